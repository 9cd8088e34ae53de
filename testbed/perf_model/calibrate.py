"""Calibrating a profile to one device from a handful of its measured shapes.

``testbed perf calibrate BASE MEASUREMENTS.csv --out PROFILE.yaml`` keeps the base profile's
shape curve (its ``half_m, half_k, half_n``; a base without the ``rate`` form is treated as a
constant rate) and fits the device's own level (peak_flops) and per-call overhead on relative
error (:func:`testbed.perf_model.estimators.calibrate`). The new profile keeps the base's thermal
and power sections, records leave-one-out figures of the measured shapes under
``evaluation.calibration`` and keeps the base's per-tile noise (a call-to-call spread; how
far the fit misses the measured shapes is an error of the model, reported, not drawn per tile).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import yaml

from testbed.perf_model.estimators import calibrate
from testbed.perf_model.evaluate import as_plain, scores
from testbed.perf_model.features import ExportedTimeModel
from testbed.perf_model.measurements import Measurement, MeasurementError, as_arrays
from testbed.perf_model.profiles import DeviceProfile, ProfileError

REFERENCE_TILE = (128, 1024, 128)
MIN_SHAPES = 3


def noise_band(model: ExportedTimeModel, low: float = 0.05, high: float = 0.95
               ) -> tuple[float, float]:
    """The (low, high) quantiles of the model's noise factor measured / predicted."""
    lo = math.exp(float(np.interp(low, model.noise_levels, model.noise_log_quantiles)))
    hi = math.exp(float(np.interp(high, model.noise_levels, model.noise_log_quantiles)))
    return lo, hi


def _profile_problems(raw: dict[str, Any], source: str) -> list[str]:
    """Every problem the profile schema finds in a calibrated profile's plain data."""
    from testbed.perf_model.profile_schema import check_profile
    try:
        check_profile(raw, source)
    except ProfileError as exc:
        return list(exc.problems)
    return []


def rate_gflops(model: ExportedTimeModel, shape: tuple[int, int, int] = REFERENCE_TILE) -> float:
    """The model's GFLOP/s at a shape (overhead included)."""
    m, k, n = shape
    return 2.0 * m * k * n / model.predict_one(m, k, n) / 1e9


