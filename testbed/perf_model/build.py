"""Build the shipped device profiles from committed data: ``python -m testbed.perf_model.build``.

Deterministic: it reads only files in the repository and ../shared/data, so rebuilding gives the
same YAML. Every figure in a profile carries a provenance entry; derived figures say how.

* host profile: :class:`BlasCostRegressor` fitted on ``tests/data/perf_host.csv`` (measured here
  with ``testbed perf measure``, min of 60 x 3 samples per shape).
* Apple M-series and phones: the overhead-plus-rate family, t = o + 2mkn / R(m, k, n); the
  shape curve R / P is shared, fitted on the NEON float per-shape sets of ../shared/data (MNN
  Snapdragon 8 Gen 5, mmperf M1 / M1 Max ruy, TF Eigen Snapdragon 835; never int8 data), and
  each device has its own level P and overhead o from its own rows (M-series: mlx-benchmark's
  PyTorch-CPU rows) or a cited figure (Snapdragon 888: ncnn's ViT row; Pixel 7a: vfpbench's
  peak). docs/perf-models.md has the figures and the held-out accuracy of each.
* Their per-tile noise: the per-call spread of ncnn's repeated runs (:func:`call_spread`), the
  same for every phone and laptop; the models' errors across shapes stay in ``evaluation``.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from testbed.emulator.thermal import ThermalParams, conductance_for_slowdown, steady_state
from testbed.perf_model.estimators import (
    BlasCostRegressor,
    OverheadRateRegressor,
    _export_rate,
    fit_halves,
)
from testbed.perf_model.evaluate import (
    as_plain,
    evaluate,
    group_sets,
    leave_one_set_out,
    scores,
    set_label,
)
from testbed.perf_model.features import ExportedTimeModel
from testbed.perf_model.importers import (
    MLX_ATTRIBUTION,
    MMPERF_ATTRIBUTION,
    MNN_ATTRIBUTION,
    NCNN_ATTRIBUTION,
    TF835_ATTRIBUTION,
    VFPBENCH_ATTRIBUTION,
    import_mlx,
    import_mmperf,
    import_mnn,
    import_ncnn,
    import_tf_sd835,
    ncnn_gemms,
    shared_data_dir,
    vfpbench_peak,
)
from testbed.perf_model.measurements import as_arrays, read_measurements, write_measurements
from testbed.perf_model.profiles import PROFILE_DIR

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
# $TESTBED_SHARED_DATA, else the nearest ancestor's shared/data (importers.shared_data_dir)
SHARED = shared_data_dir(REPO) or REPO.parent / "shared" / "data"
HOST_CSV = REPO / "tests" / "data" / "perf_host.csv"
REFERENCE_TILE = (128, 1024, 128)
PHONE_OVERHEAD_S = 5e-5

M_SERIES = {  # profile name -> device string prefix in mlx-benchmark
    "m1": "M1 (cores: 4E+4P+8GPU)", "m1pro": "M1 Pro (2E+8P+16GPU+16GB)",
    "m2": "M2 () - mlx 0.2.0", "m2pro": "M2 Pro (cores: 4E+6P+16GPU)",
    "m3pro": "M3 Pro (cores: 6E+5P+14GPU)", "m4pro": "M4 Pro (4E+10P+20GPU+24GB)",
}


SETS_CSV = REPO / "tests" / "data" / "perf_sets.csv"
ARM_BACKENDS = ("mnn-cpu", "mmperf-ruy", "tf-eigen-cpu")  # NEON float GEMMs (not AMX, not x86)


def shape_sets() -> list:
    """Every per-shape float GEMM row of ../shared/data (and this host's set), for the family."""
    rows = import_mnn(SHARED / "mnn" / "mnn_gemm_speed_parsed.csv")
    rows += import_mmperf(SHARED / "mmperf" / "mmperf_apple_only.csv")
    rows += import_tf_sd835(SHARED / "tf-opencl-sd835" / "opencl-matmul_README.md")
    rows += read_measurements(HOST_CSV)
    return rows


def write_sets(path: Path = SETS_CSV) -> Path:
    """tests/data/perf_sets.csv: the per-shape sets, with their sources' attribution."""
    write_measurements(path, shape_sets(), comments=[
        "per-shape float GEMM sets for `testbed perf eval --leave-one-set-out`, written by "
        "python -m testbed.perf_model.build from ../shared/data (see its SOURCES.md):",
        MNN_ATTRIBUTION, MMPERF_ATTRIBUTION, TF835_ATTRIBUTION,
        "host rows: tests/data/perf_host.csv (measured here)"])
    return path


def arm_halves() -> tuple[tuple[float, float, float], str]:
    """The ARM float family's shape curve: half-rate lengths shared by the NEON float sets."""
    sets = group_sets([r for r in shape_sets() if r.backend in ARM_BACKENDS])
    halves = fit_halves([(X, y, 2.0 * float(np.max(2.0 * X.prod(axis=1) / y)))
                         for X, y in sets.values()])
    how = (f"(half_m, half_k, half_n) = {halves} shared by the NEON float sets "
           f"{', '.join(set_label(k) for k in sets)}, each with its own level and overhead")
    return halves, how


VIT_PHONES = ("Snapdragon 888", "Snapdragon 855+", "Snapdragon 765G", "Snapdragon 8 Gen 2",
              "Dimensity 9300")
#: when each chip came out and how it relates to the SD888 (flagships: 855 -> 865 -> 888 ->
#: 8 Gen 1 -> 8 Gen 2); none of them is the SD888's generation
VIT_GENERATIONS = ("chips' announcement years: SD855+ 2019 (refresh of the 855, two flagship "
                   "generations before the SD888), SD765G 2019 (mid-range, 2 big cores, "
                   "announced with the SD865), SD888 2020, 8 Gen 2 2022 (two generations "
                   "after), Dimensity 9300 2023")


@dataclass(frozen=True)
class CallSpread:
    """How much one call of the same work varies around its mean on a device: the per-tile
    noise of an emulated phone or laptop (``ExportedTimeModel.noise_levels`` and
    ``noise_log_quantiles``), with where it came from."""

    levels: tuple[float, ...]
    log_quantiles: tuple[float, ...]
    how: str

    def apply(self, model: ExportedTimeModel) -> ExportedTimeModel:
        return replace(model, noise_levels=self.levels, noise_log_quantiles=self.log_quantiles)


def call_spread(timings: list) -> CallSpread:
    """The per-call spread of CPU inference, from repeated runs' (min, mean, max) of N calls.

    A tile's noise is what the same tile does from one call to the next. A profile's held-out
    error across shapes is something else: how wrong the model is for a shape, the same on every
    call (the M-series fits miss their own rows by a factor of 3-4 on the median, which drawn
    per tile made one laptop tile 0.01 times its mean and the next 27 times). Of N calls, the
    fastest lies near the 1/(N+1) quantile and the slowest near N/(N+1): across the rows of the
    most common N, the medians of log(min / mean) and log(max / mean) are those two quantiles,
    and the mean is taken as the median (the model predicts the mean).
    """
    cpu = [t for t in timings if t.cores != "gpu" and t.precision != "int8" and t.loops > 1]
    if not cpu:
        raise ValueError("no CPU float rows with a loop count to take a per-call spread from")
    loops = Counter(t.loops for t in cpu).most_common(1)[0][0]
    rows = [t for t in cpu if t.loops == loops]
    low = float(np.median([np.log(t.min_ms / t.avg_ms) for t in rows]))
    high = float(np.median([np.log(t.max_ms / t.avg_ms) for t in rows]))
    how = (f"per-call spread: of {loops} calls the fastest {np.exp(low):.4f} and the slowest "
           f"{np.exp(high):.4f} times the mean (medians over the {len(rows)} CPU float rows of "
           f"{len({t.device for t in rows})} devices that ncnn's benchmark ran {loops} times; "
           f"{NCNN_ATTRIBUTION}), at the {1 / (loops + 1):.3f} and {loops / (loops + 1):.3f} "
           f"quantiles; not the model's error across shapes (evaluation)")
    return CallSpread((1 / (loops + 1), 0.5, loops / (loops + 1)), (low, 0.0, high), how)


def ncnn_call_spread() -> CallSpread:
    """:func:`call_spread` of ncnn's benchmark table in ../shared/data."""
    return call_spread(import_ncnn(SHARED / "ncnn" / "ncnn_benchmark_parsed.csv"))


def sd888_rows_in_data() -> str:
    """What ncnn's table holds for the Snapdragon 888, counted from the data."""
    rows = [r for r in import_ncnn(SHARED / "ncnn" / "ncnn_benchmark_parsed.csv")
            if "Snapdragon 888" in r.device]
    combos = sorted({(r.threads, r.cores) for r in rows})
    vit = [r for r in rows if r.model == "vision_transformer"]
    return (f"ncnn's table holds {len(rows)} Snapdragon 888 rows ({len({r.model for r in rows})} "
            f"models), all at "
            + " and ".join(f"{t} threads on {'the GPU' if c == 'gpu' else c + ' cores'}"
                           for t, c in combos)
            + "; vision_transformer: "
            + ", ".join(f"{'GPU' if r.cores == 'gpu' else 'CPU'} {r.avg_ms} ms (min {r.min_ms}, "
                        f"max {r.max_ms})" for r in vit)
            + ". There is no SD888 row at 1 or 4 threads, so a check of SD888 at 1 and 4 threads "
              "cannot be made; compared instead: the SD888 8-thread big-core CPU row "
              "(in-sample: the level is fitted on it) and the 1- and 4-thread CPU rows of the "
              "other phones with a vision_transformer row")


def vit_gemms() -> list[tuple[str, int, int, int]]:
    """(layer, m, k, n) of ncnn's vision_transformer, from its layer file."""
    return ncnn_gemms(SHARED / "ncnn" / "params" / "vision_transformer.param")


def vit_rows() -> list:
    """ncnn's CPU vision_transformer rows of the phones in :data:`VIT_PHONES`."""
    return [r for r in import_ncnn(SHARED / "ncnn" / "ncnn_benchmark_parsed.csv")
            if r.model == "vision_transformer" and r.cores != "gpu"
            and any(chip in r.device for chip in VIT_PHONES)]


def vit_check(model: ExportedTimeModel, one_core_share: float, fitted_on: str = ""
              ) -> dict[str, Any]:
    """Predicted ncnn vision_transformer GEMM time against the phones' ncnn CPU rows.

    The profile models its big cores together (4 threads); a 1-thread row is predicted with
    the level scaled by ``one_core_share`` (the fastest core's share of the big cores' peak).
    ``fitted_on``: the row the level came from (marked in-sample).
    """
    gemms = vit_gemms()
    four_ms = 1e3 * sum(model.predict_one(m, k, n) for _, m, k, n in gemms)
    one = ExportedTimeModel.from_dict({**model.to_dict(),
                                       "peak_flops": model.peak_flops * one_core_share})
    one_ms = 1e3 * sum(one.predict_one(m, k, n) for _, m, k, n in gemms)
    out: dict[str, Any] = {"predicted_gemm_ms": {"big cores (>= 4 threads)": round(four_ms, 1),
                                                 "1 thread": round(one_ms, 1)},
                           "gemms": len(gemms),
                           "gflop": round(sum(2.0 * m * k * n for _, m, k, n in gemms) / 1e9, 2)}
    for r in vit_rows():
        chip = next(c for c in VIT_PHONES if c in r.device)
        predicted = one_ms if r.threads == 1 else four_ms
        label = f"ncnn {chip} {r.threads} threads ({r.cores} cores)"
        out[label] = {"measured_ms": r.avg_ms, "spread_ms": [r.min_ms, r.max_ms],
                      "predicted_over_measured": round(predicted / r.avg_ms, 2),
                      "as_fp16_over_measured": round(predicted / HP_OVER_SP / r.avg_ms, 2),
                      **({"in_sample": True} if label == fitted_on else {})}
    out["note"] = ("ncnn runs fp16 on these Armv8.2+ CPUs; the profile is fp32, so "
                   "as_fp16_over_measured divides its prediction by the HP/SP peak ratio "
                   f"{HP_OVER_SP:.2f}; ncnn's time also "
                   "holds attention softmax, layer norms and GELU. Generations: "
                   f"{VIT_GENERATIONS}. Source: {NCNN_ATTRIBUTION}")
    out["in_the_data"] = sd888_rows_in_data()
    return out


SD888_VIT_ROW = "ncnn Snapdragon 888 8 threads (big cores)"
HP_OVER_SP = 205.873 / 97.936  # vfpbench Pixel 7a X1 cluster, multi-thread HP and SP peaks


def sd888_level(halves: tuple[float, float, float]) -> tuple[float, float, str]:
    """(fp32 level P in FLOP/s, 1-thread share, how): from ncnn's SD888 vision_transformer row.

    P_fp16 solves sum(o + 2mkn / R_P(m, k, n)) = the measured time over the ViT's GEMMs (all of
    the time given to GEMMs, so this is a lower bound of the GEMM rate); the fp32 level divides
    it by the HP/SP peak ratio of the same cores (vfpbench, Pixel 7a X1 cluster).
    """
    row = next(r for r in vit_rows() if "Snapdragon 888" in r.device and r.cores == "big")
    gemms = vit_gemms()
    work = sum(2.0 * m * k * n * (1 + halves[0] / m + halves[1] / k + halves[2] / n)
               for _, m, k, n in gemms)
    p16 = work / (row.avg_ms / 1e3 - len(gemms) * PHONE_OVERHEAD_S)
    log_7a = (SHARED / "vfpbench" / "log" / "Google Tensor G2 Pixel 7a.txt").read_text()
    assert "205.873" in log_7a and "97.936" in log_7a, "vfpbench Pixel 7a log changed"
    hp_over_sp = HP_OVER_SP
    peak, _ = sd888_peak_gflops()
    a78 = 74.806 / 2 * 2.42 / 2.348
    share = 55.1 / (55.1 + 3 * a78)
    how = (f"{p16 / hp_over_sp / 1e9:.1f} GFLOP/s fp32 = {p16 / 1e9:.1f} GFLOP/s fp16 (ncnn "
           f"vision_transformer on the SD888's big cores, {row.threads} threads, "
           f"{row.avg_ms} ms for {len(gemms)} GEMMs from its layer file, every ms given to "
           f"GEMMs, on the family curve with {PHONE_OVERHEAD_S * 1e6:.0f} us per call) / "
           f"{hp_over_sp:.2f} (HP/SP multi-thread peak of the X1 cluster of the Pixel 7a, "
           f"{VFPBENCH_ATTRIBUTION}); {NCNN_ATTRIBUTION}. It was 20 GFLOP/s (Das et al. "
           f"15-30, arXiv 2202.10100) before; now {100 * p16 / hp_over_sp / 1e9 / peak:.0f}% of "
           f"the derived {peak:.0f} GFLOPS peak")
    return p16 / hp_over_sp, share, how


def _rate_gflops(model: ExportedTimeModel, shape: tuple[int, int, int] = REFERENCE_TILE) -> float:
    m, k, n = shape
    return 2.0 * m * k * n / model.predict_one(m, k, n) / 1e9


def host_profile() -> dict[str, Any]:
    """The profile of this host, fitted on the committed measurement set."""
    rows = read_measurements(HOST_CSV)
    X, y = as_arrays(rows)
    model = BlasCostRegressor().fit(X, y).export()
    result = evaluate(X, y)
    return {
        "name": "host", "kind": "host",
        "description": f"this build host ({rows[0].device}, {rows[0].backend}, "
                       f"{rows[0].threads} thread), numpy float32 A @ B",
        "sustained_gflops": round(_rate_gflops(model), 2),
        "tile_overhead_s": float(model.overhead_s),
        "model": model.to_dict(),
        "power": {"active_w": 15.0, "idle_w": 5.0, "radio_w": 0.5},
        "evaluation": {
            **as_plain(result),
            # the shipped model's figures on shapes it was not fitted on, for `perf show`
            "held_out": {
                "random 25% of its shapes (seed 0), fitted on the other 75%":
                    as_plain({"x": {"y": result["random"]["fitted"]}})["x"]["y"],
                "the 30% of its shapes with the most FLOPs, fitted on the other 70% "
                "(extrapolation)":
                    as_plain({"x": {"y": result["extrapolation"]["fitted"]}})["x"]["y"]}},
        "provenance": {
            "model": f"BlasCostRegressor (blocked-BLAS cost model, OpenBLAS 16x4 kernel, "
                     f"small-matrix regime below m*n*k = 1e6, L2 2 MiB) fitted on "
                     f"tests/data/perf_host.csv ({len(rows)} shapes, {rows[0].provenance})",
            "sustained_gflops": f"the model's rate at the {REFERENCE_TILE} tile",
            "power": "assumed: this VM exposes no power sensor (no RAPL); 15 W per busy core, "
                     "5 W idle share; radio 0.5 W Wi-Fi (HotCarbon'25, arXiv 2507.01803)",
            "thermal": "none: a server core is not expected to throttle in a run",
            "noise": f"the fit's own error across shapes: quantiles of the out-of-fold "
                     f"log(measured / predicted) of its {len(y)} shapes (5-fold), not one "
                     f"shape's call-to-call spread",
        },
    }


def m_series_profile(name: str, efficiency: Any, mlx_rows: list, spread: CallSpread
                     ) -> dict[str, Any]:
    """An Apple M-series laptop profile from its mlx-benchmark PyTorch-CPU rows."""
    prefix = M_SERIES[name]
    rows = [r for r in mlx_rows if r.device.startswith(prefix)]
    if not rows:
        raise ValueError(f"no mlx-benchmark cpu rows for {prefix!r}")
    X, y = as_arrays(rows)
    halves, curve_how = efficiency
    fitted = OverheadRateRegressor(halves=halves).fit(X, y)
    constant = OverheadRateRegressor(constant=True).fit(X, y)
    use_constant = np.mean(np.abs(constant.loo_log_residuals_)) < \
        np.mean(np.abs(fitted.loo_log_residuals_))
    chosen = constant if use_constant else fitted
    model = spread.apply(chosen.export())
    loo = scores(y * np.exp(-chosen.loo_log_residuals_), y)
    held: dict[str, Any] = {"leave-one-out over its own mlx-benchmark CPU rows": as_plain(
        {"x": {"y": loo}})["x"]["y"]}
    if name == "m1":
        mm = [r for r in import_mmperf(SHARED / "mmperf" / "mmperf_apple_only.csv")
              if r.device == "Apple M1" and r.backend == "mmperf-ruy"]
        Xm, ym = as_arrays(mm)
        held["mmperf M1 ruy single-core (other library, 1 thread)"] = as_plain(
            {"x": {"y": scores(model.predict_seconds(Xm), ym)}})["x"]["y"]
    return {
        "name": name, "kind": "laptop",
        "description": f"Apple {rows[0].device}, PyTorch CPU rows of mlx-benchmark, float32",
        "sustained_gflops": round(_rate_gflops(model), 2),
        "tile_overhead_s": float(model.overhead_s),
        "model": model.to_dict(),
        "thermal": None,
        "power": {"active_w": 30.0, "idle_w": 3.0, "radio_w": 0.5},
        "assumes": {"precision": "float32", "library": "PyTorch CPU (mlx-benchmark)",
                    "threads": "PyTorch's default (all cores)"},
        "evaluation": {"held_out": held,
                       "shipped_form": "constant rate (it beat the shape curve on held-out rows)"
                       if use_constant else "ARM shape curve (it beat the constant rate)"},
        "provenance": {
            "model": f"t = o + 2mkn / R, R = P / (1 + h_m/m + h_k/k + h_n/n); level P = "
                     f"{model.peak_flops / 1e9:.1f} GFLOP/s and overhead o fitted on the "
                     f"{len(rows)} PyTorch-CPU rows of this device in {MLX_ATTRIBUTION}; "
                     + ("constant rate (h = 0): it beat the ARM curve on leave-one-out"
                        if use_constant else f"shape curve {curve_how}"),
            "tile_overhead_s": "fitted with the level (per-call overhead)",
            "noise": spread.how,
            "power": "assumed: ~30 W CPU package under all-core load, 3 W idle (no measurement "
                     "in the shared data); radio 0.5 W Wi-Fi (HotCarbon'25)",
            "thermal": "none: no sustained-load data; a fan-cooled laptop assumed not to throttle",
        },
    }


def sd888_peak_gflops() -> tuple[float, str]:
    """Snapdragon 888 float32 peak, derived (no vfpbench log of an SD888 exists)."""
    log_7a = SHARED / "vfpbench" / "log" / "Google Tensor G2 Pixel 7a.txt"
    text = log_7a.read_text()
    # Pixel 7a (Tensor G2): group 1 = 2x Cortex-A78 @ 2.348 GHz, group 0 = 4x A55 @ 1.803 GHz
    a78_per_core = 74.806 / 2 * 2.42 / 2.348
    a55_per_core = 54.749 / 4 * 1.80 / 1.803
    assert "74.806" in text and "54.749" in text, "vfpbench Pixel 7a log changed"
    peak = 55.1 + 3 * a78_per_core + 4 * a55_per_core
    how = (f"{peak:.1f} GFLOPS = X1 55.1 (measured NEON FMLA peak, github.com/zchrissirhcz/pixel) "
           f"+ 3 x A78 {a78_per_core:.1f} + 4 x A55 {a55_per_core:.1f}; A78 and A55 per-core SP "
           f"peaks from the Pixel 7a (Tensor G2, same cores) multi-thread cluster figures of "
           f"{VFPBENCH_ATTRIBUTION}, scaled to SD888 clocks (2.42, 1.80 GHz)")
    return peak, how


def phone_thermal() -> dict[str, Any]:
    """Thermal parameters calibrated so sustained load settles at a 20% slowdown, tau 150 s."""
    base = ThermalParams(capacity_j_per_k=1.0, conductance_w_per_k=1.0)
    g = conductance_for_slowdown(base, idle_w=0.5, active_w=5.0, slowdown=0.20)
    params = ThermalParams(capacity_j_per_k=150.0 * g, conductance_w_per_k=g)
    t_c, speed = steady_state(params, 0.5, 5.0)
    return {"ambient_c": params.ambient_c, "capacity_j_per_k": round(params.capacity_j_per_k, 4),
            "conductance_w_per_k": round(params.conductance_w_per_k, 6),
            "throttle_start_c": params.throttle_start_c, "throttle_full_c": params.throttle_full_c,
            "min_speed": params.min_speed, "expected_sustained_slowdown": round(1 - speed, 3)}


def phone_profile(name: str, efficiency: Any, spread: CallSpread) -> dict[str, Any]:
    """Snapdragon 888 class phone or Pixel 7a, derived (no per-shape float32 data exists)."""
    sd_peak, sd_how = sd888_peak_gflops()
    halves, curve_how = efficiency
    sd_level, one_core, sd_level_how = sd888_level(halves)
    sd_sustained = sd_level / 1e9
    if name == "snapdragon888":
        sustained, desc = sd_sustained, "Snapdragon 888 class Android phone (e.g. Galaxy S21)"
        how = f"{sd_level_how}; peak: {sd_how}"
    elif name == "pixel7a":
        peak = vfpbench_peak(SHARED / "vfpbench" / "log" / "Google Tensor G2 Pixel 7a.txt")
        sustained, desc = sd_sustained * peak / sd_peak, "Google Pixel 7a (Tensor G2)"
        how = (f"{sustained:.1f} GFLOP/s = the SD888 share of peak ({sd_sustained:.1f} of "
               f"{sd_peak:.1f}) applied to the Pixel 7a's measured multi-thread SP peak {peak} "
               f"GFLOPS ({VFPBENCH_ATTRIBUTION}); SD888 level: {sd_level_how}; SD888 peak: "
               f"{sd_how}")
    else:
        raise ValueError(name)
    model = spread.apply(_export_rate(halves, PHONE_OVERHEAD_S, sustained * 1e9, np.zeros(0)))
    evaluation: dict[str, Any] = {
        "held_out": {"ncnn vision_transformer (model level)": vit_check(
            model, one_core, SD888_VIT_ROW)},  # pixel7a's level is scaled from it too
        "note": "no per-shape fp32 measurements of this phone exist in the shared data; "
                "`testbed perf calibrate` it from 5 shapes measured with `testbed adb measure`"}
    return {
        "name": name, "kind": "phone", "description": f"{desc}, GEMMs on the CPU, float32",
        "sustained_gflops": round(_rate_gflops(model), 2),
        "tile_overhead_s": PHONE_OVERHEAD_S,
        "model": model.to_dict(),
        "thermal": phone_thermal(),
        "power": {"active_w": 5.0, "idle_w": 0.5, "radio_w": 0.5},
        "assumes": {"precision": "float32 (level from an fp16 ncnn row / the HP:SP peak ratio)",
                    "library": "ncnn-class NEON GEMM",
                    "threads": "the big cores together (X1 + 3 A78 on the SD888)"},
        "evaluation": evaluation,
        "provenance": {
            "model": f"t = o + 2mkn / R, R = P / (1 + h_m/m + h_k/k + h_n/n); P = {how}; "
                     f"shape curve {curve_how} (float data only; no int8 curve)",
            "sustained_gflops": f"the model's rate at the {REFERENCE_TILE} tile",
            "tile_overhead_s": "assumed: Python + numpy dispatch per tile on a phone core",
            "noise": spread.how,
            "thermal": "calibrated: a Galaxy S21 Ultra (SD888) lost about 20% of its benchmark "
                       "score over four back-to-back runs (Notebookcheck, via shared/data/"
                       "SOURCES.md); parameters chosen so sustained load settles at a 20% "
                       "throughput loss with a 150 s time constant (most of it within 5-8 min)",
            "power": "assumed: 5 W CPU under all-core load, 0.5 W idle; radio 0.5 W Wi-Fi "
                     "(HotCarbon'25, arXiv 2507.01803)",
        },
    }


MEASURED_PHONES = {  # profile -> (set key in shape_sets, description, assumes)
    "sd8gen5-mnn": (("Snapdragon 8 Gen5", "mnn-cpu", "float16", 4),
                    "Snapdragon 8 Gen 5 phone, MNN CPU GEMMs",
                    {"precision": "float16 (MNN precision 2; an fp32 GEMM is about 2x slower "
                                  "on NEON)", "library": "MNN", "threads": 4}),
    "sd835-eigen": (("Snapdragon 835", "tf-eigen-cpu", "float32", 0),
                    "Snapdragon 835 phone, TensorFlow Eigen CPU MatMul",
                    {"precision": "float32", "library": "TensorFlow Eigen (times include TF op "
                                  "overhead)", "threads": "not stated upstream (TF default)"}),
}


def measured_phone_profile(name: str, efficiency: Any, spread: CallSpread) -> dict[str, Any]:
    """A phone profile fitted on its own per-shape set (family curve or constant, by LOO)."""
    key, desc, assumes = MEASURED_PHONES[name]
    sets = group_sets(shape_sets())
    X, y = sets[key]
    halves, curve_how = efficiency
    curve = OverheadRateRegressor(halves=halves).fit(X, y)
    constant = OverheadRateRegressor(constant=True).fit(X, y)
    use_constant = np.mean(np.abs(constant.loo_log_residuals_)) < \
        np.mean(np.abs(curve.loo_log_residuals_))
    chosen = constant if use_constant else curve
    model = spread.apply(chosen.export())
    loo = scores(y * np.exp(-chosen.loo_log_residuals_), y)
    loso = leave_one_set_out(sets)[set_label(key)]
    held = {
        f"leave-one-out over its own {len(y)} shapes (each predicted by a fit without it)":
            as_plain({"x": {"y": loo}})["x"]["y"],
        "calibrated from 5 of its shapes, the other shapes (perf eval --leave-one-set-out)":
            as_plain({"x": {"y": loso["calibrated-5"]}})["x"]["y"],
    }
    source = MNN_ATTRIBUTION if key[1] == "mnn-cpu" else TF835_ATTRIBUTION
    return {
        "name": name, "kind": "phone", "description": f"{desc}, {key[2]}",
        "sustained_gflops": round(_rate_gflops(model), 2),
        "tile_overhead_s": float(model.overhead_s),
        "model": model.to_dict(),
        "thermal": phone_thermal(),
        "power": {"active_w": 5.0, "idle_w": 0.5, "radio_w": 0.5},
        "assumes": assumes,
        "evaluation": {"held_out": held,
                       "shipped_form": "constant rate (it beat the shape curve on leave-one-out)"
                       if use_constant else "family shape curve (it beat the constant rate)"},
        "provenance": {
            "model": f"t = o + 2mkn / R, R = P / (1 + h_m/m + h_k/k + h_n/n); level P = "
                     f"{model.peak_flops / 1e9:.1f} GFLOP/s and overhead o fitted on the {len(y)} "
                     f"shapes of {source}; "
                     + ("constant rate (h = 0): it beat the family curve on leave-one-out"
                        if use_constant else f"shape curve {curve_how}"),
            "sustained_gflops": f"the model's rate at the {REFERENCE_TILE} tile",
            "tile_overhead_s": "fitted with the level (per-call overhead)",
            "noise": spread.how,
            "thermal": "as snapdragon888: sustained load settles at a 20% throughput loss "
                       "(Galaxy S21 Ultra, Notebookcheck) -- not measured on this phone",
            "power": "assumed: 5 W CPU under all-core load, 0.5 W idle; radio 0.5 W Wi-Fi "
                     "(HotCarbon'25, arXiv 2507.01803)",
        },
    }


def build_all(out_dir: Path = PROFILE_DIR) -> list[Path]:
    """Write every shipped profile; return the paths."""
    write_sets()
    efficiency = arm_halves()
    mlx_rows = import_mlx(SHARED / "mlx-benchmark" / "linear_matmul_ms.csv", backend="cpu")
    spread = ncnn_call_spread()  # every phone's and laptop's per-tile noise
    profiles = [host_profile()]
    profiles += [m_series_profile(name, efficiency, mlx_rows, spread) for name in M_SERIES]
    profiles += [phone_profile(name, efficiency, spread) for name in ("snapdragon888", "pixel7a")]
    profiles += [measured_phone_profile(name, efficiency, spread) for name in MEASURED_PHONES]
    paths = []
    for profile in profiles:
        profile = {k: v for k, v in profile.items() if v is not None}
        path = out_dir / f"{profile['name']}.yaml"
        header = "# Generated by `python -m testbed.perf_model.build`; edit build.py, not this.\n"
        path.write_text(header + yaml.safe_dump(profile, sort_keys=False, width=100))
        paths.append(path)
    return paths


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    for written in build_all():
        print(written)
