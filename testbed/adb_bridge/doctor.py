"""``testbed adb doctor [SERIAL]``: can this phone compute tiles, and if not, what to do.

Checks, in order; the first that fails stops the list (the later ones depend on it), and each
line names the problem and its exact fix. Exit 0 only when the last check passed: an agent on
the phone joined a throwaway parameter server through the phone's reverse port and left.

1. the adb server answers (``host:version``);
2. the phone is there and authorized (state ``device``);
3. Android is new enough for Termux (API >= 24);
4. a launcher: the adb shell's own python (rooted phones) or else Termux: installed
   (``pm path com.termux``); then the Termux listener (``termux-agent.sh serve``) connected to
   the control port and verified as Termux's uid in the phone's socket table (a connection of
   another uid is named and refused); without a listener, the RUN_COMMAND intent: the adb shell
   may send it, Termux runs it (``allow-external-apps``); either way Termux's python imports
   numpy and grpc (their versions come over a reverse port: the adb shell cannot read Termux's
   files);
5. the agent on the phone is this checkout's (sha256 of ``agent.zip``); ``--push`` updates it;
6. join/leave: the agent joins a throwaway PS (real gRPC, the real protocol) through
   ``adb reverse``, which answers Stop at once; the agent exits.

Every shell command has a deadline for its whole answer (:class:`PhoneShell`): a phone that stops
answering fails the check in progress as ``adb shell``, naming the command. A phone not in state
``device`` gets the fix of its state (:data:`STATE_FIXES`, adb's state names). Everything the
phone says (its properties, the probe's report, ``am``'s answer) is printed through
:func:`~testbed.adb_bridge.client.printable`: one line each, short, no terminal escapes.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shlex
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import grpc
from adbutils.errors import AdbError

from testbed.adb_bridge import agent_package, parsers, termux, termux_control
from testbed.adb_bridge.client import (
    AdbServer,
    PhoneCommandError,
    PhoneShell,
    printable,
    split_state,
)
from testbed.adb_bridge.phone_info import PhoneInfo, support_problem
from testbed.adb_bridge.server_address import START_SERVER_FIX
from testbed.adb_bridge.termux_control import ControlError, TermuxControl

DOCTOR_NAME = "adb-doctor"
REQUIRED_MODULES = ("numpy", "grpc")
TERMUX_PACKAGE_OF = {"numpy": "python-numpy", "grpc": "python-grpcio"}
MAX_REPORT_BYTES = 2**20  # the probe's report is ~200 bytes; the cap of TermuxControl's lines
REPORT_READ_S = 10.0  # from the probe's connection to the end of its report line
MAX_LINE_CHARS = 2000  # a line of the report: far more than any check writes

# What each of adb's states (client.ADB_STATES) means for a phone that should compute, and its
# fix; {serial} and {state} are filled in. A state adb adds later gets UNKNOWN_STATE_FIX.
STATE_MEANINGS = {
    "unauthorized": "USB debugging is not allowed yet on the phone",
    "authorizing": "the adb server is still checking the phone's authorization",
    "connecting": "the adb server is still connecting to it",
    "offline": "connected, but adb on the phone does not answer",
    "no permissions": "the adb server may not open its USB device",
    "bootloader": "the phone runs its bootloader, not Android",
    "recovery": "the phone runs recovery, not Android",
    "rescue": "the phone runs rescue mode, not Android",
    "sideload": "the phone runs recovery's sideload mode, not Android",
    "host": "another computer's adb, not a phone",
    "detached": "detached from the adb server",
}
_BOOT_ANDROID = ("boot the phone into Android: `adb -s {serial} reboot` (in the bootloader: choose "
                 "Start on its screen, or `fastboot reboot`), unlock it, then run the doctor again")
_WAIT = ("wait a few seconds and run the doctor again; if it stays {state}, unlock the phone and "
         "accept 'Allow USB debugging'")
UNKNOWN_STATE_FIX = "unplug and plug in the cable again (or `adb reconnect`)"
STATE_FIXES = {
    "unauthorized": "unlock the phone and accept 'Allow USB debugging' (tick 'Always allow'); no "
                    "prompt: `adb kill-server`, then plug it in again",
    "offline": UNKNOWN_STATE_FIX,
    "no permissions": "let your user open the phone's USB device: install udev rules for Android "
                      "phones (your distribution's android-udev-rules package, or a rule for the "
                      "phone's USB vendor id in /etc/udev/rules.d/51-android.rules), add your "
                      "user to the plugdev group and log in again, then `adb kill-server` and "
                      "plug the phone in again (https://developer.android.com/studio/run/device)",
    "bootloader": _BOOT_ANDROID, "recovery": _BOOT_ANDROID, "rescue": _BOOT_ANDROID,
    "sideload": _BOOT_ANDROID,
    "authorizing": _WAIT, "connecting": _WAIT,
    "host": "name a phone instead (`testbed adb devices` lists them), or drop this connection: "
            "`adb disconnect {serial}`",
    "detached": "attach it again: `adb attach {serial}`",
}
PORTS_FIX = ("stop that app, or move the ports with --phone-port (the join uses the phone port, "
             "the probe it + 1, the Termux listener it + 2)")


def state_problem(name: str, detail: str = "") -> str:
    """What a phone's adb state other than ``device`` means (name and detail as
    :func:`~testbed.adb_bridge.client.split_state` gives them); "" for a state unknown here."""
    return " ".join(filter(None, (STATE_MEANINGS.get(name), detail)))


def serial_problem(serial: str, server: str, states: dict[str, str]) -> str:
    """``serial`` is on no phone of the adb server at ``server``: said with the serials it
    lists (a typo shows; an empty list says to plug the phone in)."""
    listed = ", ".join(f"{printable(s)} ({printable(split_state(st)[0])})"
                       for s, st in sorted(states.items()))
    return (f"{printable(serial)} is not connected to the adb server at {server}, which lists "
            + (listed or "no phones"))


class BadProbeReport(ValueError):
    """What came over the probe port is not the probe's report (another app, a broken python)."""


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


