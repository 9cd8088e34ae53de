"""Adaptive time dilation with real agent processes and a real PS.

* the probe picks a larger D on a host made slow on purpose (every agent pinned to one core
  that CPU burners we start also occupy) than on the same host left alone;
* in a run, D changes only between steps, and each step's device time (wall / D of that step)
  stays the same job's device time whatever D is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from testbed.emulator.network.probe import probe
from testbed.ps_backend.main import run_probe
from testbed.runlog import read_jsonl
from tests.conftest import run_dir_of, start_up, tiny_topology

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def _bench() -> object:
    spec = importlib.util.spec_from_file_location("emulation_fidelity",
                                                  REPO / "bench" / "emulation_fidelity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def _probe(agents: int, cores: set[int] | None) -> tuple[float, list[dict]]:
    bench = _bench()
    # tiles of ~13 ms of model time (256 x 2048 x 256 on a Snapdragon 888), so that the host's
    # millisecond scheduling jitter does not decide the choice: a host made slow must need more
    job = SimpleNamespace(parallelism=SimpleNamespace(tile_m=256, tile_n=256),
                          model=SimpleNamespace(hidden=2048), dtype="float32")
    with bench.PsHarness(1.0, tile=256) as ps:  # type: ignore[attr-defined]
        for i in range(agents):
            ps.spawn(f"emu-{i}", "emulated", "snapdragon888", seed=i, cores=cores)
        ps.wait_joined(agents)
        # a 10% target: the probe raises D only while the tiles' lateness can move the
        # round's device time by more than the target. With 3 agents, in the judged rounds at
        # D = 1 the idle host's lateness moved it by 0.03-7.0 % and the slowed host's (eight
        # burners) by 17.4-41.5 % (8 idle and 5 slowed one-off runs of _probe on 2026-11-28;
        # 0.4-2.7 % and, with four burners, 16.8-22.2 % in earlier ones; with four, 10.2-25.5 %
        # that day): 1.4 times under the target and 1.7 times over it at the closest. (With 6
        # agents the idle host was itself near its two cores' capacity at D = 1.) 5 rounds, so
        # that on a host others load heavily both probes still get to D that meet it
        return run_probe(ps.server, ps.executor, job, agents, 1.0, 0.10, seed=0, rounds=5)


def _busy_share(window_s: float = 0.5) -> float:
    """The share of the host's CPU time spent busy over ``window_s`` (/proc/stat)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            jiffies = [int(x) for x in f.readline().split()[1:]]
        return sum(jiffies), jiffies[3] + jiffies[4]  # total; idle + iowait
    total0, idle0 = sample()
    time.sleep(window_s)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def _wait_until_quiet(most_s: float = 30.0, busy: float = 0.1) -> None:
    """Wait (at most ``most_s``) until two windows in a row find the host at most ``busy``:
    the idle probe is meant to measure the host left alone, and in a full suite the
    processes of the test before may still be winding down (a CI run's idle probe once chose
    D = 8, as the slowed host did, its D = 1 rounds 32 % late at p95)."""
    deadline = time.monotonic() + most_s
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        quiet = quiet + 1 if _busy_share() <= busy else 0


def test_probe_picks_a_larger_dilation_on_a_host_made_slow() -> None:
    cores = sorted(os.sched_getaffinity(0))
    # the host left alone, probed twice: what else runs can only make tiles late and raise D,
    # never lower it, so the smaller choice is the idle host's (in one full suite run an idle
    # probe (then at a 6 % target) chose D = 8, the one-round cap, as the slowed host does;
    # one of 8 one-off idle probes chose 7.7)
    probes = []
    for _ in range(2):
        _wait_until_quiet()
        probes.append(_probe(3, None))
    idle_d, idle = min(probes, key=lambda p: p[0])
    # eight burners on the agents' one core: the agents there get a small share of a core
    # while the host's other work is spread over all cores (the agents hold at real-time
    # priority, so only their compute, not their wake-ups, feels the burners)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                preexec_fn=lambda: os.sched_setaffinity(0, {cores[0]}))
               for _ in range(8)]
    try:
        # probed twice as well, the larger choice kept: a quiet spell can only lower a probe's
        # D (a CI run's one slowed probe stayed at D = 1 on 2026-11-29: its tiles late by
        # 101-175 % at p95, so by the rule their lateness moved no round by 10 %)
        slow_d, slow = max((_probe(3, {cores[0]}) for _ in range(2)), key=lambda p: p[0])
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert idle and slow and all(r["tiles"] > 0 for r in idle + slow)
    # (the first round at D = 1 is cold on both hosts; the choice is what must differ)
    assert slow_d > idle_d, (idle_d, idle, slow_d, slow)


