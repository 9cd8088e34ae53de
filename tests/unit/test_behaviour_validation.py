"""Freivalds' tolerance does not refuse an honest tile whose B columns cancel under r."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.ps_backend.validation import freivalds_ok


def test_columns_that_cancel_under_r_do_not_refuse_an_honest_tile() -> None:
    """B·r can be ~0 while C's rounding errors are not (correlated columns): still passes."""
    rng = np.random.default_rng(7)
    for _ in range(50):
        a = rng.standard_normal((16, 256)).astype(np.float32)
        col = rng.standard_normal((256, 1))
        b = np.repeat(col, 16, axis=1) * (1 + 1e-7 * rng.standard_normal((256, 16)))
        b = b.astype(np.float32)
        c = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)  # rounded C
        c += (np.abs(c) * 2e-7 * rng.standard_normal(c.shape)).astype(np.float32)
        for _ in range(20):
            assert freivalds_ok(a, b, c)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_check_shares_work_and_still_judges_every_tile(dtype: type) -> None:
    from testbed.agent.behaviour import Behaviour
    from testbed.ps_backend.tiler import cut
    from testbed.ps_backend.validation import GemmCheck

    rng = np.random.default_rng(11)
    a = rng.standard_normal((96, 200)).astype(dtype)
    b = rng.standard_normal((200, 80)).astype(dtype)
    c = a @ b
    boxes = cut(96, 80, 32, 16)
    check = GemmCheck(a, b, [(x.c0, x.c1) for x in boxes])
    liar = Behaviour(byzantine_rate=1.0, seed=2)
    for box in boxes:
        tile = c[box.r0:box.r1, box.c0:box.c1]
        assert check.tile_ok(box.r0, box.r1, box.c0, box.c1, tile)
        bad, mode = liar.apply(np.ascontiguousarray(tile))
        assert mode is not None and not check.tile_ok(box.r0, box.r1, box.c0, box.c1, bad)
    assert len(check.r) == 5  # one set of vectors per column block


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_check_judges_every_partial_of_a_k_split(dtype: type) -> None:
    from testbed.agent.behaviour import Behaviour
    from testbed.ps_backend.tiler import cut_k
    from testbed.ps_backend.validation import GemmCheck

    rng = np.random.default_rng(12)
    a = rng.standard_normal((64, 300)).astype(dtype)
    b = rng.standard_normal((300, 48)).astype(dtype)
    boxes = cut_k(64, 48, 300, 32, 16, 3)
    check = GemmCheck(a, b, [(x.c0, x.c1, x.k0, x.k1) for x in boxes])
    liar = Behaviour(byzantine_rate=1.0, seed=3)
    for box in boxes:
        partial = a[box.r0:box.r1, box.k0:box.k1] @ b[box.k0:box.k1, box.c0:box.c1]
        assert check.tile_ok(box.r0, box.r1, box.c0, box.c1, partial, box.k0, box.k1)
        bad, mode = liar.apply(np.ascontiguousarray(partial))
        assert mode is not None
        assert not check.tile_ok(box.r0, box.r1, box.c0, box.c1, bad, box.k0, box.k1)
        # another slice's partial of the same block is not this one
        other = next(x for x in boxes if (x.r0, x.c0) == (box.r0, box.c0) and x.k0 != box.k0)
        wrong = a[box.r0:box.r1, other.k0:other.k1] @ b[other.k0:other.k1, box.c0:box.c1]
        assert not check.tile_ok(box.r0, box.r1, box.c0, box.c1, wrong, box.k0, box.k1)
    assert len(check.r) == 3 * 3  # vectors per column block and slice
