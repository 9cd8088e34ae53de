"""A lower bound on the device time of one training step, from its GEMM chain and the devices.

Pure functions, no I/O. The derivation (why each term is a lower bound) is in
``docs/planning.md``; the symbols here are the ones used there.

Names and units, written down once:

* a GEMM is ``C[m x n] = A[m x k] @ B[k x n]`` with ``s`` bytes per element (``itemsize``);
  ``|A| = m·k``, ``|B| = k·n``, ``|C| = m·n`` are element counts, ``V = m·k·n`` multiply-adds,
  ``F = 2·V`` FLOPs;
* a device has a compute rate ``r`` (FLOP per device second), a downlink ``d`` and an uplink
  ``u`` (bytes per device second) and a round trip ``rtt_s`` to the PS;
* the PS link has ``down_Bps`` (towards the devices) and ``up_Bps`` (towards the PS);
* a **stage** is a set of GEMMs that may run together (the three projections of one attention
  input; the input- and weight-gradient GEMMs of a layer); stages run one after another because
  each needs the PS's output of the previous one. The step's bound is the sum of its stages'.
* an operand is **held** when an earlier stage of the step already sent the same tensor
  (by name): devices may still have it, so the bound does not count it as traffic. What is
  not held travels in the stage that uses it, as the PS sends it: a schedule that sent a
  weight ahead, in an earlier stage, is not covered (docs/planning.md, "Operands travel in
  their stage").

The per-stage bound is the smallest stage time ``T`` in which the stage's multiply-adds fit on
the devices, each device working only in its own window ``T - rtt_i`` (its first operand byte
is one way from the PS, its last result one way back), limited there by its compute rate and,
through the Loomis-Whitney inequality ``V_i <= sqrt(a_i·b_i·c_i)``, by what its links can carry
(Irony, Toledo and Tiskin 2004; Demmel et al., IPDPS 2013), and together with the devices below
the same switch link, or behind the PS link, by the entries that link carries to them, each
device its own copy (:func:`entry_yield`); ``T`` is at least each aggregate
term too (compute, new down bytes, result bytes over the rates summed over those windows, and
over the PS link after the shortest round trip; the devices below a switch link move together
no more than it carries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

INF = float("inf")


@dataclass(frozen=True)
class BoundDevice:
    """What the bound needs to know about one device."""

    name: str
    rate_flops: float  # FLOP per device second (an upper estimate: the bound must not beat it)
    down_Bps: float  # bytes per device second, PS -> device
    up_Bps: float  # bytes per device second, device -> PS
    rtt_s: float = 0.0  # round trip to the PS, device seconds
    link: str = ""  # the lowest switch link on its path to the PS (:class:`SwitchLink`), if any


@dataclass(frozen=True)
class PsLink:
    down_Bps: float = INF  # PS -> devices
    up_Bps: float = INF  # devices -> PS


@dataclass(frozen=True)
class SwitchLink:
    """A switch-to-switch link the devices below it share on their way to the PS (a Wi-Fi
    access point's uplink): together they move no more than it carries."""

    down_Bps: float  # towards the devices
    up_Bps: float  # towards the PS
    parent: str = ""  # the next switch link up ("": the PS's switch is above it)


def lowest_switch_link(path: Sequence[str], links: Mapping[str, object]) -> str:
    """The :attr:`BoundDevice.link` of a device whose way to the PS crosses ``path`` (link
    names, lowest first): the first of them that is a switch link, if it is one."""
    return path[0] if path and path[0] in links else ""


@dataclass(frozen=True)
class BoundGemm:
    """One offloaded GEMM of the step, as the bound sees it."""

    m: int
    k: int
    n: int
    itemsize: int
    stage: str  # GEMMs with the same stage key (consecutive) may run together
    a_name: str = ""  # tensor identity of A ("" = unique); a repeated name is held
    b_name: str = ""
    # nothing later in the step waits for it (a weight gradient, :func:`floats`): it may run
    # together with any later stage, so only the last stage counts it
    floating: bool = False

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


def comm_min_accessed(m: int, k: int, n: int, p: int) -> float:
    """Elements one of ``p`` devices sharing the work equally must access: min a+b+c.

    Minimizes ``a + b + c`` subject to ``a·b·c >= (m·k·n/p)²`` (Loomis-Whitney) and each part at
    most its whole matrix (``a <= m·k``, ``b <= k·n``, ``c <= m·n``). How many of the caps bind
    gives the three aspect-ratio cases of Demmel et al. (IPDPS 2013): none (three large
    dimensions: ``3·(mkn/p)^(2/3)``), the smallest matrix (two large dimensions), the two
    smallest (one large dimension).
    """
    if min(m, k, n, p) <= 0:
        raise ValueError(f"need positive m, k, n, p; got {m}, {k}, {n}, {p}")
    target = (m * k * n / p) ** 2  # required product a·b·c
    caps = sorted([m * k, k * n, m * n])
    fixed = 0.0
    free = 3
    product = target
    for cap in caps:  # smallest cap first: it is the first the balanced point can exceed
        balanced = product ** (1.0 / free)
        if balanced <= cap:
            return fixed + free * balanced
        fixed += cap
        product /= cap
        free -= 1
        if free == 0:
            break
    return fixed  # p <= 1: one device touches every matrix whole


def comm_min_bytes(m: int, k: int, n: int, p: int, itemsize: int) -> tuple[float, float, float]:
    """(down, up, total) bytes no schedule of this GEMM on ``p`` equal devices can go below.

    Down: every entry of A and B reaches some device at least once. Up: every entry of C comes
    back at least once. Total: ``p`` times :func:`comm_min_accessed` (each device's share is
    ``1/p`` of the work), and never below down + up.
    """
    down = (m * k + k * n) * itemsize
    up = m * n * itemsize
    total = max(down + up, p * comm_min_accessed(m, k, n, p) * itemsize)
    return float(down), float(up), float(total)


def comm_min_point(m: int, k: int, n: int, v: float) -> tuple[float, float, float]:
    """(a, b, c): the fewest entries of A, B and C a device doing ``v`` multiply-adds accesses.

    The point minimizing ``a + b + c`` subject to ``a·b·c >= v²`` (Loomis-Whitney) and each part
    at most its whole matrix: the parts are equal, ``v^(2/3)`` each, until one reaches its
    matrix's size, which it then keeps (the three aspect-ratio cases of Demmel et al., IPDPS
    2013, for a device's share ``v`` instead of an equal ``mkn/p``).
    """
    if min(m, k, n) <= 0 or v < 0:
        raise ValueError(f"need positive m, k, n and v >= 0; got {m}, {k}, {n}, {v}")
    caps = {"a": float(m * k), "b": float(k * n), "c": float(m * n)}
    point: dict[str, float] = {}
    product = float(v) ** 2
    for name in sorted(caps, key=lambda x: caps[x]):  # smallest cap first: it binds first
        free = 3 - len(point)
        balanced = product ** (1.0 / free) if product > 0 else 0.0
        if balanced <= caps[name]:
            point.update({x: balanced for x in caps if x not in point})
            break
        point[name] = caps[name]
        product /= caps[name]
    return point["a"], point["b"], point["c"]


def comm_min_shares(m: int, k: int, n: int, shares: Sequence[float], itemsize: int
                    ) -> tuple[float, float]:
    """(down, up) bytes of the communication-optimal schedule of a GEMM with these shares.

    ``shares`` are the multiply-adds each taking-part device does (summing to ``m·k·n``). Each
    device receives the A and B entries and sends the C entries of :func:`comm_min_point` for
    its share; down is never below every entry of A and B once, up never below every entry of
    C once (whatever the shares, each must cross a link).
    """
    down = up = 0.0
    for v in shares:
        if v > 0:
            a, b, c = comm_min_point(m, k, n, v)
            down += a + b
            up += c
    return (max(down, float(m * k + k * n)) * itemsize, max(up, float(m * n)) * itemsize)


def _max_ab(x: float, cap_a: float, cap_b: float) -> float:
    """Largest a·b with a + b <= x, a <= cap_a, b <= cap_b (all >= 0)."""
    if x >= cap_a + cap_b:
        return cap_a * cap_b
    lo, hi = sorted((cap_a, cap_b))
    if x / 2 <= lo:
        return (x / 2) ** 2
    return lo * (x - lo)


def device_capacity(g: BoundGemm, dev: BoundDevice, window_s: float, held_a: bool,
                    held_b: bool) -> float:
    """Most multiply-adds of ``g`` one device can do in ``window_s`` (compute and links)."""
    s = g.itemsize
    compute = dev.rate_flops * window_s / 2.0
    x = dev.down_Bps * window_s / s  # elements it can receive
    c = min(dev.up_Bps * window_s / s, g.m * g.n)
    cap_a, cap_b = g.m * g.k, g.k * g.n
    ab: float
    if held_a and held_b:
        ab = cap_a * cap_b
    elif held_a:
        ab = cap_a * min(x, cap_b)
    elif held_b:
        ab = min(x, cap_a) * cap_b
    else:
        ab = _max_ab(x, cap_a, cap_b)
    fan = float(entry_yield(g, c, held_a, held_b))  # products an entry received is in
    received = INF if math.isinf(fan) else fan * x if fan > 0 else 0.0
    return min(compute, math.sqrt(max(ab, 0.0) * max(c, 0.0)), received, g.k * c,
               g.m * g.k * g.n)


@dataclass(frozen=True)
class _Shared:
    """One switch link as the sums see it: which devices and links sit directly below it."""

    down_Bps: float
    up_Bps: float
    rtt_s: float  # the shortest round trip below it: its window is the stage less this
    devices: np.ndarray  # indices of the devices whose lowest switch link it is
    children: tuple[int, ...]  # positions (in _DeviceArrays.shared) of the links below it


@dataclass(frozen=True)
class _DeviceArrays:
    """The devices' rates as arrays: the window search evaluates all of them at once; and the
    switch links they share, deepest first."""

    rate_flops: np.ndarray
    down_Bps: np.ndarray
    up_Bps: np.ndarray
    rtt_s: np.ndarray
    shared: tuple[_Shared, ...] = ()
    roots: tuple[int, ...] = ()  # positions of the shared links with no shared link above
    free: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))  # below none

    @classmethod
    def of(cls, devices: Sequence[BoundDevice],
           links: Mapping[str, SwitchLink] | None = None) -> _DeviceArrays:
        rtt = np.array([d.rtt_s for d in devices], dtype=float)
        links = links or {}
        # each device's chain of switch links, lowest first (an unknown name: none)
        chains = []
        for d in devices:
            chain, name = [], d.link
            while name in links and name not in chain:
                chain.append(name)
                name = links[name].parent
            chains.append(chain)
        depth: dict[str, int] = {}  # switch links above it (one chain up from any link)
        for chain in chains:
            for i, name in enumerate(chain):
                depth[name] = len(chain) - 1 - i
        order = sorted(depth, key=lambda x: (-depth[x], x))  # deepest first
        pos = {name: i for i, name in enumerate(order)}
        shared = []
        for name in order:
            below = [i for i, chain in enumerate(chains) if name in chain]
            shared.append(_Shared(
                links[name].down_Bps, links[name].up_Bps,
                float(rtt[below].min()) if below else INF,
                np.array([i for i, chain in enumerate(chains) if chain and chain[0] == name],
                         dtype=int),
                tuple(pos[c] for c in order if links[c].parent == name)))
        roots = tuple(pos[n] for n in order if links[n].parent not in pos)
        free = np.array([i for i, chain in enumerate(chains) if not chain], dtype=int)
        return cls(np.array([d.rate_flops for d in devices], dtype=float),
                   np.array([d.down_Bps for d in devices], dtype=float),
                   np.array([d.up_Bps for d in devices], dtype=float), rtt, tuple(shared),
                   roots, free)

    def capped_sum(self, each: np.ndarray, at_link: Callable[[_Shared, int], float]) -> float:
        """Σ ``each`` over the devices, where the devices below a switch link count together
        for no more than ``at_link(link, its position in shared)`` (a cap that binds at
        several levels binds at the lowest first)."""
        if not self.shared:
            return float(each.sum())
        below: list[float] = []
        for pos, link in enumerate(self.shared):  # deepest first: children before parents
            total = float(each[link.devices].sum()) + sum(below[c] for c in link.children)
            below.append(min(total, at_link(link, pos)))
        return float(each[self.free].sum()) + sum(below[r] for r in self.roots)

    def subtree_max(self, values: np.ndarray) -> list[float]:
        """Per shared link (in ``shared``'s order), the largest of ``values`` over the devices
        below it, at any depth (-inf: none)."""
        out: list[float] = []
        for link in self.shared:  # deepest first
            here = float(values[link.devices].max()) if len(link.devices) else -INF
            out.append(max([here, *(out[c] for c in link.children)]))
        return out


