"""The PS refuses bad input at the boundary, tells the device why, and the run goes on.

A rogue device (this test, speaking the real protocol over real gRPC) joins a PS process beside
honest agent processes and sends: a result for a task it was never given, a wrong shape, a wrong
dtype, NaNs, and finally a message larger than the PS accepts. A join with a wrong token is
refused. Every step still completes with the single-process losses.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import grpc
import numpy as np
import pytest

from testbed.runlog import read_jsonl
from testbed.wire import testbed_pb2 as pb
from testbed.wire import testbed_pb2_grpc as pb_grpc
from testbed.wire.tensors import to_tensor
from tests.adversarial.psproc import device_cache, tile_operands
from tests.conftest import REPO, reference_losses, tiny_topology, wait_for

pytestmark = pytest.mark.integration
TOKEN = "rogue-test-token"


def _requests(q: queue.Queue) -> Iterator[pb.DeviceMessage]:
    while True:
        message = q.get()
        if message is None:
            return
        yield message


@pytest.mark.slow
def test_bad_results_are_rejected_and_the_run_goes_on(tmp_path: Path) -> None:
    # long enough that the honest devices cannot finish the run before the rogue's last,
    # oversized message arrives (the run ending first would close the stream with UNAVAILABLE)
    steps = 20
    topology = tiny_topology(tmp_path, dtype="float64", steps=steps)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = dict(os.environ, TESTBED_TOKEN=TOKEN, OPENBLAS_NUM_THREADS="1")
    ps = subprocess.Popen([sys.executable, "-m", "testbed.ps_backend", "--topology",
                           str(topology), "--run-dir", str(run_dir), "--expect-devices", "3"],
                          env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    agents: list[subprocess.Popen] = []
    try:
        port = wait_for(lambda: (run_dir / "ps.json").exists() and json.loads(
            (run_dir / "ps.json").read_text())["port"], 60, "the PS to listen")
        address = f"127.0.0.1:{port}"
        stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(address))
        descriptor = pb.DeviceDescriptor(name="rogue", kind="real", predicted_gflops=1000,
                                         max_in_flight=1)

        with pytest.raises(grpc.RpcError) as refused:
            stub.Join(pb.JoinRequest(token="not-the-token", device=descriptor), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "token" in refused.value.details()

        reply = stub.Join(pb.JoinRequest(token=TOKEN, device=descriptor), timeout=10)
        outbox: queue.Queue = queue.Queue()
        outbox.put(pb.DeviceMessage(attach=pb.Attach(device_id=reply.device_id,
                                                     session_key=reply.session_key)))
        responses = stub.Work(_requests(outbox))
        for i in range(2):  # the honest devices join after the rogue got the first tiles
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "testbed.agent", "--ps", address, "--name", f"honest-{i}"],
                env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        # each tile the rogue gets is answered wrongly in the next way; then it waits for the
        # PS's Reject messages, which say why
        cases = ["was not given", "wrong shape", "wrong dtype", "non-finite"]
        seen_reasons: list[str] = []
        cache = device_cache()
        sent = 0
        for message in responses:
            if message.HasField("reject"):
                seen_reasons.append(message.reject.reason)
                if len(seen_reasons) == len(cases):
                    break
            for tile in message.tiles:
                ops = tile_operands(tile, cache)
                c = ops[0] @ ops[1]
                if sent == 0:  # a task nobody gave it; the real tile is answered next
                    outbox.put(pb.DeviceMessage(result=pb.TileResult(
                        task_id=10**9, attempt=0, c=to_tensor(c))))
                    sent += 1
                case = cases[sent] if sent < len(cases) else "honest"
                sent += 1
                if case == "wrong shape":
                    c = c[:, :-1]
                elif case == "wrong dtype":
                    c = c.astype(np.float32)
                elif case == "non-finite":
                    c = c.copy()
                    c[0, 0] = np.nan
                outbox.put(pb.DeviceMessage(result=pb.TileResult(
                    task_id=tile.task_id, attempt=tile.attempt, c=to_tensor(c))))
        for words, reason in zip(cases, seen_reasons):
            assert words in reason, (words, reason)

        # a message larger than the PS accepts ends this stream with a clear status
        huge = np.zeros(reply.max_message_bytes // 8 + 1024)
        outbox.put(pb.DeviceMessage(result=pb.TileResult(task_id=1, c=to_tensor(huge))))
        with pytest.raises(grpc.RpcError) as oversized:
            for _ in responses:
                pass
        assert oversized.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        output, _ = ps.communicate(timeout=240)
        assert ps.returncode == 0, output
    finally:
        for proc in [ps, *agents]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
    losses = [s["loss"] for s in read_jsonl(run_dir / "steps.jsonl")]
    want, _ = reference_losses(topology, steps)
    assert len(losses) == steps
    for got, w in zip(losses, want):
        assert abs(got - w) <= 1e-8 * abs(w)
    events = read_jsonl(run_dir / "events.jsonl")
    assert sum(e["event"] == "reject" for e in events) >= len(cases)
    assert any(e["event"] == "join_refused" for e in events)
