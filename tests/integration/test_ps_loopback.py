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
from pathlib import Path

import psutil
import pytest
import torch

from testbed.runlog import read_jsonl
from tests.conftest import (read_status, reference_losses, run_dir_of, start_up,
                            tiny_topology, wait_for)

pytestmark = pytest.mark.integration


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
    # slow links and dilation stretch each step to seconds so the kill lands inside one
    topology = tiny_topology(tmp_path, dtype="float64", steps=4, time_dilation=4)
    out = tmp_path / "runs"
    proc = start_up(topology, out)
    try:
        run_dir = run_dir_of(out)
        busy = wait_for(lambda: [d for d in read_status(run_dir).get("devices", [])
                                 if d.get("in_flight", 0) > 0 and d["device"] != "laptops-0"]
                        if read_status(run_dir).get("step", 0) >= 1 else None,
                        120, "a busy phone in step 1")
        victim = busy[0]["device"]
        pids = json.loads((run_dir / "pids.json").read_text())
        os.kill(pids["agents"][victim], signal.SIGKILL)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    steps = read_jsonl(run_dir / "steps.jsonl")
    want, _ = reference_losses(topology, 4)
    assert [round(s["loss"], 12) for s in steps] == [round(w, 12) for w in want] or all(
        _relative(s["loss"], w) <= 1e-8 for s, w in zip(steps, want))
    departures = [e for e in read_jsonl(run_dir / "events.jsonl")
                  if e["event"] in ("disconnect", "lease_expired") and e["device"] == victim]
    assert departures, "the departure was not recorded"
    assert departures[0]["requeued_tiles"] == len(departures[0]["requeued"]) >= 1
    assert sum(s["requeued_tiles"] for s in steps) >= departures[0]["requeued_tiles"]
    # only its in-flight tiles were computed again
    assert sum(s["recomputed_tiles"] for s in steps) <= departures[0]["requeued_tiles"]


def test_sigint_stops_everything(tmp_path: Path) -> None:
    topology = tiny_topology(tmp_path, steps=200, time_dilation=2)
    out = tmp_path / "runs"
    proc = start_up(topology, out)
    run_dir = run_dir_of(out)
    wait_for(lambda: read_status(run_dir).get("step", 0) >= 1, 120, "training to start")
    pids = json.loads((run_dir / "pids.json").read_text())
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    children = [pids["ps"], *pids["agents"].values()]
    alive = [p for p in children if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"orphans: {alive}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "interrupted" and summary["exit_code"] == 130


def test_agent_with_wrong_token_is_refused(tmp_path: Path) -> None:
    import numpy as np

    from testbed.ps_backend.server import PsConfig, PsServer

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
