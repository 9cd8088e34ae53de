"""Scripted phones for the fake adb server: recorded answers, and a phone that runs the agent.

* :func:`recorded_phone`: a :class:`~tests.fakes.fake_adb.FakePhone` whose ``getprop`` and
  telemetry commands answer from the recorded samples in ``tests/data/adb/``;
* :func:`agent_phone`: the same, plus a shell whose ``sh .../start-agent.sh ARGS`` really starts
  ``python <pushed agent.zip> ARGS`` as a local process (files pushed with sync land under
  ``root_dir``), with the phone port ``127.0.0.1:<phone_port>`` replaced by the fake's local port
  for that reverse rule: the agent reaches the host only through the phone's ``adb reverse``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from testbed.adb_bridge import telemetry
from testbed.adb_bridge.agent_package import PHONE_DIR
from tests.fakes.fake_adb import FakePhone, LocalProcessCommand

DATA = Path(__file__).resolve().parents[1] / "data" / "adb"
TELEMETRY_SAMPLES = ("battery_aosp.txt", "uevent_ua_negative.txt", "thermal_aosp.txt",
                     "thermal_zones.txt", "cpufreq.txt")
START_PATTERN = r"^sh /data/local/tmp/testbed/start-agent\.sh (.*)$"


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
        args = [a if a != phone_address else f"{{reverse:{phone_port}}}"
                for a in match.group(1).split()]
        return [sys.executable, str(root_dir / PHONE_DIR.lstrip("/") / "agent.zip"), *args]

    hook = LocalProcessCommand(START_PATTERN, argv, env=env, log_dir=log_dir)
    return recorded_phone(serial, root_dir=root_dir, exec_hook=hook, **kwargs)
