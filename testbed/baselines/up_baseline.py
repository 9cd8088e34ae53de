"""`testbed up` for ``job.parallelism.strategy: pipeline | data-parallel``: the emulated
baselines (:mod:`testbed.baselines.emulate`) on Mininet, into a run directory.

The run directory holds ``topology.input.yaml`` (the file as given, its paths made absolute:
``testbed up RUN_DIR/topology.input.yaml`` runs the same job again, as a tile-tp run's), the
stage or replica processes' logs and reports, the emulated result
(``pipeline_emulated.json`` / ``data_parallel_emulated.json``) and ``summary.json``: the
comparison row of ``testbed compare`` (step time, bytes per device from the hosts' interface
counters, energy, carbon, lost work) with the run's losses. Churn (``--churn`` or the
topology's) is replayed as in ``testbed compare`` (docs/baselines.md). Not here: ``--resume``,
the live dashboard and ``report.md`` (tile-tp's run artefacts).

While it runs it prints a line per step finished (device and wall seconds, the loss) and per
placement, stage or replica lost, restart and replica back (:func:`testbed.baselines.emulate.
progress_line`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from testbed.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
)
from testbed.run_lock import RunLock
from testbed.topology import Topology


def run_baseline_up(args: argparse.Namespace, topology: Topology, schedule: Any) -> int:
    """Run the topology's pipeline or data-parallel job on Mininet; exit code."""
    from testbed.baselines.placement import fit_problems
    from testbed.emulator.network.select import NetworkUnavailable, resolve_backend
    from testbed.up import backend_problems, make_run_dir

    strategy = topology.job.parallelism.strategy
    where = f"{args.topology}: job.parallelism.strategy: {strategy}"
    if getattr(args, "resume", None):
        print(f"error: {where}: --resume works for tile-tp runs only (a pipeline restarts "
              "from its own checkpoints under churn)", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        backend = resolve_backend(topology)
    except NetworkUnavailable as exc:
        print(f"error: {where} runs on Mininet: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for problem in backend_problems(topology, backend):
        print(f"error: {args.topology}: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    problems = fit_problems(topology)
    if problems:
        print(f"error: {args.topology}: " + "; ".join(problems), file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir = make_run_dir(Path(args.out), topology.name)
    # held until this returns, as `testbed up` holds a tile-tp run's: `testbed clean RUN_DIR`
    # refuses a run that is running (the kernel drops the lock if this process dies)
    lock = RunLock(run_dir)
    try:
        return _run(args, topology, schedule, run_dir)
    finally:
        lock.release()


def _run(args: argparse.Namespace, topology: Topology, schedule: Any, run_dir: Path) -> int:
    """:func:`run_baseline_up`'s run, into its locked run directory."""
    from testbed.baselines.compare import DEFAULT_GRID_G_PER_KWH, _emulated_row
    from testbed.baselines.emulate import (
        Progress,
        emulate_data_parallel,
        emulate_pipeline,
        progress_line,
    )
    from testbed.up import portable_input

    strategy = topology.job.parallelism.strategy
    dilation = topology.time_dilation or 1.0
    print(f"run directory: {run_dir} ({strategy} on Mininet, D = {dilation:g})", flush=True)
    # the file as given, so that the run directory says what ran wherever it is read from (its
    # summary named the file as typed, relative to a directory it did not record)
    (run_dir / "topology.input.yaml").write_text(portable_input(Path(args.topology)))
    summary: dict[str, Any] = {"strategy": strategy,
                               "topology": str(Path(args.topology).resolve()),
                               "steps": topology.job.steps, "dilation": dilation,
                               "churn": str(getattr(args, "churn", None) or topology.churn or "")}

    def progress(p: Progress) -> None:
        print(progress_line(p), flush=True)
    try:
        emulate = emulate_pipeline if strategy == "pipeline" else emulate_data_parallel
        res = emulate(args.topology, run_dir / strategy, steps=topology.job.steps,
                      dilation=dilation, schedule=schedule, progress=progress)
    except (RuntimeError, OSError, ValueError) as exc:
        summary.update(state="failed", exit_code=EXIT_FAILURE, error=str(exc))
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (testbed.cli): the network is down by now
        summary.update(state="interrupted", exit_code=EXIT_INTERRUPTED)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"interrupted; run directory {run_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    row = _emulated_row(strategy, topology, res, dilation, DEFAULT_GRID_G_PER_KWH)
    summary.update(row, exit_code=EXIT_OK, losses=res["losses"])
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{strategy}: {row['steps_done']} steps, {row['step_s']:.3f} s per step (median), "
          f"{row['energy_j_per_step']:.4g} J per step, {row['lost_work']}; losses "
          + ", ".join(f"{x:.6f}" for x in res["losses"]))
    return EXIT_OK
