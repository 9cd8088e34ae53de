"""An unrooted phone through the Termux listener (``termux-agent.sh serve``), on the fake adb
server.

The phone is stock: its adb shell has no Python and may not send Termux's RUN_COMMAND intent.
The test plays the user: it "types" ``sh /data/local/tmp/testbed/termux-agent.sh serve`` in the
fake Termux (the pushed script, a real /bin/sh and python process), which dials the phone's
control port through the fake's reverse forwarding to the bridge. Another app on the phone
impersonates the listener; the bridge finds its uid in the phone's socket table (the fake builds
``/proc/net/tcp`` from this host's, with the owners' uids) and refuses it. The real ``adb``
client reads the same table and the reverse rules from the fake.

`testbed adb doctor` and `testbed adb measure` run through the command line's entry point
(``testbed.cli.main``) in this process. Before the user starts the listener, nothing can dial the
control port, so there the wait for it (5 s for the doctor, 10 s for measure) is 0.5 s: it ends
empty however long it is. Every wait for a listener or an app that does dial is the command's own.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from testbed.adb_bridge import AdbBridge, agent_package
from testbed.adb_bridge import doctor as doctor_module
from testbed.adb_bridge import measure as measure_module
from testbed.adb_bridge.doctor import Doctor, ThrowawayPS
from testbed.adb_bridge.termux_control import parse_proc_net_tcp
from testbed.runlog import read_jsonl
from tests.conftest import (
    host_cmdlines,
    killed_at_exit,
    reference_losses,
    run_dir_of,
    start_up,
    tiny_topology,
    wait_for,
)
from tests.fakes.adb_phones import termux_phone
from tests.fakes.fake_adb import (
    OTHER_APP_UID,
    TERMUX_UID,
    FakeAdbServer,
    free_port_base,
    phone_pids,
)

pytestmark = pytest.mark.integration
SERIAL = "STOCK1"
ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

# Another app that speaks the listener's hello and records whatever it is sent.
IMPOSTOR = r"""
import json, socket, sys, time
port, out = int(sys.argv[1]), sys.argv[2]
hello = {"hello": "testbed-termux", "protocol": 1, "uid": 10999, "pid": 1, "python": "3",
         "numpy": "2", "grpc": "1", "agent_pid": None}
while True:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        time.sleep(0.2)
        continue
    s.sendall((json.dumps(hello) + "\n").encode())
    with open(out, "ab") as f:
        while True:
            try:
                data = s.recv(65536)
            except OSError:
                break
            if not data:
                break
            f.write(data)
            f.flush()
    s.close()
    time.sleep(0.2)
