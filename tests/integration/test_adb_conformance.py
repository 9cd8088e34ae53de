"""The fake adb server against two real clients (adbutils, Debian's adb), then the bridge on it.

The same scenarios run through adbutils and through the real ``adb`` binary pointed at the fake
with ``-H 127.0.0.1 -P PORT``: if the fake drifted from the real protocol, the real client would
notice. The bridge tests then run the whole phone path: plug -> properties -> relay -> ``adb
reverse`` -> agent zip pushed with sync -> started over shell (a real local process that dials the
phone port through the fake's reverse table) -> telemetry -> unplug.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterator

import adbutils
import pytest

from testbed.adb_bridge import AdbBridge, RelayShaping
from testbed.adb_bridge.agent_package import PHONE_DIR, build_agent_zip
from testbed.adb_bridge.doctor import state_problem
from tests.conftest import wait_for
from tests.fakes.adb_phones import DATA, Events, recorded_phone
from tests.fakes.adb_phones import agent_phone as shared_agent_phone
from tests.fakes.fake_adb import FakeAdbServer, FakePhone, LocalProcessCommand, ShellResult

pytestmark = pytest.mark.integration
ADB = shutil.which("adb")


@pytest.fixture
def fake_adb_server() -> Iterator[FakeAdbServer]:
    server = FakeAdbServer().start()
    yield server
    server.stop()


# ----------------------------------------------------------------------------------------------
# Two clients behind one interface, so each scenario runs through both.

class Client:
    name = ""

    def __init__(self, port: int):
        self.port = port

    def version(self) -> int: ...
    def devices(self, long: bool = False) -> dict[str, str]: ...
    def shell(self, serial: str, cmd: str) -> tuple[int, str]: ...
    def reverse(self, serial: str, remote: str, local: str) -> None: ...
    def reverse_list(self, serial: str) -> list[tuple[str, str]]: ...
    def reverse_remove(self, serial: str, remote: str) -> bool: ...
    def push(self, serial: str, data: bytes, path: str, tmp: Path) -> None: ...


class AdbutilsClient(Client):
    name = "adbutils"

    def __init__(self, port: int):
        super().__init__(port)
        self.c = adbutils.AdbClient("127.0.0.1", port)

    def version(self) -> int:
        return self.c.server_version()

    def devices(self, long: bool = False) -> dict[str, str]:
        if long:
            return {d.serial: d.state for d in self.c.list(extended=True)}
        return {d.serial: d.state for d in self.c.list()}

    def shell(self, serial: str, cmd: str) -> tuple[int, str]:
        r = self.c.device(serial).shell2(cmd, v2=True)
        return r.returncode, r.stdout

    def reverse(self, serial: str, remote: str, local: str) -> None:
        self.c.device(serial).reverse(remote, local)

    def reverse_list(self, serial: str) -> list[tuple[str, str]]:
        return [(r.remote, r.local) for r in self.c.device(serial).reverse_list()]

    def reverse_remove(self, serial: str, remote: str) -> bool:
        try:
            self.c.device(serial).reverse_remove(remote)
            return True
        except adbutils.AdbError:
            return False

    def push(self, serial: str, data: bytes, path: str, tmp: Path) -> None:
        self.c.device(serial).sync.push(data, path)


class RealAdbClient(Client):
    name = "adb"

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([ADB or "adb", "-H", "127.0.0.1", "-P", str(self.port), *args],
                              capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)

    def version(self) -> int:
        # `adb version` prints the client's version only; `adb devices` makes the client check
        # the server's version (host:version) and fail loudly if it does not match.
        r = self.run("devices")
        assert r.returncode == 0, r.stderr
        return 41

    def devices(self, long: bool = False) -> dict[str, str]:
        r = self.run("devices", *(["-l"] if long else []))
        assert r.returncode == 0, r.stderr
        out = {}
        for line in r.stdout.splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 2:
                out[parts[0]] = parts[1]
        return out

    def shell(self, serial: str, cmd: str) -> tuple[int, str]:
        r = self.run("-s", serial, "shell", cmd)
        return r.returncode, r.stdout

    def reverse(self, serial: str, remote: str, local: str) -> None:
        r = self.run("-s", serial, "reverse", remote, local)
        assert r.returncode == 0, r.stderr

    def reverse_list(self, serial: str) -> list[tuple[str, str]]:
        r = self.run("-s", serial, "reverse", "--list")
        assert r.returncode == 0, r.stderr
        return [(p[1], p[2]) for p in (line.split() for line in r.stdout.splitlines())
                if len(p) == 3]

    def reverse_remove(self, serial: str, remote: str) -> bool:
        return self.run("-s", serial, "reverse", "--remove", remote).returncode == 0

    def push(self, serial: str, data: bytes, path: str, tmp: Path) -> None:
        src = tmp / "payload.bin"
        src.write_bytes(data)
        r = self.run("-s", serial, "push", str(src), path)
        assert r.returncode == 0, r.stderr


def _client_param(name: str) -> object:
    marks = [pytest.mark.skipif(ADB is None, reason="no adb binary on PATH (Debian package "
                                                    "'adb')")] if name == "adb" else []
    return pytest.param(name, marks=marks, id=name)


@pytest.fixture(params=[_client_param("adbutils"), _client_param("adb")])
def client(request: pytest.FixtureRequest, fake_adb_server: FakeAdbServer) -> Client:
    cls = AdbutilsClient if request.param == "adbutils" else RealAdbClient
    return cls(fake_adb_server.port)


# ----------------------------------------------------------------------------------------------
# Conformance scenarios

def test_version_and_device_lists(client: Client, fake_adb_server: FakeAdbServer) -> None:
    fake_adb_server.plug(recorded_phone("PHONE1"))
    fake_adb_server.plug(FakePhone("PHONE2", state="unauthorized"))
    fake_adb_server.plug(FakePhone("PHONE3", state="offline"))
    assert client.version() == 41
    expected = {"PHONE1": "device", "PHONE2": "unauthorized", "PHONE3": "offline"}
    assert client.devices() == expected
    assert client.devices(long=True) == expected
    assert "host:version" in fake_adb_server.requests


def test_unauthorized_then_device(client: Client, fake_adb_server: FakeAdbServer) -> None:
    fake_adb_server.plug(recorded_phone("PHONE1", state="unauthorized"))
    if isinstance(client, AdbutilsClient):
        with pytest.raises(adbutils.AdbError, match="unauthorized"):
            client.shell("PHONE1", "getprop ro.soc.model")
    else:
        assert client.shell("PHONE1", "getprop ro.soc.model")[0] != 0
    fake_adb_server.set_state("PHONE1", "device")
    assert client.shell("PHONE1", "getprop ro.soc.model") == (0, "SM8350\n")


def test_shell_outputs_and_exit_codes(client: Client, fake_adb_server: FakeAdbServer) -> None:
    phone = fake_adb_server.plug(recorded_phone("PHONE1"))
    phone.commands["exit-three"] = ShellResult(stdout=b"partial\n", exit_code=3)
    code, out = client.shell("PHONE1", "dumpsys battery")
    assert code == 0 and out == (DATA / "battery_aosp.txt").read_text()
    assert client.shell("PHONE1", "exit-three") == (3, "partial\n")
    assert client.shell("PHONE1", "no-such-tool")[0] == 127
    assert any(r.startswith("shell,v2") for r in fake_adb_server.requests)


def test_reverse_forward_list_kill(client: Client, fake_adb_server: FakeAdbServer) -> None:
    fake_adb_server.plug(recorded_phone("PHONE1"))
    client.reverse("PHONE1", "tcp:7700", "tcp:40001")
    client.reverse("PHONE1", "tcp:7701", "tcp:40002")
    assert client.reverse_list("PHONE1") == [("tcp:7700", "tcp:40001"), ("tcp:7701", "tcp:40002")]
    assert client.reverse_remove("PHONE1", "tcp:7700")
    assert not client.reverse_remove("PHONE1", "tcp:7700")  # gone: the phone says so
    assert client.reverse_list("PHONE1") == [("tcp:7701", "tcp:40002")]


def test_sync_push(client: Client, fake_adb_server: FakeAdbServer, tmp_path: Path) -> None:
    phone = fake_adb_server.plug(recorded_phone("PHONE1"))
    data = bytes(range(256)) * 700  # > 64 KiB: several DATA chunks
    client.push("PHONE1", data, "/data/local/tmp/blob.bin", tmp_path)
    assert phone.files["/data/local/tmp/blob.bin"][1] == data


def test_reverse_carries_a_real_connection(client: Client, fake_adb_server: FakeAdbServer
                                           ) -> None:
    phone = fake_adb_server.plug(recorded_phone("PHONE1"))
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(1)
    client.reverse("PHONE1", "tcp:7700", f"tcp:{host.getsockname()[1]}")
    with socket.create_connection(("127.0.0.1", phone.reverse_ports[7700]), timeout=5) as app:
        peer, _ = host.accept()
        app.sendall(b"ping")
        assert peer.recv(4) == b"ping"
        peer.sendall(b"pong")
        assert app.recv(4) == b"pong"
        peer.close()
    host.close()


def _track_adbutils(port: int, seen: list[tuple[str, str]], stop: threading.Event) -> None:
    try:
        for event in adbutils.AdbClient("127.0.0.1", port).track_devices():
            seen.append((event.serial, event.status))
            if stop.is_set():
                return
    except (adbutils.AdbError, OSError):
        return


def test_track_devices(client: Client, fake_adb_server: FakeAdbServer) -> None:
    """Every change reaches the tracker (each step waits until the previous one was seen)."""
    seen: list[tuple[str, str]] = []
    stop = threading.Event()
    text: list[str] = []
    proc = None
    if isinstance(client, RealAdbClient):
        proc = subprocess.Popen([ADB or "adb", "-H", "127.0.0.1", "-P",
                                 str(fake_adb_server.port), "track-devices"],
                                stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)

        def read() -> None:
            assert proc is not None and proc.stdout is not None
            for line in proc.stdout:
                text.append(line)
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
    else:
        threading.Thread(target=_track_adbutils, args=(fake_adb_server.port, seen, stop),
                         daemon=True).start()

    def observed(state: str) -> Callable[[], bool]:
        # The real client buffers its stdout on a pipe, so for it wait until the fake has
        # written the list; adbutils' events can be watched directly.
        blocks = fake_adb_server.track_blocks_sent
        if proc is not None:
            return lambda: fake_adb_server.track_blocks_sent > blocks
        return lambda: ("PHONE1", state) in seen

    wait_for(lambda: fake_adb_server.track_blocks_sent >= 1)  # the initial (empty) list
    for change, state in ((lambda: fake_adb_server.plug(FakePhone("PHONE1", state="unauthorized")),
                           "unauthorized"),
                          (lambda: fake_adb_server.set_state("PHONE1", "device"), "device"),
                          (lambda: fake_adb_server.set_state("PHONE1", "offline"), "offline")):
        seen_it = observed(state)
        change()
        wait_for(seen_it)
    seen_it = observed("absent")
    fake_adb_server.unplug("PHONE1")
    wait_for(seen_it)
    if proc is not None:
        fake_adb_server.stop()  # the real client exits when the server closes the tracker
        proc.wait(timeout=10)
        reader.join(timeout=10)
        out = "".join(text)
        # `adb track-devices` prints each list as the protocol block: 4 hex digits + lines; the
        # empty list after the unplug is "0000".
        assert "PHONE1\tunauthorized" in out and "PHONE1\tdevice" in out
        assert "PHONE1\toffline" in out and out.rstrip("\n").endswith("0000")
    else:
        wait_for(observed("absent") and (lambda: len(seen) == 6))
        stop.set()
        assert seen == [("PHONE1", "unauthorized"), ("PHONE1", "absent"), ("PHONE1", "device"),
                        ("PHONE1", "absent"), ("PHONE1", "offline"), ("PHONE1", "absent")]


def test_server_restart(client: Client, fake_adb_server: FakeAdbServer) -> None:
    fake_adb_server.plug(recorded_phone("PHONE1"))
    client.reverse("PHONE1", "tcp:7700", "tcp:40001")
    fake_adb_server.restart(down_s=0.2)
    assert client.devices() == {"PHONE1": "device"}
    assert client.reverse_list("PHONE1") == []  # reverse rules die with the server's transport
    assert client.shell("PHONE1", "getprop ro.soc.model") == (0, "SM8350\n")


# ----------------------------------------------------------------------------------------------
# The bridge on the fake server

FAKE_AGENT = textwrap.dedent('''
    """A stand-in agent: joins the stand-in PS with its name, leaves on SIGTERM."""
    import signal, socket, sys, time
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    host, port = args["--ps"].rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    token = open(args["--token-file"]).read().strip()
    s.sendall(("join " + args["--name"] + " " + token + "\\n").encode())
    def leave(*_):
        s.sendall(("leave " + args["--name"] + "\\n").encode()); s.close(); sys.exit(0)
    signal.signal(signal.SIGTERM, leave)
    while s.recv(4096):
        pass
''')


class StandInPS:
    """A TCP server that records what agents send and when their connections end."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.lines: list[str] = []
        self.peers: list[tuple[str, int]] = []
        self.closed = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.peers.append(peer)
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while True:
                data = conn.recv(4096)
                if not data:
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self.lines.append(line.decode())
        except OSError:
            pass
        self.closed += 1

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def agent_zip(tmp_path: Path) -> bytes:
    root = tmp_path / "src"
    (root / "testbed" / "agent").mkdir(parents=True)
    (root / "testbed" / "__init__.py").write_text("")
    (root / "testbed" / "agent" / "__init__.py").write_text("")
    (root / "testbed" / "agent" / "__main__.py").write_text(FAKE_AGENT)
    return build_agent_zip(root)


