"""Freivalds' check: honest tiles pass in both dtypes, corrupted ones fail."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.ps_backend.validation import check_result, freivalds_ok


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [8, 256, 3072])
def test_honest_tiles_pass(dtype: type, k: int) -> None:
    rng = np.random.default_rng(k)
    for _ in range(20):
        a = (rng.standard_normal((64, k)) * rng.uniform(0.01, 100)).astype(dtype)
        b = rng.standard_normal((k, 48)).astype(dtype)
        if rng.random() < 0.3:
            a = np.abs(a)  # same-sign operands: no cancellation to hide behind
        assert check_result(a, b, a @ b) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_corruptions_fail(dtype: type) -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 256)).astype(dtype)
    b = rng.standard_normal((256, 64)).astype(dtype)
    c = a @ b
    flipped = c.copy()
    flipped.view(np.uint32 if dtype == np.float32 else np.uint64)[3, 5] ^= 1 << (
        27 if dtype == np.float32 else 59)  # an exponent bit
    noise = 1e-3 * np.abs(c).mean() * rng.standard_normal(c.shape).astype(dtype)
    for bad in (c * 1.001, c + noise, flipped, np.zeros_like(c), np.roll(c, 1, axis=0)):
        assert not freivalds_ok(a, b, bad)


def test_a_constant_added_to_a_tile_fails_whatever_the_draw() -> None:
    # With ±1 vectors this escapes whenever r sums to zero (C(96,48)/2^96, about 8 % of draws):
    # 200 draws would let ~16 through. The continuous vectors let none.
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 32))
    b = rng.standard_normal((32, 96))
    c = a @ b
    for seed in range(200):
        assert not freivalds_ok(a, b, c + 1.0, rng=np.random.default_rng(seed))
        assert freivalds_ok(a, b, c, rng=np.random.default_rng(seed))