def total_capacity(g: BoundGemm, devs: _DeviceArrays, stage_s: float, held_a: bool,
                   held_b: bool, ps: PsLink | None = None) -> float:
    """Most multiply-adds of ``g`` the devices can do in a stage of ``stage_s``: the sum of
    :func:`device_capacity` over each device's own window, ``stage_s`` less its round trip
    (vectorised), where the devices below a switch link, and all of them behind the PS link,
    do no more than the entries that link carries to them allow (:func:`entry_yield`)."""
    s = g.itemsize
    window_s = np.maximum(stage_s - devs.rtt_s, 0.0)  # 0: its operands could not even arrive
    working = window_s > 0
    with np.errstate(invalid="ignore"):  # an infinite rate in no window: masked to 0
        compute = np.where(working, devs.rate_flops * (window_s / 2.0), 0.0)
        x = np.where(working, devs.down_Bps * window_s / s, 0.0)
        c = np.where(working, np.minimum(devs.up_Bps * window_s / s, g.m * g.n), 0.0)
    cap_a, cap_b = float(g.m * g.k), float(g.k * g.n)
    if held_a and held_b:
        ab = np.full_like(x, cap_a * cap_b)
    elif held_a:
        ab = cap_a * np.minimum(x, cap_b)
    elif held_b:
        ab = np.minimum(x, cap_a) * cap_b
    else:  # _max_ab elementwise
        lo = min(cap_a, cap_b)
        half = x / 2
        ab = np.where(x >= cap_a + cap_b, cap_a * cap_b,
                      np.where(half <= lo, half * half, lo * (x - lo)))
    yields = np.where(working, entry_yield(g, c, held_a, held_b), 0.0)
    each = np.minimum(compute, np.sqrt(np.maximum(ab, 0.0) * np.maximum(c, 0.0)))
    each = np.minimum(each, g.k * c)  # a result entry sums at most k products
    if not (held_a and held_b):  # ... and an entry received is in at most its yield
        with np.errstate(invalid="ignore"):  # no yield at an infinite rate: masked to 0
            each = np.minimum(each, np.where(yields > 0, yields * x, 0.0))
    each = np.where(working, np.minimum(each, float(g.m) * g.k * g.n), 0.0)
    if not devs.shared and (ps is None or (math.isinf(ps.down_Bps) and math.isinf(ps.up_Bps))):
        return float(each.sum())
    best = devs.subtree_max(yields)

    def link_cap(down_Bps: float, up_Bps: float, window: float, most_yield: float) -> float:
        # the entries it carries down, at the best yield below it; the partial results it
        # carries up, each the sum of at most k products
        if most_yield <= 0:
            return 0.0  # nobody below works (or can send a result): each of them is 0 already
        down = INF if math.isinf(most_yield) else most_yield * _carried(down_Bps, window) / s
        return min(down, g.k * _carried(up_Bps, window) / s)
    total = devs.capped_sum(each, lambda link, pos: link_cap(
        link.down_Bps, link.up_Bps, stage_s - link.rtt_s, best[pos]))
    if ps is not None:
        total = min(total, link_cap(ps.down_Bps, ps.up_Bps, stage_s - float(devs.rtt_s.min()),
                                    float(yields.max())))
    return total


