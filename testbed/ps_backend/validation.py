"""Checks on a returned tile, before the PS trusts it.

Boundary checks (cheap, always): the result is 2-D with the tile's shape, has the job's dtype,
and every value is finite.

Value check (Freivalds, 1977): for a random ±1 vector r a correct ``C = A·B`` satisfies
``A·(B·r) = C·r``. That costs ``2(mk + kn + mn)`` FLOPs against the tile's ``2mkn`` (under 1% for
tiles of 128 and more). The check is computed in float64 whatever the tile's dtype, so the only
rounding that matters is the device's own in C. Its tolerance is norm-wise: row i passes when

    |(A·(B·r))_i - (C·r)_i|  <=  TAU · u · ||a_i||₂ · max(||B||_F, ||B·r||₂)

with u the unit roundoff of C's dtype (2⁻²⁴ for float32, 2⁻⁵³ for float64). The device's rounding
errors δ_ij in C are about u·||a_i||·||b_j|| each with no sign pattern tied to r, so
``|Σ_j δ_ij r_j|`` is about u·||a_i||·sqrt(Σ_j ||b_j||²) = u·||a_i||·||B||_F. (An earlier
version used ``||B·r||`` alone, which is the same on average but collapses when B's columns
cancel under r, e.g. correlated activations in a weight gradient, and then refused an honest
tile.) On honest tiles (random operands, both signs and same-sign, scales 0.01–100, k from 8 to
3072) the left side stayed below 5·u·||a_i||·||B||_F; TAU = 64 leaves more than 10x headroom
(tests/unit/test_validation.py and test_behaviour_validation.py check honest tiles, columns that
cancel, and corruptions). A relative error ε spread over C moves the residual by about ε/(u·√k)
units, so
errors larger than ~TAU·u·√k relative are caught (about 1e-4 for float32 at k = 1024); bit flips
in the sign or exponent always are, flips in the lowest mantissa bits are below any tolerance.

**Sharing work between the tiles of one GEMM** (:class:`GemmCheck`, what the scheduler uses).
The PS draws the ±1 vectors once per column block j of C (they never leave the PS, so a device
cannot aim at them). At the GEMM's first checked tile it computes, in float64, every
``B_j·r_j`` side by side (a K x J matrix, one pass over B), ``A·[B_1 r_1 ... B_J r_J]`` (one
M x K x J product, one pass over A), the ``||B_j||_F`` and the row norms of A. A tile (i, j) then
costs only ``C_ij·r_j`` (m·n multiply-adds, as much as decoding it) and a comparison. Over a GEMM
that is about 1/tile_n of the GEMM's FLOPs, in a few passes over A and B. :func:`freivalds_ok`
is the one-tile version.
"""

from __future__ import annotations

import numpy as np

TAU = 64.0
_RNG = np.random.default_rng(20240601)
_TINY = float(np.finfo(np.float64).tiny)


def _unit_roundoff(dtype: np.dtype) -> float:
    return float(np.finfo(dtype).eps) / 2


def _signs(rng: np.random.Generator, n: int, vectors: int) -> np.ndarray:
    """An n x vectors matrix of random ±1 (float64)."""
    return rng.integers(0, 2, size=(n, vectors)).astype(np.float64) * 2.0 - 1.0


def _column_bound(b64: np.ndarray, br: np.ndarray) -> np.ndarray:
    """max(||B||_F, ||B·r||) per vector."""
    frobenius = np.sqrt(np.einsum("ij,ij->", b64, b64))
    return np.maximum(np.sqrt(np.einsum("ij,ij->j", br, br)), frobenius)


def freivalds_ok(a: np.ndarray, b: np.ndarray, c: np.ndarray, vectors: int = 1,
                 rng: np.random.Generator | None = None, tau: float = TAU) -> bool:
    """Whether C passes Freivalds' check against A·B with `vectors` random ±1 vectors."""
    rng = rng or _RNG
    a64, b64, c64 = (x.astype(np.float64, copy=False) for x in (a, b, c))
    scale = tau * _unit_roundoff(c.dtype) * np.sqrt(np.einsum("ij,ij->i", a64, a64))
    r = _signs(rng, c.shape[1], vectors)
    br = b64 @ r
    residual = np.abs(a64 @ br - c64 @ r)
    bound = scale[:, None] * _column_bound(b64, br)[None, :] + _TINY
    return bool((residual <= bound).all())


class GemmCheck:
    """Freivalds' check for the tiles of one GEMM C = A·B, sharing work between tiles."""

    def __init__(self, a: np.ndarray, b: np.ndarray, columns: list[tuple[int, int]],
                 vectors: int = 1, rng: np.random.Generator | None = None, tau: float = TAU):
        self.a = a
        self.b = b
        self.columns = {box: j for j, box in enumerate(sorted(set(columns)))}
        self.vectors = vectors
        self.rng = rng or _RNG
        self.tau = tau
        self._ready = False

    def _prepare(self) -> None:
        v = self.vectors
        k, blocks = self.b.shape[0], len(self.columns)
        self.r: dict[int, np.ndarray] = {}
        br = np.empty((k, blocks * v))
        self.column_bound = np.empty(blocks * v)
        for (c0, c1), j in self.columns.items():
            b64 = np.asarray(self.b[:, c0:c1], dtype=np.float64)
            r = self.r[j] = _signs(self.rng, c1 - c0, v)
            br[:, j * v:(j + 1) * v] = b64 @ r
            self.column_bound[j * v:(j + 1) * v] = _column_bound(b64, br[:, j * v:(j + 1) * v])
        a64 = np.asarray(self.a, dtype=np.float64)
        self.abr = a64 @ br
        self.row_scale = self.tau * _unit_roundoff(self.a.dtype) * np.sqrt(
            np.einsum("ij,ij->i", a64, a64))
        self._ready = True

    def tile_ok(self, r0: int, r1: int, c0: int, c1: int, c: np.ndarray) -> bool:
        """Whether C's tile [r0:r1, c0:c1] passes (shape and dtype already checked)."""
        if not self._ready:
            self._prepare()
        j = self.columns[(c0, c1)]
        v = self.vectors
        residual = np.abs(self.abr[r0:r1, j * v:(j + 1) * v] - c @ self.r[j])
        bound = np.multiply.outer(self.row_scale[r0:r1], self.column_bound[j * v:(j + 1) * v])
        return bool((residual <= bound + _TINY).all())


def check_result(a: np.ndarray, b: np.ndarray, c: np.ndarray, check_values: bool = True,
                 vectors: int = 1, gemm: GemmCheck | None = None,
                 box: tuple[int, int, int, int] | None = None) -> str | None:
    """None if C is an acceptable result for A·B, else why not.

    With ``gemm`` and ``box`` (r0, r1, c0, c1) the value check uses the GEMM's shared work;
    ``a`` and ``b`` are then the tile's blocks (for the shape and dtype checks).
    """
    expected = (a.shape[0], b.shape[1])
    if c.shape != expected:
        return f"wrong shape {tuple(c.shape)}, expected {expected}"
    if c.dtype != a.dtype:
        return f"wrong dtype {c.dtype}, expected {a.dtype}"
    if not np.isfinite(c).all():
        return "result has non-finite values (NaN or Inf)"
    if check_values:
        ok = gemm.tile_ok(*box, c) if gemm is not None and box is not None else \
            freivalds_ok(a, b, c, vectors)
        if not ok:
            return "result fails the Freivalds check (C·r differs from A·(B·r))"
    return None
