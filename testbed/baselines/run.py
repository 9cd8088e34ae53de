"""A pipeline or data-parallel job in virtual time, into a run directory of the usual shape.

``testbed simulate`` dispatches here for ``job.parallelism.strategy: pipeline | data-parallel``
(tile-tp stays in :mod:`testbed.simulate.run`). The run directory has the files
``testbed simulate`` writes (``steps.jsonl``, ``events.jsonl``, ``devices.jsonl``,
``summary.json`` with ``"simulated": true``, energy and carbon, the report), plus per step
``strategy`` and ``redo`` (a step done again after a pipeline restart) and in the summary
``steps_executed``, ``steps_redone``, ``restarts``, ``restore_s`` and the final placement.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from testbed.baselines.data_parallel_sim import DataParallelSim
from testbed.baselines.pipeline_sim import NoPlacement, PipelineSim, StepOutcome
from testbed.baselines.sim_core import BaselineWorld
from testbed.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK
from testbed.interrupts import held
from testbed.topology import Topology


def simulate_baseline(topology: Topology, run_dir: Path, schedule: Any = None,
                      noise: bool = True, report: bool = True,
                      progress: Callable[[int, float, float], None] | None = None
                      ) -> dict[str, Any]:
    """Simulate a pipeline or data-parallel job into run_dir; return the summary. Interrupted
    (KeyboardInterrupt), it writes the summary of the steps done, then raises it again."""
    from testbed.runlog import RunLog
    from testbed.summary import write_simulated_summary

    strategy = topology.job.parallelism.strategy
    world: BaselineWorld | None = None
    log = RunLog(run_dir, elapsed_s=lambda: world.now_s if world is not None else 0.0)
    world = BaselineWorld(topology, schedule, emit=log.event, noise=noise)
    sim: PipelineSim | DataParallelSim = (PipelineSim(topology, world) if strategy == "pipeline"
                                          else DataParallelSim(topology, world))
    job = topology.job
    started = time.monotonic()
    executed: list[StepOutcome] = []
    last = [time.monotonic()]

    def on_step(o: StepOutcome) -> None:
        now = time.monotonic()
        with held():  # the step's line and its count, or neither (testbed.interrupts)
            log.step(step=o.step, loss=None, wall_s=round(o.device_s, 6),
                     device_time_s=round(o.device_s, 6), sim_wall_s=round(now - last[0], 6),
                     strategy=strategy, redo=o.redo, tiles=0, bytes_down=o.bytes_down,
                     bytes_up=o.bytes_up, device_compute_s=round(o.compute_s, 6),
                     energy_j=round(o.energy_j, 6), simulated=True, **o.fields)
            executed.append(o)
        if progress is not None:
            progress(o.step, o.device_s, now - last[0])
        last[0] = now

    state, error = "done", None
    interrupted = False
    try:
        log.event("ps_start", expected_devices=len(topology.devices), time_dilation=1.0,
                  simulated=True, strategy=strategy)
        world.start()
        log.event("training_start", devices=len(world.present()), strategy=strategy)
        sim.run(job.steps, on_step)
    except NoPlacement as exc:
        state, error = "failed", str(exc)
        log.event("ps_failed", error=error)
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM, testbed.cli): the steps done are kept
        state, interrupted = "interrupted", True
    devices = world.device_records()
    events = log.finish(devices, state)
    done = sorted({o.step for o in executed})
    summary: dict[str, Any] = {
        "run": run_dir.name, "simulated": True, "strategy": strategy, "state": state,
        "error": error, "steps_done": len(done), "steps": job.steps,
        "steps_executed": len(executed), "final_loss": None, "losses": [],
        "wall_s": round(world.now_s, 6), "sim_wall_s": round(time.monotonic() - started, 3),
        "time_dilation": 1.0, "tiles": 0,
        "bytes_down": sum(d["bytes_down"] for d in devices),
        "bytes_up": sum(d["bytes_up"] for d in devices),
        "device_compute_s": round(sum(d["compute_s"] for d in devices), 6),
        "energy_j": round(sum(d["energy_j"] for d in devices), 6),
        "micro_batches": job.parallelism.micro_batches,
        "local_steps": job.parallelism.local_steps,
        "network": {"backend": "simulated", "rate": "flow-level max-min fair",
                    "delay": "path delay", "loss": "Mathis cap on the device link",
                    "paths": "device to device through the lowest common switch"},
        "exit_code": {"done": EXIT_OK, "interrupted": EXIT_INTERRUPTED}.get(state, EXIT_FAILURE),
        "devices": devices}
    if isinstance(sim, PipelineSim):
        summary.update(steps_redone=sim.steps_redone, restarts=sim.restarts,
                       restore_s=round(sim.restore_s, 6),
                       checkpoint_every=job.parallelism.checkpoint_every,
                       placement={"devices": list(sim.plan.devices) if sim.plan else [],
                                  "bounds": [list(b) for b in sim.plan.bounds]
                                  if sim.plan else []})
    else:
        summary.update(steps_redone=0, restarts=0,
                       dropped_replica_steps=sim.dropped_replica_steps,
                       placement={"replicas": list(sim.plan.replicas) if sim.plan else [],
                                  "rows": list(sim.plan.rows) if sim.plan else []})
    summary = write_simulated_summary(run_dir, topology, summary, events, report)
    if interrupted:
        raise KeyboardInterrupt  # on to the caller (run_simulate; compare stops too)
    return summary
