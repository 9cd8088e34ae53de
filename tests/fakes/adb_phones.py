"""Scripted phones for the fake adb server: recorded answers, and a phone that runs the agent.

* :func:`recorded_phone`: a :class:`~tests.fakes.fake_adb.FakePhone` whose ``getprop`` and
  telemetry commands answer from the recorded samples in ``tests/data/adb/``;
* :func:`agent_phone`: the same, plus a shell whose ``sh .../start-agent.sh ARGS`` really starts
  ``python <pushed agent.zip> ARGS`` as a local process (files pushed with sync land under
  ``root_dir``), with the phone port ``127.0.0.1:<phone_port>`` replaced by the fake's local port
  for that reverse rule: the agent reaches the host only through the phone's ``adb reverse``;
* :func:`termux_phone`: an unrooted phone: its adb shell has no python (``start-agent.sh`` and
  ``run-python.sh`` exit 3), so its agent runs only inside Termux, through the RUN_COMMAND
  intent or (with ``shell_may_send=False``, a stock phone) through the Termux listener, which
  a test starts with :meth:`~tests.fakes.fake_adb.FakeAdbServer.termux_serve` on a phone with
  ``same_ports``.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from typing import Any

from testbed.adb_bridge import telemetry
from testbed.adb_bridge.agent_package import PHONE_DIR
from testbed.adb_bridge.bridge import BridgeEvent
from tests.fakes.fake_adb import FakePhone, FakeTermux, LocalProcessCommand, ShellResult

DATA = Path(__file__).resolve().parents[1] / "data" / "adb"
TELEMETRY_SAMPLES = ("battery_aosp.txt", "uevent_ua_negative.txt", "thermal_aosp.txt",
                     "thermal_zones.txt", "cpufreq.txt")
START_PATTERN = r"^sh /data/local/tmp/testbed/start-agent\.sh (.*)$"
RUN_PYTHON_PATTERN = r"^sh /data/local/tmp/testbed/run-python\.sh "


def recorded_phone(serial: str, getprop: str = "getprop_sd888.txt", **kwargs: Any) -> FakePhone:
    """A fake phone answering the telemetry commands from the recorded samples."""
    phone = FakePhone.from_getprop(serial, (DATA / getprop).read_text(), **kwargs)
    for cmd, sample in zip(telemetry.COMMANDS, TELEMETRY_SAMPLES):
        phone.commands[cmd] = (DATA / sample).read_text()
    return phone


def agent_phone(serial: str, root_dir: Path, log_dir: Path, phone_port: int = 7700,
                env: dict[str, str] | None = None, **kwargs: Any) -> FakePhone:
    """A recorded phone whose start script runs the pushed agent zip as a local process."""
    phone_address = f"127.0.0.1:{phone_port}"

    def argv(phone: FakePhone, match: Any) -> list[str]:
        args = [f"{{reverse:{phone_port}}}" if a == phone_address else
                str(root_dir / a.lstrip("/")) if a.startswith("/data/local/tmp/") else a
                for a in match.group(1).split()]
        return [sys.executable, str(root_dir / PHONE_DIR.lstrip("/") / "agent.zip"), *args]

    hook = LocalProcessCommand(START_PATTERN, argv, env=env, log_dir=log_dir)
    return recorded_phone(serial, root_dir=root_dir, exec_hook=hook, **kwargs)


def termux_phone(serial: str, root_dir: Path, termux_dir: Path, env: dict[str, str] | None = None,
                 **termux_kwargs: Any) -> FakePhone:
    """An unrooted recorded phone: the adb shell has no Python (``start-agent.sh`` exits 3),
    and Termux answers the RUN_COMMAND intent (see :class:`FakeTermux` for the knobs)."""
    def no_python(phone: FakePhone, command: str) -> ShellResult | None:
        if (re.search(START_PATTERN, command) or command.startswith("python3 ")
                or re.search(RUN_PYTHON_PATTERN, command)):
            return ShellResult(stderr=b"testbed: no Python that the adb shell can run on this "
                                      b"phone\n", exit_code=127 if command.startswith("python3 ")
                               else 3)
        return None

    termux = FakeTermux(work_dir=termux_dir, env=dict(env or {}), **termux_kwargs)
    return recorded_phone(serial, root_dir=root_dir, exec_hook=no_python, termux=termux)


class Events:
    """Every bridge event, in order: an ``on_event`` callback (it runs in the bridge's
    threads) that tests read while the bridge goes on."""

    def __init__(self) -> None:
        self.items: list[BridgeEvent] = []
        self.lock = threading.Lock()

    def __call__(self, event: BridgeEvent) -> None:
        with self.lock:
            self.items.append(event)

    def of(self, kind: str, serial: str | None = None) -> list[BridgeEvent]:
        """The events of one kind (of one phone)."""
        with self.lock:
            return [e for e in self.items if e.kind == kind and serial in (None, e.serial)]

    def kinds(self, serial: str | None = None) -> list[str]:
        """The kinds of every event so far (of one phone)."""
        with self.lock:
            return [e.kind for e in self.items if serial is None or e.serial == serial]

    def first(self, kind: str) -> BridgeEvent:
        with self.lock:
            return next(e for e in self.items if e.kind == kind)