def check_lines(check: Check) -> str:
    """One check as the report prints it: ``[ok]``/``[FAIL] name: detail``, and the fix under
    a failed one. The checks already quote the phone through printable; this keeps any text
    that came another way (an adb error's message) from breaking a line or moving the cursor."""
    line = f"[{'ok' if check.ok else 'FAIL'}] {check.name}: " \
           f"{printable(check.detail, most=MAX_LINE_CHARS)}"
    if not check.ok and check.fix:
        line += f"\n       fix: {printable(check.fix, most=MAX_LINE_CHARS)}"
    return line


@dataclass
class Doctor:
    """Runs the checks against one adb server (and one phone on it).

    ``on_check(check)`` is called as each check ends and ``on_wait(what)`` before a step that
    may wait for the phone (seconds to minutes), so a command line can show progress."""

    server: AdbServer
    serial: str | None = None
    push: bool = False
    phone_port: int = 7700
    probe_timeout_s: float = 25.0
    shell_timeout_s: float = 15.0  # one quick shell command: getprop, pm path, sha256sum, am
    python_timeout_s: float = 60.0  # the adb shell's python importing numpy and grpc, cold
    join_timeout_s: float = 60.0
    listener_timeout_s: float = 5.0  # the listener dials every second
    checks: list[Check] = field(default_factory=list)
    launcher: str = ""
    control: TermuxControl | None = None
    on_check: Callable[[Check], None] | None = None
    on_wait: Callable[[str], None] | None = None

    @property
    def control_port(self) -> int:
        """The phone port the Termux listener dials."""
        return self.phone_port + termux_control.CONTROL_PORT_OFFSET

    def _add(self, name: str, ok: bool, detail: str, fix: str = "") -> bool:
        check = Check(name, ok, detail, fix)
        self.checks.append(check)
        if self.on_check is not None:
            self.on_check(check)
        return ok

    def _waiting(self, what: str) -> None:
        if self.on_wait is not None:
            self.on_wait(what)

    def run(self) -> bool:
        """Run the checks in order; True when the phone can compute tiles."""
        try:
            return self._run()
        except PhoneCommandError as exc:  # the phone stopped answering (or answers too much)
            return self._add("adb shell", False, str(exc), "unlock the phone and check the "
                             "cable, then run the doctor again; if the phone still does not "
                             "answer, restart it")
        except (AdbError, OSError, EOFError) as exc:
            return self._add("adb", False, f"the adb connection failed mid-check: {exc}",
                             "check the cable, then run the doctor again")
        finally:
            self._close_control()

    def _close_control(self) -> None:
        if self.control is None:
            return
        self.control.stop()
        self.control = None
        try:
            self.device.reverse_remove(f"tcp:{self.control_port}")
        except (AdbError, OSError, EOFError):
            pass

    def _run(self) -> bool:
        s = self.server
        try:
            version = s.server_version()
        except (AdbError, OSError) as exc:
            return self._add("adb server", False, f"no adb server at {s.host}:{s.port} ({exc})",
                             START_SERVER_FIX)
        self._add("adb server", True, f"{s.host}:{s.port}, protocol {version}")
        if not self._phone_check():
            return False
        assert self.serial is not None
        self.device = s.device(self.serial)
        self.shell = PhoneShell(self.device, self.shell_timeout_s)
        props = parsers.parse_getprop(self.shell.run("getprop").stdout)
        info = PhoneInfo.from_props(self.serial, props)
        phone = ", ".join(filter(None, (printable(info.model), printable(info.abi))))
        problem = support_problem(info)  # too old, or no API level to tell
        if problem:
            return self._add("android", False, f"{phone}: {problem}" if phone else problem,
                             "use a phone with Android 7.0 or later" if info.sdk is not None
                             else "`adb shell getprop ro.build.version.sdk` should print the "
                                  "API level (31 on Android 12); if it prints nothing, restart "
                                  "the phone")
        self._add("android", True, f"Android {printable(info.android_release) or '?'} "
                  f"(API {info.sdk})" + (f", {phone}" if phone else ""))
        if not self._launcher_checks():
            return False
        if not self._version_check():
            return False
        return self._join_check()

    def _phone_check(self) -> bool:
        states = self.server.states()
        if self.serial is None:
            if len(states) != 1:
                listed = ", ".join(f"{k} ({v})" for k, v in sorted(states.items())) or "none"
                return self._add("phone", False, f"{len(states)} phones on the server: {listed}",
                                 "plug in one phone with USB debugging on, or name it: "
                                 "`testbed adb doctor SERIAL` (or set ANDROID_SERIAL)")
            self.serial = next(iter(states))
        state = states.get(self.serial)
        if state is None:
            server = f"{self.server.host}:{self.server.port}"
            return self._add("phone", False, serial_problem(self.serial, server, states),
                             "plug it in and turn on USB debugging (Settings > About phone > "
                             "tap Build number 7 times; then Developer options > USB debugging)"
                             + (", or name a phone the server lists" if states else ""))
        name, detail = split_state(state)
        if name != "device":
            problem = state_problem(name, detail)
            return self._add("phone", False, f"{self.serial} is {name}"
                             + (f": {problem}" if problem else ""),
                             STATE_FIXES.get(name, UNKNOWN_STATE_FIX).format(
                                 serial=self.serial, state=name))
        return self._add("phone", True, f"{self.serial} is authorized (state device)")

    def _shell(self, command: str, timeout_s: float | None = None) -> tuple[int, str]:
        r = self.shell.run(command, timeout_s)
        return r.code, (r.stdout + r.stderr)

    def _reverse(self, phone_port: int, host_port: int) -> str | None:
        """``adb reverse tcp:phone_port tcp:host_port``; the problem when an app on the phone
        holds that port (adbd's "cannot bind listener: ..."). Other adb errors propagate."""
        try:
            self.device.reverse(f"tcp:{phone_port}", f"tcp:{host_port}")
        except AdbError as exc:
            if "cannot bind" not in str(exc):
                raise
            return (f"adb reverse tcp:{phone_port} failed ({exc}): something on the phone "
                    f"already listens on 127.0.0.1:{phone_port} (another app)")
        return None

    def _launcher_checks(self) -> bool:
        self._waiting(f"asking the adb shell's python for numpy and grpc (up to "
                      f"{self.python_timeout_s:.0f} s)")
        code, out = self._shell("python3 -c 'import numpy, grpc, sys; print(sys.version.split()[0],"
                                " numpy.__version__, grpc.__version__)'", self.python_timeout_s)
        if code == 0:
            self.launcher = "shell"
            return self._add("python (adb shell)", True, f"the adb shell runs python with "
                             f"numpy and grpc: {printable(out.strip())}; Termux is not needed")
        self._add("python (adb shell)", True, "none for the adb shell (normal on an unrooted "
                  "phone): the agent runs inside Termux")
        self.launcher = "termux"
        if not self._shell(f"pm path {termux.PACKAGE}")[1].strip().startswith("package:"):
            return self._add("termux installed", False, "package com.termux is not installed",
                             "install Termux from F-Droid (https://f-droid.org/packages/"
                             "com.termux/) or its GitHub releases (not the Google Play build), "
                             "open it once, then " + termux.PACKAGES_FIX)
        self._add("termux installed", True, "package com.termux")
        phone_dir = agent_package.PHONE_DIR
        self._shell(f"mkdir -p {phone_dir} && chmod 711 {phone_dir}")
        self.device.sync.push(termux.SCRIPT.read_bytes(), f"{phone_dir}/termux-agent.sh",
                              mode=0o644)
        self.device.sync.push(termux.SERVE_PY.read_bytes(),
                              f"{phone_dir}/{termux_control.SERVE_PY}", mode=0o644)
        verdict = self._listener_check()
        if verdict is not None:
            return verdict
        return self._probe_termux()

    def _listener_check(self) -> bool | None:
        """The Termux listener: True/False when it decided, None to try the intent instead."""
        control = TermuxControl(lambda c: self._shell(c), self.control_port)
        control.start()
        command = termux_control.serve_command(self.control_port)
        try:
            self.device.reverse(f"tcp:{self.control_port}", f"tcp:{control.port}")
        except AdbError as exc:
            control.stop()
            problem, _, fix = termux_control.reverse_failed(self.control_port, exc).partition(
                "; ")
            return self._add("termux listener", False, problem, fix)
        self.control = control
        self._waiting(f"waiting up to {self.listener_timeout_s:.0f} s for a Termux listener "
                      f"to dial 127.0.0.1:{self.control_port} on the phone")
        if control.wait_connected(self.listener_timeout_s):
            hello = control.hello
            self.launcher = "termux-serve"
            self._add("termux listener", True, f"`{command}` is connected as uid "
                      f"{control.termux_uid} (Termux's), by the phone's socket table")
            return self._python_check(hello)
        if control.refused_uids:
            uids = ", ".join(map(str, sorted(control.refused_uids)))
            return self._add("termux listener", False, printable(control.last_refusal, most=300),
                             f"find the app: `adb shell pm list packages --uid {uids}`; stop or "
                             f"uninstall it, or move the ports with --phone-port (then in "
                             f"Termux: {termux_control.serve_command(self.control_port + 10)} "
                             f"for --phone-port {self.phone_port + 10})")
        if control.last_refusal:
            return self._add("termux listener", False, printable(control.last_refusal, most=300),
                             "end the listener in Termux (Ctrl-C), start it again: "
                             f"`{command}`, then run the doctor again")
        self._close_control()
        self._add("termux listener", True, f"not running (nothing dialled 127.0.0.1:"
                  f"{self.control_port} on the phone within {self.listener_timeout_s:.0f} s); "
                  "trying Termux's RUN_COMMAND intent instead")
        return None

    def _python_check(self, report: dict[str, Any]) -> bool:
        missing = [m for m in REQUIRED_MODULES if not report.get(m)]
        versions = ", ".join(f"{m} {printable(str(report.get(m) or 'missing'), most=40)}"
                             for m in ("python", *REQUIRED_MODULES))
        if missing:
            fix = "in Termux run: pkg install " + " ".join(TERMUX_PACKAGE_OF[m] for m in missing)
            errors = "; ".join(printable(str(report.get(m + "_error")), most=200)
                               for m in missing)
            return self._add("termux python", False, f"{versions} ({errors})", fix)
        return self._add("termux python", True, versions)

    def _probe_termux(self) -> bool:
        phone_dir = agent_package.PHONE_DIR
        script = f"{phone_dir}/termux-agent.sh"
        serve = termux_control.serve_command(self.control_port)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.3)
        probe_port = self.phone_port + 1
        taken = self._reverse(probe_port, listener.getsockname()[1])
        if taken:
            listener.close()
            return self._add("probe port", False, taken, PORTS_FIX)
        probe = ["probe", f"127.0.0.1:{probe_port}"]
        try:
            code, out = self._shell(termux.intent_command(script, probe))
            answer = termux.parse_am_output(out, code)
            if answer.outcome == "background":
                code, out = self._shell(termux.intent_command(
                    script, probe, verb="start-foreground-service"))
                answer = termux.parse_am_output(out, code)
            if answer.outcome == "permission":  # a stock phone: the listener is the way
                return self._add("termux listener", False, "not running, and "
                                 + termux.PERMISSION_REFUSED,
                                 f"in Termux run `{serve}` (once; leave it running), then run "
                                 f"the doctor again")
            if answer.outcome != "sent":
                return self._add("run_command allowed", False,
                                 f"am: {printable(answer.text, most=300)}",
                                 "update Termux (RUN_COMMAND needs Termux 0.95 or later)")
            self._add("run_command allowed", True, "the adb shell may send Termux's intent")
            self._waiting(f"waiting up to {self.probe_timeout_s:g} s (--probe-timeout) for "
                          f"Termux to run the probe")
            try:
                report, seen = self._wait_report(listener)
            except BadProbeReport as exc:
                # anything on the phone may dial the probe port: say what came, not a traceback
                return self._add("probe report", False, f"127.0.0.1:{probe_port} on the phone "
                                 f"got {exc}, not the probe's report (a JSON object on one line)",
                                 f"run the doctor again; if another app keeps dialling that "
                                 f"port, {PORTS_FIX}")
        finally:
            listener.close()
            self.device.reverse_remove(f"tcp:{probe_port}")
        if report is None and not seen:
            return self._add("external apps allowed", False, "Termux ignored the intent: "
                             "allow-external-apps is not true",
                             f"{termux.PROPERTIES_FIX}; or instead run `{serve}` in Termux "
                             f"(once; leave it running)")
        self._add("external apps allowed", True, "Termux ran the probe")
        if report is None:
            return self._add("termux python", False, "Termux has no python",
                             termux.PACKAGES_FIX)
        return self._python_check(report)

    def _wait_report(self, listener: socket.socket) -> tuple[dict[str, Any] | None, bool]:
        """The probe's report (None if none came) and whether its process was ever seen;
        BadProbeReport when what connected sent something else."""
        seen = False
        deadline = time.monotonic() + self.probe_timeout_s
        while time.monotonic() < deadline:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                if not seen:
                    code, _ = self._shell("pgrep -f " + shlex.quote("termux-agent\\.sh probe"))
                    seen = code == 0
                continue
            with conn:
                return read_report(conn, time.monotonic() + REPORT_READ_S), True
        return None, seen

    def _version_check(self) -> bool:
        path = f"{agent_package.PHONE_DIR}/agent.zip"
        local = agent_package.build_agent_zip()
        want = hashlib.sha256(local).hexdigest()
        code, out = self._shell(f"sha256sum {path}")
        have = printable(out.split()[0], most=64) if code == 0 and out.split() else ""
        if have != want and self.push:
            self.device.sync.push(local, path, mode=0o644)
            return self._add("agent version", True, f"pushed this checkout's agent ({want[:12]})"
                             + (f"; the phone had {have[:12]}" if have else ""))
        if have != want:
            what = f"the phone's agent is {have[:12]}" if have else "no agent on the phone"
            return self._add("agent version", False, f"{what}; this checkout's is {want[:12]}",
                             f"`testbed adb doctor {self.serial} --push` (a `testbed up` run "
                             f"pushes it too)")
        return self._add("agent version", True, f"agent.zip {want[:12]} matches this checkout")

    def _join_check(self) -> bool:
        token = secrets.token_hex(16)
        ps = ThrowawayPS(token).start()
        phone_dir = agent_package.PHONE_DIR
        token_path = f"{phone_dir}/token-{secrets.token_hex(8)}"
        mode = 0o600 if self.launcher == "shell" else 0o644
        try:
            taken = self._reverse(self.phone_port, ps.port)
        except (AdbError, OSError, EOFError):
            ps.stop()
            raise
        if taken:
            ps.stop()
            return self._add("join/leave", False, taken, PORTS_FIX)
        if self.launcher != "termux-serve":  # the listener gets it over its connection
            self.device.sync.push(token.encode() + b"\n", token_path, mode=mode)
        argv = ["--ps", f"127.0.0.1:{self.phone_port}", "--token-file", token_path,
                "--name", DOCTOR_NAME, "--kind", "real"]
        out, started = "", False
        try:
            if self.launcher == "termux-serve":
                assert self.control is not None
                try:
                    reply = self.control.request("start", argv=argv[:2] + argv[4:], token=token)
                except ControlError as exc:
                    reply = {"ok": False, "error": str(exc)}
                started = bool(reply.get("ok"))
                out = str(reply.get("error") or "")
            elif self.launcher == "shell":
                self.device.sync.push(agent_package.START_SCRIPT.read_bytes(),
                                      f"{phone_dir}/start-agent.sh", mode=0o755)
                code, out = self._shell(f"sh {phone_dir}/start-agent.sh {shlex.join(argv)}")
                started = code == 0
            else:
                code, out = self._shell(termux.intent_command(
                    f"{phone_dir}/termux-agent.sh", ["start", *argv]))
                started = termux.parse_am_output(out, code).outcome == "sent"
            if started:
                self._waiting(f"waiting up to {self.join_timeout_s:.0f} s for the agent to "
                              f"join a throwaway PS")
                ps.done.wait(self.join_timeout_s)
        finally:
            self._shell(f"rm -f {shlex.quote(token_path)}")
            self.device.reverse_remove(f"tcp:{self.phone_port}")
            ps.stop()
        if ps.joined and ps.stopped:
            return self._add("join/leave", True, f"the agent joined a throwaway PS through "
                             f"tcp:{self.phone_port} as {printable(repr(ps.joined))} and left "
                             f"when told")
        if ps.joined:
            return self._add("join/leave", False, "the agent joined but did not take Stop",
                             "run the doctor again; if it persists, report it with the "
                             "agent's log")
        if not started and out:
            return self._add("join/leave", False, "the agent did not start: "
                             + printable(out.strip(), most=300),
                             "run the doctor again; in Termux, ~/.testbed/agent.log says more")
        return self._add("join/leave", False, f"no agent joined within {self.join_timeout_s:.0f}"
                         f" s through tcp:{self.phone_port}",
                         "run the doctor again with the phone unlocked; in Termux, "
                         "~/.testbed/agent.log says why the agent stopped")

    def verdict(self) -> str:
        """The report's last line: whether the phone can compute tiles."""
        ok = bool(self.checks) and self.checks[-1].ok and self.checks[-1].name == "join/leave"
        return "the phone can compute tiles" if ok else "the phone cannot compute tiles"

    def report(self) -> str:
        """The checks as text, one per line, with the fix under a failed one, then the
        verdict."""
        return "\n".join([*map(check_lines, self.checks), self.verdict()])