def calibrate_profile(base: DeviceProfile, rows: list[Measurement], source: str,
                      device: str | None = None, name: str | None = None,
                      backend: str | None = None) -> tuple[str, str]:
    """(profile YAML text, one-line summary) of ``base`` calibrated on ``rows``."""
    if backend is not None:
        backends = sorted({r.backend for r in rows})
        rows = [r for r in rows if r.backend == backend]
        if not rows:
            raise MeasurementError(source, [f"no rows of backend {backend!r}; the file has "
                                            f"{', '.join(backends)}"])
    devices = sorted({r.device for r in rows})
    if device is not None:
        rows = [r for r in rows if r.device == device]
        if not rows:
            raise MeasurementError(source, [f"no rows of device {device!r}; the file has "
                                            f"{', '.join(devices)}"])
    elif len(devices) > 1:
        raise MeasurementError(source, [f"rows of {len(devices)} devices "
                                        f"({', '.join(devices)}); choose one with --device"])
    # one device measured with two libraries (or precisions, thread counts) is two devices to
    # the model: a level fitted across them would fit neither
    sets = sorted({(r.backend, r.dtype, str(r.threads)) for r in rows})
    if len(sets) > 1:
        raise MeasurementError(source, [
            f"rows of {len(sets)} (backend, dtype, threads) sets of {rows[0].device}: "
            f"{'; '.join('/'.join(s) for s in sets)}; calibrate from one set (--backend "
            f"chooses the library; keep one dtype and thread count in the file)"])
    X, y = as_arrays(rows)
    if len(y) < MIN_SHAPES:
        raise MeasurementError(source, [f"{len(y)} measured shape(s); calibration needs at "
                                        f"least {MIN_SHAPES} (level, overhead and one to check "
                                        f"them)"])
    if base.model is None:
        halves_model = ExportedTimeModel(features=("half_m", "half_k", "half_n"),
                                         coef=(0.0, 0.0, 0.0), intercept=0.0, overhead_s=0.0,
                                         peak_flops=1.0, bandwidth_bytes_s=1.0, form="rate")
    else:
        halves_model = base.model
    fitted = calibrate(halves_model, X, y, base_name=base.name)
    model = fitted.export()
    inherit_noise = base.model is not None and bool(base.model.noise_levels)
    if inherit_noise:  # a tile's call-to-call spread, not the fit's misses across shapes
        assert base.model is not None
        model = replace(model, noise_levels=base.model.noise_levels,
                        noise_log_quantiles=base.model.noise_log_quantiles)
    loo = scores(y * np.exp(-fitted.loo_log_residuals_), y)
    new_name = name or f"{base.name}-calibrated"
    raw: dict[str, Any] = {k: v for k, v in base.raw.items()
                           if k not in ("model", "evaluation", "provenance")}
    raw["name"] = new_name
    raw["description"] = (f"{base.description} -- calibrated on {len(y)} shapes of "
                          f"{rows[0].device} ({rows[0].backend}, {rows[0].dtype}, "
                          f"{rows[0].threads or 'unstated'} thread(s))")
    raw["sustained_gflops"] = round(rate_gflops(model), 3)
    raw["tile_overhead_s"] = float(model.overhead_s)
    raw["model"] = model.to_dict()
    raw["evaluation"] = {"calibration": {
        "shapes": len(y), "leave_one_out": as_plain({"x": {"loo": loo}})["x"]["loo"],
        "shape_curve": fitted.selected_,
        "note": "each measured shape predicted by the level and overhead fitted on the others"}}
    base_prov = base.provenance.get("model", "") if base.provenance else ""
    raw["provenance"] = {
        **{k: v for k, v in (base.provenance or {}).items() if k != "model"},
        "model": (f"calibrated with `testbed perf calibrate {base.name} {source}`: shape curve "
                  f"(half_m, half_k, half_n) = {tuple(model.coef)} ({fitted.selected_}) from "
                  f"{base.name} "
                  f"({base_prov[:300]}{'...' if len(base_prov) > 300 else ''}); "
                  f"level peak_flops = {model.peak_flops / 1e9:.2f} GFLOP/s "
                  f"and overhead {model.overhead_s * 1e6:.1f} us fitted on {len(y)} shapes of "
                  f"{rows[0].device} ({rows[0].provenance})"),
        "noise": (f"the base profile {base.name}'s: "
                  f"{(base.provenance or {}).get('noise', 'not stated in its provenance')}"
                  if inherit_noise else "spread of the leave-one-out log(measured / predicted) "
                  "of the calibration shapes, centred (the base profile has none)"),
    }
    problems = _profile_problems(raw, source)
    if problems:  # a profile that would not load is not written
        raise MeasurementError(source, [f"the profile calibrated on these rows would be refused: "
                                        f"{p}" for p in problems])
    header = (f"# Calibrated by `testbed perf calibrate {base.name} {source}` from "
              f"{len(y)} shapes\n")
    text = header + yaml.safe_dump(raw, sort_keys=False, width=100)
    summary = (f"{new_name}: {fitted.selected_}, peak {model.peak_flops / 1e9:.2f} GFLOP/s, "
               f"overhead "
               f"{model.overhead_s * 1e6:.1f} us, {raw['sustained_gflops']} GFLOP/s at "
               f"{REFERENCE_TILE}; leave-one-out over {len(y)} shapes: {loo.within_10:.0f}% "
               f"within ±10%, {loo.within_25:.0f}% within ±25%, {loo.within_50:.0f}% within "
               f"±50%, median p/t {loo.median_ratio:.2f}")
    return text, summary
