"""The tile planner: per GEMM, the tile shape, the K split, who takes part and who owns which tile.

Pure functions, no I/O. The scheduler follows a plan and falls back on its own mechanisms
(stealing, backups, re-queues, quarantine) when the plan breaks; see ``docs/planning.md``.

A plan cuts ``C[m x n] = A[m x k] @ B[k x n]`` into a grid of ``g_r x g_c`` result blocks and,
for a **K split**, ``g_k`` slices of the contraction: tile ``(r, c, s)`` computes
``A[r-block, s-slice] @ B[s-slice, c-block]``, a partial the PS sums over ``s`` in a fixed order
(``s = 0, 1, ...``), so C is bit-identical whichever device computes which partial.

The planner works on device **classes** (devices with the same compute rate and links): it sorts
classes by the time one tile costs them (compute plus the bytes they must move), tries every
prefix of that order (a class whose links make the GEMM slower with it than without sits out)
and every grid with one to four tiles per taking-part device, and keeps the plan with the
smallest predicted time. The owner map then deals the tiles to devices in contiguous runs in
``(s, r, c)`` order, as many tiles to a device as its speed earns: a run along a row shares
its A block, so a device receives each block once.

Units: ``rate_flops`` FLOP per device second, ``down_Bps``/``up_Bps`` bytes per device second,
``*_s`` device seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

INF = float("inf")
MIN_TILE = 16  # no tile edge below this (a tile's per-message cost would dominate)
TILES_PER_DEVICE = (1, 2, 3, 4)
MAX_K_PARTS = 16


@dataclass(frozen=True)
class PlanDevice:
    """One device (or a class of identical ones) as the planner sees it."""

    name: str  # a device id, or a class label
    rate_flops: float
    down_Bps: float
    up_Bps: float
    rtt_s: float = 0.0
    count: int = 1  # devices in this class


@dataclass(frozen=True)
class GemmPlan:
    """How one GEMM is cut and who takes part."""

    tile_m: int
    tile_n: int
    k_parts: int  # K slices; 1 = no K split
    grid: tuple[int, int, int]  # (g_r, g_c, g_k)
    used: tuple[str, ...]  # classes taking part
    sat_out: dict[str, str] = field(default_factory=dict)  # class -> why: link, speed
    predicted_s: float = 0.0

    @property
    def tiles(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def _tile_terms_s(d: PlanDevice, flops: float, a_bytes: float, b_bytes: float,
                  c_bytes: float, share_a: float) -> tuple[float, float, float]:
    """Device seconds of one tile on d: (compute, down: its B block and its share of an A
    block, up: its result)."""
    down = (a_bytes * share_a + b_bytes) / d.down_Bps if d.down_Bps > 0 else INF
    up = c_bytes / d.up_Bps if d.up_Bps > 0 else INF
    return flops / max(d.rate_flops, 1.0), down, up


def _tile_cost_s(d: PlanDevice, flops: float, a_bytes: float, b_bytes: float, c_bytes: float,
                 share_a: float) -> float:
    """Device seconds per tile once d's window is full: a device's tiles pipeline (the next
    one arrives while one computes and the last goes up), so the slowest of the three."""
    return max(_tile_terms_s(d, flops, a_bytes, b_bytes, c_bytes, share_a))


def _fill_s(d: PlanDevice, flops: float, a_bytes: float, b_bytes: float, c_bytes: float,
            share_a: float) -> float:
    """The pipeline's fill and drain on d: one tile's terms other than the slowest."""
    terms = _tile_terms_s(d, flops, a_bytes, b_bytes, c_bytes, share_a)
    return sum(terms) - max(terms)


def _grids(m: int, k: int, n: int, tiles: int) -> list[tuple[int, int, int]]:
    out = []
    for g_k in range(1, min(MAX_K_PARTS, max(1, k // MIN_TILE)) + 1):
        if tiles % g_k:
            continue
        rest = tiles // g_k
        for g_r in range(1, rest + 1):
            if rest % g_r:
                continue
            g_c = rest // g_r
            if math.ceil(m / g_r) >= min(MIN_TILE, m) and math.ceil(n / g_c) >= min(MIN_TILE, n):
                out.append((g_r, g_c, g_k))
    return out


def predict_s(m: int, k: int, n: int, itemsize: int, grid: tuple[int, int, int],
              classes: Sequence[PlanDevice], ps_down_Bps: float = INF,
              ps_up_Bps: float = INF) -> float:
    """Predicted device seconds of the GEMM on these classes with this grid.

    Tiles are dealt in proportion to each device's tile rate, so every taking-part device
    finishes at ``T = N / sum(count / cost)``; the PS link adds its own floor; one round trip
    (the fastest) starts the pipeline.
    """
    g_r, g_c, g_k = grid
    tiles = g_r * g_c * g_k
    tm, tn, tk = math.ceil(m / g_r), math.ceil(n / g_c), math.ceil(k / g_k)
    a_b, b_b, c_b = tm * tk * itemsize, tk * tn * itemsize, tm * tn * itemsize
    per_device = tiles / max(1, sum(c.count for c in classes))
    share_a = 1.0 / max(1.0, min(g_c, per_device))  # a device's run shares its A block
    flops = 2.0 * tm * tk * tn
    speed = sum(c.count / _tile_cost_s(c, flops, a_b, b_b, c_b, share_a) for c in classes)
    if speed <= 0:
        return INF
    t = tiles / speed
    # the PS link carries every block each device receives: A blocks once per column run,
    # B blocks once per tile, results once per tile
    down_total = tiles * (b_b + a_b * share_a)
    t = max(t, down_total / ps_down_Bps, tiles * c_b / ps_up_Bps)
    fill = max(_fill_s(c, flops, a_b, b_b, c_b, share_a) for c in classes)
    return t + fill + min(c.rtt_s for c in classes)


def plan_gemm(m: int, k: int, n: int, itemsize: int, classes: Sequence[PlanDevice],
              ps_down_Bps: float = INF, ps_up_Bps: float = INF, k_split: bool = True,
              max_tile_elems: int = 1 << 22) -> GemmPlan:
    """Choose tile shape, K split and the taking-part classes for one GEMM (smallest time)."""
    if not classes:
        raise ValueError("no devices to plan for")
    flops = 2.0 * m * k * n
    nbytes = (m * k + k * n + m * n) * itemsize
    # order: what a class would take to do the whole GEMM alone (compute + every byte)
    order = sorted(classes, key=lambda c: _tile_cost_s(c, flops, m * k * itemsize,
                                                       k * n * itemsize, m * n * itemsize, 1.0)
                   / c.count)
    best: tuple[float, tuple[int, int, int], int] | None = None
    for used in range(1, len(order) + 1):
        devices = sum(c.count for c in order[:used])
        for per in TILES_PER_DEVICE:
            for grid in _grids(m, k if k_split else 1, n, devices * per):
                g_r, g_c, g_k = grid
                if math.ceil(m / g_r) * math.ceil(n / g_c) > max_tile_elems:
                    continue
                t = predict_s(m, k, n, itemsize, grid, order[:used], ps_down_Bps, ps_up_Bps)
                if best is None or t < best[0] - 1e-12:
                    best = (t, grid, used)
    if best is None:  # nothing fits the message limit with this few tiles: fall back to many
        side = max(MIN_TILE, int(math.isqrt(max_tile_elems)))
        grid = (math.ceil(m / side), math.ceil(n / side), 1)
        best = (predict_s(m, k, n, itemsize, grid, order, ps_down_Bps, ps_up_Bps), grid,
                len(order))
    t, grid, used = best
    sat_out = {c.name: _why_out(c, flops, nbytes, itemsize, m, k, n) for c in order[used:]}
    return GemmPlan(math.ceil(m / grid[0]), math.ceil(n / grid[1]), grid[2], grid,
                    tuple(c.name for c in order[:used]), sat_out, t)


def _why_out(c: PlanDevice, flops: float, nbytes: float, itemsize: int, m: int, k: int,
             n: int) -> str:
    """Link when moving its share of bytes costs it more than computing it, else speed."""
    compute = flops / max(c.rate_flops, 1.0)
    link = (m * k + k * n) * itemsize / max(c.down_Bps, 1e-9) + \
        m * n * itemsize / max(c.up_Bps, 1e-9)
    return "link" if link > compute else "speed"


def k_slices(k: int, k_parts: int) -> list[tuple[int, int]]:
    """The contraction ranges of a K split, in summation order."""
    size = math.ceil(k / k_parts)
    return [(k0, min(k0 + size, k)) for k0 in range(0, k, size)]


def deal_owners(tiles: Sequence[tuple[int, int, int]], weights: dict[str, float]
                ) -> dict[tuple[int, int, int], str]:
    """Deal tiles ``(r, c, s)`` to devices in contiguous runs of ``(s, r, c)`` order.

    Each device gets a share proportional to its weight (largest remainder, ties by name);
    devices of weight 0 get nothing.
    """
    ordered = sorted(tiles, key=lambda t: (t[2], t[0], t[1]))
    names = sorted(n for n, w in weights.items() if w > 0)
    if not names or not ordered:
        return {}
    total = sum(weights[n] for n in names)
    exact = {n: len(ordered) * weights[n] / total for n in names}
    counts = {n: int(exact[n]) for n in names}
    left = len(ordered) - sum(counts.values())
    for n in sorted(names, key=lambda n: (-(exact[n] - counts[n]), n))[:left]:
        counts[n] += 1
    out: dict[tuple[int, int, int], str] = {}
    i = 0
    for n in names:
        for t in ordered[i:i + counts[n]]:
            out[t] = n
        i += counts[n]
    return out


def tile_rate(d: PlanDevice, plan: GemmPlan, m: int, k: int, n: int, itemsize: int) -> float:
    """Tiles per device second d can do under this plan (the dealing weight)."""
    tm, tn = plan.tile_m, plan.tile_n
    tk = math.ceil(k / plan.k_parts)
    g_c = plan.grid[1]
    cost = _tile_cost_s(d, 2.0 * tm * tk * tn, tm * tk * itemsize, tk * tn * itemsize,
                        tm * tn * itemsize, 1.0 / max(1, g_c))
    return 1.0 / cost if cost > 0 else 0.0
