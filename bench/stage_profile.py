"""Where a step's device time goes, stage by stage, against each stage's bound (simulated).

Runs one step of a topology's job in the simulator (`testbed simulate`'s planner, scheduler and
device models) and prints, per kind of stage of the GEMM chain (forward qkv_proj, out_proj, fc1,
fc2, the LM head; their backward pairs), the device seconds some GEMM of the stage was out, the
stages' bound (docs/planning.md, "The bound") and the ratio, then the step's totals. The kinds
summed over the layers show which part of the chain holds a step away from its bound; `--stages`
lists every stage with the term that set its bound; `--layers` prints, per linear shape, the
planner's prediction for its forward and backward planned apart and on one grid (devices keeping
forward's W and X blocks for backward, the grid's blocks cut into parts; docs/planning.md) and
which it takes; `--links`, per pass, the device whose link carried the most and how much of the
pass that link alone needed (the bytes of the plans, at its rate); `--cpu`, where the
simulation's own time went (the planner's CPU seconds, the scheduler's backup walk).

    .venv/bin/python bench/stage_profile.py [topology] [--stages] [--layers] [--links] [--cpu]
                                            [--quick] [--window-scale N]
    .venv/bin/python bench/stage_profile.py --run RUN_DIR [--step N] [--stages] [--tiles]
                                            [--gemm SUBSTRING]

`--quick` cuts the job to 2 layers (a few seconds on hotcarbon); the default topology is
topologies/hotcarbon.yaml (about 10 s). `--window-scale` sets the scheduler's window depth
(`Scheduler.window_scale`) to see what other windows do. `--run` prints the same table for a
step of a run directory (its stages.jsonl: `testbed up`, or `testbed simulate`), so an emulated
step's stages can be set beside the simulated ones. With `--tiles` (a run of `testbed up
--trace-tiles` or `testbed simulate --trace-tiles`, its tiles.jsonl) it also prints, per GEMM, how
long its tiles took on each leg, in device seconds, median and largest: down (handed out -> on the
device), wait (-> started), compute (-> done), up (-> accepted by the PS). `--gemm` keeps the
GEMMs whose name contains it and adds, per device group, when its devices' first operands
arrived and their last results were back (earliest, median and latest of its devices), from the
GEMM's first tile handed out: which group a GEMM waits for, and from when.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testbed.ps_backend.scheduler import PLANNED_WINDOW_SCALE, WINDOW_SCALE  # noqa: E402
from testbed.ps_backend.step_plan import LAYER_GAIN  # noqa: E402
from testbed.runlog import device_group, read_jsonl  # noqa: E402
from testbed.simulate.chain import linears  # noqa: E402
from testbed.simulate.sim import Simulation  # noqa: E402
from testbed.topology import Topology, load_topology  # noqa: E402


def stage_kind(stage: str) -> str:
    """``fwd:layers.3.fc1`` -> ``fwd fc1``; ``bwd:lm_head`` -> ``bwd lm_head``."""
    phase, _, layer = stage.partition(":")
    return f"{phase} {layer.rsplit('.', 1)[-1]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("topology", nargs="?", default=str(ROOT / "topologies" / "hotcarbon.yaml"),
                   help="the topology YAML to simulate (default topologies/hotcarbon.yaml)")
    p.add_argument("--stages", action="store_true", help="list every stage, not only kinds")
    p.add_argument("--layers", action="store_true",
                   help="per linear shape: planned apart or on one grid, predicted")
    p.add_argument("--links", action="store_true",
                   help="per pass: the device whose link carried the most, against the pass")
    p.add_argument("--quick", action="store_true", help="cut the model to 2 layers")
    p.add_argument("--cpu", action="store_true",
                   help="where the simulation's own time went: the planner's CPU seconds and "
                        "the scheduler's backup walk (calls and wall seconds)")
    p.add_argument("--window-scale", type=float, default=None,
                   help="tiles in a median-speed device's window (default: the planner's, "
                        f"{PLANNED_WINDOW_SCALE} for auto and {WINDOW_SCALE} for fifo; a "
                        "device's max_in_flight still caps it)")
    p.add_argument("--run", default=None, metavar="RUN_DIR",
                   help="print a run directory's step (its stages.jsonl) instead of simulating")
    p.add_argument("--step", type=int, default=0, help="with --run: which step (default 0)")
    p.add_argument("--tiles", action="store_true",
                   help="with --run: per GEMM, its tiles' legs (tiles.jsonl of a run of "
                        "testbed up or testbed simulate with --trace-tiles)")
    p.add_argument("--gemm", default=None, metavar="SUBSTRING",
                   help="with --tiles: only GEMMs whose name contains this (e.g. "
                        "layers.0.fc1/forward), each with its device groups' first arrivals "
                        "and last results")
    args = p.parse_args(argv)
    if args.run is not None:
        code = print_run(Path(args.run), args.step, args.stages)
        if code == 0 and args.tiles:
            return print_tiles(Path(args.run), args.step, args.gemm)
        return code
    topology = load_topology(args.topology).with_overrides(steps=1)
    cut = ""
    if args.quick:
        job = topology.job
        model = dataclasses.replace(job.model, layers=min(2, job.model.layers))
        cut = f" (--quick: {model.layers} of its {job.model.layers} layers)"
        topology = topology.with_overrides(job=dataclasses.replace(job, model=model))
    sim = Simulation(topology, noise=True)
    if args.window_scale is not None:
        sim.scheduler.window_scale = args.window_scale  # before the devices join
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    if args.cpu:
        for name in ("_assign_backups", "_backup_candidate"):
            time_calls(sim.scheduler, name, calls)
    started = time.monotonic()
    sim.start()
    device_s, stats, record = sim.run_step(0)
    print(f"{topology.name}{cut}: one step, simulated in {time.monotonic() - started:.1f} s")
    if args.cpu:
        walks, walk_s = calls["_assign_backups"]
        print(f"  planner {sim.planner.cpu_s:.1f} CPU s; backup walk {walk_s:.1f} s in "
              f"{walks:,.0f} calls, testing {calls['_backup_candidate'][0]:,.0f} devices")
    print_kinds(record.stages, args.stages)
    print(f"step: {device_s:.2f} s device time, bound_s {record.bound_s:.2f} s "
          f"(x{device_s / record.bound_s:.2f}); bytes down {stats.bytes_down / 1e9:.2f} GB "
          f"against bytes_min_down {record.bytes_min_down / 1e9:.2f} GB, "
          f"up {stats.bytes_up / 1e9:.2f} GB; {stats.tiles} tiles, {stats.backups} backup "
          f"copies ({stats.backup_wins} won), {stats.wasted} results wasted")
    if args.layers:
        print_layers(sim, topology)
    if args.links:
        print_links(sim, record.stages)
    return 0


def time_calls(obj: object, name: str, calls: dict[str, list[float]]) -> None:
    """Count ``obj.name``'s calls and their wall seconds into ``calls[name]`` (the instance's
    method, wrapped: the class's own calls to it go through the wrapper too)."""
    method = getattr(obj, name)

    def timed(*args: object, **kwargs: object) -> object:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            calls[name][0] += 1
            calls[name][1] += time.perf_counter() - started
    setattr(obj, name, timed)


