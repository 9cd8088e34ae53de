"""``testbed simulate TOPOLOGY [--churn TRACE] [--steps N] [--out DIR] [--trace-tiles]``: a run
directory in virtual time.

The same validation as ``testbed up`` (topology, profiles, churn trace: exit 2 before anything
is written), then the same run directory (``runlog.py``'s files; ``summary.json`` with
``"simulated": true``, energy and carbon; ``report.png`` and ``report.md``), so every tool that
reads a run reads a simulated one. Every JSON line's ``elapsed_s`` is virtual (device) seconds
since training started and ``t`` is the run's origin plus that; ``wall_s`` of a step is its
device time (what the deployment would take) and ``sim_wall_s`` what simulating it took.
With ``--trace-tiles``, ``tiles.jsonl`` has every accepted tile's times as ``testbed up
--trace-tiles`` writes them, in virtual seconds, so ``bench/stage_profile.py --run RUN --tiles``
reads either.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from testbed.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK
from testbed.interrupts import held
from testbed.units import number_arg
from testbed.user_paths import path_arg


def simulate(topology: Any, run_dir: Path, schedule: Any = None, noise: bool = True,
             report: bool = True, progress: Any = None, ps_gemm_s: float = 0.0,
             trace_tiles: bool = False, during: Any = None, during_every_s: float = 10.0,
             on_planning: Any = None, on_planned: Any = None) -> dict[str, Any]:
    """Simulate the topology's job into run_dir; return the summary. ``progress(step, device
    s, wall s)`` after each step; ``during(step, device s so far, tiles so far, wall s so far,
    planner CPU s so far)`` every ``during_every_s`` of wall time within a step;
    ``on_planning()`` as the plans before the first step start and ``on_planned(shapes,
    processes, wall s, CPU s)`` once they are made (as the PS makes them: a large topology's
    take most of its first step's wall time, a job of millions of tokens a step minutes)."""
    from testbed.ps_backend.bound import BoundTotals, efficiency
    from testbed.ps_backend.step_plan import planning_workers
    from testbed.runlog import RunLog
    from testbed.simulate.sim import Simulation
    from testbed.summary import write_simulated_summary

    sim: Simulation | None = None  # the log's clock: virtual seconds once the simulation exists
    log = RunLog(run_dir, elapsed_s=lambda: sim.now_s if sim is not None else 0.0)
    # the step under way, when it started (wall) and the planner's CPU seconds by then
    current = (0, time.monotonic(), 0.0)

    def within(device_s: float, stats: Any) -> None:
        assert sim is not None
        step, wall0, planned0 = current
        during(step, device_s, stats.tiles, time.monotonic() - wall0,
               sim.planner.cpu_s - planned0)
    sim = Simulation(topology, schedule, event=log.event, noise=noise, ps_gemm_s=ps_gemm_s,
                     tile=log.tile if trace_tiles else None,
                     during=within if during is not None else None,
                     during_every_s=during_every_s)
    job = topology.job
    bound = BoundTotals()
    started = time.monotonic()
    state, error = "done", None
    steps_done = 0
    interrupted = False
    try:
        log.event("ps_start", expected_devices=len(topology.devices), time_dilation=1.0,
                  simulated=True, ps_gemm_s=ps_gemm_s)
        if on_planning is not None:
            on_planning()
        sim.start(plan_workers=planning_workers())
        if on_planned is not None and sim.planned is not None and sim.planned.shapes:
            on_planned(*sim.planned)
        for step in range(job.steps):
            t0 = time.monotonic()
            current = (step, t0, sim.planner.cpu_s)
            device_s, stats, record = sim.run_step(step)
            with held():  # the step's line and its count, or neither (testbed.interrupts)
                bound.add(record, device_s)
                log.step(step=step, loss=None, wall_s=round(device_s, 6),
                         device_time_s=round(device_s, 6), time_dilation=1.0,
                         sim_wall_s=round(time.monotonic() - t0, 6),
                         **record.fields(), efficiency=efficiency(record.bound_s, device_s),
                         tiles=stats.tiles, recomputed_tiles=stats.recomputed,
                         requeued_tiles=stats.requeued, rejected=stats.rejected, late=stats.late,
                         bytes_down=stats.bytes_down, bytes_up=stats.bytes_up,
                         gemms=stats.gemms_offloaded + stats.gemms_local,
                         gemms_local=stats.gemms_local, max_lag_s=0.0,
                         device_compute_s=round(stats.device_compute_s, 6),
                         energy_j=round(stats.energy_j, 6), failed_checks=0, backups=stats.backups,
                         backup_wins=stats.backup_wins, wasted=stats.wasted, tiles_from_ledger=0,
                         simulated=True)
                log.stages(step, record.stages)
                steps_done += 1
            if progress is not None:
                progress(step, device_s, time.monotonic() - t0)
    except RuntimeError as exc:
        state, error = "failed", str(exc)
        log.event("ps_failed", error=error)
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM, testbed.cli): the steps done are kept
        state, interrupted = "interrupted", True
    devices = sim.device_records()
    events = log.finish(devices, state)
    t = sim.run_totals()
    k = sim.scheduler.counters
    summary: dict[str, Any] = {
        "run": run_dir.name, "simulated": True, "state": state, "error": error,
        "steps_done": steps_done, "steps": job.steps, "final_loss": None, "losses": [],
        "wall_s": round(sim.now_s, 6), "sim_wall_s": round(time.monotonic() - started, 3),
        "time_dilation": 1.0, "tiles": t.tiles, "recomputed_tiles": t.recomputed,
        "requeued_tiles": t.requeued, "rejected": t.rejected, "late": t.late,
        "bytes_down": t.bytes_down, "bytes_up": t.bytes_up, "max_lag_s": 0.0,
        "device_compute_s": round(t.device_compute_s, 6), "energy_j": round(t.energy_j, 6),
        "backups": k.backups, "backup_wins": k.backup_wins, "wasted_tiles": k.wasted,
        **bound.fields(), "planner": job.parallelism.planner,
        "flow_rate_recomputes": sim.net.recomputes, "ps_gemm_s": ps_gemm_s,
        "planner_cpu_s": round(sim.planner.cpu_s, 3),
        "network": {"backend": "simulated", "rate": "flow-level max-min fair",
                    "delay": "path delay", "loss": "Mathis cap on the device link"},
        "exit_code": {"done": EXIT_OK, "interrupted": EXIT_INTERRUPTED}.get(state, EXIT_FAILURE),
        "devices": devices}
    summary = write_simulated_summary(run_dir, topology, summary, events, report)
    if interrupted:
        raise KeyboardInterrupt  # on to the caller (run_simulate; compare stops too)
    return summary


