"""A pipeline run on Mininet: one real stage process per stage device, bytes on real links.

:func:`emulate_pipeline` brings the topology's network up with the Mininet backend, starts
:mod:`testbed.baselines.stage_proc` in each stage device's namespace, waits for the steps, and
reads each stage host's interface counters before and after: the bytes that crossed the links
between stage hosts, next to the payload bytes the stages say they sent. The losses are real
(the last stage's), so the run can be checked against the single-process trainer.

:func:`emulate_data_parallel` does the same for data parallelism (replicas and the PS's
process), synchronous or DiLoCo, with churn.

Both report the run as it goes through ``progress``, a callback taking one record at a time:
:class:`Placed` (the stages or replicas as their processes start, and each pipeline restart's
new placement), :class:`Connected` (those processes up and connected: training starts or
resumes), :class:`StepDone` (a step finished, read from the last stage's or the PS's
``progress*.jsonl`` as it is written) and :class:`ChurnApplied` (a stage or replica process
killed, a replica's standby let in). :func:`progress_line` says one as a line of text. A
step's ``wall_s`` is this host's seconds (the pipeline's slowest stage's, data-parallel's
PS's); its ``step_s`` is device seconds, ``wall_s / D``: the figure the comparison row's
per-step time (``_emulated_row``) takes the median of.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

from testbed.baselines.charge import charge, ledger_path, read_ledger, write_stopped
from testbed.baselines.heard import Heard, heard_timeline
from testbed.baselines.placement import device_infos, plan_pipeline
from testbed.baselines.sim_core import BaselineWorld
from testbed.baselines.slow import CONTROL_DIR, write_slow
from testbed.runlog import write_json_atomic
from testbed.topology import load_topology

if TYPE_CHECKING:  # Mininet is imported where a run starts: not every host has it
    from testbed.emulator.network.mininet import MininetNetwork


@dataclass(frozen=True)
class Placed:
    """Where the stages (or replicas) run: at the start, and a pipeline's again per restart."""

    noun: str  # "stage" or "replica"
    devices: tuple[str, ...]
    parts: tuple[str, ...]  # what each device holds: "layers 0-1", "rows 0-2"
    attempt: int = 0  # 0: the first placement; n: the pipeline's n-th restart
    start_step: int = 0  # the step training starts at (a restart: its checkpoint's)
    redone: int = 0  # a restart: steps it does again (since the checkpoint, and the aborted one)


@dataclass(frozen=True)
class Connected:
    """Every process of a placement is up and connected: training starts (or resumes)."""

    noun: str  # "stage" or "replica"
    count: int
    startup_s: float  # this host's seconds since the processes were started
    attempt: int = 0


@dataclass(frozen=True)
class StepDone:
    """A step the run finished (the last stage's or the PS's progress line)."""

    step: int
    loss: float | None
    wall_s: float  # this host's seconds the step took (the slowest stage's, or the PS's)
    dilation: float
    redo: bool = False  # pipeline: a step done again after a restart
    replicas: int = 0  # data-parallel: the replicas placed
    out: tuple[str, ...] = ()  # data-parallel: the devices of the replicas the step went without

    @property
    def step_s(self) -> float:
        """The step in device seconds (wall / D), as the comparison row counts steps."""
        return self.wall_s / self.dilation


@dataclass(frozen=True)
class ChurnApplied:
    """A churn event the runner applied to a stage's or replica's process."""

    trace_s: float  # the event's time in the trace (x D after training started)
    device: str
    event: str  # the trace's event: leave, crash, partition, join, heal, slow
    effect: str  # what the runner did about it


Progress = Union[Placed, Connected, StepDone, ChurnApplied]


def progress_line(p: Progress) -> str:
    """One progress record as the line `testbed up` and `testbed compare` print."""
    if isinstance(p, StepDone):
        line = f"step {p.step}"
        if p.redo:
            line += " (again, after a restart)"
        line += f": {p.step_s:.3f} s device time ({p.wall_s:.2f} s wall)"
        if p.loss is not None:
            line += f", loss {p.loss:.6f}"
        if p.out:
            line += (f", {p.replicas - len(p.out)} of {p.replicas} replicas (out: "
                     + ", ".join(p.out) + ")")
        return line
    if isinstance(p, Placed):
        where = ", ".join(f"{d} ({part})" for d, part in zip(p.devices, p.parts))
        n = len(p.devices)
        placed = f"{n} {p.noun}{'' if n == 1 else 's'}: {where}"
        if p.attempt == 0:
            return f"placed {placed}; starting {'its process' if n == 1 else 'their processes'}"
        since = (f"from the checkpoint after step {p.start_step - 1}" if p.start_step
                 else "from the start (no checkpoint yet)")
        return (f"restart {p.attempt}: placed again, {placed}; resumes at step {p.start_step} "
                f"{since}, {p.redone} step{'' if p.redone == 1 else 's'} redone")
    if isinstance(p, Connected):
        whom = (f"{p.count} {p.noun}{'' if p.count == 1 else 's'} connected"
                + (" to the PS" if p.noun == "replica" else ""))
        return (f"{whom} {p.startup_s:.1f} s after "
                + ("its process" if p.count == 1 else "their processes")
                + " started: training " + ("starts" if p.attempt == 0 else "resumes"))
    return f"churn: {p.device} {p.event} (trace {p.trace_s:g} s): {p.effect}"


