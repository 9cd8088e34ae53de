"""Checks on a returned tile, before the PS trusts it.

Boundary checks (cheap, always): the result is 2-D with the tile's shape, has the job's dtype,
and every value is finite. Value check (Freivalds, 1977): for a random vector r, a correct
``C = A·B`` satisfies ``A·(B·r) = C·r``; that costs ``2(mk + kn + mn)`` FLOPs against the tile's
``2mkn`` (about 0.1–1% for tiles of 128 or more). Floating-point products are not exact, so the
residual is compared with the standard forward-error bound of a dot product of length k,
``|fl(x·y) - x·y| <= γ_k |x|·|y|`` with ``γ_k = k·u/(1 - k·u)`` (Higham, *Accuracy and Stability of
Numerical Algorithms*, §3.1), applied to both sides and widened by ``SLACK``.
"""

from __future__ import annotations

import numpy as np

SLACK = 4.0  # headroom over the worst-case bound: summation orders differ between BLAS libraries
_RNG = np.random.default_rng(20240601)


def gamma(k: int, dtype: np.dtype) -> float:
    """Higham's γ_k for unit roundoff u of the dtype."""
    u = float(np.finfo(dtype).eps) / 2
    ku = k * u
    return ku / (1 - ku) if ku < 1 else float("inf")


def freivalds_ok(a: np.ndarray, b: np.ndarray, c: np.ndarray, vectors: int = 1,
                 rng: np.random.Generator | None = None) -> bool:
    """Whether C passes Freivalds' check against A·B with `vectors` random ±1 vectors."""
    rng = rng or _RNG
    k = a.shape[1]
    g = gamma(k + c.shape[1], c.dtype) * SLACK  # A·(B·r) and C·r add n more terms
    abs_a, abs_b, abs_c = np.abs(a), np.abs(b), np.abs(c)
    for _ in range(vectors):
        r = rng.choice(np.array([-1.0, 1.0], dtype=c.dtype), size=c.shape[1])
        residual = np.abs(a @ (b @ r) - c @ r)
        bound = g * (abs_a @ (abs_b @ np.abs(r)) + abs_c @ np.abs(r)) + np.finfo(c.dtype).tiny
        if not np.all(residual <= bound):
            return False
    return True


def check_result(a: np.ndarray, b: np.ndarray, c: np.ndarray, check_values: bool = True,
                 vectors: int = 1) -> str | None:
    """None if C is an acceptable result for A·B, else why not."""
    expected = (a.shape[0], b.shape[1])
    if c.shape != expected:
        return f"wrong shape {tuple(c.shape)}, expected {expected}"
    if c.dtype != a.dtype:
        return f"wrong dtype {c.dtype}, expected {a.dtype}"
    if not np.all(np.isfinite(c)):
        return "result has non-finite values (NaN or Inf)"
    if check_values and not freivalds_ok(a, b, c, vectors):
        return "result fails the Freivalds check (C·r differs from A·(B·r))"
    return None
