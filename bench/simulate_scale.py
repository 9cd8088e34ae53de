"""How fast `testbed simulate` runs: simulated steps per wall second and peak memory.

For 100 / 1,000 / 10,000 devices (quick mode: 100, 13 s on a 2-core host) on OPT-125m-shaped
(hidden 768, 12 layers, ffn 3072) and OPT-1.3B-shaped (hidden 2048, 24 layers, ffn 8192, seq
2048) jobs: one step each, in a child process per case so that each peak RSS is its own. Wall
seconds cover the whole run (joining every device, planning, the step, writing the run
directory); CPU seconds are the child's user + system time and its planning processes' (on a
shared host, wall time includes waiting for a core, and two runs of one case differ by up to a
fifth); planner CPU seconds are the part of them the step planner took, in the child and its
planning processes (``summary.json``'s ``planner_cpu_s``), steadier from run to run. Peak RSS
is the largest process's: the child's or a planning process's.

    .venv/bin/python bench/simulate_scale.py [--quick] [--steps N] [--timeout-s S]
                                             [--devices 100,1000] [--models opt-125m]
    .venv/bin/python bench/simulate_scale.py --topology bench/topologies/mixed-1000.yaml \
        --timeout-s 120

``--topology FILE`` simulates that file's devices and job instead (its own steps unless
``--steps``): ``bench/topologies/mixed-1000.yaml`` is a thousand devices of six kinds on five
access switches (docs/simulate.md, "Heterogeneous groups at a thousand devices"); a case still
running at ``--timeout-s`` prints the tiles it simulated by then, a rate to compare.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from testbed.units import choice_arg, int_arg, list_arg

MODELS = {
    "opt-125m": {"family": "opt", "hidden": 768, "layers": 12, "heads": 12, "ffn": 3072,
                 "seq_len": 128, "vocab": 50272},
    "opt-1.3b": {"family": "opt", "hidden": 2048, "layers": 24, "heads": 32, "ffn": 8192,
                 "seq_len": 2048, "vocab": 50272},
}


def topology_yaml(devices: int, model: str, steps: int) -> str:
    """A topology of `devices` phones and laptops (9:1) behind one 10 Gbit/s PS link."""
    laptops = max(1, devices // 10)
    phones = devices - laptops
    m = MODELS[model]
    return f"""name: scale-{devices}
seed: 1
network:
  backend: loopback
  ps: {{link: {{down: 10Gbit, up: 10Gbit, delay: 1ms}}}}
devices:
  - group: phones
    profile: snapdragon888
    count: {phones}
    link: {{down: 100Mbit, up: 40Mbit, delay: 10ms}}
  - group: laptops
    profile: m2pro
    count: {laptops}
    link: {{down: 1Gbit, up: 1Gbit, delay: 2ms}}
job:
  model: {json.dumps(m)}
  batch_size: {1 if model == "opt-1.3b" else 8}
  steps: {steps}
  dtype: float32
  parallelism: {{strategy: tile-tp}}
"""


class _OutOfTime(Exception):
    pass


def _out_of_time(_signum: int, _frame: Any) -> None:
    raise _OutOfTime()


def one_case(devices: int, model: str, steps: int, timeout_s: float,
             topology_file: str | None = None) -> dict[str, Any]:
    """Run in this process: simulate and measure; after timeout_s, say how far it got
    (``topology_file``: that file, with ``steps`` steps, instead of the generated one)."""
    from testbed.simulate import sim as sim_module
    from testbed.simulate.run import simulate
    from testbed.topology import load_topology

    made: list[Any] = []

    class Watched(sim_module.Simulation):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    sim_module.Simulation = Watched  # simulate() imports it when called
    signal.signal(signal.SIGALRM, _out_of_time)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.yaml"
        if topology_file:
            topology = load_topology(topology_file).with_overrides(steps=steps)
        else:
            path.write_text(topology_yaml(devices, model, steps))
            topology = load_topology(path)
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        start = time.monotonic()
        try:
            summary = simulate(topology, run_dir, report=False)
        except _OutOfTime:
            wall = time.monotonic() - start
            cpu_s, rss_mb = _usage()
            sim = made[0] if made else None
            return {"devices": devices, "model": model, "state": "unfinished", "wall_s": wall,
                    "cpu_s": cpu_s, "peak_rss_mb": rss_mb,
                    "virtual_s": sim.now_s if sim is not None else 0.0,
                    "tiles": (sim.totals.tiles + sim.stats.tiles) if sim is not None else 0}
        wall = time.monotonic() - start
        signal.setitimer(signal.ITIMER_REAL, 0)
    cpu_s, rss_mb = _usage()
    return {"devices": devices, "model": model, "state": summary["state"],
            "steps": summary["steps_done"], "wall_s": wall,
            "steps_per_wall_s": summary["steps_done"] / wall if wall > 0 else 0.0,
            "device_s_per_step": summary["wall_s"] / max(1, summary["steps_done"]),
            "tiles": summary["tiles"], "peak_rss_mb": rss_mb,
            "cpu_s": cpu_s, "plan_cpu_s": summary["planner_cpu_s"],
            "flow_recomputes": summary["flow_rate_recomputes"]}


def _usage() -> tuple[float, float]:
    """CPU seconds of this process and of the planning processes it has waited for, and the
    peak RSS (MB) of the largest of them."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    planners = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = me.ru_utime + me.ru_stime + planners.ru_utime + planners.ru_stime
    return cpu_s, max(me.ru_maxrss, planners.ru_maxrss) / 1024


