"""The ADB bridge: phones that appear on an adb server join the run as real devices.

Names and numbers, written down once:

* a phone is known by its adb **serial**; its device name in the run is
  :func:`~.config.device_name` of it: ``adb-<serial>`` lower-cased for a serial of upper-case
  letters, digits and '-' (``R58M12ABCDE``: ``adb-r58m12abcde``), else a readable stem and a
  hash of the serial (``PHONE.1``: ``adb-phone-1-dd7b4e``), so that two phones do not share one;
* on the phone the agent dials ``127.0.0.1:<phone_port>`` (default 7700); ``adb reverse
  tcp:<phone_port> tcp:<relay_port>`` carries that to this host, where the phone's own
  :class:`~.relay.PhoneRelay` on ``127.0.0.1:<relay_port>`` forwards to the PS;
* the agent and its start scripts live in ``/data/local/tmp/testbed/`` on the phone (mode 0711:
  apps cannot list it); the join token goes there as ``token-<random>`` for ``--token-file``,
  never on a command line, and is removed once the agent has dialled the PS;
* the agent is started by the adb shell's own python (``launcher: shell``) or, when the shell
  has none, inside Termux: by the listener the user started there once (``termux-agent.sh
  serve``, ``launcher: termux-serve``), which dials ``127.0.0.1:<phone_port + 2>`` on the phone,
  carried by ``adb reverse`` to the phone's :class:`~.termux_control.TermuxControl` (verified by
  uid before the token goes to it; see termux_control.py), or else by Termux's RUN_COMMAND
  intent (``launcher: termux``, see termux.py), which stock phones refuse to the adb shell;
  with neither, the phone waits (``agent-waiting``) until the user starts the listener;
* telemetry is polled every ``telemetry_interval_s`` seconds; each poll also checks that the
  reverse rule is still there (re-applied if not) and that the agent process is still alive;
* every shell command has one deadline, ``shell_timeout_s`` for its whole answer
  (:class:`~.client.PhoneShell`, on shell protocol v2 or, on adbd of Android 6 and older, v1).
  A poll in which a command fails (too slow, cut short) or the adb server refuses a request is
  lost, and polling goes on: the phone's session ends only when the tracker says the phone is
  gone or the bridge stops. The failure is a ``poll-failed`` event and a warning, at most one
  per phone every :data:`POLL_FAILED_EVERY_S` seconds (with how many polls failed meanwhile).

Life of a phone (each step is a :class:`BridgeEvent` of that ``kind``)::

    plugged -> [state: unauthorized -> device] -> ready (properties, profile, relay, reverse)
      -> agent-started | agent-failed (the reason says why the phone cannot run the agent: too
         old, the phone port taken on the phone, no Python, a bug in the bridge; or a phone
         fault while setting it up or starting the agent, with ``retry_in_s``: tried again
         then, the wait doubling up to SETUP_RETRY_MAX_S)
         | agent-waiting (start the Termux listener; agent-started follows once it connects)
      -> telemetry ... [reverse-reapplied] [agent-exited -> agent-started] [poll-failed]
      -> unplugged | offline (the relay closes its PS connections: the PS re-queues the
         phone's in-flight tiles) | stopped (the bridge stopped: agent gets SIGTERM, leaves;
         every phone is stopped at once, so phones that do not answer cost one timeout)

Use::

    with AdbBridge("127.0.0.1", 5037, ps_address="127.0.0.1:50051", token=token) as bridge:
        for event in bridge.poll(timeout_s=1.0): ...

or pass ``on_event=callback`` (called from the bridge's threads).
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from adbutils.errors import AdbError

from testbed.adb_bridge import agent_package, parsers, telemetry, termux, termux_control
from testbed.adb_bridge.client import (
    AdbServer,
    DeviceTracker,
    PhoneCommandError,
    PhoneShell,
    ShellOutput,
    diff_states,
)
from testbed.adb_bridge.config import device_name
from testbed.adb_bridge.phone_info import PhoneInfo, choose_profile, support_problem
from testbed.adb_bridge.relay import PhoneRelay, RelayShaping
from testbed.adb_bridge.termux_control import ControlError, TermuxControl

log = logging.getLogger(__name__)

START_EXIT_REASONS = {
    3: "no Python that the adb shell can run on this phone",
    4: "Python on the phone lacks numpy or grpcio",
}
NO_PYTHON_EXIT = 3  # start-agent.sh: the adb shell has no Python; try Termux next
MAX_AGENT_RESTARTS = 3
NO_SHAPING = RelayShaping()
PHONE_FAULTS = (AdbError, OSError, EOFError)  # a command or an adb request on the phone failed
POLL_FAILED_EVERY_S = 60.0  # at most one poll-failed event (and warning) per phone this often
# A phone being unplugged fails its commands a moment before the tracker says it is gone: a
# failure counts only if the session is still on this long after it.
LEAVE_GRACE_S = 1.0
# A phone fault while the phone is set up or its agent started (a command too slow, adb refusing
# a push) is worth another try: after this long, doubling up to SETUP_RETRY_MAX_S, until it
# works or the phone leaves. (Before, such a phone sat out the run until it was plugged again.)
SETUP_RETRY_FIRST_S = 2.0
SETUP_RETRY_MAX_S = 60.0


@dataclass(frozen=True)
class BridgeEvent:
    """Something that happened to a phone (or to the adb server: serial '')."""

    kind: str
    serial: str
    time_s: float  # time.time() when it happened
    data: dict[str, Any] = field(default_factory=dict)


def profile_gflops(profile: str) -> float | None:
    """The sustained GFLOPS a device profile predicts (None if it cannot be loaded)."""
    from testbed.perf_model.profiles import ProfileError, load_profile

    try:
        return load_profile(profile).sustained_gflops
    except (ProfileError, OSError) as exc:
        log.warning("profile %r: %s; the phone announces no predicted speed", profile, exc)
        return None


def phone_port_taken(phone_port: int, exc: Exception) -> str:
    """Why ``adb reverse tcp:<phone_port>`` failed on a phone that is there, and what to do."""
    return (f"the phone port {phone_port} is in use on the phone: adb reverse tcp:{phone_port} "
            f"failed ({exc}), so another app listens on 127.0.0.1:{phone_port} there. Stop that "
            f"app, or choose another phone port: adb.phone_port in the topology (the bridge also "
            f"uses it + 2; --phone-port for testbed adb doctor and measure)")


@dataclass
class PhoneStatus:
    """What the bridge knows about one phone now (for ``testbed adb devices`` and the view)."""

    serial: str
    state: str
    name: str
    model: str = ""
    soc: str = ""
    android: str = ""
    profile: str | None = None
    profile_reason: str = ""
    relay_port: int | None = None
    reverse_ok: bool = False  # the bridge set the reverse rule (it keeps it up, then removes it)
    agent_pid: int | None = None
    launcher: str = ""  # "shell" (the adb shell's python), "termux-serve" (the listener the
    # user started in Termux) or "termux" (Termux's RUN_COMMAND intent)
    problem: str = ""  # why the agent does not run, when it does not
    waiting: str = ""  # what the user must do before the agent can start (the Termux listener)
    last_telemetry: dict[str, Any] = field(default_factory=dict)


class _PhoneSession:
    """One phone in state ``device``: set up, start the agent, poll, clean up."""

    def __init__(self, bridge: AdbBridge, serial: str):
        self.bridge = bridge
        self.serial = serial
        self.status = PhoneStatus(serial, "device", device_name(serial))
        self.relay: PhoneRelay | None = None
        self.control: TermuxControl | None = None  # the Termux listener's side, once needed
        self.last_exit_log = ""  # the end of the agent's log, as the Termux listener sent it
        self.stop_event = threading.Event()
        self.restarts = 0
        self.token_path: str | None = None  # on the phone until the agent has dialled the PS
        self._dials_before_start = 0
        self.failed_polls = 0  # since the last poll-failed event
        self._poll_failed_at: float | None = None  # time.monotonic() of that event
        self.ready = False  # set up: properties read, profile chosen, relay and reverse rule up
        self.retry_at: float | None = None  # time.monotonic() of the next try after a fault
        self.retry_wait_s = SETUP_RETRY_FIRST_S
        self.thread = threading.Thread(target=self._run, name=f"adb-{serial}", daemon=True)
        self.device = bridge.server.device(serial)
        self.phone_shell = PhoneShell(self.device, bridge.shell_timeout_s)

    # -- shell ----------------------------------------------------------------------------------

    def run(self, command: str) -> ShellOutput:
        """Run a shell command on the phone; PhoneCommandError when it gives no answer in time.
        (``stderr`` is empty on a phone without shell protocol v2: stdout holds both.)"""
        out = self.phone_shell.run(command)
        if out.code != 0 and out.stderr:
            log.debug("%s: %r exited %d: %s", self.serial, command, out.code, out.stderr.strip())
        return out

    def shell(self, command: str) -> tuple[int, str]:
        """Run a shell command on the phone; return (exit code, stdout)."""
        out = self.run(command)
        return out.code, out.stdout

    # -- life -----------------------------------------------------------------------------------

    def _run(self) -> None:
        """Set the phone up and start its agent, then poll until the phone leaves or the bridge
        stops. A phone fault costs the step it happens in; anything else is a bug, reported as
        agent-failed (the run must not wait for a phone whose thread died unseen)."""
        try:
            self._bring_up()
            while not self.stop_event.wait(self.bridge.telemetry_interval_s):
                if (self.retry_at is not None and time.monotonic() >= self.retry_at
                        and self.bridge.may_restart()):
                    self._bring_up()
                try:
                    self._tick()
                except PHONE_FAULTS as exc:
                    if not self._leaving():
                        self._poll_failed(exc)
        except Exception as exc:
            log.exception("%s: the bridge's session for this phone failed", self.serial)
            self._cannot_run(f"the bridge failed on this phone ({type(exc).__name__}: {exc}); "
                             f"a bug in testbed: the log has the traceback")

    def _leaving(self) -> bool:
        """Whether the phone is gone or the bridge stops (waits LEAVE_GRACE_S to tell)."""
        return self.stop_event.wait(LEAVE_GRACE_S)

    def _poll_failed(self, exc: Exception) -> None:
        """One poll is lost: say so, at most once every POLL_FAILED_EVERY_S seconds."""
        self.failed_polls += 1
        now = time.monotonic()
        if self._poll_failed_at is not None and now - self._poll_failed_at < POLL_FAILED_EVERY_S:
            log.debug("%s: a poll failed: %s", self.serial, exc)
            return
        self._poll_failed_at = now
        reason = str(exc) if isinstance(exc, PhoneCommandError) else \
            f"phone {self.serial}: {type(exc).__name__}: {exc}"
        log.warning("%s; this poll is lost, polling goes on (%d lost since the last warning)",
                    reason, self.failed_polls)
        self.bridge._emit("poll-failed", self.serial, reason=reason,
                          command=getattr(exc, "command", None), failed_polls=self.failed_polls)
        self.failed_polls = 0

    def _bring_up(self) -> None:
        """Set the phone up (once) and start its agent. A phone fault on the way is agent-failed
        with when the next try comes (SETUP_RETRY_FIRST_S, doubling to SETUP_RETRY_MAX_S); a
        problem that another try cannot mend (too old, the port taken, no Python) is not tried
        again."""
        self.retry_at = None
        try:
            if self.ready or self._setup():
                self._start_agent()
        except PHONE_FAULTS as exc:
            if self._leaving():
                return
            wait_s, self.retry_wait_s = self.retry_wait_s, min(self.retry_wait_s * 2,
                                                               SETUP_RETRY_MAX_S)
            self.retry_at = time.monotonic() + wait_s
            what = "starting the agent" if self.ready else "setting up the phone"
            self._cannot_run(f"{what} failed: {exc}; trying again in {wait_s:.0f} s",
                             retry_in_s=wait_s)

    def _setup(self) -> bool:
        b = self.bridge
        code, out = self.shell("getprop")
        props = parsers.parse_getprop(out)
        info = PhoneInfo.from_props(self.serial, props)
        choice = choose_profile(info, props, b.profile)
        s = self.status
        s.model, s.soc, s.android = info.model, info.soc, info.android_release
        s.profile, s.profile_reason = choice.profile, choice.reason
        if self.relay is None:  # (a second try after a fault keeps the first one's relay)
            self.relay = PhoneRelay(self.serial, b.ps_host, b.ps_port, b.shaping,
                                    upstream_unix=b.upstream_unix.get(self.serial))
            s.relay_port = self.relay.start()
        reverse_problem = None
        try:
            self._apply_reverse()
        except AdbError as exc:  # the phone is there (else it leaves): its port is taken
            if self._leaving():
                raise
            reverse_problem = phone_port_taken(b.phone_port, exc)
        b._emit("ready", self.serial, model=info.model, soc=info.soc, android=info.android_release,
                abi=info.abi, profile=choice.profile, profile_reason=choice.reason,
                relay_port=s.relay_port, phone_port=b.phone_port)
        problem = support_problem(info) or reverse_problem
        if problem:
            self._cannot_run(problem)
            return False
        self.ready = True
        return True

    def _apply_reverse(self) -> None:
        assert self.relay is not None
        self.device.reverse(f"tcp:{self.bridge.phone_port}", f"tcp:{self.relay.port}")
        if self.control is not None:
            self.device.reverse(*self._control_rule())
        self.status.reverse_ok = True

    def _reverse_present(self) -> bool:
        want = (f"tcp:{self.bridge.phone_port}", f"tcp:{self.status.relay_port}")
        rules = {(r.remote, r.local) for r in self.device.reverse_list()}
        if self.control is not None and self._control_rule() not in rules:
            return False
        return want in rules

    @property
    def control_port(self) -> int:
        """The phone port the Termux listener dials."""
        return self.bridge.phone_port + termux_control.CONTROL_PORT_OFFSET

    def _control_rule(self) -> tuple[str, str]:
        assert self.control is not None
        return f"tcp:{self.control_port}", f"tcp:{self.control.port}"

    def _ensure_control(self) -> TermuxControl:
        """The phone's Termux control port: listening here, reversed from the phone."""
        if self.control is None:
            control = TermuxControl(self.shell, self.control_port, self._on_control)
            control.start()
            try:
                self.device.reverse(f"tcp:{self.control_port}", f"tcp:{control.port}")
            except AdbError as exc:
                control.stop()
                raise ControlError(termux_control.reverse_failed(self.control_port, exc)) \
                    from exc
            self.control = control
        return self.control

    def _on_control(self, kind: str, data: dict[str, Any]) -> None:
        b = self.bridge
        if kind == "listener-connected":
            b._emit("listener-connected", self.serial, uid=data.get("uid"),
                    python=data.get("python"), numpy=data.get("numpy"), grpc=data.get("grpc"))
        elif kind == "listener-refused":
            if self.status.agent_pid is None:
                self.status.waiting = (f"the bridge refused a connection to the Termux control "
                                       f"port: {data.get('reason')}")
            b._emit("listener-refused", self.serial, **data)
        elif kind == "listener-lost":
            b._emit("listener-lost", self.serial)
        elif kind == "agent-exited":
            self.last_exit_log = str(data.get("log_tail") or "")[-500:]

    def _cannot_run(self, reason: str, **data: Any) -> None:
        self.status.problem = reason
        log.warning("phone %s (%s) cannot run the agent: %s", self.serial, self.status.model,
                    reason)
        self.bridge._emit("agent-failed", self.serial, reason=reason, **data)

    def _push_token(self, mode: int) -> str:
        """Write the join token to a fresh file on the phone; return its path.

        The token never goes on a command line (the phone's process list would show it). The
        file name is random and the directory cannot be listed by apps; mode 0600 when the adb
        shell runs the agent, 0644 when Termux (another user) must read it. It is removed as
        soon as the agent has dialled the PS (it has read the token by then)."""
        self._remove_token()
        path = f"{agent_package.PHONE_DIR}/token-{secrets.token_hex(8)}"
        self.device.sync.push(self.bridge.token.encode() + b"\n", path, mode=mode)
        self.token_path = path
        self._dials_before_start = self.relay.connections_total if self.relay else 0
        return path

    def _remove_token(self) -> None:
        if self.token_path is not None:
            self.shell(f"rm -f {shlex.quote(self.token_path)}")
            self.token_path = None

    def _agent_argv(self, token_path: str) -> list[str]:
        b = self.bridge
        argv = ["--ps", f"127.0.0.1:{b.phone_port}", "--token-file", token_path,
                "--name", self.status.name, "--kind", "real"]
        if self.status.profile:
            argv += ["--profile", self.status.profile]
            gflops = profile_gflops(self.status.profile)
            if gflops:  # the PS sizes its window by predicted speed until it has observed it
                argv += ["--gflops", repr(gflops)]
        return argv + b.extra_agent_args

    def _start_agent(self) -> None:
        b = self.bridge
        phone_dir = agent_package.PHONE_DIR
        self.shell(f"mkdir -p {phone_dir} && chmod 711 {phone_dir}")  # apps cannot list it
        self.device.sync.push(b.agent_zip(), f"{phone_dir}/agent.zip", mode=0o644)
        self.device.sync.push(agent_package.START_SCRIPT.read_bytes(),
                              f"{phone_dir}/start-agent.sh", mode=0o755)
        if b.launcher in ("auto", "shell"):
            argv = self._agent_argv(self._push_token(0o600))
            answer = self.run(f"sh {phone_dir}/start-agent.sh {shlex.join(argv)}")
            lines = answer.stdout.strip().splitlines()
            pid = parsers.parse_int(lines[-1]) if lines else None  # it prints the pid last
            if answer.code == 0 and pid is not None:
                self._started(pid, "shell")
                return
            detail = (answer.stderr or answer.stdout).strip()
            if answer.code != NO_PYTHON_EXIT or b.launcher == "shell":
                self._remove_token()
                reason = START_EXIT_REASONS.get(answer.code,
                                                f"the start script exited {answer.code}")
                self._cannot_run(f"{reason}: {detail}" if detail else reason)
                return
        problem = self._start_in_termux()
        if problem:
            self._remove_token()
            self._cannot_run(problem if b.launcher == "termux" else
                             f"no Python that the adb shell can run, and Termux: {problem}")

    def _start_via_listener(self) -> str | None:
        """Start the agent through the Termux listener; None when it runs, else why not."""
        assert self.control is not None
        argv = self._agent_argv("")
        i = argv.index("--token-file")
        del argv[i:i + 2]  # the token travels over the verified connection, into the env
        if "--profile" in argv:  # the listener takes plain names: a profile file goes by its name
            j = argv.index("--profile") + 1
            argv[j] = Path(argv[j]).stem if "/" in argv[j] else argv[j]
        try:
            reply = self.control.request("start", argv=argv, token=self.bridge.token)
        except ControlError as exc:
            return str(exc)
        if not reply.get("ok") or not isinstance(reply.get("pid"), int):
            fix = (f" Fix: {termux.PACKAGES_FIX}" if "cannot import" in str(reply.get("error"))
                   else "")
            return f"the Termux listener refused to start the agent: {reply.get('error')}.{fix}"
        self.status.waiting = ""
        self._started(int(reply["pid"]), "termux-serve")
        return None

    def _wait_for_listener(self, why: str) -> None:
        """No way to start the agent until the user starts the listener in Termux: say so."""
        command = termux_control.serve_command(self.control_port)
        self.status.waiting = (f"in Termux run `{command}` (once; leave it running){why}")
        log.warning("phone %s (%s): waiting for the Termux listener: %s", self.serial,
                    self.status.model, self.status.waiting)
        self.bridge._emit("agent-waiting", self.serial, reason=self.status.waiting,
                          command=command)

    def _start_in_termux(self) -> str | None:
        """Start the agent in Termux: through the listener the user started there, else with
        Termux's RUN_COMMAND intent; None when it runs or waits for the listener, else why not."""
        b = self.bridge
        self._remove_token()  # the adb shell's (it has no python); Termux gets its own
        if not self.shell(f"pm path {termux.PACKAGE}")[1].strip().startswith("package:"):
            return ("Termux (com.termux) is not installed; install it from F-Droid or Termux's "
                    "GitHub releases, then run `testbed adb doctor SERIAL`")
        script = f"{agent_package.PHONE_DIR}/termux-agent.sh"
        self.device.sync.push(termux.SCRIPT.read_bytes(), script, mode=0o644)
        self.device.sync.push(termux.SERVE_PY.read_bytes(),
                              f"{agent_package.PHONE_DIR}/{termux_control.SERVE_PY}", mode=0o644)
        try:
            control = self._ensure_control()
        except ControlError as exc:
            return str(exc)
        # The listener dials every second: give one that runs a moment to find the new rule.
        if control.wait_connected(b.listener_grace_s):
            return self._start_via_listener()
        # Ask with a harmless intent first: the token file Termux would read is readable by
        # every app, so it goes to the phone only when the intent can get through.
        answer = self._send_intent(script, ["stop"])
        if answer.outcome == "sent":
            argv = ["start", *self._agent_argv(self._push_token(0o644))]
            answer = self._send_intent(script, argv)
        if answer.outcome == "permission":  # the stock phone's answer: the listener is the way
            self._wait_for_listener(f" ({termux.PERMISSION_REFUSED})")
            return None
        if answer.outcome != "sent":
            return f"am could not reach Termux's RunCommandService: {answer.text}"
        deadline = time.monotonic() + b.termux_start_timeout_s
        while time.monotonic() < deadline and not self.stop_event.is_set():
            pid = self._find_termux_agent()
            if pid is not None:
                self._started(pid, "termux")
                return None
            time.sleep(0.3)
        self._remove_token()
        self._wait_for_listener(
            f" (Termux got the RUN_COMMAND intent but no agent appeared within "
            f"{b.termux_start_timeout_s:.0f} s: external apps are not allowed, or python, numpy "
            f"or grpcio are missing; `testbed adb doctor {self.serial}` tells which)")
        return None

    def _send_intent(self, script: str, argv: list[str]) -> termux.IntentAnswer:
        out = self.run(termux.intent_command(script, argv))
        answer = termux.parse_am_output(out.stdout + out.stderr, out.code)
        if answer.outcome == "background":  # Android 8+: ask for a foreground service instead
            out = self.run(termux.intent_command(script, argv, verb="start-foreground-service"))
            answer = termux.parse_am_output(out.stdout + out.stderr, out.code)
        return answer

    def _find_termux_agent(self) -> int | None:
        code, out = self.shell(f"pgrep -f {shlex.quote(termux.agent_pattern(self.status.name))}")
        pids = [pid for pid in map(parsers.parse_int, out.split()) if pid is not None]
        return max(pids) if code == 0 and pids else None

    def _started(self, pid: int, launcher: str) -> None:
        self.status.agent_pid = pid
        self.status.launcher = launcher
        self.retry_wait_s = SETUP_RETRY_FIRST_S
        self.status.problem = ""
        self.status.waiting = ""
        self.bridge._emit("agent-started", self.serial, pid=pid, name=self.status.name,
                          profile=self.status.profile, launcher=launcher)

    def _agent_alive(self, pid: int) -> bool:
        if self.status.launcher.startswith("termux"):  # another user's: visible, not signalable
            return self.shell(f"test -d /proc/{pid}")[0] == 0
        return self.shell(f"kill -0 {pid}")[0] == 0

    def _tick(self) -> None:
        b = self.bridge
        if self.status.reverse_ok and not self._reverse_present():
            log.warning("%s: the reverse rule tcp:%d is gone; applying it again", self.serial,
                        b.phone_port)
            self._apply_reverse()
            b._emit("reverse-reapplied", self.serial, phone_port=b.phone_port,
                    relay_port=self.status.relay_port)
        if (self.token_path is not None and self.relay is not None
                and self.relay.connections_total > self._dials_before_start):
            self._remove_token()  # the agent has dialled the PS, so it has read the token
        if (self.status.agent_pid is None and self.status.waiting and self.control is not None
                and self.control.connected() and b.may_restart()):
            problem = self._start_via_listener()  # the user has started the listener
            if problem:
                self._cannot_run(problem)
        pid = self.status.agent_pid
        if pid is not None and not self._agent_alive(pid):
            self.status.agent_pid = None
            b._emit("agent-exited", self.serial, pid=pid, restarts=self.restarts)
            if not b.may_restart():
                log.info("%s: the agent exited and the job has ended; not restarting it",
                         self.serial)
            elif self.restarts < MAX_AGENT_RESTARTS:
                self.restarts += 1
                self._bring_up()
            else:
                tail = (f"; the end of its log in Termux: {self.last_exit_log.strip()}"
                        if self.last_exit_log.strip() else "")
                self._cannot_run(f"the agent exited {self.restarts + 1} times; not "
                                 f"restarting{tail}")
        sample = telemetry.sample(self.shell)
        self.status.last_telemetry = sample
        b._record_telemetry(self.serial, self.status.name, sample)
        b._emit("telemetry", self.serial, **sample)

    def _stop_agent(self, pid: int) -> None:
        """SIGTERM (the agent leaves gracefully), then wait for it so its Leave gets through.

        An agent Termux started belongs to Termux's user: only Termux can signal it, so the
        SIGTERM goes through a second intent (``termux-agent.sh stop``)."""
        if self.status.launcher == "termux-serve":
            try:
                assert self.control is not None
                self.control.request("stop")
            except ControlError as exc:
                log.warning("%s: cannot reach the Termux listener to stop the agent: %s",
                            self.serial, exc)
        elif self.status.launcher == "termux":
            self._send_intent(f"{agent_package.PHONE_DIR}/termux-agent.sh", ["stop"])
        else:
            self.shell(f"kill -TERM {pid}")
        deadline = time.monotonic() + self.bridge.agent_grace_s
        while time.monotonic() < deadline:
            if not self._agent_alive(pid):
                return
            time.sleep(0.1)
        if self.status.launcher.startswith("termux"):
            log.warning("%s: the agent (pid %d) did not leave within %.1f s; only Termux can "
                        "kill it", self.serial, pid, self.bridge.agent_grace_s)
            return
        log.warning("%s: the agent (pid %d) did not leave within %.1f s; killing it",
                    self.serial, pid, self.bridge.agent_grace_s)
        self.shell(f"kill -KILL {pid}")

    def close(self, reachable: bool) -> None:
        """End the session; stop the agent and remove the reverse rule when the phone is there."""
        self.stop_event.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=self.bridge.shell_timeout_s + 2)
        if reachable:
            try:
                self._remove_token()
                if self.status.agent_pid is not None:
                    self._stop_agent(self.status.agent_pid)
                if self.status.reverse_ok:  # not when the phone refused it (port taken)
                    self.device.reverse_remove(f"tcp:{self.bridge.phone_port}")
                if self.control is not None:
                    self.device.reverse_remove(f"tcp:{self.control_port}")
            except PHONE_FAULTS as exc:
                log.info("%s: cleanup on the phone failed: %s", self.serial, exc)
        if self.control is not None:
            self.control.stop()  # the listener in Termux dials again, for the next run
        if self.relay is not None:
            self.relay.stop()


