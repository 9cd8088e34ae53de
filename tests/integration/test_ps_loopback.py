"""The spine end to end on loopback: a real PS process, real agent processes, real gRPC.

Parity is the first correctness property of the whole system (DESIGN.md §2): the losses and
final weights of a run through devices equal those of the same model trained in one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from testbed.runlog import read_jsonl, write_json_atomic
from tests.conftest import (
    REPO,
    catches,
    cli_argv,
    killed_at_exit,
    read_status,
    reference_losses,
    run_dir_of,
    start_up,
    tiny_topology,
    wait_for,
)
from tests.fakes.adb_phones import agent_phone
from tests.fakes.fake_adb import FakeAdbServer

pytestmark = pytest.mark.integration
PHONE_SERIAL = "SIGINTPHONE1"
PHONE_NAME = "adb-sigintphone1"  # device_name(PHONE_SERIAL)


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    assert checkpoints, "the PS wrote no final checkpoint"
    return torch.load(checkpoints[-1], weights_only=True)["model"]


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _run(topology: Path, out: Path, timeout_s: float = 240) -> tuple[int, Path, str]:
    proc = start_up(topology, out)
    output, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, run_dir_of(out), output


@pytest.mark.slow
def test_float64_parity_losses_and_weights(tmp_path: Path) -> None:
    topology = tiny_topology(tmp_path, dtype="float64", steps=5)
    code, run_dir, output = _run(topology, tmp_path / "runs")
    assert code == 0, output
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]
    assert all(s["tiles"] > 0 for s in steps)  # the GEMMs really went to devices
    want_losses, want_weights = reference_losses(topology, 5)
    for got, want in zip([s["loss"] for s in steps], want_losses):
        assert _relative(got, want) <= 1e-8, (got, want)
    got_weights = _final_weights(run_dir)
    assert got_weights.keys() == want_weights.keys()
    # Relative to the whole model's scale: a tensor whose exact gradient is zero (the attention
    # key bias: softmax ignores a constant added to every score) holds only rounding noise of
    # ~1e-15, which no relative comparison of its own can judge.
    scale = max(w.abs().max().item() for w in want_weights.values())
    for name, want in want_weights.items():
        diff = (got_weights[name] - want).abs().max().item()
        assert diff <= 1e-8 * scale, (name, diff)
    got_all = torch.cat([got_weights[n].flatten() for n in want_weights])
    want_all = torch.cat([w.flatten() for w in want_weights.values()])
    assert ((got_all - want_all).norm() / want_all.norm()).item() <= 1e-8
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "done" and summary["exit_code"] == 0
    devices = {d["device"] for d in summary["devices"]}
    assert devices == {"phones-0", "phones-1", "phones-2", "laptops-0"}
    # the run's energy is the power model's sum over its tiles (and idle time and radio bytes)
    energy = summary["energy"]["total"]
    # steps.jsonl rounds each step's joules to 1e-6 J
    assert energy["compute_j"] == pytest.approx(sum(s["energy_j"] for s in steps),
                                                abs=1e-6 * len(steps))
    assert energy["compute_j"] > 0 and energy["idle_j"] > 0 and energy["radio_j"] > 0
    assert energy["total_j"] == pytest.approx(
        energy["compute_j"] + energy["idle_j"] + energy["radio_j"])
    for name in ("topology.yaml", "events.jsonl", "devices.jsonl", "status.json"):
        assert (run_dir / name).exists(), name


@pytest.mark.slow
def test_float32_parity_losses(tmp_path: Path) -> None:
    topology = tiny_topology(tmp_path, dtype="float32", steps=5)
    code, run_dir, output = _run(topology, tmp_path / "runs")
    assert code == 0, output
    got = [s["loss"] for s in read_jsonl(run_dir / "steps.jsonl")]
    want, _ = reference_losses(topology, 5)
    assert len(got) == 5
    for g, w in zip(got, want):
        assert _relative(g, w) <= 1e-5, (g, w)


@pytest.mark.slow
def test_device_killed_mid_step_costs_only_its_tiles(tmp_path: Path) -> None:
    # Far more steps than the test needs: the run cannot end before the victim holds a slowed
    # tile on any machine, however fast. Once the departure is handled and two more steps are
    # done, the test stops the run itself (SIGINT) and judges the steps that were done.
    steps_total = 10_000
    topology = tiny_topology(tmp_path, dtype="float64", steps=steps_total, time_dilation=2)
    out = tmp_path / "runs"
    proc = start_up(topology, out)
    victim = "phones-1"
    with killed_at_exit(proc):
        run_dir = run_dir_of(out)
        wait_for(lambda: read_status(run_dir).get("step", 0) >= 1, 120, "step 1")
        # slow the victim a hundred-thousandfold (the churn `slow` control file): the next tile it
        # starts is then held for seconds, so it is surely in flight when the victim is killed
        write_json_atomic(run_dir / "agents" / f"{victim}.slow", {"slow": 1e5})

        def held() -> set[int]:
            status = read_status(run_dir)
            return {task for d in status.get("devices", [])
                    if d["device"] == victim and d.get("state") != "left"
                    for task, _ in d.get("outstanding", [])}

        def holds_a_slowed_tile() -> bool:  # the same tile still held a second later
            first = held()
            time.sleep(1.0)
            return bool(first & held())
        wait_for(holds_a_slowed_tile, 120, "the victim to hold a slowed tile")
        pids = json.loads((run_dir / "pids.json").read_text())
        os.kill(pids["agents"][victim], signal.SIGKILL)
        killed_at = read_status(run_dir).get("step", 0)
        wait_for(lambda: read_status(run_dir).get("step", 0) >= killed_at + 2, 180,
                 "two steps after the kill")
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert len(steps) >= killed_at + 2
    want, _ = reference_losses(topology, len(steps))
    assert all(_relative(s["loss"], w) <= 1e-8 for s, w in zip(steps, want))
    departures = [e for e in read_jsonl(run_dir / "events.jsonl")
                  if e["event"] in ("disconnect", "lease_expired") and e["device"] == victim]
    assert len(departures) == 1, "the departure was not recorded (once)"
    gone = departures[0]
    # it held a tile when killed: still in flight, or already beaten by a backup copy (then that
    # losing copy no longer counts as in flight, see docs/fault-tolerance.md)
    assert gone["in_flight"] + gone["cancelled"] >= 1
    # every tile it held is accounted for: re-queued, or already covered by a backup copy
    assert gone["requeued_tiles"] == len(gone["requeued"])
    assert gone["requeued_tiles"] + gone["backed_up"] + gone["done_elsewhere"] == \
        gone["in_flight"]
    assert {r["task"] for r in gone["requeued"]} <= set(gone["in_flight_tasks"])
    # only the tiles it had in flight were computed again
    assert sum(s["recomputed_tiles"] for s in steps) <= gone["in_flight"]


@pytest.mark.parametrize("terminal", [False, True], ids=["kill -INT", "Ctrl-C"])
def test_sigint_stops_everything(tmp_path: Path, terminal: bool) -> None:
    """SIGINT to `testbed up`, or to its whole process group as a terminal's Ctrl-C sends it
    (the PS and every agent get it too). A phone over adb takes part (the fake adb server's,
    its agent a process of this test's, out of reach of the group's SIGINT as a phone's is):
    stopping the run is no churn for it either."""
    adb_server = FakeAdbServer().start()
    try:
        phone = adb_server.plug(agent_phone(PHONE_SERIAL, tmp_path / "phone",
                                            tmp_path / "phone-logs",
                                            env={"OPENBLAS_NUM_THREADS": "1"}))
        _interrupt_and_check(tmp_path, terminal, adb={
            "enabled": True, "server": f"127.0.0.1:{adb_server.port}",
            "link": {"down": "1Gbit", "up": "1Gbit"}})
        assert phone.processes and all(p.poll() is not None for p in phone.processes)
    finally:
        adb_server.stop()  # also ends every local process the phone's shell started


def _interrupt_and_check(tmp_path: Path, terminal: bool, adb: dict[str, Any]) -> None:
    topology = tiny_topology(tmp_path, steps=200, time_dilation=2, adb=adb)
    out = tmp_path / "runs"
    # its own session: the group's SIGINT reaches nothing of this test's
    proc = subprocess.Popen(cli_argv("up", str(topology), "--no-live", "--out", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, start_new_session=True)
    with killed_at_exit(proc):
        run_dir = run_dir_of(out)
        wait_for(lambda: read_status(run_dir).get("step", 0) >= 1, 120, "training to start")
        wait_for(lambda: any(d["device"] == PHONE_NAME and d.get("tiles_done", 0) > 0
                             for d in read_status(run_dir).get("devices", [])), 60,
                 f"{PHONE_NAME} to compute tiles")  # the phone takes part
        pids = json.loads((run_dir / "pids.json").read_text())
        wait_for(lambda: catches(proc.pid, signal.SIGINT), 30, "testbed up's handler")
        if terminal:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    children = [pids["ps"], *pids["agents"].values()]
    alive = [p for p in children if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"orphans: {alive}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "interrupted" and summary["exit_code"] == 130
    # stopping the run is no churn: the agents were told by the PS, not counted as leaving
    # (every agent's SIGTERM was a departure, its tiles re-queued, every device drawn departed)
    leaves = [e for e in read_jsonl(run_dir / "events.jsonl")
              if e["event"] in ("leave", "disconnect", "lease_expired")]
    assert not leaves, leaves
    assert summary["departures"] == 0 and summary["requeued_tiles"] == 0, summary
    # its last line gives the figures `testbed simulate`'s gives: device time, efficiency, energy
    assert f"interrupted: {summary['steps_done']} step" in output, output
    assert f", {summary['device_time_s']:.3f} s device time, efficiency " \
           f"{summary['efficiency']:.2f}, energy {summary['energy']['total']['total_j']:.1f} J; " \
           f"run directory {run_dir}" in output, output[-1500:]


def test_agent_with_wrong_token_is_refused(tmp_path: Path) -> None:
    import numpy as np

    from testbed.ps_backend.core import PsConfig
    from testbed.ps_backend.host import PsServer

    server = PsServer(PsConfig(token="right", run_name="t", dtype=np.dtype("float64"),
                               tile_m=8, tile_n=8, min_offload_flops=0)).start()
    try:
        env = dict(os.environ, TESTBED_TOKEN="wrong")
        done = subprocess.run([sys.executable, "-m", "testbed.agent", "--ps",
                                                   f"127.0.0.1:{server.port}", "--name", "x"],
                              env=env, capture_output=True, text=True, timeout=60)
    finally:
        server.stop()
    assert done.returncode == 3
    assert "wrong join token" in done.stdout + done.stderr