def main(argv: list[str] | None = None) -> int:
    """Print one line per case."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="100 devices only (unless --devices)")
    p.add_argument("--steps", type=int, default=1, help="steps per case (default 1)")
    p.add_argument("--timeout-s", type=float, default=1800.0,
                   help="per case, seconds (default 1800); a case still running then "
                        "prints how far it got")
    p.add_argument("--models", type=list_arg(choice_arg(*MODELS)), default=list(MODELS),
                   help="comma-separated job shapes (default " + ",".join(MODELS) + ")")
    p.add_argument("--devices", type=list_arg(int_arg(1, 1_000_000)), default=[],
                   help="comma-separated device counts (default 100,1000,10000; quick: 100)")
    p.add_argument("--topology", metavar="FILE",
                   help="simulate this topology file instead (--devices and --models ignored)")
    p.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(one_case(int(args.case[0]), args.case[1], args.steps,
                                  args.timeout_s, args.topology)))
        return 0
    sizes = args.devices or ([100] if args.quick else [100, 1000, 10000])
    models = args.models
    extra: list[str] = []
    if args.topology:
        from testbed.topology import load_topology
        given = load_topology(args.topology)
        sizes, models = [len(given.devices)], [Path(args.topology).stem]
        extra = ["--topology", args.topology]
    print(f"{'model':10} {'devices':>7} {'steps/wall s':>12} {'wall s':>8} {'cpu s':>8} "
          f"{'planner cpu s':>13} {'device s/step':>13} {'tiles':>8} {'peak RSS MB':>11}",
          flush=True)
    for model in models:
        for n in sizes:
            cmd = [sys.executable, __file__, "--case", str(n), model, "--steps", str(args.steps),
                   *extra]
            try:
                out = subprocess.run(cmd + ["--timeout-s", str(args.timeout_s)],
                                     capture_output=True, text=True,
                                     timeout=args.timeout_s + 120)
            except subprocess.TimeoutExpired:
                print(f"{model:10} {n:>7} timed out after {args.timeout_s:g} s", flush=True)
                continue
            if out.returncode != 0:
                print(f"{model:10} {n:>7} failed: {out.stderr.strip().splitlines()[-1:]}",
                      flush=True)
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            if r["state"] == "unfinished":
                print(f"{model:10} {n:>7} {'< ' + format(1 / r['wall_s'], '.4f'):>12} "
                      f"{r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} {'-':>13} {'unfinished':>13} "
                      f"{r['tiles']:>8} {r['peak_rss_mb']:>11.0f}  (step not done: "
                      f"{r['virtual_s']:.3f} device s simulated)", flush=True)
                continue
            print(f"{model:10} {n:>7} {r['steps_per_wall_s']:>12.4f} {r['wall_s']:>8.1f} "
                  f"{r['cpu_s']:>8.1f} {r['plan_cpu_s']:>13.1f} {r['device_s_per_step']:>13.3f} "
                  f"{r['tiles']:>8} "
                  f"{r['peak_rss_mb']:>11.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
