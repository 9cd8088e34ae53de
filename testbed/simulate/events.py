"""Virtual time, shared by the tile-parallel simulator and the baselines' simulators.

Timed callbacks and the flow network's arrivals run in time order: the clock jumps to whichever
comes first, a transfer's last byte and the path's delay, or the next callback.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Callable

from testbed.simulate.network import FlowNetwork


class EventLoop:
    """A simulator's clock: ``now_s``, a ``FlowNetwork`` and a heap of timed callbacks.

    A subclass sets ``now_s`` and ``net`` and calls :meth:`_start_events` before any other
    method.
    """

    now_s: float
    net: FlowNetwork

    def _start_events(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, time_s: float, fn: Callable[[], None]) -> None:
        """Run fn at virtual time time_s."""
        heapq.heappush(self._heap, (time_s, next(self._seq), fn))

    def busy(self) -> bool:
        """Whether anything is still to happen: an event scheduled or a flow under way."""
        return bool(self._heap) or math.isfinite(self.net.next_drain_s())

    def run_until(self, done: Callable[[], bool], horizon_s: float = math.inf) -> bool:
        """Advance until done() (True) or nothing can happen before horizon_s (False)."""
        while not done():
            t_event = self._heap[0][0] if self._heap else math.inf
            t = min(t_event, self.net.next_drain_s())
            if math.isinf(t) or t > horizon_s:
                return False
            self.now_s = max(self.now_s, t)
            for flow, arrive_s in self.net.advance(self.now_s):
                self.at(arrive_s, flow.tag)
            while self._heap and self._heap[0][0] <= self.now_s:
                _, _, fn = heapq.heappop(self._heap)
                fn()
                if done():
                    return True
        return True

    def pass_time(self, until_s: float) -> None:
        """Let virtual time run to until_s: everything due by then happens, flows move on."""
        self.run_until(lambda: False, horizon_s=until_s)
        for flow, arrive_s in self.net.advance(until_s):
            self.at(arrive_s, flow.tag)
        self.now_s = max(self.now_s, until_s)
