"""``testbed perf measure|import|fit|calibrate|predict|eval|show``: GEMM timings to device profiles.

Exit codes as in :mod:`testbed.cli`: 0 ok, 1 failure while running, 2 bad input.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Callable

import yaml
from pydantic import AfterValidator, ConfigDict, ValidationError

from testbed.errors import EXIT_BAD_INPUT, EXIT_OK, InputError
from testbed.perf_model.features import MAX_DIMENSION
from testbed.perf_model.measurements import (
    MIN_MODEL_SECONDS,
    Measurement,
    MeasurementError,
    as_arrays,
    read_csv_lines,
    read_measurements,
    row_problems,
)
from testbed.perf_model.profiles import (
    ProfileError,
    find_profile,
    list_profiles,
    load_profile,
    profile_name_problem,
)
from testbed.schema import Schema, problem_pairs
from testbed.units import SEED, format_bytes, int_arg, number_arg
from testbed.user_paths import checked_output, path_arg, written_whole


def _measure(args: argparse.Namespace) -> int:
    from testbed.perf_model.measure import (
        LocalNumpyRunner,
        Shape,
        SweepProgress,
        measure,
        sweep_shapes,
    )
    from testbed.perf_model.measurements import write_measurements
    size = "full" if args.full else "quick"
    runner = LocalNumpyRunner(device=args.device, threads=args.threads,
                              min_sample_s=args.min_sample_s)
    info = runner.describe()
    try:
        checked_output(args.out, "--out", [("--shapes", args.shapes)])
        # before minutes of timing: a name the rows cannot hold is refused now, not after
        # writing a file that perf fit refuses (an empty name) or reads as no rows ('#...')
        _device_name_check(args.device, str(info["backend"]))
        if args.shapes:
            # a handful of shapes (e.g. the 5 to calibrate a profile from), op 'gemm': not said
            shapes = [Shape("gemm", m, k, n) for m, k, n in read_shapes(args.shapes)]
            _memory_check(args.shapes, shapes, args.dtype)
            what = f"--shapes {args.shapes}"
        else:
            shapes = sweep_shapes(size, seed=args.seed)
            what = f"--{size} --seed {args.seed}"
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    progress = SweepProgress(len(shapes), args.passes,
                             say=lambda line: print(line, file=sys.stderr, flush=True))
    progress.start(f"measuring {len(shapes)} shape(s) x {args.passes} pass(es) x "
                   f"{args.repeats} sample(s) on {info['cpu_model']} ({info['threads']} "
                   f"thread(s)); {args.out} is written at the end")
    rows = measure(shapes, runner, dtype=args.dtype,
                   warmup=args.warmup, repeats=args.repeats, passes=args.passes,
                   statistic=args.statistic, on_timed=progress)
    write_measurements(args.out, rows, comments=[
        f"testbed perf measure {what}: {info['cpu_model']}, "
        f"{info['backend']}, {info['threads']} thread(s)",
        f"statistic: {args.statistic} of {args.passes} round-robin passes x {args.repeats} "
        f"samples (each >= {args.min_sample_s:g} s of calls) after {args.warmup} warm-up "
        f"call(s) per pass; times in seconds"])
    print(f"{args.out}: {len(rows)} shapes measured on {info['cpu_model']} "
          f"({info['threads']} thread(s), {info['backend']})")
    return EXIT_OK


def _device_name_check(device: str, backend: str) -> None:
    """InputError naming --device when a row of that device would not read back (the reader's
    own checks, :func:`written_row_problems`)."""
    from testbed.perf_model.measurements import written_row_problems
    probe = Measurement(device=device, backend=backend, dtype="float32", threads=1, op="gemm",
                        m=1, k=1, n=1, seconds=1.0, provenance="testbed perf measure")
    problems = written_row_problems(probe)
    if problems:
        raise InputError("--device", [message for _, message in problems])


def _write_text(out: str, text: str) -> None:
    with written_whole(Path(out)) as handle:
        handle.write(text)


def _write_model_timings(out: str, rows: list[Any]) -> None:
    from dataclasses import asdict, fields

    from testbed.perf_model.importers import ModelTiming
    with written_whole(Path(out)) as handle:
        writer = csv.writer(handle)
        names = [f.name for f in fields(ModelTiming)]
        writer.writerow(names)
        for r in rows:
            writer.writerow([asdict(r)[n] for n in names])


def _gemm_sources() -> dict[str, Any]:
    from testbed.perf_model import importers
    return {"mnn": (importers.import_mnn, importers.MNN_ATTRIBUTION),
            "mmperf": (importers.import_mmperf, importers.MMPERF_ATTRIBUTION),
            "tf-sd835": (importers.import_tf_sd835, importers.TF835_ATTRIBUTION)}


def _model_sources() -> dict[str, Any]:
    from testbed.perf_model import importers
    return {"ncnn": importers.import_ncnn, "paddle-lite": importers.import_paddle_lite,
            "xnnpack": importers.import_xnnpack}


_GEMM_SOURCES: dict[str, Any] = {}
_MODEL_SOURCES: dict[str, Any] = {}


# the file of ../shared/data each `perf import` source reads (its --help lists them)
IMPORT_FILES = {
    "mlx": "mlx-benchmark/linear_matmul_ms.csv", "deepbench": "deepbench/device_gemm.csv",
    "vfpbench": "vfpbench/log (the directory, or one log)",
    "mnn": "mnn/mnn_gemm_speed_parsed.csv", "mmperf": "mmperf/mmperf_apple_only.csv",
    "tf-sd835": "tf-opencl-sd835/opencl-matmul_README.md",
    "ncnn": "ncnn/ncnn_benchmark_parsed.csv", "paddle-lite": "paddle-lite/benchmark.md",
    "xnnpack": "xnnpack/README_performance_section.md"}


def _import(args: argparse.Namespace) -> int:
    try:  # the source read and checked whole before --out is written
        checked_output(args.out, "--out", _import_inputs(args.source, args.src))
        if args.backend is not None and args.source != "mlx":
            # it was ignored: `perf import mmperf ... --backend mmperf-ruy` wrote every backend
            raise InputError("--backend", [
                f"only an mlx import keeps one backend; {args.source} imports every row of the "
                f"source (choose a backend later: perf fit/eval/calibrate --backend)"])
        rows, write = _imported(args.source, args.src, args.backend or "cpu")
        if not rows:  # an empty output is never what an import was run for
            raise InputError(args.src, [f"no rows to import from it as {args.source}"])
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    write(args.out, rows)
    print(f"{args.out}: {len(rows)} rows from {args.source}")
    return EXIT_OK


def _import_inputs(source: str, src: str) -> list[tuple[str, str | Path]]:
    """The files ``testbed perf import`` reads: the source, or a vfpbench directory's logs."""
    inputs: list[tuple[str, str | Path]] = [("src", src)]
    if source == "vfpbench" and Path(src).is_dir():
        inputs += [("src", log) for log in sorted(Path(src).glob("*.txt"))]
    return inputs


