"""A churn ``slow`` in the emulated baselines: one control file per device, written by the
runner (:mod:`testbed.baselines.emulate`), read by the stage and replica processes
(:class:`~testbed.baselines.stage_proc.HeldDevice`).

It is tile-tp's mechanism (the churn replay writes ``agents/<device>.slow``, the agent polls
it) with the time of the event added, so that a process applies the factor from the trace's
time rather than from whenever it read the file.

Naming and units, written down once:

* **The file**: ``<the baseline's run directory>/devices/<device>.slow``, JSON ``{"slow":
  factor, "at_s": t}``, replaced whole (:func:`~testbed.runlog.write_json_atomic`) at each
  ``slow`` of the device and left in place for the run's later processes. ``slow`` is the
  key tile-tp's agents read.
* ``factor``: the trace's ``arg``, a multiplier of compute time relative to the device's
  profile (2 = twice as slow, 1 = normal again); applied to time and energy alike, as the
  simulated baselines apply it (:meth:`~testbed.baselines.sim_core.BaselineWorld.set_slow`).
* ``at_s``: when the factor takes effect on this host's ``time.monotonic()`` clock, in wall
  seconds (every namespace shares it): the churn clock's start + the trace's time x D. The
  runner writes the file as soon as it sees that time pass (its loop runs every 20 ms).
* **Polling**: a process reads the file when it starts (a restarted stage, a replica's
  standby: they begin with the factor in force), at each piece's start and end, and every
  :data:`POLL_S` of wall time while it holds a piece. No file: factor 1.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from testbed.runlog import write_json_atomic

POLL_S = 0.05  # wall seconds between a holding process's reads of its control file
CONTROL_DIR = "devices"  # under a baseline's run directory


@dataclass(frozen=True)
class Slow:
    """A device's compute factor and when (``time.monotonic()``) it took effect."""

    factor: float = 1.0
    at_s: float = -math.inf  # the factor a device starts with was always in force


def control_path(control_dir: Path, device: str) -> Path:
    """The control file of a device."""
    return control_dir / f"{device}.slow"


def write_slow(control_dir: Path, device: str, factor: float, at_s: float) -> None:
    """The runner's side: from ``at_s`` on, the device computes ``factor`` times slower than its
    profile."""
    write_json_atomic(control_path(control_dir, device), {"slow": factor, "at_s": at_s})


class SlowControl:
    """The process's side: the factor in force, as its control file last said."""

    def __init__(self, path: Path | None):
        self.path = path
        self.current = Slow()
        self.poll()

    def poll(self) -> Slow:
        """Read the file (a small JSON; every read is whole: the runner replaces it) and
        return the factor in force. A file that cannot be read keeps the last factor."""
        if self.path is None:
            return self.current
        try:
            doc = json.loads(self.path.read_text())
            factor = float(doc["slow"])
            at_s = float(doc.get("at_s", -math.inf))
        except (OSError, ValueError, KeyError, TypeError):
            return self.current
        if factor > 0 and (factor, at_s) != (self.current.factor, self.current.at_s):
            self.current = Slow(factor, at_s)
        return self.current
