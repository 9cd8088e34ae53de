"""The bridge's phone sessions when a phone misbehaves, on the fake adb server (the real ADB host
protocol): a phone without shell protocol v2, a command slower than ``shell_timeout_s``, a bug
in the session, the phone port taken on the phone, an unusable API level, two serials that
sanitize alike, and phones that stop answering while the bridge stops.

Each phone's "agent" is a local process that sleeps (started by the start script's command, so
``kill -0 PID`` on the phone reaches it): a session is watched without a PS.
"""

from __future__ import annotations

import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from testbed.adb_bridge import bridge as bridge_mod
from testbed.adb_bridge import parsers, telemetry
from testbed.adb_bridge.bridge import AdbBridge
from tests.conftest import wait_for
from tests.fakes.adb_phones import START_PATTERN, Events, recorded_phone
from tests.fakes.fake_adb import FakeAdbServer, FakePhone, LocalProcessCommand, ShellResult

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
SHELL_TIMEOUT_S = 0.5


def sleeper_phone(serial: str, **kwargs: Any) -> FakePhone:
    """A recorded phone whose start script starts a local process that sleeps."""
    hook = LocalProcessCommand(START_PATTERN, lambda phone, match: SLEEPER)
    return recorded_phone(serial, exec_hook=hook, **kwargs)


def with_hook(phone: FakePhone, before: Callable[[str], None]) -> FakePhone:
    """The phone runs ``before(command)`` ahead of each command (to stall it)."""
    inner = phone.exec_hook

    def hook(p: FakePhone, command: str) -> ShellResult | None:
        before(command)
        return inner(p, command) if inner is not None else None
    phone.exec_hook = hook
    return phone


@pytest.fixture
def fake_adb_server() -> Iterator[FakeAdbServer]:
    with FakeAdbServer() as server:
        yield server


def bridge_on(server: FakeAdbServer, events: Events, **kwargs: Any) -> AdbBridge:
    """A bridge on the fake server; its PS address is never dialled (no agent dials it)."""
    settings: dict[str, Any] = dict(telemetry_interval_s=0.1, shell_timeout_s=SHELL_TIMEOUT_S,
                                    agent_zip=b"agent", on_event=events, crosscheck_s=1.0,
                                    agent_grace_s=1.0)
    return AdbBridge("127.0.0.1", server.port, "127.0.0.1:9", "tok3n", **{**settings, **kwargs})


def test_a_phone_without_shell_v2_starts_its_agent_and_reports_telemetry(
        fake_adb_server: FakeAdbServer) -> None:
    """adbd of Android 6 and older has no shell protocol v2: stdout must still be read."""
    phone = fake_adb_server.plug(sleeper_phone("OLD6", features="cmd"))
    events = Events()
    with bridge_on(fake_adb_server, events):
        wait_for(lambda: events.of("telemetry"))
    assert events.of("ready")[0].data["soc"] == "sm8350"  # getprop was read
    assert [e.data["pid"] for e in events.of("agent-started")] == [phone.processes[0].pid]
    sample = events.of("telemetry")[0].data
    assert sample["battery_level_fraction"] == 0.85 and sample["thermal_status"] == 2
    assert not events.of("agent-failed")


def test_a_slow_command_costs_one_poll_and_the_session_goes_on(
        fake_adb_server: FakeAdbServer) -> None:
    """One `dumpsys thermalservice` slower than shell_timeout_s: a poll-failed event naming the
    phone and the command; telemetry, agent-exit detection and restarts go on."""
    stall = threading.Event()

    def stall_thermal_once(command: str) -> None:
        if command == telemetry.CMD_THERMAL and stall.is_set():
            stall.clear()
            time.sleep(SHELL_TIMEOUT_S * 3)
    phone = fake_adb_server.plug(with_hook(sleeper_phone("STALL1"), stall_thermal_once))
    events = Events()
    with bridge_on(fake_adb_server, events) as bridge:
        wait_for(lambda: events.of("agent-started") and events.of("telemetry"))
        stall.set()
        wait_for(lambda: events.of("poll-failed"))
        failed = events.of("poll-failed")[0]
        assert failed.serial == "STALL1" and failed.data["command"] == telemetry.CMD_THERMAL
        assert f"phone STALL1: `{telemetry.CMD_THERMAL}` did not finish" in failed.data["reason"]
        samples = len(events.of("telemetry"))
        wait_for(lambda: len(events.of("telemetry")) >= samples + 2)  # polling goes on
        phone.processes[0].kill()  # the agent dies: noticed and restarted
        wait_for(lambda: len(events.of("agent-started")) == 2)
        assert events.of("agent-exited")[0].data["pid"] == phone.processes[0].pid
        assert bridge.phones()[0].agent_pid == phone.processes[1].pid
    assert not events.of("agent-failed")