def entry_yield(g: BoundGemm, c: np.ndarray | float, held_a: bool, held_b: bool
                ) -> np.ndarray:
    """Most multiply-adds of ``g`` per operand entry a device receives, for devices that send
    at most ``c`` result entries: with neither operand held, ``V <= sqrt(a·b·c) <= (a + b)/2
    · sqrt(c)`` and ``V <= min(a·n, b·m) <= (a + b)·mn/(m + n)`` (an entry of A is in n
    products, one of B in m); with B held only A travels, ``V <= a·n``; with A held, ``V <=
    b·m``; with both held nothing travels (infinite)."""
    c = np.asarray(c, dtype=float)
    if held_a and held_b:
        return np.full(c.shape, INF)
    if held_a:
        return np.full(c.shape, float(g.m))
    if held_b:
        return np.full(c.shape, float(g.n))
    return np.minimum(np.sqrt(np.maximum(c, 0.0)) / 2, g.m * g.n / (g.m + g.n))


def _smallest_stage_s(feasible: Callable[[float], bool], start: float) -> float:
    """The infimum of the stage times from ``start`` on that are ``feasible`` (monotone):
    bisection, from below, so still a lower bound."""
    step = 1e-6
    while not feasible(start + step):
        step *= 2
        if step > 1e12:
            return INF
    lo, hi = start, start + step
    for _ in range(60):  # bisection to ~1e-18 relative: plenty
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return lo