def _imported(source: str, src: str, backend: str) -> tuple[list[Any], Callable[..., None]]:
    """The rows of one ``testbed perf import`` source and the function that writes them."""
    _GEMM_SOURCES.update(_gemm_sources())
    _MODEL_SOURCES.update(_model_sources())
    from testbed.perf_model import importers
    from testbed.perf_model.measurements import write_measurements
    if source == "mlx":
        return (importers.import_mlx(src, backend=None if backend == "all" else backend),
                partial(write_measurements, comments=[importers.MLX_ATTRIBUTION]))
    if source == "deepbench":
        return (importers.import_deepbench(src),
                partial(write_measurements, comments=[importers.DEEPBENCH_ATTRIBUTION]))
    if source in _GEMM_SOURCES:
        reader, attribution = _GEMM_SOURCES[source]
        return reader(src), partial(write_measurements, comments=[attribution])
    if source in _MODEL_SOURCES:
        return _MODEL_SOURCES[source](src), _write_model_timings
    logs = sorted(Path(src).glob("*.txt")) if Path(src).is_dir() else [Path(src)]
    if not logs:
        raise InputError(src, [f"no *.txt files in {src} (vfpbench logs are .txt files)"])
    return [rec for path in logs for rec in importers.import_vfpbench(path)], importers.write_peaks


