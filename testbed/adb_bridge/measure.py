"""GEMM timings on a phone over adb: the perf model's :class:`GemmRunner` seam, for a phone.

The runner pushes ``phone/run-python.sh`` and ``phone/time_gemm.py`` to
``/data/local/tmp/testbed/`` and runs one shell command per shape; the script prints the samples
as one JSON line. :func:`testbed.perf_model.measure.measure` drives it unchanged.

When the adb shell has no python (an unrooted phone), the runner asks the Termux listener
(``termux-agent.sh serve``; see termux_control.py) instead: the same script, run by Termux's
python, through the verified control connection on ``phone_port + 2``.

Every call of the timing script has one deadline for its whole answer, which grows with the work
asked: ``start_s`` (python and numpy starting on a slow phone) plus ``per_sample_s`` for each
call timed (the warm-up call and ``repeats`` samples); ``testbed adb measure`` chooses the two
and says them in its --help. The answer is checked before it is used: ``describe`` must be a
JSON object, a shape's ``{"samples": [...]}`` exactly ``repeats`` numbers of seconds, each
between 1 ns (:data:`~testbed.perf_model.measurements.MIN_MODEL_SECONDS`, no call is faster)
and the call's deadline. Anything else is :class:`PhoneCannotMeasure` naming the phone, the
shape and what was expected, so no figure that testbed's own reader would refuse is written.

A sweep on a phone takes minutes (one adb shell command and python start per shape and pass):
``testbed adb measure`` logs its progress (INFO, on stderr) through
:class:`~testbed.perf_model.measure.SweepProgress`, as ``perf measure`` prints its own.
"""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path
from typing import Any

from testbed.adb_bridge import termux, termux_control
from testbed.adb_bridge.agent_package import PHONE_DIR
from testbed.adb_bridge.bridge import NO_PYTHON_EXIT, START_EXIT_REASONS, device_name
from testbed.adb_bridge.client import PhoneCommandError, PhoneShell, printable
from testbed.adb_bridge.termux_control import ControlError, TermuxControl
from testbed.perf_model.measurements import MIN_MODEL_SECONDS

log = logging.getLogger(__name__)

PHONE_SCRIPTS = Path(__file__).resolve().parent / "phone"
QUICK_COMMAND_S = 30.0  # pm path, the Termux control's socket-table reads


class PhoneCannotMeasure(RuntimeError):
    """The phone cannot run the timing script (no Python, no numpy, ...) or answered what the
    script never prints."""


class _NoShellPython(Exception):
    pass


def call_deadline_s(warmup: int, repeats: int, start_s: float, per_sample_s: float) -> float:
    """Seconds one shape's timing may take on the phone, start to answer."""
    return start_s + per_sample_s * (max(warmup, 1) + repeats)