def agent_phone(serial: str, tmp_path: Path, **kwargs: object) -> FakePhone:
    """A phone whose start script really runs the pushed agent zip as a local process."""
    return shared_agent_phone(serial, tmp_path / serial, tmp_path / "logs", **kwargs)


@pytest.fixture
def stand_in_ps() -> Iterator[StandInPS]:
    ps = StandInPS()
    yield ps
    ps.close()


def make_bridge(server: FakeAdbServer, ps: StandInPS, zip_bytes: bytes, events: Events,
                tmp_path: Path, **kwargs: object) -> AdbBridge:
    return AdbBridge("127.0.0.1", server.port, f"127.0.0.1:{ps.port}", "tok3n",
                     telemetry_interval_s=0.2, agent_zip=zip_bytes, on_event=events,
                     devices_jsonl=tmp_path / "devices.jsonl", crosscheck_s=1.0,
                     **kwargs)  # type: ignore[arg-type]


def test_bridge_phone_joins_reports_and_leaves_on_unplug(
        fake_adb_server: FakeAdbServer, stand_in_ps: StandInPS, agent_zip: bytes,
        tmp_path: Path) -> None:
    events = Events()
    fake_adb_server.plug(agent_phone("PHONE1", tmp_path, state="unauthorized"))
    with make_bridge(fake_adb_server, stand_in_ps, agent_zip, events, tmp_path) as bridge:
        wait_for(lambda: "plugged" in events.kinds())
        assert "agent-started" not in events.kinds()  # unauthorized: nothing may start yet
        fake_adb_server.set_state("PHONE1", "device")
        wait_for(lambda: "join adb-phone1 tok3n" in stand_in_ps.lines)
        ready = events.first("ready")
        assert ready.data["profile"] == "snapdragon888" and ready.data["soc"] == "sm8350"
        phone = fake_adb_server.phones["PHONE1"]
        with zipfile.ZipFile(phone.local_path(f"{PHONE_DIR}/agent.zip")) as zf:  # type: ignore
            assert "__main__.py" in zf.namelist()
        # The PS connection came through this phone's relay, and the bridge can say so.
        wait_for(lambda: stand_in_ps.peers and bridge.relay_for(stand_in_ps.peers[0]))
        assert bridge.relay_for(stand_in_ps.peers[0]) == "PHONE1"
        wait_for(lambda: "telemetry" in events.kinds())
        sample = events.first("telemetry").data
        assert sample["battery_level_fraction"] == 0.85 and sample["thermal_status"] == 2
        assert sample["battery_current_a"] == pytest.approx(1.25)  # µA, negative, charging
        assert (tmp_path / "devices.jsonl").read_text().count('"adb-telemetry"') >= 1
        # The phone loses its reverse rule: the bridge puts it back.
        fake_adb_server.drop_reverse("PHONE1")
        wait_for(lambda: "reverse-reapplied" in events.kinds())
        assert 7700 in phone.reverse_ports
        closed_before = stand_in_ps.closed
        fake_adb_server.unplug("PHONE1")
        wait_for(lambda: "unplugged" in events.kinds())
        wait_for(lambda: stand_in_ps.closed > closed_before)  # the PS sees the phone go
        assert bridge.phones() == []