def run_simulate(args: argparse.Namespace) -> int:
    """The `testbed simulate` command."""
    from testbed.runlog import read_jsonl
    from testbed.up import load_run_inputs, make_run_dir, portable_input

    inputs = load_run_inputs(args.topology, steps=args.steps, churn_path=args.churn,
                             trace_tiles=args.trace_tiles)
    if isinstance(inputs, int):
        return inputs
    topology, _, schedule = inputs
    run_dir = make_run_dir(Path(args.out), topology.name)
    (run_dir / "topology.input.yaml").write_text(portable_input(Path(args.topology)))
    (run_dir / "topology.yaml").write_text(yaml.safe_dump(topology.to_yaml(), sort_keys=False))
    print(f"run directory: {run_dir} (simulated)")
    byzantine = [g.group for g in topology.groups
                 if g.behaviour and g.behaviour.byzantine and g.behaviour.byzantine.rate > 0]
    if byzantine:  # no tensors, so nothing to corrupt or check (docs/simulate.md)
        print(f"note: byzantine behaviour is not simulated (groups: {', '.join(byzantine)}): "
              "every result passes its check; run it with testbed up", flush=True)

    def progress(step: int, device_s: float, wall_s: float) -> None:
        print(f"step {step}: {device_s:.3f} s device time ({wall_s:.2f} s to simulate)",
              flush=True)

    def during(step: int, device_s: float, tiles: int, wall_s: float, planning_s: float
               ) -> None:
        print(f"  step {step}: {device_s:.3f} s of device time so far, {tiles:,} tiles "
              f"({wall_s:.0f} s, planning {planning_s:.0f} CPU s of them)", flush=True)
    def planning() -> None:
        print("planning every linear's tiles before the first step (minutes for a job of "
              "millions of tokens a step)", flush=True)

    def planned(shapes: int, processes: int, wall_s: float, cpu_s: float) -> None:
        print(f"planned {shapes} GEMM shape(s) in {wall_s:.1f} s ({cpu_s:.1f} CPU s in "
              f"{processes} process{'' if processes == 1 else 'es'})", flush=True)
    try:
        if topology.job.parallelism.strategy != "tile-tp":  # the baselines (docs/baselines.md)
            from testbed.baselines.run import simulate_baseline
            summary = simulate_baseline(topology, run_dir, schedule, progress=progress)
        else:
            summary = simulate(topology, run_dir, schedule, progress=progress,
                               ps_gemm_s=args.ps_gemm_s, trace_tiles=args.trace_tiles,
                               during=during, on_planning=planning, on_planned=planned)
    except KeyboardInterrupt:
        try:
            done = json.loads((run_dir / "summary.json").read_text())["steps_done"]
        except (OSError, ValueError, KeyError):  # interrupted again while it was written
            print(f"interrupted; run directory {run_dir}", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(f"interrupted: {done} step{'' if done == 1 else 's'} kept in {run_dir} "
              f"(summary.json, report)", file=sys.stderr)
        return EXIT_INTERRUPTED
    if summary["state"] != "done":
        print(f"error: {summary['error']}", file=sys.stderr)
        return EXIT_FAILURE
    eff = summary.get("efficiency")
    eff_text = f"{eff:.2f}" if isinstance(eff, float) else "n/a (no bound for this strategy)"
    done = summary["steps_done"]
    # a baseline's virtual time also holds what is outside its steps: the model handed out to
    # its devices, restores and restarts
    in_steps = sum(s.get("device_time_s", 0.0) for s in read_jsonl(run_dir / "steps.jsonl"))
    extra = summary["wall_s"] - in_steps
    print(f"done: {done} step{'' if done == 1 else 's'}, {in_steps:.3f} s device time"
          + (f" ({summary['wall_s']:.3f} s in all, the model handed out to its devices"
             + (f" and {summary['restarts']} restart(s)" if summary.get("restarts") else "")
             + " included)" if extra > 5e-4 else "")
          + f", efficiency {eff_text}, energy {summary['energy']['total']['total_j']:.1f} J")
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `testbed simulate`."""
    p = sub.add_parser(
        "simulate", help="run a topology's job in virtual time (no processes, no tensors)",
        description="Simulate a topology's job: the PS's scheduler and planner, the devices' "
                    "models, churn and a flow-level network in virtual time. Writes the same "
                    "run directory as `testbed up`, marked simulated. A job whose "
                    "parallelism.strategy is pipeline or data-parallel runs those baselines "
                    "(docs/baselines.md). Prints each step's device time, and within a long "
                    "step (a thousand devices take minutes) its progress every 10 s. Exit 2 on "
                    "bad input.")
    p.add_argument("topology", help="the topology YAML file")
    p.add_argument("--churn", type=path_arg,
                   help="churn trace to replay (default: the topology's churn:)")
    p.add_argument("--steps", type=int, help="training steps (default: the topology's)")
    p.add_argument("--out", type=path_arg, default="runs",
                   help="parent of the run directory (default: runs)")
    p.add_argument("--ps-gemm-s", type=number_arg(0, 3600), default=0.0,
                   help="the PS's own time per offloaded GEMM, device seconds (default 0: not "
                        "modelled; see docs/simulate.md)")
    p.add_argument("--trace-tiles", action="store_true",
                   help="write RUN_DIR/tiles.jsonl: every accepted tile's times (handed out, "
                        "on the device, started, done, back), virtual seconds, as testbed up "
                        "--trace-tiles writes them (read with bench/stage_profile.py --run RUN "
                        "--tiles); ~300 bytes a tile")
    p.set_defaults(func=run_simulate)
