"""Cutting one GEMM into tiles.

``C[M x N] = A[M x K] @ B[K x N]`` is cut into tiles of at most ``tile_m x tile_n`` elements of C.
Tile (i, j) needs row block i of A (``tile_m x K``) and column block j of B (``K x tile_n``) and
produces ``C[i*tile_m : .., j*tile_n : ..]``. K is not split (each tile is a whole dot product),
so a tile's result is final and the PS only places it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TileBox:
    """Where one tile sits: C[r0:r1, c0:c1], from A[r0:r1, :] and B[:, c0:c1]."""

    row: int
    col: int
    r0: int
    r1: int
    c0: int
    c1: int

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