def test_bridge_graceful_stop_and_no_python(fake_adb_server: FakeAdbServer,
                                            stand_in_ps: StandInPS, agent_zip: bytes,
                                            tmp_path: Path) -> None:
    events = Events()
    fake_adb_server.plug(agent_phone("PHONE1", tmp_path))
    bare = recorded_phone("PHONE2", getprop="getprop_pixel6.txt")
    bare.exec_hook = lambda phone, cmd: ShellResult(  # the token file's name is random
        stderr=b"testbed: no Python that the adb shell can run on this phone\n", exit_code=3
    ) if cmd.startswith(f"sh {PHONE_DIR}/start-agent.sh --ps 127.0.0.1:7700 --token-file "
                        f"{PHONE_DIR}/token-") and "--name adb-phone2 --kind real" in cmd else None
    fake_adb_server.plug(bare)
    old = recorded_phone("PHONE3", getprop="getprop_old.txt")
    fake_adb_server.plug(old)
    with make_bridge(fake_adb_server, stand_in_ps, agent_zip, events, tmp_path) as bridge:
        wait_for(lambda: "join adb-phone1 tok3n" in stand_in_ps.lines)
        wait_for(lambda: events.kinds("PHONE2").count("agent-failed") == 1
                 and events.kinds("PHONE3").count("agent-failed") == 1)
        reasons = {e.serial: e.data["reason"] for e in events.items if e.kind == "agent-failed"}
        assert reasons["PHONE2"].startswith("no Python that the adb shell can run")
        assert "too old" in reasons["PHONE3"]
        status = {p.serial: p for p in bridge.phones()}
        assert status["PHONE2"].profile is None
        assert "measured live" in status["PHONE2"].profile_reason
        assert status["PHONE3"].problem
    # stop(): SIGTERM to the agent, which says goodbye (graceful leave); reverse rules removed.
    wait_for(lambda: "leave adb-phone1" in stand_in_ps.lines)
    assert fake_adb_server.phones["PHONE1"].reverses == {}