def layer_span(a: int, e: int) -> str:
    """A stage's decoder layers [a, e) in words."""
    if e - a == 0:
        return "no decoder layer"
    return f"layer {a}" if e - a == 1 else f"layers {a}-{e - 1}"


def row_span(rows: Sequence[int]) -> str:
    """A replica's rows [lo, hi) of each batch in words."""
    lo, hi = rows
    return f"row {lo}" if hi - lo == 1 else f"rows {lo}-{hi - 1}"


class JsonlTail:
    """The records appended to a JSON-lines file since the last read; a line still being
    written (no newline yet) waits for the next read."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        """The complete new lines, parsed (none while the file does not exist)."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def _wait_all(procs: Sequence[tuple[Any, subprocess.Popen]], timeout_s: float,
              log_of: Any, poll: Callable[[], None] = lambda: None) -> list[str]:
    """Wait for every process, calling ``poll`` meanwhile (the run's progress); on the first
    failure (or the deadline) kill the others, whose peers are gone (they would wait on a
    socket until the deadline). Returns the failures."""
    deadline = time.monotonic() + timeout_s
    failed: list[str] = []
    while True:
        poll()
        running = [(tag, p) for tag, p in procs if p.poll() is None]
        failed = [f"{tag} exited {p.returncode} (see {log_of(tag)})" for tag, p in procs
                  if p.returncode not in (None, 0)]
        if not running or failed or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for tag, p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
            if not failed:
                failed.append(f"{tag} did not finish within {timeout_s:g} s")
    return failed


