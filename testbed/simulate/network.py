"""A flow-level network: transfers share the links of their paths by max-min fairness.

Pure bookkeeping, no I/O, no wall clock: the simulation advances it in virtual (device) seconds.

A **link** is one direction of a cable with a capacity in bytes per device second (``inf``: not
limited). A **flow** is one transfer of ``nbytes`` over a path of links; while it runs it gets the
max-min fair rate of the flows present (no link carries more than its capacity; no flow's rate can
grow without lowering the rate of a flow that has no more than it). Its last byte arrives
``delay_s`` after it leaves (the path's one-way delay).

Max-min rates by parallel water-filling (:func:`max_min_rates`): every round, each link's fair
share is its capacity left over its flows not yet fixed; a link whose share is no larger than
what each of its flows could get anywhere else on its path is a bottleneck, and its flows are
fixed at that share. Every round fixes at least the flows of the smallest share, so the rounds
are at most the number of distinct bottleneck levels (on a tree of device links, switch links
and the PS link: a handful), and each round is a few numpy passes over the (flow, link) pairs.

Loss is not a per-flow property here: the emulator caps a device direction's rate with Mathis'
formula (``testbed/agent/link.py``), so the caller folds that cap into the device link's capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

INF = math.inf
EPS_BYTES = 1e-6  # a flow with less than this left is done (float residue of rate x time)


def max_min_rates(paths: Sequence[Sequence[int]], capacity_Bps: Sequence[float]) -> np.ndarray:
    """Max-min fair rate (bytes/s) of each flow, given each flow's links and each link's capacity.

    A flow whose links are all unlimited gets ``inf``.
    """
    n_flows = len(paths)
    if n_flows == 0:
        return np.zeros(0)
    flow_of = np.fromiter((f for f, p in enumerate(paths) for _ in p), dtype=np.int64)
    link_of = np.fromiter((x for p in paths for x in p), dtype=np.int64)
    return _water_fill(flow_of, link_of, np.asarray(capacity_Bps, dtype=float), n_flows)


def _water_fill(flow_of: np.ndarray, link_of: np.ndarray, capacity: np.ndarray,
                n_flows: int) -> np.ndarray:
    rate = np.full(n_flows, INF)
    left = capacity.astype(float).copy()
    active = np.ones(n_flows, dtype=bool)
    finite = np.isfinite(left[link_of])
    flow_of, link_of = flow_of[finite], link_of[finite]  # unlimited links constrain nobody
    # the callers list pairs flow by flow; filtering keeps that order
    grouped = bool(flow_of.size < 2 or (np.diff(flow_of) >= 0).all())
    while flow_of.size:
        live = active[flow_of]
        flow_of, link_of = flow_of[live], link_of[live]
        if not flow_of.size:
            break
        count = np.bincount(link_of, minlength=left.size)
        share = np.full(left.size, INF)
        used = count > 0
        share[used] = np.maximum(left[used], 0.0) / count[used]
        pair_share = share[link_of]
        best = np.full(n_flows, INF)  # the most each flow could get: its tightest link
        if grouped:  # a flow's pairs are adjacent: one reduceat instead of a scattered min
            starts = np.flatnonzero(np.concatenate(([True], flow_of[1:] != flow_of[:-1])))
            best[flow_of[starts]] = np.minimum.reduceat(pair_share, starts)
        else:
            np.minimum.at(best, flow_of, pair_share)
        link_floor = np.full(left.size, INF)  # per link: the least any of its flows could get
        np.minimum.at(link_floor, link_of, best[flow_of])
        bottleneck = used & (share <= link_floor * (1 + 1e-12))
        fixed_pairs = bottleneck[link_of]
        fixed = np.zeros(n_flows, dtype=bool)
        fixed[flow_of[fixed_pairs]] = True
        if not fixed.any():  # cannot happen (the smallest share is a bottleneck); be safe
            fixed[flow_of[pair_share <= pair_share.min()]] = True
        rate[fixed] = best[fixed]
        # the fixed flows' rates leave every link of their paths
        sel = fixed[flow_of]
        np.subtract.at(left, link_of[sel], rate[flow_of[sel]])
        active &= ~fixed
    return rate


@dataclass(eq=False)
class Flow:
    """One transfer in progress (its bytes left and rate live in the network's arrays)."""

    flow_id: int
    path: tuple[int, ...]
    nbytes: float
    delay_s: float
    tag: Any  # the caller's token, handed back when the flow arrives
    started_s: float = 0.0
    _net: FlowNetwork | None = None
    _slot: int = -1  # its row in the network's arrays while it runs

    @property
    def left_bytes(self) -> float:
        """Bytes not yet sent (0 once done)."""
        net = self._net
        return float(net._left[self._slot]) if net is not None and self._slot >= 0 else 0.0

    @property
    def rate_Bps(self) -> float:
        """Its current max-min rate (0 once done)."""
        net = self._net
        if net is None or self._slot < 0:
            return 0.0
        net._rates()
        return float(net._rate[self._slot])


class FlowNetwork:
    """Links, the flows on them, and when each flow's last byte arrives.

    The flows in progress are rows of numpy arrays (bytes left, rate, size, and the links of
    the path padded with -1), so advancing time, finding the next drain and re-running the
    water-filling are a few array operations per event, not a Python walk over every flow.
    Rates are recomputed only when the flows or capacities changed since the last time
    (``recomputes`` counts those).
    """

    def __init__(self) -> None:
        self.capacity_Bps: list[float] = []
        self.names: list[str] = []
        self.flows: dict[int, Flow] = {}
        self.now_s = 0.0
        self._next_id = 0
        self._dirty = False
        self.recomputes = 0  # how many times rates were recomputed (the cost driver)
        self._cap = np.zeros(0)  # capacity_Bps as an array (rebuilt when a link changes)
        self._cap_stale = True
        rows = 64
        self._left = np.zeros(rows)
        self._rate = np.zeros(rows)
        self._nbytes = np.zeros(rows)
        self._links = np.full((rows, 4), -1, dtype=np.int64)
        self._live = np.zeros(rows, dtype=bool)
        self._by_slot: list[Flow | None] = [None] * rows
        self._free: list[int] = list(range(rows - 1, -1, -1))
        self._rows: np.ndarray | None = None  # the live rows, ascending (None: to find again)

    def add_link(self, capacity_Bps: float, name: str = "") -> int:
        """A new link; returns its id."""
        if not capacity_Bps >= 0:
            raise ValueError(f"link {name!r}: capacity must be >= 0, got {capacity_Bps}")
        self.capacity_Bps.append(float(capacity_Bps))
        self.names.append(name)
        self._cap_stale = True
        return len(self.capacity_Bps) - 1

    def set_capacity(self, link: int, capacity_Bps: float) -> None:
        """Change a link's capacity (0: the cable is out); rates follow at the next advance."""
        self.capacity_Bps[link] = float(capacity_Bps)
        self._cap_stale = True
        self._dirty = True

    def _grow(self, path_len: int) -> None:
        rows, width = self._links.shape
        if path_len > width:
            wider = np.full((rows, path_len), -1, dtype=np.int64)
            wider[:, :width] = self._links
            self._links = wider
        if not self._free:
            more = rows
            self._left = np.concatenate([self._left, np.zeros(more)])
            self._rate = np.concatenate([self._rate, np.zeros(more)])
            self._nbytes = np.concatenate([self._nbytes, np.zeros(more)])
            self._links = np.concatenate(
                [self._links, np.full((more, self._links.shape[1]), -1, dtype=np.int64)])
            self._live = np.concatenate([self._live, np.zeros(more, dtype=bool)])
            self._by_slot.extend([None] * more)
            self._free.extend(range(rows + more - 1, rows - 1, -1))

    def start(self, nbytes: float, path: Sequence[int], delay_s: float = 0.0,
              tag: Any = None) -> Flow:
        """Start a transfer now; it shares its path's links from this moment."""
        path = tuple(path)
        if not self._free or len(path) > self._links.shape[1]:
            self._grow(len(path))
        slot = self._free.pop()
        flow = Flow(self._next_id, path, nbytes, delay_s, tag, self.now_s, self, slot)
        self._next_id += 1
        self.flows[flow.flow_id] = flow
        self._left[slot] = float(nbytes)
        self._nbytes[slot] = float(nbytes)
        self._rate[slot] = 0.0
        row = self._links[slot]
        row[:] = -1
        row[:len(path)] = path
        self._live[slot] = True
        self._by_slot[slot] = flow
        self._dirty = True
        self._rows = None
        return flow

    def _release(self, flow: Flow) -> None:
        slot = flow._slot
        self._left[slot] = 0.0  # what a finished flow has left
        self._live[slot] = False
        self._by_slot[slot] = None
        self._rows = None
        self._free.append(slot)
        flow._slot = -1

    def cancel(self, flow_id: int) -> None:
        """Stop a transfer (its endpoint is gone)."""
        flow = self.flows.pop(flow_id, None)
        if flow is not None:
            self._release(flow)
            self._dirty = True

    def _live_rows(self) -> np.ndarray:
        if self._rows is None:
            self._rows = np.flatnonzero(self._live)
        return self._rows

    def _rates(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        self.recomputes += 1
        if self._cap_stale:
            self._cap = np.asarray(self.capacity_Bps, dtype=float)
            self._cap_stale = False
        live = self._live_rows()
        if not live.size:
            return
        links = self._links[live]
        flow_of, col = np.nonzero(links >= 0)  # row by row: each flow's pairs are adjacent
        self._rate[live] = _water_fill(flow_of, links[flow_of, col], self._cap, live.size)

    def next_drain_s(self) -> float:
        """When the next flow's last byte leaves (inf: no flow can progress)."""
        self._rates()
        if not self.flows:
            return INF
        live = self._live_rows()
        left = self._left[live]
        rate = self._rate[live]
        if self._drained(left, rate, self._nbytes[live]).any():
            return self.now_s
        moving = rate > 0
        if not moving.any():
            return INF
        return float(self.now_s + (left[moving] / rate[moving]).min())

    def _drained(self, left: np.ndarray, rate: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Which flows are done: their residue is float rounding of rate x time (relative
        slack, so a flow due at a time does not miss it), or what is left would take less
        than the clock can resolve at this hour: at 4,096 s a step is 0.9 ps, and a 10 MB/s
        flow with 5 µB left could never move the clock again (a simulation hung there)."""
        return (left <= EPS_BYTES + 1e-9 * nbytes) | (left <= rate * np.spacing(self.now_s))

    def advance(self, to_s: float) -> list[tuple[Flow, float]]:
        """Move time to ``to_s``; return the flows whose last byte left, with arrival times."""
        self._rates()
        dt = to_s - self.now_s
        if dt < 0:
            raise ValueError(f"time runs forward: {to_s} < {self.now_s}")
        self.now_s = to_s
        if not self.flows:
            return []
        live = self._live_rows()
        rate = self._rate[live]
        left = self._left[live]
        unlimited = np.isinf(rate)
        if dt > 0:
            left = np.where(unlimited, 0.0, left - rate * dt)
        else:
            left = np.where(unlimited, 0.0, left)
        self._left[live] = left
        done = live[self._drained(left, rate, self._nbytes[live])]
        if not done.size:
            return []
        drained: list[tuple[Flow, float]] = []
        finished = [f for f in (self._by_slot[int(s)] for s in done) if f is not None]
        finished.sort(key=_flow_id)  # the order flows started in, as a dict walk gives it
        for f in finished:
            del self.flows[f.flow_id]
            self._release(f)
            drained.append((f, to_s + f.delay_s))
        self._dirty = True
        return drained


def _flow_id(flow: Flow) -> int:
    return flow.flow_id