def read_report(conn: socket.socket, deadline: float) -> dict[str, Any]:
    """The probe's report: one JSON object on one line, whole before ``deadline``
    (time.monotonic()) and within MAX_REPORT_BYTES; else BadProbeReport saying what came."""
    data = bytearray()
    while b"\n" not in data:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise socket.timeout()
            conn.settimeout(left)
            chunk = conn.recv(65536)
        except socket.timeout:
            raise BadProbeReport((f"{len(data)} bytes and no end of line" if data else "nothing")
                                 + f" within {REPORT_READ_S:g} s") from None
        except OSError as exc:
            raise BadProbeReport(f"a connection that broke ({exc})") from None
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REPORT_BYTES:
            raise BadProbeReport(f"more than {MAX_REPORT_BYTES // 2**20} MiB without an end of "
                                 f"line")
    if not data:
        raise BadProbeReport("a connection that closed without sending anything")
    line = bytes(data).partition(b"\n")[0]
    shown = printable(repr(line.decode("utf-8", errors="replace")), most=80)
    try:
        report = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadProbeReport(f"{shown} (not UTF-8)") from None
    except (ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
        raise BadProbeReport(f"{shown} (not JSON)") from None
    if not isinstance(report, dict):
        kind = {list: "array", str: "string", int: "number", float: "number",
                bool: "true or false"}.get(type(report), "null")
        raise BadProbeReport(f"{shown} (a JSON {kind}, not an object)")
    return report


class ThrowawayPS:
    """A parameter server for one join: checks the token, attaches, answers Stop at once
    (``hold=True``: keeps the device attached, handing out no work, until it goes)."""

    def __init__(self, token: str, hold: bool = False):
        from testbed.wire import testbed_pb2 as pb
        from testbed.wire import testbed_pb2_grpc as pb_grpc

        self.token = token
        self.joined = ""
        self.stopped = False
        self.left = False
        self.done = threading.Event()
        outer = self

        class Servicer(pb_grpc.ParameterServerServicer):  # type: ignore[misc]
            def Join(self, request: Any, context: Any) -> Any:
                if request.token != outer.token:
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong token")
                outer.joined = request.device.name
                return pb.JoinReply(device_id="doctor-0", session_key="doctor", lease_s=30,
                                    heartbeat_s=5, max_message_bytes=1 << 20,
                                    time_dilation=1.0, run_name="adb-doctor")

            def Work(self, request_iterator: Any, context: Any) -> Iterator[Any]:
                next(request_iterator)  # Attach
                if hold:
                    outer.done.set()
                    for _ in request_iterator:  # heartbeats, until the device leaves
                        pass
                    return
                # done once the RPC ends, however: the agent that takes Stop may close its
                # stream before the server resumes this generator, which it then never does
                # (the doctor waited out join_timeout_s for a check that had passed)
                if not context.add_callback(outer.done.set):
                    outer.done.set()
                outer.stopped = True
                yield pb.ServerMessage(stop=pb.Stop(reason="adb doctor: join check done"))

            def Leave(self, request: Any, context: Any) -> Any:
                outer.left = True
                return pb.LeaveReply()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_ParameterServerServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def start(self) -> ThrowawayPS:
        """Start serving."""
        self.server.start()
        return self

    def stop(self) -> None:
        """Stop serving."""
        self.server.stop(grace=1).wait(2)
