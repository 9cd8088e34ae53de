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

import numpy as np
from scipy.optimize import nnls
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.linear_model import Ridge
from sklearn.model_selection import KFold

from testbed.perf_model.features import (
    COST_FEATURES,
    DEFAULT_BLAS,
    FEATURES,
    ExportedTimeModel,
    cost_matrix,
    feature_matrix,
    roofline_seconds,
)

NOISE_LEVELS = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
EFFICIENCY_FEATURES = ("log2_m", "log2_k", "log2_n")


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