class AdbBridge:
    """Follows an adb server and brings every phone in state ``device`` into the run."""

    def __init__(self, adb_host: str, adb_port: int, ps_address: str, token: str, *,
                 serials: tuple[str, ...] | None = None, profile: str = "auto",
                 shaping: RelayShaping = NO_SHAPING, phone_port: int = 7700,
                 telemetry_interval_s: float = 2.0, shell_timeout_s: float = 10.0,
                 devices_jsonl: Path | None = None, extra_agent_args: tuple[str, ...] = (),
                 on_event: Callable[[BridgeEvent], None] | None = None,
                 backoff_initial_s: float = 0.1, backoff_max_s: float = 5.0,
                 crosscheck_s: float = 5.0, agent_zip: bytes | None = None,
                 agent_grace_s: float = 10.0, launcher: str = "auto",
                 termux_start_timeout_s: float = 20.0, listener_grace_s: float = 2.5,
                 may_restart: Callable[[], bool] = lambda: True,
                 upstream_unix: dict[str, str] | None = None):
        host, _, port = ps_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"ps_address must be HOST:PORT, got {ps_address!r}")
        self.server = AdbServer(adb_host, adb_port, timeout_s=shell_timeout_s)
        self.ps_host, self.ps_port = host, int(port)
        self.token = token
        self.serials = set(serials) if serials else None
        self.profile = profile
        self.shaping = shaping
        self.phone_port = phone_port
        self.telemetry_interval_s = telemetry_interval_s
        self.shell_timeout_s = shell_timeout_s
        self.agent_grace_s = agent_grace_s
        if launcher not in ("auto", "shell", "termux"):
            raise ValueError(f"launcher must be auto, shell or termux, got {launcher!r}")
        self.launcher = launcher  # auto: the adb shell's python, else Termux's RUN_COMMAND
        self.termux_start_timeout_s = termux_start_timeout_s
        self.listener_grace_s = listener_grace_s  # wait this long for a running listener
        self.may_restart = may_restart  # False once the job has ended: an exited agent stays so
        # serial -> Unix socket of the phone's forwarder (Mininet); the relay dials it, not the PS
        self.upstream_unix = dict(upstream_unix or {})
        self.devices_jsonl = devices_jsonl
        self.extra_agent_args = list(extra_agent_args)
        self.on_event = on_event
        self.events: queue.Queue[BridgeEvent] = queue.Queue()
        self.tracker = DeviceTracker(self.server, self._on_states, backoff_initial_s,
                                     backoff_max_s, crosscheck_s)
        self._lock = threading.RLock()
        self._states: dict[str, str] = {}
        self._sessions: dict[str, _PhoneSession] = {}
        self._zip = agent_zip  # None: built from this checkout on first use
        self._jsonl_lock = threading.Lock()
        self._stopping = False

    # -- public -------------------------------------------------------------------------------

    def start(self) -> AdbBridge:
        """Start following the adb server."""
        self.tracker.start()
        return self

    def stop(self) -> None:
        """Stop every phone's agent (SIGTERM: a graceful leave), remove reverse rules, relays.

        The phones are stopped at once, each in a thread of its own: N phones that do not
        answer cost one phone's timeouts, not N of them."""
        self._stopping = True  # phones vanishing from here on are the bridge's own doing
        self.tracker.stop()
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        closers = [threading.Thread(target=self._stop_session, args=(session,),
                                    name=f"adb-stop-{session.serial}", daemon=True)
                   for session in sessions]
        for closer in closers:
            closer.start()
        for closer in closers:  # each close is bounded by the shell and agent timeouts
            closer.join()

    def __enter__(self) -> AdbBridge:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def poll(self, timeout_s: float = 0.0) -> list[BridgeEvent]:
        """Events since the last poll; waits up to timeout_s for the first one."""
        out: list[BridgeEvent] = []
        try:
            out.append(self.events.get(timeout=timeout_s) if timeout_s > 0 else
                       self.events.get_nowait())
            while True:
                out.append(self.events.get_nowait())
        except queue.Empty:
            pass
        return out

    def phones(self) -> list[PhoneStatus]:
        """A snapshot of every known phone (sessions and phones not in state ``device``)."""
        with self._lock:
            out = []
            for serial, state in sorted(self._states.items()):
                session = self._sessions.get(serial)
                out.append(session.status if session else
                           PhoneStatus(serial, state, device_name(serial)))
            return out

    def relay_for(self, peer: tuple[str, int]) -> str | None:
        """The serial whose relay opened the PS connection with this peer address."""
        with self._lock:
            for session in self._sessions.values():
                if session.relay and tuple(peer[:2]) in session.relay.upstream_addresses():
                    return session.serial
        return None

    def agent_zip(self) -> bytes:
        """The agent zip pushed to phones (built once)."""
        if self._zip is None:
            self._zip = agent_package.build_agent_zip()
        return self._zip

    # -- internals -------------------------------------------------------------------------------

    def _stop_session(self, session: _PhoneSession) -> None:
        session.close(reachable=True)
        self._emit("stopped", session.serial)

    def _emit(self, kind: str, serial: str, **data: Any) -> None:
        event = BridgeEvent(kind, serial, time.time(), data)
        log.debug("adb event %s %s %s", kind, serial, data if kind != "telemetry" else "")
        self.events.put(event)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a broken callback must not stop the bridge
                log.exception("adb bridge event callback failed")

    def _record_telemetry(self, serial: str, name: str, sample: dict[str, Any]) -> None:
        if self.devices_jsonl is None:
            return
        line = json.dumps({"time_s": time.time(), "device": name, "serial": serial,
                           "kind": "adb-telemetry", **sample}, sort_keys=True)
        with self._jsonl_lock, open(self.devices_jsonl, "a") as f:
            f.write(line + "\n")

    def _on_states(self, states: dict[str, str], cause: str) -> None:
        if self._stopping:
            return
        if self.serials is not None:
            states = {s: st for s, st in states.items() if s in self.serials}
        with self._lock:
            old, self._states = self._states, dict(states)
        if cause == "lost":
            self._emit("tracker-lost", "")
        for serial, before, after in diff_states(old, states):
            if before is None:
                self._emit("plugged", serial, state=after)
            elif after is None:
                self._leave(serial, "unplugged" if cause != "lost" else "adb-server-lost")
                continue
            else:
                self._emit("state", serial, old=before, new=after)
            if after == "device":
                self._join(serial)
            elif before == "device" and after == "offline":
                self._leave(serial, "offline")

    def _join(self, serial: str) -> None:
        with self._lock:
            if serial in self._sessions:
                return
            session = _PhoneSession(self, serial)
            self._sessions[serial] = session
        session.thread.start()

    def _leave(self, serial: str, cause: str) -> None:
        with self._lock:
            session = self._sessions.pop(serial, None)
        if session is not None:
            threading.Thread(target=session.close, args=(False,), daemon=True).start()
        kind = cause if cause in ("unplugged", "offline") else "unplugged"
        self._emit(kind, serial, cause=cause,
                   name=device_name(serial), had_agent=bool(session and session.status.agent_pid))
