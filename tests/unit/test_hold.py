"""An emulated device's hold ends at its deadline, never before it (the sleep-then-spin)."""

from __future__ import annotations

import time

import pytest

from testbed.agent.hold import SPIN_BELOW_S, SPIN_S, hold_until


@pytest.mark.parametrize("hold_s", [SPIN_S / 3, SPIN_S * 2, SPIN_BELOW_S * 2])
def test_a_hold_never_ends_before_its_deadline(hold_s: float) -> None:
    for _ in range(5 if hold_s > SPIN_BELOW_S else 20):
        deadline = time.monotonic() + hold_s
        ended = hold_until(deadline)
        assert ended >= deadline
        assert time.monotonic() >= deadline


def test_a_deadline_already_past_returns_at_once() -> None:
    start = time.monotonic()
    assert hold_until(start - 1.0) - start < 0.05  # a loaded 2-core host: generous headroom