def test_a_phone_that_is_always_slow_warns_once_a_while(fake_adb_server: FakeAdbServer) -> None:
    def stall_thermal(command: str) -> None:
        if command == telemetry.CMD_THERMAL:
            time.sleep(SHELL_TIMEOUT_S * 2)
    phone = fake_adb_server.plug(with_hook(sleeper_phone("SLOW1"), stall_thermal))
    events = Events()
    with bridge_on(fake_adb_server, events):
        wait_for(lambda: phone.shell_log.count(telemetry.CMD_THERMAL) >= 3, timeout_s=30)
        assert len(events.of("poll-failed")) == 1  # not one per poll (one a minute at most)
    assert not events.of("telemetry") and not events.of("agent-failed")


def stall_once(pattern: str) -> tuple[threading.Event, Callable[[str], None]]:
    """A hook that stalls the next command matching ``pattern`` past SHELL_TIMEOUT_S, once the
    returned event is set (set at once: the first such command)."""
    armed = threading.Event()

    def before(command: str) -> None:
        if re.match(pattern, command) and armed.is_set():
            armed.clear()
            time.sleep(SHELL_TIMEOUT_S * 3)
    return armed, before


def test_a_fault_while_setting_the_phone_up_is_tried_again(
        fake_adb_server: FakeAdbServer) -> None:
    """A first `getprop` too slow (a phone busy just after it was authorized): agent-failed
    saying when the next try comes; then the phone is set up and its agent runs."""
    armed, before = stall_once(r"^getprop$")
    armed.set()
    phone = fake_adb_server.plug(with_hook(sleeper_phone("BUSY1"), before))
    events = Events()
    with bridge_on(fake_adb_server, events) as bridge:
        wait_for(lambda: events.of("agent-started"))
        failed = events.of("agent-failed")
        assert len(failed) == 1 and failed[0].data["retry_in_s"] == bridge_mod.SETUP_RETRY_FIRST_S
        assert failed[0].data["reason"].startswith("setting up the phone failed: phone BUSY1: "
                                                   "`getprop` did not finish")
        assert "trying again in 2 s" in failed[0].data["reason"]
        assert len(events.of("ready")) == 1
        assert bridge.phones()[0].problem == ""
        assert bridge.phones()[0].agent_pid == phone.processes[0].pid


def test_a_fault_while_restarting_the_agent_is_tried_again(
        fake_adb_server: FakeAdbServer) -> None:
    """The agent died, and the start script that would restart it stalls: tried again with the
    same relay and reverse rule (the phone is not set up twice)."""
    armed, before = stall_once(START_PATTERN)
    phone = fake_adb_server.plug(with_hook(sleeper_phone("RESTART1"), before))
    events = Events()
    with bridge_on(fake_adb_server, events) as bridge:
        wait_for(lambda: events.of("agent-started"))
        relay_port = bridge.phones()[0].relay_port
        armed.set()
        phone.processes[0].kill()
        wait_for(lambda: len(events.of("agent-started")) == 2)
        failed = events.of("agent-failed")
        assert len(failed) == 1
        assert failed[0].data["reason"].startswith("starting the agent failed: phone RESTART1: ")
        assert bridge.phones()[0].relay_port == relay_port and len(events.of("ready")) == 1
        assert bridge.phones()[0].agent_pid == phone.processes[-1].pid


