"""GEMM timings on a phone over adb: the perf model's :class:`GemmRunner` seam, for a phone.

The runner pushes ``phone/run-python.sh`` and ``phone/time_gemm.py`` to
``/data/local/tmp/testbed/`` and runs one shell command per shape; the script prints the samples
as one JSON line. :func:`testbed.perf_model.measure.measure` drives it unchanged.

When the adb shell has no python (an unrooted phone), the runner asks the Termux listener
(``termux-agent.sh serve``; see termux_control.py) instead: the same script, run by Termux's
python, through the verified control connection on ``phone_port + 2``.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from testbed.adb_bridge import termux, termux_control
from testbed.adb_bridge.agent_package import PHONE_DIR
from testbed.adb_bridge.bridge import NO_PYTHON_EXIT, START_EXIT_REASONS, device_name
from testbed.adb_bridge.termux_control import ControlError, TermuxControl

PHONE_SCRIPTS = Path(__file__).resolve().parent / "phone"


class PhoneCannotMeasure(RuntimeError):
    """The phone cannot run the timing script (no Python, no numpy, ...)."""


class _NoShellPython(Exception):
    pass


class AdbGemmRunner:
    """Times numpy ``A @ B`` on one phone (an adbutils device) through adb shell."""

    def __init__(self, device: Any, min_sample_s: float = 1e-3, timeout_s: float = 120.0,
                 phone_port: int = 7700, listener_wait_s: float = 10.0):
        self.device = device
        self.min_sample_s = min_sample_s
        self.timeout_s = timeout_s
        self.control: TermuxControl | None = None
        self.control_port = phone_port + termux_control.CONTROL_PORT_OFFSET
        for name, mode in (("run-python.sh", 0o755), ("time_gemm.py", 0o644)):
            device.sync.push((PHONE_SCRIPTS / name).read_bytes(), f"{PHONE_DIR}/{name}",
                             mode=mode)
        try:
            self._info = self._run("describe")
        except _NoShellPython:
            self._info = self._through_termux(listener_wait_s)

    def _through_termux(self, wait_s: float) -> dict[str, Any]:
        """No python for the adb shell: use the Termux listener, or say how to start it."""
        d = self.device
        no_python = START_EXIT_REASONS[NO_PYTHON_EXIT]
        if not d.shell2(f"pm path {termux.PACKAGE}", timeout=30,
                        v2=True).stdout.strip().startswith("package:"):
            raise PhoneCannotMeasure(f"{d.serial}: {no_python}, and Termux (com.termux) is not "
                                     f"installed: install it from F-Droid, then in Termux run "
                                     f"{termux.PACKAGES_FIX.removeprefix('in Termux run: ')}")
        d.sync.push(termux.SCRIPT.read_bytes(), f"{PHONE_DIR}/termux-agent.sh", mode=0o644)
        d.sync.push(termux.SERVE_PY.read_bytes(), f"{PHONE_DIR}/{termux_control.SERVE_PY}",
                    mode=0o644)

        def shell(command: str) -> tuple[int, str]:
            r = d.shell2(command, timeout=30, v2=True)
            return r.returncode, r.stdout

        self.control = TermuxControl(shell, self.control_port)
        self.control.start()
        d.reverse(f"tcp:{self.control_port}", f"tcp:{self.control.port}")
        if not self.control.wait_connected(wait_s):
            refusal = self.control.last_refusal
            self.close()
            command = termux_control.serve_command(self.control_port)
            raise PhoneCannotMeasure(
                f"{d.serial}: {no_python}, and no Termux listener "
                + (f"was accepted ({refusal})" if refusal else f"connected within {wait_s:.0f} s")
                + f"; in Termux run `{command}` (once; leave it running), then measure again")
        return self._run("describe")

    def close(self) -> None:
        """Drop the Termux control port, if it was used."""
        if self.control is not None:
            self.control.stop()
            self.control = None
            try:
                self.device.reverse_remove(f"tcp:{self.control_port}")
            except Exception:  # the phone may be gone; nothing is left to undo on it then
                pass

    def _run(self, *args: str) -> dict[str, Any]:
        if self.control is not None:
            try:
                reply = self.control.request("gemm", timeout_s=self.timeout_s, args=list(args))
            except ControlError as exc:
                raise PhoneCannotMeasure(f"{self.device.serial}: {exc}") from exc
            if not reply.get("ok") or not isinstance(reply.get("result"), dict):
                raise PhoneCannotMeasure(f"{self.device.serial}: Termux: {reply.get('error')}")
            return dict(reply["result"])
        cmd = (f"sh {PHONE_DIR}/run-python.sh {PHONE_DIR}/time_gemm.py "
               f"{shlex.join(args)}")
        result = self.device.shell2(cmd, timeout=self.timeout_s, v2=True)
        if result.returncode == NO_PYTHON_EXIT and args == ("describe",):
            raise _NoShellPython()
        if result.returncode != 0:
            reason = START_EXIT_REASONS.get(result.returncode,
                                            f"the timing script exited {result.returncode}")
            raise PhoneCannotMeasure(f"{self.device.serial}: {reason}: {result.stderr.strip()}")
        lines = result.stdout.strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError) as exc:
            raise PhoneCannotMeasure(f"{self.device.serial}: unreadable timing output "
                                     f"{result.stdout[-200:]!r}") from exc

    def describe(self) -> dict[str, str | int]:
        """device, backend, threads and cpu_model of the phone."""
        return {"device": device_name(self.device.serial),
                "backend": f"numpy-{self._info.get('numpy', '?')}-phone",
                "threads": 0,  # numpy's default on the phone: BLAS picks its own thread count
                "cpu_model": str(self._info.get("cpu_model", "unknown"))}

    def time_gemm(self, m: int, k: int, n: int, dtype: str, warmup: int,
                  repeats: int) -> list[float]:
        """Seconds of one ``A @ B`` call on the phone, one figure per repeat."""
        out = self._run(str(m), str(k), str(n), dtype, str(warmup), str(repeats),
                        repr(self.min_sample_s))
        return [float(s) for s in out["samples"]]
