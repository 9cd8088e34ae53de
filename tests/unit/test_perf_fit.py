"""Fitting GEMM time models: synthetic recovery, the committed host set, the numpy-only export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.base import clone

from testbed.perf_model.estimators import (
    BlasCostRegressor,
    GemmTimeRegressor,
    RooflineRegressor,
    ShapeEfficiencyRegressor,
)
from testbed.perf_model.evaluate import evaluate, random_split, scores
from testbed.perf_model.measure import LocalNumpyRunner, Shape, measure, sweep_shapes
from testbed.perf_model.measurements import as_arrays, read_measurements

HOST_CSV = Path(__file__).resolve().parents[1] / "data" / "perf_host.csv"


def synthetic_seconds(X: np.ndarray) -> np.ndarray:
    """A known timing function: overhead + FLOPs at a rate that saturates with m and n."""
    m, k, n = X.T
    efficiency = (1 - np.exp(-m / 96.0)) * (1 - np.exp(-n / 96.0)) * (1 - 0.3 * np.exp(-k / 512))
    return 4e-6 + 2 * m * k * n / (80e9 * efficiency)


def synthetic_shapes(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.column_stack([np.exp(rng.uniform(np.log(16), np.log(512), count)),
                            np.exp(rng.uniform(np.log(64), np.log(4096), count)),
                            np.exp(rng.uniform(np.log(16), np.log(512), count))]).round()


def test_fit_recovers_a_known_timing_function_within_5_percent() -> None:
    X_train, X_test = synthetic_shapes(300, 1), synthetic_shapes(200, 2)
    model = GemmTimeRegressor().fit(X_train, synthetic_seconds(X_train))
    rel = np.abs(model.predict(X_test) / synthetic_seconds(X_test) - 1)
    assert rel.max() < 0.05, f"worst held-out error {rel.max():.3f}"


def test_estimators_follow_the_sklearn_contract() -> None:
    X = synthetic_shapes(60, 3)
    for est in (GemmTimeRegressor(alpha=0.1), RooflineRegressor(), ShapeEfficiencyRegressor(),
                BlasCostRegressor(k_block=256)):
        params = est.get_params()
        copy = clone(est)
        assert copy.get_params() == params
        fitted = est.fit(X, synthetic_seconds(X))
        assert fitted is est
        assert [a for a in vars(est) if a.endswith("_") and not a.startswith("_")]
        assert not [a for a in vars(copy) if a.endswith("_") and not a.startswith("_")]


def test_export_predicts_what_the_estimator_predicts() -> None:
    X = synthetic_shapes(100, 4)
    est = GemmTimeRegressor().fit(X, synthetic_seconds(X))
    exported = est.export()
    assert np.allclose(exported.predict_seconds(X), est.predict(X))
    assert exported.predict_one(128, 1024, 128) == pytest.approx(
        float(est.predict(np.array([[128, 1024, 128]]))[0]))


def test_host_set_random_split_beats_roofline() -> None:
    X, y = as_arrays(read_measurements(HOST_CSV))
    result = evaluate(X, y)["random"]
    assert result["fitted"].rmspe < result["roofline"].rmspe


def test_host_set_90_percent_within_10_percent() -> None:
    X, y = as_arrays(read_measurements(HOST_CSV))
    fitted = evaluate(X, y)["random"]["fitted"]
    assert fitted.within_10 >= 90.0, fitted


def test_cost_model_recovers_known_blas_costs() -> None:
    """Times built from known per-term costs (one kernel edge piece, packing, overhead) are
    recovered: the fit on some shapes predicts others within 1%."""
    from testbed.perf_model.features import COST_FEATURES, DEFAULT_BLAS, cost_matrix
    X_train, X_test = synthetic_shapes(200, 6), synthetic_shapes(100, 7)
    true = np.zeros(len(COST_FEATURES))
    for name, value in (("small:one", 2e-6), ("packed:one", 4e-6),
                        ("small:kernel_full", 1.1e-9), ("packed:kernel_full", 1.0e-9),
                        ("packed:kernel_half", 0.7e-9), ("packed:pack_kn", 3e-10),
                        ("packed:pack_kn_far", 2e-10), ("packed:write_mn_kb", 5e-10)):
        true[COST_FEATURES.index(name)] = value
    def seconds(X: np.ndarray) -> np.ndarray:
        return cost_matrix(X, COST_FEATURES, DEFAULT_BLAS) @ true
    model = BlasCostRegressor().fit(X_train, seconds(X_train))
    rel = np.abs(model.predict(X_test) / seconds(X_test) - 1)
    assert rel.max() < 0.01, f"worst held-out error {rel.max():.4f}"


def test_cost_model_export_round_trips_through_a_profile_dict() -> None:
    from testbed.perf_model.features import ExportedTimeModel
    X, y = as_arrays(read_measurements(HOST_CSV))
    exported = BlasCostRegressor().fit(X, y).export()
    again = ExportedTimeModel.from_dict(exported.to_dict())
    assert again.form == "cost"
    assert np.allclose(again.predict_seconds(X), exported.predict_seconds(X))
    assert again.predict_one(128, 1024, 128) == pytest.approx(
        float(exported.predict_seconds(np.array([[128, 1024, 128]]))[0]))
    bad = exported.to_dict()
    bad["blas"] = {"unroll_n": 16}
    with pytest.raises(ValueError, match="model.blas"):
        ExportedTimeModel.from_dict(bad)


def test_noise_quantiles_come_from_held_out_residuals() -> None:
    X, y = as_arrays(read_measurements(HOST_CSV))
    train, _ = random_split(len(y))
    est = GemmTimeRegressor().fit(X[train], y[train])
    q = est.noise_log_quantiles_
    assert np.all(np.diff(q) >= 0) and q[0] < 0 < q[-1]
    rng = np.random.default_rng(0)
    factors = [est.export().sample_factor(rng) for _ in range(2000)]
    assert np.exp(q[0]) <= min(factors) and max(factors) <= np.exp(q[-1])


def test_scores_count_within_bands() -> None:
    s = scores(np.array([1.04, 1.09, 1.2, 0.5]), np.ones(4))
    assert (s.within_5, s.within_10, s.within_15) == (25.0, 50.0, 50.0)
    assert s.mape == pytest.approx(100 * (0.04 + 0.09 + 0.2 + 0.5) / 4)


class ScriptedRunner:
    """A runner that 'measures elsewhere': returns times of a known function (the ADB seam)."""

    def describe(self) -> dict[str, str | int]:
        return {"device": "fake-phone", "backend": "numpy-remote", "threads": 4,
                "cpu_model": "scripted"}

    def time_gemm(self, m: int, k: int, n: int, dtype: str, warmup: int,
                  repeats: int) -> list[float]:
        t = float(synthetic_seconds(np.array([[m, k, n]], dtype=float))[0])
        return [t * 1.02, t, t * 0.99][:repeats]


def test_measure_takes_the_min_by_default() -> None:
    rows = measure(sweep_shapes("quick")[:5], ScriptedRunner(), repeats=3, passes=2)
    X, y = as_arrays(rows)
    assert np.allclose(y, synthetic_seconds(X) * 0.99)
    assert "min of 2x3" in rows[0].provenance


def test_measure_uses_the_runner_seam() -> None:
    rows = measure(sweep_shapes("quick")[:10], ScriptedRunner(), repeats=3, passes=2,
                   statistic="median")
    assert {r.device for r in rows} == {"fake-phone"} and rows[0].threads == 4
    X, y = as_arrays(rows)
    assert np.allclose(y, synthetic_seconds(X) * 1.0)  # median of (1.02, 1, 0.99) x 2 passes


def test_local_runner_times_real_gemms() -> None:
    rows = measure([Shape("forward", 32, 64, 32), Shape("weight_grad", 64, 512, 64)],
                   LocalNumpyRunner(min_sample_s=1e-4), repeats=2)
    assert all(r.seconds > 0 for r in rows) and rows[0].threads == 1
    assert rows[0].op == "forward" and rows[1].op == "weight_grad"


def test_sweep_shapes_cover_the_training_ranges() -> None:
    shapes = sweep_shapes("quick")
    assert 100 <= len(shapes) <= 200
    assert {s.op for s in shapes} == {"forward", "input_grad", "weight_grad"}
    assert all(16 <= s.m <= 512 and 16 <= s.n <= 512 and 64 <= s.k <= 4096 for s in shapes)


def test_device_model_needs_no_sklearn() -> None:
    code = ("import sys\n"
            "from testbed.perf_model.profiles import load_profile\n"
            "from testbed.emulator.device_model import device_model_for\n"
            "for name in ('host', 'snapdragon888', 'm2pro'):\n"
            "    d = device_model_for(load_profile(name), seed=1)\n"
            "    assert d.tile_cost(128, 1024, 128, 'forward', 0.0).seconds > 0\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('sklearn', 'torch', 'scipy')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_scalar_and_array_predictions_agree() -> None:
    from testbed.perf_model.profiles import load_profile
    for name in ("host", "snapdragon888", "m2pro"):
        model = load_profile(name).model
        X = synthetic_shapes(20, 5)
        assert np.allclose([model.predict_one(*map(int, row)) for row in X],
                           model.predict_seconds(X))
