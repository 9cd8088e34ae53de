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
from dataclasses import dataclass, field
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
    """One transfer in progress."""

    flow_id: int
    path: tuple[int, ...]
    nbytes: float
    delay_s: float
    tag: Any  # the caller's token, handed back when the flow arrives
    left_bytes: float = 0.0
    rate_Bps: float = 0.0
    started_s: float = 0.0

    def __post_init__(self) -> None:
        self.left_bytes = float(self.nbytes)


@dataclass
class FlowNetwork:
    """Links, the flows on them, and when each flow's last byte arrives."""

    capacity_Bps: list[float] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    flows: dict[int, Flow] = field(default_factory=dict)
    now_s: float = 0.0
    _next_id: int = 0
    _dirty: bool = False
    recomputes: int = 0  # how many times rates were recomputed (the cost driver; bench prints it)

    def add_link(self, capacity_Bps: float, name: str = "") -> int:
        """A new link; returns its id."""
        if not capacity_Bps >= 0:
            raise ValueError(f"link {name!r}: capacity must be >= 0, got {capacity_Bps}")
        self.capacity_Bps.append(float(capacity_Bps))
        self.names.append(name)
        return len(self.capacity_Bps) - 1

    def set_capacity(self, link: int, capacity_Bps: float) -> None:
        """Change a link's capacity (0: the cable is out); rates follow at the next advance."""
        self.capacity_Bps[link] = float(capacity_Bps)
        self._dirty = True

    def start(self, nbytes: float, path: Sequence[int], delay_s: float = 0.0,
              tag: Any = None) -> Flow:
        """Start a transfer now; it shares its path's links from this moment."""
        flow = Flow(self._next_id, tuple(path), nbytes, delay_s, tag, started_s=self.now_s)
        self._next_id += 1
        self.flows[flow.flow_id] = flow
        self._dirty = True
        return flow

    def cancel(self, flow_id: int) -> None:
        """Stop a transfer (its endpoint is gone)."""
        if self.flows.pop(flow_id, None) is not None:
            self._dirty = True

    def _rates(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        self.recomputes += 1
        flows = list(self.flows.values())
        rates = max_min_rates([f.path for f in flows], self.capacity_Bps)
        for f, r in zip(flows, rates):
            f.rate_Bps = float(r)

    def next_drain_s(self) -> float:
        """When the next flow's last byte leaves (inf: no flow can progress)."""
        self._rates()
        best = INF
        for f in self.flows.values():
            if f.left_bytes <= EPS_BYTES:
                return self.now_s
            if f.rate_Bps > 0:
                best = min(best, self.now_s + f.left_bytes / f.rate_Bps)
        return best

    def advance(self, to_s: float) -> list[tuple[Flow, float]]:
        """Move time to ``to_s``; return the flows whose last byte left, with arrival times."""
        self._rates()
        dt = to_s - self.now_s
        if dt < 0:
            raise ValueError(f"time runs forward: {to_s} < {self.now_s}")
        drained: list[tuple[Flow, float]] = []
        for f in list(self.flows.values()):
            if math.isinf(f.rate_Bps):
                f.left_bytes = 0.0
            elif dt > 0:
                f.left_bytes -= f.rate_Bps * dt
            # relative slack: a flow due at to_s must not miss it by float rounding
            if f.left_bytes <= EPS_BYTES + 1e-9 * f.nbytes:
                del self.flows[f.flow_id]
                drained.append((f, to_s + f.delay_s))
                self._dirty = True
        self.now_s = to_s
        return drained
