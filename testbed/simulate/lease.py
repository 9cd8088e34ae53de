"""The PS's lease over a cut-off device, in virtual time: one rule for ``testbed simulate``
(:class:`~testbed.simulate.sim.Simulation`) and the baselines' simulations
(:class:`~testbed.baselines.sim_core.BaselineWorld`).

The PS declares a device lost when it has heard nothing from it for ``lease_s`` seconds
(``PsConfig.lease_s``), counted here from the cut: a partition silences the device, so a cut
starts a timer; a heal (the device is heard again) ends it, and a cut after the heal starts a
new one, so an earlier cut's timer never ends a later cut. A partition of a device already cut
off would start nothing (the first cut's timer runs on), but a churn schedule never has one:
it refuses a partition of a partitioned device. What
"lost" means, and whether the device was the PS's to lose (present, in which session), is the
caller's.
"""

from __future__ import annotations

from typing import Callable, Protocol

from testbed.simulate.events import EventLoop


class Cuttable(Protocol):
    """A simulated device as the lease sees it."""

    partitioned: bool  # its links are down
    cuts: int  # bumps on each cut: a timer is its own cut's only


def set_partitioned(loop: EventLoop, dev: Cuttable, down: bool, lease_s: float,
                    lost: Callable[[], None] | None) -> bool:
    """Cut ``dev`` off (``down``) or heal it; a new cut runs ``lost`` ``lease_s`` seconds from
    now unless the device is healed (or healed and cut again) by then. ``lost`` None: no timer
    (the device is not one the PS holds a lease for). Returns whether this was a new cut."""
    cut = down and not dev.partitioned
    dev.partitioned = down
    if cut:
        dev.cuts += 1  # an earlier cut's timer, healed since, must not end this one
    if cut and lost is not None:
        mine = dev.cuts

        def expire() -> None:
            if dev.cuts == mine and dev.partitioned:
                lost()
        loop.at(loop.now_s + lease_s, expire)
    return cut
