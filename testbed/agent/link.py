"""A link emulated in the application: one direction's rate, one-way delay and loss.

Used wherever the kernel does not shape a link (the loopback backend; delay and loss on kernels
without sch_netem). A direction is a FIFO pipe: a message of ``nbytes`` starts when the pipe is
free, occupies it for ``8·nbytes / rate_bps`` and arrives ``delay_s`` after its last byte left.

Loss on a TCP stream shows up as lower throughput, not lost messages, so a loss probability caps
the rate with the steady-state TCP throughput of Mathis et al. (1997), "The macroscopic behavior of
the TCP congestion avoidance algorithm": ``rate <= (MSS / RTT) · sqrt(3 / (2p))``, with MSS = 1448
bytes and RTT = 2·delay.

Time dilation D: every duration is multiplied by D and every rate divided by D.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

MSS_BYTES = 1448
# what a message's framing adds to its tensor bytes on an emulated link, as the agent books a
# tile's operands or a result (the simulator and the PS's DeviceTimeline count the same)
MESSAGE_OVERHEAD_BYTES = 64


def mathis_rate_bps(delay_s: float, loss_fraction: float) -> float:
    """TCP's steady-state throughput for a one-way delay and a packet loss probability."""
    if loss_fraction <= 0 or delay_s <= 0:
        return math.inf
    rtt_s = 2 * delay_s
    return 8 * MSS_BYTES / rtt_s * math.sqrt(3 / (2 * loss_fraction))


@dataclass
class LinkDirection:
    """One direction of an emulated link; deliver_at() books a message on it."""

    rate_bps: float | None = None  # None: not limited here
    delay_s: float = 0.0
    loss_fraction: float = 0.0
    dilation: float = 1.0

    def __post_init__(self) -> None:
        self._free_at = 0.0
        self._lock = threading.Lock()

    @property
    def effective_bps(self) -> float:
        """The rate messages really get: capped by loss (Mathis), divided by dilation."""
        rate = min(self.rate_bps or math.inf, mathis_rate_bps(self.delay_s, self.loss_fraction))
        return rate / self.dilation

    @property
    def effective_delay_s(self) -> float:
        return self.delay_s * self.dilation

    def deliver_at(self, nbytes: int, now_s: float) -> float:
        """When a message of nbytes, offered at now_s, arrives at the other end."""
        rate = self.effective_bps
        with self._lock:
            start = max(now_s, self._free_at)
            self._free_at = start + (8.0 * nbytes / rate if math.isfinite(rate) else 0.0)
            return self._free_at + self.effective_delay_s