def emulate_pipeline(topology_path: str | Path, run_dir: Path, steps: int | None = None,
                     devices: Sequence[str] | None = None,
                     bounds: Sequence[tuple[int, int]] | None = None,
                     micro_batches: int | None = None, dilation: float = 1.0,
                     timeout_s: float = 600.0, schedule: Any = None,
                     progress: Callable[[Progress], None] | None = None) -> dict[str, Any]:
    """Run the topology's job as a GPipe pipeline on Mininet; return what was measured.

    With a churn ``schedule`` (trace time 0 = training start: every stage of the first
    placement connected; times x dilation): a ``partition`` takes the device's switch port
    down and a ``heal`` up again, a ``leave`` or ``crash`` ends its stage's process; the runner
    hears of a stage's device as a network tells it (:mod:`testbed.baselines.heard`: a
    reachable departure at once, a cut-off device at its lease, 5 s x D after the cut, or at a
    heal that comes first), then ends the other stages, places the model again on the devices
    it still holds, and restarts every stage from
    the last checkpoint all stages wrote (``job.parallelism.checkpoint_every``). Steps finished
    since that checkpoint and the aborted one are counted as redone. Joins and heals bring a
    device back for the next placement. A ``slow`` is written to the device's control file
    (:mod:`testbed.baselines.slow`) with its time: a stage there follows it from that time,
    mid-piece, and a stage placed there later starts with it.

    ``progress`` gets, as they happen: the placement once every stage has connected (training
    starts), each step the last stage finishes, each stage killed by churn, and each restart's
    placement as its stages start."""
    from testbed.churn.trace import ChurnEvent
    from testbed.emulator.network.mininet import MininetNetwork

    topo = load_topology(topology_path)
    job = topo.job
    total_steps = steps or job.steps
    m = micro_batches or job.parallelism.micro_batches
    every = job.parallelism.checkpoint_every if schedule is not None else 0
    names = [d.name for d in topo.devices]
    gone: set[str] = set(names) - set(schedule.initially_present) if schedule else set()
    actions = sorted(schedule.actions, key=lambda a: a.time_s) if schedule else []
    # what the runner, DT-FM's scheduler, hears of them, when (the simulator's rule)
    heard = heard_timeline(actions, schedule.initially_present) if schedule else []
    net = MininetNetwork(topo, dilation=dilation)
    specs = {d.name: d for d in topo.devices}
    world = BaselineWorld(topo, noise=False)  # for the paths' one-way delays only
    control_dir = run_dir / CONTROL_DIR if schedule is not None else None
    app_delay = not net.caps.netem  # without netem the stages apply the delay themselves
    run_dir.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[str, subprocess.Popen]] = []
    executed: list[dict[str, Any]] = []
    restarts, redone, start_step, attempt, last_redone = 0, 0, 0, 0, 0
    resume_files: list[str] = []
    ledgers: dict[str, list[Path]] = {}  # device -> its stage processes' ledgers so far
    work: list[dict[str, Any]] = []  # each stage process's work, up to its end or kill
    report = progress or (lambda _p: None)
    net.start()
    try:
        before = {d: net.interface_counters(d) for d in names}
        t0 = time.monotonic()
        clock_origin = t0  # every stage process's device clock (HeldDevice): one per run
        while True:
            alive = [n for n in names if n not in gone]
            if attempt == 0 and devices is not None and bounds is not None:
                use, cuts = list(devices), [tuple(b) for b in bounds]
            else:
                plan = plan_pipeline(job, device_infos(topo, set(alive)))
                use, cuts = list(plan.devices), list(plan.bounds)
            delay_s = [[world.path(src, dst)[1] * dilation if app_delay and src != dst else 0.0
                        for src in use] for dst in use]
            progress_path = run_dir / f"progress{attempt}.jsonl"
            ready_dir = run_dir / f"ready{attempt}"
            ready_dir.mkdir(exist_ok=True)
            ckpt_dir = run_dir / "checkpoints" / f"attempt{attempt}"
            plan_doc = {"topology": str(Path(topology_path).resolve()), "devices": use,
                        "bounds": [list(b) for b in cuts], "micro_batches": m,
                        "steps": total_steps, "dilation": dilation,
                        "clock_origin": clock_origin,
                        "ips": [net.host_ip(d) for d in use], "delay_s": delay_s,
                        "start_step": start_step, "resume_files": resume_files,
                        "checkpoint_every": every, "ckpt_dir": str(ckpt_dir),
                        # each stage's device's earlier processes (their ledgers): it goes
                        # on with their draws and their heat (HeldDevice.resume)
                        "history": [[str(p) for p in ledgers.get(d, [])] for d in use],
                        "progress": str(progress_path), "ready_dir": str(ready_dir),
                        "control_dir": str(control_dir or ""),  # churn `slow` (slow.py)
                        "report_pattern": str(run_dir / f"stage{{}}-attempt{attempt}.json")}
            plan_path = run_dir / f"pipeline_plan{attempt}.json"
            write_json_atomic(plan_path, plan_doc)  # its stages, and a watcher, read it whole
            launched = time.monotonic()
            report(Placed("stage", tuple(use), tuple(layer_span(*b) for b in cuts), attempt,
                          start_step, last_redone))
            procs = []
            for s, d in enumerate(use):
                log = (run_dir / f"stage{s}.log").open("w")
                procs.append((d, net.popen(d, [sys.executable, "-m",
                                               "testbed.baselines.stage_proc",
                                               "--plan", str(plan_path), "--stage", str(s),
                                               "--out",
                                               str(run_dir / f"stage{s}-attempt{attempt}.json")],
                                           stdout=log, stderr=subprocess.STDOUT)))
            ready = functools.partial(_all_ready, ready_dir, len(use))
            connected = _ConnectedOnce(ready, "stage", len(use), launched, attempt, report)
            deadline = time.monotonic() + timeout_s
            if attempt == 0:  # the churn clock starts when training does
                while not ready() and time.monotonic() < deadline \
                        and all(p.poll() is None for _, p in procs):
                    time.sleep(0.02)
                t0 = time.monotonic()
            steps_done = PipelineSteps(
                JsonlTail(progress_path),
                [run_dir / f"stage{s}-attempt{attempt}.json" for s in range(len(use) - 1)],
                start_step, executed, report, dilation)
            stopped = _supervise(procs, actions, t0, dilation, gone, ChurnEvent, deadline,
                                 functools.partial(_each, (connected, steps_done)),
                                 functools.partial(_slow_stage, control_dir, t0, dilation,
                                                   use, report), heard,
                                 lambda d, down: net.set_partitioned(specs[d], down), report)
            killed = stopped[0] if stopped is not None else None
            for s, d in enumerate(use):  # what ran, up to the kill (charge.py)
                ledger = ledger_path(run_dir / f"stage{s}-attempt{attempt}.json")
                ledgers.setdefault(d, []).append(ledger)
                stop = stopped[1].get(d) if stopped is not None else None
                if stop is not None:  # a process started again there heats up to it
                    write_stopped(ledger, stop)
                done = charge(read_ledger(ledger), stop)
                work.append({"device": d, "attempt": attempt, "stage": s,
                             "device_s": done.device_s, "energy_j": done.energy_j})
            steps_done(final=True)  # the lines written before the stages ended
            this_attempt = steps_done.steps
            if stopped is not None and stopped[2] is not None:  # heard at once
                report(ChurnApplied(stopped[2].time_s, stopped[2].device,
                                    stopped[2].event.value,
                                    f"stage {use.index(stopped[2].device)}'s process killed, "
                                    "the other stages ended"))
            elif killed is not None:
                report(ChurnApplied(killed.time_s, killed.device, killed.kind,
                                    f"stage {use.index(killed.device)} lost "
                                    f"({killed.reason}): the stages ended"))
            if killed is None:
                failed = [f"stage{s} exited {p.returncode} (see {run_dir / f'stage{s}.log'})"
                          for s, (_, p) in enumerate(procs) if p.returncode != 0]
                if failed:
                    raise RuntimeError("; ".join(failed))
                break
            # DT-FM: back to the last checkpoint every stage finished, on a new placement
            finished = max(this_attempt, default=start_step - 1)
            if finished == total_steps - 1:  # lost after its last step: nothing to redo
                break
            saved = sorted((int(d.name[4:]), d) for d in ckpt_dir.glob("step*")
                           if len(list(d.glob("stage*.pt"))) == len(use))
            if saved:
                start_step, resume = saved[-1][0], saved[-1][1]
                resume_files = [str(f) for f in sorted(resume.glob("stage*.pt"))]
            last_redone = max(0, finished - start_step + 1) + 1
            redone += last_redone
            restarts += 1
            attempt += 1
        wall_s = time.monotonic() - t0
        after = {d: net.interface_counters(d) for d in names}
        stages = [json.loads((run_dir / f"stage{s}-attempt{attempt}.json").read_text())
                  for s in range(len(use))]
        every_attempt = [json.loads(f.read_text())
                         for f in sorted(run_dir.glob("stage*-attempt*.json"))]
        final: dict[int, float] = {}
        for e in executed:
            final[e["step"]] = e["loss"]
        out = {"devices": use, "bounds": [list(b) for b in cuts], "micro_batches": m,
               "wall_s": wall_s, "stages": stages, "attempt_reports": every_attempt,
               "losses": [final[k] for k in sorted(final)], "executed": executed,
               "restarts": restarts, "steps_redone": redone, "network": net.describe(),
               "work": work,
               # the trace's events whose time came while the run lasted (a tile-tp run's
               # summary counts its replayed ones): those left in `actions` never came
               "churn_events": len(schedule.actions) - len(actions) if schedule else 0,
               "links": {d: {"tx_bytes": after[d]["tx_bytes"] - before[d]["tx_bytes"],
                             "rx_bytes": after[d]["rx_bytes"] - before[d]["rx_bytes"]}
                         for d in names}}
        write_json_atomic(run_dir / "pipeline_emulated.json", out)
        return out
    finally:
        _stop(procs, net)


