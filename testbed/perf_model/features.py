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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

EDGE = 16


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
    """t = overhead_s + exp(intercept + coef . phi(m, k, n)), plus noise quantiles of log error."""

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

    def predict_seconds(self, shapes: np.ndarray) -> np.ndarray:
        """Predicted seconds for an (N, 3) array of (m, k, n)."""
        phi = feature_matrix(shapes, self.features, self.peak_flops, self.bandwidth_bytes_s,
                             self.dtype_bytes)
        return self.overhead_s + np.exp(self.intercept + phi @ np.asarray(self.coef))

    def predict_one(self, m: int, k: int, n: int) -> float:
        """Predicted seconds of one tile (scalar path: a few microseconds, no arrays)."""
        cols = _scalar_columns(float(m), float(k), float(n), self.peak_flops,
                               self.bandwidth_bytes_s, self.dtype_bytes)
        z = self.intercept
        for name, c in zip(self.features, self.coef):
            z += c * cols[name]
        return self.overhead_s + math.exp(z)

    def sample_factor(self, rng: np.random.Generator) -> float:
        """A multiplicative noise factor exp(q), q drawn from the stored quantiles (1 if none)."""
        if not self.noise_levels:
            return 1.0
        u = float(rng.uniform(self.noise_levels[0], self.noise_levels[-1]))
        return math.exp(float(np.interp(u, self.noise_levels, self.noise_log_quantiles)))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the profile YAML."""
        out: dict[str, Any] = {
            "form": "t = overhead_s + exp(intercept + sum(coef[j] * feature[j](m, k, n)))",
            "features": list(self.features), "coef": [float(c) for c in self.coef],
            "intercept": float(self.intercept), "overhead_s": float(self.overhead_s),
            "peak_flops": float(self.peak_flops),
            "bandwidth_bytes_s": float(self.bandwidth_bytes_s),
            "dtype_bytes": int(self.dtype_bytes),
            "noise": {"levels": [float(x) for x in self.noise_levels],
                      "log_quantiles": [float(x) for x in self.noise_log_quantiles]},
        }
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

        features = tuple(need("features", lambda v: isinstance(v, list), "a list of names"))
        coef = tuple(need("coef", lambda v: isinstance(v, list) and len(v) == len(features)
                          and all(is_num(c) for c in v),
                          f"a list of {len(features)} numbers (one per feature)"))
        unknown = [f for f in features if f not in FEATURES]
        if unknown:
            raise ValueError(f"{where}.features: unknown feature(s) {', '.join(unknown)}")
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
                   noise_log_quantiles=quantiles)
