"""Churn benchmark: step time under 0 %, 10 % and 30 % of devices churning per minute, recovery
latency, and the PS's CPU cost of validating tiles.

    .venv/bin/python bench/churn.py                 # the three rates, ~90 s of training each
    .venv/bin/python bench/churn.py --quick         # 30 s windows, rates 0, 30, 100: ~1.5 min
    .venv/bin/python bench/churn.py --rates 0,50 --duration-s 120 --devices 12

For each rate r (% of the devices per minute) a trace is made: every 60 / (r/100 · N) seconds a
present phone crashes or leaves (alternately) and joins again ``--absence-s`` later. It is
replayed by a real ``testbed up`` run (loopback, real PS and agent processes) of a small job
whose links have 20 ms delays. Printed per rate: the median and mean step time over the steps
that ended inside the churn window, departures, tiles re-queued and recomputed, recovery latency
(departure -> its re-queued tiles handed out again) p50/p95, goodput (useful share of tile
FLOPs) and the PS's validation CPU: µs per checked tile and share of the PS's CPU time.

Then a micro-benchmark: Freivalds' check against the tile's own GEMM, per tile size, in thread
CPU time on this host. No figure is asserted; timings depend on the host and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one BLAS thread, like PS and agents
import numpy as np  # noqa: E402
import yaml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from testbed.ps_backend.validation import check_result  # noqa: E402
from testbed.runlog import read_jsonl  # noqa: E402
from testbed.units import list_arg, number_arg  # noqa: E402


def topology(devices: int, steps: int, trace: Path | None) -> dict[str, Any]:
    """A small job on `devices` emulated devices (one laptop per five), 20 ms links."""
    laptops = max(1, devices // 5)
    link = {"down": "1Gbit", "up": "1Gbit", "delay": "20ms"}
    raw: dict[str, Any] = {
        "name": "bench-churn", "seed": 11, "network": {"backend": "loopback"},
        "devices": [{"group": "phones", "profile": "snapdragon888", "count": devices - laptops,
                     "link": link},
                    {"group": "laptops", "profile": "m2pro", "count": laptops, "link": link}],
        "job": {"model": {"family": "opt", "hidden": 32, "layers": 2, "heads": 2, "ffn": 64,
                          "seq_len": 16},
                "batch_size": 4, "steps": steps, "dtype": "float32",
                "optimizer": {"name": "adamw", "lr": 1e-3},
                "parallelism": {"strategy": "tile-tp", "tile": 16, "min_offload_flops": 0}},
        "time_dilation": 1}
    if trace is not None:
        raw["churn"] = str(trace)
    return raw


def churn_trace(phones: int, rate_pct_per_min: float, duration_s: float, absence_s: float,
                seed: int) -> str:
    """A trace where rate% of `phones` go per minute and come back after absence_s."""
    rng = random.Random(seed)
    lines = ["time_s,device,event,arg"]
    if rate_pct_per_min <= 0:
        return "\n".join(lines) + "\n"
    period_s = 60.0 / (rate_pct_per_min / 100.0 * phones)
    present = {f"phones-{i}" for i in range(phones)}
    returns: list[tuple[float, str]] = []
    t, kind = period_s / 2, 0
    while t < duration_s:
        for when, name in sorted(r for r in returns if r[0] <= t):
            lines.append(f"{when:.3f},{name},join,")
            present.add(name)
        returns = [r for r in returns if r[0] > t]
        if len(present) > 1:
            name = rng.choice(sorted(present))
            present.discard(name)
            lines.append(f"{t:.3f},{name},{('crash', 'leave')[kind % 2]},")
            returns.append((t + absence_s, name))
            kind += 1
        t += period_s
    for when, name in sorted(returns):
        lines.append(f"{when:.3f},{name},join,")
    return "\n".join(lines) + "\n"


def run_rate(rate: float, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One `testbed up` run with the rate's trace; the figures from its run directory."""
    phones = args.devices - max(1, args.devices // 5)
    trace = work / f"churn-{rate:g}.csv"
    trace.write_text(churn_trace(phones, rate, args.duration_s, args.absence_s, seed=7))
    topo_path = work / f"bench-{rate:g}.yaml"
    topo_path.write_text(yaml.safe_dump(topology(args.devices, args.steps, trace)))
    out = work / f"runs-{rate:g}"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "testbed.cli", "up", str(topo_path),
                           "--no-live", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=args.duration_s * 10 + 600)
    wall_s = time.monotonic() - started
    run_dir = next(out.iterdir())
    if done.returncode != 0:
        raise RuntimeError(f"rate {rate}: testbed up exited {done.returncode}:\n"
                           f"{done.stdout[-2000:]}")
    steps = read_jsonl(run_dir / "steps.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    clock = next((e["t"] for e in events if e["event"] == "churn_clock_start"),
                 next(e["t"] for e in events if e["event"] == "training_start"))
    window = [s["wall_s"] for s in steps if s["t"] - clock <= args.duration_s]
    recoveries = sorted(e["recovery_s"] for e in events if e["event"] == "recovered")
    return {"rate": rate, "steps": len(window), "median_step_s": statistics.median(window),
            "mean_step_s": statistics.fmean(window), "departures": summary["departures"],
            "requeued": summary["requeued_tiles"], "recomputed": summary["recomputed_tiles"],
            "recovery_p50_s": _q(recoveries, 0.5), "recovery_p95_s": _q(recoveries, 0.95),
            "recoveries": len(recoveries), "goodput": summary["goodput"],
            "backups": summary["backups"], "validation_us": summary["validation_us_per_tile"],
            "validation_cpu_share": summary["validation_overhead_cpu"], "wall_s": wall_s}


