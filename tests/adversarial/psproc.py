"""A real PS process for the attack tests, and a rogue client speaking the real protocol."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np

from testbed.runlog import read_jsonl
from testbed.wire import testbed_pb2 as pb
from testbed.wire import testbed_pb2_grpc as pb_grpc
from testbed.wire.cache import BlockCache
from testbed.wire.tensors import operand_array
from tests.conftest import REPO, reference_losses, wait_for

TOKEN = "adversarial-test-token"


class PsProcess:
    """`python -m testbed.ps_backend` on loopback, plus honest agent processes."""

    def __init__(self, topology: Path, run_dir: Path, *args: str, fd_limit: int | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.topology, self.run_dir = topology, run_dir
        self.env = dict(os.environ, TESTBED_TOKEN=TOKEN, OPENBLAS_NUM_THREADS="1")

        # soft = hard = fd_limit through prlimit(1), not a preexec_fn: a fork that runs Python
        # code in the child runs gRPC's fork handlers, and once this test process has used gRPC
        # those crashed the child before exec now and then (SIGSEGV, "epoll_wait error: Bad file
        # descriptor"; 106 of 300 forks in a probe with four threads using gRPC)
        limit = ["prlimit", f"--nofile={fd_limit}:{fd_limit}", "--"] if fd_limit else []
        self.proc = subprocess.Popen(
            [*limit, sys.executable, "-m", "testbed.ps_backend", "--topology", str(topology),
             "--run-dir", str(run_dir), *args], env=self.env, cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.agents: list[subprocess.Popen] = []
        port = wait_for(lambda: self.proc.poll() is not None or (
            (run_dir / "ps.json").exists() and json.loads((run_dir / "ps.json").read_text())[
                "port"]), 90, "the PS to listen")
        assert self.proc.poll() is None, self.proc.communicate()[0]
        self.address = f"127.0.0.1:{port}"
        self.port = int(port)

    def agent(self, name: str, *args: str) -> subprocess.Popen:
        """Start an honest agent process."""
        proc = subprocess.Popen([sys.executable, "-m", "testbed.agent", "--ps", self.address,
                                 "--name", name, *args], env=self.env, cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.agents.append(proc)
        return proc

    def status(self) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir / "status.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def finish(self, timeout_s: float = 240) -> tuple[int, str]:
        """Wait for the PS to exit; return its exit code and output."""
        output, _ = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode, output

    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "ps_summary.json").read_text())

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / "events.jsonl")

    def assert_losses_match(self, steps: int) -> None:
        """steps.jsonl has `steps` steps with the single-process (quiet run's) losses."""
        got = [s["loss"] for s in read_jsonl(self.run_dir / "steps.jsonl")]
        want, _ = reference_losses(self.topology, steps)
        assert len(got) == steps, got
        for g, w in zip(got, want):
            assert abs(g - w) <= 1e-8 * abs(w), (g, w)

    def close(self) -> None:
        for proc in [self.proc, *self.agents]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)

    def __enter__(self) -> PsProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Rogue:
    """A token holder that drives the protocol by hand over real gRPC."""

    def __init__(self, address: str, name: str = "rogue", gflops: float = 1.0,
                 window: int = 1, token: str = TOKEN):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.ParameterServerStub(self.channel)
        self.descriptor = pb.DeviceDescriptor(name=name, kind="real", predicted_gflops=gflops,
                                              max_in_flight=window)
        self.token = token
        self.outbox: queue.Queue = queue.Queue()
        self.reply: pb.JoinReply | None = None

    def join(self, **descriptor: Any) -> pb.JoinReply:
        for key, value in descriptor.items():
            setattr(self.descriptor, key, value)
        self.reply = self.stub.Join(pb.JoinRequest(token=self.token, device=self.descriptor),
                                    timeout=20)
        return self.reply

    def attach(self) -> Iterator[pb.ServerMessage]:
        """Open the Work stream; returns the PS's messages."""
        assert self.reply is not None
        self.outbox.put(pb.DeviceMessage(attach=pb.Attach(device_id=self.reply.device_id,
                                                          session_key=self.reply.session_key)))
        return self.stub.Work(self._requests())

    def send(self, message: pb.DeviceMessage) -> None:
        self.outbox.put(message)

    def _requests(self) -> Iterator[pb.DeviceMessage]:
        while True:
            message = self.outbox.get()
            if message is None:
                return
            yield message

    def close(self) -> None:
        self.outbox.put(None)
        self.channel.close()


def job_topology(tmp_path: Path, name: str = "adv", **job: Any) -> Path:
    """tests/data/tiny.yaml (float64) with job keys set (also keys tiny.yaml lacks)."""
    import yaml

    from tests.conftest import TINY

    raw = yaml.safe_load(TINY.read_text())
    raw["job"].update(dtype="float64", **job)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def tile_operands(tile: pb.Tile, cache: BlockCache[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A tile's A and B blocks as a device resolves them (:func:`operand_array`)."""
    return operand_array(tile.a, cache), operand_array(tile.b, cache)


def device_cache() -> BlockCache[np.ndarray]:
    """A block cache for a hand-driven device: larger than anything the PS's mirror holds."""
    return BlockCache(1 << 40)