def test_bridge_survives_adb_server_restart(fake_adb_server: FakeAdbServer,
                                            stand_in_ps: StandInPS, agent_zip: bytes,
                                            tmp_path: Path) -> None:
    events = Events()
    fake_adb_server.plug(agent_phone("PHONE1", tmp_path))
    with make_bridge(fake_adb_server, stand_in_ps, agent_zip, events, tmp_path,
                     backoff_initial_s=0.05, backoff_max_s=0.4) as bridge:
        wait_for(lambda: stand_in_ps.lines.count("join adb-phone1 tok3n") == 1)
        fake_adb_server.restart(down_s=0.5)
        wait_for(lambda: "tracker-lost" in events.kinds())
        wait_for(lambda: stand_in_ps.lines.count("join adb-phone1 tok3n") == 2)
        assert events.kinds("PHONE1").count("agent-started") == 2
        assert bridge.tracker.reconnects >= 1


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_bridge_shapes_the_relay(fake_adb_server: FakeAdbServer, stand_in_ps: StandInPS,
                                 tmp_path: Path) -> None:
    """A relay with 200 ms one-way delay makes a round trip through it take >= 400 ms.

    Robust under load: both ends read until they have all 5 bytes (a relay may pass a message
    on in pieces), and the byte counters are read once the relay has counted (it counts a chunk
    after handing it on, so the echo can reach the client a moment before the count moves).
    """
    from testbed.adb_bridge.relay import PhoneRelay

    echo = socket.socket()
    echo.bind(("127.0.0.1", 0))
    echo.listen(1)

    def serve() -> None:
        conn, _ = echo.accept()
        conn.sendall(_recv_exactly(conn, 5))
        conn.close()
    threading.Thread(target=serve, daemon=True).start()
    relay = PhoneRelay("PHONE1", "127.0.0.1", echo.getsockname()[1],
                       RelayShaping(down_bps=1e6, up_bps=1e6, delay_s=0.2))
    port = relay.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            start = time.monotonic()
            s.sendall(b"hello")
            assert _recv_exactly(s, 5) == b"hello"
            assert time.monotonic() - start >= 0.4
        wait_for(lambda: relay.bytes_up == 5 and relay.bytes_down == 5)
        time.sleep(0.05)
        assert (relay.bytes_up, relay.bytes_down) == (5, 5)  # exactly: nothing counted twice
    finally:
        relay.stop()
        echo.close()