@contextmanager
def _fitted_on(path: str, note: str = "") -> Iterator[None]:
    """A model's refusal of the rows it is fitted on (too few of them) as a MeasurementError
    naming the file they came from: the rows are the file's, so is the problem."""
    try:
        yield
    except InputError:
        raise
    except ValueError as exc:
        raise MeasurementError(path, [f"{exc}{note}"]) from None


def _load(path: str, device: str | None, backend: str | None = None):
    rows = one_set(path, read_measurements(path, min_seconds=MIN_MODEL_SECONDS), device,
                   backend)
    return as_arrays(rows)


def _chosen(path: str, rows: list[Measurement], device: str | None,
            backend: str | None) -> list[Measurement]:
    """The rows of ``--device`` and ``--backend`` (each when given); MeasurementError naming
    what the file has when none is left."""
    for column, wanted in (("device", device), ("backend", backend)):
        if wanted is None:
            continue
        have = sorted({getattr(r, column) for r in rows})
        rows = [r for r in rows if getattr(r, column) == wanted]
        if not rows:
            raise MeasurementError(path, [f"no rows of {column} {wanted!r}; "
                                          + (f"the rows of device {device!r} have "
                                             if column == "backend" and device else
                                             "the file has ")
                                          + ", ".join(have)])
    return rows


def _chosen_text(device: str | None, backend: str | None) -> str:
    """' of device D, backend B' for the options given ('' for none)."""
    parts = [f"{what} {value!r}" for what, value in (("device", device), ("backend", backend))
             if value]
    return f" of {', '.join(parts)}" if parts else ""


def one_set(path: str, rows: list[Measurement], device: str | None,
            backend: str | None) -> list[Measurement]:
    """The rows ``perf fit`` and ``perf eval`` fit a model on: one (device, backend, dtype,
    threads) set. A file of several sets (``tests/data/perf_sets.csv``: 9 of them) is refused
    unless --device and --backend pick one: one model across devices or libraries fits none,
    and its held-out figures say nothing about any of them."""
    rows = _chosen(path, rows, device, backend)
    sets = sorted({(r.device, r.backend, r.dtype, str(r.threads)) for r in rows})
    if len(sets) > 1:
        shown = "; ".join("/".join(s) for s in sets[:12]) + ("; ..." if len(sets) > 12 else "")
        narrowed = len({(d, b) for d, b, _, _ in sets}) == 1
        raise MeasurementError(path, [
            f"rows of {len(sets)} (device, backend, dtype, threads) sets: {shown}; a model is "
            f"fitted on one set: "
            + ("keep one dtype and thread count in the file" if narrowed
               else "choose one with --device and --backend")
            + " (perf eval --leave-one-set-out compares sets)"])
    return rows


