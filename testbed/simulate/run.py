"""``testbed simulate TOPOLOGY [--churn TRACE] [--steps N] [--out DIR] [--ps-gemm-s S]
[--trace-tiles]``: a run directory in virtual time.

The same validation as ``testbed up`` (topology, profiles, churn trace: exit 2 before anything
is written), then the same run directory (``runlog.py``'s files; ``summary.json`` with
``"simulated": true``, energy and carbon; ``report.png`` and ``report.md``), so every tool that
reads a run reads a simulated one. Every JSON line's ``elapsed_s`` is virtual (device) seconds
since training started and ``t`` is the run's origin plus that; ``wall_s`` of a step is its
device time (what the deployment would take) and ``sim_wall_s`` what simulating it took.
With ``--trace-tiles``, ``tiles.jsonl`` has every accepted tile's times as ``testbed up
--trace-tiles`` writes them, in virtual seconds, so ``bench/stage_profile.py --run RUN --tiles``
reads either. ``--ps-gemm-s`` and ``--trace-tiles`` are tile-tp's: a job whose
``parallelism.strategy`` is pipeline or data-parallel refuses them (exit 2, nothing written).

What it prints, in this order: the run directory; a note for each part of the topology that is
not simulated (Byzantine behaviour, ``adb:`` phones, devices joining through
``network.ps.listen``); the planning before the first step (not with ``planner: fifo``, which
plans nothing): as it starts, every 10 s how many GEMM shapes are planned, and when it ends;
one line per step (its device seconds and the wall seconds simulating it took), and within a
step, every 10 s of wall time, its device seconds, tiles and GEMMs submitted so far; then the end
line (steps, device seconds, efficiency ``bound_s / device time``, energy in joules: the
summary's ``energy.total.total_j``, compute, idle and radio).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from testbed.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK
from testbed.interrupts import held
from testbed.units import number_arg
from testbed.user_paths import path_arg


def simulate(topology: Any, run_dir: Path, schedule: Any = None, noise: bool = True,
             report: bool = True, progress: Any = None, ps_gemm_s: float = 0.0,
             trace_tiles: bool = False, during: Any = None, during_every_s: float = 10.0,
             on_planning: Any = None, on_planned: Any = None,
             planning: Any = None) -> dict[str, Any]:
    """Simulate the topology's job into run_dir; return the summary. ``progress(step, device
    s, wall s)`` after each step; ``during(step, device s so far, tiles so far, wall s so far,
    planner CPU s so far, GEMMs submitted so far, the step's GEMMs)`` every
    ``during_every_s`` of wall time within a step;
    ``on_planning()`` as the plans before the first step start, ``planning(shapes planned,
    shapes, wall s so far)`` every ``during_every_s`` while they are made and
    ``on_planned(shapes, processes, wall s, CPU s)`` once they are (as the PS makes them: a
    large topology's take most of its first step's wall time, a job of millions of tokens a
    step minutes)."""
    from testbed.ps_backend.accounting import after_last_step, run_figures
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
               sim.planner.cpu_s - planned0, stats.gemms_offloaded + stats.gemms_local,
               sim.step_gemms)
    sim = Simulation(topology, schedule, event=log.event, noise=noise, ps_gemm_s=ps_gemm_s,
                     tile=log.tile if trace_tiles else None,
                     during=within if during is not None else None,
                     during_every_s=during_every_s, device=log.device)
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
        sim.start(plan_workers=planning_workers(), planning=planning)
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
    # the present devices' final records: each departed session's went out as it departed
    events = log.finish(sim.present_records(), state)
    # as the PS's summary: a done run's figures are its steps' sums, what came after apart
    # (nothing: the simulation stops with its last step), an unfinished run's count the step
    # under way too
    done = state == "done"
    summary: dict[str, Any] = {
        "run": run_dir.name, "simulated": True, "state": state, "error": error,
        "steps_done": steps_done, "steps": job.steps, "final_loss": None, "losses": [],
        "wall_s": round(sim.now_s, 6), "sim_wall_s": round(time.monotonic() - started, 3),
        "time_dilation": 1.0, **run_figures(sim.totals if done else sim.run_totals()),
        **({"after_last_step": after_last_step(sim.stats)} if done else {}),
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


def not_simulated(topology: Any) -> list[str]:
    """A note for each part of the topology the simulation leaves out (it simulates the
    topology's own device groups only, and no tensors): Byzantine groups, the ``adb:`` section's
    real phones, the devices of other machines ``network.ps.listen`` lets join."""
    notes = []
    byzantine = [g.group for g in topology.groups
                 if g.behaviour and g.behaviour.byzantine and g.behaviour.byzantine.rate > 0]
    if byzantine:  # no tensors, so nothing to corrupt or check (docs/simulate.md)
        notes.append(f"note: byzantine behaviour is not simulated (groups: {', '.join(byzantine)}"
                     "): every result passes its check; run it with testbed up")
    adb = topology.extra.get("adb")
    if adb is not None and getattr(adb, "enabled", False):
        notes.append(f"note: adb.enabled: real phones are not simulated, only the topology's "
                     f"{len(topology.devices)} devices; run them with testbed up")
    if topology.network.ps.listen:
        notes.append(f"note: network.ps.listen: devices joining from other machines are not "
                     f"simulated, only the topology's {len(topology.devices)} devices")
    return notes


def step_line(step: int, device_s: float, wall_s: float) -> str:
    """The line printed when a step ends."""
    return f"step {step}: {device_s:.3f} s device time ({wall_s:.2f} s to simulate)"


def during_line(step: int, device_s: float, tiles: int, wall_s: float, planning_s: float,
                gemms: int, step_gemms: int) -> str:
    """The line printed every 10 s of wall time within a step (device and wall seconds, tiles,
    the planner's CPU seconds and the GEMMs submitted so far, of the step's: how far the step
    is, where tiles and device seconds do not say)."""
    return (f"  step {step}: {device_s:.3f} s of device time so far, {tiles:,} tiles, "
            f"{gemms:,} of {step_gemms:,} GEMMs submitted ({wall_s:.0f} s to simulate so far, "
            f"{planning_s:.0f} CPU s of it planning)")


def planned_line(shapes: int, processes: int, wall_s: float, cpu_s: float) -> str:
    """The line printed once the plans before the first step are made."""
    return (f"planned {shapes} GEMM shape(s) in {wall_s:.1f} s ({cpu_s:.1f} CPU s in "
            f"{processes} process{'' if processes == 1 else 'es'})")


def efficiency_text(summary: dict[str, Any], strategy: str) -> str:
    """The end line's efficiency (``bound_s`` / device time), or why there is none."""
    eff = summary.get("efficiency")
    if isinstance(eff, float):
        return f"{eff:.2f}"
    if strategy != "tile-tp":
        return "n/a (no bound for this strategy)"
    return "n/a (no GEMM was offloaded: job.parallelism.min_offload_flops)"


def tile_tp_only(args: argparse.Namespace, strategy: str) -> str | None:
    """The tile-tp option given for a baseline, said as the error line; None if there is none
    (``--trace-tiles``'s is load_run_inputs', as for testbed up)."""
    if strategy != "tile-tp" and args.ps_gemm_s:
        return (f"--ps-gemm-s: the {strategy} baseline offloads no GEMM to wait for "
                "(job.parallelism.strategy); tile-tp only")
    return None


def run_simulate(args: argparse.Namespace) -> int:
    """The `testbed simulate` command."""
    from testbed.ps_backend.planning_processes import progress_line
    from testbed.run_lock import RunLock
    from testbed.runlog import read_jsonl
    from testbed.up import load_run_inputs, make_run_dir, portable_input

    inputs = load_run_inputs(args.topology, steps=args.steps, churn_path=args.churn,
                             trace_tiles=args.trace_tiles)
    if isinstance(inputs, int):
        return inputs
    topology, _, schedule = inputs
    strategy = topology.job.parallelism.strategy
    problem = tile_tp_only(args, strategy)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir = make_run_dir(Path(args.out), topology.name)
    # held while it runs, as testbed up holds its run's: a report of the run meanwhile says
    # running, not failed (the kernel drops it when this process ends, killed or not)
    lock = RunLock(run_dir)
    (run_dir / "topology.input.yaml").write_text(portable_input(Path(args.topology)))
    (run_dir / "topology.yaml").write_text(yaml.safe_dump(topology.to_yaml(), sort_keys=False))
    print(f"run directory: {run_dir} (simulated)")
    for note in not_simulated(topology):
        print(note, flush=True)

    def progress(step: int, device_s: float, wall_s: float) -> None:
        print(step_line(step, device_s, wall_s), flush=True)

    def during(step: int, device_s: float, tiles: int, wall_s: float, planning_s: float,
               gemms: int, step_gemms: int) -> None:
        print(during_line(step, device_s, tiles, wall_s, planning_s, gemms, step_gemms),
              flush=True)

    def planning() -> None:
        print("planning every linear's tiles before the first step (minutes for a job of "
              "millions of tokens a step)", flush=True)

    def planning_progress(planned: int, shapes: int, wall_s: float) -> None:
        print(progress_line(planned, shapes, wall_s), flush=True)

    def planned(shapes: int, processes: int, wall_s: float, cpu_s: float) -> None:
        print(planned_line(shapes, processes, wall_s, cpu_s), flush=True)
    try:
        if strategy != "tile-tp":  # the baselines (docs/baselines.md)
            from testbed.baselines.run import simulate_baseline
            summary = simulate_baseline(topology, run_dir, schedule, progress=progress)
        else:
            # fifo cuts fixed tiles: nothing is planned before the first step
            summary = simulate(topology, run_dir, schedule, progress=progress,
                               ps_gemm_s=args.ps_gemm_s, trace_tiles=args.trace_tiles,
                               during=during, on_planned=planned,
                               planning=planning_progress,
                               on_planning=(planning if topology.job.parallelism.planner
                                            != "fifo" else None))
    except KeyboardInterrupt:
        try:
            done = json.loads((run_dir / "summary.json").read_text())["steps_done"]
        except (OSError, ValueError, KeyError):  # interrupted again while it was written
            print(f"interrupted; run directory {run_dir}", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(f"interrupted: {done} step{'' if done == 1 else 's'} kept in {run_dir} "
              f"(summary.json, report)", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        lock.release()  # summary.json is written by now
    if summary["state"] != "done":
        print(f"error: {summary['error']}", file=sys.stderr)
        return EXIT_FAILURE
    done = summary["steps_done"]
    # a baseline's virtual time also holds what is outside its steps: the model handed out to
    # its devices, restores and restarts
    in_steps = sum(s.get("device_time_s", 0.0) for s in read_jsonl(run_dir / "steps.jsonl"))
    extra = summary["wall_s"] - in_steps
    print(f"done: {done} step{'' if done == 1 else 's'}, {in_steps:.3f} s device time"
          + (f" ({summary['wall_s']:.3f} s in all, the model handed out to its devices"
             + (f" and {summary['restarts']} restart(s)" if summary.get("restarts") else "")
             + " included)" if extra > 5e-4 else "")
          + f", efficiency {efficiency_text(summary, strategy)}, energy "
            f"{summary['energy']['total']['total_j']:.1f} J")
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `testbed simulate`."""
    from testbed.topology import MAX_STEPS

    p = sub.add_parser(
        "simulate", help="run a topology's job in virtual time (no processes, no tensors)",
        description="Simulate a topology's job: the PS's scheduler and planner, the devices' "
                    "models, churn and a flow-level network in virtual time. Writes the same "
                    "run directory as `testbed up` (<DIR>/<time>-<name>/), marked simulated. A "
                    "job whose parallelism.strategy is pipeline or data-parallel runs those "
                    "baselines (docs/baselines.md). Prints each step's device time, and within "
                    "a long tile-tp step (a thousand devices take minutes) its progress every "
                    "10 s. "
                    "Exit: 0 done, 1 failed while running (a stalled simulation), 2 bad input "
                    "(nothing written), 130 interrupted (the steps done are kept).")
    p.add_argument("topology", metavar="TOPOLOGY", type=path_arg, help="the topology YAML file")
    p.add_argument("--churn", type=path_arg, metavar="TRACE",
                   help="churn trace CSV to replay (default: the topology's churn:)")
    p.add_argument("--steps", type=int, metavar="N",
                   help=f"training steps, 1 to {MAX_STEPS:,} (default: the topology's job.steps)")
    p.add_argument("--out", type=path_arg, default="runs", metavar="DIR",
                   help="parent of the run directory (default: runs)")
    p.add_argument("--ps-gemm-s", type=number_arg(0, 3600), default=0.0, metavar="S",
                   help="the PS's own time per offloaded GEMM, device seconds, 0 to 3600 "
                        "(default 0: not modelled; tile-tp only; see docs/simulate.md)")
    p.add_argument("--trace-tiles", action="store_true",
                   help="write RUN_DIR/tiles.jsonl: every accepted tile's times (handed out, "
                        "on the device, started, done, back), virtual seconds, as testbed up "
                        "--trace-tiles writes them (read with bench/stage_profile.py --run RUN "
                        "--tiles); ~300 bytes a tile; tile-tp only")
    p.set_defaults(func=run_simulate)