def ms(value: float | None) -> str:
    """Seconds as milliseconds for the table; '-' when there is no value."""
    return f"{value * 1e3:.1f}" if value is not None else "-"


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def validation_micro(repeats: int) -> list[dict[str, float]]:
    """Thread CPU µs per tile: the PS's check (shared per GEMM) against the tile's GEMM.

    A GEMM of 8 x 8 tiles is checked tile by tile with a fresh GemmCheck, as the PS does;
    the GEMM time is the whole product's, divided by 64. float32, one vector, one BLAS thread.
    """
    from testbed.ps_backend.tiler import cut
    from testbed.ps_backend.validation import GemmCheck

    rng = np.random.default_rng(0)
    rows = []
    for tile, k in ((16, 32), (64, 256), (128, 256), (128, 1024), (256, 1024)):
        a = rng.standard_normal((8 * tile, k)).astype(np.float32)
        b = rng.standard_normal((k, 8 * tile)).astype(np.float32)
        c = a @ b
        boxes = cut(8 * tile, 8 * tile, tile, tile)
        t0 = time.thread_time()
        for _ in range(repeats):
            check = GemmCheck(a, b, [(x.c0, x.c1) for x in boxes])
            for x in boxes:
                block = c[x.r0:x.r1, x.c0:x.c1]
                check_result(a[x.r0:x.r1], b[:, x.c0:x.c1], block, gemm=check,
                             box=(x.r0, x.r1, x.c0, x.c1))
        check_us = (time.thread_time() - t0) / repeats / len(boxes) * 1e6
        t0 = time.thread_time()
        for _ in range(repeats):
            a @ b
        gemm_us = (time.thread_time() - t0) / repeats / len(boxes) * 1e6
        rows.append({"tile": tile, "k": k, "check_us": check_us, "gemm_us": gemm_us})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=list_arg(number_arg(0, 6000)), default=None,
                   help="comma-separated churn rates, %% of the devices per minute "
                        "(default 0,10,30; quick: 0,30,100)")
    p.add_argument("--devices", type=int, default=10,
                   help="devices of the job (default 10)")
    p.add_argument("--duration-s", type=float, default=90.0,
                   help="churn window, seconds (default 90)")
    p.add_argument("--absence-s", type=float, default=15.0,
                   help="how long a departed device stays away, seconds (default 15)")
    p.add_argument("--steps", type=int, default=0, help="job steps (default: enough to cover "
                                                        "the window at ~1.5 s a step, "
                                                        "duration / 1.5 + 5)")
    p.add_argument("--quick", action="store_true",
                   help="30 s windows, 6 devices, 8 s absences (replaces those three "
                        "options), rates 0,30,100 unless --rates (at 10 %%/min no one of "
                        "6 devices leaves in 30 s); about 1.5 minutes")
    args = p.parse_args(argv)
    if args.quick:
        args.duration_s, args.devices, args.absence_s = 30.0, 6, 8.0
    args.steps = args.steps or int(args.duration_s / 1.5) + 5  # steps take ~1.5-2 s
    rates = args.rates or ([0.0, 30.0, 100.0] if args.quick else [0.0, 10.0, 30.0])
    print(f"churn bench: {args.devices} devices, {args.duration_s:g} s window, "
          f"absence {args.absence_s:g} s, {args.steps} steps; host load "
          f"{open('/proc/loadavg').read().split()[0]}")
    with tempfile.TemporaryDirectory(prefix="bench-churn-") as tmp:
        rows = [run_rate(r, args, Path(tmp)) for r in rates]
    head = (f"{'churn %/min':>11} {'steps':>5} {'step p50 s':>10} {'step mean s':>11} "
            f"{'departures':>10} {'requeued':>8} {'recomputed':>10} {'recov p50 ms':>12} "
            f"{'recov p95 ms':>12} {'goodput':>7} {'backups':>7} {'valid. µs/tile':>14} "
            f"{'valid. % PS CPU':>15}")
    print(head)
    for r in rows:
        print(f"{r['rate']:>11g} {r['steps']:>5} {r['median_step_s']:>10.3f} "
              f"{r['mean_step_s']:>11.3f} {r['departures']:>10} {r['requeued']:>8} "
              f"{r['recomputed']:>10} {ms(r['recovery_p50_s']):>12} "
              f"{ms(r['recovery_p95_s']):>12} {r['goodput']:>7.3f} {r['backups']:>7} "
              f"{r['validation_us']:>14.1f} {100 * r['validation_cpu_share']:>15.2f}")
    print("\nFreivalds' check per tile, shared per GEMM of 8x8 tiles, vs the tile's GEMM "
          "(float32, one vector, thread CPU time):")
    print(f"{'tile':>5} {'k':>5} {'check µs':>9} {'GEMM µs':>9} {'check/GEMM':>10}")
    for m in validation_micro(5):
        print(f"{m['tile']:>5} {m['k']:>5} {m['check_us']:>9.1f} {m['gemm_us']:>9.1f} "
              f"{m['check_us'] / m['gemm_us']:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