def test_a_bug_in_a_session_is_agent_failed_not_a_dead_thread(
        fake_adb_server: FakeAdbServer, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(text: str) -> dict[str, str]:
        raise ValueError("a parser bug")
    monkeypatch.setattr(parsers, "parse_getprop", broken)
    died: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(str(args.exc_value)))
    fake_adb_server.plug(sleeper_phone("BUG1"))
    events = Events()
    with bridge_on(fake_adb_server, events) as bridge:
        wait_for(lambda: events.of("agent-failed"))
        reason = events.of("agent-failed")[0].data["reason"]
        assert "ValueError: a parser bug" in reason and "bug in testbed" in reason
        assert bridge.phones()[0].problem == reason
    assert died == []


def test_the_phone_port_taken_on_the_phone_is_agent_failed_with_the_fix(
        fake_adb_server: FakeAdbServer) -> None:
    """Another app listens on the phone port: `adb reverse` cannot bind it."""
    with socket.socket() as other_app:  # same_ports: the phone's port D is this host's D
        other_app.bind(("127.0.0.1", 0))
        other_app.listen(1)
        port = other_app.getsockname()[1]
        phone = fake_adb_server.plug(sleeper_phone("TAKEN1", same_ports=True))
        events = Events()
        with bridge_on(fake_adb_server, events, phone_port=port) as bridge:
            wait_for(lambda: events.of("agent-failed"))
            reason = events.of("agent-failed")[0].data["reason"]
            assert f"the phone port {port} is in use on the phone" in reason
            assert "Address already in use" in reason and "adb.phone_port" in reason
            assert bridge.phones()[0].problem == reason
            time.sleep(0.5)  # a few polls: the rule the bridge never set is not retried
            assert not events.of("agent-started") and not events.of("poll-failed")
    assert phone.processes == []


def test_an_unusable_api_level_is_agent_failed(fake_adb_server: FakeAdbServer) -> None:
    phone = sleeper_phone("SDK1")
    phone.commands["getprop"] = re.sub(r"\[ro.build.version.sdk\]: \[\d+\]",
                                       "[ro.build.version.sdk]: [\u00b2]",
                                       str(phone.commands["getprop"]))
    fake_adb_server.plug(phone)
    events = Events()
    with bridge_on(fake_adb_server, events):
        wait_for(lambda: events.of("agent-failed"))
    assert "no usable Android version" in events.of("agent-failed")[0].data["reason"]
    assert phone.processes == []


def test_serials_that_sanitize_alike_get_names_of_their_own(
        fake_adb_server: FakeAdbServer) -> None:
    a = fake_adb_server.plug(sleeper_phone("PHONE.1"))
    b = fake_adb_server.plug(sleeper_phone("phone_1"))
    events = Events()
    with bridge_on(fake_adb_server, events) as bridge:
        wait_for(lambda: len(events.of("agent-started")) == 2)
        names = {e.serial: e.data["name"] for e in events.of("agent-started")}
        assert {p.serial: p.name for p in bridge.phones()} == names
    assert len(set(names.values())) == 2
    for phone in (a, b):  # each agent was started with its own name
        assert any(f"--name {names[phone.serial]} " in c for c in phone.shell_log)


def test_stop_closes_frozen_phones_at_once(fake_adb_server: FakeAdbServer) -> None:
    """Phones that stop answering (a frozen USB hub; still listed as `device`): stopping
    costs one phone's timeouts (at most 2 * shell_timeout_s), not one per phone."""
    count, timeout_s = 5, 1.0
    frozen, release = threading.Event(), threading.Event()

    def freeze(command: str) -> None:
        if frozen.is_set():
            release.wait(30)
    for i in range(count):
        fake_adb_server.plug(with_hook(sleeper_phone(f"HUB{i}"), freeze))
    events = Events()
    bridge = bridge_on(fake_adb_server, events, shell_timeout_s=timeout_s).start()
    try:
        wait_for(lambda: len(events.of("agent-started")) == count)
        frozen.set()
        time.sleep(0.2)
        started = time.monotonic()
        bridge.stop()
        elapsed = time.monotonic() - started
    finally:
        release.set()
        bridge.stop()
    assert len(events.of("stopped")) == count
    assert elapsed < count * timeout_s - 1.5, elapsed  # one after another: >= count * timeout
