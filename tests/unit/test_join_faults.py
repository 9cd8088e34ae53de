"""A device's agent meets an unlucky PS: one that stops answering mid-stream (its host froze,
or this device's network went away), one that accepts a connection and never completes the TLS
handshake, one that ends the session without a word (a lease that ran out while this device
slept). A stop asked for ends the agent at once, and a session that ends says so."""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import grpc
import pytest

from testbed.agent.agent import Agent, AgentOptions
from testbed.cli import main as cli_main
from testbed.ps_backend.tls import (
    host_port,
    join_hosts,
    make_identity,
    resumed_listen,
    saved_identity,
)
from testbed.wire import testbed_pb2 as pb
from testbed.wire import testbed_pb2_grpc as pb_grpc
from tests.conftest import closed_port

TOKEN = "t0ken-" + "7" * 26
PROMPT_S = 3.0  # a stop ends the agent within this; the pin's handshake timeout is 10 s


class FakePS:
    """A PS over real gRPC that answers Join and Leave, and whose Work stream either never
    answers nor ends (``work="frozen"``) or ends at once after the attach (``"ends"``); or
    that refuses every join as the run ends (``"ending"``)."""

    def __init__(self, work: str):
        self.release = threading.Event()  # ends a frozen Work at the test's end
        self.attached = threading.Event()
        self.joins = 0
        self.left: list[str] = []
        outer = self

        class Servicer(pb_grpc.ParameterServerServicer):  # type: ignore[misc]
            def Join(self, request: Any, context: Any) -> Any:
                outer.joins += 1
                if work == "ending":  # as the PS answers a join while it ends the run
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the run is ending")
                return pb.JoinReply(device_id=f"d{outer.joins}", session_key="k", lease_s=30,
                                    heartbeat_s=5, max_message_bytes=1 << 20,
                                    time_dilation=1.0, run_name="fake")

            def Work(self, request_iterator: Any, context: Any) -> Iterator[Any]:
                next(request_iterator)  # the attach
                outer.attached.set()
                if work == "frozen":  # reads nothing more, answers nothing, never ends
                    outer.release.wait(60)
                return
                yield  # a generator: a stream of no messages

            def Leave(self, request: Any, context: Any) -> Any:
                outer.left.append(request.reason)
                return pb.LeaveReply(requeued_tiles=2)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_ParameterServerServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def close(self) -> None:
        self.release.set()
        self.server.stop(grace=0).wait(5)


def _agent(port: int, fingerprint: str = "") -> Agent:
    return Agent(AgentOptions(ps_address=f"127.0.0.1:{port}", token=TOKEN, name="lan-0",
                              kind="real", tls_fingerprint=fingerprint))


def _run_in_thread(agent: Agent) -> tuple[threading.Event, list[int]]:
    done, codes = threading.Event(), []
    threading.Thread(target=lambda: (codes.append(agent.run()), done.set()),
                     daemon=True).start()
    return done, codes


def test_a_stop_ends_the_agent_while_the_ps_does_not_answer() -> None:
    ps = FakePS("frozen")
    try:
        agent = _agent(ps.port)
        done, _ = _run_in_thread(agent)
        assert ps.attached.wait(10), "the agent never attached"
        started = time.monotonic()
        agent.request_stop("SIGINT")
        assert done.wait(PROMPT_S), "the agent waited for a PS that does not answer"
        assert time.monotonic() - started < PROMPT_S
        assert ps.left == ["SIGINT"]  # it said goodbye first
        assert agent.stopped_by == "SIGINT"
    finally:
        ps.close()