def _all_ready(ready_dir: Path, n: int) -> bool:
    """Whether n stages have said, by a file each in ready_dir, that they are connected."""
    return len(list(ready_dir.iterdir())) >= n


def _each(fns: Sequence[Callable[[], None]]) -> None:
    """Call each of fns (one poll of several watchers)."""
    for fn in fns:
        fn()


class _ConnectedOnce:
    """Reports :class:`Connected` the first time ``ready()`` is true (called as the run polls)."""

    def __init__(self, ready: Callable[[], bool], noun: str, count: int, launched: float,
                 attempt: int, report: Callable[[Progress], None]):
        self.ready, self.noun, self.count = ready, noun, count
        self.launched, self.attempt, self.report = launched, attempt, report
        self.said = False

    def __call__(self) -> None:
        if not self.said and self.ready():
            self.said = True
            self.report(Connected(self.noun, self.count, time.monotonic() - self.launched,
                                  self.attempt))


class PipelineSteps:
    """An attempt's finished steps as the runner learns them.

    The last stage's progress lines go into the run's executed steps (a step done in an
    earlier attempt is a redo) and the attempt's; each is reported once the other stages'
    reports (rewritten whole after each of their steps) have that step's time too, with the
    slowest stage's, as the comparison row times a step. ``final``: the attempt has ended, the
    steps still waiting are reported with the times there are."""

    def __init__(self, tail: JsonlTail, stage_reports: Sequence[Path], start_step: int,
                 executed: list[dict[str, Any]], report: Callable[[Progress], None],
                 dilation: float):
        self.tail = tail
        self.stage_reports = list(stage_reports)  # every stage's but the last's
        self.start_step = start_step
        self.executed = executed
        self.report = report
        self.dilation = dilation
        self.steps: list[int] = []  # this attempt's, in order
        self._waiting: list[dict[str, Any]] = []
        self._times: list[list[float]] = [[] for _ in self.stage_reports]

    def __call__(self, final: bool = False) -> None:
        for rec in self.tail.read():
            rec["redo"] = any(e["step"] == rec["step"] for e in self.executed)
            self.executed.append(rec)
            self.steps.append(rec["step"])
            self._waiting.append(rec)
        while self._waiting:
            rec = self._waiting[0]
            i = rec["step"] - self.start_step  # its index in each stage's step_s
            times = [self._step_s(s, i) for s in range(len(self.stage_reports))]
            if None in times and not final:
                return
            self._waiting.pop(0)
            wall_s = max([rec["step_s"], *(t for t in times if t is not None)])
            rec["wall_s"] = wall_s  # the step run's time, as the comparison row counts it
            # a stage killed before it timed the step (the first stage ends a step's backward
            # last): the run's time lacks the slowest stage's, and the row's median leaves it out
            rec["partial"] = None in times
            self.report(StepDone(rec["step"], rec["loss"], wall_s, self.dilation,
                                 redo=rec["redo"]))

    def _step_s(self, s: int, i: int) -> float | None:
        """Stage s's wall seconds for its i-th step of the attempt, once its report has them."""
        if i >= len(self._times[s]):
            try:
                self._times[s] = json.loads(self.stage_reports[s].read_text())["step_s"]
            except (OSError, ValueError, KeyError):
                return None  # not written yet
        return self._times[s][i] if i < len(self._times[s]) else None


def _stop(procs: Sequence[tuple[Any, subprocess.Popen]], net: MininetNetwork) -> None:
    """A baseline's end, however it ends: its processes still running killed, its network
    taken down."""
    for _, proc in procs:
        if proc.poll() is None:
            proc.kill()
    net.stop()


def _slow_stage(control_dir: Path | None, t0: float, dilation: float, use: Sequence[str],
                report: Callable[[Progress], None], action: Any) -> None:
    """A churn ``slow`` during a pipeline run: to the device's control file, with its time (the
    stage there re-times the piece under way; a later placement's stage starts with it)."""
    if control_dir is None:
        return
    factor = float(action.factor or 1.0)
    write_slow(control_dir, action.device, factor, t0 + action.time_s * dilation)
    where = (f"stage {use.index(action.device)} computes x{factor:g} from now"
             if action.device in use else
             f"compute x{factor:g} (no stage there now; a stage placed there starts with it)")
    report(ChurnApplied(action.time_s, action.device, action.event.value, where))


