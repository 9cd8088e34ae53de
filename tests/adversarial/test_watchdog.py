"""The progress watchdog: a run that cannot go on fails (exit 1) and says why; the summary keeps
the steps really done. A device that heartbeats but never returns its tiles costs a backup, not
a stalled step."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from testbed.ps_backend.core import PsConfig
from testbed.ps_backend.executor import DivergedError, TileExecutor
from testbed.ps_backend.host import PsServer
from testbed.ps_backend.scheduler import GemmSpec
from testbed.runlog import read_jsonl
from testbed.wire import testbed_pb2 as pb
from testbed.wire.tensors import to_tensor
from tests.adversarial.psproc import PsProcess, Rogue, device_cache, job_topology, tile_operands
from tests.conftest import tiny_topology, wait_for

pytestmark = pytest.mark.integration


def _failed_with(ps: PsProcess, words: str, timeout_s: float = 90) -> dict:
    code, output = ps.finish(timeout_s)
    assert code == 1, output
    summary = ps.summary()
    assert summary["state"] == "failed" and words in summary["error"], summary["error"]
    assert words in output
    assert summary["steps_done"] == len(read_jsonl(ps.run_dir / "steps.jsonl"))
    return summary


def test_no_device_ever_attached_fails_the_run(tmp_path: Path) -> None:
    topology = tiny_topology(tmp_path, steps=3)
    with PsProcess(topology, tmp_path / "run", "--expect-devices", "1", "--join-timeout-s",
                   "1", "--no-progress-s", "3") as ps:
        started = time.monotonic()
        summary = _failed_with(ps, "no device attached")
        assert time.monotonic() - started < 60
        assert summary["steps_done"] == 0


def test_the_last_device_gone_fails_the_run_and_keeps_the_steps_done(tmp_path: Path) -> None:
    topology = tiny_topology(tmp_path, steps=1000)
    with PsProcess(topology, tmp_path / "run", "--expect-devices", "1",
                   "--no-progress-s", "3") as ps:
        agent = ps.agent("only-0")
        wait_for(lambda: ps.status().get("step", 0) >= 2, 120, "two steps")
        agent.kill()
        summary = _failed_with(ps, "no device attached")
        assert summary["steps_done"] >= 2  # never "0 steps" after steps were done


def _silent_rogue(ps: PsProcess, answer: str,
                  name: str = "rogue") -> tuple[Rogue, threading.Thread]:
    """A rogue that attaches and heartbeats; it never answers (silent) or answers wrongly."""
    rogue = Rogue(ps.address, name=name, gflops=1000, window=4)
    rogue.join()
    responses = rogue.attach()
    cache = device_cache()

    def serve() -> None:
        try:
            for message in responses:
                for tile in message.tiles:
                    a, b = tile_operands(tile, cache)
                    if answer == "garbage":
                        c = a @ b + 1.0
                        rogue.send(pb.DeviceMessage(result=pb.TileResult(
                            task_id=tile.task_id, attempt=tile.attempt, c=to_tensor(c))))
        except grpc.RpcError:
            pass  # its stream ends with the run (or when the PS drops it)

    def beat() -> None:
        while rogue.outbox is not None and thread.is_alive():
            rogue.send(pb.DeviceMessage(heartbeat=pb.Heartbeat(device_time_s=time.monotonic())))
            time.sleep(0.5)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    threading.Thread(target=beat, daemon=True).start()
    return rogue, thread


def test_a_device_that_never_returns_tiles_fails_the_run_alone(tmp_path: Path) -> None:
    topology = tiny_topology(tmp_path, steps=3)
    with PsProcess(topology, tmp_path / "run", "--expect-devices", "1",
                   "--no-progress-s", "4") as ps:
        rogue, _ = _silent_rogue(ps, "silent")
        _failed_with(ps, "no tile accepted")
        rogue.close()


def test_every_device_quarantined_fails_the_run(tmp_path: Path) -> None:
    topology = job_topology(tmp_path, steps=3, validation={"enabled": True,
                                                            "quarantine_after": 1})
    with PsProcess(topology, tmp_path / "run", "--expect-devices", "1",
                   "--no-progress-s", "4") as ps:
        rogue, _ = _silent_rogue(ps, "garbage")
        _failed_with(ps, "every attached device is quarantined")
        rogue.close()


def test_a_device_that_heartbeats_but_never_returns_does_not_stall_the_step(
        tmp_path: Path) -> None:
    steps = 2
    topology = tiny_topology(tmp_path, steps=steps)
    with PsProcess(topology, tmp_path / "run", "--expect-devices", "2",
                   "--no-progress-s", "60") as ps:
        rogue, _ = _silent_rogue(ps, "silent")  # claims 1000 GFLOP/s: it gets tiles first
        ps.agent("honest-0")
        started = time.monotonic()
        code, output = ps.finish(120)
        assert code == 0, output
        # the rogue's tiles were backed up within seconds, not after a 40 s stall (or never)
        assert time.monotonic() - started < 60
        summary = ps.summary()
        assert summary["backups"] >= 1 and summary["backup_wins"] >= 1
        rogue.close()
    ps.assert_losses_match(steps)


def test_an_infinite_learning_rate_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """``lr: .inf`` once quarantined honest devices and hung; now the topology refuses it."""
    topology = tiny_topology(tmp_path, steps=5, optimizer={"name": "adamw", "lr": float("inf")})
    out = subprocess.run([sys.executable, "-m", "testbed.cli", "up", str(topology), "--no-live",
                          "--out", str(tmp_path / "runs")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert "job.optimizer.lr" in out.stderr and "finite" in out.stderr
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_the_ps_refuses_to_offload_a_diverged_gemm() -> None:
    """Defence in depth: should a model diverge anyway, the PS fails the GEMM with a message
    instead of sending non-finite operands that every honest device would be refused for."""
    config = PsConfig(token="t", run_name="diverged", dtype=np.dtype("float32"), tile_m=16,
                      tile_n=16, min_offload_flops=0.0)
    server = PsServer(config).start()
    try:
        executor = TileExecutor(server)
        for bad in (float("nan"), float("inf"), -float("inf")):
            for operand in (0, 1):  # A, then B (a weight's transpose, as forward passes it)
                a, w = torch.ones(32, 16), torch.ones(32, 16)
                (a if operand == 0 else w)[3, 5] = bad
                with pytest.raises(DivergedError, match="non-finite.*job.optimizer.lr"):
                    executor.submit(a, w.t(), GemmSpec("l", "forward", 0))
        assert server.call(lambda: len(server.core.scheduler.pending)) == 0  # nothing queued
    finally:
        server.stop()