def _gemm_stage_s(g: BoundGemm, devs: _DeviceArrays, held_a: bool, held_b: bool,
                  ps: PsLink | None = None) -> float:
    """Shortest stage in which the devices, each in its own window, could do all of g's
    multiply-adds."""
    need = float(g.m) * g.k * g.n
    return _smallest_stage_s(lambda t: total_capacity(g, devs, t, held_a, held_b, ps) >= need,
                             float(devs.rtt_s.min()))


def fill_s(amount: float, rates: np.ndarray, rtt_s: np.ndarray) -> float:
    """Shortest stage ``T`` with ``sum(rate_i · max(T - rtt_i, 0)) >= amount``: devices each
    moving or computing at its rate in its own window (exact; the sum is piecewise linear in T).
    Nothing to do still takes the shortest round trip."""
    order = np.argsort(rtt_s, kind="stable")
    rates, rtt_s = rates[order], rtt_s[order]
    infinite = np.isinf(rates)
    k = int(np.argmax(infinite)) if infinite.any() else len(rates)  # done once its window opens
    total = np.cumsum(rates[:k])  # with the first j + 1 devices working: sum rate, sum rate·rtt
    with np.errstate(divide="ignore", invalid="ignore"):
        finish = np.where(total > 0, (amount + np.cumsum(rates[:k] * rtt_s[:k])) / total, INF)
    opens = np.append(rtt_s[1:], INF)[:k]  # when the next device's window opens
    done = finish <= opens  # the first j + 1 finish before the next one could help
    if done.any():
        return float(finish[np.argmax(done)])
    return float(rtt_s[k]) if k < len(rates) else INF


