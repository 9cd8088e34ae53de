"""What a baseline's coordinator hears of churn: the rule every baseline path follows.

The coordinator is the pipeline's runner (DT-FM's scheduler) or data-parallel's PS. It learns
of a device only through the network, as ``testbed up``'s PS and ``testbed simulate`` do
(docs/churn.md, "Leave while cut off" and "Crash while cut off"):

* a ``leave`` (its goodbye) or ``crash`` (its broken stream) of a reachable device is heard
  at once: ``leave`` / ``disconnect``;
* a ``partition`` silences the device: it is lost when its lease runs out, ``lease_s`` after
  the cut (``lease_expired``; the timer is :mod:`testbed.simulate.lease`'s, the code
  ``testbed simulate`` runs), unless a ``heal`` comes first, after which nothing was lost;
* a ``leave`` or ``crash`` of a device a partition holds crosses the cut no more than its
  results do: heard at its lease (``lease_expired``) or at a ``heal`` that comes first
  (``disconnect``: the close the cut held). A ``join`` of it before either is heard as a
  ``disconnect`` at the join (its old process is ended first);
* a device is back (``join`` / ``heal``) when it is present and reachable again after the
  coordinator lost it, or joins reachable; a device joined while cut off is back at the heal.

:class:`Hearing` applies a schedule's actions one by one on an event loop (the baselines'
simulation runs it on its own clock); :func:`heard_timeline` runs it on a loop of its own
and returns every :class:`Heard` in trace time, which the emulated runners act on (their
coordinator hears nothing the trace does not decide). Times are trace seconds (device time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

from testbed.churn.schedule import ChurnAction
from testbed.churn.trace import ChurnEvent
from testbed.ps_backend.core import STREAM_CLOSED
from testbed.simulate.events import EventLoop
from testbed.simulate.lease import set_partitioned
from testbed.simulate.network import FlowNetwork

LEASE_S = 5.0  # the PS's lease (testbed/ps_backend/core.py PsConfig.lease_s)


@dataclass(frozen=True)
class Heard:
    """One thing the coordinator learns about one device."""

    time_s: float  # trace seconds
    device: str
    lost: bool  # True: the device is lost to it; False: the device is back
    kind: str  # lost: "leave", "disconnect" or "lease_expired"; back: "join" or "heal"
    reason: str  # in words, for events.jsonl


@dataclass(eq=False)
class _Device:
    """One device as the coordinator's network sees it (:class:`~testbed.simulate.lease.
    Cuttable`)."""

    name: str
    alive: bool  # its process runs (present in the trace)
    held: bool  # the coordinator holds it: joined and not lost since
    partitioned: bool = False
    cuts: int = 0
    gone: bool = False  # it left or crashed while cut off: heard at its lease or the heal


@dataclass
class Hearing:
    """Applies churn actions and tells ``on_heard`` what the coordinator hears, when.

    ``loop``: the clock the lease timers run on (``loop.now_s`` is the current action's
    time). ``present``: the devices present (and reachable) at time 0, whom it holds."""

    loop: EventLoop
    present: Iterable[str]
    on_heard: Callable[[Heard], None]
    lease_s: float = LEASE_S
    devices: dict[str, _Device] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.present:
            self.devices[name] = _Device(name, alive=True, held=True)

    def _dev(self, name: str) -> _Device:
        if name not in self.devices:
            self.devices[name] = _Device(name, alive=False, held=False)
        return self.devices[name]

    def held(self, name: str) -> bool:
        """Whether the coordinator holds the device now."""
        return name in self.devices and self.devices[name].held

    def apply(self, action: ChurnAction) -> None:
        """One churn action at ``loop.now_s``; what it makes heard is said at once (or at the
        lease, by a timer on the loop)."""
        dev, event = self._dev(action.device), action.event
        if event is ChurnEvent.JOIN:
            if dev.gone:  # its old process, cut off, is ended before the new one starts
                self._lose(dev, "disconnect", STREAM_CLOSED)
            dev.alive = True
            if not dev.partitioned and not dev.held:
                self._back(dev, "join", "joined")
        elif event in (ChurnEvent.LEAVE, ChurnEvent.CRASH):
            if not dev.alive:
                return
            dev.alive = False
            leave = event is ChurnEvent.LEAVE
            if not dev.held:
                return  # lost already (its lease ran out): nothing more to hear
            if dev.partitioned:  # neither its goodbye nor its socket's close crosses the cut
                dev.gone = True
            else:  # the reasons `testbed up` records: its Leave's signal, its kernel's close
                self._lose(dev, "leave" if leave else "disconnect",
                           "SIGTERM" if leave else STREAM_CLOSED)
        elif event is ChurnEvent.PARTITION:
            def expired(dev: _Device = dev) -> None:
                if dev.held:
                    self._lose(dev, "lease_expired",
                               f"no message for more than {self.lease_s:g} s")
            set_partitioned(self.loop, dev, True, self.lease_s,
                            expired if dev.held else None)
        elif event is ChurnEvent.HEAL:
            if dev.gone and dev.held:  # the end it made while cut off reaches it now
                self._lose(dev, "disconnect", STREAM_CLOSED)
            set_partitioned(self.loop, dev, False, self.lease_s, None)
            if dev.alive and not dev.held:
                self._back(dev, "heal", "reachable again")

    def _lose(self, dev: _Device, kind: str, reason: str) -> None:
        dev.held = False
        dev.gone = False
        self.on_heard(Heard(self.loop.now_s, dev.name, True, kind, reason))

    def _back(self, dev: _Device, kind: str, reason: str) -> None:
        dev.held = True
        self.on_heard(Heard(self.loop.now_s, dev.name, False, kind, reason))


class _Clock(EventLoop):
    """An event loop with no network: the lease timers' clock for :func:`heard_timeline`."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self.net = FlowNetwork()
        self._start_events()


def heard_timeline(actions: Iterable[ChurnAction], present: Iterable[str],
                   lease_s: float = LEASE_S) -> list[Heard]:
    """Everything the coordinator hears over a whole schedule (its actions in time order,
    ``present`` at time 0), in time order. Pure: the same rule as :class:`Hearing` on the
    baselines' simulation clock, decided by the trace alone."""
    clock = _Clock()
    out: list[Heard] = []
    hearing = Hearing(clock, present, out.append, lease_s)
    for action in actions:
        clock.at(action.time_s, lambda a=action: hearing.apply(a))  # type: ignore[misc]
    clock.run_until(lambda: False, horizon_s=math.inf)
    return out