# ----------------------------------------------------------------------------------------------
# The command line on the fake server

def main(argv: list[str]) -> int:
    """``testbed adb ...`` through this part's own add_parser (independent of other parts)."""
    import argparse

    from testbed.adb_bridge.cli import add_parser

    parser = argparse.ArgumentParser(prog="testbed")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))

def test_cli_devices_lists_state_profile_reverse(fake_adb_server: FakeAdbServer,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    fake_adb_server.plug(recorded_phone("PHONE1"))
    fake_adb_server.plug(FakePhone("PHONE2", state="unauthorized"))
    AdbutilsClient(fake_adb_server.port).reverse("PHONE1", "tcp:7700", "tcp:40001")
    assert main(["adb", "devices", "--adb", f"127.0.0.1:{fake_adb_server.port}", "--json"]) == 0
    rows = {r["serial"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["PHONE1"]["profile"] == "snapdragon888"
    assert rows["PHONE1"]["reverse"] == "tcp:7700 -> tcp:40001"
    # every row has the same keys: what is not known of a phone not in state device is null,
    # and its problem says what to do about its state, as the table does
    assert set(rows["PHONE2"]) == set(rows["PHONE1"])
    assert {k: v for k, v in rows["PHONE2"].items() if v is not None} == {
        "serial": "PHONE2", "state": "unauthorized", "problem": state_problem("unauthorized", "")}
    assert "USB debugging is not allowed" in rows["PHONE2"]["problem"]
    assert main(["adb", "devices", "--adb", f"127.0.0.1:{fake_adb_server.port}"]) == 0
    table = capsys.readouterr().out
    assert "PHONE1" in table and "M2011K2G" in table and "unauthorized" in table


def test_cli_measure_runs_the_sweep_on_the_phone(fake_adb_server: FakeAdbServer, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The timing script is pushed with sync and really runs (numpy here, as on a phone); its
    figures go to a file named for the phone unless --out names one."""
    from testbed.perf_model.measurements import read_measurements

    root = tmp_path / "phone"

    def argv(phone: FakePhone, match: object) -> list[str]:
        return [sys.executable, str(root / PHONE_DIR.lstrip("/") / "time_gemm.py"),
                *match.group(1).split()]  # type: ignore[attr-defined]

    hook = LocalProcessCommand(r"^sh /data/local/tmp/testbed/run-python\.sh \S+time_gemm\.py "
                               r"(.*)$", argv, wait=True)
    fake_adb_server.plug(recorded_phone("PHONE1", root_dir=root, exec_hook=hook))
    monkeypatch.chdir(tmp_path)
    assert main(["adb", "measure", "PHONE1", "--adb", f"127.0.0.1:{fake_adb_server.port}",
                 "--limit", "3", "--repeats", "2"]) == 0
    out = tmp_path / "adb_measurements-PHONE1.csv"
    rows = read_measurements(out)
    assert len(rows) == 3 and all(r.seconds > 0 and r.device == "adb-phone1" for r in rows)
    # A phone without Python: a clear failure, exit 1.
    fake_adb_server.plug(recorded_phone("PHONE2"))
    fake_adb_server.phones["PHONE2"].exec_hook = lambda phone, cmd: (
        ShellResult(stderr=b"testbed: no Python that the adb shell can run\n", exit_code=3)
        if "run-python.sh" in cmd else None)
    assert main(["adb", "measure", "PHONE2", "--adb", f"127.0.0.1:{fake_adb_server.port}",
                 "--out", str(tmp_path / "n.csv")]) == 1
    assert "no Python that the adb shell can run" in capsys.readouterr().err
