"""Cutting one GEMM into tiles.

``C[M x N] = A[M x K] @ B[K x N]`` is cut into tiles of at most ``tile_m x tile_n`` elements of C.
Tile (i, j) needs row block i of A (``tile_m x K``) and column block j of B (``K x tile_n``) and
produces ``C[i*tile_m : .., j*tile_n : ..]``. Without a K split each tile is a whole dot product,
so its result is final and the PS only places it. With a K split (:func:`cut_k`) tile
``(i, j, s)`` uses only the contraction range ``k0:k1`` of slice ``s`` and returns a partial; the
PS sums the partials of a block in slice order (see :mod:`testbed.ps_backend.planner`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TileBox:
    """Where one tile sits: C[r0:r1, c0:c1], from A[r0:r1, :] and B[:, c0:c1]."""

    row: int
    col: int
    r0: int
    r1: int
    c0: int
    c1: int
    k0: int = 0  # contraction range of a K-split tile; k1 == -1: the whole K
    k1: int = -1
    part: int = 0  # its slice number (summation order)
    parts: int = 1  # slices its block of C is cut into (the partials the PS sums)
    # K parts (0: none): its operands travel and are cached as its K range cut at multiples of
    # this, so a slice spanning several parts reuses the blocks another GEMM of the step cut
    # finer (a linear's forward and backward on one grid)
    k_block: int = 0

    @property
    def split(self) -> bool:
        return self.k1 >= 0

    @property
    def key(self) -> tuple[int, ...]:
        """How the ledger names the tile: (r0, r1, c0, c1), plus (k0, k1) when K is split."""
        base = (self.r0, self.r1, self.c0, self.c1)
        return base + (self.k0, self.k1) if self.split else base

    @property
    def shape(self) -> tuple[int, int]:
        return self.r1 - self.r0, self.c1 - self.c0


def gemm_flops(m: int, k: int, n: int) -> float:
    """Floating-point operations of an m x k by k x n product (one multiply-add = 2 FLOPs)."""
    return 2.0 * m * k * n


def cut(m: int, n: int, tile_m: int, tile_n: int) -> list[TileBox]:
    """The tiles of an m x n result, row-major; edge tiles are smaller."""
    if m <= 0 or n <= 0 or tile_m <= 0 or tile_n <= 0:
        raise ValueError(f"cannot tile a {m}x{n} result with {tile_m}x{tile_n} tiles")
    return [TileBox(i, j, r0, min(r0 + tile_m, m), c0, min(c0 + tile_n, n))
            for i, r0 in enumerate(range(0, m, tile_m))
            for j, c0 in enumerate(range(0, n, tile_n))]


def cut_k(m: int, n: int, k: int, tile_m: int, tile_n: int, k_parts: int,
          k_block: int = 0) -> list[TileBox]:
    """The tiles of an m x n result with K cut into ``k_parts`` slices; no split when 1.

    ``k_block`` > 0: K is first cut into parts of that size (how the operands' blocks are
    named and cached, :func:`k_pieces`) and each slice is a run of whole parts.
    """
    boxes = cut(m, n, tile_m, tile_n)
    if k_parts <= 1:
        return [replace(b, k_block=k_block) for b in boxes] if k_block > 0 else boxes
    size = -(-k // k_parts)
    if k_block > 0:
        parts = -(-k // k_block)
        size = k_block * -(-parts // k_parts)
    slices = [(k0, min(k0 + size, k)) for k0 in range(0, k, size)]
    return [TileBox(b.row, b.col, b.r0, b.r1, b.c0, b.c1, k0, k1, s, len(slices), k_block)
            for s, (k0, k1) in enumerate(slices) for b in boxes]


@dataclass(frozen=True)
class Region:
    """A run of C's rows cut its own way: ``rows`` ``r0:r1`` in tiles of ``tile_m x tile_n``
    over ``k_parts`` K slices, runs of ``k_block`` parts when set (:func:`cut_k`)."""

    r0: int
    r1: int
    tile_m: int
    tile_n: int
    k_parts: int = 1
    k_block: int = 0

    @property
    def tile_rows(self) -> int:
        """How many rows of tiles the run is cut into (:func:`cut_regions` numbers the next
        run's from there)."""
        return -(-(self.r1 - self.r0) // self.tile_m)


def uniform(m: int, tile_m: int, tile_n: int, k_parts: int = 1, k_block: int = 0
            ) -> tuple[Region, ...]:
    """A cut with one region: every row of an ``m``-row result cut the same way."""
    return (Region(0, m, tile_m, tile_n, k_parts, k_block),)


def cut_regions(n: int, k: int, regions: Sequence[Region]) -> list[TileBox]:
    """The tiles of a result whose runs of rows may be cut differently (:class:`Region`, in
    row order, together covering every row once), region by region in :func:`cut_k`'s order.
    Tile rows are numbered through the regions, so ``(row, col, part)`` names one tile of C.
    A uniform cut is one region (:func:`uniform`)."""
    out: list[TileBox] = []
    rows = 0
    for g in regions:
        boxes = cut_k(g.r1 - g.r0, n, k, g.tile_m, g.tile_n, g.k_parts, g.k_block)
        out += [replace(b, row=b.row + rows, r0=b.r0 + g.r0, r1=b.r1 + g.r0) for b in boxes]
        rows += g.tile_rows
    return out


def k_pieces(k0: int, k1: int, k_block: int) -> list[tuple[int, int]]:
    """The parts of a contraction range ``k0:k1`` cut at multiples of ``k_block`` (0: one)."""
    if k_block <= 0:
        return [(k0, k1)]
    out = []
    lo = k0
    while lo < k1:
        hi = min(k1, (lo // k_block + 1) * k_block)
        out.append((lo, hi))
        lo = hi
    return out
