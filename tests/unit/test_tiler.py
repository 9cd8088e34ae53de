"""Cutting a GEMM into tiles: K slices made of whole parts (``k_block``) and a slice's parts;
runs of rows cut each their own way (regions)."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.ps_backend.tiler import Region, cut_k, cut_regions, k_pieces, uniform


@pytest.mark.parametrize("k, k_parts, k_block", [(300, 3, 16), (96, 4, 8), (100, 3, 7),
                                                  (64, 2, 64), (50, 5, 10)])
def test_k_slices_are_runs_of_whole_parts_and_cover_k(k: int, k_parts: int, k_block: int
                                                      ) -> None:
    boxes = cut_k(32, 16, k, 16, 16, k_parts, k_block)
    slices = sorted({(b.part, b.k0, b.k1) for b in boxes if b.split} or {(0, 0, k)})
    assert slices[0][1] == 0 and slices[-1][2] == k
    for (_, _, end), (_, start, _) in zip(slices, slices[1:]):
        assert end == start  # contiguous, in summation order
    for _, k0, k1 in slices:
        assert k0 % k_block == 0 and (k1 % k_block == 0 or k1 == k)
        pieces = k_pieces(k0, k1, k_block)
        assert pieces[0][0] == k0 and pieces[-1][1] == k1
        assert all(hi - lo <= k_block and lo % k_block == 0 for lo, hi in pieces)
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert len(slices) <= k_parts


def test_without_parts_a_slice_is_one_piece_and_the_cut_is_unchanged() -> None:
    assert k_pieces(5, 37, 0) == [(5, 37)]
    assert [(b.key, b.part) for b in cut_k(32, 16, 300, 16, 16, 3)] == \
        [(b.key, b.part) for b in cut_k(32, 16, 300, 16, 16, 3, 100)]


def test_a_uniform_cut_is_one_region_and_each_tile_carries_its_parts() -> None:
    n, k = 16, 64
    assert cut_regions(n, k, uniform(32, 16, 8, 2, 16)) == cut_k(32, n, k, 16, 8, 2, 16)
    # whole K in parts of 16: the tiles are not split, but their blocks travel as parts
    whole = cut_regions(n, k, uniform(32, 16, 8, 1, 16))
    assert all(not b.split and b.k_block == 16 for b in whole)
    mixed = cut_regions(n, k, [Region(0, 16, 16, 8, 2, 16), Region(16, 32, 8, 16, 4)])
    assert {b.k_block for b in mixed if b.r0 < 16} == {16}
    assert {b.k_block for b in mixed if b.r0 >= 16} == {0}


def test_regions_cover_every_product_once_and_name_each_tile_once() -> None:
    m, n, k = 70, 45, 50
    regions = [Region(0, 30, 16, 45), Region(30, 70, 8, 16, 3)]
    boxes = cut_regions(n, k, regions)
    products = np.zeros((m, n, k), dtype=int)
    for b in boxes:
        k0, k1 = (b.k0, b.k1) if b.split else (0, k)
        products[b.r0:b.r1, b.c0:b.c1, k0:k1] += 1
    assert (products == 1).all()
    assert len({(b.row, b.col, b.part) for b in boxes}) == len(boxes)
    first = [b for b in boxes if b.r0 < 30]
    assert all(not b.split and b.parts == 1 and b.r1 <= 30 for b in first)
    second = [b for b in boxes if b.r0 >= 30]
    assert {b.parts for b in second} == {3} and {b.part for b in second} == {0, 1, 2}
    assert min(b.row for b in second) == max(b.row for b in first) + 1
    # a region's boxes are its own cut_k, moved down to its first row
    assert [(b.r0 - 30, b.r1 - 30, b.c0, b.c1, b.k0, b.k1, b.part) for b in second] == \
        [(b.r0, b.r1, b.c0, b.c1, b.k0, b.k1, b.part) for b in cut_k(40, n, k, 8, 16, 3)]
