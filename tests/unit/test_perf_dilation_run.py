"""Time dilation end to end: a real PS (in-process gRPC server) and a real emulated agent process.

With dilation D the agent holds every tile for D x its model's device time, and the run converts
wall time back to device time by dividing by D. Checked per tile, from the PS's side:

* lower bound (exact): the wall time from "operands on the device" (``TileResult.received_s``,
  the agent's CLOCK_MONOTONIC, which this process shares) to "result at the PS", divided by D, is
  never shorter than the tile's model time ``compute_s``: the hold is ``compute_s x D`` from the
  start of compute, and with one tile in flight compute starts after the operands arrived;
* upper bound: summed over the run, device time = wall / D exceeds the model's device time by
  no more than the measured lag (``lag_s``, real compute beyond the hold) plus the loopback
  round trip, divided by D. The round-trip allowance is generous (this machine is shared).

An agent that ignored D (or applied it twice) fails one of the two bounds by a factor of ~3.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from testbed.emulator.dilation import device_seconds
from testbed.ps_backend.core import PsConfig
from testbed.ps_backend.executor import TileExecutor
from testbed.ps_backend.host import PsServer
from testbed.ps_backend.scheduler import GemmSpec

REPO = Path(__file__).resolve().parents[2]
DILATION = 3.0
PROFILE = "sd835-eigen"  # 6.29 GFLOP/s peak: a tile's model time is large next to its trip
K = 6144
# Wall seconds per tile for the result's trip and the PS loop (on a loaded 2-core machine the
# whole excess reached ~12 ms a tile). The bound still catches a wrong agent: a tile of
# 128 x 6144 x 128 is 2mkn(1 + 4/k) / 6.29e9 + 12 us = c ~ 32 ms of model time; an agent that
# applied D twice holds 9c, so its excess is 2c ~ 64 ms of device time a tile, against an
# allowance of 0.05 / 3 ~ 17 ms (plus lag / 3, 0 for such an agent): ~3.8 x over. An agent
# that ignored D holds c, and c / 3 < c fails the exact lower bound, whatever this allowance.
TRIP_ALLOWANCE_S = 0.05


def _start_agent(port: int, token: str, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, TESTBED_TOKEN=token, OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "testbed.agent", "--ps", f"127.0.0.1:{port}", "--name",
           "dil-0", "--kind", "emulated", "--profile", PROFILE, "--max-in-flight", "1"]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log_path.open("w"),
                            stderr=subprocess.STDOUT)


def test_device_time_is_wall_time_over_dilation_within_lag(tmp_path: Path) -> None:
    token = secrets.token_hex(8)
    config = PsConfig(token=token, run_name="dilation-test", dtype=np.dtype("float32"),
                      tile_m=128, tile_n=128, min_offload_flops=0.0, lease_s=30.0, planner="fifo",
                      max_message_bytes=8 << 20, time_dilation=DILATION)
    server = PsServer(config).start()
    core = server.core
    assert core is not None
    records: list[tuple[float, float, float, float]] = []  # arrived, received, compute_s, lag_s
    core.accepted_observers.append(
        lambda conn, result, arrived: records.append((arrived, result.received_s,
                                                      result.compute_s, result.lag_s)))
    agent = _start_agent(server.port, token, tmp_path / "agent.log")
    try:
        deadline = time.monotonic() + 60
        while not server.call(lambda: any(c.outbox is not None for c in core.conns.values())):
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()
            assert time.monotonic() < deadline, "the agent did not attach within 60 s"
            time.sleep(0.05)
        executor = TileExecutor(server)
        gen = torch.Generator().manual_seed(0)
        b = torch.randn(K, 512, generator=gen)
        started = time.monotonic()
        for step in range(3):  # 3 GEMMs x 8 tiles of 128 x K x 128
            a = torch.randn(256, K, generator=gen)
            c = executor.submit(a, b, GemmSpec("dil", "forward", step)).result()
            assert torch.allclose(c, a @ b, rtol=1e-4, atol=1e-3)
        wall_s = time.monotonic() - started
    finally:
        server.stop("test done")
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()

    assert len(records) == 24
    arrived, received, compute_s, lag_s = (np.array(col) for col in zip(*records))
    tile_wall_s = arrived - received
    assert (compute_s > 0).all()
    # lower bound, per tile: the hold alone is D x compute_s
    assert (device_seconds(tile_wall_s, DILATION) >= compute_s * (1 - 1e-6)).all(), \
        list(zip(tile_wall_s / DILATION, compute_s))
    # upper bound, over the run: device time - model time <= (lag + round trips) / D
    excess_s = device_seconds(tile_wall_s.sum(), DILATION) - compute_s.sum()
    allowance_s = (lag_s.sum() + TRIP_ALLOWANCE_S * len(records)) / DILATION
    assert excess_s <= allowance_s, (excess_s, allowance_s, compute_s.sum())
    print(f"device {device_seconds(tile_wall_s.sum(), DILATION):.4f} s, model "
          f"{compute_s.sum():.4f} s, lag {lag_s.sum():.4f} s, excess {excess_s:.4f} s <= "
          f"{allowance_s:.4f} s")
    # and the run as a whole took at least D x the model's device time on the wall clock
    assert wall_s >= DILATION * compute_s.sum()
