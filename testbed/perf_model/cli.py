"""``testbed perf measure|import|fit|eval|show``: measure GEMMs, import public data, fit, inspect.

Exit codes as in :mod:`testbed.cli`: 0 ok, 1 failure while running, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from testbed.perf_model.measurements import MeasurementError, as_arrays, read_measurements
from testbed.perf_model.profiles import ProfileError, list_profiles, load_profile

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2


def _measure(args: argparse.Namespace) -> int:
    from testbed.perf_model.measure import LocalNumpyRunner, measure, sweep_shapes
    from testbed.perf_model.measurements import write_measurements
    size = "full" if args.full else "quick"
    runner = LocalNumpyRunner(device=args.device, threads=args.threads,
                              min_sample_s=args.min_sample_s)
    rows = measure(sweep_shapes(size, seed=args.seed), runner, dtype=args.dtype,
                   warmup=args.warmup, repeats=args.repeats, passes=args.passes,
                   statistic=args.statistic)
    info = runner.describe()
    write_measurements(args.out, rows, comments=[
        f"testbed perf measure --{size} --seed {args.seed}: {info['cpu_model']}, "
        f"{info['backend']}, {info['threads']} thread(s)",
        f"statistic: {args.statistic} of {args.passes} round-robin passes x {args.repeats} "
        f"samples (each >= {args.min_sample_s:g} s of calls) after {args.warmup} warm-up "
        f"call(s) per pass; times in seconds"])
    print(f"{args.out}: {len(rows)} shapes measured on {info['cpu_model']} "
          f"({info['threads']} thread(s), {info['backend']})")
    return EXIT_OK


def _import(args: argparse.Namespace) -> int:
    from testbed.perf_model import importers
    from testbed.perf_model.measurements import write_measurements
    try:
        if args.source == "mlx":
            rows = importers.import_mlx(args.src, backend=None if args.backend == "all"
                                        else args.backend)
            write_measurements(args.out, rows, comments=[importers.MLX_ATTRIBUTION])
        elif args.source == "deepbench":
            rows = importers.import_deepbench(args.src)
            write_measurements(args.out, rows, comments=[importers.DEEPBENCH_ATTRIBUTION])
        else:
            src = Path(args.src)
            logs = sorted(src.glob("*.txt")) if src.is_dir() else [src]
            rows = [rec for path in logs for rec in importers.import_vfpbench(path)]
            importers.write_peaks(args.out, rows)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{args.out}: {len(rows)} rows from {args.source}")
    return EXIT_OK


def _load(path: str, device: str | None):
    rows = read_measurements(path)
    if device:
        rows = [r for r in rows if r.device == device]
        if not rows:
            raise MeasurementError(f"{path}: no rows of device {device!r}")
    return as_arrays(rows)


def _fit(args: argparse.Namespace) -> int:
    from testbed.perf_model.estimators import BlasCostRegressor, GemmTimeRegressor
    try:
        X, y = _load(args.measurements, args.device)
        estimator = BlasCostRegressor() if args.model == "cost" else GemmTimeRegressor()
        model = estimator.fit(X, y).export()
    except (MeasurementError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    Path(args.out).write_text(yaml.safe_dump({"model": model.to_dict()}, sort_keys=False))
    print(f"{args.out}: model fitted on {len(y)} shapes (put its 'model' section in a profile)")
    return EXIT_OK


def _eval(args: argparse.Namespace) -> int:
    from testbed.perf_model.evaluate import as_plain, evaluate, format_table
    try:
        X, y = _load(args.measurements, args.device)
        result = evaluate(X, y, seed=args.seed)
    except (MeasurementError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(as_plain(result), indent=1) if args.json else format_table(result))
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
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
    print("provenance:")
    for key, text in profile.provenance.items():
        print(f"  {key}: {text}")
    print("evaluation:")
    print("  " + yaml.safe_dump(profile.evaluation, sort_keys=False).replace("\n", "\n  "))
    return EXIT_OK


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``testbed perf ...``."""
    perf = subparsers.add_parser("perf", help="GEMM measurements, performance models, profiles")
    sub = perf.add_subparsers(dest="perf_command", metavar="PERF_COMMAND", required=True)

    p = sub.add_parser("measure", help="time numpy A @ B over training-GEMM tile shapes here")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="150 shapes, about a minute with the "
                      "default passes (default)")
    size.add_argument("--full", action="store_true", help="600 shapes")
    p.add_argument("--out", default="perf_measurements.csv", help="output CSV")
    p.add_argument("--device", default="host", help="device name written into the rows")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads (agents use 1)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--warmup", type=int, default=1, help="warm-up calls per shape and pass")
    p.add_argument("--repeats", type=int, default=3, help="samples per shape and pass")
    p.add_argument("--passes", type=int, default=40,
                   help="sweeps over all shapes, round-robin (quick: ~1.3 s each here)")
    p.add_argument("--min-sample-s", type=float, default=2e-4,
                   help="a sample loops the call until it lasts this long")
    p.add_argument("--statistic", choices=("min", "median"), default="min",
                   help="figure per shape over its samples (min: noise only adds time)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_measure)

    p = sub.add_parser("import", help="convert ../shared/data sources into the CSV format")
    p.add_argument("source", choices=("mlx", "deepbench", "vfpbench"))
    p.add_argument("src", help="source file (vfpbench: a log or the log directory)")
    p.add_argument("--out", required=True)
    p.add_argument("--backend", default="cpu", help="mlx backend to keep, or 'all'")
    p.set_defaults(func=_import)

    for name, func, text in (("fit", _fit, "fit a GemmTimeRegressor; write its model section"),
                             ("eval", _eval, "held-out scores: fitted model vs pure roofline")):
        p = sub.add_parser(name, help=text)
        p.add_argument("measurements", help="measurement CSV")
        p.add_argument("--device", help="only rows of this device")
        if name == "fit":
            p.add_argument("--out", required=True, help="YAML file for the model section")
            p.add_argument("--model", choices=("cost", "ridge"), default="cost",
                           help="cost: blocked-BLAS cost model (default); ridge: log-space "
                                "ridge on smooth features")
        else:
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)

    p = sub.add_parser("show", help="a profile's provenance and evaluation figures")
    p.add_argument("profile", nargs="?", help="profile name or path")
    p.add_argument("--list", action="store_true", help="list shipped profiles")
    p.set_defaults(func=_show)