def _supervise(procs: list[tuple[str, subprocess.Popen]], actions: list[Any], t0: float,
               dilation: float, gone: set[str], events: Any, deadline: float,
               poll: Callable[[], None] = lambda: None,
               slow: Callable[[Any], None] = lambda _a: None,
               heard: list[Heard] | None = None,
               partition: Callable[[str, bool], object] = lambda _d, _down: None,
               report: Callable[[Progress], None] = lambda _p: None
               ) -> tuple[Heard, dict[str, float], Any] | None:
    """Wait for the stages while replaying churn, calling ``poll`` meanwhile (the run's
    progress) and ``slow`` with each ``slow`` action as its time comes.

    The trace's actions happen to the devices at their times: ``partition`` / ``heal`` take
    the device's port down / up (``partition``), a ``leave`` or ``crash`` ends its stage's
    process. What the runner, the pipeline's scheduler, hears of them comes from ``heard``
    (:func:`~testbed.baselines.heard.heard_timeline`: at once when the device is reachable,
    at its lease or at a heal when it is cut off), before an action at the same time: a lost
    device is taken out of the next placement (``gone``), and one of this placement's ends
    the stages. ``report`` gets each action applied to a stage's device. Returns what was
    heard, when each stage was killed (``time.monotonic()``) and the trace's departure heard
    (a reachable one's action, else None), or None when every stage ended by itself."""
    stage_of = {d: p for d, p in procs}
    heard = heard if heard is not None else []
    stopped: dict[str, float] = {}

    def due(time_s: float) -> bool:
        return t0 + time_s * dilation <= time.monotonic()

    def kill(d: str, p: subprocess.Popen) -> None:
        if p.poll() is None:
            stopped.setdefault(d, time.monotonic())
            p.kill()
        p.wait()
    while True:
        poll()
        while (heard and due(heard[0].time_s)) or (actions and due(actions[0].time_s)):
            if heard and due(heard[0].time_s) and (not actions
                                                  or heard[0].time_s <= actions[0].time_s):
                h = heard.pop(0)
                if not h.lost:
                    gone.discard(h.device)
                    continue
                gone.add(h.device)
                if h.device in stage_of:  # a stage lost: the others would wait on it
                    # a reachable departure, heard at its own time: the trace's action
                    cause = next((a for a in actions if a.time_s == h.time_s
                                  and a.device == h.device
                                  and a.event in (events.LEAVE, events.CRASH)), None)
                    if cause is not None:
                        actions.remove(cause)
                    for d, q in procs:
                        kill(d, q)
                    return h, stopped, cause
                continue
            a = actions.pop(0)
            where = f"stage {list(stage_of).index(a.device)}" if a.device in stage_of else ""
            if a.event in (events.PARTITION, events.HEAL):
                partition(a.device, a.event is events.PARTITION)
                if where:
                    report(ChurnApplied(a.time_s, a.device, a.event.value, (
                        f"{where}'s link down: lost at its lease unless a heal comes first"
                        if a.event is events.PARTITION else f"{where}'s link up")))
            elif a.event in (events.LEAVE, events.CRASH) and where:
                kill(a.device, stage_of[a.device])  # its process ends, heard or not
                report(ChurnApplied(a.time_s, a.device, a.event.value,
                                    f"{where}'s process ended"))
            elif a.event is events.SLOW:
                slow(a)
        ended = [(d, p) for d, p in procs if p.poll() is not None]
        if len(ended) == len(procs) and not stopped:
            return None
        if any(p.returncode != 0 and d not in stopped for d, p in ended) \
                or time.monotonic() > deadline:
            for _, q in procs:
                if q.poll() is None:
                    q.kill()
                q.wait()
            return None
        time.sleep(0.02)