def _carried(rate: float, window_s: float) -> float:
    return rate * window_s if window_s > 0 else 0.0  # an infinite rate in no window: 0


def _moved_s(amount: float, devs: _DeviceArrays, direction: int) -> float:
    """:func:`fill_s` of ``amount`` bytes down (``direction`` 0) or up (1) with the devices'
    switch links: the devices below one move together no more than it carries in its window
    (bisection, from below; ``fill_s`` itself without any shared link)."""
    rates = (devs.down_Bps, devs.up_Bps)[direction]
    if not devs.shared or amount <= 0:
        return fill_s(amount, rates, devs.rtt_s)

    def moved(stage_s: float) -> float:
        window = np.maximum(stage_s - devs.rtt_s, 0.0)
        with np.errstate(invalid="ignore"):  # an infinite rate in no window: masked to 0
            each = np.where(window > 0, rates * window, 0.0)
        return devs.capped_sum(each, lambda link, _pos: _carried(
            (link.down_Bps, link.up_Bps)[direction], stage_s - link.rtt_s))
    return _smallest_stage_s(lambda t: moved(t) >= amount, float(devs.rtt_s.min()))


@dataclass
class StageBound:
    """The bound of one stage, with the term that set it."""

    stage: str
    gemms: int
    bound_s: float
    window_s: float
    rtt_s: float
    terms: dict[str, float] = field(default_factory=dict)

    @property
    def limit(self) -> str:
        return max(self.terms, key=lambda t: self.terms[t]) if self.terms else ""


