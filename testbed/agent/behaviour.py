"""Emulated misbehaviour of a device: byzantine results and straggling compute.

Needs only numpy (the agent runs on phones). A device's behaviour comes from its topology group
(``devices[].behaviour``), reaches the agent as flags, and is applied per tile:

* **byzantine** (``rate``: share of tiles): the tile's honest ``C`` is replaced by a wrong one, the
  mode drawn uniformly from ``modes``:

  - ``noise``: ``C + N(0, (noise_rel · rms(C))²)`` on every element;
  - ``bitflip``: one element with ``|x| >= rms(C)`` gets its sign bit or its highest exponent bit
    flipped (bit 31 / 30 of a float32, 63 / 62 of a float64);
  - ``stale``: the device's previous honest result of the same shape (falls back to ``noise``
    when there is none yet);
  - ``scale``: ``C × scale_factor``.

  Only a result that really differs from the honest one counts as a corruption (a scaled tile of
  zeros does not). Every corruption is appended to the behaviour log (JSON lines: task, attempt,
  mode) and counted, so a test can match them against the PS's rejections.
* **straggler** (``factor`` >= 1 on a share ``rate`` of tiles): the tile's compute time is
  multiplied by ``factor``.

Draws come from ``numpy.random.default_rng([seed, 0xB5])``: a device's misbehaviour is a function
of its seed and the sequence of tiles it gets.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the agent itself never loads the topology
    from testbed.topology import DeviceSpec

log = logging.getLogger("testbed.agent.behaviour")

MODES = ("noise", "bitflip", "stale", "scale")
_SIGN_EXP_BITS = {4: (31, 30), 8: (63, 62)}  # itemsize -> (sign bit, top exponent bit)
_UINT = {4: np.uint32, 8: np.uint64}


class BehaviourError(ValueError):
    """A behaviour setting out of range."""


@dataclass
class Behaviour:
    """What a device does wrong, and its own record of it."""

    byzantine_rate: float = 0.0
    byzantine_modes: tuple[str, ...] = MODES
    noise_rel: float = 0.01
    scale_factor: float = 1.5
    straggler_factor: float = 1.0
    straggler_rate: float = 1.0
    seed: int = 0
    log_path: str = ""
    corrupted: int = 0  # corruptions made so far
    by_mode: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.byzantine_rate <= 1:
            problems.append(f"byzantine rate must be in [0, 1], got {self.byzantine_rate}")
        if not 0 <= self.straggler_rate <= 1:
            problems.append(f"straggler rate must be in [0, 1], got {self.straggler_rate}")
        if self.straggler_factor < 1:
            problems.append(f"straggler factor must be >= 1, got {self.straggler_factor}")
        if self.noise_rel <= 0:
            problems.append(f"noise must be positive, got {self.noise_rel}")
        if self.scale_factor <= 0 or self.scale_factor == 1:
            problems.append(f"scale must be positive and not 1, got {self.scale_factor}")
        unknown = [m for m in self.byzantine_modes if m not in MODES]
        if unknown or not self.byzantine_modes:
            problems.append(f"byzantine modes must be some of {', '.join(MODES)}, "
                            f"got {', '.join(self.byzantine_modes) or 'none'}")
        if problems:
            raise BehaviourError("; ".join(problems))
        self._rng_made: np.random.Generator | None = None
        self._stale: dict[tuple[tuple[int, ...], str], np.ndarray] = {}
        self._lock = threading.Lock()

    @property
    def _rng(self) -> np.random.Generator:
        """Made on first use: an honest device never loads numpy.random (~3 MB per agent)."""
        if self._rng_made is None:
            self._rng_made = np.random.default_rng([self.seed, 0xB5])
        return self._rng_made

    @property
    def active(self) -> bool:
        return self.byzantine_rate > 0 or self.straggler_factor > 1

    def compute_factor(self) -> float:
        """The compute-time multiplier for the next tile (1.0 unless it straggles)."""
        if self.straggler_factor <= 1:
            return 1.0
        with self._lock:
            slowed = self._rng.random() < self.straggler_rate
        return self.straggler_factor if slowed else 1.0

    def apply(self, c: np.ndarray, task_id: int = -1, attempt: int = 0, gemm: str = "",
              device: str = "") -> tuple[np.ndarray, str | None]:
        """The result to send for an honest ``c``, and the mode if it was corrupted."""
        if self.byzantine_rate <= 0:
            return c, None
        with self._lock:
            stale = self._stale.get((c.shape, c.dtype.str))
            self._stale[(c.shape, c.dtype.str)] = c.copy()
            if self._rng.random() >= self.byzantine_rate:
                return c, None
            mode = str(self._rng.choice(list(self.byzantine_modes)))
            bad, mode = self._corrupt(c, mode, stale)
        if bad is c or np.array_equal(bad, c):
            return c, None
        self._record(mode, task_id, attempt, gemm, device)
        return bad, mode

    def _corrupt(self, c: np.ndarray, mode: str, stale: np.ndarray | None
                 ) -> tuple[np.ndarray, str]:
        rms = float(np.sqrt(np.mean(np.square(c, dtype=np.float64)))) if c.size else 0.0
        if mode == "stale":
            if stale is not None and not np.array_equal(stale, c):
                return stale, mode
            mode = "noise"
        if mode == "noise":
            noise = self._rng.normal(0.0, self.noise_rel * (rms or 1.0), c.shape)
            return (c + noise).astype(c.dtype), mode
        if mode == "scale":
            return (c * c.dtype.type(self.scale_factor)).astype(c.dtype), mode
        return self._bitflip(c, rms), "bitflip"

    def _bitflip(self, c: np.ndarray, rms: float) -> np.ndarray:
        size = c.dtype.itemsize
        if size not in _SIGN_EXP_BITS or c.size == 0 or rms == 0:
            return c
        big = np.flatnonzero(np.abs(c) >= rms)
        index = int(self._rng.choice(big))
        bit = _SIGN_EXP_BITS[size][int(self._rng.integers(2))]
        bad = np.ascontiguousarray(c).copy()
        bad.reshape(-1).view(_UINT[size])[index] ^= _UINT[size](1) << _UINT[size](bit)
        return bad

    def _record(self, mode: str, task_id: int, attempt: int, gemm: str, device: str) -> None:
        self.corrupted += 1
        self.by_mode[mode] = self.by_mode.get(mode, 0) + 1
        log.debug("%s: corrupted task %d attempt %d (%s)", device, task_id, attempt, mode)
        if self.log_path:
            line = json.dumps({"t": round(time.time(), 6), "device": device, "task": task_id,
                               "attempt": attempt, "gemm": gemm, "mode": mode})
            with self._lock, open(self.log_path, "a") as f:
                f.write(line + "\n")

    def telemetry(self) -> dict[str, float]:
        """Counters for the device's telemetry (byzantine devices only)."""
        if self.byzantine_rate <= 0:
            return {}
        return {"byzantine_tiles": float(self.corrupted)}


def straggler_for(device: DeviceSpec, seed: int) -> Behaviour | None:
    """The straggling its topology group gives a device (``behaviour.straggler``), drawn from
    ``seed`` as the device's agent draws it; None when its compute is never slowed. For the
    simulators and the baselines' processes, which apply it per piece of work."""
    behaviour = device.group.behaviour
    spec = behaviour.straggler if behaviour is not None else None
    if spec is None or spec.factor <= 1:
        return None
    return Behaviour(straggler_factor=spec.factor, straggler_rate=spec.rate, seed=seed)
