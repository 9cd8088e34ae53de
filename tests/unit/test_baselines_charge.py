"""Work stopped part-way is charged as far as it ran, in the emulated baselines' processes as
in their simulation (charge.py), and a process started again goes on with its device's draws."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from testbed.baselines import cost
from testbed.baselines.charge import (
    charge,
    heat_spans,
    ledger_path,
    ran,
    read_ledger,
    retimed_parts,
    unrun_share,
    write_stopped,
)
from testbed.baselines.stage_proc import HeldDevice
from testbed.emulator.device_model import RateDeviceModel
from testbed.topology import Topology, parse_topology

RAW: dict[str, Any] = {
    "name": "charge", "seed": 5, "network": {"switches": ["ap0"],
                                             "ps": {"switch": "ap0",
                                                    "link": {"down": "1Gbit", "up": "1Gbit"}}},
    "devices": [{"group": "phones", "profile": "snapdragon888", "count": 2, "switch": "ap0",
                 "link": {"down": "100Mbit", "up": "20Mbit"},
                 "behaviour": {"straggler": {"factor": 3, "rate": "50%"}}}],
    "job": {"model": {"hidden": 32, "layers": 2, "heads": 2, "ffn": 64, "seq_len": 16},
            "batch_size": 4, "steps": 200, "dtype": "float64",
            "parallelism": {"strategy": "pipeline", "micro_batches": 4}}}


def topology() -> Topology:
    return parse_topology(RAW)


def test_a_part_is_charged_whole_when_it_ended_and_pro_rata_while_under_way() -> None:
    parts = [(0.0, 1.0, 10.0), (1.0, 3.0, 4.0), (3.0, 4.0, 1.0)]
    assert unrun_share(1.0, 3.0, 2.5) == pytest.approx(0.25, rel=1e-12)
    assert ran(parts, 2.5) == pytest.approx((2.5, 10.0 + 3.0), rel=1e-12)
    assert ran(parts, 0.0) == (0.0, 0.0)
    assert ran(parts, 9.0) == pytest.approx((4.0, 15.0), rel=1e-12)


def test_a_ledgers_pieces_are_charged_up_to_the_kill(tmp_path: Path) -> None:
    """Each piece at its own start time and dilation; a piece begun after the kill is not
    charged (it cannot be, but a ledger read late must not invent it)."""
    ledger = tmp_path / "stage0-attempt0.work.jsonl"
    lines = [{"t0": 100.0, "dilation": 2.0, "gemms": 1,
              "parts": [[0.0, 1.0, 5.0], [1.0, 1.5, 1.0]]},
             {"t0": 103.0, "dilation": 2.0, "gemms": 0, "parts": [[0.0, 2.0, 2.0]]}]
    ledger.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"t0": 10')  # torn
    pieces = read_ledger(ledger)
    assert len(pieces) == 2
    killed = charge(pieces, 104.0)  # the second piece half a device second in: a quarter
    assert (killed.device_s, killed.energy_j) == pytest.approx((1.5 + 0.5, 6.0 + 0.5), rel=1e-12)
    assert (killed.pieces, killed.gemms) == (2, 1)
    whole = charge(pieces, None)
    assert (whole.device_s, whole.energy_j) == pytest.approx((3.5, 8.0), rel=1e-12)
    assert charge(pieces, 99.0).device_s == 0.0


def test_a_device_started_again_goes_on_with_its_draws(tmp_path: Path) -> None:
    """A restarted stage (or a returning replica) drew its straggler and noise factors from the
    seed afresh, so it repeated its first process's delays; skipping the draws its ledger
    counts, it draws what one process running on would have."""
    t = topology()
    gemms, mem = cost.stage_work(t.job.model, 2, True, "F", 1, 8)
    first_ledger = tmp_path / "first.work.jsonl"
    first = HeldDevice(t, "phones-0", 0.0, first_ledger)
    on = HeldDevice(t, "phones-0", 0.0)
    for _ in range(10):
        first.end(first.begin(gemms, mem))
        on.end(on.begin(gemms, mem))
    used = charge(read_ledger(first_ledger), None)
    assert (used.pieces, used.gemms) == (10, 10 * len(gemms))
    again = HeldDevice(t, "phones-0", 0.0)
    again.skip_draws(used.pieces, used.gemms)
    fresh = HeldDevice(t, "phones-0", 0.0)
    assert again.model._rng.getstate() == on.model._rng.getstate()  # type: ignore[attr-defined]
    assert fresh.model._rng.getstate() != on.model._rng.getstate()  # type: ignore[attr-defined]
    assert again.straggler is not None and on.straggler is not None
    assert fresh.straggler is not None
    ahead = [on.straggler.compute_factor() for _ in range(40)]
    assert [again.straggler.compute_factor() for _ in range(40)] == ahead
    assert [fresh.straggler.compute_factor() for _ in range(40)] != ahead


def test_the_device_model_idles_between_pieces_on_the_runs_clock() -> None:
    """A held device's model is timed on the run's clock (device seconds since its origin),
    so the time between pieces is idle: it cools, as the simulated device does. On its busy
    seconds alone it never idled, and a stage busy part of the time heated as if all of it."""
    t = topology()
    gemms, mem = cost.stage_work(t.job.model, 2, True, "F", 1, 8)
    D = 1e-3  # holds of microseconds
    idle_s = 600.0  # device seconds since the run's origin before this process's first piece
    held = HeldDevice(t, "phones-0", D, clock_origin=time.monotonic() - idle_s * D)
    held.end(held.begin(gemms, mem))
    tel = held.model.telemetry(held.device_time_s(time.monotonic()))
    assert tel["idle_s"] >= idle_s * 0.999
    assert 0 < tel["busy_s"] < 1.0


def test_a_device_started_again_goes_on_with_its_heat(tmp_path: Path) -> None:
    """A process started again on a device resumes from its earlier process's ledger: the
    same draws and the same thermal state at the same time on the run's clock, where a new
    process started cold (its device had been busy for minutes)."""
    t = topology()
    big = [cost.Gemm(2048, 2048, 2048, "forward")]  # about a second on the phone
    D = 1e-4
    origin = time.monotonic()
    ledger = tmp_path / "first.work.jsonl"
    first = HeldDevice(t, "phones-0", D, ledger, clock_origin=origin)
    for _ in range(150):
        first.end(first.begin(big, 0.0))
    resumed = HeldDevice(t, "phones-0", D, clock_origin=origin)
    resumed.resume([ledger])
    cold = HeldDevice(t, "phones-0", D, clock_origin=origin)
    now_s = first.device_time_s(time.monotonic())
    hot = first.model.telemetry(now_s)
    assert hot["busy_s"] > 60  # a minute of work or more: the phone has warmed
    warm = resumed.model.telemetry(now_s)
    assert warm["temperature_c"] == pytest.approx(hot["temperature_c"], rel=1e-9)
    assert cold.model.telemetry(now_s)["temperature_c"] < hot["temperature_c"] - 1.0
    rng = resumed.model._rng  # type: ignore[attr-defined]
    assert rng.getstate() == first.model._rng.getstate()  # type: ignore[attr-defined]


def test_a_stage_process_killed_mid_step_is_charged_what_ran(tmp_path: Path) -> None:
    """A one-stage pipeline's process (on this host's loopback), killed mid-run: its ledger
    charges the pieces that ran and the one under way as far as it got, which the report it
    writes at each step's end (what the row read) lacks: the aborted step's pieces."""
    topo_path = tmp_path / "t.yaml"
    topo_path.write_text(json.dumps(RAW))
    D = 400.0  # a step of device milliseconds held as a host second or so
    report = tmp_path / "stage0-attempt0.json"
    plan = {"topology": str(topo_path), "devices": ["phones-0"], "bounds": [[0, 2]],
            "micro_batches": 4, "steps": 200, "dilation": D, "ips": ["127.0.0.1"],
            "delay_s": [[0.0]], "start_step": 0, "resume_files": [], "checkpoint_every": 0,
            "ckpt_dir": str(tmp_path / "ckpt"), "progress": "", "ready_dir": "",
            "report_pattern": str(tmp_path / "stage{}-attempt0.json")}
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    proc = subprocess.Popen([sys.executable, "-m", "testbed.baselines.stage_proc", "--plan",
                             str(plan_path), "--stage", "0", "--out", str(report)],
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        deadline = time.monotonic() + 120
        while not report.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # a step done: pieces run
        time.sleep(1.3)
        killed_at = time.monotonic()
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    pieces = read_ledger(ledger_path(report))
    assert pieces, "the stage began no piece"
    charged = charge(pieces, killed_at)
    held = (killed_at - pieces[0]["t0"]) / D  # device seconds since its first piece began
    assert 0.8 * held <= charged.device_s <= held * (1 + 1e-9)
    reported = json.loads(report.read_text())
    assert reported["device_s"] < charged.device_s  # the step under way was left out
    assert charged.device_s < charge(pieces, None).device_s  # the last piece had not ended


def test_a_device_with_a_rate_model_resumes_as_any_other(tmp_path: Path) -> None:
    """A profile without a regression model gets a RateDeviceModel, which has no heat and no
    draws: its warm and skip_draws are the protocol's, and do nothing (HeldDevice called
    them behind hasattr checks)."""
    t = topology()
    gemms, mem = cost.stage_work(t.job.model, 2, True, "F", 1, 8)
    ledger = tmp_path / "first.work.jsonl"
    first = HeldDevice(t, "phones-0", 1e-4, ledger)
    first.model = RateDeviceModel(10.0)
    for _ in range(3):
        first.end(first.begin(gemms, mem))
    again = HeldDevice(t, "phones-0", 1e-4, clock_origin=first.clock_origin)
    again.model = RateDeviceModel(10.0)
    again.resume([ledger])  # skip_draws and warm on the protocol: no AttributeError
    g = gemms[0]
    cost_then = first.model.tile_cost(g.m, g.k, g.n, g.op, 0.0)
    assert again.model.tile_cost(g.m, g.k, g.n, g.op, 0.0) == cost_then
    assert again.model.telemetry(0.0) == {}


def test_a_device_started_again_heats_with_its_killed_process_only_as_far_as_it_ran(
        tmp_path: Path) -> None:
    """A process killed mid-run: the one started again on its device warmed its model with
    every piece of the ledger, the one under way at the kill and those after it whole; with
    the runner's stop (write_stopped) it heats as the pieces that ran, the one under way cut
    at the kill."""
    t = topology()
    big = [cost.Gemm(2048, 2048, 2048, "forward")] * 2  # a second or two on the phone
    D = 1e-4
    origin = time.monotonic()
    ledger = tmp_path / "first.work.jsonl"
    first = HeldDevice(t, "phones-0", D, ledger, clock_origin=origin)
    for _ in range(120):
        first.end(first.begin(big, 0.0))
    pieces = read_ledger(ledger)
    kill = pieces[80]  # killed inside its first GEMM, 40 pieces before the process ended
    gemm_s = kill["parts"][0][1]
    stop = kill["t0"] + 0.5 * gemm_s * D
    write_stopped(ledger, stop)
    ran_ledger = tmp_path / "ran.work.jsonl"  # what ran, by hand
    cut = {**kill, "parts": [[0.0, 0.5 * gemm_s, kill["parts"][0][2] / 2]]}
    ran_ledger.write_text("".join(json.dumps(p) + "\n" for p in [*pieces[:80], cut]))
    now_s = first.device_time_s(time.monotonic())
    temperature = {}
    for name, path in (("stopped", ledger), ("ran", ran_ledger)):
        again = HeldDevice(t, "phones-0", D, clock_origin=origin)
        again.resume([path])
        temperature[name] = again.model.telemetry(now_s)["temperature_c"]
    whole = first.model.telemetry(now_s)["temperature_c"]
    assert temperature["stopped"] == pytest.approx(temperature["ran"], rel=1e-9)
    assert temperature["stopped"] < whole - 0.05  # 40 pieces of heat not run


def test_heat_spans_follow_a_re_timed_piece_and_stop_at_the_kill() -> None:
    """A slow x3 at 0.75 s splits the piece's second GEMM there: its GEMMs ran [0, 0.5),
    [0.5, 0.75) and [0.75, 1.5) (the memory-bound part after them heats nothing); a kill at
    1 s cuts the last one."""
    parts = [(0.0, 0.5, 2.5), (0.5, 1.0, 2.5), (1.0, 1.5, 1.0)]
    became = retimed_parts(parts, 0.75, 3.0)
    pieces = [{"t0": 10.0, "dilation": 1.0, "gemms": 2, "parts": [list(p) for p in parts]},
              {"t0": 10.0, "dilation": 1.0, "retimed": True,
               "gemm_parts": sum(len(b) for b in became[:2]),
               "parts": [list(p) for b in became for p in b]}]
    def flat(spans: list[tuple[float, float, float]]) -> list[float]:
        return [x for span in spans for x in span]
    assert flat(heat_spans(pieces, None)) == pytest.approx(
        [10.0, 0.0, 0.5, 10.0, 0.5, 0.25, 10.0, 0.75, 0.75], rel=1e-12)
    assert flat(heat_spans(pieces, 11.0)) == pytest.approx(
        [10.0, 0.0, 0.5, 10.0, 0.5, 0.25, 10.0, 0.75, 0.25], rel=1e-12)
    assert flat(heat_spans(pieces, 10.25)) == pytest.approx([10.0, 0.0, 0.25], rel=1e-12)


def test_a_rewindable_device_forgets_the_heat_no_rewind_reaches() -> None:
    """Its list of tiles grew with every step of a baseline's simulation (2,160 a device after
    20 hotcarbon pipeline steps); settle(t) keeps only what ends after t, and a rewind from t
    then leaves the temperature a rewind with the whole list left."""
    from testbed.emulator.device_model import EmulatedDevice, device_model_for
    from testbed.perf_model.profiles import load_profile

    profile = load_profile("snapdragon888")

    def heated() -> tuple[EmulatedDevice, float]:
        dev = device_model_for(profile, seed=1, noise=False, rewindable=True)
        assert isinstance(dev, EmulatedDevice) and dev.thermal is not None
        t = 0.0
        for _ in range(50):
            t += dev.tile_cost(512, 768, 768, "forward", t).seconds
        return dev, t

    whole, end_s = heated()
    whole.rewind(end_s / 2, [])
    settled, _ = heated()
    settled.settle(end_s / 2)
    assert 0 < len(settled._heat) < 50
    settled.rewind(end_s / 2, [])
    assert whole.thermal is not None and settled.thermal is not None
    assert settled.thermal.temperature_c == whole.thermal.temperature_c
    assert settled.thermal.temperature_c < heated()[0].thermal.temperature_c  # type: ignore[union-attr]