def _fit(args: argparse.Namespace) -> int:
    from testbed.perf_model.estimators import (
        BlasCostRegressor,
        GemmTimeRegressor,
        OverheadRateRegressor,
    )
    from testbed.perf_model.profile_schema import model_problems
    try:
        checked_output(args.out, "--out", [("measurements", args.measurements)])
        X, y = _load(args.measurements, args.device, args.backend)
        estimator = {"cost": BlasCostRegressor, "ridge": GemmTimeRegressor,
                     "rate": OverheadRateRegressor}[args.model]()
        chosen = _chosen_text(args.device, args.backend)
        with _fitted_on(args.measurements, f" (rows{chosen})" if chosen else ""):
            model = estimator.fit(X, y).export()
        problems = model_problems(model.to_dict())
        if problems:  # what a profile would refuse is not written
            raise MeasurementError(args.measurements, [
                f"the model fitted on these rows would be refused in a profile: {p}"
                for p in problems])
        _write_text(args.out, yaml.safe_dump({"model": model.to_dict()}, sort_keys=False))
    except (MeasurementError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{args.out}: model fitted on {len(y)} shapes (put its 'model' section in a profile)")
    return EXIT_OK


def _eval(args: argparse.Namespace) -> int:
    from testbed.perf_model.evaluate import (
        as_plain,
        evaluate,
        format_sets_table,
        format_table,
        group_sets,
        leave_one_set_out,
    )
    try:
        if args.leave_one_set_out:
            rows = _chosen(args.measurements,
                           read_measurements(args.measurements, min_seconds=MIN_MODEL_SECONDS),
                           args.device, args.backend)
            sets = group_sets(rows)
            if len(sets) < 2:
                raise MeasurementError(args.measurements, [
                    f"leave one set out needs at least two per-shape float sets of >= 6 "
                    f"shapes, found {len(sets)}"])
            with _fitted_on(args.measurements):
                result = leave_one_set_out(sets)
            print(json.dumps(as_plain(result), indent=1) if args.json
                  else format_sets_table(result) + "\n" + format_model_level())
            return EXIT_OK
        X, y = _load(args.measurements, args.device, args.backend)
        with _fitted_on(args.measurements, f"; each split fits on 70-75% of the {len(y)} rows"
                        + _chosen_text(args.device, args.backend)):
            result = evaluate(X, y, seed=args.seed)
    except (MeasurementError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(as_plain(result), indent=1) if args.json else format_table(result))
    return EXIT_OK


MODEL_LEVEL = "ncnn vision_transformer (model level)"


def format_model_level(names: tuple[str, ...] = ("snapdragon888", "pixel7a")) -> str:
    """The shipped derived phone profiles' model-level check (stored in their evaluation)."""
    lines = []
    for name in names:
        check = load_profile(name).evaluation.get("held_out", {}).get(MODEL_LEVEL)
        if not isinstance(check, dict):
            continue
        predicted = check.get("predicted_gemm_ms", {})
        lines.append(f"model level, profile {name}: {MODEL_LEVEL}, {check.get('gemms')} GEMMs, "
                     f"{check.get('gflop')} GFLOP; predicted fp32 GEMM ms "
                     + ", ".join(f"{k} {v}" for k, v in predicted.items()))
        lines.append(f"  {'ncnn CPU row':<52}{'measured ms':>12}{'pred/meas (fp16-eq)':>21}")
        for label, row in check.items():
            if isinstance(row, dict) and "measured_ms" in row:
                mark = "  in-sample" if row.get("in_sample") else ""
                lines.append(f"  {label[:52]:<52}{row['measured_ms']:>12.1f}"
                             f"{row['as_fp16_over_measured']:>21.2f}{mark}")
        if "in_the_data" in check:
            lines.append(f"  in the data: {check['in_the_data']}")
    return "\n".join(lines)


def _calibrate(args: argparse.Namespace) -> int:
    from testbed.perf_model.calibrate import calibrate_profile
    try:
        checked_output(args.out, "--out", [("base_profile", find_profile(args.base_profile)),
                                           ("measurements", args.measurements)])
        name = args.name or Path(args.out).stem
        problem = profile_name_problem(name)
        if problem:
            raise InputError("--name" if args.name else f"--out {args.out}", [
                problem if args.name else f"its stem {problem}; give the profile a name with "
                                          f"--name"])
        base = load_profile(args.base_profile)
        rows = read_measurements(args.measurements, min_seconds=MIN_MODEL_SECONDS)
        text, summary = calibrate_profile(base, rows, args.measurements, device=args.device,
                                          name=name, backend=args.backend)
        _write_text(args.out, text)
    except (InputError, MeasurementError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{args.out}: {summary}")
    return EXIT_OK


def _dimension(value: int) -> int:
    if not 1 <= value <= MAX_DIMENSION:
        raise ValueError(f"expected a positive integer up to {MAX_DIMENSION}, got {value}")
    return value


class ShapeRow(Schema):
    """One GEMM shape (a ``--shapes`` row or ``M K N`` on the command line); other columns pass."""

    model_config = ConfigDict(extra="ignore", frozen=True, str_strip_whitespace=True)

    m: Annotated[int, AfterValidator(_dimension)]
    k: Annotated[int, AfterValidator(_dimension)]
    n: Annotated[int, AfterValidator(_dimension)]


def _memory_check(path: str, shapes: list[Any], dtype: str) -> None:
    """InputError naming the shapes whose operands and result do not fit in the memory free
    now: a 100,000-cube shape ended minutes later in numpy's MemoryError as a traceback. The
    operands are drawn in float64 and then cast (LocalNumpyRunner)."""
    import psutil

    item = 4 if dtype == "float32" else 8
    free = psutil.virtual_memory().available
    too_big = [f"{s.m} x {s.k} x {s.n}: its operands and result need "
               f"{format_bytes(need)}, and {format_bytes(free)} is free"
               for s in shapes
               if (need := 8 * max(s.m * s.k, s.k * s.n)
                   + item * (s.m * s.k + s.k * s.n + s.m * s.n)) > free]
    if too_big:
        raise InputError(f"--shapes {path}", too_big[:10] + (
            [f"and {len(too_big) - 10} more"] if len(too_big) > 10 else []))


def read_shapes(path: str) -> list[tuple[int, int, int]]:
    """(m, k, n) rows of a CSV with columns m, k, n (others ignored); InputError with lines."""
    problems: list[str] = []
    shapes: list[tuple[int, int, int]] = []
    for line_no, fields in read_csv_lines(path, ("m", "k", "n"), None, "shape",
                                          max_line_chars=4096):
        try:
            row = ShapeRow.model_validate(fields)
            shapes.append((row.m, row.k, row.n))
        except ValidationError as exc:
            problems.extend(row_problems(exc, line_no, ShapeRow))
    if problems:
        raise InputError(path, problems)
    if not shapes:
        raise InputError(path, ["no shape rows after the header"])
    return shapes


def predict_seconds(profile: Any, shapes: list[tuple[int, int, int]]) -> list[float]:
    """What an emulated device of this profile takes per GEMM: no noise, cold (no throttle)."""
    from testbed.emulator.device_model import device_model_for
    out = []
    for m, k, n in shapes:
        device = device_model_for(profile, seed=0, noise=False)  # a fresh, cold device
        out.append(device.tile_cost(m, k, n, "forward", 0.0).seconds)
    return out


def _command_line_shape(mkn: list[str]) -> tuple[int, int, int]:
    """``M K N`` given on the command line as a shape; InputError naming M, K or N."""
    try:
        row = ShapeRow.model_validate(dict(zip("mkn", mkn)))
    except ValidationError as exc:
        raise InputError("command line", [f"{path.upper()}: {message}"
                                          for path, message in problem_pairs(exc)]) from None
    return row.m, row.k, row.n


def _predict(args: argparse.Namespace) -> int:
    try:
        profile = load_profile(args.profile)
        if args.shapes:
            if args.mkn:
                raise InputError("command line", ["give M K N or --shapes FILE, not both"])
            shapes = read_shapes(args.shapes)
        elif len(args.mkn) == 3:
            shapes = [_command_line_shape(args.mkn)]
        else:
            raise InputError("command line", [
                f"expected one shape, M K N (three positive integers), or --shapes FILE.csv for "
                f"several; got {len(args.mkn)} value(s)"])
    except (InputError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    seconds = predict_seconds(profile, shapes)
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(["m", "k", "n", "seconds"])
    for (m, k, n), t in zip(shapes, seconds):
        # every profile that loads gives every shape up to MAX_DIMENSION a finite time: the
        # profile schema's ranges bound each term of every form (profile_schema's docstring)
        assert math.isfinite(t), f"{profile.path}: {t} s for {m} x {k} x {n}"
        writer.writerow([m, k, n, f"{t:.6g}"])
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    if args.list and args.profile:  # the name was ignored: the whole list came out
        print(f"error: give a profile or --list, not both (got {args.profile!r} and --list)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.list or not args.profile:
        for name in list_profiles():
            profile = load_profile(name)
            print(f"{name:<16}{profile.kind:<8}{profile.sustained_gflops:>9.2f} GFLOP/s  "
                  f"{profile.description}")
        return EXIT_OK
    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{profile.name} ({profile.kind}): {profile.description}")
    print(f"  file: {profile.path}")
    print(f"  rate at a 128x1024x128 tile: {profile.sustained_gflops} GFLOP/s; "
          f"overhead {profile.tile_overhead_s * 1e6:.1f} us/tile")
    if profile.thermal is not None:
        from testbed.emulator.thermal import steady_state
        idle, active = ((profile.power.idle_w, profile.power.active_w) if profile.power
                        else (0.0, 0.0))
        t_c, speed = steady_state(profile.thermal, idle, active)
        print(f"  thermal: tau {profile.thermal.tau_s:.0f} s, sustained load settles at "
              f"{t_c:.1f} C, {100 * (1 - speed):.1f}% slowdown")
    if profile.power is not None:
        print(f"  power: active {profile.power.active_w} W, idle {profile.power.idle_w} W, "
              f"radio {profile.power.radio_w} W")
    if profile.model is not None and profile.model.noise_levels:
        print(noise_line(profile))
    evaluation = profile.evaluation if isinstance(profile.evaluation, dict) else {}
    rest = dict(evaluation)  # what the summary below does not print
    held = dict(rest.pop("held_out", None) or {})
    calibration = evaluation.get("calibration")
    if isinstance(calibration, dict) and isinstance(calibration.get("leave_one_out"), dict):
        # a `perf calibrate` profile: each calibration shape predicted without it
        held[f"leave-one-out over the {calibration.get('shapes')} calibration shapes "
             f"({calibration.get('shape_curve')})"] = calibration["leave_one_out"]
        rest["calibration"] = {k: v for k, v in calibration.items() if k != "leave_one_out"}
    if held:
        print("accuracy on data it was not fitted on:")
        for line in held_out_lines(held):
            print(line)
    else:
        print("accuracy on data it was not fitted on: none measured (see evaluation)")
    print("provenance:")
    for key, text in profile.provenance.items():
        print(f"  {key}: {text}")
    rest = {k: v for k, v in rest.items() if v not in ({}, None)}
    compared = {k: v for k, v in rest.items() if isinstance(v, dict) and v
                and all(_is_scores(fig) for fig in v.values())}
    if compared:  # `perf eval`'s splits, every model on them: the fitted one is shipped above
        print("every model on the same splits (testbed perf eval):")
        for split, models in compared.items():
            print(f"  {split}:")
            for name, fig in models.items():
                print(f"    {name}: " + ("as above (the shipped model)" if fig in held.values()
                                         else _scores_text(fig)))
    rest = {k: v for k, v in rest.items() if k not in compared}
    if rest:  # the figures above are not repeated here
        print("evaluation (other figures):")
        print("  " + yaml.safe_dump(rest, sort_keys=False).rstrip("\n").replace("\n", "\n  "))
    return EXIT_OK


def noise_line(profile: Any) -> str:
    """The band of the per-tile noise factor an emulated device of ``profile`` draws from.

    It is not the model's error across shapes unless the profile says so: a phone's or laptop's
    noise is one shape's call-to-call spread (``provenance.noise``), while the shapes held out of
    its fit are 0.9 to 6 times off (docs/perf-models.md, "Noise is a call-to-call spread")."""
    from testbed.perf_model.calibrate import noise_band
    low, high = noise_band(profile.model)
    band = (f"  per-tile noise band (5-95% of the factor emulated tiles draw their time from): "
            f"{100 * (low - 1):+.0f}% .. {100 * (high - 1):+.0f}%")
    source = str((profile.provenance or {}).get("noise", ""))
    if "per-call spread" in source:
        return (band + "; one shape's call-to-call spread (provenance: noise), not the model's "
                       "error across shapes (accuracy below)")
    return band + "; what it is: provenance, noise" if source else band


_SCORES = (("n", "n {}"), ("within_5", "±5% {}%"), ("within_10", "±10% {}%"),
           ("within_15", "±15% {}%"), ("within_25", "±25% {}%"), ("within_50", "±50% {}%"),
           ("mape", "MAPE {}%"), ("rmspe", "RMSPE {}%"), ("median_ratio", "median p/t {}"))


def _is_scores(fig: Any) -> bool:
    return isinstance(fig, dict) and "within_25" in fig


def _scores_text(fig: dict[str, Any]) -> str:
    return ", ".join(text.format(fig[key]) for key, text in _SCORES if key in fig)


def held_out_lines(held: dict[str, Any]) -> list[str]:
    """``evaluation.held_out`` as lines: one per figure set, one per model-level row."""
    lines = []
    for label, fig in held.items():
        if _is_scores(fig):
            lines.append(f"  {label}: {_scores_text(fig)}")
        elif isinstance(fig, dict):  # model level: one line per measured row
            lines.append(f"  {label}:")
            for row, val in fig.items():
                if isinstance(val, dict) and "measured_ms" in val:
                    spread = val.get("spread_ms")
                    extra = ", ".join(f"{k} {v}" for k, v in val.items()
                                      if k not in ("measured_ms", "spread_ms"))
                    within = (f" (min {spread[0]}, max {spread[1]})"
                              if isinstance(spread, list) and len(spread) == 2 else "")
                    lines.append(f"    {row}: measured {val['measured_ms']} ms{within}, {extra}")
                else:
                    lines.append(f"    {row}: {val}")
        else:
            lines.append(f"  {label}: {fig}")
    return lines


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``testbed perf ...``."""
    perf = subparsers.add_parser(
        "perf", help="GEMM measurements, performance models, profiles",
        description="GEMM measurements, performance models and device profiles: time GEMMs "
                    "here (measure) or import published ones (import), fit and evaluate a time "
                    "model (fit, eval), make a device's profile from a few measured shapes "
                    "(calibrate), and ask a profile (predict, show). docs/perf-models.md says "
                    "more.")
    sub = perf.add_subparsers(dest="perf_command", metavar="PERF_COMMAND", required=True)

    p = sub.add_parser("measure", help="time numpy A @ B over training-GEMM tile shapes here")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="150 shapes, about a minute with the "
                      "default passes (default)")
    size.add_argument("--full", action="store_true", help="600 shapes")
    size.add_argument("--shapes", metavar="FILE.csv", type=path_arg,
                      help="time these shapes instead (columns m, k, n; e.g. 5 to calibrate)")
    p.add_argument("--out", default="perf_measurements.csv", type=path_arg,
                   help="output CSV, written at the end (default: perf_measurements.csv)")
    p.add_argument("--device", default="host",
                   help="device name written into the rows (default host)")
    p.add_argument("--threads", type=int_arg(1, 1024), default=1,
                   help="BLAS threads, 1 to 1024 (default 1, as agents use)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="element type of the matrices (default float32)")
    p.add_argument("--warmup", type=int_arg(0, 1000), default=1,
                   help="warm-up calls per shape and pass, 0 to 1000 (default 1)")
    p.add_argument("--repeats", type=int_arg(1, 10_000), default=3,
                   help="samples per shape and pass, 1 to 10,000 (default 3)")
    p.add_argument("--passes", type=int_arg(1, 100_000), default=40,
                   help="sweeps over all shapes, round-robin, 1 to 100,000 (default 40; quick: "
                        "~1.3 s each here)")
    p.add_argument("--min-sample-s", type=number_arg(0, 60), default=2e-4, metavar="S",
                   help="a sample loops the call until it lasts this long, seconds, 0 to 60 "
                        "(default 0.0002)")
    p.add_argument("--statistic", choices=("min", "median"), default="min",
                   help="figure per shape over its samples (default min: noise only adds "
                        "time)")
    p.add_argument("--seed", type=SEED, default=0,
                   help="seed of the --quick/--full shape draw (default 0)")
    p.set_defaults(func=_measure)

    p = sub.add_parser(
        "import", help="convert a published benchmark's file into the measurement CSV",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Convert a published benchmark's file into the measurement CSV that perf\n"
                    "fit, eval and calibrate read (vfpbench: peak GFLOPS; ncnn, paddle-lite and\n"
                    "xnnpack: whole-model times), with its attribution. The copies this project\n"
                    "uses are in ../shared/data (SOURCES.md there); the file each source takes:\n"
                    + "".join(f"\n  {name:<12} {file}" for name, file in IMPORT_FILES.items()))
    p.add_argument("source", choices=tuple(IMPORT_FILES),
                   help="mnn/mmperf/tf-sd835 give per-shape GEMM rows; ncnn, paddle-lite and "
                        "xnnpack whole-model times")
    p.add_argument("src", type=path_arg,
                   help="source file (vfpbench: a log or the log directory)")
    p.add_argument("--out", required=True, type=path_arg,
                   help="CSV to write (replaced once the source is read whole; missing "
                        "directories are made)")
    p.add_argument("--backend", help="mlx only: the backend to keep, or 'all' (default: cpu)")
    p.set_defaults(func=_import)

    for name, func, text in (
            ("fit", _fit, "fit a GEMM time model (--model cost, rate or ridge) on one set of "
                          "rows; write its model section"),
            ("eval", _eval, "held-out scores of every model family (the cost model as "
                            "'fitted', rate, constant, ridge, roofline) on one set of rows")):
        p = sub.add_parser(name, help=text)
        p.add_argument("measurements", type=path_arg, help="measurement CSV")
        p.add_argument("--device", help="only rows of this device (a file of several "
                                        "devices needs it)")
        p.add_argument("--backend", help="only rows of this backend/library (a file of several "
                                         "needs it)")
        if name == "fit":
            p.add_argument("--out", required=True, type=path_arg,
                           help="YAML file for the model section")
            p.add_argument("--model", choices=("cost", "ridge", "rate"), default="cost",
                           help="cost: blocked-BLAS cost model (default, the host); rate: "
                                "overhead + monotone capped rate (phones, laptops); ridge: "
                                "log-space ridge on smooth features")
        else:
            p.add_argument("--seed", type=SEED, default=0,
                           help="seed of the random held-out split (default 0)")
            p.add_argument("--json", action="store_true",
                           help="print the figures as JSON (adds RMSPE)")
            p.add_argument("--leave-one-set-out", action="store_true",
                           help="hold out each (device, backend, dtype, threads) set in turn: "
                                "calibrated from 5 of its shapes, and every other set's profile")
        p.set_defaults(func=func)

    p = sub.add_parser("calibrate", help="a device profile from 3 or more (e.g. 5) measured "
                                         "shapes of it: the "
                                         "base profile's shape curve, the device's own level "
                                         "and overhead")
    p.add_argument("base_profile", type=path_arg,
                   help="profile name or path whose shape curve to keep")
    p.add_argument("measurements", type=path_arg,
                   help="measurement CSV (testbed perf measure / adb measure)")
    p.add_argument("--out", required=True, type=path_arg, help="profile YAML to write")
    p.add_argument("--device", help="only rows of this device (default: the file's only one)")
    p.add_argument("--backend", help="only rows of this backend/library (a file may hold "
                                     "several of one device, e.g. mmperf's)")
    p.add_argument("--name", help="name of the new profile (default: the --out file's stem)")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("predict", help="seconds an emulated device of a profile takes for one "
                                       "GEMM (no noise, cold); CSV m,k,n,seconds",
                       # one shape or a file: argparse's own usage would say [M K N ...]
                       usage="%(prog)s [-h] profile (M K N | --shapes FILE.csv)")
    p.add_argument("profile", type=path_arg, help="profile name or path")
    p.add_argument("mkn", nargs="*", metavar="M K N",
                   help="one GEMM, C[M x N] = A[M x K] B[K x N] (several: --shapes)")
    p.add_argument("--shapes", metavar="FILE.csv", type=path_arg,
                   help="CSV with columns m, k, n (one GEMM per row)")
    p.set_defaults(func=_predict)

    p = sub.add_parser("show", help="a profile's provenance and evaluation figures")
    p.add_argument("profile", nargs="?", type=path_arg,
                   help="profile name or path (none: the list)")
    p.add_argument("--list", action="store_true",
                   help="list shipped profiles: name, kind, GFLOP/s at a 128x1024x128 tile, "
                        "description")
    p.set_defaults(func=_show)
    for action in sub._choices_actions:  # `perf measure --help` said no word of what it does
        parser = sub.choices[action.dest]
        if parser.description is None and action.help:
            parser.description = action.help[0].upper() + action.help[1:] + "."
