"""``testbed compare TOPOLOGY [--churn TRACE] [--strategies ...] --simulate [--out DIR]``.

Runs the topology's job once per strategy (``tile-tp``, ``pipeline``, ``data-parallel``) on the
same devices, device models, network and churn trace, each into its own run directory, and
writes beside them a comparison: ``comparison.md``, ``comparison.csv``, ``comparison.json`` and
``comparison.png``, with a cloud GPU reference row (``--gpu``, A5000 by default). With
``--simulate`` every strategy runs in virtual time (churn included). Without it they run on
Mininet (root): tile-tp through ``testbed up``, the pipeline and data parallelism
(synchronous or DiLoCo) as stage and replica processes (:mod:`testbed.baselines.emulate`);
every strategy replays churn there too.

Columns: median device time per executed step; wall time of the whole run (restarts and
restores included); bytes per participating device per step, each way; energy and carbon per
step and in total (edge devices: compute, idle while participating, radio; the GPU: board
power x PUE); steps redone (pipeline restarts), lost work (tile-tp: re-queued tiles;
data-parallel: replica-steps dropped); the largest OPT shape (Zhang et al. 2022, Table 1)
each strategy could train on these devices' memory.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import json
import logging
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from testbed.baselines import cost
from testbed.baselines.gpu import GpuProfile, gpu_step, load_gpu
from testbed.baselines.memory import gib
from testbed.baselines.placement import (
    FitError,
    device_infos,
    fit_problems,
    pipeline_fits,
    plan_data_parallel,
)
from testbed.emulator.energy import DEFAULT_GRID_G_PER_KWH, carbon_g, topology_energy
from testbed.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, InputError
from testbed.interrupts import held
from testbed.topology import JobSpec, Topology
from testbed.units import number_arg, size_arg
from testbed.user_paths import path_arg

STRATEGIES = ("tile-tp", "pipeline", "data-parallel")
DEFAULT_PS_MEMORY = "64GiB"  # assumption: a workstation-class PS (the seeds' PS is a server)
# --ps-memory's floor: the PS holds the model, its gradients and Adam's moments and the batch's
# activations (16 B a parameter and more); below 1 GiB not even OPT-125m (2 GB) fits, so a
# smaller figure is a mistyped unit, not a PS
MIN_PS_MEMORY_BYTES = 2**30
# OPT shapes (Zhang et al. 2022, arXiv 2205.01068, Table 1): layers, hidden, heads; ffn = 4h
OPT_SHAPES = {"OPT-125m": (12, 768, 12), "OPT-350m": (24, 1024, 16),
              "OPT-1.3B": (24, 2048, 32), "OPT-2.7B": (32, 2560, 32),
              "OPT-6.7B": (32, 4096, 32), "OPT-13B": (40, 5120, 40),
              "OPT-30B": (48, 7168, 56), "OPT-66B": (64, 9216, 72),
              "OPT-175B": (96, 12288, 96)}
COLUMNS = ("strategy", "state", "devices_used", "steps_done", "step_s", "bound_s", "wall_s",
           "down_bytes_per_device_step", "up_bytes_per_device_step", "energy_j_per_step",
           "carbon_g_per_step", "energy_j", "carbon_g", "steps_redone", "restarts",
           "churn_events", "churn_events_total", "sequences_trained", "sequences_asked",
           "lost_work", "largest_model", "late_share", "note")
GPU_STATE = "estimate, not run"  # the GPU row: a datasheet roofline (gpu.py), no run behind it
# an emulated row whose host lateness (the share of its step time the processes' real compute
# ran past their device-model holds) is above this is said to be the host's, not the devices':
# tile-tp's fidelity target (testbed up's `dilation_target_p95`), applied to the baselines
LATE_SHARE_TARGET = 0.10
LOSSES_SHOWN = 6  # a row's note shows at most this many of its losses (comparison.json: all)


def with_strategy(topology: Topology, strategy: str) -> Topology:
    """The topology with job.parallelism.strategy replaced."""
    job = topology.job
    return dataclasses.replace(topology, job=dataclasses.replace(
        job, parallelism=dataclasses.replace(job.parallelism, strategy=strategy)))


def opt_job(job: JobSpec, name: str) -> JobSpec:
    """The job with an OPT shape's model (the job's vocabulary and sequence length)."""
    layers, hidden, heads = OPT_SHAPES[name]
    return dataclasses.replace(job, model=dataclasses.replace(
        job.model, hidden=hidden, layers=layers, heads=heads, ffn=4 * hidden))


def fits(topology: Topology, strategy: str, job: JobSpec, ps_memory_bytes: int,
         gpu: GpuProfile | None = None) -> bool:
    """Whether ``strategy`` can hold ``job``'s model on the topology's devices (or the GPU)."""
    if strategy == "gpu":
        assert gpu is not None
        return cost.replica_bytes(job, job.batch_size) <= gpu.memory_bytes
    if strategy == "tile-tp":  # devices hold tiles; the PS holds the model and the batch
        return cost.replica_bytes(job, job.batch_size) <= ps_memory_bytes
    devices = device_infos(topology)
    try:
        if strategy == "data-parallel":
            plan_data_parallel(job, devices)
            return True
    except FitError:
        return False
    return pipeline_fits(job, devices)


def largest_model(topology: Topology, strategy: str, ps_memory_bytes: int,
                  gpu: GpuProfile | None = None) -> str:
    """The largest OPT shape the strategy could train on these devices (memory only)."""
    best = "none of OPT-125m..175B"
    for name in OPT_SHAPES:
        if not fits(topology, strategy, opt_job(topology.job, name), ps_memory_bytes, gpu):
            break
        best = name
    return best


def used_energy_j(energy: dict[str, Any], used: set[str]) -> float:
    """Joules of the devices a strategy used (``energy`` is a run's ``topology_energy``): a
    device that computed nothing and moved no byte in the whole run would be free for other
    work, so no strategy is charged for it (the pipeline's devices beyond its stages were
    never in its run; tile-tp's the plans left out sat in it, idle)."""
    return float(sum(d["total_j"] for name, d in energy["devices"].items() if name in used))


def sequences_trained(summary: dict[str, Any], steps: list[dict[str, Any]],
                      batch_size: int) -> int:
    """Sequences a run trained over its steps: the whole batch each step, except for
    data-parallel steps a replica missed (its rows went untrained; ``took_part`` and
    ``placement.rows``, docs/baselines.md). Redone pipeline steps count once."""
    placement = summary.get("placement") or {}
    rows = dict(zip(placement.get("replicas") or [], placement.get("rows") or []))
    done = [s for s in steps if not s.get("redo")]
    if not rows or not any("took_part" in s for s in done):
        return batch_size * int(summary.get("steps_done", len(done)))
    return sum(sum(_row_count(rows.get(n, 0)) for n in s.get("took_part", rows)) for s in done)


def _row_count(rows: Any) -> int:
    """A replica's rows: a count (simulated) or a [start, end) range (emulated)."""
    return int(rows[1] - rows[0]) if isinstance(rows, (list, tuple)) else int(rows)


def _lost_work(strategy: str, summary: dict[str, Any], trained: int, asked: int) -> str:
    """What churn cost a run (``summary``: its summary.json, or an emulated baseline's result,
    which has the same keys)."""
    if strategy == "tile-tp":
        return (f"{summary.get('requeued_tiles', 0)} tiles re-queued, "
                f"{summary.get('recomputed_tiles', 0)} recomputed")
    if strategy == "pipeline":
        return (f"{summary.get('steps_redone', 0)} steps redone after "
                f"{summary.get('restarts', 0)} restart(s)")
    text = f"{summary.get('dropped_replica_steps', 0)} replica-steps dropped"
    return text + (f" ({asked - trained} of {asked} sequences untrained)" if trained < asked
                   else "")


def _row(strategy: str, summary: dict[str, Any], steps: list[dict[str, Any]],
         grid: float, batch_size: int | None = None,
         churn_total: int | None = None) -> dict[str, Any]:
    devices = [d for d in summary.get("devices", []) if d.get("compute_s") or
               d.get("bytes_down") or d.get("bytes_up")]
    names = {d["device"] for d in devices}
    executed = max(len(steps), 1)
    down = sum(d.get("bytes_down", 0) for d in devices)
    up = sum(d.get("bytes_up", 0) for d in devices)
    # the devices the strategy used, and only those (docs/baselines.md, "Energy"): tile-tp's
    # run charges idle power to every device present, its plans' sat-out ones too
    energy = used_energy_j(summary["energy"], names)
    # per step done: a run that finished none has no per-step figure (its total was shown
    # as one, 0.063 J "a step" for tile-tp's run that failed before its first step)
    done = int(summary.get("steps_done", 0)) or None
    asked = (batch_size or 0) * int(summary.get("steps_done", 0))
    trained = sequences_trained(summary, steps, batch_size) if batch_size else 0
    return {"strategy": strategy, "state": summary["state"], "devices_used": len(names),
            "steps_done": summary.get("steps_done", 0),
            "step_s": statistics.median(s["device_time_s"] for s in steps) if steps else None,
            # tile-tp's lower bound (docs/planning.md): no schedule of its tiles on these devices
            # is faster, so a strategy below it beats tile-tp whatever its planner does
            "bound_s": statistics.median(bounds) if (bounds := [
                s["bound_s"] for s in steps if s.get("bound_s")]) else None,
            "wall_s": summary["wall_s"],
            "down_bytes_per_device_step": down / max(len(names), 1) / executed,
            "up_bytes_per_device_step": up / max(len(names), 1) / executed,
            "energy_j_per_step": energy / done if done else None,
            "carbon_g_per_step": carbon_g(energy, grid) / done if done else None,
            "energy_j": energy, "carbon_g": carbon_g(energy, grid),
            "steps_redone": summary.get("steps_redone", 0), "restarts": summary.get("restarts", 0),
            # how much of the trace this run lived through: a run that ends early misses the
            # trace's later events, so rows under one trace need not have met the same churn
            "churn_events": summary.get("churn_events", 0) if churn_total is not None else None,
            "churn_events_total": churn_total,
            "sequences_trained": trained if batch_size else None,
            "sequences_asked": asked if batch_size else None,
            "lost_work": _lost_work(strategy, summary, trained, asked),
            "note": summary.get("error") or ""}


def _does_not_fit(topo: Topology, strategy: str, largest: str) -> dict[str, Any] | None:
    """The comparison row of a strategy the job does not fit on these devices, else None."""
    problems = fit_problems(topo)
    if not problems:
        return None
    return {"strategy": strategy, "state": "does not fit", "largest_model": largest,
            "note": " ".join(problems)}

UP_STOP_GRACE_S = 60.0  # what `testbed up` takes to stop its agents and take its network down


def _run_up(argv: list[str], line: Callable[[str], None] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """`testbed up` as subprocess.run would run it, each line of its output also given to
    ``line`` as it comes (its steps while it runs), except when this command is interrupted:
    then it gets SIGTERM and the time to stop cleanly (subprocess.run would SIGKILL it, which
    leaves its Mininet bridges for `testbed clean`), and the interrupt goes on."""
    out: list[str] = []
    # its log to a file, not a pipe: a pipe nobody reads while stdout is read could fill
    with tempfile.TemporaryFile("w+") as err, \
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
        assert proc.stdout is not None
        try:
            for text in proc.stdout:
                out.append(text)
                if line is not None:
                    line(text.rstrip("\n"))
            proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            try:
                proc.wait(UP_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        err.seek(0)
        return subprocess.CompletedProcess(argv, proc.returncode, "".join(out), err.read())


def _that_fit(topology: Topology, strategies: list[str], ps_memory_bytes: int,
              rows: list[dict[str, Any]]) -> Iterator[tuple[str, Topology, str]]:
    """Each strategy whose job fits the devices, with the topology as it runs it and the
    largest model it fits; a row saying why for each of the others, added to ``rows`` in
    order."""
    for strategy in strategies:
        topo = with_strategy(topology, strategy)
        largest = largest_model(topo, strategy, ps_memory_bytes)
        unfit = _does_not_fit(topo, strategy, largest)
        if unfit is not None:
            rows.append(unfit)
        else:
            yield strategy, topo, largest


def compare(topology: Topology, out_dir: Path, strategies: list[str], schedule_for: Any,
            gpu: GpuProfile, grid_g_per_kwh: float = DEFAULT_GRID_G_PER_KWH,
            gpu_grid_g_per_kwh: float = DEFAULT_GRID_G_PER_KWH, pue: float = 1.0,
            ps_memory_bytes: int = 64 * 2**30, report: bool = False,
            progress: Callable[[str, Path, dict[str, Any] | None], None] | None = None
            ) -> list[dict[str, Any]]:
    """Run each strategy into out_dir/<strategy>/ and write the comparison; return the rows.
    ``progress(strategy, its directory, None)`` as a strategy starts and ``(..., its row)``
    when it ends."""
    from testbed.baselines.run import simulate_baseline
    from testbed.runlog import read_jsonl
    from testbed.simulate.run import simulate

    inputs = _inputs(topology, gpu, grid_g_per_kwh, gpu_grid_g_per_kwh, pue, ps_memory_bytes,
                     "simulated")
    gpu_row = _gpu_row(topology, gpu, gpu_grid_g_per_kwh, pue, ps_memory_bytes)
    with _comparison_written(out_dir, strategies, inputs, gpu_row) as (rows, under_way):
        for strategy, topo, largest in _that_fit(topology, strategies, ps_memory_bytes, rows):
            run_dir = out_dir / strategy
            run_dir.mkdir(parents=True)
            schedule = schedule_for(topo)
            churn_total = len(schedule.actions) if schedule is not None else None
            under_way.update(strategy=strategy, run_dir=run_dir, largest=largest,
                             row_so_far=functools.partial(_simulated_row_so_far, strategy,
                                                          run_dir, grid_g_per_kwh,
                                                          topo.job.batch_size, churn_total))
            if progress is not None:
                progress(strategy, run_dir, None)
            summary = (simulate(topo, run_dir, schedule, report=report) if strategy == "tile-tp"
                       else simulate_baseline(topo, run_dir, schedule, report=report))
            steps = [s for s in read_jsonl(run_dir / "steps.jsonl")]
            row = _row(strategy, summary, steps, grid_g_per_kwh, topo.job.batch_size,
                       churn_total)
            row["largest_model"] = largest
            row["note"] = "; ".join(x for x in (row["note"], _ps_memory_note(
                topo, strategy, ps_memory_bytes)) if x)
            rows.append(row)
            under_way.clear()
            if progress is not None:
                progress(strategy, run_dir, row)
    return rows


def _inputs(topology: Topology, gpu: GpuProfile, grid_g_per_kwh: float,
            gpu_grid_g_per_kwh: float, pue: float, ps_memory_bytes: int,
            mode: str) -> dict[str, Any]:
    """What a comparison was run with (comparison.json's ``inputs``; the page's title and
    last line)."""
    return {"topology": topology.name, "steps": topology.job.steps,
            "churn": str(topology.churn or ""), "grid_g_per_kwh": grid_g_per_kwh,
            "gpu_grid_g_per_kwh": gpu_grid_g_per_kwh, "pue": pue,
            "ps_memory_bytes": ps_memory_bytes, "gpu": dataclasses.asdict(gpu), "mode": mode}


@contextlib.contextmanager
def _comparison_written(out_dir: Path, strategies: list[str], inputs: dict[str, Any],
                        gpu_row: dict[str, Any]
                        ) -> Iterator[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """The rows a comparison's strategies add and the strategy under way (see
    :func:`_interrupted_rows`), written to out_dir with the GPU's row when the block ends; on an
    interrupt as a partial comparison, so that what finished stays comparable (its unfinished
    rows saying so), and the interrupt goes on."""
    rows: list[dict[str, Any]] = []
    under_way: dict[str, Any] = {}
    try:
        yield rows, under_way
    except KeyboardInterrupt:
        with held():
            rows.extend(_interrupted_rows(strategies, rows, under_way))
            rows.append(gpu_row)
            write_comparison(out_dir, rows, {**inputs, "mode": f"{inputs['mode']}; "
                                             "INTERRUPTED, partial"})
        raise
    rows.append(gpu_row)
    write_comparison(out_dir, rows, inputs)


def _ps_memory_note(topology: Topology, strategy: str, ps_memory_bytes: int) -> str:
    """tile-tp's PS holds the model, its optimizer state and the batch's activations: a job
    beyond --ps-memory runs in the simulator all the same, which the row must say."""
    need = cost.replica_bytes(topology.job, topology.job.batch_size)
    if strategy != "tile-tp" or need <= ps_memory_bytes:
        return ""
    return (f"the job needs {gib(need)} on the PS, more than --ps-memory "
            f"{gib(ps_memory_bytes)}; run as if the PS held it")


def _interrupted_rows(strategies: list[str], rows: list[dict[str, Any]],
                      under_way: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows for an interrupted comparison: the strategy under way (``under_way``: its strategy,
    run_dir, largest model, and ``row_so_far()``, its row from what its run wrote as it
    stopped, or None where a run writes nothing until it ends) and each strategy never
    started."""
    out: list[dict[str, Any]] = []
    seen = {r["strategy"] for r in rows}
    if under_way:
        strategy, run_dir = under_way["strategy"], under_way["run_dir"]
        seen.add(strategy)
        note = f"interrupted; its run so far: {run_dir}"
        row: dict[str, Any] = {"strategy": strategy}
        so_far = under_way.get("row_so_far")
        try:
            row = (so_far() if so_far is not None else None) or row
        except (OSError, ValueError, KeyError):
            pass  # no summary yet: the row says only that it was interrupted
        out.append({**row, "state": "interrupted", "note": note,
                    "largest_model": under_way["largest"]})
    out += [{"strategy": s, "state": "not run (interrupted before it)"}
            for s in strategies if s not in seen]
    return out


def _simulated_row_so_far(strategy: str, run_dir: Path, grid: float, batch: int,
                          churn_total: int | None) -> dict[str, Any] | None:
    """A simulated run's row from the summary it wrote as it stopped; None before a step."""
    from testbed.runlog import read_jsonl

    summary = json.loads((run_dir / "summary.json").read_text())
    steps = read_jsonl(run_dir / "steps.jsonl")
    if not (summary.get("energy") and steps):
        return None
    return _row(strategy, summary, steps, grid, batch, churn_total)


def _gpu_row(topology: Topology, gpu: GpuProfile, gpu_grid_g_per_kwh: float, pue: float,
             ps_memory_bytes: int) -> dict[str, Any]:
    g = gpu_step(topology.job, gpu, pue)
    steps_n = topology.job.steps
    return {"strategy": f"gpu:{gpu.name}", "state": GPU_STATE, "devices_used": 1,
            "steps_done": steps_n, "step_s": g.step_s, "wall_s": g.step_s * steps_n,
            "down_bytes_per_device_step": 0, "up_bytes_per_device_step": 0,
            "energy_j_per_step": g.energy_j,
            "carbon_g_per_step": carbon_g(g.energy_j, gpu_grid_g_per_kwh),
            "energy_j": g.energy_j * steps_n,
            "carbon_g": carbon_g(g.energy_j * steps_n, gpu_grid_g_per_kwh),
            "steps_redone": 0, "restarts": 0, "lost_work": "",
            "sequences_trained": topology.job.batch_size * steps_n,
            "sequences_asked": topology.job.batch_size * steps_n,
            "largest_model": largest_model(topology, "gpu", ps_memory_bytes, gpu),
            "fits": g.fits,
            "note": "" if g.fits else f"the job needs {gib(g.need_bytes)}, more than the "
                                      f"GPU's {gib(gpu.memory_bytes)}"}


def losses_text(losses: list[float]) -> str:
    """A run's losses for its note: every one up to :data:`LOSSES_SHOWN`, else the first and
    last few (a 200-step run's note was 200 numbers long; comparison.json keeps them all)."""
    xs = [f"{x:.6f}" for x in losses]
    if len(xs) <= LOSSES_SHOWN:
        return "losses " + ", ".join(xs)
    return (f"losses {', '.join(xs[:3])}, ..., {', '.join(xs[-2:])} ({len(xs)}; every one in "
            "comparison.json)")


def host_lateness(reports: list[dict[str, Any]], dilation: float,
                  step_s: list[float]) -> float | None:
    """The largest share of an emulated baseline's step time that one of its processes' late
    holds can account for: its holds' lateness in all (``lag_total_s``, wall seconds, over D)
    over the device seconds of the steps it ran in (``step_s``). A hold ends late when the
    process's real compute on this host outlasts the device model's time x D; every second of
    it lengthens a step that waits on that process, so the step is the host's, not the
    device's. None when the reports do not say (or D is 0: no holds)."""
    lags = [r["lag_total_s"] for r in reports if isinstance(r.get("lag_total_s"), (int, float))]
    total = sum(step_s)
    if not lags or dilation <= 0 or total <= 0:
        return None
    return max(lags) / dilation / total


def _lateness_note(share: float | None, of: str = "its steps' device time, in all") -> str:
    """The part of an emulated row's note that gives its host lateness."""
    if share is None:
        return ""
    return f"; the host's lateness up to {share:.1%} of {of}"


def _emulated_row(strategy: str, topology: Topology, res: dict[str, Any], dilation: float,
                  grid: float) -> dict[str, Any]:
    """A comparison row from an emulated pipeline or data-parallel run on Mininet."""
    from testbed.emulator.energy import run_energy
    from testbed.perf_model.profiles import load_profile

    if strategy == "pipeline":  # every attempt's step runs (restarts redo some steps)
        reports = res.get("attempt_reports") or res["stages"]
        runs = [e for e in res["executed"] if isinstance(e.get("wall_s"), (int, float))]
        timed = [e for e in runs if not e.get("partial")] or runs  # every stage's time in
        step_s = [e["wall_s"] / dilation for e in timed]
        steps_n = len({e["step"] for e in runs})
    else:  # the PS's step times: replicas come and go under churn
        reports = [r for k, r in res["reports"].items() if k != "ps"]
        step_s = [x / dilation for x in res["reports"]["ps"]["step_s"]]
        runs = step_s
        steps_n = len(step_s)
    end_s = res["wall_s"] / dilation if res.get("restarts") or res.get("churn_events") \
        else sum(step_s)
    specs = {d.name: d for d in topology.devices}
    # device -> (busy s, J) over every process on it (a pipeline's attempts, a replica's
    # returns): what ran, up to a kill (its ledger, charge.py; a report counts whole steps)
    work: dict[str, tuple[float, float]] = {}
    for r in res.get("work") or res.get("attempt_reports") or reports:
        busy, joules = work.get(r["device"], (0.0, 0.0))
        work[r["device"]] = (busy + r["device_s"], joules + r["energy_j"])
    devices, power, links = [], {}, {}
    for name, (busy, joules) in work.items():
        d = specs[name]
        link = res["links"][d.name]
        devices.append({"device": d.name, "compute_s": busy, "energy_j": joules,
                        "tiles_done": 0, "bytes_down": link["rx_bytes"],
                        "bytes_up": link["tx_bytes"]})
        power[d.name] = load_profile(str(d.group.profile_path), check=False).power
        links[d.name] = (d.link.down_bps, d.link.up_bps)
    events = [{"device": d["device"], "event": "join", "elapsed_s": 0.0} for d in devices]
    energy = run_energy(devices, events, power, links, 1.0, end_s, grid)
    total_j = float(energy["total"]["total_j"])
    n = len(devices)
    asked = topology.job.batch_size * steps_n
    trained = asked
    if strategy == "data-parallel" and res.get("took_part"):
        rows = res.get("rows") or []
        trained = sum(_row_count(rows[i]) for t in res["took_part"] for i in t
                      if i < len(rows))
    late = host_lateness(reports, dilation, step_s)
    return {"strategy": strategy, "state": "done", "devices_used": n, "steps_done": steps_n,
            "step_s": statistics.median(step_s), "wall_s": end_s,
            # bytes per step run, energy per step done (as the simulated rows, _row)
            "down_bytes_per_device_step": sum(d["bytes_down"] for d in devices) / n / len(runs),
            "up_bytes_per_device_step": sum(d["bytes_up"] for d in devices) / n / len(runs),
            "energy_j_per_step": total_j / steps_n, "carbon_g_per_step":
            carbon_g(total_j, grid) / steps_n, "energy_j": total_j,
            "carbon_g": carbon_g(total_j, grid), "steps_redone": res.get("steps_redone", 0),
            "restarts": res.get("restarts", 0),
            "sequences_trained": trained, "sequences_asked": asked,
            # what churn cost it, in the simulated rows' and tile-tp's words: "no churn
            # replayed" also stood for a trace whose events all came after the run's end
            "lost_work": _lost_work(strategy, res, trained, asked),
            "late_share": late, "losses": list(res["losses"]),
            "note": f"Mininet, D = {dilation:g}; bytes from the hosts' interface counters"
                    f"{_lateness_note(late)}; {losses_text(res['losses'])}"}


def compare_emulated(topology_path: Path, topology: Topology, out_dir: Path,
                     strategies: list[str], gpu: GpuProfile,
                     grid_g_per_kwh: float = DEFAULT_GRID_G_PER_KWH,
                     gpu_grid_g_per_kwh: float = DEFAULT_GRID_G_PER_KWH, pue: float = 1.0,
                     ps_memory_bytes: int = 64 * 2**30,
                     schedule_for: Any = None,
                     progress: Callable[[str, Path, dict[str, Any] | None], None] | None = None,
                     during: Callable[[str, Any], None] | None = None
                     ) -> list[dict[str, Any]]:
    """Each strategy on Mininet: tile-tp through `testbed up`, the baselines as stage and
    replica processes (testbed/baselines/emulate.py); then the comparison files. With churn
    (``topology.churn``, ``schedule_for(topology) -> ChurnSchedule``): every strategy replays
    it. ``progress`` as :func:`compare`'s; ``during(strategy, record)`` with each of a
    baseline's progress records as it runs (:class:`testbed.baselines.emulate.StepDone` and
    the others, said by ``progress_line``), and with each line tile-tp's `testbed up` prints."""
    import yaml

    from testbed.baselines.emulate import emulate_data_parallel, emulate_pipeline
    from testbed.up import portable_input
    from testbed.user_paths import load_user_yaml

    raw = load_user_yaml(portable_input(topology_path))
    raw.setdefault("network", {})["backend"] = "mininet"
    raw["job"]["steps"] = topology.job.steps
    dilation = topology.time_dilation or 1.0
    mode = f"emulated on Mininet, D = {dilation:g}" + (
        " for the baselines, tile-tp at its own (its note)"
        if "tile-tp" in strategies and topology.time_dilation is None else "")
    inputs = _inputs(topology, gpu, grid_g_per_kwh, gpu_grid_g_per_kwh, pue, ps_memory_bytes,
                     mode)
    gpu_row = _gpu_row(topology, gpu, gpu_grid_g_per_kwh, pue, ps_memory_bytes)
    with _comparison_written(out_dir, strategies, inputs, gpu_row) as (rows, under_way):
        for strategy, topo, largest in _that_fit(topology, strategies, ps_memory_bytes, rows):
            raw["job"].setdefault("parallelism", {})["strategy"] = strategy
            path = out_dir / f"{strategy}.yaml"
            path.write_text(yaml.safe_dump(raw, sort_keys=False))
            schedule = schedule_for(topo) if schedule_for and topology.churn else None
            churn_total = len(schedule.actions) if schedule is not None else None
            runs = out_dir / strategy
            # tile-tp's `testbed up` writes its summary as it stops; the baselines' processes
            # report only at their end, so an interrupted one's row says only that
            under_way.update(strategy=strategy, run_dir=runs, largest=largest,
                             row_so_far=functools.partial(
                                 _up_row, topology, topo, runs, grid_g_per_kwh, churn_total)
                             if strategy == "tile-tp" else None)
            if progress is not None:
                progress(strategy, runs, None)
            row: dict[str, Any]
            try:
                if strategy == "tile-tp":
                    churn = ["--churn", str(topology.churn)] if topology.churn else []
                    done = _run_up([sys.executable, "-m", "testbed.cli", "up", str(path),
                                    "--no-live", "--out", str(runs), *churn],
                                   line=(functools.partial(during, strategy)
                                         if during is not None else None))
                    if done.returncode != 0:
                        raise RuntimeError(f"testbed up exited {done.returncode}: "
                                           f"{done.stderr.strip()[-300:]}")
                    row = _up_row(topology, topo, runs, grid_g_per_kwh, churn_total)
                else:
                    emulate = (emulate_pipeline if strategy == "pipeline"
                               else emulate_data_parallel)
                    res = emulate(path, runs, dilation=dilation, schedule=schedule,
                                  progress=(functools.partial(during, strategy)
                                            if during is not None else None))
                    row = _emulated_row(strategy, topo, res, dilation, grid_g_per_kwh)
                    if schedule is not None:  # the trace's events that came while it ran
                        row["churn_events"] = res["churn_events"]
                        row["churn_events_total"] = churn_total
            except (RuntimeError, OSError, ValueError) as exc:
                row = {"strategy": strategy, "state": "failed", "note": str(exc)}
            row["largest_model"] = largest
            rows.append(row)
            under_way.clear()
            if progress is not None:
                progress(strategy, runs, row)
    return rows


def _up_row(topology: Topology, topo: Topology, runs: Path, grid: float,
            churn_total: int | None) -> dict[str, Any]:
    """tile-tp's row from the run `testbed up` made in ``runs`` (``topo``: the topology as
    that strategy runs it), in the baselines' terms: device seconds, energy from its training's
    start. Also an interrupted run's, from the summary it wrote as it stopped."""
    from testbed.runlog import read_jsonl

    (run_dir,) = list(runs.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = read_jsonl(run_dir / "steps.jsonl")
    up_d = float(summary.get("time_dilation") or 1.0)
    # energy from its training's start, as the baselines' rows count theirs: the run's own
    # figure also charges the devices' idle power while they joined and the PS probed and
    # planned (a one-off run of two steps of home-wifi: 22.9 J a step against 14.9 simulated)
    events = read_jsonl(run_dir / "events.jsonl")
    if any(e.get("event") == "training_start" for e in events):
        summary = {**summary, "energy": topology_energy(
            topo, summary.get("devices") or [], events, up_d, grid,
            from_event="training_start")}
    row = _row("tile-tp", summary, steps, grid, topo.job.batch_size, churn_total)
    # in device seconds, as the baselines' rows: testbed up's wall_s is real seconds at its
    # own time dilation (auto picks one), from the PS's start
    row["wall_s"] = (summary["wall_s"] / up_d if topology.churn
                     else sum(s["device_time_s"] for s in steps))
    losses = list(summary.get("losses") or [])
    # its fidelity verdict (docs/architecture.md): how much of a step the devices' lateness
    # can account for, the figure the baselines' rows give as their host lateness
    late = summary.get("lateness_share_max")
    row["late_share"] = float(late) if isinstance(late, (int, float)) else None
    row["losses"] = losses
    row["note"] = (f"Mininet via testbed up ({run_dir.name}), D = {up_d:.3g}"
                   + (" (time_dilation: auto)" if topology.time_dilation is None else "")
                   + "; bytes from the PS's payload accounting; energy from its training's "
                   f"start{_lateness_note(row['late_share'], 'its worst step')}"
                   + ("; emulation fidelity missed (its summary's fidelity_ok)"
                      if summary.get("fidelity_ok") is False else "")
                   + f"; {losses_text(losses)}")
    return row


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _fairness_notes(rows: list[dict[str, Any]], steps_n: int) -> list[str]:
    """What the rows did not share: steps, the trace's churn, the sequences trained."""
    ran = [r for r in rows if r.get("step_s") is not None]
    notes = []
    for r in ran:
        if r.get("steps_done") is not None and int(r["steps_done"]) < steps_n:
            notes.append(f"- {r['strategy']}: {r['state']} after {r['steps_done']} of "
                         f"{steps_n} steps; its per-step figures are its run so far (an unfinished "
                         f"step's work included) over the steps done")
    met = {r["strategy"]: r.get("churn_events") for r in ran
           if r.get("churn_events_total") is not None and r.get("churn_events") is not None}
    if len(set(met.values())) > 1:
        total = next(r["churn_events_total"] for r in ran if r["strategy"] in met)
        notes.append("- not the same churn: each run replays the trace from its own start "
                     "and meets only the events that come before it ends ("
                     + ", ".join(f"{s} {n} of {total}" for s, n in met.items())
                     + "); a run that ended before an event never paid for it")
    for r in ran:
        trained, asked = r.get("sequences_trained"), r.get("sequences_asked")
        if trained is not None and asked and trained < asked:
            notes.append(f"- {r['strategy']}: trained {trained} of the {asked} sequences its "
                         f"steps held (dropped replicas' rows go untrained), so its time and "
                         f"energy per step bought fewer tokens than a whole batch")
    for r in ran:
        late = r.get("late_share")
        if isinstance(late, (int, float)) and late > LATE_SHARE_TARGET:
            notes.append(f"- {r['strategy']}: up to {late:.0%} of its step time is this host "
                         f"running late (its processes' real compute outlasted the device "
                         f"model's time x D), more than the {LATE_SHARE_TARGET:.0%} emulation "
                         f"fidelity allows: its times are the host's, not the devices'; a "
                         f"larger `time_dilation:` in the topology gives the processes the CPU "
                         f"they need")
    notes += _loss_notes(ran)
    return notes


def _loss_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Whether the emulated rows' losses agree, step for step (rows with as many losses; in
    float64 the three executors give the same ones, docs/baselines.md): what a reader could
    see by eye when each note listed every loss."""
    runs = [r for r in rows if r.get("losses")]
    if len(runs) < 2:
        return []
    first = runs[0]
    same = [r for r in runs[1:] if len(r["losses"]) == len(first["losses"])]
    if not same:
        return []
    gaps = [(abs(a - b) / max(1.0, abs(a)), i, r["strategy"]) for r in same
            for i, (a, b) in enumerate(zip(first["losses"], r["losses"]))]
    names = ", ".join(r["strategy"] for r in [first, *same])
    worst = max(gaps)
    if worst[0] <= 1e-6:
        return [f"- losses: {names} agree within 1e-6 at each of their "
                f"{len(first['losses'])} steps"]
    why = next((f" ({r['strategy']} dropped replicas: its losses average the rows it "
                f"trained)" for r in [first, *same] if r.get("sequences_trained") is not None
                and r.get("sequences_asked") and r["sequences_trained"] < r["sequences_asked"]),
               "")
    return [f"- losses: {names} differ: at most {worst[0]:.2g} (relative) at step {worst[1]}, "
            f"{worst[2]} against {first['strategy']}{why}"]


def _wall_per_step(row: dict[str, Any]) -> float | None:
    """A row's wall time over its steps done (restarts, restores and stalls included)."""
    done, wall = row.get("steps_done"), row.get("wall_s")
    return wall / int(done) if isinstance(wall, (int, float)) and done else None


def title(inputs: dict[str, Any]) -> str:
    """What a comparison ran: topology, mode, steps and churn trace (comparison.md's heading
    and comparison.png's title)."""
    steps_n = inputs["steps"]
    return (f"Comparison: {inputs['topology']} ({inputs['mode']}, {steps_n} "
            f"step{'s' if steps_n != 1 else ''}"
            f"{', churn ' + inputs['churn'] if inputs['churn'] else ''})")


def write_comparison(out_dir: Path, rows: list[dict[str, Any]], inputs: dict[str, Any]) -> None:
    """comparison.csv, .json, .md and .png in out_dir."""
    with (out_dir / "comparison.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})
    (out_dir / "comparison.json").write_text(json.dumps({"inputs": inputs, "rows": rows},
                                                        indent=2, default=str) + "\n")
    heads = ["strategy", "state", "steps done", "devices used", "median s/step",
             "tile-tp bound s/step", "wall s", "MB down/device/step", "MB up/device/step",
             "J/step", "gCO2e/step", "steps redone", "churn events met", "lost work",
             "largest model"]
    steps_n = inputs["steps"]
    lines = [f"# {title(inputs)}", "",
             "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        mb = [(r.get(k) or 0) / 1e6 if r.get("step_s") is not None else None
              for k in ("down_bytes_per_device_step", "up_bytes_per_device_step")]
        churn = (f"{r['churn_events']} of {r['churn_events_total']}"
                 if r.get("churn_events_total") is not None and r.get("churn_events") is not None
                 else None)
        done = (f"{r['steps_done']} of {steps_n}" if r.get("steps_done") is not None
                and r.get("state") != GPU_STATE else None)
        lines.append("| " + " | ".join(_fmt(v) for v in (
            r["strategy"], r["state"], done, r.get("devices_used"), r.get("step_s"),
            r.get("bound_s"), r.get("wall_s"),
            mb[0], mb[1], r.get("energy_j_per_step"), r.get("carbon_g_per_step"),
            r.get("steps_redone"), churn, r.get("lost_work"), r.get("largest_model"))) + " |")
    lines += ["", "Columns: median s/step is the median device (virtual or undilated) seconds "
              "of a step run, restarts and restores left out; wall s is the whole run, "
              "restarts and restores included; bytes are per device used per step run; J and "
              "gCO2e per step done count the devices used only (their compute, idle and "
              "radio energy over the run); churn events met: the trace's device events that "
              "came while the run lasted, of all in the trace; largest model: the largest OPT "
              "shape that fits these devices' memory (memory only)."
              + (" On Mininet each row's note gives its host lateness (the csv's late_share): "
                 "the share of its step time its processes' real compute on this host ran "
                 "past the device model's time x D (tile-tp: its worst step's, as its run's "
                 "fidelity check; the baselines: their most late process's, over the run)."
                 if inputs["mode"].startswith("emulated") else "")]
    base = next((r for r in rows if r["strategy"] == "tile-tp" and r.get("step_s")), None)
    ref = rows[-1]
    gpu_row = ref if ref.get("state") == GPU_STATE else None
    if gpu_row is not None:
        lines += ["", f"{ref['strategy']} is not a run: an estimate from the GPU's datasheet "
                  f"(GEMM FLOPs over peak x sustained fraction, plus memory-bound bytes over "
                  f"its bandwidth; board power x time x PUE), with no network and no churn"
                  + ("." if ref.get("fits", True) else
                     f"; the job does not fit its memory ({ref.get('note')}), so its "
                     f"figures are for a GPU that could hold it.")]
    against = "time per step against tile-tp" if base is not None else \
        "no tile-tp row, so no time ratios"
    lines += ["", f"Ratios ({against}; energy and carbon per step against the "
              f"{ref['strategy']} estimate):", ""]
    for r in rows[:-1]:
        if not r.get("step_s"):
            continue
        parts = [f"- {r['strategy']}:"]
        if base is not None:
            bound = base.get("bound_s")
            parts.append(f"{r['step_s'] / base['step_s']:.3g}x tile-tp's time per step"
                         + (f" and {r['step_s'] / bound:.3g}x its lower bound;" if bound
                            else ";"))
        wall, base_wall = _wall_per_step(r), _wall_per_step(base) if base is not None else None
        if inputs["churn"] and wall and base_wall:  # restarts and stalls are outside s/step
            parts[-1] = (parts[-1].rstrip(";") + f", {wall / base_wall:.3g}x tile-tp's wall "
                         "time per step done;")
        if r.get("energy_j_per_step") is not None:
            parts.append(f"{r['energy_j_per_step'] / ref['energy_j_per_step']:.3g}x the GPU's "
                         f"energy, {r['carbon_g_per_step'] / ref['carbon_g_per_step']:.3g}x "
                         "its carbon")
        lines.append(" ".join(parts).rstrip(";"))
    if base is not None and base.get("bound_s"):
        lines += ["", f"tile-tp's lower bound: {base['bound_s']:.4g} s a step (its median "
                  f"`bound_s`: no schedule of its tiles on these devices and links is faster; "
                  f"it ran {base['step_s'] / base['bound_s']:.3g}x that). A strategy faster than "
                  f"the bound is faster than any tile-tp planner could be here."]
    notes = [f"- {r['strategy']}: {r['note']}" for r in rows if r.get("note")]
    notes += _fairness_notes(rows[:-1] if gpu_row is not None else rows, steps_n)
    if notes:
        lines += ["", "Notes:", "", *notes]
    gpu = inputs["gpu"]
    lines += ["", f"Inputs: edge grid {inputs['grid_g_per_kwh']:g} gCO2e/kWh, GPU grid "
              f"{inputs['gpu_grid_g_per_kwh']:g} gCO2e/kWh, PUE {inputs['pue']:g}; GPU "
              f"{gpu['name']}: {gpu['peak_fp32_flops'] / 1e12:g} TFLOPS fp32 peak x "
              f"{gpu['sustained_fraction']:g}, {gpu['board_power_w']:g} W, "
              f"{gib(gpu['memory_bytes'])} (sources: testbed/baselines/data/); tile-tp's PS "
              f"memory {gib(inputs['ps_memory_bytes'])}. Largest model: memory only "
              f"(docs/baselines.md)."]
    (out_dir / "comparison.md").write_text("\n".join(lines) + "\n")
    _plot(out_dir, rows, inputs)


def _plot(out_dir: Path, rows: list[dict[str, Any]], inputs: dict[str, Any]) -> None:
    """comparison.png: time, energy and bytes per step, titled with what ran (the picture
    alone, shared without its page, said neither the mode nor the steps nor the trace); under
    churn the time panel also marks each run's wall time per step done."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r.get("step_s")]
    names = [r["strategy"] for r in ran]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [r["step_s"] for r in ran])
    bound = next((r["bound_s"] for r in ran if r.get("bound_s")), None)
    if bound is not None:
        axes[0].axhline(bound, color="black", linestyle="--", linewidth=1,
                        label="tile-tp's lower bound")
        axes[0].legend()
    axes[0].set_ylabel("median device seconds per step")
    if inputs.get("churn"):  # restarts, restores and stalls: outside the median
        walls = [_wall_per_step(r) for r in ran]
        axes[0].scatter([i for i, w in enumerate(walls) if w], [w for w in walls if w],
                        marker="x", color="black", zorder=3,
                        label="wall time per step done")
        axes[0].legend()
    axes[1].bar(names, [r.get("energy_j_per_step") or 0.0 for r in ran])
    axes[1].set_ylabel("J per step")
    x = range(len(ran))
    axes[2].bar([i - 0.2 for i in x], [r["down_bytes_per_device_step"] / 1e6 for r in ran],
                width=0.4, label="down")
    axes[2].bar([i + 0.2 for i in x], [r["up_bytes_per_device_step"] / 1e6 for r in ran],
                width=0.4, label="up")
    axes[2].set_xticks(list(x), names)
    axes[2].set_ylabel("MB per device per step")
    axes[2].legend()
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(title(inputs), fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "comparison.png", dpi=100)
    plt.close(fig)


@contextlib.contextmanager
def _quiet_networks(quiet: bool) -> Iterator[None]:
    """The baselines' Mininet networks coming up and down said nothing a user reads between
    compare's own lines (tile-tp's, in its `testbed up`, went to that run's output): their
    INFO lines only with --verbose, warnings always."""
    logger = logging.getLogger("testbed.emulator.network")
    before = logger.level
    if quiet:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(before)


def run_compare(args: argparse.Namespace) -> int:
    """The `testbed compare` command."""
    from testbed.churn import TraceError, load_schedule
    from testbed.up import load_run_inputs, make_run_dir

    if not args.simulate:
        from testbed.emulator.network.probe import probe

        missing = probe().missing()
        if missing:
            print(f"error: the emulated comparison runs on Mininet, which cannot run here "
                  f"(missing: {'; '.join(missing)}); --simulate runs in virtual time",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        print(f"error: --strategies: unknown {bad or 'empty list'}; expected a comma-separated "
              f"subset of {','.join(STRATEGIES)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    twice = sorted({s for s in strategies if strategies.count(s) > 1})
    if twice:  # each strategy has one run directory; a second run would find it taken
        print(f"error: --strategies: {', '.join(twice)} named more than once; expected each "
              f"of {','.join(STRATEGIES)} at most once", file=sys.stderr)
        return EXIT_BAD_INPUT
    # the topology, --steps and the churn trace, checked as `testbed up` and `simulate` do
    inputs = load_run_inputs(args.topology, steps=args.steps, churn_path=args.churn)
    if isinstance(inputs, int):
        return inputs
    topology, churn, _ = inputs
    try:
        gpu = load_gpu(args.gpu)
        schedules = {}
        if churn is not None:
            for s in strategies:  # checked before anything runs
                schedules[s] = load_schedule(churn, with_strategy(topology, s))
    except (InputError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    ps_memory = args.ps_memory
    out_dir = make_run_dir(Path(args.out), f"{topology.name}-compare")
    print(f"comparison directory: {out_dir} ({'simulated' if args.simulate else 'Mininet'})")
    under_way: list[tuple[str, Path]] = []

    def during(strategy: str, record: Any) -> None:  # a step or churn on Mininet
        from testbed.baselines.emulate import progress_line

        text = record if isinstance(record, str) else progress_line(record)  # tile-tp's: lines
        print(f"  {strategy}: {text}", flush=True)

    def progress(strategy: str, run_dir: Path, row: dict[str, Any] | None) -> None:
        if row is None:
            under_way[:] = [(strategy, run_dir)]
            print(f"{strategy}: {topology.job.steps} step(s) "
                  f"{'in virtual time' if args.simulate else 'on Mininet'}...", flush=True)
            return
        under_way.clear()
        step_s = row.get("step_s")
        print(f"{strategy}: {row['state']}" + (f", {step_s:.3f} s a step" if isinstance(
            step_s, float) else "") + (f" ({row['note'][:200]})" if row["state"] == "failed"
                                       and row.get("note") else ""), flush=True)
    try:
        if args.simulate:
            rows = compare(topology, out_dir, strategies,
                           lambda t: schedules.get(t.job.parallelism.strategy), gpu,
                           args.grid_g_per_kwh, args.gpu_grid_g_per_kwh, args.pue, ps_memory,
                           report=not args.no_report, progress=progress)
        else:
            with _quiet_networks(not getattr(args, "verbose", False)):
                rows = compare_emulated(Path(args.topology), topology, out_dir, strategies,
                                        gpu, args.grid_g_per_kwh, args.gpu_grid_g_per_kwh,
                                        args.pue, ps_memory,
                                        lambda t: schedules.get(t.job.parallelism.strategy),
                                        progress=progress, during=during)
    except KeyboardInterrupt:
        where = (f" during {under_way[0][0]} (its run so far: {under_way[0][1]})"
                 if under_way else "")
        partial = out_dir / "comparison.md"
        print(f"interrupted{where}; " + (f"a partial comparison (the strategies that finished, "
              f"the one under way as far as it got) is in {partial}" if partial.is_file()
              else f"no comparison was written in {out_dir}"), file=sys.stderr)
        return EXIT_INTERRUPTED
    print((out_dir / "comparison.md").read_text())
    failed = [r["strategy"] for r in rows if r["state"] == "failed"]
    return EXIT_FAILURE if failed else EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `testbed compare`."""
    p = sub.add_parser(
        "compare", help="run tile-tp, pipeline and data-parallel on one topology side by side, "
                        "with a cloud GPU reference (virtual time or Mininet)",
        description="Run the topology's job with each strategy (tile-tp, a GPipe pipeline as "
                    "DT-FM, data parallelism: averaged every step, or DiLoCo rounds with "
                    "job.parallelism.local_steps above 1) on the same devices, device models, "
                    "network and churn, and write a comparison directory: comparison.md, .csv, "
                    ".json, .png and one run directory per strategy, plus a cloud GPU "
                    "reference row. --simulate: virtual time (testbed simulate's models, "
                    "churn included). Without it: on Mininet (root), tile-tp through testbed "
                    "up, the pipeline and data-parallel as real stage and replica processes "
                    "(churn replayed by all, DiLoCo rounds included); each strategy's steps, "
                    "churn and restarts are printed as they happen, prefixed by the strategy. "
                    "Exit 2 on bad input.")
    p.add_argument("topology", type=path_arg, help="the topology YAML file")
    p.add_argument("--churn", type=path_arg,
                   help="churn trace to replay (default: the topology's churn:)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma-separated strategies among tile-tp, pipeline, data-parallel "
                        "(default: all three)")
    p.add_argument("--simulate", action="store_true",
                   help="run in virtual time (default: on Mininet, needs root)")
    p.add_argument("--steps", type=int, help="training steps (default: the topology's)")
    p.add_argument("--out", type=path_arg, default="runs",
                   help="parent of the comparison directory (default: runs)")
    p.add_argument("--gpu", type=path_arg, default="a5000",
                   help="GPU reference: a shipped name or a YAML file of the same keys "
                        "(default: a5000)")
    p.add_argument("--grid-g-per-kwh", type=number_arg(0, 1e5), default=DEFAULT_GRID_G_PER_KWH,
                   help="the edge devices' grid carbon intensity, gCO2e/kWh (default "
                        f"{DEFAULT_GRID_G_PER_KWH:g}: world average, IEA 2019)")
    p.add_argument("--gpu-grid-g-per-kwh", type=number_arg(0, 1e5), default=DEFAULT_GRID_G_PER_KWH,
                   help="the datacenter's grid carbon intensity, gCO2e/kWh (same default)")
    p.add_argument("--pue", type=number_arg(1, 100), default=1.0,
                   help="datacenter power usage effectiveness applied to the GPU (default 1: "
                        "the board alone, as the edge side counts devices alone)")
    p.add_argument("--ps-memory", type=size_arg(MIN_PS_MEMORY_BYTES), default=DEFAULT_PS_MEMORY,
                   help="tile-tp's PS memory for the largest-model column, at least 1GiB "
                        "(default 64GiB, an assumption)")
    p.add_argument("--no-report", action="store_true",
                   help="skip each run's report.png/report.md (with --simulate; on Mininet "
                        "each run draws its report as testbed up does)")
    p.set_defaults(func=run_compare)