@dataclass
class StepBound:
    bound_s: float
    stages: list[StageBound]


def stage_bound(gemms: Sequence[BoundGemm], devices: Sequence[BoundDevice], ps: PsLink,
                held: set[str], stage: str = "", arrays: _DeviceArrays | None = None,
                links: Mapping[str, SwitchLink] | None = None) -> StageBound:
    """Lower bound on the time of GEMMs that run together, given names devices already hold.

    Every term is a stage time: each device works in its own window, the stage less its round
    trip, the devices below a switch link (``links``, by name; :attr:`BoundDevice.link`) move
    together what it carries in its window, and the PS link carries what it must after the
    shortest round trip."""
    if not devices:
        return StageBound(stage, len(gemms), INF, INF, 0.0, {"no devices": INF})
    devs = arrays or _DeviceArrays.of(devices, links)
    rtt = float(devs.rtt_s.min())
    new_down: dict[str, float] = {}  # distinct tensors of the stage that must travel down
    up_bytes = flops = 0.0
    terms: dict[str, float] = {}
    for i, g in enumerate(gemms):
        flops += g.flops
        up_bytes += g.m * g.n * g.itemsize
        for tag, name, size in (("a", g.a_name, g.m * g.k), ("b", g.b_name, g.k * g.n)):
            key = name or f"#{i}{tag}"  # an unnamed operand is its own tensor
            if not (name and name in held):
                new_down[key] = size * g.itemsize
        held_a = bool(g.a_name) and g.a_name in held
        held_b = bool(g.b_name) and g.b_name in held
        terms[f"gemm{i}"] = _gemm_stage_s(g, devs, held_a, held_b, ps)
    down_bytes = sum(new_down.values())
    terms["compute"] = fill_s(flops, devs.rate_flops, devs.rtt_s)
    terms["down"] = _moved_s(down_bytes, devs, 0)
    terms["up"] = _moved_s(up_bytes, devs, 1)
    terms["ps_down"] = rtt + down_bytes / ps.down_Bps
    terms["ps_up"] = rtt + up_bytes / ps.up_Bps
    bound = max(terms.values())
    return StageBound(stage, len(gemms), bound, bound - rtt, rtt, terms)


def group_stages(gemms: Sequence[BoundGemm]) -> list[list[BoundGemm]]:
    """Consecutive GEMMs with the same stage key, in order."""
    out: list[list[BoundGemm]] = []
    for g in gemms:
        if out and out[-1][0].stage == g.stage:
            out[-1].append(g)
        else:
            out.append([g])
    return out


