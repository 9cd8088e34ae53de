"""The application-level link: serialization at the rate, FIFO, delay, loss cap, dilation."""

from __future__ import annotations

import math

import pytest

from testbed.agent.link import LinkDirection, mathis_rate_bps


def test_rate_and_delay() -> None:
    link = LinkDirection(rate_bps=8e6, delay_s=0.01)  # 1 MB/s
    assert link.deliver_at(1_000_000, 0.0) == pytest.approx(1.01)
    # a second message queues behind the first (FIFO)
    assert link.deliver_at(500_000, 0.5) == pytest.approx(1.51)
    # an idle link starts at once
    assert link.deliver_at(1000, 10.0) == pytest.approx(10.011)


def test_dilation_stretches_time() -> None:
    link = LinkDirection(rate_bps=8e6, delay_s=0.01, dilation=3.0)
    assert link.deliver_at(1_000_000, 0.0) == pytest.approx(3.03)


def test_unlimited_direction() -> None:
    assert LinkDirection().deliver_at(10**9, 2.0) == 2.0


def test_loss_caps_the_rate_like_tcp() -> None:
    # Mathis: MSS/RTT * sqrt(3/(2p)); 1448 B, RTT 20 ms, p = 1% -> 7.09 Mbit/s
    assert mathis_rate_bps(0.01, 0.01) == pytest.approx(8 * 1448 / 0.02 * math.sqrt(150))
    lossy = LinkDirection(rate_bps=100e6, delay_s=0.01, loss_fraction=0.01)
    assert lossy.effective_bps == pytest.approx(mathis_rate_bps(0.01, 0.01))
