"""``testbed adb doctor`` and the Termux launcher against the fake adb server.

The fake phone is unrooted: its adb shell has no Python, and its Termux answers the
RUN_COMMAND intent by running the pushed ``termux-agent.sh`` (a real /bin/sh process) with a
python that can hide numpy or grpc. The doctor's last check is a real join through the phone's
reverse port against a throwaway gRPC PS; the bridge test runs the real agent the same way.

The doctor runs through the command line's entry point (``testbed.cli.main``) in this process,
as `testbed adb doctor` would run it, with one difference: no phone here runs the Termux
listener, so the wait for it always ends empty, and it is 0.5 s instead of the doctor's 5 s (and
the bridge's 2.5 s; the listener's own tests, where it dials, are in
test_adb_termux_listener.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from testbed.adb_bridge import AdbBridge, agent_package
from testbed.adb_bridge import doctor as doctor_module
from testbed.adb_bridge.doctor import Doctor, ThrowawayPS
from testbed.adb_bridge.server_address import adb_address
from tests.conftest import host_cmdlines, wait_for
from tests.fakes.adb_phones import termux_phone
from tests.fakes.fake_adb import FakeAdbServer, phone_pids

pytestmark = pytest.mark.integration
SERIAL = "TERMUX1"
ROOT = Path(__file__).resolve().parents[2]
ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def fake_adb_server() -> Iterator[FakeAdbServer]:
    server = FakeAdbServer().start()
    yield server
    server.stop()


@dataclass
class NoListenerDoctor(Doctor):
    """The doctor, waiting 0.5 s for a Termux listener that none of these phones runs."""

    listener_timeout_s: float = 0.5


RunDoctor = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def doctor(monkeypatch: pytest.MonkeyPatch, cli_here: RunDoctor) -> RunDoctor:
    """``doctor(port, *args, env=None)``: `testbed adb doctor ARGS` with the adb server port in
    the environment, through the command line's entry point: its exit code and output."""
    monkeypatch.setattr(doctor_module, "Doctor", NoListenerDoctor)

    def run(port: int, *args: str, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        return cli_here("adb", "doctor", *args,
                        env={**(env or {}), "ANDROID_ADB_SERVER_PORT": str(port)})
    return run


def plug(server: FakeAdbServer, tmp_path: Path, **kwargs: Any) -> Any:
    return server.plug(termux_phone(SERIAL, tmp_path / "phone", tmp_path / "termux", env=ENV,
                                    **kwargs))


def test_doctor_ready_phone_joins_and_leaves(fake_adb_server: FakeAdbServer,
                                             doctor: RunDoctor, tmp_path: Path) -> None:
    phone = plug(fake_adb_server, tmp_path)
    done = doctor(fake_adb_server.port, SERIAL, "--push")
    assert done.returncode == 0, done.stdout + done.stderr
    for check in ("adb server", "phone", "android", "termux installed", "run_command allowed",
                  "external apps allowed", "termux python", "agent version", "join/leave"):
        assert f"[ok] {check}:" in done.stdout, (check, done.stdout)
    assert "FAIL" not in done.stdout and "the phone can compute tiles" in done.stdout
    assert "joined a throwaway PS" in done.stdout
    # Termux ran the probe and the agent; no token file is left on the phone.
    assert [i[0].endswith("termux-agent.sh") for i in phone.termux.intents] == [True, True]
    assert not [p for p in phone.files if "/token-" in p]


def test_doctor_reads_a_phone_without_shell_v2_end_to_end(fake_adb_server: FakeAdbServer,
                                                          doctor: RunDoctor,
                                                          tmp_path: Path) -> None:
    """Every check through shell protocol v1 (no exit status of its own, stderr merged into
    stdout): adbutils' shell2 read such a phone as blank."""
    phone = plug(fake_adb_server, tmp_path)
    phone.features = "cmd"
    done = doctor(fake_adb_server.port, SERIAL, "--push")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[ok] android: Android 12 (API 31), M2011K2G, arm64-v8a" in done.stdout
    assert "[ok] termux python: python 3" in done.stdout and "joined a throwaway PS" in done.stdout


@pytest.mark.parametrize("scenario, kwargs, problem, fix", [
    ("no termux", {"installed": False}, "[FAIL] termux installed: package com.termux is not "
     "installed", "install Termux from F-Droid"),
    ("permission", {"shell_may_send": False}, "[FAIL] termux listener: not running, and this "
     "phone does not let the adb shell send", "in Termux run `sh /data/local/tmp/testbed/"
     "termux-agent.sh serve` (once; leave it running)"),
    ("external apps", {"allow_external_apps": False}, "[FAIL] external apps allowed: Termux "
     "ignored the intent", "echo 'allow-external-apps = true' >> ~/.termux/termux.properties"),
    ("no python", {"python": False}, "[FAIL] termux python: Termux has no python",
     "pkg install python python-numpy python-grpcio"),
    ("no numpy", {"modules": ("grpc",)}, "[FAIL] termux python: python 3", "in Termux run: pkg "
     "install python-numpy"),
])
def test_doctor_names_problem_and_fix(fake_adb_server: FakeAdbServer, doctor: RunDoctor,
                                      tmp_path: Path, scenario: str, kwargs: dict[str, Any],
                                      problem: str, fix: str) -> None:
    installed = kwargs.pop("installed", True)
    phone = plug(fake_adb_server, tmp_path, **kwargs)
    if not installed:
        phone.termux = None
    # a probe that never reports (Termux ignored the intent, no python) is waited for in full,
    # so those wait less; one that reports may need the time on a loaded host
    never_reports = scenario in ("external apps", "no python")
    done = doctor(fake_adb_server.port, "--probe-timeout", "3s" if never_reports else "10s",
                  env={"ANDROID_SERIAL": SERIAL})
    assert done.returncode == 1, done.stdout
    assert problem in done.stdout, (scenario, done.stdout)
    assert f"fix: {fix}" in done.stdout or fix in done.stdout.split("fix:")[-1], done.stdout
    assert "the phone cannot compute tiles" in done.stdout
    if scenario == "no numpy":
        assert "numpy missing" in done.stdout and "No module named 'numpy'" in done.stdout


def test_doctor_agent_version_mismatch(fake_adb_server: FakeAdbServer, doctor: RunDoctor,
                                       tmp_path: Path) -> None:
    phone = plug(fake_adb_server, tmp_path)
    phone.files[f"{agent_package.PHONE_DIR}/agent.zip"] = (0o100644, b"an older agent", 0)
    done = doctor(fake_adb_server.port, SERIAL)
    assert done.returncode == 1, done.stdout
    assert "[FAIL] agent version: the phone's agent is" in done.stdout
    assert f"fix: `testbed adb doctor {SERIAL} --push`" in done.stdout


def test_doctor_unplugged_and_no_server(fake_adb_server: FakeAdbServer, doctor: RunDoctor,
                                        tmp_path: Path) -> None:
    done = doctor(fake_adb_server.port, SERIAL)
    assert done.returncode == 1
    assert f"[FAIL] phone: {SERIAL} is not connected" in done.stdout
    assert "USB debugging" in done.stdout
    port = fake_adb_server.port
    fake_adb_server.stop()
    done = doctor(port)
    assert done.returncode == 1 and "[FAIL] adb server: no adb server at 127.0.0.1:" in done.stdout
    assert "adb start-server" in done.stdout


def test_adb_environment_conventions() -> None:
    assert adb_address(None, {}) == ("127.0.0.1:5037", None)
    assert adb_address(None, {"ANDROID_ADB_SERVER_PORT": "5038"}) == ("127.0.0.1:5038", None)
    assert adb_address(None, {"ANDROID_ADB_SERVER_PORT": "5038",
                              "ANDROID_ADB_SERVER_ADDRESS": "10.1.2.3"}) == ("10.1.2.3:5038", None)
    assert adb_address("127.0.0.1:7000", {"ANDROID_ADB_SERVER_PORT": "5038"}) == (
        "127.0.0.1:7000", None)  # --adb wins
    _, problem = adb_address(None, {"ANDROID_ADB_SERVER_PORT": "http"})
    assert problem is not None and "ANDROID_ADB_SERVER_PORT" in problem and "'http'" in problem


@pytest.mark.skipif(shutil.which("adb") is None, reason="the adb client is not installed")
def test_devices_honours_adb_server_port(fake_adb_server: FakeAdbServer, tmp_path: Path) -> None:
    plug(fake_adb_server, tmp_path)
    env = dict(os.environ, ANDROID_ADB_SERVER_PORT=str(fake_adb_server.port))
    ours = subprocess.run([sys.executable, "-m", "testbed.cli", "adb", "devices"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert ours.returncode == 0, ours.stderr
    assert SERIAL in ours.stdout and "snapdragon888" in ours.stdout
    theirs = subprocess.run(["adb", "devices"], env=env, capture_output=True, text=True,
                            timeout=30)  # the real client reads the same variable
    assert f"{SERIAL}\tdevice" in theirs.stdout, theirs.stdout + theirs.stderr
    bad = subprocess.run([sys.executable, "-m", "testbed.cli", "adb", "devices"],
                         env=dict(env, ANDROID_ADB_SERVER_PORT="x"), capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "ANDROID_ADB_SERVER_PORT" in bad.stderr


def test_bridge_runs_agent_in_termux_and_stops_it(fake_adb_server: FakeAdbServer,
                                                  tmp_path: Path) -> None:
    phone = plug(fake_adb_server, tmp_path)
    token = "s3cret-" + "7" * 20
    ps = ThrowawayPS(token, hold=True).start()
    events: list[Any] = []
    bridge = AdbBridge("127.0.0.1", fake_adb_server.port, f"127.0.0.1:{ps.port}", token,
                       telemetry_interval_s=0.3, agent_grace_s=10, listener_grace_s=0.5,
                       on_event=events.append)
    try:
        bridge.start()
        assert ps.done.wait(90), [(e.kind, e.data) for e in events]
        # the agent may join before the bridge has read its pid back and said so
        started = wait_for(lambda: next((e for e in events if e.kind == "agent-started"), None),
                           30, "the bridge's agent-started event")
        assert started.data["launcher"] == "termux" and ps.joined == "adb-termux1"
        cmdlines = [c for c in phone_pids(phone).values()] + host_cmdlines()
        assert not [c for c in cmdlines if token in c]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and [p for p in phone.files if "/token-" in p]:
            time.sleep(0.1)
        assert not [p for p in phone.files if "/token-" in p]  # removed once the agent dialled
        pid = started.data["pid"]
    finally:
        bridge.stop()
        ps.stop()
    assert ps.left  # the stop intent's SIGTERM made the agent leave gracefully
    assert pid not in phone_pids(phone)
    assert phone.termux is not None and phone.termux.intents[-1] == [
        f"{agent_package.PHONE_DIR}/termux-agent.sh", "stop"]


