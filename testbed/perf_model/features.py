"""GEMM features and the exported time model; numpy only (the device agent imports this).

Shapes are C[m x n] = A[m x k] @ B[k x n]. Symbols, once:

=============  =============================================================================
flops          2 m k n  (one multiply and one add per term)
bytes          s (m k + k n + m n), s = bytes per element of the dtype (operands read, C written)
intensity      flops / bytes  (arithmetic intensity, FLOP per byte)
t_roof         max(flops / P, bytes / W), P = peak FLOP/s, W = memory bandwidth in byte/s
               (the roofline time; Williams, Waterman, Patterson, CACM 52(4), 2009)
pad_x          ceil(x / 16) * 16 / x - 1: share of a 16-wide SIMD/register block wasted at the
               tile's edge in dimension x (0 when x is a multiple of 16)
inv_x          16 / x: costs paid once per row/column block, amortized over the dimension
=============  =============================================================================

:class:`ExportedTimeModel` is what a profile stores and an emulated device evaluates::

    t(m, k, n) = overhead_s + exp(intercept + sum_j coef_j * phi_j(m, k, n))

with ``phi`` named features from :data:`FEATURES`. Evaluating it is a few dozen float
operations (microseconds in Python), so 500 emulated devices can afford it on every tile.
Noise is a table of quantiles of log(measured / predicted); :meth:`sample_factor` draws from it
by inverse-CDF interpolation.

A second form, ``cost``, is a blocked-BLAS cost model (:data:`COST_FEATURES`)::

    t(m, k, n) = sum_j coef_j * psi_j(m, k, n)          coef_j >= 0, seconds per unit of psi_j

numpy's row-major ``A @ B`` reaches OpenBLAS as the column-major product C^T = B^T A^T, so the
micro-kernel's long side (``unroll_n``, 16 floats for sgemm on AVX-512) runs along n and its
short side (``unroll_m``, 4) along m. The terms, each once per regime:

=============  =============================================================================
one            per-call overhead (argument checks, buffer set-up)
kernel_w       k * (n-blocks of width w) * mb: micro-kernel calls; w = unroll_n for the full
               blocks, then unroll_n/2, /4, ... for the edge pieces OpenBLAS cuts n mod
               unroll_n into (one piece per set bit), mb = floor(m / unroll_m) + popcount(m mod
               unroll_m) (the same along m)
pack_km        k m: packing A's panel (read once per call)
pack_kn        k n: packing B's panel
write_mn       m n: updating C
write_mn_kb    m n ceil(k / k_block): C is read and written once per k block
kblocks        ceil(k / k_block): per-k-block loop overhead
pack_kn_far    k n when the operands (s (mk + kn + mn) bytes) exceed ``cache_bytes`` (the core's
               L2): B is then packed from L3
=============  =============================================================================

Regimes: ``small`` when m k n <= ``small_mnk`` (OpenBLAS's small-matrix kernels, which do not
pack), ``packed`` otherwise; a term of the other regime is 0.

A third form, ``rate``, is the overhead-plus-rate family the phone and laptop profiles use
(:data:`RATE_FEATURES`, see :class:`testbed.perf_model.estimators.OverheadRateRegressor`)::

    t(m, k, n) = overhead_s + 2 m k n / R(m, k, n)
    R(m, k, n) = peak_flops / (1 + half_m / m + half_k / k + half_n / n)

``half_x`` >= 0 is the length of dimension x at which that dimension alone halves the rate (its
edge and packing costs equal the kernel's). R rises monotonically in every dimension and never
exceeds ``peak_flops``; with every ``half_x`` = 0 it is the constant-rate-plus-overhead baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

EDGE = 16
# The largest m, k or n a time model is evaluated at (`testbed perf predict` refuses more): 2^20,
# far above any tile; the profile schema bounds a log-linear model's exponent over shapes up to it
MAX_DIMENSION = 1 << 20

COST_TERMS: tuple[str, ...] = ("one", "kernel_full", "kernel_half", "kernel_quarter",
                               "kernel_eighth", "kernel_sixteenth", "pack_km", "pack_kn",
                               "write_mn", "write_mn_kb", "kblocks", "pack_kn_far")
REGIMES: tuple[str, ...] = ("small", "packed")
COST_FEATURES: tuple[str, ...] = tuple(f"{r}:{t}" for r in REGIMES for t in COST_TERMS)
# Chosen on this host's data (OpenBLAS 0.3.31, SkylakeX kernels; see docs/perf-models.md): a 16x4
# micro-kernel fitted best of 4..64 x 2..16; the rate breaks at m*n*k = 1e6 (small-matrix path);
# k blocks of 448 fitted marginally best of 256..640; 2 MiB L2 per core (lscpu)
DEFAULT_BLAS: dict[str, float] = {"unroll_n": 16, "unroll_m": 4, "k_block": 448,
                                  "small_mnk": 1e6, "cache_bytes": 2 * 1024 * 1024}


RATE_FEATURES: tuple[str, ...] = ("half_m", "half_k", "half_n")


def rate_flops(shapes: np.ndarray, peak_flops: float, half: Sequence[float]) -> np.ndarray:
    """R(m, k, n) of the ``rate`` form for an (N, 3) array of (m, k, n), in FLOP/s."""
    shapes = np.asarray(shapes, dtype=np.float64).reshape(-1, 3)
    return peak_flops / (1.0 + half[0] / shapes[:, 0] + half[1] / shapes[:, 1]
                         + half[2] / shapes[:, 2])


def _log2(x: np.ndarray) -> np.ndarray:
    return np.log2(np.maximum(x, 1.0))


def _pad(x: np.ndarray) -> np.ndarray:
    return np.ceil(x / EDGE) * EDGE / x - 1.0


def base_columns(shapes: np.ndarray, peak_flops: float, bandwidth_bytes_s: float,
                 dtype_bytes: int = 4) -> dict[str, np.ndarray]:
    """Every named feature for an (N, 3) array of (m, k, n); see the module docstring."""
    shapes = np.asarray(shapes, dtype=np.float64).reshape(-1, 3)
    m, k, n = shapes[:, 0], shapes[:, 1], shapes[:, 2]
    flops = 2.0 * m * k * n
    size_bytes = dtype_bytes * (m * k + k * n + m * n)
    t_roof = np.maximum(flops / peak_flops, size_bytes / bandwidth_bytes_s)
    lm, lk, ln = _log2(m), _log2(k), _log2(n)
    cols = {
        "log2_m": lm, "log2_k": lk, "log2_n": ln,
        "log2_m^2": lm * lm, "log2_k^2": lk * lk, "log2_n^2": ln * ln,
        "log2_m*log2_k": lm * lk, "log2_m*log2_n": lm * ln, "log2_k*log2_n": lk * ln,
        "log2_flops": np.log2(flops), "log2_bytes": np.log2(size_bytes),
        "log2_intensity": np.log2(flops / size_bytes),
        "log_t_roof": np.log(t_roof),
        "pad_m": _pad(m), "pad_n": _pad(n), "pad_k": _pad(k),
        "inv_m": EDGE / m, "inv_n": EDGE / n, "inv_k": EDGE / k,
    }
    return cols


def _scalar_columns(m: float, k: float, n: float, peak_flops: float, bandwidth_bytes_s: float,
                    dtype_bytes: int) -> dict[str, float]:
    """base_columns for one shape with plain floats (the per-tile path of emulated devices)."""
    flops = 2.0 * m * k * n
    size_bytes = dtype_bytes * (m * k + k * n + m * n)
    lm, lk, ln = math.log2(max(m, 1.0)), math.log2(max(k, 1.0)), math.log2(max(n, 1.0))
    return {
        "log2_m": lm, "log2_k": lk, "log2_n": ln,
        "log2_m^2": lm * lm, "log2_k^2": lk * lk, "log2_n^2": ln * ln,
        "log2_m*log2_k": lm * lk, "log2_m*log2_n": lm * ln, "log2_k*log2_n": lk * ln,
        "log2_flops": math.log2(flops), "log2_bytes": math.log2(size_bytes),
        "log2_intensity": math.log2(flops / size_bytes),
        "log_t_roof": math.log(max(flops / peak_flops, size_bytes / bandwidth_bytes_s)),
        "pad_m": math.ceil(m / EDGE) * EDGE / m - 1.0,
        "pad_n": math.ceil(n / EDGE) * EDGE / n - 1.0,
        "pad_k": math.ceil(k / EDGE) * EDGE / k - 1.0,
        "inv_m": EDGE / m, "inv_n": EDGE / n, "inv_k": EDGE / k,
    }


FEATURES: tuple[str, ...] = ("log2_m", "log2_k", "log2_n", "log2_m^2", "log2_k^2", "log2_n^2",
                             "log2_m*log2_k", "log2_m*log2_n", "log2_k*log2_n", "log2_flops",
                             "log2_bytes", "log2_intensity", "log_t_roof", "pad_m", "pad_n",
                             "pad_k", "inv_m", "inv_n", "inv_k")


def _edge_pieces(x: float, unroll: int) -> list[float]:
    """Full blocks of width ``unroll`` in x, then one flag per edge piece (widths unroll/2, ...)."""
    full, rest = divmod(int(x), unroll)
    pieces = [float(full)]
    width = unroll // 2
    for _ in range(4):  # half, quarter, eighth, sixteenth
        pieces.append(1.0 if width >= 1 and rest & width else 0.0)
        width //= 2
    return pieces


def cost_terms(m: float, k: float, n: float, blas: dict[str, float],
               dtype_bytes: int = 4) -> dict[str, float]:
    """Every :data:`COST_FEATURES` term of one shape (plain floats; see the module docstring)."""
    unroll_m = int(blas["unroll_m"])
    rest_m = int(m) % unroll_m
    mb = float(int(m) // unroll_m + bin(rest_m).count("1"))
    kb = float(math.ceil(k / blas["k_block"]))
    nbytes = dtype_bytes * (m * k + k * n + m * n)
    kernel = [k * p * mb for p in _edge_pieces(n, int(blas["unroll_n"]))]
    values = [1.0, *kernel, k * m, k * n, m * n, m * n * kb, kb,
              k * n if nbytes > blas["cache_bytes"] else 0.0]
    regime = "small" if m * k * n <= blas["small_mnk"] else "packed"
    out = dict.fromkeys(COST_FEATURES, 0.0)
    out.update({f"{regime}:{t}": v for t, v in zip(COST_TERMS, values)})
    return out


def cost_matrix(shapes: np.ndarray, names: Sequence[str], blas: dict[str, float],
                dtype_bytes: int = 4) -> np.ndarray:
    """The (N, len(names)) matrix of cost terms for an (N, 3) array of (m, k, n)."""
    unknown = [name for name in names if name not in COST_FEATURES]
    if unknown:
        raise ValueError(f"unknown cost term(s) {', '.join(unknown)}; known: "
                         f"{', '.join(COST_FEATURES)}")
    shapes = np.asarray(shapes, dtype=np.float64).reshape(-1, 3)
    rows = [cost_terms(m, k, n, blas, dtype_bytes) for m, k, n in shapes]
    return np.array([[row[name] for name in names] for row in rows]).reshape(len(rows),
                                                                             len(names))


def feature_matrix(shapes: np.ndarray, names: Sequence[str], peak_flops: float,
                   bandwidth_bytes_s: float, dtype_bytes: int = 4) -> np.ndarray:
    """The (N, len(names)) feature matrix for the named features."""
    cols = base_columns(shapes, peak_flops, bandwidth_bytes_s, dtype_bytes)
    unknown = [name for name in names if name not in cols]
    if unknown:
        raise ValueError(f"unknown feature(s) {', '.join(unknown)}; known: {', '.join(cols)}")
    return np.column_stack([cols[name] for name in names]) if names else \
        np.zeros((len(cols["log2_m"]), 0))


def roofline_seconds(shapes: np.ndarray, peak_flops: float, bandwidth_bytes_s: float,
                     dtype_bytes: int = 4) -> np.ndarray:
    """t_roof = max(flops / P, bytes / W) for each shape (the pure roofline model)."""
    return np.exp(base_columns(shapes, peak_flops, bandwidth_bytes_s, dtype_bytes)["log_t_roof"])


@dataclass(frozen=True)
class ExportedTimeModel:
    """A GEMM time model plus noise quantiles of log error, in one of two forms.

    ``log-linear``: t = overhead_s + exp(intercept + coef . phi(m, k, n)) (features of
    :data:`FEATURES`); ``cost``: t = coef . psi(m, k, n) (terms of :data:`COST_FEATURES`, with the
    BLAS constants in ``blas``; intercept and overhead_s unused by the formula).
    """

    features: tuple[str, ...]
    coef: tuple[float, ...]
    intercept: float
    overhead_s: float
    peak_flops: float
    bandwidth_bytes_s: float
    dtype_bytes: int = 4
    noise_levels: tuple[float, ...] = ()
    noise_log_quantiles: tuple[float, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    form: str = "log-linear"
    blas: dict[str, float] = field(default_factory=dict)

    def predict_seconds(self, shapes: np.ndarray) -> np.ndarray:
        """Predicted seconds for an (N, 3) array of (m, k, n)."""
        if self.form == "cost":
            return cost_matrix(shapes, self.features, self.blas, self.dtype_bytes) @ \
                np.asarray(self.coef)
        if self.form == "rate":
            shapes = np.asarray(shapes, dtype=np.float64).reshape(-1, 3)
            return self.overhead_s + 2.0 * shapes.prod(axis=1) / rate_flops(
                shapes, self.peak_flops, self.coef)
        phi = feature_matrix(shapes, self.features, self.peak_flops, self.bandwidth_bytes_s,
                             self.dtype_bytes)
        return self.overhead_s + np.exp(self.intercept + phi @ np.asarray(self.coef))

    def predict_one(self, m: int, k: int, n: int) -> float:
        """Predicted seconds of one tile (scalar path: a few microseconds, no arrays)."""
        if self.form == "cost":
            terms = cost_terms(float(m), float(k), float(n), self.blas, self.dtype_bytes)
            return sum(c * terms[name] for name, c in zip(self.features, self.coef))
        if self.form == "rate":
            h_m, h_k, h_n = self.coef
            return self.overhead_s + 2.0 * m * k * n * (1.0 + h_m / m + h_k / k + h_n / n) \
                / self.peak_flops
        cols = _scalar_columns(float(m), float(k), float(n), self.peak_flops,
                               self.bandwidth_bytes_s, self.dtype_bytes)
        z = self.intercept
        for name, c in zip(self.features, self.coef):
            z += c * cols[name]
        return self.overhead_s + math.exp(z)

    def sample_factor(self, rng: Any) -> float:  # rng: anything with uniform(a, b)
        """A multiplicative noise factor exp(q), q drawn from the stored quantiles (1 if none)."""
        if not self.noise_levels:
            return 1.0
        u = float(rng.uniform(self.noise_levels[0], self.noise_levels[-1]))
        return math.exp(float(np.interp(u, self.noise_levels, self.noise_log_quantiles)))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the profile YAML."""
        formula = {"cost": "t = sum(coef[j] * term[j](m, k, n))",
                   "rate": "t = overhead_s + 2mkn (1 + half_m/m + half_k/k + half_n/n) / "
                           "peak_flops  (coef = half_m, half_k, half_n)"}.get(
            self.form, "t = overhead_s + exp(intercept + sum(coef[j] * feature[j](m, k, n)))")
        out: dict[str, Any] = {
            "form": self.form, "formula": formula,
            "features": list(self.features), "coef": [float(c) for c in self.coef],
            "intercept": float(self.intercept), "overhead_s": float(self.overhead_s),
            "peak_flops": float(self.peak_flops),
            "bandwidth_bytes_s": float(self.bandwidth_bytes_s),
            "dtype_bytes": int(self.dtype_bytes),
            "noise": {"levels": [float(x) for x in self.noise_levels],
                      "log_quantiles": [float(x) for x in self.noise_log_quantiles]},
        }
        if self.form == "cost":
            out["blas"] = {k: float(v) for k, v in self.blas.items()}
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "model") -> "ExportedTimeModel":
        """Read the plain data a profile stores; ValueError naming the field on a problem."""
        def need(key: str, check: Callable[[Any], bool], expected: str) -> Any:
            if key not in data or not check(data[key]):
                raise ValueError(f"{where}.{key}: expected {expected}, got {data.get(key)!r}")
            return data[key]

        def is_num(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        form = data.get("form", "log-linear")
        if form not in ("log-linear", "cost", "rate"):  # old profiles wrote a formula here
            form = "log-linear" if str(form).startswith("t = overhead_s") else form
        if form not in ("log-linear", "cost", "rate"):
            raise ValueError(f"{where}.form: expected 'log-linear', 'cost' or 'rate', "
                             f"got {form!r}")
        features = tuple(need("features", lambda v: isinstance(v, list), "a list of names"))
        coef = tuple(need("coef", lambda v: isinstance(v, list) and len(v) == len(features)
                          and all(is_num(c) for c in v),
                          f"a list of {len(features)} numbers (one per feature)"))
        known = {"cost": COST_FEATURES, "rate": RATE_FEATURES}.get(form, FEATURES)
        unknown = [f for f in features if f not in known]
        if unknown:
            raise ValueError(f"{where}.features: unknown {form} feature(s) {', '.join(unknown)}")
        if form == "rate" and (features != RATE_FEATURES or any(c < 0 for c in coef)):
            raise ValueError(f"{where}.coef: the rate form needs features "
                             f"{', '.join(RATE_FEATURES)} with lengths >= 0 (a negative length "
                             f"would let the rate exceed peak_flops)")
        blas: dict[str, float] = {}
        if form == "cost":
            given = data.get("blas")
            if not isinstance(given, dict) or set(given) != set(DEFAULT_BLAS) or not all(
                    is_num(v) and v > 0 for v in given.values()):
                raise ValueError(f"{where}.blas: expected positive numbers for exactly "
                                 f"{', '.join(DEFAULT_BLAS)}, got {given!r}")
            blas = {k: float(v) for k, v in given.items()}
        noise = data.get("noise") or {}
        levels = tuple(float(x) for x in noise.get("levels", []))
        quantiles = tuple(float(x) for x in noise.get("log_quantiles", []))
        if len(levels) != len(quantiles) or list(levels) != sorted(levels):
            raise ValueError(f"{where}.noise: levels must be sorted and as many as log_quantiles")
        return cls(features=features, coef=tuple(float(c) for c in coef),
                   intercept=float(need("intercept", is_num, "a number")),
                   overhead_s=float(need("overhead_s", lambda v: is_num(v) and v >= 0,
                                         "a number >= 0")),
                   peak_flops=float(need("peak_flops", lambda v: is_num(v) and v > 0,
                                         "a positive number")),
                   bandwidth_bytes_s=float(need("bandwidth_bytes_s",
                                                lambda v: is_num(v) and v > 0,
                                                "a positive number")),
                   dtype_bytes=int(data.get("dtype_bytes", 4)), noise_levels=levels,
                   noise_log_quantiles=quantiles, form=form, blas=blas)