"""


@pytest.fixture
def fake_adb_server() -> Iterator[FakeAdbServer]:
    server = FakeAdbServer().start()
    yield server
    server.stop()


def plug(server: FakeAdbServer, tmp_path: Path) -> Any:
    phone = termux_phone(SERIAL, tmp_path / "phone", tmp_path / "termux", env=ENV,
                         shell_may_send=False)
    phone.same_ports = True
    return server.plug(phone)


NO_LISTENER_S = 0.5  # the wait for a listener before anything can dial the control port


RunCli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def testbed_cli(monkeypatch: pytest.MonkeyPatch, cli_here: RunCli) -> RunCli:
    """``testbed_cli(adb_port, *argv, listener_s=None)``: `testbed ARGV` with the adb server
    port in the environment, through the command line's entry point: its exit code and output.
    ``listener_s`` is how long the doctor or measure waits for the Termux listener (None: the
    command's own wait)."""
    def run(port: int, *argv: str, listener_s: float | None = None
            ) -> subprocess.CompletedProcess[str]:
        with monkeypatch.context() as m:
            if listener_s is not None:
                @dataclass
                class ShortDoctor(Doctor):
                    listener_timeout_s: float = listener_s

                class ShortRunner(measure_module.AdbGemmRunner):
                    def __init__(self, device: Any, **kwargs: Any) -> None:
                        super().__init__(device, **kwargs, listener_wait_s=listener_s)

                m.setattr(doctor_module, "Doctor", ShortDoctor)
                m.setattr(measure_module, "AdbGemmRunner", ShortRunner)
            return cli_here(*argv, env={"ANDROID_ADB_SERVER_PORT": str(port)})
    return run


def doctor(testbed_cli: RunCli, port: int, phone_port: int, *args: str,
           listener_s: float | None = None) -> subprocess.CompletedProcess[str]:
    return testbed_cli(port, "adb", "doctor", SERIAL, "--phone-port", str(phone_port), *args,
                       listener_s=listener_s)


def test_doctor_asks_for_the_listener_then_passes_through_it(
        fake_adb_server: FakeAdbServer, testbed_cli: RunCli, tmp_path: Path) -> None:
    phone = plug(fake_adb_server, tmp_path)
    base = free_port_base()
    first = doctor(testbed_cli, fake_adb_server.port, base, "--push", listener_s=NO_LISTENER_S)
    assert first.returncode == 1, first.stdout + first.stderr
    assert ("[FAIL] termux listener: not running, and this phone does not let the adb shell "
            "send Termux's RUN_COMMAND intent") in first.stdout, first.stdout
    assert (f"fix: in Termux run `sh /data/local/tmp/testbed/termux-agent.sh serve "
            f"127.0.0.1:{base + 2}` (once; leave it running)") in first.stdout, first.stdout
    # The user types the command the doctor printed; the doctor pushed the script it runs.
    fake_adb_server.termux_serve(SERIAL, f"127.0.0.1:{base + 2}")
    second = doctor(testbed_cli, fake_adb_server.port, base, "--push")
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"[ok] termux listener: `sh /data/local/tmp/testbed/termux-agent.sh serve " \
           f"127.0.0.1:{base + 2}` is connected as uid {TERMUX_UID}" in second.stdout
    for check in ("termux python", "agent version", "join/leave"):
        assert f"[ok] {check}:" in second.stdout, (check, second.stdout)
    assert "numpy" in second.stdout and "the phone can compute tiles" in second.stdout
    # Android refused the intent to the adb shell each time; the token never went to a file.
    assert phone.termux.intents == []
    assert not [p for p, _ in phone.pushes if "/token-" in p]


def test_doctor_names_an_app_that_holds_the_control_port(
        fake_adb_server: FakeAdbServer, testbed_cli: RunCli, tmp_path: Path) -> None:
    plug(fake_adb_server, tmp_path)
    base = free_port_base()
    got = tmp_path / "impostor.bin"
    fake_adb_server.run_app(SERIAL, [sys.executable, "-c", IMPOSTOR, str(base + 2), str(got)])
    done = doctor(testbed_cli, fake_adb_server.port, base, "--push")
    assert done.returncode == 1, done.stdout + done.stderr
    assert (f"[FAIL] termux listener: uid {OTHER_APP_UID} (not Termux, uid {TERMUX_UID}) is "
            f"connected to the control port 127.0.0.1:{base + 2}") in done.stdout, done.stdout
    assert f"adb shell pm list packages --uid {OTHER_APP_UID}" in done.stdout
    assert not got.exists() or got.read_bytes() == b""  # refused: it was sent nothing


def test_doctor_names_an_app_that_took_the_control_port_first(
        fake_adb_server: FakeAdbServer, testbed_cli: RunCli, tmp_path: Path) -> None:
    plug(fake_adb_server, tmp_path)
    base = free_port_base()
    squat = ("import socket, time; s = socket.socket(); s.bind(('127.0.0.1', %d)); s.listen(); "
             "time.sleep(600)" % (base + 2))
    fake_adb_server.run_app(SERIAL, [sys.executable, "-c", squat])
    wait_for(lambda: _accepts(base + 2), 30, "the app to listen on the control port")
    done = doctor(testbed_cli, fake_adb_server.port, base, "--push")
    assert done.returncode == 1, done.stdout + done.stderr
    assert (f"[FAIL] termux listener: adb reverse tcp:{base + 2} failed (") in done.stdout
    assert f"something on the phone already listens on 127.0.0.1:{base + 2}" in done.stdout
    assert "fix: stop that app, or move the ports" in done.stdout, done.stdout


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_measure_through_the_listener(fake_adb_server: FakeAdbServer, testbed_cli: RunCli,
                                      tmp_path: Path) -> None:
    plug(fake_adb_server, tmp_path)
    base = free_port_base()
    out = tmp_path / "phone.csv"
    argv = ["adb", "measure", SERIAL, "--phone-port", str(base), "--limit", "2", "--repeats",
            "1", "--passes", "1", "--out", str(out)]
    first = testbed_cli(fake_adb_server.port, *argv, listener_s=NO_LISTENER_S)
    assert first.returncode == 1 and not out.exists(), first.stdout + first.stderr
    assert ("no Python that the adb shell can run on this phone, and no Termux listener "
            "connected") in first.stderr
    assert f"in Termux run `sh /data/local/tmp/testbed/termux-agent.sh serve 127.0.0.1:" \
           f"{base + 2}`" in first.stderr
    fake_adb_server.termux_serve(SERIAL, f"127.0.0.1:{base + 2}")
    second = testbed_cli(fake_adb_server.port, *argv)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"2 shapes measured on {SERIAL}" in second.stdout
    rows = [line for line in out.read_text().splitlines() if line and not line.startswith("#")]
    assert len(rows) == 3 and "numpy-" in out.read_text()  # header + 2 shapes; the phone's numpy


def test_bridge_waits_for_the_listener_runs_the_agent_and_refuses_an_impostor(
        fake_adb_server: FakeAdbServer, tmp_path: Path) -> None:
    phone = plug(fake_adb_server, tmp_path)
    base = free_port_base()
    token = "s3cret-" + "9" * 24
    ps = ThrowawayPS(token, hold=True).start()
    events: list[Any] = []
    bridge = AdbBridge("127.0.0.1", fake_adb_server.port, f"127.0.0.1:{ps.port}", token,
                       phone_port=base, telemetry_interval_s=0.3, agent_grace_s=15,
                       listener_grace_s=0.5, on_event=events.append)
    kinds = lambda: [e.kind for e in events]  # noqa: E731
    got = tmp_path / "impostor.bin"
    try:
        bridge.start()
        deadline = time.monotonic() + 60
        while "agent-waiting" not in kinds() and time.monotonic() < deadline:
            time.sleep(0.1)
        waiting = next(e for e in events if e.kind == "agent-waiting")
        assert f"serve 127.0.0.1:{base + 2}" in waiting.data["reason"]
        assert "RUN_COMMAND" in waiting.data["reason"]  # why the listener is needed
        status = bridge.phones()[0]
        assert status.agent_pid is None and status.waiting.startswith("in Termux run")

        fake_adb_server.termux_serve(SERIAL, f"127.0.0.1:{base + 2}")
        assert ps.done.wait(90), kinds()
        started = next(e for e in events if e.kind == "agent-started")
        assert started.data["launcher"] == "termux-serve" and ps.joined == f"adb-{SERIAL.lower()}"
        connected = next(e for e in events if e.kind == "listener-connected")
        assert connected.data["uid"] == os.getuid()  # what the listener says of itself
        pid = started.data["pid"]
        assert pid in phone_pids(phone)
        # The token is on no command line here (the phone's processes are local ones).
        assert not [c for c in host_cmdlines() if token in c]
        # One token file went to the phone: mode 0600 for the adb shell's own python, before
        # the bridge learnt there is none; it is gone, and Termux's (0644) never went.
        assert [m for p, m in phone.push_modes if "/token-" in p] == [0o600]
        assert not [p for p in phone.files if "/token-" in p]

        if shutil.which("adb"):  # the real client sees the rule and the listener's socket
            adb = ["adb", "-H", "127.0.0.1", "-P", str(fake_adb_server.port), "-s", SERIAL]
            rules = subprocess.run(adb + ["reverse", "--list"], capture_output=True, text=True,
                                   timeout=30)
            assert f"tcp:{base + 2}" in rules.stdout, rules.stdout + rules.stderr
            table = subprocess.run(adb + ["shell", "cat", "/proc/net/tcp", "/proc/net/tcp6"],
                                   capture_output=True, text=True, timeout=30)
            listener = [s for s in parse_proc_net_tcp(table.stdout)
                        if s.remote_port == base + 2 and s.live]
            assert [s.uid for s in listener] == [TERMUX_UID], table.stdout

        # Another app impersonates the listener while the agent runs: refused, sent nothing.
        fake_adb_server.run_app(SERIAL, [sys.executable, "-c", IMPOSTOR, str(base + 2),
                                         str(got)])
        deadline = time.monotonic() + 60
        while "listener-refused" not in kinds() and time.monotonic() < deadline:
            time.sleep(0.1)
        refused = next(e for e in events if e.kind == "listener-refused")
        assert refused.data["uids"] == [OTHER_APP_UID], refused.data
        assert bridge.phones()[0].agent_pid == pid  # the agent runs on
    finally:
        bridge.stop()
        ps.stop()
    assert ps.left  # the listener's SIGTERM made the agent leave gracefully
    assert pid not in phone_pids(phone)
    assert not got.exists() or token.encode() not in got.read_bytes()
    assert phone.termux.intents == []  # Android refused the intent: all went by the listener
    assert agent_package.PHONE_DIR + "/termux_serve.py" in phone.files


@pytest.mark.slow
def test_testbed_up_with_a_stock_phone_through_the_listener(fake_adb_server: FakeAdbServer,
                                                            tmp_path: Path) -> None:
    """`testbed up` as a user runs it: the phone waits, the user starts the listener, the phone
    joins the running job's start and computes tiles, the losses are the one-process ones."""
    phone = plug(fake_adb_server, tmp_path)
    base = free_port_base()
    steps = 4
    topology = tiny_topology(
        tmp_path, dtype="float64", steps=steps,
        adb={"enabled": True, "server": f"127.0.0.1:{fake_adb_server.port}",
             "phone_port": base, "telemetry_interval": "300ms"})
    out = tmp_path / "runs"
    proc = start_up(topology, out, "--join-timeout", "120")
    with killed_at_exit(proc):
        run_dir = run_dir_of(out)

        def event(kind: str) -> dict[str, Any] | None:
            path = run_dir / "events.jsonl"
            found = [e for e in read_jsonl(path) if e["event"] == kind] if path.exists() else []
            return found[0] if found else None

        waiting = wait_for(lambda: event("adb_agent_waiting"), 90, "the phone to wait")
        assert waiting["command"].endswith(f"serve 127.0.0.1:{base + 2}")
        fake_adb_server.termux_serve(SERIAL, f"127.0.0.1:{base + 2}")
        started = wait_for(lambda: event("adb_agent_started"), 60, "the agent to start")
        assert started["launcher"] == "termux-serve"
        # The run's token reached the agent in its environment, and no command line.
        environ = Path(f"/proc/{started['pid']}/environ").read_bytes().split(b"\0")
        token = next(v.split(b"=", 1)[1] for v in environ if v.startswith(b"TESTBED_TOKEN="))
        assert len(token) == 32 and not [c for c in host_cmdlines() if token.decode() in c]
        output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    events = read_jsonl(run_dir / "events.jsonl")
    name = f"adb-{SERIAL.lower()}"
    start = next(e for e in events if e["event"] == "training_start")
    assert start["devices"] == start["expected_devices"] == 5  # 4 emulated + the phone
    joins = [e for e in events if e["event"] == "join" and e["device"] == name]
    assert joins and joins[0]["kind"] == "real" and joins[0]["group"] == "adb"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "done"
    assert sum(d["tiles_done"] for d in summary["devices"] if d["device"] == name) > 0
    want, _ = reference_losses(topology, steps)
    got = [s["loss"] for s in read_jsonl(run_dir / "steps.jsonl")]
    assert len(got) == steps
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-8 * abs(w), (g, w)
    assert phone.termux.intents == []


def test_listener_outlives_a_dead_agent_and_a_replug(fake_adb_server: FakeAdbServer,
                                                     tmp_path: Path) -> None:
    """The agent dies: the bridge restarts it through the listener. The cable is pulled and
    plugged back: the listener (still running in Termux) dials the new control port and the
    bridge starts the agent again, without the user doing anything."""
    phone = plug(fake_adb_server, tmp_path)
    base = free_port_base()
    token = "t0ken-" + "4" * 26
    ps = ThrowawayPS(token, hold=True).start()
    events: list[Any] = []
    bridge = AdbBridge("127.0.0.1", fake_adb_server.port, f"127.0.0.1:{ps.port}", token,
                       phone_port=base, telemetry_interval_s=0.3, agent_grace_s=15,
                       listener_grace_s=0.5, on_event=events.append)

    def started() -> list[Any]:
        return [e for e in events if e.kind == "agent-started"]

    try:
        bridge.start()
        serve = fake_adb_server.termux_serve(SERIAL, f"127.0.0.1:{base + 2}")  # once pushed
        wait_for(lambda: len(started()) == 1, 60, "the agent to start")
        first = started()[0].data["pid"]
        os.kill(first, 9)  # the agent dies; Termux's listener stays
        wait_for(lambda: len(started()) == 2, 60, "the agent to be restarted")
        exited = next(e for e in events if e.kind == "agent-exited")
        assert exited.data["pid"] == first
        fake_adb_server.unplug(SERIAL)
        wait_for(lambda: "unplugged" in [e.kind for e in events], 30, "the unplug")
        assert serve.poll() is None  # unplugging the phone does not end Termux's listener
        fake_adb_server.plug(phone)
        wait_for(lambda: len(started()) == 3, 60, "the agent to start after the replug")
        assert [e.data["launcher"] for e in started()] == ["termux-serve"] * 3
        connects = [e for e in events if e.kind == "listener-connected"]
        assert len(connects) == 2  # one per plug: the listener dialled the new rule by itself
        last = started()[-1].data["pid"]
        wait_for(lambda: last in phone_pids(phone), 10, "the new agent in the process list")
    finally:
        bridge.stop()
        ps.stop()
    assert last not in phone_pids(phone)
