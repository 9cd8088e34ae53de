"""scikit-learn estimators for GEMM tile time (fit here; emulated devices evaluate the export).

All follow the scikit-learn contract: ``__init__`` only stores its parameters, ``fit(X, y)``
learns and returns ``self``, learned state ends in ``_``. ``X`` is an (N, 3) array of
(m, k, n) for C[m x n] = A[m x k] @ B[k x n]; ``y`` is seconds. :meth:`export` turns a fitted
estimator into a :class:`~testbed.perf_model.features.ExportedTimeModel`, which needs numpy only.

:class:`GemmTimeRegressor`
    ridge regression of log(t - o) on the named features of :mod:`features`, o a fixed per-call
    overhead chosen by cross-validation among fractions of the smallest measured time. Noise:
    quantiles of the out-of-fold log residuals.
:class:`BlasCostRegressor`
    the blocked-BLAS cost model of :mod:`features` (form ``cost``): non-negative seconds per
    micro-kernel call, per packed element, per C element and per call, in two regimes (small-
    matrix path / packed path), fitted by non-negative least squares on *relative* error
    (rows weighted by 1 / t). Noise: quantiles of the out-of-fold log residuals.
:class:`RooflineRegressor`
    the pure roofline t = max(flops / P, bytes / W); P defaults to the best measured FLOP rate.
:class:`ShapeEfficiencyRegressor`
    for devices without per-shape data: log e = b0 + b . (log2 m, log2 k, log2 n), where
    e = achieved rate / the device's best achieved rate, pooled over measured devices.
"""

from __future__ import annotations

from typing import overload

import numpy as np
from scipy.optimize import nnls
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.linear_model import Ridge
from sklearn.model_selection import KFold

from testbed.perf_model.features import (
    COST_FEATURES,
    DEFAULT_BLAS,
    FEATURES,
    RATE_FEATURES,
    ExportedTimeModel,
    cost_matrix,
    feature_matrix,
    rate_flops,
    roofline_seconds,
)

NOISE_LEVELS = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
EFFICIENCY_FEATURES = ("log2_m", "log2_k", "log2_n")


