"""Attacks without a token: idle TCP connections and a flood of refused joins. The run keeps
training with the single-process (quiet run's) losses, and the run directory stays small."""

from __future__ import annotations

import resource
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest

from testbed.ps_backend.proto import testbed_pb2 as pb
from testbed.ps_backend.proto import testbed_pb2_grpc as pb_grpc
from tests.adversarial.psproc import PsProcess, job_topology
from tests.conftest import wait_for

pytestmark = pytest.mark.integration

PS_FD_LIMIT = 1024  # the PS runs with soft = hard = this; the attack opens twice as many
IDLE_CONNECTIONS = 2048
# the 6-step tiny run's directory is ~2.2 MB quiet (two checkpoints and a ledger segment);
# 4,000+ refusals with 4 KiB names used to add ~16 MB to events.jsonl alone
RUN_DIR_MAX_BYTES = 4 * 1024 * 1024
EVENTS_MAX_BYTES = 64 * 1024


def _run_dir_bytes(run_dir: Path) -> int:
    return sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())


def test_idle_connections_beyond_the_fd_limit_do_not_kill_the_ps(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < IDLE_CONNECTIONS + 256:
        pytest.skip(f"this test needs {IDLE_CONNECTIONS + 256} fds (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, IDLE_CONNECTIONS + 256), hard))
    steps = 6
    topology = job_topology(tmp_path, steps=steps)
    sockets: list[socket.socket] = []
    try:
        with PsProcess(topology, tmp_path / "run", "--expect-devices", "2",
                       fd_limit=PS_FD_LIMIT) as ps:
            ps.agent("honest-0")
            ps.agent("honest-1")
            wait_for(lambda: ps.status().get("state") == "training", 120, "training")
            for _ in range(IDLE_CONNECTIONS):  # connect and say nothing, ever
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", ps.port))
                sockets.append(s)
            code, output = ps.finish()
            assert code == 0, output
    finally:
        for s in sockets:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    ps.assert_losses_match(steps)
    summary = ps.summary()
    assert summary["steps_done"] == steps and summary["state"] == "done"
    start = next(e for e in ps.events() if e["event"] == "ps_start")
    assert start["max_connections"] < PS_FD_LIMIT


@pytest.mark.slow
def test_a_flood_of_refused_joins_keeps_the_run_and_its_logs_small(tmp_path: Path) -> None:
    steps = 6
    topology = job_topology(tmp_path, steps=steps)
    with PsProcess(topology, tmp_path / "run", "--expect-devices", "2") as ps:
        ps.agent("honest-0")
        ps.agent("honest-1")
        wait_for(lambda: ps.status().get("state") == "training", 120, "training")
        stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(ps.address))
        name = "n" * 4096  # each refusal used to write this into events.jsonl
        sent, done = [0], threading.Event()

        def flood() -> None:  # ~1,000 joins a second with a wrong token, for 4 s
            end = time.monotonic() + 4.0
            while time.monotonic() < end:
                tick = time.monotonic()
                calls = [stub.Join.future(pb.JoinRequest(
                    token="wrong", device=pb.DeviceDescriptor(name=name)), timeout=10)
                    for _ in range(100)]
                for call in calls:
                    try:
                        call.result()
                    except grpc.RpcError:
                        pass
                sent[0] += len(calls)
                time.sleep(max(0.0, 0.1 - (time.monotonic() - tick)))
            done.set()
        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        thread.join(60)
        code, output = ps.finish()
        assert code == 0, output
    assert sent[0] >= 1000
    ps.assert_losses_match(steps)
    refused = [e for e in ps.events() if e["event"] == "join_refused"]
    assert refused and sum(e["refusals"] for e in refused) <= sent[0]
    assert len(refused) <= 2 * 10  # at most one line per reason per second
    assert all(len(e["device"]) <= 70 for e in refused)  # names cut to 64
    assert (ps.run_dir / "events.jsonl").stat().st_size <= EVENTS_MAX_BYTES
    assert _run_dir_bytes(ps.run_dir) <= RUN_DIR_MAX_BYTES
