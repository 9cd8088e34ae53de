"""What a baseline's coordinator hears of churn (testbed/baselines/heard.py): the rule of
docs/churn.md, "Leave while cut off" and "Crash while cut off", which every baseline path
(simulated and emulated, pipeline and data-parallel) follows."""

from __future__ import annotations

import pytest

from testbed.baselines.heard import LEASE_S, heard_timeline
from testbed.churn.schedule import ChurnAction
from testbed.churn.trace import ChurnEvent

E = ChurnEvent


def said(*rows: tuple[float, str]) -> list[tuple[float, str, bool, str]]:
    """The timeline of phones-0's actions ``rows`` (time, event), phones-0 present at 0."""
    actions = [ChurnAction(t, "phones-0", E(ev)) for t, ev in rows]
    return [(h.time_s, h.device, h.lost, h.kind)
            for h in heard_timeline(actions, {"phones-0", "phones-1"})]


def test_a_partition_shorter_than_the_lease_is_never_heard() -> None:
    assert said((1.0, "partition"), (1.0 + LEASE_S - 0.5, "heal")) == []


def test_a_partition_past_the_lease_is_lost_then_and_back_at_the_heal() -> None:
    out = said((1.0, "partition"), (9.0, "heal"))
    assert out == [(pytest.approx(1.0 + LEASE_S, rel=1e-12), "phones-0", True, "lease_expired"),
                   (9.0, "phones-0", False, "heal")]


@pytest.mark.parametrize("event", ["leave", "crash"])
def test_a_departure_while_cut_off_is_heard_at_the_lease(event: str) -> None:
    out = said((1.0, "partition"), (1.5, event))
    assert out == [(pytest.approx(1.0 + LEASE_S, rel=1e-12), "phones-0", True, "lease_expired")]


@pytest.mark.parametrize("event", ["leave", "crash"])
def test_a_departure_while_cut_off_is_heard_at_a_heal_that_comes_first(event: str) -> None:
    out = said((1.0, "partition"), (1.5, event), (3.0, "heal"))
    assert out == [(3.0, "phones-0", True, "disconnect")]  # and not back: it has gone


def test_a_departure_while_cut_off_after_the_lease_adds_nothing() -> None:
    out = said((1.0, "partition"), (7.0, "leave"), (9.0, "heal"))
    assert out == [(pytest.approx(1.0 + LEASE_S, rel=1e-12), "phones-0", True, "lease_expired")]


def test_a_join_after_a_departure_while_cut_off_ends_the_old_process_first() -> None:
    out = said((1.0, "partition"), (1.5, "crash"), (2.0, "join"), (4.0, "heal"))
    # the old session ends at the join; the new process, cut off too, is heard at the heal
    assert out == [(2.0, "phones-0", True, "disconnect"), (4.0, "phones-0", False, "heal")]


def test_a_reachable_departure_is_heard_at_once() -> None:
    assert said((2.0, "leave"), (3.0, "join")) == [(2.0, "phones-0", True, "leave"),
                                                    (3.0, "phones-0", False, "join")]
    assert said((2.0, "crash")) == [(2.0, "phones-0", True, "disconnect")]


def test_a_heal_at_the_leases_end_comes_first() -> None:
    """Equal times: the trace's action before the timer (as the simulators' loop runs
    them: actions are queued first)."""
    assert said((1.0, "partition"), (1.0 + LEASE_S, "heal")) == []
