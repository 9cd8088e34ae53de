"""The PS's lease over a cut-off device (testbed.simulate.lease), shared by testbed simulate
and the baselines' simulations: each cut its own timer, a heal ends it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from testbed.simulate.events import EventLoop
from testbed.simulate.lease import set_partitioned
from testbed.simulate.network import FlowNetwork


class Clock(EventLoop):
    def __init__(self) -> None:
        self.now_s = 0.0
        self.net = FlowNetwork()
        self._start_events()


@dataclass
class Dev:
    partitioned: bool = False
    cuts: int = 0


LEASE_S = 5.0


def test_a_cut_is_lost_a_lease_later_unless_healed_and_only_by_its_own_timer() -> None:
    loop, dev, lost = Clock(), Dev(), []
    set_partitioned(loop, dev, True, LEASE_S, lambda: lost.append(loop.now_s))  # 0 s
    loop.pass_time(2.0)
    set_partitioned(loop, dev, False, LEASE_S, None)  # healed at 2 s: no loss at 5 s
    loop.pass_time(3.0)
    set_partitioned(loop, dev, True, LEASE_S, lambda: lost.append(loop.now_s))  # 3 s
    loop.pass_time(20.0)
    assert lost == [pytest.approx(3.0 + LEASE_S, rel=1e-12)]  # the 0 s timer never fired


def test_a_cut_without_a_lease_holder_starts_no_timer_and_still_ends_an_older_one() -> None:
    """A device absent at its cut (lost None) has no timer; its cut still counts, so the
    timer of an earlier cut, healed since, cannot end it."""
    loop, dev, lost = Clock(), Dev(), []
    set_partitioned(loop, dev, True, LEASE_S, lambda: lost.append("first"))
    set_partitioned(loop, dev, False, LEASE_S, None)
    assert set_partitioned(loop, dev, True, LEASE_S, None)  # a new cut, no lease held
    assert not set_partitioned(loop, dev, True, LEASE_S, None)  # already cut off
    loop.pass_time(20.0)
    assert lost == [] and dev.partitioned
