"""The Mininet path of a phone's bytes without namespaces: relay -> Unix socket -> forwarder.

A relay told to dial a forwarder's Unix socket hands each phone connection to it, and the
forwarder opens the TCP connection to the "PS" (here a loopback echo server). Bytes arrive
intact in both directions, the relay counts them, closing the relay closes the PS side (how the
PS sees a phone go), and the forwarder's delay (kernels without netem) delays a round trip.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from testbed.adb_bridge.forwarder import main, serve
from testbed.adb_bridge.relay import PhoneRelay
from tests.conftest import wait_for


def _echo_server() -> tuple[socket.socket, list[socket.socket], list[socket.socket]]:
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    closed: list[socket.socket] = []  # connections whose device side ended

    def run() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            threading.Thread(target=_echo, args=(conn, closed), daemon=True).start()
    threading.Thread(target=run, daemon=True).start()
    return listener, accepted, closed


def _echo(conn: socket.socket, closed: list[socket.socket]) -> None:
    try:
        while data := conn.recv(65536):
            conn.sendall(data)
    except OSError:
        pass
    closed.append(conn)
    conn.close()  # the PS closes its side when the device's side is closed


def _forwarder(path: Path, port: int, delay_s: float = 0.0) -> None:
    ready = threading.Event()
    threading.Thread(target=serve, args=(path, "127.0.0.1", port, delay_s, ready),
                     daemon=True).start()
    assert ready.wait(5)


def _round_trip(port: int, payload: bytes) -> tuple[bytes, float]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as phone:
        t0 = time.monotonic()
        phone.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = phone.recv(65536)
            assert chunk, "the relay closed early"
            got += chunk
        return got, time.monotonic() - t0


def test_relay_hands_connections_to_the_forwarder(tmp_path: Path) -> None:
    ps, accepted, closed = _echo_server()
    sock = tmp_path / "a0.sock"
    _forwarder(sock, ps.getsockname()[1])
    relay = PhoneRelay("P1", "203.0.113.1", 9, upstream_unix=str(sock))  # never dialled
    port = relay.start()
    payload = bytes(range(256)) * 400
    got, _ = _round_trip(port, payload)
    assert got == payload and len(accepted) == 1
    wait_for(lambda: relay.bytes_up == relay.bytes_down == len(payload), 10, "relay counters")
    assert relay.connections_total == 1
    # a second phone connection while the first is open: each gets its own PS connection
    with socket.create_connection(("127.0.0.1", port), timeout=10) as phone:
        phone.sendall(b"x")
        assert phone.recv(1) == b"x"
        wait_for(lambda: relay.open_connections() == 1, 10, "the first connection to close")
        assert len(accepted) == 2
        relay.stop()  # the phone goes: the PS sees its connection end
        wait_for(lambda: accepted[1] in closed, 10, "the PS side to see the end")
    ps.close()


def test_forwarder_applies_its_delay_each_way(tmp_path: Path) -> None:
    ps, _, _ = _echo_server()
    sock = tmp_path / "a1.sock"
    _forwarder(sock, ps.getsockname()[1], delay_s=0.1)
    relay = PhoneRelay("P1", "203.0.113.1", 9, upstream_unix=str(sock))
    port = relay.start()
    got, rtt_s = _round_trip(port, b"ping")
    assert got == b"ping" and rtt_s >= 0.2  # 0.1 s each way
    relay.stop()
    ps.close()


def test_a_missing_forwarder_closes_the_phone_connection(tmp_path: Path) -> None:
    relay = PhoneRelay("P1", "203.0.113.1", 9, upstream_unix=str(tmp_path / "none.sock"))
    port = relay.start()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as phone:
        phone.settimeout(10)
        assert phone.recv(1) == b""
    relay.stop()


def test_bad_arguments_exit_2(tmp_path: Path, capsys: object) -> None:
    assert main(["--listen-unix", str(tmp_path / "s"), "--connect", "nohostport"]) == 2
