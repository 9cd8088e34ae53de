"""Evaluating time models on held-out measurements: splits and error figures.

Relative error of a prediction p for a measured time t: r = (p - t) / t.

==============  ==================================================================
within_5...50   share of held-out points with |r| <= 5%, 10%, 15%, 25%, 50%
median_ratio    median of p / t (1 = unbiased; 2 = predicts twice the measured time)
rmspe           sqrt(mean(r^2)), in percent
mape            mean(|r|), in percent
==============  ==================================================================

Splits: ``random`` holds out a seeded random 25% of the rows; ``extrapolation`` fits on the
rows with the smaller 70% of FLOPs and tests on the largest 30% (fit small, predict large).

Leave one set out (:func:`leave_one_set_out`): the per-shape sets are the groups of rows with one
(device, backend, dtype, threads). For each held-out set S the family's shape curve is fitted on
every other float set; then

* ``calibrated-5``: what ``testbed perf calibrate`` does: S's level and overhead from 5 of its
  shapes (spread over its FLOP range, :func:`calibration_picks`) on the family curve, or the
  constant rate when that wins leave-one-out on those 5 (:func:`estimators.calibrate`), scored on
  S's other shapes;
* ``curve-5``: the family curve calibrated on the same 5 shapes, never replaced;
* ``constant-5``: the constant-rate-plus-overhead baseline calibrated on the same 5 shapes;
* ``roofline-5``: the plain roofline at the best rate of the same 5 shapes;
* ``from <T>``: uncalibrated, the profile one would ship for set T (curve without S, level and
  overhead from all of T) predicting all of S.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from testbed.perf_model.estimators import (
    BlasCostRegressor,
    GemmTimeRegressor,
    OverheadRateRegressor,
    RooflineRegressor,
    _export_rate,
    calibrate,
    fit_halves,
)


@dataclass(frozen=True)
class Scores:
    """Error figures of one model on one held-out set (percent except n)."""

    n: int
    within_5: float
    within_10: float
    within_15: float
    rmspe: float
    mape: float
    within_25: float = 0.0
    within_50: float = 0.0
    median_ratio: float = 1.0


def scores(predicted_s: np.ndarray, measured_s: np.ndarray) -> Scores:
    """Error figures of predictions against measurements."""
    r = (np.asarray(predicted_s) - np.asarray(measured_s)) / np.asarray(measured_s)
    a = np.abs(r)
    return Scores(n=int(len(r)), within_5=float(100 * np.mean(a <= 0.05)),
                  within_10=float(100 * np.mean(a <= 0.10)),
                  within_15=float(100 * np.mean(a <= 0.15)),
                  rmspe=float(100 * np.sqrt(np.mean(r ** 2))), mape=float(100 * np.mean(a)),
                  within_25=float(100 * np.mean(a <= 0.25)),
                  within_50=float(100 * np.mean(a <= 0.50)),
                  median_ratio=float(np.median(1.0 + r)))


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

    Default models: ``fitted`` (:class:`BlasCostRegressor`, what the host profile uses),
    ``rate`` (:class:`OverheadRateRegressor`, the phone and laptop family), ``constant`` (its
    constant-rate baseline), ``ridge`` (the log-space :class:`GemmTimeRegressor`) and
    ``roofline``.
    """
    if models is None:
        models = {"fitted": BlasCostRegressor,
                  "rate": OverheadRateRegressor,
                  "constant": lambda: OverheadRateRegressor(constant=True),
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
    lines = [f"{'split':<14}{'model':<10}{'n':>5}{'±5%':>7}{'±10%':>7}{'±25%':>7}{'±50%':>7}"
             f"{'median p/t':>11}{'MAPE%':>8}"]
    for split, models in result.items():
        for name, s in models.items():
            lines.append(f"{split:<14}{name:<10}{s.n:>5}{s.within_5:>7.1f}{s.within_10:>7.1f}"
                         f"{s.within_25:>7.1f}{s.within_50:>7.1f}{s.median_ratio:>11.2f}"
                         f"{s.mape:>8.1f}")
    return "\n".join(lines)


# --- leave one set out ----------------------------------------------------------------------

SetKey = tuple[str, str, str, int]  # (device, backend, dtype, threads)


def set_label(key: SetKey) -> str:
    """A short name of a per-shape set: device/backend/dtype/threads."""
    device, backend, dtype, threads = key
    return f"{device}/{backend}/{dtype}/{threads or '?'}t"


def group_sets(rows: list[Any], min_rows: int = 6) -> dict[SetKey, tuple[np.ndarray, np.ndarray]]:
    """Rows grouped into per-shape sets (a shape measured twice keeps its fastest time)."""
    groups: dict[SetKey, dict[tuple[int, int, int], float]] = {}
    for r in rows:
        if r.dtype not in ("float32", "float16", "float64"):
            continue  # the family is fitted on float data only, never int8
        shapes = groups.setdefault((r.device, r.backend, r.dtype, r.threads), {})
        shape = (r.m, r.k, r.n)
        shapes[shape] = min(r.seconds, shapes.get(shape, np.inf))
    out: dict[SetKey, tuple[np.ndarray, np.ndarray]] = {}
    for key, shapes in groups.items():
        if len(shapes) >= min_rows:
            out[key] = (np.array(list(shapes), dtype=np.float64),
                        np.array(list(shapes.values()), dtype=np.float64))
    return out


def calibration_picks(X: np.ndarray, count: int = 5) -> np.ndarray:
    """Indices of ``count`` shapes spread evenly over the set's FLOP range (smallest, largest,
    and between), the few shapes a user would time on a new device."""
    order = np.argsort(X.prod(axis=1), kind="stable")
    at = np.unique(np.round(np.linspace(0, len(order) - 1, count)).astype(int))
    return np.sort(order[at])


def leave_one_set_out(sets: dict[SetKey, tuple[np.ndarray, np.ndarray]], calibrate_n: int = 5
                      ) -> dict[str, dict[str, Scores]]:
    """Scores per held-out set: calibrated-5, constant-5, roofline-5 and ``from <T>``."""
    out: dict[str, dict[str, Scores]] = {}
    for held, (X, y) in sets.items():
        others = [(Xo, yo, 2.0 * float(np.max(2.0 * Xo.prod(axis=1) / yo)))
                  for key, (Xo, yo) in sets.items() if key != held]
        halves = fit_halves(others)
        picks = calibration_picks(X, calibrate_n)
        rest = np.setdiff1d(np.arange(len(y)), picks)
        figures: dict[str, Scores] = {}
        base = _export_rate(halves, 0.0, 1.0, np.zeros(0))
        Xp, yp = X[picks], y[picks]
        # each a scikit-learn-style regressor: predict(X) -> seconds
        fitted_models: dict[str, OverheadRateRegressor | RooflineRegressor] = {
            "calibrated-5": calibrate(base, Xp, yp),
            "curve-5": OverheadRateRegressor(halves=halves).fit(Xp, yp),
            "constant-5": OverheadRateRegressor(constant=True).fit(Xp, yp),
            "roofline-5": RooflineRegressor().fit(Xp, yp)}
        for name, fitted in fitted_models.items():
            figures[name] = scores(fitted.predict(X[rest]), y[rest])
        for key, (Xo, yo) in sets.items():
            if key == held:
                continue
            source = OverheadRateRegressor(halves=halves).fit(Xo, yo)
            figures[f"from {set_label(key)}"] = scores(source.predict(X), y)
        out[set_label(held)] = figures
    return out


def format_sets_table(result: dict[str, dict[str, Scores]]) -> str:
    """One block per held-out set; rows: the models predicting it."""
    lines = []
    for held, models in result.items():
        lines.append(f"held out: {held}")
        lines.append(f"  {'model':<52}{'n':>4}{'±10%':>7}{'±25%':>7}{'±50%':>7}"
                     f"{'median p/t':>11}")
        for name, s in models.items():
            lines.append(f"  {name[:52]:<52}{s.n:>4}{s.within_10:>7.1f}{s.within_25:>7.1f}"
                         f"{s.within_50:>7.1f}{s.median_ratio:>11.2f}")
    return "\n".join(lines)