def step_bound(gemms: Sequence[BoundGemm], devices: Sequence[BoundDevice],
               ps: PsLink = PsLink(), links: Mapping[str, SwitchLink] | None = None
               ) -> StepBound:
    """Lower bound on a step's device time: the sum of its stages' bounds, in chain order.

    A floating GEMM (a weight gradient) may run alongside any later stage, so no stage but the
    last counts it: the sum of the stages' bounds must not charge work a schedule can hide in
    a later stage's slack. In the last stage it runs with that stage's GEMMs (nothing comes
    after), and a stage's bound with more of what runs in it only grows."""
    held: set[str] = set()
    stages = []
    arrays = _DeviceArrays.of(devices, links)
    groups = group_stages(gemms)
    for i, group in enumerate(groups):
        chained = group if i == len(groups) - 1 else [g for g in group if not g.floating]
        if chained:
            stages.append(stage_bound(chained, devices, ps, held, group[0].stage, arrays))
        for g in group:  # what this stage sent, later stages may find on devices
            held.update(x for x in (g.a_name, g.b_name) if x)
    return StepBound(sum(s.bound_s for s in stages), stages)


def floats(op: str) -> bool:
    """Whether nothing later in the step waits for a GEMM of this op: a weight gradient, which
    only the optimizer reads, so the engine lets it run on while the next layers' GEMMs go out
    (docs/engine.md) and the bound lets it run with any later stage."""
    return op == "weight_grad"


def pass_of(op: str) -> str:
    """The pass a GEMM's op belongs to: ``fwd`` (forward) or ``bwd`` (both gradients)."""
    return "fwd" if op == "forward" else "bwd"


def stage_key(layer: str, op: str) -> str:
    """Which GEMMs may run together: a layer's forward alone, its dX with its dW.

    Backward, the input- and weight-gradient GEMMs of one layer are independent (the engine
    submits them together); the weight gradient may also run on with later stages
    (:func:`floats`). Linears that read one input and could run together are one GEMM already
    (the model's ``qkv_proj``, :func:`~testbed.ps_backend.engine.offload.fused_linear`).
    """
    return f"{pass_of(op)}:{layer}"


def efficiency(bound_s: float | None, device_time_s: float) -> float | None:
    """bound / device time (1.0: the schedule reached the bound)."""
    if bound_s is None or not device_time_s > 0 or not bound_s == bound_s:
        return None
    return round(bound_s / device_time_s, 6)


class BoundTotals:
    """The run's sums of the per-step bound fields (for summary.json)."""

    def __init__(self) -> None:
        self.bound_s = self.device_time_s = 0.0
        self.min_down = self.min_up = 0.0
        self.sat_out: dict[str, str] = {}
        # steps faster than their lower bound: impossible for a faithful emulation or simulation
        # (links or D not what the topology says); summary.json counts them, the run warns
        self.below = 0

    def add(self, record: Any, device_time_s: float, from_ledger: int = 0) -> None:
        # a resumed step's tiles journaled before the crash cost no device time: it may be
        # below its bound with nothing wrong (``from_ledger``: how many there were)
        self.below += device_time_s < record.bound_s and not from_ledger
        self.bound_s += record.bound_s
        self.device_time_s += device_time_s
        self.min_down += record.bytes_min_down
        self.min_up += record.bytes_min_up
        self.sat_out.update(record.sat_out)

    def fields(self) -> dict[str, Any]:
        return {"bound_s": round(self.bound_s, 6), "device_time_s": round(self.device_time_s, 6),
                "bytes_min_down": int(self.min_down), "bytes_min_up": int(self.min_up),
                "efficiency": efficiency(self.bound_s, self.device_time_s),
                "steps_below_bound": self.below, "sat_out": self.sat_out}