def print_kinds(stages: list[tuple[str, float, float, str]], every: bool) -> None:
    """Per kind of stage (``every``: per stage too) the device seconds, bound and ratio."""
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for stage, spent_s, bound_s, limit in stages:
        totals = kinds[stage_kind(stage)]
        totals[0] += spent_s
        totals[1] += bound_s
        totals[2] += 1
        if every:
            print(f"  {stage:36s} {spent_s:9.3f} s  bound {bound_s:8.3f} s  "
                  f"x{spent_s / bound_s:5.2f}  ({limit})")
    print(f"{'stage kind':16s} {'stages':>6s} {'device s':>10s} {'bound s':>10s} {'ratio':>6s}")
    for kind, (spent_s, bound_s, count) in kinds.items():
        print(f"{kind:16s} {count:6d} {spent_s:10.2f} {bound_s:10.2f} {spent_s / bound_s:6.2f}")


def print_links(sim: Simulation, stages: list[tuple[str, float, float, str]]) -> None:
    """Per pass (forward, backward): its stages' device seconds; the device whose link was
    busiest in it, with the bytes it received and sent and the seconds its down- and uplink
    needed for them; and the same for all devices' bytes through the PS link (as the planner
    sees it: the PS's own, capped by the switch links every device sits below). A pass cannot
    end before its busiest link has carried its bytes (stages run one after another), so the
    share says how near the pass is to what its plans' bytes allow."""
    spent = {"fwd": 0.0, "bwd": 0.0}
    for stage, spent_s, _, _ in stages:
        spent[stage.partition(":")[0]] += spent_s
    print(f"{'pass':5s} {'device s':>9s}  {'busiest link':18s} {'MB down':>8s} {'MB up':>8s} "
          f"{'down s':>7s} {'up s':>7s}  share")

    def row(phase: str, name: str, down: float, up: float, rates: tuple[float, float]) -> None:
        down_s, up_s = down / rates[0], up / rates[1]
        print(f"{phase:5s} {spent[phase]:9.2f}  {name:18s} {down / 1e6:8.1f} {up / 1e6:8.1f} "
              f"{down_s:7.2f} {up_s:7.2f}  {max(down_s, up_s) / spent[phase]:5.2f}")
    for phase in ("fwd", "bwd"):
        busiest = max(sim.devices.values(), key=lambda d: max(
            d.moved[phase][0] / d.link_Bps[0], d.moved[phase][1] / d.link_Bps[1]))
        down, up = busiest.moved[phase]
        row(phase, busiest.spec.name, down, up, busiest.link_Bps)
        row(phase, "PS link", sum(d.moved[phase][0] for d in sim.devices.values()),
            sum(d.moved[phase][1] for d in sim.devices.values()), sim.config.ps_link_Bps)


