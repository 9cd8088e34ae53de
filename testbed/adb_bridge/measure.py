"""GEMM timings on a phone over adb: the perf model's :class:`GemmRunner` seam, for a phone.

The runner pushes ``phone/run-python.sh`` and ``phone/time_gemm.py`` to
``/data/local/tmp/testbed/`` and runs one shell command per shape; the script prints the samples
as one JSON line. :func:`testbed.perf_model.measure.measure` drives it unchanged.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from testbed.adb_bridge.agent_package import PHONE_DIR
from testbed.adb_bridge.bridge import START_EXIT_REASONS, device_name

PHONE_SCRIPTS = Path(__file__).resolve().parent / "phone"


class PhoneCannotMeasure(RuntimeError):
    """The phone cannot run the timing script (no Python, no numpy, ...)."""


class AdbGemmRunner:
    """Times numpy ``A @ B`` on one phone (an adbutils device) through adb shell."""

    def __init__(self, device: Any, min_sample_s: float = 1e-3, timeout_s: float = 120.0):
        self.device = device
        self.min_sample_s = min_sample_s
        self.timeout_s = timeout_s
        for name, mode in (("run-python.sh", 0o755), ("time_gemm.py", 0o644)):
            device.sync.push((PHONE_SCRIPTS / name).read_bytes(), f"{PHONE_DIR}/{name}",
                             mode=mode)
        self._info = self._run("describe")

    def _run(self, *args: str) -> dict[str, Any]:
        cmd = (f"sh {PHONE_DIR}/run-python.sh {PHONE_DIR}/time_gemm.py "
               f"{shlex.join(args)}")
        result = self.device.shell2(cmd, timeout=self.timeout_s, v2=True)
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
