"""The tile planner: per GEMM, the tile shape, the K split, who takes part and who owns which tile.

Pure functions, no I/O. The scheduler follows a plan and falls back on its own mechanisms
(stealing, backups, re-queues, quarantine) when the plan breaks; see ``docs/planning.md``.

A plan cuts ``C[m x n] = A[m x k] @ B[k x n]`` into a grid of ``g_r x g_c`` result blocks and,
for a **K split**, ``g_k`` slices of the contraction: tile ``(r, c, s)`` computes
``A[r-block, s-slice] @ B[s-slice, c-block]``, a partial the PS sums over ``s`` in a fixed order
(``s = 0, 1, ...``), so C is bit-identical whichever device computes which partial.

The planner works on device **classes** (devices with the same compute rate and links): it sorts
classes by the time the whole GEMM would cost one of them (compute plus the bytes it must move),
tries every prefix of that order (a class whose links make the GEMM slower with it than without
sits out) and grids of one to ``MAX_TILES_PER_DEVICE`` tiles per taking-part device, and keeps
the plan with the smallest predicted time. Each device owns one **box** of the grid (rows x
columns x K slices, :func:`split_boxes`), as large as its speed and link earn, so it receives
each A and B block of its box once and its tiles pipeline (the next blocks come down while
results go up). A linear's backward pair (``dX = dY @ W``, ``dW = dYᵀ @ X``) may be planned as
one (:func:`plan_pair`): each device computes both GEMMs' K-split partials from the dY blocks
it receives, so dY travels once; and a linear's forward with its pair on one grid
(:func:`plan_layer`), so that the devices keep forward's W and X blocks for backward.

Units: ``rate_flops`` FLOP per device second, ``down_Bps``/``up_Bps`` bytes per device second,
``*_s`` device seconds.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from testbed.ps_backend.scheduler import PLANNED_WINDOW_SCALE

INF = float("inf")
MIN_TILE = 16  # no tile edge below this (a tile's per-message cost would dominate)
MAX_TILES_PER_DEVICE = 16  # the search's largest grid: this many tiles per device
MAX_PAIR_BLOCKS_PER_DEVICE = 16  # a backward pair's (two tiles a block)
MAX_K_PARTS = 16
# parts per block of a linear's forward-and-backward grid (:func:`plan_layer`), per (t, o, c)
FINE_PARTS = ((1, 2, 4, 8, 16), (1, 2, 4), (1, 2, 4))
MAX_PARTS_PER_DEVICE = 64  # ... and at most this many parts of the cube a device
# what one tile costs a device beyond its bytes and FLOPs (the messages' handling on both sides,
# the PS's check): on the loopback stack a few ms of host time; it keeps small GEMMs in few tiles
TILE_OVERHEAD_S = 0.002
NEAR_TIE = 0.05  # plans within 5 % of the fastest count as fast: most devices at work wins
PARTIAL_CLASS_MAX = 16  # a class this small may take part with only some of its devices
# a larger class behind a PS link it would overfill: these multiples of the devices filling it
# (a device's own link is not busy all the time, so twice the fill can be faster). Half and four
# times were tried too; at 1,000 devices they cost 40 % of the search and were chosen in one
# case of six, 0.2 % faster (docs/simulate.md, "Fewer sizes of a large class")
PS_FILL_FACTORS = (1.0, 2.0)
EXACT_CLASS_MAX = 32  # the search models a larger class as PSEUDO_PER_CLASS pseudo-devices
PSEUDO_PER_CLASS = 8
FIT_SLACK = 1.1  # split_boxes(fit=True): a cut whose runs get within 10 % of their share fits


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
    counts: dict[str, int] = field(default_factory=dict)  # class -> devices taking part
    # K parts: each K slice is a run of parts this long, each sent and cached as its own block
    # (0: the slice is one block; :func:`plan_layer`'s parts)
    k_block: int = 0

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


Box = tuple[int, int, int, int, int, int]  # tile ranges r0, r1, c0, c1, s0, s1 (ends excluded)


def split_boxes(grid: tuple[int, int, int], weights: Sequence[tuple[str, float]],
                tile_bytes: tuple[float, float, float] = (1.0, 1.0, 1.0),
                fit: bool = False) -> dict[str, Box]:
    """Cut the tile grid into one box of tiles per device, its size in proportion to its weight.

    Recursive bisection: the devices (heaviest first) are split into two runs of about equal
    weight, and the box is cut across the dimension whose cut duplicates the fewest bytes (a
    cut across rows makes both halves receive the same B blocks, across columns the same A
    blocks, across K slices both halves send partials of the same C blocks; ``tile_bytes`` =
    what one tile's A block, B block and result cost), at the position that splits the tiles
    in proportion to the two runs' weights. A device's box is a block of rows by columns by
    slices, so it receives each of its A and B blocks once. Devices of weight 0 get no box;
    when a box has fewer tiles than devices, the lightest get none.

    With ``fit``, the two runs are chosen to fit a cut instead: among the cuts across the
    cheapest dimension that balance within ``FIT_SLACK`` (else across any dimension, the best
    balanced), the one whose tiles match the runs' weights best, so 15 equal devices on a
    5 x 3 grid get one tile each (plain bisection cuts 15 devices 7 | 8 and the 5 rows 2 | 3).
    """
    named = sorted(((n, w) for n, w in weights if w > 0), key=lambda x: (-x[1], x[0]))
    names = [n for n, _ in named]
    ws = [w for _, w in named]
    out: dict[str, Box] = {}
    a_b, b_b, c_b = tile_bytes

    def cut(box: Box, first: int, end: int, prefix: tuple[float, ...]) -> None:
        """Cut ``box`` among the devices ``first`` to ``end`` (excluded, two or more) of the
        order, whose running weights are ``prefix``; a part with one device or one tile is
        that device's box."""
        r0, r1, c0, c1, s0, s1 = box
        nr, nc, ns = r1 - r0, c1 - c0, s1 - s0
        total = prefix[-1]
        # (duplicated bytes, dimension, extent) of each possible cut, cheapest first (the
        # dimensions differ, so ties go to the lower one)
        options = []
        if nr >= 2:
            options.append((nc * ns * b_b, 0, nr))
        if nc >= 2:
            options.append((nr * ns * a_b, 1, nc))
        if ns >= 2:
            options.append((nr * nc * c_b, 2, ns))
        options.sort()
        if fit:
            # per dimension the (imbalance, at, split) of its best cut: imbalance 1 = each run
            # gets tiles exactly in proportion to its weight; the first good one wins
            fits = []
            for _, _, extent_ in options:
                fits.append(_best_fit(extent_, prefix))
                if fits[-1][0] <= FIT_SLACK:
                    break
            j = len(fits) - 1 if fits[-1][0] <= FIT_SLACK else \
                min(range(len(fits)), key=lambda j: fits[j][0])
            dim, at, split = options[j][1], fits[j][2], fits[j][3]
        else:
            # the split whose left run's weight is nearest half: beside where half falls
            count = end - first
            j = bisect.bisect_left(prefix, total / 2, 0, count - 1)
            split = min(range(max(1, j), min(count - 1, j + 1) + 1),
                        key=lambda i: abs(prefix[i - 1] - total / 2))
            share = prefix[split - 1] / total
            _, dim, extent = options[0]
            at = min(extent - 1, max(1, round(extent * share)))
        if dim == 0:
            lo, hi = (r0, r0 + at, c0, c1, s0, s1), (r0 + at, r1, c0, c1, s0, s1)
            lo_tiles, hi_tiles = at * nc * ns, (nr - at) * nc * ns
        elif dim == 1:
            lo, hi = (r0, r1, c0, c0 + at, s0, s1), (r0, r1, c0 + at, c1, s0, s1)
            lo_tiles, hi_tiles = nr * at * ns, nr * (nc - at) * ns
        else:
            lo, hi = (r0, r1, c0, c1, s0, s0 + at), (r0, r1, c0, c1, s0 + at, s1)
            lo_tiles, hi_tiles = nr * nc * at, nr * nc * (ns - at)
        mid = first + split
        if split == 1 or lo_tiles == 1:
            out[names[first]] = lo
        else:  # the left run's running weights are the first of these, to the last bit
            cut(lo, first, mid, prefix[:split])
        if end - mid == 1 or hi_tiles == 1:
            out[names[mid]] = hi
        else:
            cut(hi, mid, end, tuple(itertools.accumulate(ws[mid:end])))

    if named:
        box = (0, grid[0], 0, grid[1], 0, grid[2])
        if len(named) == 1 or math.prod(grid) == 1:
            out[names[0]] = box
        else:
            cut(box, 0, len(named), tuple(itertools.accumulate(ws)))
    return out


@functools.lru_cache(maxsize=1024)
def _best_fit(extent: int, prefix: tuple[float, ...]) -> tuple[float, int, int, int]:
    """(imbalance, off-centre, at, split) of the best cut at ``at`` of ``extent`` tiles with
    the devices split before ``split`` (``prefix``: their running weights); imbalance 1 = each
    run gets tiles in proportion to its weight. For one cut the imbalance falls as the left
    run's weight nears the cut's share and rises after it, and for one split likewise as the
    cut nears its share: so only the two pairs beside that point can be best, tried from
    whichever side has fewer (trying every pair made the search quadratic at 1,000 devices;
    ``tests/unit/test_planner.py`` checks the result against trying every pair).

    Cached: runs of equal devices (a class's) meet boxes of equal extent again and again, in
    one cut and across a search's grids (about half of the calls at 1,000 devices and on
    large; a small cache holds them, for they come close together)."""
    total = prefix[-1]
    splits = len(prefix) - 1
    last = extent - 1
    pairs: list[tuple[int, int]] = []  # (at, split) beside where the shares meet
    if extent <= splits:
        for at in range(1, extent):
            # split j leaves the left run just below the cut's share, j + 1 at or above it
            j = bisect.bisect_left(prefix, at / extent * total, 0, splits)
            if 1 <= j < splits:
                pairs += ((at, j), (at, j + 1))
            else:
                pairs.append((at, max(1, min(j, splits))))
    else:
        for i in range(1, splits + 1):
            # the cuts beside where the left run's share of the extent falls
            mid = int(prefix[i - 1] / total * extent)
            if 1 <= mid < last:
                pairs += ((mid, i), (mid + 1, i))
            else:
                pairs.append((max(1, min(mid, last)), i))
    # the key orders every pair, so the order they are tried in does not matter
    best = (INF, 0, 0, 0)
    for at, i in pairs:
        left = prefix[i - 1]
        value = at / extent * total / left
        right = (extent - at) / extent * total / (total - left)
        if right > value:
            value = right
        if value <= best[0]:
            key = (value, abs(2 * at - extent), at, i)
            if key < best:
                best = key
    return best


def box_time_s(d: PlanDevice, box: Box, flops: float, a_bytes: float, b_bytes: float,
               c_bytes: float, members: float = 1.0) -> float:
    """Device seconds for d to do a box of tiles, its tiles pipelining.

    It receives each A block (``rows x slices``) and B block (``columns x slices``) of its box
    once, and sends every tile's result. Nothing can go up before the first tile's blocks are
    down, nor the last result before the last blocks: the slowest of the three streams plus
    the other two ends of one tile.
    """
    nr: float = box[1] - box[0]
    nc: float = box[3] - box[2]
    ns = box[5] - box[4]
    if nr * nc * ns == 0:
        return 0.0
    if members > 1:  # a pseudo-device: each member does a square part of the box, fractions
        # of blocks included (member_part's whole blocks here too made the plans of the
        # 100-phone headline step run 77.2 s simulated instead of 70.7; the PS link's bytes
        # count whole blocks)
        nr, nc = nr / math.sqrt(members), nc / math.sqrt(members)
    rate, down, up = d.rate_flops / members, d.down_Bps / members, d.up_Bps / members
    tiles = nr * nc * ns
    if members == 1:
        return _box_replay_s(int(nr), int(nc), int(ns), flops / max(rate, 1.0),
                             a_bytes / down if down > 0 else INF,
                             b_bytes / down if down > 0 else INF,
                             c_bytes / up if up > 0 else INF) + tiles * TILE_OVERHEAD_S
    down_B = ns * (nr * a_bytes + nc * b_bytes)
    d_s = down_B / down if down > 0 else INF
    one_down = (a_bytes + b_bytes) / down if down > 0 else INF
    one_up = c_bytes / up if up > 0 else INF
    one_f = flops / max(rate, 1.0)
    return max(d_s + one_f + one_up, one_down + one_f + tiles * one_up,
               one_down + tiles * one_f + one_up) + tiles * TILE_OVERHEAD_S


# A tile of a box as the replay sees it: the blocks it needs (name, seconds to come down), its
# compute seconds, its result's seconds to go up.
_ReplayTile = tuple[tuple[tuple[object, float], ...], float, float]


def pipeline_s(tiles: Sequence[_ReplayTile], window: int = PLANNED_WINDOW_SCALE) -> float:
    """Seconds until the last of a device's tiles is up, the tiles taken in this order.

    A tile's blocks the device does not hold yet come down after the ones before it; it
    computes after the tile before it, once they are down; its result goes up after the one
    before it. At most ``window`` tiles are out (the scheduler's window of a median-speed
    device with a plan): a tile is sent once the one ``window`` before it is up. (The closed
    form used before, the slowest stream plus one tile's other two ends, missed the tail: the
    last block of hotcarbon's fused q/k/v forward brought three tiles of a 3 x 3 box whose
    results then queued on the uplink, 0.85 s predicted, 1.08 s simulated.)
    """
    held: set[object] = set()
    down_end = comp_end = 0.0
    ups: list[float] = []
    for blocks, f_s, up_s in tiles:
        if len(ups) >= window:
            down_end = max(down_end, ups[-window])
        for name, down_s in blocks:
            if name not in held:
                held.add(name)
                down_end += down_s
        comp_end = max(down_end, comp_end) + f_s
        ups.append(max(comp_end, ups[-1] if ups else 0.0) + up_s)
    return ups[-1] if ups else 0.0


@functools.lru_cache(maxsize=1 << 16)
def _box_replay_s(nr: int, nc: int, ns: int, f_s: float, a_s: float, b_s: float,
                  c_s: float) -> float:
    """:func:`pipeline_s` of a GEMM box of ``nr x nc x ns`` tiles in the scheduler's ``(s, r,
    c)`` order: A block ``(r, s)`` and B block ``(c, s)``."""
    return pipeline_s([(((("a", r, s), a_s), (("b", c, s), b_s)), f_s, c_s)
                       for s in range(ns) for r in range(nr) for c in range(nc)])


@functools.lru_cache(maxsize=1 << 16)
def _pair_replay_s(bt: int, bo: int, bc: int, f_s: float, dy_s: float, w_s: float,
                   x_s: float, dx_s: float, dw_s: float) -> float:
    """:func:`pipeline_s` of a pair's box of ``bt x bo x bc`` blocks: dX's tiles first, in its
    queue order ``(o, t, c)``, each needing dY ``(t, o)`` and W ``(o, c)``; then dW's ``(t, o,
    c)``, each needing dY ``(t, o)`` and X ``(t, c)``. Zero seconds for a block already held
    (:func:`layer_box_times_s`: W and X from forward)."""
    dx = [(((("dy", t, o), dy_s), (("w", o, c), w_s)), f_s, dx_s)
          for o in range(bo) for t in range(bt) for c in range(bc)]
    dw = [(((("dy", t, o), dy_s), (("x", t, c), x_s)), f_s, dw_s)
          for t in range(bt) for o in range(bo) for c in range(bc)]
    return pipeline_s(dx + dw)


def member_part(n1: float, n2: float, n3: float, members: float
                ) -> tuple[float, float, float, float]:
    """(rows, columns, slices, working members): the part of an ``n1 x n2 x n3`` box (in
    blocks) each member of a pseudo-device does, as dealing cuts it among real devices: rows
    and columns square-ish with whole slices, but never under one block either way, for a
    device receives whole blocks (squares of a 14 x 28 box shared by 125 phones would be
    1.25 x 2.5 blocks; of a 2 x 196 box, 0.18 x 35); with fewer row-column blocks than members,
    the slices are cut too (each member then receives a block both its neighbours receive);
    with fewer blocks than members, that many get one each. The members between them receive
    ``working`` times a part's blocks: with many members, well above the box's own once.
    The PS link's bytes count these parts (:func:`predict_s`, :func:`predict_pair_s`)."""
    working = min(members, n1 * n2 * n3)
    if working <= 0:
        return 0.0, 0.0, 0.0, 0.0
    if n1 * n2 <= working:
        return 1.0, 1.0, n1 * n2 * n3 / working, working
    area = n1 * n2 / working
    p1, p2 = n1 / math.sqrt(working), n2 / math.sqrt(working)
    if p1 < 1.0:
        p1, p2 = 1.0, area
    elif p2 < 1.0:
        p1, p2 = area, 1.0
    return p1, p2, n3, working


@functools.lru_cache(maxsize=1 << 12)
def _expanded(classes: tuple[PlanDevice, ...]
              ) -> tuple[tuple[tuple[PlanDevice, float], ...],
                         dict[str, tuple[PlanDevice, float]]]:
    """(device, members): a class's devices, or for a class of more than ``EXACT_CLASS_MAX``
    ``PSEUDO_PER_CLASS`` pseudo-devices of ``members`` devices each (rates and links summed),
    to keep the search cheap; and each by name. Cached, and so not to be changed: a search
    predicts thousands of grids on the same classes."""
    out = []
    for c in classes:
        if c.count <= EXACT_CLASS_MAX:
            out += [(PlanDevice(f"{c.name}#{i}", c.rate_flops, c.down_Bps, c.up_Bps, c.rtt_s),
                     1.0) for i in range(c.count)]
            continue
        q = c.count / PSEUDO_PER_CLASS
        out += [(PlanDevice(f"{c.name}#{i}", c.rate_flops * q, c.down_Bps * q, c.up_Bps * q,
                            c.rtt_s), q) for i in range(PSEUDO_PER_CLASS)]
    return tuple(out), {d.name: (d, q) for d, q in out}


def _tile_bytes(m: int, k: int, n: int, itemsize: int, grid: tuple[int, int, int]
                ) -> tuple[float, float, float, float]:
    """(FLOPs, A block, B block, result) of one tile of the grid, bytes."""
    g_r, g_c, g_k = grid
    tm, tn, tk = math.ceil(m / g_r), math.ceil(n / g_c), math.ceil(k / g_k)
    return 2.0 * tm * tk * tn, tm * tk * itemsize, tk * tn * itemsize, tm * tn * itemsize


def box_weight(d: PlanDevice, flops: float, a_bytes: float, b_bytes: float,
               c_bytes: float, reuse: float) -> float:
    """Tiles per device second d does when each block it receives serves ``reuse`` tiles."""
    cost = _tile_cost_s(d, flops, a_bytes, b_bytes / reuse, c_bytes, 1.0 / reuse)
    return 1.0 / cost if cost > 0 else 0.0


def predict_s(m: int, k: int, n: int, itemsize: int, grid: tuple[int, int, int],
              classes: Sequence[PlanDevice], ps_down_Bps: float = INF,
              ps_up_Bps: float = INF, cutoff: float = INF) -> float:
    """Predicted device seconds of the GEMM on these classes with this grid.

    The grid is cut into one box per device (:func:`split_boxes`, weights from each device's
    tile rate); the GEMM takes as long as the slowest box (:func:`box_time_s`, each device at
    its share of the PS link: :func:`on_ps_link`), at least what the PS link carries, plus one
    round trip (the fastest). A prediction above ``cutoff`` may come back lower, though still
    above it: the boxes at the devices' own rates, which the shares only slow (a search that
    drops what is above its cutoff need not pay for the shares).
    """
    shares = _box_shares(m, k, n, itemsize, grid, classes)
    link = link_s(shares.down_B / ps_down_Bps, shares.up_B / ps_up_Bps, shares.per_device,
                  shares.first_B / ps_down_Bps)
    rtt = min(c.rtt_s for c in classes)
    if link + rtt > cutoff:  # the boxes' times could only add to it
        return link + rtt
    own = {d.name: box_time_s(d, b, *shares.tile, q) for d, q, b in shares.boxes}
    t = max(own.values(), default=INF)
    if max(t, link) + rtt > cutoff:
        return max(t, link) + rtt
    fair = on_ps_link(shares.loads, ps_down_Bps, ps_up_Bps, own)
    t = max((box_time_s(fair[d.name], b, *shares.tile, q) if fair[d.name] is not d
             else own[d.name] for d, q, b in shares.boxes), default=INF)
    return max(t, link) + rtt


def first_tiles_B(members: float, tiles: int, tile_B: float) -> float:
    """Bytes of every working device's first tile (``tile_B``, one A and one B block each):
    as many devices as take part, or as there are tiles. Counted from the devices taking part,
    not from the boxes they get, so that :func:`_floor_s` knows it before the grid is cut."""
    return min(members, tiles) * tile_B


@dataclass(frozen=True)
class _Shares:
    """A GEMM's grid cut among devices: each (device, members, box), one tile's FLOPs and
    A, B and result bytes, and what the PS link carries: blocks down (every member's), results
    up, and tiles per (member) device; and each device's part of those (its load); and the
    blocks of every (member) device's first tile, one of A and one of B."""

    boxes: tuple[tuple[PlanDevice, float, Box], ...]
    tile: tuple[float, float, float, float]
    down_B: float
    up_B: float
    per_device: float
    loads: tuple[_Load, ...]
    first_B: float


def _box_shares(m: int, k: int, n: int, itemsize: int, grid: tuple[int, int, int],
                classes: Sequence[PlanDevice]) -> _Shares:
    """The boxes :func:`predict_s` and :func:`predict_together_s` time."""
    devices, by_name = _expanded(tuple(classes))
    flops, a_b, b_b, c_b = _tile_bytes(m, k, n, itemsize, grid)
    tiles = grid[0] * grid[1] * grid[2]
    reuse = math.sqrt(max(1.0, tiles / max(1.0, sum(q for _, q in devices))))
    weight_of: dict[tuple[float, float, float], float] = {}  # a class's devices weigh the same
    weights = []
    for d, _ in devices:
        key = (d.rate_flops, d.down_Bps, d.up_Bps)
        if key not in weight_of:
            weight_of[key] = box_weight(d, flops, a_b, b_b, c_b, reuse)
        weights.append((d.name, weight_of[key]))
    boxes = split_boxes(grid, weights, (a_b, b_b, c_b), fit=True)
    loads = []
    for name, b in boxes.items():  # what every (member) device receives, over the PS link
        rows, cols, slices, each = member_part(b[1] - b[0], b[3] - b[2], b[5] - b[4],
                                               by_name[name][1])
        loads.append((*by_name[name], each * slices * (rows * a_b + cols * b_b),
                      (b[1] - b[0]) * (b[3] - b[2]) * (b[5] - b[4]) * c_b))
    per_device = tiles / max(1.0, sum(by_name[name][1] for name in boxes))
    down_B = sum(load[2] for load in loads)
    first_B = first_tiles_B(sum(q for _, q in devices), tiles, a_b + b_b)
    return _Shares(tuple((*by_name[name], b) for name, b in boxes.items()),
                   (flops, a_b, b_b, c_b), down_B, tiles * c_b, per_device, tuple(loads),
                   min(first_B, down_B))


def predict_together_s(gemms: Sequence[tuple[int, int, int, GemmPlan]], itemsize: int,
                       classes: Sequence[PlanDevice], ps_down_Bps: float = INF,
                       ps_up_Bps: float = INF) -> float:
    """Predicted device seconds of GEMMs ``(m, k, n, plan)`` submitted together, each cut
    by its own plan over the classes it counts on: a device does its boxes of all of them as
    one stream of tiles (the first GEMM's, then the next's: the scheduler's queue order), so
    one GEMM's last results go up while the next one's first blocks come down, and the PS
    link carries all of their bytes; one round trip. The sum of their own predictions counts
    each GEMM's fill and drain apart (large's fc1 backward pair spread over every device, in
    regions: 98 + 101 ms summed, 179 together; simulated, dX to 95 ms and dW to 169)."""
    streams: dict[str, list[tuple[PlanDevice, float, Box, tuple[float, float, float, float]]]]
    streams = {}
    loads: dict[str, list[float]] = {}  # per device: its PS-link bytes of all the GEMMs
    down_s = up_s = per_device = 0.0
    rtt = INF
    for m, k, n, plan in gemms:
        taking = [replace(c, count=plan.counts.get(c.name, c.count)) for c in classes
                  if c.name in plan.used]
        if not taking:
            return INF
        shares = _box_shares(m, k, n, itemsize, plan.grid, taking)
        for d, q, b in shares.boxes:
            streams.setdefault(d.name, []).append((d, q, b, shares.tile))
        for d, _, down_B, up_B in shares.loads:
            load = loads.setdefault(d.name, [0.0, 0.0])
            load[0] += down_B
            load[1] += up_B
        down_s += shares.down_B / ps_down_Bps
        up_s += shares.up_B / ps_up_Bps
        per_device += shares.per_device
        rtt = min(rtt, min(c.rtt_s for c in taking))
    own = {name: _stream_time_s(parts) for name, parts in streams.items()}
    # every device starts with its first GEMM's first tile
    first_s = sum(q * (tile[1] + tile[2]) for (_, q, _, tile), *_ in streams.values())
    fair = on_ps_link([(parts[0][0], parts[0][1], loads[name][0], loads[name][1])
                       for name, parts in streams.items()], ps_down_Bps, ps_up_Bps, own)
    slowest = max((_stream_time_s([_at_most(part, fair[name]) for part in parts])
                   if fair[name] is not parts[0][0] else own[name]
                   for name, parts in streams.items()), default=INF)
    return max(slowest, link_s(down_s, up_s, per_device,
                               min(first_s / ps_down_Bps, down_s))) + rtt


def _at_most(part: tuple[PlanDevice, float, Box, tuple[float, float, float, float]],
             fair: PlanDevice
             ) -> tuple[PlanDevice, float, Box, tuple[float, float, float, float]]:
    """A stream's part with its device's links no faster than ``fair`` has them."""
    d = part[0]
    if fair.down_Bps >= d.down_Bps and fair.up_Bps >= d.up_Bps:
        return part
    return (PlanDevice(d.name, d.rate_flops, min(d.down_Bps, fair.down_Bps),
                       min(d.up_Bps, fair.up_Bps), d.rtt_s, d.count), *part[1:])


def _stream_time_s(parts: Sequence[tuple[PlanDevice, float, Box,
                                         tuple[float, float, float, float]]]) -> float:
    """Device seconds for one device to do its boxes of several GEMMs in order (each part:
    the device as that GEMM's plan sees it, its members, its box and the GEMM's tile): the
    boxes' tiles replayed as one stream (:func:`pipeline_s`), or for a pseudo-device, as in
    :func:`box_time_s`, the slowest of the three streams summed over the boxes plus the other
    two ends of the first or last tile."""
    if len(parts) == 1:
        d, q, b, tile = parts[0]
        return box_time_s(d, b, *tile, q)
    timed = []
    for d, q, b, (flops, a_b, b_b, c_b) in parts:
        rate, down, up = d.rate_flops / q, d.down_Bps / q, d.up_Bps / q
        timed.append((b, q, flops / max(rate, 1.0), a_b / down if down > 0 else INF,
                      b_b / down if down > 0 else INF, c_b / up if up > 0 else INF))
    tiles = 0.0
    if all(q == 1 for _, q, *_ in timed):
        for b, _, *_ in timed:
            tiles += (b[1] - b[0]) * (b[3] - b[2]) * (b[5] - b[4])
        return _boxes_replay_s(tuple((b[1] - b[0], b[3] - b[2], b[5] - b[4], *times)
                                     for b, _, *times in timed)) + tiles * TILE_OVERHEAD_S
    down_s = up_s = compute_s = 0.0
    for b, q, f_s, a_s, b_s, c_s in timed:
        nr, nc = (b[1] - b[0]) / math.sqrt(q), (b[3] - b[2]) / math.sqrt(q)
        ns = b[5] - b[4]
        n_tiles = nr * nc * ns
        tiles += n_tiles
        down_s += ns * (nr * a_s + nc * b_s)
        up_s += n_tiles * c_s
        compute_s += n_tiles * f_s
    _, _, f_first, a_first, b_first, _ = timed[0]
    _, _, f_last, _, _, c_last = timed[-1]
    return max(down_s + f_last + c_last, a_first + b_first + f_first + up_s,
               a_first + b_first + compute_s + c_last) + tiles * TILE_OVERHEAD_S


@functools.lru_cache(maxsize=1 << 16)
def _boxes_replay_s(boxes: tuple[tuple[int, int, int, float, float, float, float], ...]
                    ) -> float:
    """:func:`pipeline_s` of one device's boxes of several GEMMs, one after another, each
    ``(rows, columns, slices, compute, A block, B block, result seconds)`` in the scheduler's
    ``(s, r, c)`` order (:func:`_box_replay_s` for one)."""
    return pipeline_s([(((("a", g, r, s), a_s), (("b", g, c, s), b_s)), f_s, c_s)
                       for g, (nr, nc, ns, f_s, a_s, b_s, c_s) in enumerate(boxes)
                       for s in range(ns) for r in range(nr) for c in range(nc)])


def link_s(down_s: float, up_s: float, tiles_per_device: float, first_s: float = 0.0
           ) -> float:
    """Seconds the PS link carries a GEMM's blocks down and results up: both ways at once
    only between a device's first block and its last result, as in a two-machine flow shop of
    ``tiles_per_device`` jobs (one tile each: down, then up). The jobs are equal but the
    first: ``first_s``, the PS link's time for every device's first tile, which brings whole
    the blocks its later tiles share (a layer's W block, cut into parts along the tokens,
    comes down with the first part of X). Without it the fill was ``down_s / n``: 5 ms of
    the 9.4 ms that 18 laptops' first tiles took on a 10 Gbit PS link, and a plan on 18
    laptops was predicted faster than one on 10, which ran faster (docs/simulate.md)."""
    n = max(1.0, tiles_per_device)
    return max(down_s + up_s / n, max(down_s / n, first_s) + up_s)


def fair_finish_s(demands: Sequence[float], caps: Sequence[float], flows: Sequence[float],
                  capacity: float) -> list[float]:
    """Seconds until each of several transfers that start together over one shared link ends.

    Transfer ``j`` moves ``demands[j]`` bytes at most ``caps[j]`` bytes/s (its own link) as
    ``flows[j]`` equal flows (a pseudo-device's members). The link's ``capacity`` is shared
    max-min fairly among the flows still moving, as TCP shares it on Mininet and the
    simulator's water-filling does: a flow capped below the fair level keeps its cap and the
    others split the rest; what a finished transfer leaves goes to those still moving.
    """
    left = [max(0.0, b) for b in demands]
    end = [0.0] * len(left)
    active = [j for j, b in enumerate(left) if b > 0]
    now = 0.0
    while active:
        by_cap = sorted(active, key=lambda j: caps[j] / flows[j])
        room, flows_left = capacity, sum(flows[j] for j in active)
        rate = {}
        for j in by_cap:  # increasing per-flow cap: below the level a flow keeps its cap
            rate[j] = min(caps[j], flows[j] * max(room, 0.0) / flows_left)
            room -= rate[j]
            flows_left -= flows[j]
        if not any(rate[j] > 0 for j in active):
            for j in active:
                end[j] = INF
            break
        dt = min(left[j] / rate[j] for j in active if rate[j] > 0)
        now += dt
        for j in active:
            left[j] -= rate[j] * dt
        done = [j for j in active if left[j] <= 1e-9 * demands[j]]
        for j in done:
            end[j] = now
        active = [j for j in active if j not in done]
    return end


# A device's load in one pass of a plan: (the device as the plan sees it, its members, bytes it
# receives, bytes it sends over the PS link)
_Load = tuple[PlanDevice, float, float, float]


def on_ps_link(loads: Sequence[_Load], ps_down_Bps: float, ps_up_Bps: float,
               own_s: Mapping[str, float] | None = None) -> dict[str, PlanDevice]:
    """Each device of a plan as it is while all of them move their bytes over the PS link at
    once: each way, when their links together carry more than the PS link, its rate is the
    average its transfer gets under the PS link's fair share (:func:`fair_finish_s`), never
    more than its own. The PS link's total (:func:`link_s`) assumes that what it carries
    reaches each device when that device needs it; a fair share gives a laptop beside 18
    phones a nineteenth of it, not the 62.5 MB/s of its own link that its box was timed with.

    ``own_s``, each device's box at its own links: a device asks no more of the PS link than
    its bytes over that time (a phone whose uplink paces its tiles takes its next blocks only
    as its window frees), so its flow is capped there too and leaves the rest to the others.
    """
    def cap_of(d: PlanDevice, nbytes: float, down: bool) -> float:
        link = d.down_Bps if down else d.up_Bps
        pace = own_s.get(d.name, 0.0) if own_s is not None else 0.0
        return min(link, nbytes / pace) if 0 < pace < INF else link

    if sum(cap_of(load[0], load[2], True) for load in loads if load[2] > 0) <= ps_down_Bps \
            and sum(cap_of(load[0], load[3], False) for load in loads if load[3] > 0) \
            <= ps_up_Bps:
        return {load[0].name: load[0] for load in loads}  # each at its own link's rate
    out: dict[str, PlanDevice] = {}
    for down, capacity in ((True, ps_down_Bps), (False, ps_up_Bps)):
        # devices alike (the same link and bytes per member) move as one transfer of all
        # their flows: a fair share treats them alike, so they end together
        alike: dict[tuple[float, float], list[float]] = {}  # -> [bytes, cap, flows]
        keys = []
        for load in loads:
            d, q, nbytes = load[0], load[1], load[2] if down else load[3]
            cap = cap_of(d, nbytes, down)
            key = (cap / q, nbytes / q)
            keys.append(key)
            if nbytes > 0:
                group = alike.get(key)
                if group is None:
                    alike[key] = [nbytes, cap, q]
                else:
                    group[0] += nbytes
                    group[1] += cap
                    group[2] += q
        if sum(g[1] for g in alike.values()) <= capacity:
            continue  # every device gets its own link's rate
        groups = list(alike.values())
        ends = fair_finish_s([g[0] for g in groups], [g[1] for g in groups],
                             [g[2] for g in groups], capacity)
        share = {key: g[0] / end / g[2] if end > 0 else key[0]  # per member
                 for key, g, end in zip(alike, groups, ends)}
        for load, key in zip(loads, keys):
            if key[1] > 0 and share[key] < key[0]:
                d = out.get(load[0].name, load[0])
                rate = share[key] * load[1]
                # the constructor: dataclasses.replace costs ten times as much
                out[d.name] = PlanDevice(d.name, d.rate_flops, rate, d.up_Bps, d.rtt_s,
                                         d.count) if down else \
                    PlanDevice(d.name, d.rate_flops, d.down_Bps, rate, d.rtt_s, d.count)
    return {load[0].name: out.get(load[0].name, load[0]) for load in loads}


def _candidates(extent: int, most: int, step: float = 1.25, devices: int = 1) -> list[int]:
    """Grid sizes worth trying along one dimension: 1..4, then steps of about ``step``, and
    1-4 times each divisor of ``devices`` (equal devices share such a grid evenly:
    15 phones on ``22 x 6`` tiles get boxes of 8 and 9, and the 3 x 3 boxes' last block brings
    three results to queue on the uplink; ``20 x 6`` gives each a 4 x 2 box)."""
    limit = min(extent, most)
    out, g = set(), 1
    while g <= limit:
        out.add(g)
        g = g + 1 if g < 4 else max(g + 1, int(g * step))
    if devices <= EXACT_CLASS_MAX:  # beyond, the search's own steps are coarse anyway
        out.update(d * j for d in range(2, devices + 1) if devices % d == 0
                   for j in range(1, 5) if d * j <= limit)
    return sorted(out)


def plan_gemm(m: int, k: int, n: int, itemsize: int, classes: Sequence[PlanDevice],
              ps_down_Bps: float = INF, ps_up_Bps: float = INF, k_split: bool = True,
              max_tile_elems: int = 1 << 22) -> GemmPlan:
    """Choose tile shape, K split and the taking-part classes for one GEMM (smallest time)."""
    if not classes:
        raise ValueError("no devices to plan for")
    flops = 2.0 * m * k * n
    nbytes = (m * k + k * n + m * n) * itemsize
    # order: what one device of a class would take for the whole GEMM (compute + every byte)
    order = sorted(classes, key=lambda c: (_tile_cost_s(c, flops, m * k * itemsize,
                                                        k * n * itemsize, m * n * itemsize,
                                                        1.0), c.name))
    best: _Found | None = None
    candidates: list[_Found] = []  # (a floor under its prediction, grid, classes)
    for taking_part in _device_sets(order, ps_down_Bps, ps_up_Bps):
        devices = sum(c.count for c in taking_part)
        most = MAX_TILES_PER_DEVICE * devices
        # the search costs (grids) x (devices): coarser steps when there are many devices
        step = 1.25 if devices <= 32 else 1.6
        # equal devices share a grid evenly when its sides divide their count
        equal = devices if len(taking_part) == 1 else 1
        for g_k in _candidates(max(1, k // MIN_TILE) if k_split else 1, MAX_K_PARTS, step):
            for g_r in _candidates(max(1, m // MIN_TILE), most // g_k, step, equal):
                for g_c in _candidates(max(1, n // MIN_TILE), most // (g_k * g_r), step,
                                       equal):
                    if (math.ceil(m / math.ceil(m / g_r)) != g_r or
                            math.ceil(n / math.ceil(n / g_c)) != g_c or
                            math.ceil(k / math.ceil(k / g_k)) != g_k):
                        continue  # the tiler would cut fewer rows, columns or slices
                    if math.ceil(m / g_r) * math.ceil(n / g_c) > max_tile_elems:
                        continue
                    grid = (g_r, g_c, g_k)
                    t_f, a_b, b_b, c_b = _tile_bytes(m, k, n, itemsize, grid)
                    tiles = g_r * g_c * g_k
                    candidates.append((_floor_s(taking_part, tiles * t_f, tiles * c_b,
                                                g_k * (g_r * a_b + g_c * b_b), ps_down_Bps,
                                                ps_up_Bps, (t_f, a_b + b_b, c_b),
                                                first_tiles_B(devices, tiles, a_b + b_b)),
                                       grid, taking_part))

    def finer_floor(grid: tuple[int, int, int], taking_part: tuple[PlanDevice, ...]) -> float:
        t_f, a_b, b_b, c_b = _tile_bytes(m, k, n, itemsize, grid)
        return _boxes_floor_s(taking_part, math.prod(grid), t_f, a_b, b_b, c_b)

    found = _predicted(candidates, lambda grid, taking_part, cutoff: predict_s(
        m, k, n, itemsize, grid, taking_part, ps_down_Bps, ps_up_Bps, cutoff), finer_floor)
    if found:
        best = _near_fastest(found)
    if best is None:  # nothing fits the message limit with this few tiles: fall back to many
        side = max(MIN_TILE, int(math.isqrt(max_tile_elems)))
        grid = (math.ceil(m / side), math.ceil(n / side), 1)
        best = (predict_s(m, k, n, itemsize, grid, order, ps_down_Bps, ps_up_Bps), grid,
                tuple(order))
    t, grid, taking_part = best
    counts = {c.name: c.count for c in taking_part}
    sat_out = _sat_out(order, counts, flops, nbytes, itemsize, m, k, n)
    return GemmPlan(math.ceil(m / grid[0]), math.ceil(n / grid[1]), grid[2], grid,
                    tuple(counts), sat_out, t, counts)


# (seconds, grid, classes): the prediction, or for a candidate not yet predicted its floor
_Found = tuple[float, tuple[int, int, int], tuple[PlanDevice, ...]]


def _floor_s(classes: Sequence[PlanDevice], flops: float, up_B: float, down_B: float,
             ps_down_Bps: float, ps_up_Bps: float,
             tile: tuple[float, float, float] = (0.0, 0.0, 0.0), first_B: float = 0.0
             ) -> float:
    """A floor under any prediction for a grid on these classes: its FLOPs (tiles at their
    rounded-up size) on all their compute, its results through all their up links or the PS
    link, its operand blocks once each through their down links or the PS link. No box
    beats its share of the whole (a box's time covers its compute and each stream, a
    pseudo-device's members no less: :func:`box_time_s`), and the slowest box is at least the
    whole over the sum of the rates.

    ``tile`` (one tile's FLOPs, operand bytes and result bytes) adds each stream's ends that
    every box waits for: nothing goes up before a tile's blocks are down and computed, the last
    blocks down still have a tile to compute and send (the fastest device's, as the floor must
    hold for any box). A tighter floor leaves fewer candidates to predict; where a GEMM is
    bound by the PS link (campus), most candidates' predictions sit on the floor anyway.

    ``first_B``, the bytes of every device's first tile (:func:`first_tiles_B`), adds the PS
    link's fill (:func:`link_s`): no result goes up the PS link before those came down it.
    ``down_B`` counts each block once, which the plan's blocks down never are below, so the
    fill is capped there as :func:`predict_s` caps it by those. Of the predictions a
    1,000-device search made without it, three in five were above the bar on the fill alone
    (docs/planning.md, "The PS link both ways")."""
    rate = sum(max(c.rate_flops, 1.0) * c.count for c in classes)
    own_down = sum(c.down_Bps * c.count for c in classes)
    own_up = sum(c.up_Bps * c.count for c in classes)
    up, down = min(ps_up_Bps, own_up), min(ps_down_Bps, own_down)
    t_f, t_down, t_up = tile

    def ends(f: bool, d: bool, u: bool) -> float:
        """The fastest class's time for one tile's compute, blocks down and result up (those
        asked for)."""
        best = INF
        for c in classes:
            t = t_f / max(c.rate_flops, 1.0) if f else 0.0
            if d and t_down:
                t += t_down / c.down_Bps if c.down_Bps > 0 else INF
            if u and t_up:
                t += t_up / c.up_Bps if c.up_Bps > 0 else INF
            best = min(best, t)
        return best

    return max(flops / rate + ends(False, True, True),
               up_B / up if up > 0 else INF,
               min(first_B, down_B) / ps_down_Bps + up_B / ps_up_Bps,
               up_B / own_up + ends(True, True, False) if own_up > 0 else INF,
               down_B / down if down > 0 else INF,
               down_B / own_down + ends(True, False, True) if own_down > 0 else INF
               ) + min(c.rtt_s for c in classes)


def _boxes_floor_s(classes: Sequence[PlanDevice], tiles: int, t_f: float, a_b: float,
                   b_b: float, c_b: float) -> float:
    """A floor under the slowest box (:func:`box_time_s`) of any cut of ``tiles`` equal tiles
    (one: ``t_f`` FLOPs, A and B blocks ``a_b`` and ``b_b`` bytes, a result of ``c_b``) among
    these classes' devices, plus the fastest round trip, as :func:`predict_s` adds.

    A device of a class doing ``t > 0`` tiles takes at least ``g(t) = d + max(f + t·u, t·f +
    u) + t·o``: its first blocks down (``d``), then its tiles' compute (``f`` each) and results
    up (``u`` each) one after another, the last result after the last compute, the first after
    the first, and ``TILE_OVERHEAD_S`` (``o``) a tile. It also receives at least ``2·√(t·A·B)``
    bytes (a box of ``r x c x s`` tiles takes ``s·(r·A + c·B)``, at least ``2·s·√(r·c·A·B)``),
    and after its last blocks still computes and sends their tile. However the tiles are
    shared out, some device is at least at the level ``λ`` where what every device can do
    within ``λ`` adds up to ``tiles``: for the first, the smallest ``λ`` whose ``g⁻¹(λ)``
    summed over the devices is ``tiles`` (continuous in λ and linear between each class's ``d
    + max(f, u)``, where it starts, and ``d + f + u + o``, at one tile); for the second, ``λ =
    2·√(A·B·tiles / Σ down²)``. A pseudo-device's members each do ``1/members`` of its box
    (:func:`box_time_s`), a fraction of a tile included, which ``g`` covers too (below one
    tile the box's time still has a whole tile's compute or result at one end, as ``g``
    has). :func:`_floor_s`'s totals leave out that each device pays its own ends and overheads
    and gets its own copies of the blocks (a third of large's first step's predictions are
    skipped on it, half at 100 devices; docs/simulate.md, "Eighth round")."""
    if tiles <= 0 or not classes:
        return 0.0
    # per class (count, d, the smaller and larger of f and u) of the devices that could take part
    kinds = []
    down_sq = 0.0
    last_ends = INF
    for c in classes:
        if c.down_Bps <= 0 or c.up_Bps <= 0:
            continue
        f, u = t_f / max(c.rate_flops, 1.0), c_b / c.up_Bps
        kinds.append((c.count, (a_b + b_b) / c.down_Bps, min(f, u), max(f, u)))
        down_sq += c.count * c.down_Bps ** 2
        last_ends = min(last_ends, f + u)
    if not kinds:
        return INF

    def can_do(level: float) -> float:
        """Tiles the devices can do each within ``level`` seconds."""
        total = 0.0
        for count, d, lo, hi in kinds:
            if level > d + hi:
                total += count * min((level - d - hi) / (lo + TILE_OVERHEAD_S),
                                     (level - d - lo) / (hi + TILE_OVERHEAD_S))
        return total

    # can_do is linear between these levels and beyond the last: find the piece reaching tiles
    levels = sorted({x for _, d, lo, hi in kinds for x in (d + hi, d + lo + hi + TILE_OVERHEAD_S)})
    below, done_below = levels[0], 0.0
    for level in levels[1:]:
        done = can_do(level)
        if done >= tiles:
            break
        below, done_below = level, done
    else:
        level = below + 1.0
        done = can_do(level)
    work = below + (tiles - done_below) / (done - done_below) * (level - below)
    down = 2.0 * math.sqrt(a_b * b_b * tiles / down_sq) + last_ends
    # a hair under: the floor of a one-device grid is its prediction, up to rounding
    return (max(work, down) + min(c.rtt_s for c in classes)) * (1 - 1e-9)


def _predicted(candidates: Sequence[_Found],
               predict: Callable[[tuple[int, int, int], tuple[PlanDevice, ...], float], float],
               finer: Callable[[tuple[int, int, int], tuple[PlanDevice, ...]], float] | None
               = None) -> list[_Found]:
    """Predict the candidates ``(floor, grid, classes)`` from the lowest floor up, until a
    floor is above NEAR_TIE of the fastest so far: no prediction of the rest could be near the
    fastest, so the choice is unchanged (at 1,000 devices ~40% of a GEMM's candidates and ~80%
    of a pair's go unpredicted). ``finer``, a second floor dearer to find, skips one candidate
    the same way: found only for those the first lets through. ``predict`` is told that bar
    (its third argument): above it, a floor above the bar serves as well as the prediction.
    In the candidates' order, for :func:`_near_fastest`'s ties."""
    fastest = INF
    found: list[tuple[int, _Found]] = []
    for index in sorted(range(len(candidates)), key=lambda j: candidates[j][0]):
        floor, grid, taking_part = candidates[index]
        if floor > fastest * (1 + NEAR_TIE):
            break
        if finer is not None and finer(grid, taking_part) > fastest * (1 + NEAR_TIE):
            continue
        t = predict(grid, taking_part, fastest * (1 + NEAR_TIE))
        fastest = min(fastest, t)
        found.append((index, (t, grid, taking_part)))
    return [f for _, f in sorted(found, key=lambda x: x[0])]


def _near_fastest(found: Sequence[_Found]) -> _Found:
    """The fastest plan, or one with more devices predicted within NEAR_TIE of it: the
    prediction is not that exact, and spreading keeps more devices at work (a departure or a
    straggler then costs less)."""
    fastest = min(f[0] for f in found)
    return min((f for f in found if f[0] <= fastest * (1 + NEAR_TIE)),
               key=lambda f: (-min(sum(c.count for c in f[2]), math.prod(f[1])), f[0]))


def _sat_out(order: Sequence[PlanDevice], counts: dict[str, int], flops: float, nbytes: float,
             itemsize: int, m: int, k: int, n: int) -> dict[str, str]:
    """Why each class the plan leaves out (wholly or some of its devices) sits out: ``PS
    link`` for the rest of a large class taking part with some of its devices (only the PS
    link gives such a class partial sizes, :func:`_device_sets`)."""
    sat_out = {}
    for c in order:
        if counts.get(c.name, 0) < c.count:
            why = _why_out(c, flops, nbytes, itemsize, m, k, n)
            if c.name in counts and c.count > PARTIAL_CLASS_MAX:
                why = "PS link"
            sat_out[c.name] = why if c.name not in counts else \
                f"{why} ({c.count - counts[c.name]} of {c.count})"
    return sat_out


def _device_sets(order: Sequence[PlanDevice], ps_down_Bps: float = INF,
                 ps_up_Bps: float = INF) -> list[tuple[PlanDevice, ...]]:
    """Which devices may take part: every prefix of the classes' order, the last class of it
    whole or only some of its devices (more devices share the work but each receives blocks
    of its own: on a shared or slow link fewer can be faster). A class of at most
    PARTIAL_CLASS_MAX may take part with 1, 2, 4, ... devices; a larger one, when its links add
    up to more than the PS link has left after the classes before it, with PS_FILL_FACTORS
    times the devices that fill the PS link (each way): beyond that point more devices add
    duplicated blocks on the PS link, not rate."""
    out: list[tuple[PlanDevice, ...]] = []
    for used in range(1, len(order) + 1):
        last = order[used - 1]
        before = order[:used - 1]
        if last.count <= PARTIAL_CLASS_MAX:
            sizes = {last.count, *(1 << i for i in range(last.count.bit_length())
                                   if 1 << i < last.count)}
        else:
            sizes = {last.count}
            for ps_Bps, link_Bps, taken in (
                    (ps_down_Bps, last.down_Bps, sum(c.down_Bps * c.count for c in before)),
                    (ps_up_Bps, last.up_Bps, sum(c.up_Bps * c.count for c in before))):
                if link_Bps > 0 and ps_Bps - taken < link_Bps * last.count:
                    fill = max(ps_Bps - taken, link_Bps) / link_Bps  # devices filling the rest
                    sizes.update(n for n in (round(fill * f) for f in PS_FILL_FACTORS)
                                 if PARTIAL_CLASS_MAX < n < last.count)
        out += [(*before, replace(last, count=size)) for size in sorted(sizes)]
    return out


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


def deal_boxes(plan: GemmPlan, m: int, k: int, n: int, itemsize: int,
               devices: Sequence[PlanDevice]) -> dict[tuple[int, int, int], str]:
    """Owners of a plan's tiles ``(r, c, s)``: one box of the grid per device (split_boxes)."""
    flops, a_b, b_b, c_b = _tile_bytes(m, k, n, itemsize, plan.grid)
    reuse = math.sqrt(max(1.0, plan.tiles / max(1, len(devices))))
    weights = [(d.name, box_weight(d, flops, a_b, b_b, c_b, reuse)) for d in devices]
    out: dict[tuple[int, int, int], str] = {}
    for name, (r0, r1, c0, c1, s0, s1) in split_boxes(plan.grid, weights, (a_b, b_b, c_b),
                                                      fit=True).items():
        for s in range(s0, s1):
            for r in range(r0, r1):
                for c in range(c0, c1):
                    out[(r, c, s)] = name
    return out


# -- regions of C -----------------------------------------------------------------------------
# One grid for every device gives the laptops and the phones of a mix the same tiles. On
# large's forward the phones, rationed by their access points, would do best with a thin slice
# of K and a large block of results, sending partials; the laptops, whose uplinks carry their
# results, with no K split at all. A region plan cuts C's rows in two runs, each planned on its
# own (plan_gemm) over one side of the classes: the tiler cuts each run its own way
# (tiler.cut_regions) and the PS sums each block's partials in slice order as for any K split.
REGION_GAIN = 0.95  # regions when predicted this much faster than one grid
REGION_PROBES = 6  # row counts tried (each two plan_gemm searches)


@dataclass(frozen=True)
class RegionPlan:
    """C's rows in runs ``bounds[i]:bounds[i + 1]``, run i planned by ``plans[i]`` (its row
    count as m) over its own classes."""

    bounds: tuple[int, ...]
    plans: tuple[GemmPlan, ...]
    predicted_s: float


def _region_sides(order: Sequence[tuple[float, PlanDevice]]
                  ) -> tuple[list[PlanDevice], list[PlanDevice]]:
    """The classes (in plan_gemm's order, each with what one of its devices would take for the
    whole GEMM) cut where that time grows most from one class to the next. One cut keeps the
    search to a few plans (the planner runs before a first step)."""
    keys = [max(key, 1e-12) for key, _ in order]
    at = max(range(1, len(keys)), key=lambda i: keys[i] / keys[i - 1])
    return [c for _, c in order[:at]], [c for _, c in order[at:]]


_RegionSides = tuple[tuple[list[PlanDevice], list[PlanDevice]],
                     list[tuple[float, float]]]


def _region_sides_and_links(m: int, k: int, n: int, itemsize: int,
                            classes: Sequence[PlanDevice], ps_down_Bps: float,
                            ps_up_Bps: float) -> _RegionSides | None:
    """The two sides :func:`plan_regions` plans apart (:func:`_region_sides`, the classes in
    :func:`plan_gemm`'s order) and each side's (down, up) share of the PS link: as much as its
    devices' links carry of all of theirs, each capped by the PS link (a device the topology
    does not declare has no link limit). None when a side would get none of it."""
    flops = 2.0 * m * k * n
    order = sorted(((_tile_cost_s(c, flops, m * k * itemsize, k * n * itemsize,
                                  m * n * itemsize, 1.0), c.name, c) for c in classes),
                   key=lambda x: (x[0], x[1]))
    sides = _region_sides([(key, c) for key, _, c in order])

    def share(side: Sequence[PlanDevice], ps_Bps: float, rate: Callable[[PlanDevice], float]
              ) -> float:
        if math.isinf(ps_Bps):
            return ps_Bps
        total = sum(min(rate(c), ps_Bps) * c.count for c in classes)
        return ps_Bps * sum(min(rate(c), ps_Bps) * c.count for c in side) / total \
            if total > 0 else 0.0

    ps = [(share(side, ps_down_Bps, lambda c: c.down_Bps),
           share(side, ps_up_Bps, lambda c: c.up_Bps)) for side in sides]
    if not all(down > 0 and up > 0 for down, up in ps):
        return None
    return sides, ps


def regions_floor_s(m: int, k: int, n: int, itemsize: int, classes: Sequence[PlanDevice],
                    ps_down_Bps: float = INF, ps_up_Bps: float = INF) -> float:
    """A floor under the prediction of every :class:`RegionPlan` :func:`plan_regions` could
    find (inf when it finds none): at each row count it may try, the larger of the two sides'
    :func:`_floor_s` for their runs (a side's FLOPs on all its compute, its operands and results
    once through all its links or its share of the PS link: no larger than the floor of any
    grid on any of the side's classes, so than :func:`plan_gemm`'s prediction), the least of
    those over the row counts. Cheap: no plan is searched."""
    if len(classes) < 2 or m < 2 * MIN_TILE:
        return INF
    split = _region_sides_and_links(m, k, n, itemsize, classes, ps_down_Bps, ps_up_Bps)
    return INF if split is None else _split_floor_s(m, k, n, itemsize, *split)


def _split_floor_s(m: int, k: int, n: int, itemsize: int,
                   sides: tuple[list[PlanDevice], list[PlanDevice]],
                   ps: list[tuple[float, float]]) -> float:
    """:func:`regions_floor_s` for the sides and PS shares already found."""
    def floor(rows: int, side: Sequence[PlanDevice], link: tuple[float, float]) -> float:
        return _floor_s(side, 2.0 * rows * k * n, rows * n * itemsize,
                        (rows * k + k * n) * itemsize, *link)
    rows = [at * MIN_TILE for at in range(1, m // MIN_TILE)]  # plan_regions' row counts
    return min(max(floor(r, sides[0], ps[0]), floor(m - r, sides[1], ps[1])) for r in rows)


def plan_regions(m: int, k: int, n: int, itemsize: int, classes: Sequence[PlanDevice],
                 ps_down_Bps: float = INF, ps_up_Bps: float = INF,
                 max_tile_elems: int = 1 << 22, beat_s: float = INF) -> RegionPlan | None:
    """C's rows in two runs, the faster classes on the first, the others on the second, each
    run planned on its own (:func:`plan_gemm`); None for fewer than two classes or too few rows,
    and None at once when no split could be predicted below ``beat_s`` (its caller's one grid,
    less the gain regions must bring; :func:`regions_floor_s`), which saves the searches.

    The first run's rows (in ``MIN_TILE`` steps) are bisected for where the two runs'
    predicted times meet, from where the two sides' rates for the whole GEMM would share them,
    ``REGION_PROBES`` row counts at most; the best of them is kept. Each side sees the PS link
    in proportion to what its own links carry of all the classes'.
    """
    if len(classes) < 2 or m < 2 * MIN_TILE:
        return None
    split = _region_sides_and_links(m, k, n, itemsize, classes, ps_down_Bps, ps_up_Bps)
    if split is None:
        return None
    sides, ps = split
    if beat_s < INF and _split_floor_s(m, k, n, itemsize, sides, ps) >= beat_s:
        return None

    whole = [plan_gemm(m, k, n, itemsize, side, *link, max_tile_elems=max_tile_elems)
             for side, link in zip(sides, ps)]
    if not all(0 < p.predicted_s < INF for p in whole):
        return None
    # the first run's time grows with its rows and the second's shrinks: bisect for where they
    # meet, from where the two sides' rates for the whole GEMM would share the rows
    lo, hi = 1, m // MIN_TILE - 1  # rows in MIN_TILE steps
    rate0, rate1 = 1.0 / whole[0].predicted_s, 1.0 / whole[1].predicted_s
    at = min(hi, max(lo, round(m * rate0 / (rate0 + rate1) / MIN_TILE)))
    best: RegionPlan | None = None
    for _ in range(REGION_PROBES):
        rows = at * MIN_TILE
        p0, p1 = (plan_gemm(r, k, n, itemsize, side, *link, max_tile_elems=max_tile_elems)
                  for r, side, link in zip((rows, m - rows), sides, ps))
        found = RegionPlan((0, rows, m), (p0, p1), max(p0.predicted_s, p1.predicted_s))
        if best is None or found.predicted_s < best.predicted_s:
            best = found
        if p0.predicted_s > p1.predicted_s:
            hi = at - 1
        else:
            lo = at + 1
        if lo > hi:
            break
        at = (lo + hi) // 2
    return best


# -- backward pairs ---------------------------------------------------------------------------
# A linear's backward is two GEMMs on one new operand: ``dX[T x I] = dY[T x O] @ W[O x I]`` and
# ``dW[O x I] = dYᵀ[O x T] @ X[T x I]`` (T tokens, O output and I input features). Both walk
# the same cube of multiply-adds ``(t, o, i)``: dX[t, i] += dY[t, o]·W[o, i] and
# dW[o, i] += dY[t, o]·X[t, i]. Planned together, the cube is cut into a grid of blocks
# ``(t, o, c)`` (token, output and input-column blocks) and each device owns a box of it: it
# receives dY[t, o], W[o, c] and X[t, c] of its box once and computes dX's tile ``(t, c, o)``
# (a partial over output block o) and dW's tile ``(o, c, t)`` (a partial over token block t)
# of each block. dX is K-split over the output blocks, dW over the token blocks; the PS sums
# each in slice order as for any K split, so results stay bit-identical. Cutting two devices'
# boxes apart across token blocks makes both receive the same W blocks and send partials of the
# same dW blocks; across output blocks, the same X blocks and dX blocks; across columns, the
# same dY blocks (:func:`split_boxes` picks the cheapest).
PairGrid = tuple[int, int, int]  # (n_t, n_o, n_c)
Fine = tuple[int, int, int]  # parts per block of a layer's grid along (t, o, c)


@dataclass(frozen=True)
class PairPlan:
    """A backward pair planned as one: the block grid and each GEMM's plan of it."""

    grid: PairGrid
    dx: GemmPlan  # grid (n_t, n_c, n_o): K split over the output blocks
    dw: GemmPlan  # grid (n_o, n_c, n_t): K split over the token blocks
    used: tuple[str, ...]
    sat_out: dict[str, str] = field(default_factory=dict)
    predicted_s: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)


def _pair_sizes(t: int, o: int, i: int, grid: PairGrid) -> tuple[int, int, int]:
    """(token rows, output rows, input columns) of one block."""
    return math.ceil(t / grid[0]), math.ceil(o / grid[1]), math.ceil(i / grid[2])


def _pair_bytes(t: int, o: int, i: int, itemsize: int, grid: PairGrid
                ) -> tuple[float, float, float, float, float]:
    """Bytes of one block's dY, W and X pieces, and of its dX and dW partials."""
    tm, to, tc = _pair_sizes(t, o, i, grid)
    s = itemsize
    return tm * to * s, to * tc * s, tm * tc * s, tm * tc * s, to * tc * s


def _cube_floor_s(t: int, o: int, i: int, itemsize: int, grid: PairGrid,
                  classes: Sequence[PlanDevice], forward: bool = False) -> float:
    """A floor under a pair's prediction on ``grid`` (:func:`predict_pair_s`), or under either
    pass of a layer's (:func:`predict_layer_s`, whatever its parts; ``forward`` for its forward
    pass), plus the fastest round trip, as each adds.

    A device doing ``b`` of the grid's blocks computes them and sends their results one after
    another (a block: forward one tile, a Y partial; backward two, a dX and a dW partial; a
    layer's finer parts are the same FLOPs and bytes in more tiles), and pays
    ``TILE_OVERHEAD_S`` a tile: at least ``b·(max(F, U) + O)`` with ``F`` a block's compute,
    ``U`` its results' time up and ``O`` its tiles' overheads. Shared out any way, some device
    is at least at the level where the devices' blocks add up to the grid's. The totals of
    :func:`_floor_s` miss that a device's compute and uplink are its own (a phone's idle
    compute does not carry a laptop's results) and the overheads."""
    tm, to, tc = _pair_sizes(t, o, i, grid)
    _, _, _, dx_b, dw_b = _pair_bytes(t, o, i, itemsize, grid)
    flops, up_B, tiles = ((2.0 * tm * to * tc, tm * to * itemsize, 1) if forward else
                          (4.0 * tm * to * tc, dx_b + dw_b, 2))
    rate = 0.0  # blocks a second, all devices
    for c in classes:
        if c.up_Bps > 0 and c.down_Bps > 0:
            rate += c.count / (max(flops / max(c.rate_flops, 1.0), up_B / c.up_Bps)
                               + tiles * TILE_OVERHEAD_S)
    if rate <= 0:
        return INF
    # a hair under: rounding must not lift it over a prediction it meets
    return (math.prod(grid) / rate + min(c.rtt_s for c in classes)) * (1 - 1e-9)


def pair_box_time_s(d: PlanDevice, box: Box, t: int, o: int, i: int, itemsize: int,
                    grid: PairGrid, members: float = 1.0) -> float:
    """Device seconds for d to do a box ``(t0, t1, o0, o1, c0, c1)`` of a backward pair.

    It receives each dY, W and X block of its box once and sends a dX and a dW partial per
    block; the three streams overlap and the first tile's blocks come before anything goes up
    (the pipeline of :func:`box_time_s`).
    """
    bt: float = box[1] - box[0]
    bo: float = box[3] - box[2]
    bc = box[5] - box[4]
    if bt * bo * bc == 0:
        return 0.0
    if d.down_Bps <= 0 or d.up_Bps <= 0:
        return INF
    if members > 1:  # a pseudo-device: each member does a square part of the box (as in
        # box_time_s)
        bt, bo = bt / math.sqrt(members), bo / math.sqrt(members)
    rate, down, up = d.rate_flops / members, d.down_Bps / members, d.up_Bps / members
    dy_b, w_b, x_b, dx_b, dw_b = _pair_bytes(t, o, i, itemsize, grid)
    tm, to, tc = _pair_sizes(t, o, i, grid)
    blocks = bt * bo * bc
    if members == 1:
        return _pair_replay_s(int(bt), int(bo), int(bc), 2.0 * tm * to * tc / max(rate, 1.0),
                              dy_b / down, w_b / down, x_b / down, dx_b / up,
                              dw_b / up) + 2 * blocks * TILE_OVERHEAD_S
    d_s = (bt * bo * dy_b + bo * bc * w_b + bt * bc * x_b) / down
    u_s = blocks * (dx_b + dw_b) / up
    f_s = blocks * 4.0 * tm * to * tc / max(rate, 1.0)
    one_down = (dy_b + w_b) / down
    one_up = dx_b / up
    one_f = 2.0 * tm * to * tc / max(rate, 1.0)
    return max(d_s + one_f + one_up, one_down + one_f + u_s,
               one_down + f_s + one_up) + 2 * blocks * TILE_OVERHEAD_S


def _pair_boxes(devices: Sequence[tuple[PlanDevice, float]], t: int, o: int, i: int,
                itemsize: int, grid: PairGrid) -> dict[str, Box]:
    """One box of the pair's grid per device, in proportion to the blocks per second it does
    when each block it receives serves √(blocks per device) blocks (:func:`split_boxes`)."""
    dy_b, w_b, x_b, dx_b, dw_b = _pair_bytes(t, o, i, itemsize, grid)
    tm, to, tc = _pair_sizes(t, o, i, grid)
    reuse = math.sqrt(max(1.0, math.prod(grid) / max(1.0, sum(q for _, q in devices))))
    weights = []
    for d, _ in devices:
        cost = max(4.0 * tm * to * tc / max(d.rate_flops, 1.0),
                   (dy_b + w_b + x_b) / reuse / d.down_Bps if d.down_Bps > 0 else INF,
                   (dx_b + dw_b) / d.up_Bps if d.up_Bps > 0 else INF)
        weights.append((d.name, 1.0 / cost if 0 < cost < INF else 0.0))
    # split_boxes' dimensions (rows, columns, slices) are (t, o, c) here; what a cut across
    # each duplicates: per (o, c) block W and a dW partial, per (t, c) block X and a dX
    # partial, per (t, o) block dY
    return split_boxes(grid, weights, (x_b + dx_b, w_b + dw_b, dy_b), fit=True)


def predict_pair_s(t: int, o: int, i: int, itemsize: int, grid: PairGrid,
                   classes: Sequence[PlanDevice], ps_down_Bps: float = INF,
                   ps_up_Bps: float = INF) -> float:
    """Predicted device seconds of a backward pair planned together on these classes: the
    slowest device's box, at least what the PS link carries, plus one round trip."""
    devices, by_name = _expanded(tuple(classes))
    boxes = _pair_boxes(devices, t, o, i, itemsize, grid)
    dy_b, w_b, x_b, dx_b, dw_b = _pair_bytes(t, o, i, itemsize, grid)
    loads = []
    for name, (t0, t1, o0, o1, c0, c1) in boxes.items():
        bt, bo, bc = t1 - t0, o1 - o0, c1 - c0
        pt, po, pc, each = member_part(bt, bo, bc, by_name[name][1])  # every member's
        loads.append((*by_name[name], each * (pt * po * dy_b + po * pc * w_b + pt * pc * x_b),
                      bt * bo * bc * (dx_b + dw_b)))
    down = sum(load[2] for load in loads)
    up = sum(load[3] for load in loads)
    own = {n_: pair_box_time_s(by_name[n_][0], b, t, o, i, itemsize, grid, by_name[n_][1])
           for n_, b in boxes.items()}
    fair = on_ps_link(loads, ps_down_Bps, ps_up_Bps, own)
    slowest = max((pair_box_time_s(fair[n_], b, t, o, i, itemsize, grid, by_name[n_][1])
                   if fair[n_] is not by_name[n_][0] else own[n_]
                   for n_, b in boxes.items()), default=INF)
    per_device = math.prod(grid) / max(1.0, sum(by_name[n_][1] for n_ in boxes))
    # every member's first tile, a dX part: a dY and a W block
    first = min(down, sum(by_name[n_][1] for n_ in boxes) * (dy_b + w_b))
    return max(slowest, link_s(down / ps_down_Bps, up / ps_up_Bps, per_device,
                               first / ps_down_Bps)) + min(c.rtt_s for c in classes)


def _pair_grids(t: int, o: int, i: int, devices: int, max_tile_elems: int
                ) -> list[PairGrid]:
    """The grids a pair (or a layer, :func:`plan_layer`) may be cut into for this many devices:
    up to ``MAX_PAIR_BLOCKS_PER_DEVICE`` blocks a device (finer columns pipeline a box better
    than its own few tiles), each block's dY, result and W/X pieces within the message limit."""
    step = 1.25 if devices <= 32 else 1.6
    most = MAX_PAIR_BLOCKS_PER_DEVICE * devices
    out = []
    for n_t in _candidates(max(1, t // MIN_TILE), most, step):
        for n_o in _candidates(max(1, o // MIN_TILE), most // n_t, step):
            for n_c in _candidates(max(1, i // MIN_TILE), most // (n_t * n_o), step):
                if (math.ceil(t / math.ceil(t / n_t)) != n_t or
                        math.ceil(o / math.ceil(o / n_o)) != n_o or
                        math.ceil(i / math.ceil(i / n_c)) != n_c):
                    continue  # the tiler would cut fewer blocks
                tm, to, tc = _pair_sizes(t, o, i, (n_t, n_o, n_c))
                if max(tm, to) * tc > max_tile_elems or tm * to > max_tile_elems:
                    continue  # a result or a dY block would not fit a message
                out.append((n_t, n_o, n_c))
    return out


def _search_cube(t: int, o: int, i: int, itemsize: int, classes: Sequence[PlanDevice],
                 ps_down_Bps: float, ps_up_Bps: float, max_tile_elems: int,
                 floor: Callable[[PairGrid, tuple[PlanDevice, ...]], float],
                 predict: Callable[[PairGrid, tuple[PlanDevice, ...], float], float],
                 finer: Callable[[PairGrid, tuple[PlanDevice, ...]], float] | None = None
                 ) -> tuple[list[PlanDevice], _Found | None]:
    """The search :func:`plan_pair` and :func:`plan_layer` share over the cube ``(t, o, i)``:
    the classes in order, and the near-fastest (prediction, grid, taking part) of every device
    set and grid (None when no grid fits the message limit), each candidate predicted only if
    its ``floor`` could be near the fastest (:func:`_predicted`)."""
    if not classes:
        raise ValueError("no devices to plan for")
    flops = 4.0 * t * o * i
    nbytes = (t * o + (t + o) * i) * itemsize
    order = sorted(classes, key=lambda c: (_tile_cost_s(c, flops, nbytes, 0.0, nbytes, 1.0),
                                           c.name))
    candidates: list[_Found] = [
        (floor(grid, taking_part), grid, taking_part)
        for taking_part in _device_sets(order, ps_down_Bps, ps_up_Bps)
        for grid in _pair_grids(t, o, i, sum(c.count for c in taking_part), max_tile_elems)]
    found = _predicted(candidates, predict, finer)
    return order, _near_fastest(found) if found else None


def _pair_of(t: int, o: int, i: int, itemsize: int, order: Sequence[PlanDevice],
             found: _Found) -> PairPlan:
    """The pair plan of a chosen (prediction, grid, classes)."""
    pred, grid, taking_part = found
    counts = {c.name: c.count for c in taking_part}
    sat_out = _sat_out(order, counts, 4.0 * t * o * i, (t * o + (t + o) * i) * itemsize,
                       itemsize, t, o, i)
    tm, to, tc = _pair_sizes(t, o, i, grid)
    n_t, n_o, n_c = grid
    used = tuple(counts)
    dx = GemmPlan(tm, tc, n_o, (n_t, n_c, n_o), used, sat_out, pred, counts)
    dw = GemmPlan(to, tc, n_t, (n_o, n_c, n_t), used, sat_out, pred, counts)
    return PairPlan(grid, dx, dw, used, sat_out, pred, counts)


def plan_pair(t: int, o: int, i: int, itemsize: int, classes: Sequence[PlanDevice],
              ps_down_Bps: float = INF, ps_up_Bps: float = INF,
              max_tile_elems: int = 1 << 22) -> PairPlan | None:
    """Plan a backward pair (``dX = dY @ W``, ``dW = dYᵀ @ X``; dY is ``t x o``, X ``t x i``)
    as one: the grid and the taking-part classes of the smallest predicted time (None when no
    grid fits the message limit)."""
    def floor(grid: PairGrid, taking_part: tuple[PlanDevice, ...]) -> float:
        tm, to, tc = _pair_sizes(t, o, i, grid)
        dy_b, w_b, x_b, dx_b, dw_b = _pair_bytes(t, o, i, itemsize, grid)
        n_t, n_o, n_c = grid
        blocks = n_t * n_o * n_c
        return _floor_s(taking_part, blocks * 4.0 * tm * to * tc, blocks * (dx_b + dw_b),
                        n_t * n_o * dy_b + n_o * n_c * w_b + n_t * n_c * x_b, ps_down_Bps,
                        ps_up_Bps, (2.0 * tm * to * tc, dy_b + w_b, min(dx_b, dw_b)))

    order, best = _search_cube(
        t, o, i, itemsize, classes, ps_down_Bps, ps_up_Bps, max_tile_elems, floor,
        lambda grid, taking_part, _cutoff: predict_pair_s(t, o, i, itemsize, grid, taking_part,
                                                          ps_down_Bps, ps_up_Bps),
        lambda grid, taking_part: _cube_floor_s(t, o, i, itemsize, grid, taking_part))
    return None if best is None else _pair_of(t, o, i, itemsize, order, best)


def deal_pair(plan: PairPlan, t: int, o: int, i: int, itemsize: int,
              devices: Sequence[PlanDevice]
              ) -> tuple[dict[tuple[int, int, int], str], dict[tuple[int, int, int], str]]:
    """Owners of a pair's tiles: dX's ``(t, c, o)`` and dW's ``(o, c, t)`` both go to the
    owner of block (t, o, c), so each dY block travels once."""
    boxes = _pair_boxes([(d, 1.0) for d in devices], t, o, i, itemsize, plan.grid)
    dx: dict[tuple[int, int, int], str] = {}
    dw: dict[tuple[int, int, int], str] = {}
    for name, (t0, t1, o0, o1, c0, c1) in boxes.items():
        for tb in range(t0, t1):
            for ob in range(o0, o1):
                for c in range(c0, c1):
                    dx[(tb, c, ob)] = name
                    dw[(ob, c, tb)] = name
    return dx, dw


# -- a linear's forward and backward on one grid -----------------------------------------------
# The forward GEMM ``Y[T x O] = X[T x I] @ Wᵀ`` walks the same cube (t, o, i) as its backward
# pair. On the pair's grid, forward's tile ``(t, o, c)`` is a partial of Y over input block c
# (K split over the input columns) from X[t, c] and W[o, c]: the very blocks the pair's block
# (t, o, c) needs besides dY[t, o]. Dealt to the same owners, a device keeps them in its cache
# from forward to backward, and backward sends it only dY. :func:`plan_layer` weighs both
# passes together: a grid a little slower forward can save more backward, where W and X would
# otherwise travel again.


@dataclass(frozen=True)
class LayerPlan:
    """A linear's forward GEMM and backward pair planned on one grid, with one owner per block."""

    pair: PairPlan  # the backward pair on the grid
    forward: GemmPlan  # grid (n_t, n_o, n_c), K split over the input blocks
    forward_s: float  # predicted, each pass
    backward_s: float
    fine: Fine = (1, 1, 1)  # parts per block along (t, o, c) (:func:`layer_box_times_s`)

    @property
    def predicted_s(self) -> float:
        return self.forward_s + self.backward_s


def fine_grid(grid: PairGrid, fine: Fine) -> PairGrid:
    """The grid of parts a layer's coarse grid is cut into (each coarse block ``fine`` parts)."""
    return grid[0] * fine[0], grid[1] * fine[1], grid[2] * fine[2]


@functools.lru_cache(maxsize=1 << 16)
def _layer_replay_s(bt: int, bo: int, bc: int, fine: Fine, f_s: float, x_s: float,
                    w_s: float, y_s: float, dy_s: float, dx_s: float, dw_s: float
                    ) -> tuple[float, float]:
    """:func:`pipeline_s` of a layer's box of ``bt x bo x bc`` coarse blocks cut into parts
    (``fine``; ``f_s`` one part-cube's compute, the others one part's transfers), forward and
    backward. Forward's tiles ``(c, t, o)`` (its queue order ``(s, r, c)``) each chain the X
    and W parts of one coarse input block; backward, holding those, dX's ``(o, t, c)`` chain
    the dY parts of one coarse output block, then dW's ``(t, o, c)`` the dY parts (held by
    then) of one coarse token block."""
    ft, fo, fc = fine
    nt, no, nc = bt * ft, bo * fo, bc * fc
    forward = [(tuple((("x", r, s * fc + j), x_s) for j in range(fc))
                + tuple((("w", c, s * fc + j), w_s) for j in range(fc)), fc * f_s, y_s)
               for s in range(bc) for r in range(nt) for c in range(no)]
    dx = [(tuple((("dy", r, s * fo + j), dy_s) for j in range(fo)), fo * f_s, dx_s)
          for s in range(bo) for r in range(nt) for _ in range(nc)]
    dw = [(tuple((("dy", s * ft + j, r), dy_s) for j in range(ft)), ft * f_s, dw_s)
          for s in range(bt) for r in range(no) for _ in range(nc)]
    return pipeline_s(forward), pipeline_s(dx + dw)


def layer_box_times_s(d: PlanDevice, box: Box, t: int, o: int, i: int, itemsize: int,
                      grid: PairGrid, members: float = 1.0, fine: Fine = (1, 1, 1)
                      ) -> tuple[float, float]:
    """(forward, backward) device seconds for d to do a box ``(t0, t1, o0, o1, c0, c1)`` of a
    layer's grid, its tiles pipelining as in :func:`box_time_s`: forward receives the box's X
    and W blocks and sends a Y partial per block; backward, holding those, receives the box's
    dY blocks and sends a dX and a dW partial per block. With ``fine`` parts per block, each
    tile is one part of its result and chains the parts of one block along its contraction
    (:func:`_layer_replay_s`): the same bytes, in smaller pieces that pipeline."""
    bt: float = box[1] - box[0]
    bo: float = box[3] - box[2]
    bc = box[5] - box[4]
    if bt * bo * bc == 0:
        return 0.0, 0.0
    if d.down_Bps <= 0 or d.up_Bps <= 0:
        return INF, INF
    if members > 1:  # a pseudo-device: each member does a square part (as in box_time_s)
        bt, bo = bt / math.sqrt(members), bo / math.sqrt(members)
    rate, down, up = d.rate_flops / members, d.down_Bps / members, d.up_Bps / members
    if members == 1 and fine != (1, 1, 1):
        parts = fine_grid(grid, fine)
        dy_b, w_b, x_b, dx_b, dw_b = _pair_bytes(t, o, i, itemsize, parts)
        tm, to, tc = _pair_sizes(t, o, i, parts)
        forward, backward = _layer_replay_s(
            int(bt), int(bo), int(bc), fine, 2.0 * tm * to * tc / max(rate, 1.0), x_b / down,
            w_b / down, tm * to * itemsize / up, dy_b / down, dx_b / up, dw_b / up)
        nt, no, nc = bt * fine[0], bo * fine[1], bc * fine[2]
        return (forward + bc * nt * no * TILE_OVERHEAD_S,
                backward + (bo * nt * nc + bt * no * nc) * TILE_OVERHEAD_S)
    dy_b, w_b, x_b, dx_b, dw_b = _pair_bytes(t, o, i, itemsize, grid)
    tm, to, tc = _pair_sizes(t, o, i, grid)
    y_b = tm * to * itemsize
    blocks = bt * bo * bc
    one_f = 2.0 * tm * to * tc / max(rate, 1.0)

    def streams(down_B: float, one_down: float, up_B: float, one_up: float, per_block: int
                ) -> float:
        d_s, u_s, f_s = down_B / down, up_B / up, blocks * per_block * one_f
        return max(d_s + one_f + one_up, one_down + one_f + u_s,
                   one_down + f_s + one_up) + per_block * blocks * TILE_OVERHEAD_S

    if members == 1:  # forward: the (c, t, o) order of its K split; backward holds W and X
        forward = _box_replay_s(int(bt), int(bo), int(bc), one_f, x_b / down, w_b / down,
                                y_b / up) + blocks * TILE_OVERHEAD_S
        backward = _pair_replay_s(int(bt), int(bo), int(bc), one_f, dy_b / down, 0.0, 0.0,
                                  dx_b / up, dw_b / up) + 2 * blocks * TILE_OVERHEAD_S
        return forward, backward
    forward = streams(bc * (bt * x_b + bo * w_b), (x_b + w_b) / down, blocks * y_b,
                      y_b / up, 1)
    backward = streams(bt * bo * dy_b, dy_b / down, blocks * (dx_b + dw_b), dx_b / up, 2)
    return forward, backward


def predict_layer_s(t: int, o: int, i: int, itemsize: int, grid: PairGrid,
                    classes: Sequence[PlanDevice], ps_down_Bps: float = INF,
                    ps_up_Bps: float = INF, fine: Fine = (1, 1, 1)) -> tuple[float, float]:
    """(forward, backward) predicted device seconds of a layer on one grid, its blocks cut
    into ``fine`` parts: per pass the slowest box (the pair's boxes, :func:`_pair_boxes`), at
    least what the PS link carries, plus one round trip."""
    return _predict_layer(t, o, i, itemsize, grid, classes, ps_down_Bps, ps_up_Bps,
                          lambda f: f == fine, fine)[:2]


def _predict_layer(t: int, o: int, i: int, itemsize: int, grid: PairGrid,
                   classes: Sequence[PlanDevice], ps_down_Bps: float, ps_up_Bps: float,
                   allowed: Callable[[Fine], bool], start: Fine = (1, 1, 1)
                   ) -> tuple[float, float, Fine]:
    """:func:`predict_layer_s` with the parts chosen: from ``start``, move to the fastest of
    every other count along one dimension (:data:`FINE_PARTS`, those ``allowed``) while that
    is faster. The boxes and the PS link's bytes do not depend on the parts, only the boxes'
    pipelines; a pseudo-device's closed form does not see parts, so large groups keep none."""
    devices, by_name = _expanded(tuple(classes))
    boxes = _pair_boxes(devices, t, o, i, itemsize, grid)
    if not boxes:
        return INF, INF, start
    dy_b, w_b, x_b, dx_b, dw_b = _pair_bytes(t, o, i, itemsize, grid)
    tm, to, _ = _pair_sizes(t, o, i, grid)
    fwd_down = bwd_down = blocks = 0.0
    fwd_loads, bwd_loads = [], []
    for name, box in boxes.items():
        bt, bo, bc = box[1] - box[0], box[3] - box[2], box[5] - box[4]
        blocks += bt * bo * bc
        pt, po, pc, each = member_part(bt, bo, bc, by_name[name][1])
        fwd_down += each * pc * (pt * x_b + po * w_b)
        bwd_down += each * pt * po * dy_b
        fwd_loads.append((*by_name[name], each * pc * (pt * x_b + po * w_b),
                          bt * bo * bc * tm * to * itemsize))
        bwd_loads.append((*by_name[name], each * pt * po * dy_b, bt * bo * bc * (dx_b + dw_b)))
    # forward moves X and W down and Y up; backward dY down and dX and dW up; each device's
    # pace, its boxes at its own links (with the first parts tried)
    own = {name: layer_box_times_s(by_name[name][0], box, t, o, i, itemsize, grid,
                                   by_name[name][1], start) for name, box in boxes.items()}
    fair_fwd = on_ps_link(fwd_loads, ps_down_Bps, ps_up_Bps,
                          {name: f for name, (f, _) in own.items()})
    fair_bwd = on_ps_link(bwd_loads, ps_down_Bps, ps_up_Bps,
                          {name: b for name, (_, b) in own.items()})
    rtt = min(c.rtt_s for c in classes)
    members = sum(by_name[name][1] for name in boxes)
    per_device = blocks / max(1.0, members)

    def times(fine: Fine) -> tuple[float, float]:
        # forward's tiles are a block's (t, o) parts, backward's dX (t, c) parts (dW's alike);
        # a device's first forward tile brings a part of X and one of W, its first backward
        # one a part of dY (W and X held)
        fwd = link_s(fwd_down / ps_down_Bps, blocks * tm * to * itemsize / ps_up_Bps,
                     per_device * fine[0] * fine[1],
                     min(fwd_down, members * (x_b / fine[0] + w_b / fine[1])) / ps_down_Bps)
        bwd = link_s(bwd_down / ps_down_Bps, blocks * (dx_b + dw_b) / ps_up_Bps,
                     per_device * fine[0] * fine[2],
                     min(bwd_down, members * dy_b / fine[0]) / ps_down_Bps)
        for name, box in boxes.items():
            q = by_name[name][1]
            f, b = layer_box_times_s(fair_fwd[name], box, t, o, i, itemsize, grid, q, fine)
            if fair_bwd[name] is not fair_fwd[name]:
                b = layer_box_times_s(fair_bwd[name], box, t, o, i, itemsize, grid, q, fine)[1]
            fwd, bwd = max(fwd, f), max(bwd, b)
        return fwd, bwd

    best_fine = start
    best = times(start)
    moved = all(q == 1 for _, q in by_name.values())  # parts only where boxes replay
    while moved:
        moved = False
        around: list[Fine] = []
        for axis in range(3):
            for n in FINE_PARTS[axis]:
                if n != best_fine[axis]:
                    f = list(best_fine)
                    f[axis] = n
                    around.append((f[0], f[1], f[2]))
        for fine in around:
            if not allowed(fine):
                continue
            got = times(fine)
            if got[0] + got[1] < best[0] + best[1]:
                best, best_fine, moved = got, fine, True
    return best[0] + rtt, best[1] + rtt, best_fine


def _fines(t: int, o: int, i: int, grid: PairGrid, devices: int) -> Callable[[Fine], bool]:
    """Which parts a layer's grid may be cut into: each part at least ``MIN_TILE`` a side and
    cut by the tiler into exactly that many, at most ``MAX_PARTS_PER_DEVICE`` parts a device."""
    def allowed(fine: Fine) -> bool:
        parts = fine_grid(grid, fine)
        return math.prod(parts) <= MAX_PARTS_PER_DEVICE * devices and all(
            x // n >= MIN_TILE and math.ceil(x / math.ceil(x / n)) == n
            for x, n in zip((t, o, i), parts))
    return allowed


def plan_layer(t: int, o: int, i: int, itemsize: int, classes: Sequence[PlanDevice],
               ps_down_Bps: float = INF, ps_up_Bps: float = INF,
               max_tile_elems: int = 1 << 22) -> LayerPlan | None:
    """Plan a linear (``Y = X @ Wᵀ``; X is ``t x i``, Y ``t x o``) forward and backward on one
    grid: the grid and taking-part classes of the smallest predicted sum of both passes, the
    devices holding their forward blocks for backward (None when no grid fits the message
    limit)."""
    def floor(grid: PairGrid, taking_part: tuple[PlanDevice, ...]) -> float:
        tm, to, tc = _pair_sizes(t, o, i, grid)
        dy_b, w_b, x_b, dx_b, dw_b = _pair_bytes(t, o, i, itemsize, grid)
        n_t, n_o, n_c = grid
        blocks = n_t * n_o * n_c
        flops = blocks * 2.0 * tm * to * tc
        return _floor_s(taking_part, flops, blocks * tm * to * itemsize,
                        n_c * (n_t * x_b + n_o * w_b), ps_down_Bps, ps_up_Bps) + \
            _floor_s(taking_part, 2 * flops, blocks * (dx_b + dw_b), n_t * n_o * dy_b,
                     ps_down_Bps, ps_up_Bps)

    def finer_floor(grid: PairGrid, taking_part: tuple[PlanDevice, ...]) -> float:
        return _cube_floor_s(t, o, i, itemsize, grid, taking_part, forward=True) + \
            _cube_floor_s(t, o, i, itemsize, grid, taking_part)

    chosen: dict[tuple[PairGrid, tuple[PlanDevice, ...]], tuple[float, float, Fine]] = {}

    def predict(grid: PairGrid, taking_part: tuple[PlanDevice, ...], _cutoff: float) -> float:
        got = chosen[(grid, taking_part)] = _predict_layer(
            t, o, i, itemsize, grid, taking_part, ps_down_Bps, ps_up_Bps,
            _fines(t, o, i, grid, sum(c.count for c in taking_part)))
        return got[0] + got[1]

    order, best = _search_cube(t, o, i, itemsize, classes, ps_down_Bps, ps_up_Bps,
                               max_tile_elems, floor, predict, finer_floor)
    if best is None:
        return None
    fwd_s, bwd_s, fine = chosen[(best[1], best[2])]
    pair = _pair_of(t, o, i, itemsize, order, (bwd_s, best[1], best[2]))
    n_t, n_o, n_c = best[1]
    f_t, f_o, f_c = fine
    tm, to, tc = _pair_sizes(t, o, i, fine_grid(best[1], fine))
    # each GEMM's tiles are one part of its result; its K slices are a block's parts, each
    # part its own cached block (k_block), so that what forward sent backward finds
    forward = GemmPlan(tm, to, n_c, (n_t * f_t, n_o * f_o, n_c), pair.used, pair.sat_out,
                       fwd_s, pair.counts, tc if f_c > 1 else 0)
    dx = replace(pair.dx, tile_m=tm, tile_n=tc, grid=(n_t * f_t, n_c * f_c, n_o),
                 k_block=to if f_o > 1 else 0)
    dw = replace(pair.dw, tile_m=to, tile_n=tc, grid=(n_o * f_o, n_c * f_c, n_t),
                 k_block=tm if f_t > 1 else 0)
    return LayerPlan(replace(pair, dx=dx, dw=dw), forward, fwd_s, bwd_s, fine)


def deal_layer(plan: LayerPlan, t: int, o: int, i: int, itemsize: int,
               devices: Sequence[PlanDevice]
               ) -> tuple[dict[tuple[int, int, int], str], dict[tuple[int, int, int], str],
                          dict[tuple[int, int, int], str]]:
    """Owners of a layer's forward tiles ``(t, o, c)`` and of its pair's dX ``(t, c, o)`` and
    dW ``(o, c, t)`` tiles (row, column, K slice): each goes to the owner of the block it is a
    part of (:func:`deal_pair`'s boxes), so a device keeps its box's blocks from forward to
    backward."""
    dx, _ = deal_pair(plan.pair, t, o, i, itemsize, devices)
    block = {(tb, ob, c): name for (tb, c, ob), name in dx.items()}
    n_t, n_o, n_c = plan.pair.grid
    f_t, f_o, f_c = plan.fine
    forward, dx_owners, dw_owners = {}, {}, {}
    for (tb, ob, cb), name in block.items():
        for tf in range(tb * f_t, (tb + 1) * f_t):
            for of in range(ob * f_o, (ob + 1) * f_o):
                forward[(tf, of, cb)] = name
            for cf in range(cb * f_c, (cb + 1) * f_c):
                dx_owners[(tf, cf, ob)] = name
        for of in range(ob * f_o, (ob + 1) * f_o):
            for cf in range(cb * f_c, (cb + 1) * f_c):
                dw_owners[(of, cf, tb)] = name
    return forward, dx_owners, dw_owners
