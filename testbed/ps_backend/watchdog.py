"""The progress watchdog: when a run cannot go on, and why.

One rule for `testbed up`'s PS (:class:`~testbed.ps_backend.core.PsCore`, on its monotonic
clock, checked at every tick) and `testbed simulate` (:class:`~testbed.simulate.sim.Simulation`,
on virtual time, checked at the same tick period), so a trace that keeps every device away for
longer than ``job.watchdog.no_progress_s`` fails both at the same time with the same reason
(docs/fault-tolerance.md, "Watchdog").

A run cannot go on when no device has been attached for ``limit_s``; when work is outstanding
and no tile was accepted for ``limit_s``; or when every attached device has been quarantined
for ``ALL_QUARANTINED_GRACE_S`` (or ``limit_s``, if shorter) while work is outstanding. Pure:
the caller passes the time and what it sees; ``limit_s`` 0 turns the watchdog off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

ALL_QUARANTINED_GRACE_S = 10.0  # every attached device quarantined this long: the run fails


class WatchdogError(RuntimeError):
    """The progress watchdog ended the run; the message says which condition."""


@dataclass
class ProgressWatchdog:
    """The watchdog's clocks and, once it fired, its reason (set once)."""

    limit_s: float
    last_attached_s: float  # last moment some device was attached
    last_progress_s: float  # last accepted tile, or the moment work became outstanding
    all_quarantined_since: float | None = None
    reason: str | None = None
    # (time, device, kind, reason) of the last departure: the reason says how the last device
    # went once none is left (a network down shows as leases)
    last_departure: tuple[float, str, str, str] | None = None

    @classmethod
    def starting(cls, limit_s: float, now_s: float) -> ProgressWatchdog:
        return cls(limit_s, last_attached_s=now_s, last_progress_s=now_s)

    def progressed(self, now_s: float) -> None:
        """A tile was accepted."""
        self.last_progress_s = now_s

    def departed(self, now_s: float, device: str, kind: str, why: str) -> None:
        """A device's session ended (``kind``: the departure event's, ``why`` its reason)."""
        self.last_departure = (now_s, device, kind, why)

    def paused(self, lost_s: float, now_s: float) -> None:
        """The caller did not run for ``lost_s``: its clocks move on by that, never past now."""
        self.last_attached_s = min(self.last_attached_s + lost_s, now_s)
        self.last_progress_s = min(self.last_progress_s + lost_s, now_s)
        if self.all_quarantined_since is not None:
            self.all_quarantined_since = min(self.all_quarantined_since + lost_s, now_s)

    def check(self, now_s: float, attached: int, quarantined: int, outstanding: int,
              names: Callable[[], Sequence[str]], in_flight: Callable[[], int]) -> str | None:
        """Set and return why the run cannot go on, else None (the reason, once set, stays).

        ``attached``: how many devices are attached, ``quarantined`` of them; ``outstanding``:
        tiles not yet accepted; ``names`` and ``in_flight`` (the attached devices' names, the
        copies out on them) are asked only for a reason's text: a check is one per tick, and
        a simulation may have thousands of devices."""
        limit_s = self.limit_s
        if self.reason is not None or limit_s <= 0:
            return self.reason
        if attached:
            self.last_attached_s = now_s
        if not outstanding:
            self.last_progress_s = now_s
        if attached and quarantined >= attached and outstanding:
            if self.all_quarantined_since is None:
                self.all_quarantined_since = now_s
        else:
            self.all_quarantined_since = None
        reason = None
        if not attached and now_s - self.last_attached_s > limit_s:
            reason = (f"no device attached for {now_s - self.last_attached_s:.0f} s "
                      f"(watchdog no_progress_s = {limit_s:g})")
        elif self.all_quarantined_since is not None and (
                now_s - self.all_quarantined_since > min(limit_s, ALL_QUARANTINED_GRACE_S)
                or now_s - self.last_progress_s > limit_s):
            reason = (f"every attached device is quarantined ({attached}: "
                      f"{', '.join(sorted(set(names()))[:5])}); "
                      f"no device may compute the {outstanding} tiles left")
        elif outstanding and now_s - self.last_progress_s > limit_s:
            reason = (f"no tile accepted for {now_s - self.last_progress_s:.0f} s with "
                      f"{outstanding} tiles outstanding ({in_flight()} in flight on "
                      f"{attached} attached devices; watchdog no_progress_s = {limit_s:g})")
        if reason is not None and not attached and self.last_departure is not None:
            at_s, device, kind, why = self.last_departure
            reason += (f"; no device has been attached since {device} left "
                       f"{max(0.0, now_s - at_s):.0f} s ago ({kind}: {why})")
        self.reason = reason
        return reason
