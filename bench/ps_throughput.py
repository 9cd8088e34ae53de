"""How many tiles per second the PS moves, and what each costs it.

Starts the PS server in this process (no training: GEMMs are submitted straight to the tile
executor, as the engine would) and N real agent processes on loopback that compute each tile
with numpy and return it at once (``--kind real``: no emulated hold, no link shaping). For each
(devices, tile edge) it submits GEMMs of M = N = 16 tiles per side and K = tile edge for a fixed
time and prints tiles/s, payload bytes/s (operand and result bytes that crossed the wire) and the
PS's CPU time per tile (this process's user+system time over the measured window).

Usage: ``.venv/bin/python bench/ps_throughput.py [--devices 16 64] [--tiles 64 256]
[--seconds 10]``. Numbers depend on the machine; the agents share its cores with the PS.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from testbed.ps_backend.executor import GemmSpec  # noqa: E402
from testbed.ps_backend.main import max_message_bytes  # noqa: E402
from testbed.ps_backend.server import PsConfig, PsServer, TileExecutor  # noqa: E402

TOKEN = "bench"


def start_agents(port: int, count: int) -> list[subprocess.Popen]:
    env = dict(os.environ, TESTBED_TOKEN=TOKEN, OPENBLAS_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, "-m", "testbed.agent", "--ps", f"127.0.0.1:{port}",
                              "--name", f"bench-{i}", "--kind", "real", "--max-in-flight", "4",
                              "--gflops", "10"],
                             env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for i in range(count)]


def measure(devices: int, tile: int, seconds: float) -> dict[str, float]:
    config = PsConfig(token=TOKEN, run_name="bench", dtype=np.dtype("float32"), tile_m=tile,
                      tile_n=tile, min_offload_flops=0,
                      max_message_bytes=max_message_bytes(tile, tile), lease_s=30)
    server = PsServer(config).start()
    agents = start_agents(server.port, devices)
    try:
        core = server.core
        assert core is not None
        deadline = time.monotonic() + 120
        while len(core.conns) < devices:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(core.conns)} of {devices} agents joined")
            time.sleep(0.1)
        executor = TileExecutor(server)
        side = 16 * tile
        rng = np.random.default_rng(0)
        a = torch.from_numpy(rng.standard_normal((side, tile), dtype=np.float32))
        b = torch.from_numpy(rng.standard_normal((tile, side), dtype=np.float32))
        executor.submit(a, b, GemmSpec("warmup", "forward", 0)).result()  # caches, connections
        before = server.call(lambda: (core.totals.tiles, core.totals.bytes_down,
                                      core.totals.bytes_up))
        cpu0, wall0 = time.process_time(), time.monotonic()
        step = 1
        while time.monotonic() - wall0 < seconds:
            # new weights each round, as after an optimizer step: no stale cache hits
            handles = [executor.submit(a, b, GemmSpec(f"l{i}", "forward", step, f"w{i}@{step}:T"))
                       for i in range(2)]
            for h in handles:
                h.result()
            step += 1
        wall = time.monotonic() - wall0
        cpu = time.process_time() - cpu0
        after = server.call(lambda: (core.totals.tiles, core.totals.bytes_down,
                                     core.totals.bytes_up))
        tiles = after[0] - before[0]
        payload = (after[1] - before[1]) + (after[2] - before[2])
        return {"devices": devices, "tile": tile, "tiles_per_s": tiles / wall,
                "payload_MB_per_s": payload / wall / 1e6, "ps_cpu_us_per_tile": cpu / tiles * 1e6,
                "tiles": tiles}
    finally:
        server.stop("bench done")
        for proc in agents:
            proc.terminate()
        for proc in agents:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, nargs="+", default=[16, 64])
    p.add_argument("--tiles", type=int, nargs="+", default=[64, 256])
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()
    print(f"{'devices':>7} {'tile':>5} {'tiles/s':>9} {'payload MB/s':>13} "
          f"{'PS CPU us/tile':>15} {'tiles':>7}")
    for devices in args.devices:
        for tile in args.tiles:
            r = measure(devices, tile, args.seconds)
            print(f"{r['devices']:>7} {r['tile']:>5} {r['tiles_per_s']:>9.0f} "
                  f"{r['payload_MB_per_s']:>13.1f} {r['ps_cpu_us_per_tile']:>15.0f} "
                  f"{r['tiles']:>7}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
