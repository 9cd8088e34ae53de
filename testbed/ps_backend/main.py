"""The PS process: ``python -m testbed.ps_backend --topology T --run-dir D``.

Starts the gRPC server, writes ``ps.json`` (address, pid) once it listens, waits for the
expected devices (up to ``--join-timeout-s``), trains the job's steps through the tile executor,
writes ``steps.jsonl``, ``devices.jsonl``, ``status.json`` and ``summary.json``, tells every device
to stop and exits 0. SIGTERM or SIGINT ends it between (or inside) steps with exit code 1 and a
summary marked ``interrupted``. The join token comes from the environment (``TESTBED_TOKEN``), not
the command line, so that process listings do not show it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from testbed.ps_backend.server import PsConfig, PsServer, TileExecutor
from testbed.runlog import RunLog, write_json_atomic
from testbed.topology import Topology, TopologyError, load_topology

log = logging.getLogger("testbed.ps")

STATUS_PERIOD_S = 0.5
DEVICE_SAMPLE_PERIOD_S = 2.0


def max_message_bytes(tile_m: int, tile_n: int) -> int:
    """Largest device message the PS accepts: one float64 result tile, with room to spare."""
    return 4 * tile_m * tile_n * 8 + 64 * 1024


class StatusWriter:
    """Writes status.json (for the live view) and periodic devices.jsonl samples."""

    def __init__(self, run_dir: Path, server: PsServer, runlog: RunLog, steps: int):
        self.path = run_dir / "status.json"
        self.server = server
        self.runlog = runlog
        self.fields: dict[str, Any] = {"state": "starting", "step": 0, "steps": steps,
                                       "loss": None, "losses": []}
        self._last_write = self._last_sample = 0.0
        self._last_tiles = 0
        self._last_tiles_s = time.monotonic()
        self.tiles_per_s = 0.0

    def tick(self, force: bool = False) -> None:
        """On the loop thread: refresh the snapshot when due."""
        now = time.monotonic()
        if not force and now - self._last_write < STATUS_PERIOD_S:
            return
        core = self.server.core
        assert core is not None
        totals = core.totals
        dt = now - self._last_tiles_s
        if dt > 0:
            self.tiles_per_s = (totals.tiles - self._last_tiles) / dt
        self._last_tiles, self._last_tiles_s, self._last_write = totals.tiles, now, now
        devices = core.device_records() + [dict(d) for d in core.departed]
        write_json_atomic(self.path, {
            **self.fields, "tiles": totals.tiles, "tiles_per_s": round(self.tiles_per_s, 2),
            "bytes_down": totals.bytes_down, "bytes_up": totals.bytes_up,
            "requeued": totals.requeued, "rejected": totals.rejected,
            "pending": len(core.scheduler.pending), "devices": devices})
        if force or now - self._last_sample >= DEVICE_SAMPLE_PERIOD_S:
            self._last_sample = now
            for record in core.device_records():
                self.runlog.device(**record)


def _wait_for_devices(server: PsServer, expected: int, timeout_s: float,
                      stop: threading.Event) -> int:
    deadline = time.monotonic() + timeout_s
    core = server.core
    assert core is not None
    while not stop.is_set() and time.monotonic() < deadline:
        joined = len(core.conns)
        if joined >= expected:
            return joined
        time.sleep(0.05)
    return len(core.conns)


def run_ps(topology: Topology, run_dir: Path, listen: str, token: str, expected_devices: int,
           join_timeout_s: float, dilation: float, stop: threading.Event) -> int:
    """Train the topology's job with devices; return the process exit code."""
    job = topology.job
    from testbed.ps_backend.engine.trainer import Trainer  # torch-heavy: import after args

    runlog = RunLog(run_dir)
    config = PsConfig(token=token, run_name=run_dir.name, dtype=np.dtype(job.dtype),
                      tile_m=job.parallelism.tile_m, tile_n=job.parallelism.tile_n,
                      min_offload_flops=job.parallelism.min_offload_flops,
                      max_message_bytes=max_message_bytes(job.parallelism.tile_m,
                                                          job.parallelism.tile_n),
                      time_dilation=dilation)
    server = PsServer(config, runlog, listen).start()
    executor = TileExecutor(server, interrupted=stop)  # a signal also ends a GEMM's wait
    status = StatusWriter(run_dir, server, runlog, job.steps)
    server.every_tick(status.tick)
    host = listen.rsplit(":", 1)[0]
    write_json_atomic(run_dir / "ps.json", {"host": host, "port": server.port, "pid": os.getpid()})
    log.info("PS listening on %s:%d; waiting for %d device(s)", host, server.port,
             expected_devices)
    runlog.event("ps_start", address=f"{host}:{server.port}", expected_devices=expected_devices,
                 time_dilation=dilation)
    trainer = Trainer(job, topology.seed, executor)
    started = time.monotonic()
    state, code, losses = "done", 0, []
    try:
        status.fields["state"] = "waiting for devices"
        joined = _wait_for_devices(server, expected_devices, join_timeout_s, stop)
        runlog.event("training_start", devices=joined, expected_devices=expected_devices)
        status.fields["state"] = "training"
        stop.wait(0)  # a SIGTERM during the wait ends here
        if stop.is_set():
            raise InterruptedError
        for _ in range(job.steps):
            step_start = time.monotonic()
            result = trainer.step()
            wall_s = time.monotonic() - step_start
            stats = server.call(server.core.take_step_stats)  # type: ignore[union-attr]
            losses.append(result.loss)
            runlog.step(step=result.step, loss=result.loss, wall_s=round(wall_s, 6),
                        device_time_s=round(wall_s / dilation, 6), tiles=stats.tiles,
                        recomputed_tiles=stats.recomputed, requeued_tiles=stats.requeued,
                        rejected=stats.rejected, late=stats.late, bytes_down=stats.bytes_down,
                        bytes_up=stats.bytes_up, gemms=result.gemms,
                        gemms_local=executor.local_gemms, max_lag_s=round(stats.lag_s_max, 6),
                        device_compute_s=round(stats.device_compute_s, 6),
                        energy_j=round(stats.energy_j, 6))
            executor.local_gemms = 0
            status.fields.update(step=result.step + 1, loss=result.loss, losses=losses[-200:])
            log.info("step %d loss %.4f (%.2f s, %d tiles)", result.step, result.loss, wall_s,
                     stats.tiles)
            if stop.is_set():
                raise InterruptedError
        from testbed.ps_backend.engine.checkpoint import checkpoint_name, save_checkpoint
        save_checkpoint(trainer, run_dir / "checkpoints" / checkpoint_name(trainer.next_step))
    except InterruptedError:
        state, code = "interrupted", 1
        log.warning("interrupted; stopping devices")
    except Exception as exc:
        state, code = "failed", 1
        log.exception("training failed")
        runlog.event("ps_failed", error=repr(exc))
    finally:
        status.fields["state"] = state
        server.call(lambda: status.tick(force=True))
        core = server.core
        assert core is not None
        totals = core.totals
        summary = {
            "run": run_dir.name, "state": state, "steps_done": len(losses),
            "steps": job.steps, "final_loss": losses[-1] if losses else None,
            "losses": losses, "wall_s": round(time.monotonic() - started, 3),
            "time_dilation": dilation, "tiles": totals.tiles,
            "recomputed_tiles": totals.recomputed, "requeued_tiles": totals.requeued,
            "rejected": totals.rejected, "late": totals.late, "bytes_down": totals.bytes_down,
            "bytes_up": totals.bytes_up, "max_lag_s": round(totals.lag_s_max, 6),
            "device_compute_s": round(totals.device_compute_s, 6),
            "energy_j": round(totals.energy_j, 6),
            "devices": server.call(core.device_records) + list(core.departed)}
        write_json_atomic(run_dir / "ps_summary.json", summary)
        runlog.event("ps_stop", state=state)
        server.stop("run " + state)
        runlog.close()
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.ps_backend",
                                description="The testbed parameter server process.")
    p.add_argument("--topology", required=True, help="topology YAML")
    p.add_argument("--run-dir", required=True, type=Path, help="existing run directory")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to bind (port 0: any)")
    p.add_argument("--steps", type=int, default=None, help="override job.steps")
    p.add_argument("--expect-devices", type=int, default=None,
                   help="devices to wait for before training (default: the topology's count)")
    p.add_argument("--join-timeout-s", type=float, default=60.0,
                   help="start training after this long even if not every device joined")
    p.add_argument("--dilation", type=float, default=1.0, help="time dilation factor D >= 1")
    p.add_argument("--threads", type=int, default=1, help="torch threads on the PS")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ps %(levelname)s: %(message)s")
    try:
        topology = load_topology(args.topology)
    except TopologyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.steps:
        topology = topology.with_overrides(steps=args.steps)
    token = os.environ.get("TESTBED_TOKEN", "")
    if not token:
        print("error: TESTBED_TOKEN is not set", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, args.threads))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    expected = args.expect_devices if args.expect_devices is not None else len(topology.devices)
    return run_ps(topology, args.run_dir, args.listen, token, expected, args.join_timeout_s,
                  args.dilation, stop)
