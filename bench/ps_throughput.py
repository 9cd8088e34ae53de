"""How many tiles per second the PS moves, what each costs it, and the bare-gRPC ceiling.

Starts the PS server in this process (no training: GEMMs are submitted straight to the tile
executor, as the engine would) and N real agent processes on loopback that compute each tile
with numpy (``--kind real``: no emulated hold, no link shaping). For each (devices, tile edge) it
submits GEMMs of M = N = 16 tiles per side and K = tile edge, cut into tiles of exactly that edge
(``planner="fifo"``: the traffic-aware planner would cut larger ones), for a fixed time and
prints tiles/s, payload bytes/s (operand and result bytes that crossed the wire), the PS's CPU
time per tile (this process's user+system time over the measured window, the engine's side
included) and tiles per result message (batching: docs/architecture.md).

Then, in the same run, the ceiling: a bare gRPC bidirectional stream per device (same number of
client processes, same window of 4 tiles) moving the same bytes per tile (down: the PS's
measured operand bytes per tile; up: one tile of results), with no PS logic: the server answers
each reply with the next pre-serialized message and the client answers each message with a
pre-serialized reply. ``share`` is the PS's tiles/s over the ceiling's.

Usage: ``.venv/bin/python bench/ps_throughput.py [--devices 16 64] [--tiles 64 256]
[--seconds 10] [--quick]``. Numbers depend on the machine; the clients share its cores with
the server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from testbed.ps_backend.config import max_message_bytes  # noqa: E402
from testbed.ps_backend.core import PsConfig  # noqa: E402
from testbed.ps_backend.executor import TileExecutor  # noqa: E402
from testbed.ps_backend.host import PsServer  # noqa: E402
from testbed.ps_backend.scheduler import GemmSpec  # noqa: E402

TOKEN = "bench"
WINDOW = 4  # tiles in flight per device, as the agents' --max-in-flight
CEILING_METHOD = "/bench.Ceiling/Work"


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
                      max_message_bytes=max_message_bytes(tile, tile), lease_s=30,
                      planner="fifo")  # tiles of exactly tile x tile (the planner cuts larger)
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
        messages_up = [0]  # results messages the PS handled (a batch counts once)
        on_results = core.on_results

        def counting(conn, results):  # type: ignore[no-untyped-def]
            messages_up[0] += 1  # one call per result message, a batch or a single result
            on_results(conn, results)
        core.on_results = counting  # type: ignore[method-assign]
        executor = TileExecutor(server)
        side = 16 * tile
        rng = np.random.default_rng(0)
        a = torch.from_numpy(rng.standard_normal((side, tile), dtype=np.float32))
        b = torch.from_numpy(rng.standard_normal((tile, side), dtype=np.float32))
        executor.submit(a, b, GemmSpec("warmup", "forward", 0)).result()  # caches, connections
        before = server.call(lambda: (core.totals.tiles, core.totals.bytes_down,
                                      core.totals.bytes_up))
        cpu0, wall0 = time.process_time(), time.monotonic()
        messages0 = messages_up[0]
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
                "tiles": tiles, "tiles_per_message": tiles / max(messages_up[0] - messages0, 1),
                "down_bytes_per_tile": (after[1] - before[1]) / tiles,
                "up_bytes_per_tile": (after[2] - before[2]) / tiles}
    finally:
        server.stop("bench done")
        for proc in agents:
            proc.terminate()
        for proc in agents:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


class _Ceiling:
    """The bare stream's server: each reply from a client is answered with the next message."""

    def __init__(self, down: bytes):
        self.down = down
        self.replies = 0
        self.bytes = 0

    async def work(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        for _ in range(WINDOW):
            await context.write(self.down)
        while True:
            reply = await context.read()
            if reply is grpc.aio.EOF:
                return
            self.replies += 1
            self.bytes += len(reply) + len(self.down)
            await context.write(self.down)


def _pb_message_of(payload_bytes: int, tile: int, down: bool) -> bytes:
    """A real protocol message carrying payload_bytes of tensor data (as the PS's messages do)."""
    from testbed.wire import testbed_pb2 as pb

    if down:
        message = pb.ServerMessage()
        t = message.tiles.add(task_id=1 << 40, step=1, gemm="s1/l0/forward#0", op="forward",
                              m=tile, k=tile, n=tile, deadline_s=30.0)
        t.a.tensor.data = b"\0" * payload_bytes
        t.a.tensor.shape[:] = [payload_bytes // 4]
        t.a.tensor.dtype = pb.FLOAT32
        t.a.key = "s1/l0/forward#0:A:0"
        return message.SerializeToString()
    result = pb.DeviceMessage(result=pb.TileResult(task_id=1 << 40, compute_s=1e-3,
                                                   received_s=1.0, started_s=1.0, done_s=1.0))
    result.result.c.data = b"\0" * payload_bytes
    result.result.c.shape[:] = [tile, tile]
    result.result.c.dtype = pb.FLOAT32
    return result.SerializeToString()


def measure_ceiling(devices: int, tile: int, down_bytes: int, up_bytes: int,
                    seconds: float) -> dict[str, float]:
    """Tiles/s over a bare gRPC bidirectional stream per client: same bytes, no PS logic."""
    ceiling = _Ceiling(_pb_message_of(down_bytes, tile, down=True))
    loop = asyncio.new_event_loop()
    ready: dict[str, object] = {}

    async def start() -> grpc.aio.Server:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 1 << 30),
                                          ("grpc.max_send_message_length", 1 << 30)])
        handler = grpc.stream_stream_rpc_method_handler(ceiling.work)  # bytes in, bytes out
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "bench.Ceiling", {"Work": handler})])
        ready["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server

    import threading

    server = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    clients = [subprocess.Popen([sys.executable, __file__, "--ceiling-client",
                                 f"127.0.0.1:{ready['port']}", "--up-bytes", str(up_bytes),
                                 "--tile", str(tile)], env=env, cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for _ in range(devices)]
    try:
        time.sleep(1.0)  # clients start, connect, warm up
        deadline = time.monotonic() + 180  # 64 Python clients start slowly on a busy machine
        while ceiling.replies < 10 * devices:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {devices} ceiling clients did not warm up in 180 s "
                                   f"({ceiling.replies} replies): is the machine overloaded?")
            time.sleep(0.1)
        replies0, bytes0 = ceiling.replies, ceiling.bytes
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        wall = time.monotonic() - wall0
        cpu = time.process_time() - cpu0
        tiles = ceiling.replies - replies0
        if tiles == 0:
            raise RuntimeError(f"the {devices} ceiling clients moved no tile in {seconds:g} s "
                               "(did they start? is the machine overloaded?)")
        return {"tiles_per_s": tiles / wall,
                "payload_MB_per_s": (ceiling.bytes - bytes0) / wall / 1e6,
                "cpu_us_per_tile": cpu / max(tiles, 1) * 1e6}
    finally:
        for proc in clients:
            proc.terminate()
        for proc in clients:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def ceiling_client(address: str, up_bytes: int, tile: int) -> int:
    """One bare-stream client: answer every message from the server with one reply."""
    import queue

    reply = _pb_message_of(up_bytes, tile, down=False)
    channel = grpc.insecure_channel(address, options=[
        ("grpc.max_receive_message_length", 1 << 30),
        ("grpc.max_send_message_length", 1 << 30)])
    call = channel.stream_stream(CEILING_METHOD)
    out: queue.Queue[bytes | None] = queue.Queue()

    def requests() -> object:
        while (item := out.get()) is not None:
            yield item
    try:
        for _ in call(requests()):
            out.put(reply)
    except grpc.RpcError:
        pass
    out.put(None)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Print the PS's tiles/s and the bare-gRPC ceiling for each (devices, tile edge)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[16, 64],
                   help="agent processes, one figure each (default 16 64)")
    p.add_argument("--tiles", type=int, nargs="+", default=[64, 256],
                   help="tile edges, one figure each (default 64 256)")
    p.add_argument("--seconds", type=float, default=10.0,
                   help="measured window per figure, seconds (default 10)")
    p.add_argument("--quick", action="store_true",
                   help="4 devices, 3 s per figure (a smoke run, not a measurement; "
                        "replaces --devices and --seconds)")
    p.add_argument("--ceiling-client", metavar="HOST:PORT", help=argparse.SUPPRESS)
    p.add_argument("--up-bytes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tile", type=int, default=64, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ceiling_client:
        return ceiling_client(args.ceiling_client, args.up_bytes, args.tile)
    if args.quick:
        args.devices, args.seconds = [4], 3.0
    print(f"{'devices':>7} {'tile':>5} {'tiles/s':>9} {'payload MB/s':>13} "
          f"{'PS CPU us/tile':>15} {'tiles':>7} {'tiles/msg':>9} {'ceiling tiles/s':>16} "
          f"{'ceiling MB/s':>13} "
          f"{'ceil CPU us/tile':>17} {'share':>6}")
    for devices in args.devices:
        for tile in args.tiles:
            r = measure(devices, tile, args.seconds)
            c = measure_ceiling(devices, tile, int(r["down_bytes_per_tile"]),
                                int(r["up_bytes_per_tile"]), args.seconds)
            print(f"{r['devices']:>7} {r['tile']:>5} {r['tiles_per_s']:>9.0f} "
                  f"{r['payload_MB_per_s']:>13.1f} {r['ps_cpu_us_per_tile']:>15.0f} "
                  f"{r['tiles']:>7} {r['tiles_per_message']:>9.2f} {c['tiles_per_s']:>16.0f} "
                  f"{c['payload_MB_per_s']:>13.1f} "
                  f"{c['cpu_us_per_tile']:>17.0f} "
                  f"{r['tiles_per_s'] / c['tiles_per_s']:>6.0%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