def print_run(run_dir: Path, step: int, every: bool) -> int:
    """The table of a run directory's step, from its stages.jsonl and steps.jsonl."""
    stages = [(r["stage"], r["device_s"], r["bound_s"], r["limit"])
              for r in read_jsonl(run_dir / "stages.jsonl") if r["step"] == step]
    steps = [r for r in read_jsonl(run_dir / "steps.jsonl") if r["step"] == step]
    if not stages or not steps:
        print(f"{run_dir}: no stages of step {step} (stages.jsonl, steps.jsonl)",
              file=sys.stderr)
        return 2
    print(f"{run_dir}: step {step}")
    print_kinds(stages, every)
    s = steps[0]
    print(f"step: {s['device_time_s']:.2f} s device time (stages {sum(x[1] for x in stages):.2f}), "
          f"bound_s {s['bound_s']:.2f} s (x{s['device_time_s'] / s['bound_s']:.2f}); bytes "
          f"down {s['bytes_down'] / 1e9:.2f} GB, up {s['bytes_up'] / 1e9:.2f} GB; "
          f"{s['tiles']} tiles, {s['backups']} backup copies")
    # no schedule beats a stage's bound on the topology's links and devices: a stage under it
    # ran faster than the topology says (docs/network.md, "Left out / known limits")
    below = [stage for stage, spent_s, bound_s, _ in stages if spent_s < bound_s * (1 - 1e-9)]
    if below:
        print(f"{len(below)} of {len(stages)} stages shorter than their bound (e.g. {below[0]}): "
              "the emulation was faster than the topology there (docs/network.md, \"Left out / "
              "known limits\")")
    return 0


LEGS = (("down", "sent_s", "arrived_s"), ("wait", "arrived_s", "started_s"),
        ("compute", "started_s", "done_s"), ("up", "done_s", "accepted_s"))