def _run(tmp_path: Path, name: str, dilation: object, steps: int) -> Path:
    topology = tiny_topology(tmp_path, name=name, steps=steps, time_dilation=dilation)
    out = tmp_path / f"runs-{name}"
    proc = start_up(topology, out)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    return run_dir_of(out)


def test_adaptive_d_changes_only_between_steps_and_device_time_holds(tmp_path: Path) -> None:
    # a 0.2% target: the tiny job's tiles (model time ~ microseconds) miss by far at D = 1,
    # and their lateness is a few percent of a step, so the probe raises D, and the
    # controller raises it again after step 0 (up to 8 times a decision)
    # (2 steps: each takes D x ~8 ms, and D may grow eight-fold a step; with 3 steps, D went
    # 8, 64, 512 in an 18-s run of this test alone, and one run in the suite took 71 s)
    run_dir = _run(tmp_path, "adaptive", {"target_p95": "0.2%"}, 2)
    steps = read_jsonl(run_dir / "steps.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    probe = [e for e in events if e["event"] == "dilation_probe"]
    assert len(probe) == 1 and probe[0]["chosen"] > 1
    assert steps[0]["time_dilation"] == pytest.approx(probe[0]["chosen"], rel=1e-4)
    changes = {e["step"]: e for e in events if e["event"] == "dilation_change"}
    for prev, cur in zip(steps, steps[1:]):
        if cur["step"] in changes:  # a change is announced after one step, before the next
            assert changes[cur["step"]]["old"] == pytest.approx(prev["time_dilation"], rel=1e-4)
            assert changes[cur["step"]]["new"] == pytest.approx(cur["time_dilation"], rel=1e-4)
        else:
            assert cur["time_dilation"] == prev["time_dilation"]
    for s in steps:  # one D per step: device time is that step's wall / D
        assert s["device_time_s"] == pytest.approx(s["wall_s"] / s["time_dilation"], rel=1e-4,
                                                   abs=1e-6)
        assert s["emulated_tiles"] == s["tiles"] and s["tile_error_p95"] is not None
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tile_error_p95"] is not None and summary["dilation_target_p95"] == 0.002
    assert all(r["late_share"] is not None for r in probe[0]["rounds"])


@pytest.mark.skipif(bool(probe().missing()), reason="Mininet backend unavailable, missing: "
                    + "; ".join(probe().missing()))
def test_on_mininet_the_kernels_links_follow_every_new_d_before_the_next_step(
        tmp_path: Path) -> None:
    topology = tiny_topology(tmp_path, name="adaptive-mn", steps=3,
                             time_dilation={"target_p95": "10%"})
    raw = yaml.safe_load(topology.read_text())
    raw["network"] = {"backend": "mininet"}
    topology.write_text(yaml.safe_dump(raw))
    out = tmp_path / "runs"
    proc = start_up(topology, out)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    events = read_jsonl(run_dir_of(out) / "events.jsonl")
    steps = read_jsonl(run_dir_of(out) / "steps.jsonl")
    asked = [e for e in events if e["event"] in ("dilation_probe", "dilation_change")]
    moved = [e for e in events if e["event"] == "links_dilation"]
    assert asked and len(moved) == len(asked), (asked, moved)
    for ask, move in zip(asked, moved):
        new = ask.get("chosen", ask.get("new"))
        assert move["new"] == pytest.approx(new, rel=1e-4) and move["backend"] == "mininet"
        # the PS waited for the links: they moved before the step at the new D began (a
        # change is made only when a step follows; the probe's comes before step 0)
        first = next(s for s in steps if s["step"] == ask.get("step", 0))
        assert first["time_dilation"] == pytest.approx(new, rel=1e-4), (ask, first)
        assert move["t"] <= first["t"] - first["wall_s"] + 0.05, (move, first)


def test_device_time_per_step_is_the_same_at_different_fixed_d(tmp_path: Path) -> None:
    # The tiny job's step is ~8 ms of device time (71 tiles of ~1 us model time plus the
    # PS's share); at D = 200 and D = 800 the host's overhead is a small part of the wall time
    # (at D 300 and 1200 one run's steps 1-2 differed by 7-8 %: the host's overhead was about 10 %
    # of the device time at D 300, so about 15 % at D 200 and 4 % at D 800)
    low = read_jsonl(_run(tmp_path, "d200", 200, 3) / "steps.jsonl")
    high = read_jsonl(_run(tmp_path, "d800", 800, 3) / "steps.jsonl")
    for a, b in zip(low[1:], high[1:]):  # step 0 includes the devices' first operand fetches
        assert a["time_dilation"] == 200 and b["time_dilation"] == 800
        # tolerance: 35% of the device time, for a loaded 2-core host
        assert b["device_time_s"] == pytest.approx(a["device_time_s"], rel=0.35), (a, b)
