"""Checks on a returned tile, before the PS trusts it.

Boundary checks (cheap, always): the result is 2-D with the tile's shape, has the job's dtype,
and every value is finite.

Value check (Freivalds, 1977): for a random ±1 vector r a correct ``C = A·B`` satisfies
``A·(B·r) = C·r``. That costs ``2(mk + kn + mn)`` FLOPs against the tile's ``2mkn`` (under 1% for
tiles of 128 and more). The check is computed in float64 whatever the tile's dtype, so the only
rounding that matters is the device's own in C. Its tolerance is norm-wise: row i passes when

    |(A·(B·r))_i - (C·r)_i|  <=  TAU · u · ||a_i||₂ · ||B·r||₂

with u the unit roundoff of C's dtype (2⁻²⁴ for float32, 2⁻⁵³ for float64) and ``||a_i|| ||B·r||``
the Cauchy–Schwarz bound of the exact ``a_i·(B·r)``. On honest tiles (random operands, both signs
and same-sign, scales 0.01–100, k from 8 to 3072) the left side stayed below 5·u·||a_i|| ||B·r||;
TAU = 64 leaves more than 10x headroom (tests/unit/test_validation.py checks honest tiles and
corruptions). A relative error ε spread over C moves the residual by about ε/(u·√k) units, so
errors larger than ~TAU·u·√k relative are caught (about 1e-4 for float32 at k = 1024); bit flips
in the sign or exponent always are, flips in the lowest mantissa bits are below any tolerance.
"""

from __future__ import annotations

import numpy as np

TAU = 64.0
_RNG = np.random.default_rng(20240601)


def freivalds_ok(a: np.ndarray, b: np.ndarray, c: np.ndarray, vectors: int = 1,
                 rng: np.random.Generator | None = None, tau: float = TAU) -> bool:
    """Whether C passes Freivalds' check against A·B with `vectors` random ±1 vectors."""
    rng = rng or _RNG
    a64, b64, c64 = (x.astype(np.float64, copy=False) for x in (a, b, c))
    u = float(np.finfo(c.dtype).eps) / 2
    row_norms = np.linalg.norm(a64, axis=1)
    for _ in range(vectors):
        r = rng.choice(np.array([-1.0, 1.0]), size=c.shape[1])
        br = b64 @ r
        residual = np.abs(a64 @ br - c64 @ r)
        bound = tau * u * row_norms * np.linalg.norm(br) + np.finfo(np.float64).tiny
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