class AdbGemmRunner:
    """Times numpy ``A @ B`` on one phone (an adbutils device) through adb shell."""

    def __init__(self, device: Any, *, start_s: float, per_sample_s: float,
                 min_sample_s: float = 1e-3, phone_port: int = 7700,
                 listener_wait_s: float = 10.0):
        self.device = device
        self.serial = str(device.serial)
        self.shell = PhoneShell(device, QUICK_COMMAND_S)
        self.min_sample_s = min_sample_s
        self.start_s = start_s
        self.per_sample_s = per_sample_s
        self.control: TermuxControl | None = None
        self.control_port = phone_port + termux_control.CONTROL_PORT_OFFSET
        for name, mode in (("run-python.sh", 0o755), ("time_gemm.py", 0o644)):
            device.sync.push((PHONE_SCRIPTS / name).read_bytes(), f"{PHONE_DIR}/{name}",
                             mode=mode)
        try:
            try:
                self._info = self._describe()
            except _NoShellPython:
                self._info = self._through_termux(listener_wait_s)
        except BaseException:  # no runner for the caller to close: drop the control port here
            self.close()
            raise

    def _fail(self, what: str, problem: str) -> PhoneCannotMeasure:
        return PhoneCannotMeasure(f"phone {self.serial}: {what}: {problem}")

    def _describe(self) -> dict[str, Any]:
        answer = self._run(("describe",), self.start_s, "describing the phone")
        if not isinstance(answer, dict):
            raise self._fail("describing the phone", f"the timing script answered "
                             f"{_shown(answer)}; expected a JSON object with cpu_model and numpy")
        return answer

    def _through_termux(self, wait_s: float) -> dict[str, Any]:
        """No python for the adb shell: use the Termux listener, or say how to start it."""
        d = self.device
        no_python = START_EXIT_REASONS[NO_PYTHON_EXIT]
        if not self.shell.run(f"pm path {termux.PACKAGE}").stdout.strip().startswith("package:"):
            raise PhoneCannotMeasure(f"phone {self.serial}: {no_python}, and Termux "
                                     f"(com.termux) is not installed: install it from F-Droid, "
                                     f"then in Termux run "
                                     f"{termux.PACKAGES_FIX.removeprefix('in Termux run: ')}")
        d.sync.push(termux.SCRIPT.read_bytes(), f"{PHONE_DIR}/termux-agent.sh", mode=0o644)
        d.sync.push(termux.SERVE_PY.read_bytes(), f"{PHONE_DIR}/{termux_control.SERVE_PY}",
                    mode=0o644)

        def shell(command: str) -> tuple[int, str]:
            r = self.shell.run(command)
            return r.code, r.stdout

        self.control = TermuxControl(shell, self.control_port)
        self.control.start()
        d.reverse(f"tcp:{self.control_port}", f"tcp:{self.control.port}")
        log.info("phone %s: no python for the adb shell; waiting up to %.0f s for the Termux "
                 "listener (%s) to dial 127.0.0.1:%d on the phone", self.serial, wait_s,
                 termux_control.serve_command(self.control_port), self.control_port)
        if not self.control.wait_connected(wait_s):
            refusal = self.control.last_refusal
            self.close()
            command = termux_control.serve_command(self.control_port)
            raise PhoneCannotMeasure(
                f"phone {self.serial}: {no_python}, and no Termux listener "
                + (f"was accepted ({printable(refusal, most=300)})" if refusal
                   else f"connected within {wait_s:.0f} s")
                + f"; in Termux run `{command}` (once; leave it running), then measure again")
        return self._describe()

    def close(self) -> None:
        """Drop the Termux control port, if it was used."""
        if self.control is not None:
            self.control.stop()
            self.control = None
            try:
                self.device.reverse_remove(f"tcp:{self.control_port}")
            except Exception:  # the phone may be gone; nothing is left to undo on it then
                pass

    def _run(self, args: tuple[str, ...], timeout_s: float, what: str) -> Any:
        """The timing script's answer to ``args``: any JSON value (the caller checks it)."""
        label = f"time_gemm.py {shlex.join(args)}"
        if self.control is not None:
            try:
                reply = self.control.request("gemm", timeout_s=timeout_s, args=list(args))
            except ControlError as exc:
                raise self._fail(what, f"Termux: {printable(str(exc), most=300)}") from None
            if not reply.get("ok") or "result" not in reply:
                raise self._fail(what, f"Termux: `{label}` failed: "
                                 f"{printable(str(reply.get('error')), most=300)}")
            return reply["result"]
        cmd = f"sh {PHONE_DIR}/run-python.sh {PHONE_DIR}/time_gemm.py {shlex.join(args)}"
        try:
            result = self.shell.run(cmd, timeout_s=timeout_s)
        except PhoneCommandError as exc:
            raise self._fail(what, f"`{label}` {exc.reason}") from None
        if result.code == NO_PYTHON_EXIT and args == ("describe",):
            raise _NoShellPython()
        if result.code != 0:
            reason = START_EXIT_REASONS.get(result.code, f"`{label}` exited {result.code}")
            said = (result.stderr or result.stdout).strip()  # shell v1 has stdout only
            raise self._fail(what, f"{reason}: {printable(said[-300:], most=300)}" if said
                             else reason)
        lines = result.stdout.strip().splitlines()
        try:
            return json.loads(lines[-1])
        # RecursionError: JSON nested thousands deep, which python's parser cannot take
        except (IndexError, ValueError, RecursionError):
            said = printable(repr(result.stdout[-200:])) if lines else "nothing"
            raise self._fail(what, f"`{label}` printed {said}; expected a line of JSON") \
                from None

    def describe(self) -> dict[str, str | int]:
        """device, backend, threads and cpu_model of the phone (its words made printable)."""
        return {"device": device_name(self.serial),
                "backend": f"numpy-{printable(str(self._info.get('numpy', '?')), most=40)}-phone",
                "threads": 0,  # numpy's default on the phone: BLAS picks its own thread count
                "cpu_model": printable(str(self._info.get("cpu_model", "unknown")))}

    def time_gemm(self, m: int, k: int, n: int, dtype: str, warmup: int,
                  repeats: int) -> list[float]:
        """Seconds of one ``A @ B`` call on the phone, one figure per repeat."""
        limit_s = call_deadline_s(warmup, repeats, self.start_s, self.per_sample_s)
        what = f"shape {m}x{k}x{n}"
        answer = self._run((str(m), str(k), str(n), dtype, str(warmup), str(repeats),
                            repr(self.min_sample_s)), limit_s, what)
        samples = answer.get("samples") if isinstance(answer, dict) else None
        if not (isinstance(samples, list) and len(samples) == repeats
                and all(_seconds_within(s, limit_s) for s in samples)):
            raise self._fail(what, f"the timing script answered {_shown(answer)}; expected "
                             f'{{"samples": [{repeats} number(s) of seconds, each from '
                             f"{MIN_MODEL_SECONDS:g} to {limit_s:g}]}}")
        return [float(s) for s in samples]


def _seconds_within(value: Any, limit_s: float) -> bool:
    # bool is an int to python, NaN fails both comparisons, 1e400 parses as inf
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and MIN_MODEL_SECONDS <= value <= limit_s)


def _shown(answer: Any) -> str:
    """A JSON answer as an error message quotes it: one line, short."""
    try:
        return printable(json.dumps(answer), most=120)
    except (ValueError, RecursionError):
        return "a JSON value nested too deep to show"