def emulate_data_parallel(topology_path: str | Path, run_dir: Path, steps: int | None = None,
                          replicas: Sequence[str] | None = None, dilation: float = 1.0,
                          timeout_s: float = 600.0, schedule: Any = None,
                          progress: Callable[[Progress], None] | None = None
                          ) -> dict[str, Any]:
    """Run the topology's job as data parallelism on Mininet: one replica process per replica
    device, the PS process on the PS's node; every step averaged (``local_steps: 1``) or DiLoCo
    rounds (``local_steps: H > 1``).

    With a churn ``schedule`` (trace time 0 = every replica present at the start connected to
    the PS and every standby warm, when the PS starts; times x dilation): a ``partition``
    takes a replica's device's port down and a ``heal`` up again, a ``leave`` or ``crash``
    kills its process; the PS hears of it as a network tells it (:mod:`testbed.baselines.
    heard`: a reachable departure at once, a cut-off replica at its lease, 5 s x D after the
    cut, or at a heal that comes first; the runner writes it to the run's ``lost`` directory)
    and drops it from the step it was gathering and from the rest of its round; a replica
    back (a join, or a heal after its lease ran out) lets its warm standby process connect,
    which the PS
    takes in at the next round's start with the state the others hold (H = 1: parameters and
    AdamW moments; DiLoCo: θ_global, a fresh inner AdamW). A ``slow`` of a replica's device is
    written to its control file with its time (:mod:`testbed.baselines.slow`): the replica
    follows it from that time, mid-piece, and a standby let in later starts with it. The
    replicas are placed once over
    the devices present at the start, their rows fixed (:mod:`testbed.baselines.membership`:
    the rule the engine and the simulator follow); devices that were not replicas stay out.
    ``took_part`` says, per step, which replicas the step averaged over.

    ``progress`` gets, as they happen: the replicas once every one present has connected to
    the PS, each step the PS finishes, and each replica's process killed or standby let in by
    churn."""
    from testbed.baselines.cost import split_rows
    from testbed.baselines.placement import plan_data_parallel
    from testbed.churn.trace import ChurnEvent
    from testbed.emulator.network.mininet import MininetNetwork

    topo = load_topology(topology_path)
    job = topo.job
    H = job.parallelism.local_steps
    if replicas is None:  # placed once, over the devices present at the start (membership.py)
        at_start = set(schedule.initially_present) if schedule is not None else None
        replicas = plan_data_parallel(job, device_infos(topo, at_start)).replicas
    names = list(replicas)
    present0 = set(schedule.initially_present) if schedule is not None else set(names)
    initial = [r for r, d in enumerate(names) if d in present0]
    if not initial:
        raise ValueError("no replica's device is present when the churn trace starts")
    actions = sorted(schedule.actions, key=lambda a: a.time_s) if schedule else []
    net = MininetNetwork(topo, dilation=dilation)
    world = BaselineWorld(topo, noise=False)
    app_delay = not net.caps.netem
    delay_s = [world.path("ps", d)[1] * dilation if app_delay else 0.0 for d in names]
    run_dir.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[str, subprocess.Popen]] = []
    net.start()
    try:
        total_steps = steps or job.steps
        rows = [list(r) for r in split_rows(job.batch_size, len(names))]
        plan_doc = {"topology": str(Path(topology_path).resolve()), "devices": names,
                    "rows": rows,
                    "steps": total_steps, "dilation": dilation, "dtype": job.dtype,
                    "clock_origin": time.monotonic(),  # the devices' clocks (HeldDevice)
                    "ps_ip": net.host_ip(None), "delay_s": delay_s, "local_steps": H,
                    "initial": initial, "keep_state": schedule is not None,
                    "ready": str(run_dir / "ps.ready"), "timeout_s": timeout_s,
                    "start": str(run_dir / "ps.start") if schedule is not None else "",
                    # what the PS hears of a cut-off replica (heard.py): the runner's word
                    "lost_dir": str(run_dir / LOST_DIR) if schedule is not None else "",
                    # churn `slow`: each replica's device's control file (slow.py)
                    "control_dir": str(run_dir / CONTROL_DIR) if schedule is not None else "",
                    "progress": str(run_dir / "progress.jsonl")}
        plan_path = run_dir / "data_parallel_plan.json"
        write_json_atomic(plan_path, plan_doc)  # its replicas, and a watcher, read it whole
        nodes: list[str | None] = [None, *names]
        before = {n: net.interface_counters(n) for n in nodes}
        t0 = time.monotonic()
        base = [sys.executable, "-m", "testbed.baselines.replica_proc", "--plan", str(plan_path)]
        started = {r: 0 for r in range(len(names))}  # processes started per replica
        go_of: dict[int, Path] = {}  # replica -> the file its newest standby waits for
        replica_of: dict[str, int] = {}  # a replica process's tag -> its replica
        stopped_at: dict[int, float] = {}  # id of a process killed by churn -> when
        def start(r: int | None, join: bool = False) -> subprocess.Popen:
            if r is None:
                tag, role = "ps", ["--role", "ps"]
            else:
                tag = f"replica{r}" + (f"-{started[r]}" if started[r] else "")
                role = ["--role", "replica", "--replica", str(r)]
                if join:  # a standby, started at once: it connects when told (the join)
                    go_of[r] = run_dir / f"{tag}.go"
                    role += ["--join", "--go", str(go_of[r])]
                started[r] += 1
                replica_of[tag] = r
            log = (run_dir / f"{tag}.log").open("w")
            proc = net.popen(None if r is None else names[r],
                             [*base, *role, "--out", str(run_dir / f"{tag}.json")],
                             stdout=log, stderr=subprocess.STDOUT)
            procs.append((tag, proc))
            return proc
        report = progress or (lambda _p: None)
        report(Placed("replica", tuple(names), tuple(
            row_span(span) + ("" if r in initial else ", away at the start")
            for r, span in enumerate(rows))))
        launched = time.monotonic()
        ps = start(None)
        alive = {r: start(r) for r in initial}
        # training starts when the PS has every replica present (under churn: and the
        # runner's standbys are warm, when it writes ps.start)
        connected = _ConnectedOnce((run_dir / ("ps.start" if schedule is not None
                                               else "ps.ready")).exists,
                                   "replica", len(initial), launched, 0, report)
        steps_done = functools.partial(_replica_steps, JsonlTail(run_dir / "progress.jsonl"),
                                       names, report, dilation)
        poll = functools.partial(_each, (connected, steps_done))
        if schedule is None:
            failed = _wait_all(procs, timeout_s, lambda tag: run_dir / f"{tag}.log", poll)
        else:
            def history_of(r: int) -> list[str]:  # the ledgers of replica r's processes
                return [str(ledger_path(run_dir / f"{tag}.json"))  # before its standby
                        for tag, q in replica_of.items() if q == r and tag != go_of[r].stem]
            # under churn the row's time is the run's (restarts and waits in it): from
            # training's start to the PS's end, as the pipeline's and the simulator's; from
            # t0 it had the processes' start-up, the standbys' warm-up and the replicas'
            # ends in it (9.6 s against 7.5 s of steps on tests/data/slow.yaml)
            specs = {d.name: d for d in topo.devices}
            churn, failed, trained = _supervise_replicas(
                ps, alive, names, start, go_of, actions, dilation, ChurnEvent, run_dir,
                timeout_s, poll, report, H, stopped_at, history_of,
                heard_timeline(actions, schedule.initially_present),
                lambda d, down: net.set_partitioned(specs[d], down))
        wall_s = time.monotonic() - t0 if schedule is None else trained
        after = {n: net.interface_counters(n) for n in nodes}
        poll()  # the lines written before the PS ended
        if failed:
            raise RuntimeError("; ".join(failed))
        reports = {tag: json.loads((run_dir / f"{tag}.json").read_text()) for tag, _ in procs
                   if (run_dir / f"{tag}.json").exists()}
        reports = {tag: r for tag, r in reports.items()  # standbys never taken in: no work
                   if tag == "ps" or r["first_step"] < plan_doc["steps"]}
        took_part = reports["ps"]["took_part"]
        work = []  # each replica process's work, up to its end or kill (charge.py)
        for tag, proc in procs:
            if tag in replica_of:
                done = charge(read_ledger(ledger_path(run_dir / f"{tag}.json")),
                              stopped_at.get(id(proc)))
                work.append({"device": names[replica_of[tag]], "process": tag,
                             "device_s": done.device_s, "energy_j": done.energy_j})
        out = {"replicas": names, "rows": plan_doc["rows"], "local_steps": H, "wall_s": wall_s,
               "losses": reports["ps"]["losses"], "took_part": took_part,
               "dropped_replica_steps": sum(len(names) - len(t) for t in took_part),
               "churn": churn if schedule is not None else [], "reports": reports,
               "work": work,
               "churn_events": len(schedule.actions) - len(actions) if schedule else 0,
               "network": net.describe(),
               "links": {("ps" if n is None else n): {
                   "tx_bytes": after[n]["tx_bytes"] - before[n]["tx_bytes"],
                   "rx_bytes": after[n]["rx_bytes"] - before[n]["rx_bytes"]} for n in nodes}}
        write_json_atomic(run_dir / "data_parallel_emulated.json", out)
        return out
    finally:
        _stop(procs, net)


