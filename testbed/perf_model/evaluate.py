"""Evaluating time models on held-out measurements: splits and error figures.

Relative error of a prediction p for a measured time t: r = (p - t) / t.

==============  ==================================================================
within_5/10/15  share of held-out points with |r| <= 5%, 10%, 15%
rmspe           sqrt(mean(r^2)), in percent
mape            mean(|r|), in percent
==============  ==================================================================

Splits: ``random`` holds out a seeded random 25% of the rows; ``extrapolation`` fits on the
rows with the smaller 70% of FLOPs and tests on the largest 30% (fit small, predict large).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from testbed.perf_model.estimators import BlasCostRegressor, GemmTimeRegressor, RooflineRegressor


@dataclass(frozen=True)
class Scores:
    """Error figures of one model on one held-out set (percent except n)."""

    n: int
    within_5: float
    within_10: float
    within_15: float
    rmspe: float
    mape: float


def scores(predicted_s: np.ndarray, measured_s: np.ndarray) -> Scores:
    """Error figures of predictions against measurements."""
    r = (np.asarray(predicted_s) - np.asarray(measured_s)) / np.asarray(measured_s)
    a = np.abs(r)
    return Scores(n=int(len(r)), within_5=float(100 * np.mean(a <= 0.05)),
                  within_10=float(100 * np.mean(a <= 0.10)),
                  within_15=float(100 * np.mean(a <= 0.15)),
                  rmspe=float(100 * np.sqrt(np.mean(r ** 2))), mape=float(100 * np.mean(a)))


def random_split(n: int, test_fraction: float = 0.25, seed: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices of a seeded random split."""
    order = np.random.default_rng(seed).permutation(n)
    cut = int(round(n * (1 - test_fraction)))
    return np.sort(order[:cut]), np.sort(order[cut:])


def extrapolation_split(X: np.ndarray, small_fraction: float = 0.7
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Train on the shapes with the smallest FLOPs, test on the largest."""
    flops = np.asarray(X, dtype=np.float64).prod(axis=1)
    order = np.argsort(flops, kind="stable")
    cut = int(round(len(order) * small_fraction))
    return np.sort(order[:cut]), np.sort(order[cut:])


ModelFactory = Callable[[], Any]


def evaluate(X: np.ndarray, y: np.ndarray, models: dict[str, ModelFactory] | None = None,
             seed: int = 0, bandwidth_bytes_s: float = 20e9) -> dict[str, dict[str, Scores]]:
    """Scores per split and model: {"random": {"fitted": Scores, "roofline": Scores}, ...}.

    Default models: ``fitted`` (:class:`BlasCostRegressor`, what profiles use), ``ridge`` (the
    log-space :class:`GemmTimeRegressor`, for comparison) and ``roofline``.
    """
    if models is None:
        models = {"fitted": BlasCostRegressor,
                  "ridge": lambda: GemmTimeRegressor(bandwidth_bytes_s=bandwidth_bytes_s),
                  "roofline": lambda: RooflineRegressor(bandwidth_bytes_s=bandwidth_bytes_s)}
    X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
    splits = {"random": random_split(len(y), seed=seed), "extrapolation": extrapolation_split(X)}
    out: dict[str, dict[str, Scores]] = {}
    for split, (train, test) in splits.items():
        out[split] = {}
        for name, factory in models.items():
            model = factory().fit(X[train], y[train])
            out[split][name] = scores(model.predict(X[test]), y[test])
    return out


def as_plain(result: dict[str, dict[str, Scores]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Scores as plain dicts, rounded, for YAML and JSON."""
    return {split: {name: {k: (round(v, 2) if isinstance(v, float) else v)
                           for k, v in asdict(s).items()} for name, s in models.items()}
            for split, models in result.items()}


def format_table(result: dict[str, dict[str, Scores]]) -> str:
    """A fixed-width table of the scores, one line per split and model."""
    lines = [f"{'split':<14}{'model':<10}{'n':>5}{'±5%':>8}{'±10%':>8}{'±15%':>8}"
             f"{'RMSPE%':>9}{'MAPE%':>8}"]
    for split, models in result.items():
        for name, s in models.items():
            lines.append(f"{split:<14}{name:<10}{s.n:>5}{s.within_5:>8.1f}{s.within_10:>8.1f}"
                         f"{s.within_15:>8.1f}{s.rmspe:>9.1f}{s.mape:>8.1f}")
    return "\n".join(lines)