def test_a_stop_during_a_stalled_tls_handshake_ends_the_agent_at_once(
        caplog: pytest.LogCaptureFixture) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts (the kernel does), never says a word of TLS
    try:
        agent = _agent(listener.getsockname()[1], "sha256:" + "ab" * 32)
        with caplog.at_level(logging.INFO, logger="testbed.agent"):
            done, codes = _run_in_thread(agent)
            time.sleep(0.5)  # in the handshake now
            started = time.monotonic()
            agent.request_stop("SIGTERM")
            assert done.wait(PROMPT_S), "the stop waited for the handshake's timeout"
        assert time.monotonic() - started < PROMPT_S
        assert codes == [0]
        assert not any("joining again" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        listener.close()


def test_a_join_while_the_run_ends_ends_the_agent(caplog: pytest.LogCaptureFixture) -> None:
    """A join that reaches the PS as it ends the run: the agent ends (exit 0) saying so; it was
    UNAVAILABLE, retried every few seconds for ever once the PS was gone."""
    ps = FakePS("ending")
    try:
        with caplog.at_level(logging.INFO, logger="testbed.agent"):
            done, codes = _run_in_thread(_agent(ps.port))
            assert done.wait(PROMPT_S) and codes == [0]
        assert ps.joins == 1 and "PS says: the run is ending" in caplog.text, caplog.text
    finally:
        ps.close()


def test_a_session_the_ps_ends_is_said_in_a_line_before_joining_again(
        caplog: pytest.LogCaptureFixture) -> None:
    ps = FakePS("ends")
    try:
        agent = _agent(ps.port)
        with caplog.at_level(logging.INFO, logger="testbed.agent"):
            done, _ = _run_in_thread(agent)
            deadline = time.monotonic() + 10
            while ps.joins < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            agent.request_stop("SIGINT")
            assert done.wait(PROMPT_S)
        assert ps.joins >= 2, "the agent did not join again"
        ended = [r.getMessage() for r in caplog.records if "ended this device's session" in
                 r.getMessage()]
        assert ended and "joining again" in ended[0], caplog.text
    finally:
        ps.close()


def test_an_agent_started_cut_off_joins_only_once_healed() -> None:
    """`--partitioned` (a loopback device that joins while its link is down): no join until
    the heal (SIGUSR2), as a device behind a port that is down cannot reach the PS."""
    ps = FakePS("frozen")
    try:
        agent = _agent(ps.port)
        agent.set_partitioned(True)
        done, _ = _run_in_thread(agent)
        time.sleep(1.0)
        assert ps.joins == 0
        agent.set_partitioned(False)
        assert ps.attached.wait(10), "the healed agent never joined"
        agent.request_stop("SIGTERM")
        assert done.wait(PROMPT_S)
    finally:
        ps.close()


def test_a_server_that_does_not_speak_tls_is_refused_not_retried(
        caplog: pytest.LogCaptureFixture) -> None:
    """A wrong port (an HTTP server, the PS's plain loopback port) answers, but not in TLS:
    retrying will not make it the PS, so the agent stops (exit 3) with a line that says so."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def answer_http() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed at the test's end
                return
            with conn:
                conn.recv(4096)  # the ClientHello
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
    threading.Thread(target=answer_http, daemon=True).start()
    try:
        port = listener.getsockname()[1]
        with caplog.at_level(logging.INFO, logger="testbed.agent"):
            done, codes = _run_in_thread(_agent(port, "sha256:" + "ab" * 32))
            assert done.wait(PROMPT_S), "the agent kept trying a server that is not the PS"
        assert codes == [3]
        assert f"127.0.0.1:{port} answered, but not in TLS" in caplog.text, caplog.text
        assert "joining again" not in caplog.text, caplog.text
    finally:
        listener.close()


def test_a_grpc_server_that_is_not_a_ps_is_refused_not_retried(
        caplog: pytest.LogCaptureFixture) -> None:
    """Another gRPC service on the port given (UNIMPLEMENTED: it has no testbed Join): the
    plain agent retried it for ever; now it stops (exit 3) saying so."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))  # serves nothing of ours
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with caplog.at_level(logging.INFO, logger="testbed.agent"):
            done, codes = _run_in_thread(_agent(port))
            assert done.wait(PROMPT_S), "the agent kept trying a server that is not the PS"
        assert codes == [3]
        assert f"127.0.0.1:{port} answered in gRPC but has no testbed Join" in caplog.text, \
            caplog.text
        assert "joining again" not in caplog.text, caplog.text
    finally:
        server.stop(grace=0).wait(5)


@pytest.mark.parametrize("address", ["0.0.0.0:50051", "[::]:50051"])
def test_the_address_a_ps_listens_on_everywhere_is_refused_with_what_to_give(
        capsys: pytest.CaptureFixture[str], address: str) -> None:
    """0.0.0.0 or [::] typed by hand (the PS puts its host's addresses in the join command it
    prints, :func:`join_hosts`): on the device that address is the device itself, and the agent
    was refused for ever. Now: exit 2, saying which address to give."""
    assert cli_main(["join", address, "--fingerprint", "sha256:" + "ab" * 32,
                     "--token-file", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "every address of the PS's host" in err and "192.168.1.10:50051" in err, err


def _nic(*addresses: str) -> list[Any]:
    return [SimpleNamespace(address=a) for a in addresses]


def test_a_ps_listening_everywhere_prints_this_hosts_addresses_to_join() -> None:
    """listen 0.0.0.0 or [::]: the join command carries addresses a device may dial (private
    ones first; no loopback, link-local or MAC address), or loopback when there is no other."""
    nics = {"lo": _nic("127.0.0.1", "::1", "00:00:00:00:00:00"),
            "eth0": _nic("81.2.69.142", "fe80::1%eth0", "2a02:598::7", "52:54:00:12:34:56"),
            "wlan0": _nic("192.168.1.10", "fd00::10")}
    assert join_hosts("0.0.0.0", nics) == ["192.168.1.10", "81.2.69.142"]
    assert join_hosts("::", nics) == ["fd00::10", "2a02:598::7"]
    assert join_hosts("0.0.0.0", {"lo": _nic("127.0.0.1")}) == ["127.0.0.1"]
    assert join_hosts("192.168.1.10", nics) == ["192.168.1.10"]  # the one it listens on
    assert [host_port(h, 5) for h in join_hosts("::", nics)] == ["[fd00::10]:5",
                                                                "[2a02:598::7]:5"]


def test_a_resumed_run_keeps_its_certificate_and_token_unless_they_are_unusable(
        tmp_path: Path) -> None:
    from testbed.up import saved_token

    made = make_identity(tmp_path, "127.0.0.1:0")
    assert saved_identity(tmp_path) == made
    other = tmp_path / "other"
    other.mkdir()
    make_identity(other, "127.0.0.1:0")
    (tmp_path / "ps-tls.key").write_bytes((other / "ps-tls.key").read_bytes())
    assert saved_identity(tmp_path) is None  # a key that is not the certificate's
    (tmp_path / "ps-tls.crt").write_text("-----BEGIN CERTIFICATE-----\nzz\n")
    assert saved_identity(tmp_path) is None
    assert saved_identity(tmp_path / "missing") is None
    token = tmp_path / "join-token"
    assert saved_token(tmp_path) is None
    token.write_text("0123456789abcdef" * 2 + "\n")
    assert saved_token(tmp_path) == "0123456789abcdef" * 2
    token.write_text("not a token\n")
    assert saved_token(tmp_path) is None


def test_a_resumed_run_listens_where_it_did_when_its_port_was_any_and_is_free() -> None:
    free = closed_port()  # a port the run's first start had: free again
    assert resumed_listen("127.0.0.1:0", f"127.0.0.1:{free}") == f"127.0.0.1:{free}"
    # listening on every address, the device dialled one of them: its port is the one
    assert resumed_listen("0.0.0.0:0", f"192.0.2.7:{free}") == f"0.0.0.0:{free}"
    with socket.socket() as taken:  # another process has it now: any free port, as asked
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert resumed_listen("127.0.0.1:0", f"127.0.0.1:{port}") == "127.0.0.1:0"
    assert resumed_listen("127.0.0.1:50051", f"127.0.0.1:{free}") == "127.0.0.1:50051"
    assert resumed_listen("127.0.0.1:0", None) == "127.0.0.1:0"
    assert resumed_listen("127.0.0.1:0", "torn") == "127.0.0.1:0"
    assert resumed_listen("127.0.0.1:0", free) == "127.0.0.1:0"  # not a HOST:PORT string