def _replica_steps(tail: JsonlTail, names: Sequence[str], report: Callable[[Progress], None],
                   dilation: float) -> None:
    """The PS's new progress lines, each reported (its step time is the comparison row's)."""
    for rec in tail.read():
        out = tuple(d for r, d in enumerate(names) if r not in rec["took_part"])
        report(StepDone(rec["step"], rec["loss"], rec["step_s"], dilation,
                        replicas=len(names), out=out))


def _supervise_replicas(ps: subprocess.Popen, alive: dict[int, subprocess.Popen],
                        names: list[str], start: Any, go: dict[int, Path],
                        actions: list[Any], dilation: float,
                        events: Any, run_dir: Path,
                        timeout_s: float, poll: Callable[[], None] = lambda: None,
                        report: Callable[[Progress], None] = lambda _p: None,
                        local_steps: int = 1, stopped_at: dict[int, float] | None = None,
                        history_of: Callable[[int], list[str]] = lambda _r: [],
                        heard: list[Heard] | None = None,
                        partition: Callable[[str, bool], object] = lambda _d, _down: None
                        ) -> tuple[list[dict[str, Any]], list[str], float]:
    """Replay churn on the replicas until the PS ends.

    The trace's actions happen to the devices at their times: ``partition`` / ``heal`` take
    a replica's device's port down / up (``partition``), a ``leave`` or ``crash`` kills its
    process, a ``slow`` goes to the device's control file (``run_dir/devices``) with its
    time. What the PS hears of them comes from ``heard`` (:func:`~testbed.baselines.heard.
    heard_timeline`, the simulator's rule), before an action at the same time: a replica
    lost (at once when reachable; cut off, at its lease or at a heal that comes first) is
    written to ``run_dir/lost`` (:func:`write_lost`), which the PS reads while it gathers and
    drops the replica as it drops one whose connection broke, and its process, cut off and
    still running, is killed; a replica back lets its standby connect (``--join --go``).
    Each replica the trace brings back has a standby, warm before the PS's first step (and
    a new one after each return the trace repeats), so a return connects at its time, not
    after this host's Python and torch start-up. Calls ``poll`` meanwhile (the run's
    progress) and ``report`` with each churn event applied; notes in ``stopped_at`` when
    each process it kills was killed (by ``id``); tells a standby to go with its replica's
    earlier processes' ledgers (``history_of``: it goes on with their draws and heat).
    Returns the churn applied, the failures and the seconds from training's start (the
    churn clock's 0) to the PS's end."""
    ready = run_dir / "ps.ready"
    deadline = time.monotonic() + timeout_s
    index = {d: r for r, d in enumerate(names)}
    heard = [h for h in (heard or []) if h.device in index]
    # a warm standby for each replica the trace brings back, before the clock starts (a
    # loaded host takes seconds to start Python and torch: started at the crash, it could
    # miss a short run)
    returns = {index[h.device] for h in heard if not h.lost}
    standby: dict[int, subprocess.Popen] = {r: start(r, join=True) for r in sorted(returns)}
    warm = [go[r].with_suffix(".warm") for r in standby]
    while (not ready.exists() or not all(w.exists() for w in warm)) and ps.poll() is None \
            and time.monotonic() < deadline and all(p.poll() is None for p in standby.values()):
        poll()
        time.sleep(0.02)
    (run_dir / "ps.start").write_text("start")  # the PS's first step and the churn clock
    t0 = time.monotonic()
    applied: list[dict[str, Any]] = []
    killed: set[int] = set()
    failed: list[str] = []
    losses: dict[int, int] = {}  # replica -> losses told to the PS
    departed: dict[int, float] = {}  # replica -> the trace time its last process was killed
    next_round = ("its next step's start" if local_steps == 1
                  else f"its next round's start (every {local_steps} steps)")

    def due(time_s: float) -> bool:
        return t0 + time_s * dilation <= time.monotonic()

    def kill(r: int) -> bool:
        proc = alive.pop(r, None)
        if proc is None or proc.poll() is not None:
            return False
        now = time.monotonic()
        if stopped_at is not None:
            stopped_at[id(proc)] = now
        proc.kill()  # its device is gone, or its session over
        proc.wait()
        if isinstance(proc.args, list) and "--out" in proc.args:  # its standby heats to it
            write_stopped(ledger_path(Path(proc.args[proc.args.index("--out") + 1])), now)
        killed.add(id(proc))
        return True

    def note(time_s: float, device: str, event: str, r: int, effect: str) -> None:
        applied.append({"time_s": time.monotonic() - t0, "device": device, "event": event,
                        "replica": r})
        report(ChurnApplied(time_s, device, event, effect))
    while ps.poll() is None and time.monotonic() < deadline:
        poll()
        while (heard and due(heard[0].time_s)) or (actions and due(actions[0].time_s)):
            # an action before what is heard at its time (a departure's kill before the
            # PS is told; a heal's link up before a standby connects)
            if heard and due(heard[0].time_s) and (not actions
                                                  or heard[0].time_s < actions[0].time_s):
                h = heard.pop(0)
                r = index[h.device]
                if h.lost:
                    losses[r] = losses.get(r, 0) + 1
                    write_lost(run_dir / LOST_DIR, r, losses[r])
                    if kill(r) or departed.get(r, h.time_s) < h.time_s:  # heard later
                        note(h.time_s, h.device, h.kind, r,
                             f"replica {r} lost ({h.reason}): the PS goes on without it")
                elif r in standby and r not in alive:
                    # it goes on with the device's draws and heat (HeldDevice.resume)
                    write_json_atomic(go[r], history_of(r))
                    alive[r] = standby.pop(r)
                    if any(not b.lost and b.device == h.device for b in heard):
                        standby[r] = start(r, join=True)  # for its next return
                    note(h.time_s, h.device, h.kind, r,
                         f"replica {r}'s standby connects; the PS takes it in at {next_round}")
                continue
            a = actions.pop(0)
            r2 = index.get(a.device)
            if r2 is None:
                continue  # not a replica: nothing runs there
            if a.event is events.SLOW:
                factor = float(a.factor or 1.0)
                write_slow(run_dir / CONTROL_DIR, a.device, factor, t0 + a.time_s * dilation)
                proc = alive.get(r2)
                applied.append({"time_s": time.monotonic() - t0, "device": a.device,
                                "event": a.event.value, "replica": r2, "factor": factor})
                report(ChurnApplied(a.time_s, a.device, a.event.value,
                                    f"replica {r2} computes x{factor:g} from now"
                                    + ("" if proc is not None and proc.poll() is None else
                                       " (away now: its process starts with it)")))
            elif a.event in (events.PARTITION, events.HEAL):
                partition(a.device, a.event is events.PARTITION)
                report(ChurnApplied(a.time_s, a.device, a.event.value, (
                    f"replica {r2}'s link down: the PS waits for it, and drops it at its "
                    "lease unless a heal comes first" if a.event is events.PARTITION
                    else f"replica {r2}'s link up")))
            elif a.event in (events.LEAVE, events.CRASH) and kill(r2):
                departed[r2] = a.time_s
                note(a.time_s, a.device, a.event.value, r2, f"replica {r2}'s process killed")
        for r, proc in [*alive.items(), *standby.items()]:
            if proc.poll() not in (None, 0) and id(proc) not in killed:
                failed.append(f"replica {r} ({names[r]}) exited {proc.returncode} "
                              f"(see {run_dir}/replica{r}*.log)")
        if failed:
            break
        time.sleep(0.02)
    trained_s = time.monotonic() - t0
    if ps.poll() is None:
        ps.kill()
        ps.wait()
        if not failed:
            failed.append(f"the PS did not finish within {timeout_s:g} s")
    elif ps.returncode != 0:
        failed.append(f"the PS exited {ps.returncode} (see {run_dir / 'ps.log'})")
    for proc in standby.values():  # never told to join: the device did not come back
        proc.kill()
        proc.wait()
    for r, proc in alive.items():  # the replicas present end after the PS's last step
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            if not _taken_in(proc):
                continue  # back after the PS's last step: it never connected, nothing lost
        if proc.returncode != 0 and id(proc) not in killed and not failed:
            failed.append(f"replica {r} ({names[r]}) exited {proc.returncode}")
    return applied, failed, trained_s


LOST_DIR = "lost"  # under the run directory: what the PS hears of cut-off replicas


def write_lost(lost_dir: Path, replica: int, count: int) -> None:
    """Tell the PS that replica ``replica`` is lost for the ``count``-th time (whole file,
    replaced: the PS drops the replica's connection when the count passes the last it read)."""
    lost_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(lost_dir / f"replica{replica}.json", {"lost": count})


def read_lost(lost_dir: Path, replica: int) -> int:
    """How many times the runner has said replica ``replica`` is lost (0: never)."""
    try:
        return int(json.loads((lost_dir / f"replica{replica}.json").read_text())["lost"])
    except (OSError, ValueError, KeyError):
        return 0


def _taken_in(proc: subprocess.Popen) -> bool:
    """Whether a replica process wrote a report (it took part in a step or was turned away)."""
    out = Path(proc.args[proc.args.index("--out") + 1]) if isinstance(proc.args, list) else None
    return out is not None and out.exists()
