"""Uplink lateness end to end: a real PS (in-process gRPC server) and a real emulated agent.

The PS judges each result's arrival against the uplink the topology gives the device's group
(`DeviceTimeline`). An agent whose uplink runs at that rate delivers its results on time; one
whose uplink is four times slower than the topology says (what a host too busy to carry the
bytes looks like from the PS) makes the results late by much of the step, and the verdict fails
although every compute hold kept its time.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from testbed.emulator.dilation import fidelity_ok, lateness_shares
from testbed.ps_backend.core import PsConfig
from testbed.ps_backend.executor import TileExecutor
from testbed.ps_backend.host import PsServer
from testbed.ps_backend.scheduler import GemmSpec
from tests.conftest import killed_at_exit

REPO = Path(__file__).resolve().parents[2]
DILATION = 2.0
UP_BPS = 16e6  # the topology's uplink for the group: 2 MB/s, a 64 kB result in 32 ms
DELAY_S = 0.005


def _step(tmp_path: Path, agent_up_bps: float) -> tuple[dict[str, float], list[float]]:
    """Three GEMMs of 8 result tiles each through one agent whose uplink runs at
    ``agent_up_bps``; the step's lateness shares and tile errors. The PS hands the agent its
    next tile as a result returns, so a late result also holds the next tile back, which the
    PS's sum of signed lateness counts (``DeviceTimeline``)."""
    token = secrets.token_hex(8)
    link = (float("inf"), UP_BPS / 8, 2 * DELAY_S)
    config = PsConfig(token=token, run_name="uplink-test", dtype=np.dtype("float32"),
                      tile_m=128, tile_n=128, min_offload_flops=0.0, lease_s=30.0,
                      planner="fifo", max_message_bytes=8 << 20, time_dilation=DILATION,
                      group_links={"phones": link}, plan_links={"phones": link},
                      busy_up_Bps={"phones": UP_BPS / 8}, planned_groups=(("phones", 1, 1.0),))
    server = PsServer(config).start()
    core = server.core
    assert core is not None
    env = dict(os.environ, TESTBED_TOKEN=token, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(REPO))
    log_path = tmp_path / f"agent-{agent_up_bps:g}.log"
    agent = subprocess.Popen(
        [sys.executable, "-m", "testbed.agent", "--ps", f"127.0.0.1:{server.port}", "--name",
         "phones-0", "--group", "phones", "--kind", "emulated", "--profile", "snapdragon888",
         "--max-in-flight", "8", "--up-bps", str(agent_up_bps), "--delay-s", str(DELAY_S)],
        env=env, cwd=REPO, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    try:
        with killed_at_exit(agent):
            deadline = time.monotonic() + 60
            while not server.call(lambda: any(c.outbox is not None
                                              for c in core.conns.values())):
                assert agent.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "the agent did not attach within 60 s"
                time.sleep(0.05)
            executor = TileExecutor(server)
            gen = torch.Generator().manual_seed(0)
            b = torch.randn(256, 512, generator=gen)
            server.call(lambda: core.take_step_stats(count=False))  # the step starts here
            started = time.monotonic()
            for step in range(3):  # 3 GEMMs x 8 tiles of 128 x 256 x 128 (64 kB results)
                a = torch.randn(256, 256, generator=gen)
                c = executor.submit(a, b, GemmSpec("up", "forward", step)).result()
                assert torch.allclose(c, a @ b, rtol=1e-4, atol=1e-3)
            device_s = (time.monotonic() - started) / DILATION
            stats = server.call(lambda: core.take_step_stats(count=False))
    finally:
        server.stop("test done")
    return lateness_shares(stats.late_s, device_s), stats.tile_errors


def test_results_slower_than_their_uplink_fail_the_verdict(tmp_path: Path) -> None:
    faithful, errors = _step(tmp_path, UP_BPS)
    assert len(errors) == 24
    # on time, within a generous allowance for a busy 2-core host
    assert faithful["uplink"] < 0.1, faithful
    slow, errors = _step(tmp_path, UP_BPS / 4)
    assert len(errors) == 24
    # a 4x slower uplink: each result arrives about 3 of its transfer times late, and the
    # results are most of the step (one-off runs: 0.47-0.55 of it, against 0.002 faithful)
    assert slow["uplink"] > 0.3 and slow["all"] >= slow["uplink"], slow
    assert slow["uplink"] > faithful["uplink"] + 0.25
    p95 = float(np.quantile(np.abs(errors), 0.95))
    assert fidelity_ok(p95, slow["all"], 0.1) is False