def print_tiles(run_dir: Path, step: int, only: str | None = None) -> int:
    """Per GEMM of a traced step: tiles, span, and each leg's median and largest (device s);
    with ``only``, the GEMMs whose name contains it, each with its groups' timelines."""
    path = run_dir / "tiles.jsonl"
    if not path.exists():
        print(f"{run_dir}: no tiles.jsonl (run testbed up or testbed simulate with "
              "--trace-tiles)", file=sys.stderr)
        return 2
    dilation = next(r["time_dilation"] for r in read_jsonl(run_dir / "steps.jsonl")
                    if r["step"] == step)
    gemms: dict[str, list[dict]] = defaultdict(list)
    for r in read_jsonl(path):
        if r["step"] == step and (only is None or only in r["gemm"]):
            gemms[r["gemm"]].append(r)
    if not gemms:
        print(f"{run_dir}: no tiles of step {step}" + (f" in a GEMM named *{only}*" if only
                                                       else ""), file=sys.stderr)
        return 2
    group_of = {str(r["device"]): device_group(r)
                for r in read_jsonl(run_dir / "devices.jsonl")} \
        if (run_dir / "devices.jsonl").exists() else {}
    print(f"{'gemm':44s} {'tiles':>5s} {'span':>6s}  "
          + "  ".join(f"{leg:>13s}" for leg, _, _ in LEGS) + "   (median/largest, device s)")
    for gemm, rows in gemms.items():
        span = (max(r["accepted_s"] for r in rows) - min(r["sent_s"] for r in rows)) / dilation
        legs = []
        for _, start, end in LEGS:
            took = sorted((r[end] - r[start]) / dilation for r in rows)
            legs.append(f"{took[len(took) // 2]:6.3f}/{took[-1]:6.3f}")
        print(f"{gemm.split('/', 1)[-1]:44s} {len(rows):5d} {span:6.2f}  " + "  ".join(legs))
        if only is not None:
            print_groups(rows, group_of, dilation)
    return 0


def print_groups(rows: list[dict], group_of: dict[str, str], dilation: float) -> None:
    """A GEMM's device groups: per group, its devices' first operands on the device and last
    result accepted, in device ms from the GEMM's first tile handed out (earliest / median /
    latest device)."""
    t0 = min(r["sent_s"] for r in rows)
    per_device: dict[str, list[float]] = {}
    for r in rows:
        first_last = per_device.setdefault(r["device"], [math.inf, -math.inf, 0])
        first_last[0] = min(first_last[0], r["arrived_s"])
        first_last[1] = max(first_last[1], r["accepted_s"])
        first_last[2] += 1
    groups: dict[str, list[list[float]]] = defaultdict(list)
    for device, first_last in per_device.items():
        groups[group_of.get(device, device)].append(first_last)

    def spread(values: list[float]) -> str:
        ms = sorted(1e3 * (v - t0) / dilation for v in values)
        return f"{ms[0]:6.1f} /{ms[len(ms) // 2]:6.1f} /{ms[-1]:6.1f}"
    print(f"    {'group':14s} {'devices':>7s} {'tiles':>6s}  {'first on device, ms':>22s}  "
          f"{'last result back, ms':>22s}")
    for group, devices in sorted(groups.items()):
        print(f"    {group:14s} {len(devices):7d} {int(sum(d[2] for d in devices)):6d}  "
              f"{spread([d[0] for d in devices]):>22s}  {spread([d[1] for d in devices]):>22s}")


def print_layers(sim: Simulation, topology: Topology) -> None:
    """Per distinct linear shape: forward + backward predicted apart and on one grid."""
    tokens = topology.job.batch_size * topology.job.model.seq_len
    item = sim.config.dtype.itemsize
    slots = [s for s in sim.scheduler.devices.values() if not s.quarantined]
    print(f"{'linear (T x out x in)':24s} {'apart s':>8s} {'one grid s':>11s} "
          f"{'(fwd + bwd)':>15s} {'grid':>12s} {'parts':>9s}  taken")
    seen = set()
    for lin in linears(topology.job):
        shape = (tokens, lin.d_out, lin.d_in)
        if shape in seen:
            continue
        seen.add(shape)
        layer, apart = sim.planner.layer_or_apart(shape, item, slots)
        if layer is None:
            print(f"{'x'.join(map(str, shape)):24s} {apart:8.3f}  (no grid fits)")
            continue
        taken = "one grid" if layer.predicted_s < LAYER_GAIN * apart else "apart"
        print(f"{'x'.join(map(str, shape)):24s} {apart:8.3f} {layer.predicted_s:11.3f} "
              f"({layer.forward_s:6.3f} +{layer.backward_s:6.3f}) "
              f"{'x'.join(map(str, layer.pair.grid)):>12s} "
              f"{'x'.join(map(str, layer.fine)):>9s}  {taken}")


if __name__ == "__main__":
    raise SystemExit(main())