@overload
def _check_xy(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


@overload
def _check_xy(X: np.ndarray, y: None = None) -> tuple[np.ndarray, None]: ...


def _check_xy(X: np.ndarray, y: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[1] != 3 or (X < 1).any():
        raise ValueError(f"X must be an (N, 3) array of positive (m, k, n), got shape {X.shape}")
    if y is None:
        return X, None
    y = np.asarray(y, dtype=np.float64).ravel()
    if len(y) != len(X) or (y <= 0).any() or not np.isfinite(y).all():
        raise ValueError("y must hold one positive, finite time in seconds per row of X")
    return X, y


def best_rate_flops(X: np.ndarray, y: np.ndarray) -> float:
    """The highest achieved FLOP rate 2mkn / t over the rows."""
    return float(np.max(2.0 * X.prod(axis=1) / y))


class GemmTimeRegressor(RegressorMixin, BaseEstimator):
    """Ridge on engineered GEMM features predicting log time; exports to numpy coefficients."""

    def __init__(self, features: tuple[str, ...] = FEATURES, alpha: float = 1e-3,
                 overhead_fractions: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75),
                 peak_flops: float | None = None, bandwidth_bytes_s: float = 20e9,
                 dtype_bytes: int = 4, n_splits: int = 5, random_state: int = 0) -> None:
        self.features = features
        self.alpha = alpha
        self.overhead_fractions = overhead_fractions
        self.peak_flops = peak_flops
        self.bandwidth_bytes_s = bandwidth_bytes_s
        self.dtype_bytes = dtype_bytes
        self.n_splits = n_splits
        self.random_state = random_state

    def _design(self, X: np.ndarray, peak: float) -> np.ndarray:
        return feature_matrix(X, self.features, peak, self.bandwidth_bytes_s, self.dtype_bytes)

    def _fit_log(self, phi: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, float]:
        mean, scale = phi.mean(axis=0), phi.std(axis=0)
        scale[scale == 0] = 1.0
        ridge = Ridge(alpha=self.alpha).fit((phi - mean) / scale, z)
        coef = ridge.coef_ / scale
        return coef, float(ridge.intercept_ - coef @ mean)

    def _oof_log_residuals(self, phi: np.ndarray, y: np.ndarray, overhead_s: float) -> np.ndarray:
        splits = min(self.n_splits, len(y))
        residuals = np.empty(len(y))
        folds = KFold(splits, shuffle=True, random_state=self.random_state).split(phi)
        for train, test in folds:
            coef, b = self._fit_log(phi[train], np.log(y[train] - overhead_s))
            residuals[test] = np.log(y[test]) - np.log(overhead_s + np.exp(b + phi[test] @ coef))
        return residuals

    def fit(self, X: np.ndarray, y: np.ndarray) -> "GemmTimeRegressor":
        """Learn coefficients, the per-call overhead and the noise quantiles; return self."""
        X, y = _check_xy(X, y)
        if len(y) < len(self.features) + 2:
            raise ValueError(f"need at least {len(self.features) + 2} measurements to fit "
                             f"{len(self.features)} features, got {len(y)}")
        self.peak_flops_ = float(self.peak_flops or best_rate_flops(X, y))
        phi = self._design(X, self.peak_flops_)
        best = None
        for fraction in self.overhead_fractions:
            overhead_s = fraction * float(y.min())
            residuals = self._oof_log_residuals(phi, y, overhead_s)
            score = float(np.sqrt(np.mean(residuals ** 2)))
            if best is None or score < best[0]:
                best = (score, overhead_s, residuals)
        assert best is not None
        self.cv_log_rmse_, self.overhead_s_, residuals = best
        self.coef_, self.intercept_ = self._fit_log(phi, np.log(y - self.overhead_s_))
        self.noise_log_quantiles_ = np.quantile(residuals, NOISE_LEVELS)
        self.n_features_in_ = 3
        return self

    def export(self) -> ExportedTimeModel:
        """The fitted model as numpy-evaluable coefficients."""
        return ExportedTimeModel(features=tuple(self.features), coef=tuple(self.coef_),
                                 intercept=self.intercept_, overhead_s=self.overhead_s_,
                                 peak_flops=self.peak_flops_,
                                 bandwidth_bytes_s=self.bandwidth_bytes_s,
                                 dtype_bytes=self.dtype_bytes, noise_levels=NOISE_LEVELS,
                                 noise_log_quantiles=tuple(self.noise_log_quantiles_))

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Predicted seconds per row of X (mean model, no noise)."""
        X, _ = _check_xy(X)
        return self.export().predict_seconds(X)


def _nnls_relative(psi: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_{c >= 0} sum(((psi c - y) / y)^2), columns scaled for conditioning."""
    scale = np.abs(psi).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(psi / scale / y[:, None], np.ones_like(y))
    return coef / scale


class BlasCostRegressor(RegressorMixin, BaseEstimator):
    """t = c . psi(m, k, n), c >= 0: a blocked-BLAS cost model fitted on relative error."""

    def __init__(self, unroll_n: int = int(DEFAULT_BLAS["unroll_n"]),
                 unroll_m: int = int(DEFAULT_BLAS["unroll_m"]),
                 k_block: int = int(DEFAULT_BLAS["k_block"]),
                 small_mnk: float = DEFAULT_BLAS["small_mnk"],
                 cache_bytes: float = DEFAULT_BLAS["cache_bytes"], dtype_bytes: int = 4,
                 n_splits: int = 5, random_state: int = 0) -> None:
        self.unroll_n = unroll_n
        self.unroll_m = unroll_m
        self.k_block = k_block
        self.small_mnk = small_mnk
        self.cache_bytes = cache_bytes
        self.dtype_bytes = dtype_bytes
        self.n_splits = n_splits
        self.random_state = random_state

    def _blas(self) -> dict[str, float]:
        return {"unroll_n": float(self.unroll_n), "unroll_m": float(self.unroll_m),
                "k_block": float(self.k_block), "small_mnk": float(self.small_mnk),
                "cache_bytes": float(self.cache_bytes)}

    def fit(self, X: np.ndarray, y: np.ndarray) -> "BlasCostRegressor":
        """Learn the non-negative costs and the noise quantiles; return self."""
        X, y = _check_xy(X, y)
        if len(y) < 10:
            raise ValueError(f"need at least 10 measurements to fit the cost model, got {len(y)}")
        self.blas_ = self._blas()
        psi = cost_matrix(X, COST_FEATURES, self.blas_, self.dtype_bytes)
        residuals = np.empty(len(y))
        folds = KFold(min(self.n_splits, len(y)), shuffle=True, random_state=self.random_state)
        for train, test in folds.split(psi):
            coef = _nnls_relative(psi[train], y[train])
            predicted = np.maximum(psi[test] @ coef, 1e-12)
            residuals[test] = np.log(y[test]) - np.log(predicted)
        self.cv_log_rmse_ = float(np.sqrt(np.mean(residuals ** 2)))
        self.coef_ = _nnls_relative(psi, y)
        self.noise_log_quantiles_ = np.quantile(residuals, NOISE_LEVELS)
        self.peak_flops_ = best_rate_flops(X, y)
        self.n_features_in_ = 3
        return self

    def export(self) -> ExportedTimeModel:
        """The fitted model as numpy-free coefficients (form ``cost``)."""
        return ExportedTimeModel(features=COST_FEATURES, coef=tuple(float(c) for c in self.coef_),
                                 intercept=0.0,
                                 overhead_s=float(self.coef_[COST_FEATURES.index("small:one")]),
                                 peak_flops=self.peak_flops_, bandwidth_bytes_s=20e9,
                                 dtype_bytes=self.dtype_bytes, noise_levels=NOISE_LEVELS,
                                 noise_log_quantiles=tuple(self.noise_log_quantiles_),
                                 form="cost", blas=dict(self.blas_))

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Predicted seconds per row of X (mean model, no noise)."""
        X, _ = _check_xy(X)
        return cost_matrix(X, COST_FEATURES, self.blas_, self.dtype_bytes) @ self.coef_


class RooflineRegressor(RegressorMixin, BaseEstimator):
    """t = max(flops / P, bytes / W): the pure roofline baseline."""

    def __init__(self, peak_flops: float | None = None, bandwidth_bytes_s: float = 20e9,
                 dtype_bytes: int = 4) -> None:
        self.peak_flops = peak_flops
        self.bandwidth_bytes_s = bandwidth_bytes_s
        self.dtype_bytes = dtype_bytes

    def fit(self, X: np.ndarray, y: np.ndarray) -> "RooflineRegressor":
        """Take P from the parameter, else the best measured FLOP rate; return self."""
        X, y = _check_xy(X, y)
        self.peak_flops_ = float(self.peak_flops or best_rate_flops(X, y))
        self.n_features_in_ = 3
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Roofline seconds per row of X."""
        X, _ = _check_xy(X)
        return roofline_seconds(X, self.peak_flops_, self.bandwidth_bytes_s, self.dtype_bytes)


class ShapeEfficiencyRegressor(BaseEstimator):
    """log e(m, k, n) = b0 + b . (log2 m, log2 k, log2 n), e = rate / the device's best rate.

    ``fit(X, y, groups)`` takes measured times of several devices; each device's rates are
    divided by its own best rate, so only the shape's effect is pooled, not the device speed.
    """

    def __init__(self, alpha: float = 1e-2) -> None:
        self.alpha = alpha

    def fit(self, X: np.ndarray, y: np.ndarray,
            groups: np.ndarray | None = None) -> "ShapeEfficiencyRegressor":
        """Learn the efficiency curve from per-device relative rates; return self."""
        X, y = _check_xy(X, y)
        groups = np.zeros(len(y)) if groups is None else np.asarray(groups)
        rate = 2.0 * X.prod(axis=1) / y
        efficiency = np.empty(len(y))
        for g in np.unique(groups):
            mask = groups == g
            efficiency[mask] = rate[mask] / rate[mask].max()
        phi = feature_matrix(X, EFFICIENCY_FEATURES, 1.0, 1.0)
        ridge = Ridge(alpha=self.alpha).fit(phi, np.log(efficiency))
        self.coef_, self.intercept_ = ridge.coef_.copy(), float(ridge.intercept_)
        self.n_features_in_ = 3
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Predicted efficiency e in (0, 1] (capped at 1) per row of X."""
        X, _ = _check_xy(X)
        phi = feature_matrix(X, EFFICIENCY_FEATURES, 1.0, 1.0)
        return np.minimum(1.0, np.exp(self.intercept_ + phi @ self.coef_))

    def time_model(self, sustained_flops: float, overhead_s: float,
                   noise_sigma: float = 0.05) -> ExportedTimeModel:
        """t = overhead_s + flops / (sustained_flops * e(m, k, n)) as an exported model.

        log(flops / (G e)) = ln 2 * log2_flops - ln G - b0 - b . phi, so the export is exact
        (without the cap at 1). Noise: a stated log-normal sigma, written as quantiles.
        """
        from statistics import NormalDist
        coef = (np.log(2.0),) + tuple(-self.coef_)
        quantiles = tuple(noise_sigma * NormalDist().inv_cdf(p) for p in NOISE_LEVELS)
        return ExportedTimeModel(features=("log2_flops",) + EFFICIENCY_FEATURES,
                                 coef=tuple(float(c) for c in coef),
                                 intercept=float(-np.log(sustained_flops) - self.intercept_),
                                 overhead_s=overhead_s, peak_flops=sustained_flops,
                                 bandwidth_bytes_s=50e9, noise_levels=NOISE_LEVELS,
                                 noise_log_quantiles=quantiles)


# --- the overhead-plus-rate family (form ``rate`` of ExportedTimeModel) -------------------------

#: candidate half-rate lengths (elements) searched for each of half_m, half_k, half_n
HALF_GRID: tuple[float, ...] = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)
#: without a measured peak, the rate is capped at this multiple of the best measured rate
CAP_OVER_BEST = 2.0


def _level_fit(X: np.ndarray, y: np.ndarray, halves: np.ndarray, cap_flops: float
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each row of ``halves`` (G, 3): the best (overhead_s, 1/peak) and its relative SSE.

    Minimizes sum(((o + c g_i - y_i) / y_i)^2) over o >= 0, c >= 1/cap_flops, where
    g_i = 2 m k n (1 + h_m/m + h_k/k + h_n/n), in closed form for all G candidates at once:
    the unconstrained 2x2 solution when feasible, else the best of the two boundaries.
    """
    m, k, n = X[:, 0], X[:, 1], X[:, 2]
    g = 2.0 * m * k * n * (1.0 + halves[:, :1] / m + halves[:, 1:2] / k + halves[:, 2:3] / n)
    a = 1.0 / y                      # overhead column, relative
    G = g / y                        # (G, N) rate column, relative
    c_min = 1.0 / cap_flops
    b = 1.0 - c_min * G              # target once the capped part is moved over
    saa = float(a @ a)
    sag, sgg = G @ a, (G * G).sum(axis=1)
    sab, sgb = b @ a, (G * b).sum(axis=1)
    det = saa * sgg - sag * sag
    with np.errstate(divide="ignore", invalid="ignore"):
        o_free = np.where(det > 0, (sgg * sab - sag * sgb) / det, -1.0)
        c_free = np.where(det > 0, (saa * sgb - sag * sab) / det, -1.0)
        c_edge = np.maximum(0.0, np.where(sgg > 0, sgb / sgg, 0.0))  # o = 0
    o_edge = np.maximum(0.0, sab / saa)  # c' = 0

    def sse(o: np.ndarray, c: np.ndarray) -> np.ndarray:
        r = o[:, None] * a + c[:, None] * G - b
        return (r * r).sum(axis=1)

    feasible = (o_free >= 0) & (c_free >= 0)
    candidates = [(np.where(feasible, o_free, 0.0), np.where(feasible, c_free, 0.0),
                   np.where(feasible, 0.0, np.inf)),
                  (np.zeros(len(G)), c_edge, 0.0), (o_edge, np.zeros(len(G)), 0.0)]
    best_o, best_c, best = np.zeros(len(G)), np.zeros(len(G)), np.full(len(G), np.inf)
    for o, c, penalty in candidates:
        o = np.broadcast_to(o, (len(G),))
        err = sse(o, c) + penalty
        better = err < best
        best_o, best_c, best = (np.where(better, o, best_o), np.where(better, c, best_c),
                                np.where(better, err, best))
    return best_o, best_c + c_min, best


def _grid() -> np.ndarray:
    h = np.asarray(HALF_GRID)
    return np.array(np.meshgrid(h, h, h, indexing="ij")).reshape(3, -1).T


def fit_halves(sets: list[tuple[np.ndarray, np.ndarray, float]]) -> tuple[float, float, float]:
    """The half-rate lengths shared by several devices' data, each with its own level.

    ``sets`` holds (X, y, cap_flops) per device; every set weighs the same (mean relative SSE).
    """
    grid = _grid()
    total = np.zeros(len(grid))
    for X, y, cap in sets:
        total += _level_fit(X, y, grid, cap)[2] / len(y)
    h = grid[int(np.argmin(total))]
    return float(h[0]), float(h[1]), float(h[2])


def _cap(X: np.ndarray, y: np.ndarray, peak_flops: float | None) -> float:
    return float(peak_flops or CAP_OVER_BEST * best_rate_flops(X, y))


def _export_rate(halves: tuple[float, float, float], overhead_s: float, peak_flops: float,
                 residuals: np.ndarray, extra: dict | None = None) -> ExportedTimeModel:
    # noise: the spread of held-out log(measured / predicted), centred so it adds no bias
    q = np.quantile(residuals, NOISE_LEVELS) if len(residuals) else np.zeros(len(NOISE_LEVELS))
    q = q - np.median(residuals) if len(residuals) else q
    return ExportedTimeModel(features=RATE_FEATURES, coef=tuple(float(h) for h in halves),
                             intercept=0.0, overhead_s=float(overhead_s),
                             peak_flops=float(peak_flops), bandwidth_bytes_s=50e9,
                             noise_levels=NOISE_LEVELS,
                             noise_log_quantiles=tuple(float(x) for x in q), form="rate",
                             extra=dict(extra or {}))


class OverheadRateRegressor(RegressorMixin, BaseEstimator):
    """t = o + 2mkn / R(m, k, n), R = P / (1 + h_m/m + h_k/k + h_n/n): monotone, capped rate.

    ``halves=None`` searches (h_m, h_k, h_n) on :data:`HALF_GRID` on this device's data; a
    given triple keeps the family's shape curve and fits only the level P and overhead o (that
    is calibration). ``constant=True`` is the constant-rate-plus-overhead baseline (h = 0).
    P never exceeds ``peak_flops`` (the device's measured peak), or without one
    :data:`CAP_OVER_BEST` times the best measured rate. Fitted on relative error, so a 10 us
    tile counts as much as a 1 s GEMM. Noise: quantiles of leave-one-out log residuals.
    """

    def __init__(self, halves: tuple[float, float, float] | None = None,
                 peak_flops: float | None = None, constant: bool = False) -> None:
        self.halves = halves
        self.peak_flops = peak_flops
        self.constant = constant

    def _halves_for(self, X: np.ndarray, y: np.ndarray, cap: float) -> tuple[float, float, float]:
        if self.constant:
            return (0.0, 0.0, 0.0)
        if self.halves is not None:
            return (float(self.halves[0]), float(self.halves[1]), float(self.halves[2]))
        return fit_halves([(X, y, cap)])

    def _fit_level(self, X: np.ndarray, y: np.ndarray, halves: tuple[float, float, float],
                   cap: float) -> tuple[float, float]:
        o, c, _ = _level_fit(X, y, np.asarray([halves]), cap)
        return float(o[0]), float(1.0 / c[0])

    def fit(self, X: np.ndarray, y: np.ndarray) -> "OverheadRateRegressor":
        """Learn the shape curve (unless given), level, overhead and noise; return self."""
        X, y = _check_xy(X, y)
        if len(y) < 3:
            raise ValueError(f"need at least 3 measured shapes (overhead, level and one to "
                             f"check them), got {len(y)}")
        cap = _cap(X, y, self.peak_flops)
        self.halves_ = self._halves_for(X, y, cap)
        self.overhead_s_, self.peak_flops_ = self._fit_level(X, y, self.halves_, cap)
        self.cap_flops_ = cap
        # leave-one-out: refit level (and the curve, when it is learned here) without row i
        residuals = np.empty(len(y))
        for i in range(len(y)):
            keep = np.arange(len(y)) != i
            halves = self.halves_ if len(y) > 12 or self.halves is not None or self.constant \
                else self._halves_for(X[keep], y[keep], cap)
            o, p = self._fit_level(X[keep], y[keep], halves, cap)
            predicted = o + 2.0 * X[i].prod() / float(rate_flops(X[i:i + 1], p, halves)[0])
            residuals[i] = np.log(y[i] / predicted)
        self.loo_log_residuals_ = residuals
        self.n_features_in_ = 3
        return self

    def export(self) -> ExportedTimeModel:
        """The fitted model as form ``rate`` (numpy-only evaluation)."""
        return _export_rate(self.halves_, self.overhead_s_, self.peak_flops_,
                            self.loo_log_residuals_)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Predicted seconds per row of X (no noise)."""
        X, _ = _check_xy(X)
        return self.overhead_s_ + 2.0 * X.prod(axis=1) / rate_flops(X, self.peak_flops_,
                                                                     self.halves_)


def calibrate(base: ExportedTimeModel, X: np.ndarray, y: np.ndarray,
              peak_flops: float | None = None, select: bool = True,
              base_name: str = "base") -> OverheadRateRegressor:
    """A device's own level and overhead on the base profile's shape curve, from >= 3 shapes.

    With ``select`` (the default) the constant-rate baseline is calibrated on the same shapes
    too and kept instead when its leave-one-out error (mean |log(measured / predicted)|) is
    lower: a curve learned on other libraries can be wrong for this one (MNN's 4-thread fp16
    rates are flat in m where single-thread fp32 sets are not; docs/perf-models.md), and the
    device's own shapes are the only evidence. A base without the ``rate`` form (an older
    profile, the host's cost model) or with a flat curve is calibrated as a constant rate. The
    result's ``selected_`` says which won, and why (``base_name`` names the base there).
    """
    halves = tuple(base.coef) if base.form == "rate" else (0.0, 0.0, 0.0)
    curve = OverheadRateRegressor(halves=halves, peak_flops=peak_flops).fit(X, y)  # type: ignore[arg-type]
    if not any(halves):  # no curve to keep: the rate is constant whatever is selected
        curve.selected_ = (f"constant rate (the base {base_name} has no rate-form shape curve)"
                           if base.form != "rate"
                           else f"constant rate (the base {base_name}'s curve is flat)")
        return curve
    curve.selected_ = "base curve"
    if not select:
        return curve
    constant = OverheadRateRegressor(constant=True, peak_flops=peak_flops).fit(X, y)
    if np.mean(np.abs(constant.loo_log_residuals_)) < np.mean(np.abs(curve.loo_log_residuals_)):
        constant.selected_ = "constant rate (beat the base curve on leave-one-out)"
        return constant
    return curve
