"""Replaying a :class:`~testbed.churn.schedule.ChurnSchedule` against a running ``testbed up``.

What each action does to the run (the run supplies the means through :class:`RunControl`):

=========  ==================================================================================
join       start the device's agent
leave      SIGTERM to the agent (it says Leave, then exits)
crash      SIGKILL to the agent; SIGQUIT to one that blackholes itself (loopback, cut off),
           whose SIGKILL its blackhole could not hold: it dies once healed or once the PS
           ends its session (a join before either kills it first)
partition  take the device's link down (Mininet) or blackhole the agent (SIGUSR1, loopback)
heal       bring the link back up (Mininet) or un-blackhole the agent (SIGUSR2)
slow       write ``agents/<device>.slow`` (``{"slow": factor}``), which the agent polls
=========  ==================================================================================

**Clock.** Trace time 0 is the moment training starts (``status.json`` leaves ``starting`` and
``waiting for devices``), so a trace means the same thing however long the devices take to join;
an action at trace time ``t`` is applied ``t x D`` wall seconds later (D: time dilation; when an
adaptive D changes, :meth:`Replay.set_dilation`, trace time runs on at the new rate from that
moment, as the devices' clocks do). Each applied action is one ``churn`` event in
``events.jsonl`` with its effect.

**Resume.** ``testbed up --resume`` goes on from where the run was (:func:`resume_point`): the
actions already recorded as ``churn`` events are not applied again, the devices present after them
are the ones started, partitions in force are applied again at once (the network was rebuilt), and
the rest of the trace is replayed from the trace time the run had reached when it stopped (time
while the PS was down does not count: trace time runs while training runs).

**Threads.** The replay runs on its own thread, but never forks on it: the run starts every agent
from one long-lived thread (``testbed.up.Spawner``). ``PR_SET_PDEATHSIG`` fires when the *thread*
that forked a child exits (prctl(2)), so agents forked here died the moment the replay ended.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from testbed.churn.schedule import ChurnAction, ChurnSchedule
from testbed.churn.trace import ChurnEvent
from testbed.emulator.agent_forkserver import ForkServerGone
from testbed.emulator.dilation import DeviceClock
from testbed.errors import out_of_room

log = logging.getLogger(__name__)

# the PS's states before its training starts: trace time 0 is training's start, as testbed
# simulate counts it (its probe of D and its planning, seconds to minutes, come before; an
# action of the trace's first second landed in them, on no tile)
WAITING_STATES = (None, "starting", "waiting for devices", "probing time dilation", "planning")
# the PS's states once its training is over: an action due then meets no run (its agents were
# told to stop; a crash after the last step was applied to them as "absent" and counted)
ENDED_STATES = ("done", "failed", "interrupted")
STATUS_EVERY_S = 0.25  # how often the replay reads status.json before an action is applied


class RunControl(Protocol):
    """What the replay needs from a run."""

    def start_agent(self, name: str, cut_off: bool = False) -> None:
        """Start (or restart) the device's agent; ``cut_off``: blackholed from its start, as
        after SIGUSR1 (its link is down where the network cannot take it down).
        :class:`~testbed.emulator.agent_forkserver.ForkServerGone` when the process agents are
        forked from has ended: no agent can start any more."""

    def signal_agent(self, name: str, sig: int) -> bool:
        """Signal the device's agent; False when it is not running."""

    def set_partitioned(self, name: str, partitioned: bool) -> bool:
        """Take the device's link down or up in the network; False when the network cannot."""

    def ps_alive(self) -> bool:
        """Whether the PS is still running."""


@dataclass
class ReplayState:
    """Where a replay stands: actions applied, and the device states they left."""

    applied: int = 0  # actions of the schedule already applied
    trace_s: float = 0.0  # trace time reached
    present: set[str] = field(default_factory=set)
    partitioned: set[str] = field(default_factory=set)


def state_after(schedule: ChurnSchedule, applied: int, trace_s: float = 0.0) -> ReplayState:
    """Device states after the schedule's first ``applied`` actions."""
    present = set(schedule.initially_present)
    partitioned: set[str] = set()
    for a in schedule.actions[:applied]:
        if a.event is ChurnEvent.JOIN:
            present.add(a.device)
        elif a.event in (ChurnEvent.LEAVE, ChurnEvent.CRASH):
            present.discard(a.device)
        elif a.event is ChurnEvent.PARTITION:
            partitioned.add(a.device)
        elif a.event is ChurnEvent.HEAL:
            partitioned.discard(a.device)
    last = schedule.actions[applied - 1].time_s if applied else 0.0
    return ReplayState(applied, max(trace_s, last), present, partitioned)


def resume_record_problem(record: dict[str, Any]) -> str | None:
    """What is wrong with one ``events.jsonl`` record for :func:`resume_point` (None: nothing):
    ``t`` a finite Unix time, and what the kinds it reads carry (``churn_clock_start``'s
    ``offset_s``, ``links_dilation``'s ``new``). ``testbed up --resume`` asks this of every
    record before it starts anything."""
    def number(key: str, low: float, required: bool) -> str | None:
        value = record.get(key)
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < low:
            return f"{key}: expected a finite number >= {low:g}, found {value!r}"
        return None
    kind = record.get("event")
    if kind is not None and not isinstance(kind, str):
        return f"event: expected a string, found {kind!r}"
    return number("t", 0, required=False) or (
        number("offset_s", 0, required=False) if kind == "churn_clock_start" else
        number("new", 1, required=True) if kind == "links_dilation" else None)


TAIL_BYTES = 1 << 16  # what last_record_t reads of a run file's end


def last_record_t(path: Path) -> float:
    """The latest ``t`` among the last whole records of a JSON-lines run file (0.0 when it has
    none, or cannot be read): read from its end, as a 10,000-device run's devices.jsonl is GBs."""
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - TAIL_BYTES))
            lines = fh.read().splitlines()
    except OSError:
        return 0.0
    latest = 0.0
    for line in lines[1:] if size > TAIL_BYTES else lines:  # the first may be cut
        try:
            t = json.loads(line).get("t")
        except (ValueError, AttributeError):
            continue  # a torn last line, or no object
        if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t):
            latest = max(latest, float(t))
    return latest


def resume_point(schedule: ChurnSchedule, events: Sequence[dict[str, Any]],
                 dilation: float, later_t: float = 0.0) -> ReplayState:
    """Where a stopped run's replay stood, from its ``events.jsonl`` records.

    Applied = the number of ``churn`` events (each action is recorded once, whichever session
    applied it). Trace time reached = the last ``churn_clock_start``'s offset plus the device
    time from it to the last record of that session (or ``later_t``, the time of the run's last
    record of another file, steps.jsonl's or devices.jsonl's, when later: a stretch with no
    event, the devices' samples go on): wall time over ``dilation``, the D the run started
    with, or over the D of the last ``links_dilation`` record before it (an adaptive run's).
    ValueError for a record :func:`resume_record_problem` refuses.
    """
    for e in events:
        problem = resume_record_problem(e)
        if problem is not None:
            raise ValueError(f"events.jsonl record {e!r:.200}: {problem}")
    applied = min(sum(e.get("event") == "churn" for e in events), len(schedule.actions))
    clock: DeviceClock | None = None  # the last session's trace clock, from its start
    offset_s = last_t = 0.0
    for e in events:
        t = float(e.get("t", 0.0) or 0.0)
        kind = e.get("event")
        if kind == "churn_clock_start":
            clock, offset_s = DeviceClock(t, dilation), float(e.get("offset_s", 0.0) or 0.0)
        elif kind == "links_dilation":
            dilation = float(e["new"])
            if clock is not None:
                clock.set_dilation(dilation, t)
        last_t = max(last_t, t)
    last_t = max(last_t, later_t)
    trace_s = offset_s + clock.device_s(last_t) if clock is not None else 0.0
    return state_after(schedule, applied, trace_s)


def apply_action(action: ChurnAction, run: RunControl, agents_dir: Path,
                 cut_off: bool = False) -> str:
    """Do one action to the run; return its effect as recorded in events.jsonl. ``cut_off``:
    the device's agent blackholes its own traffic (loopback) and its link is down now."""
    name, event = action.device, action.event
    if event is ChurnEvent.JOIN:
        run.start_agent(name, cut_off)
        return "applied"
    if event is ChurnEvent.LEAVE:
        return "SIGTERM" if run.signal_agent(name, signal.SIGTERM) else "absent"
    if event is ChurnEvent.CRASH:
        # cut off by its own blackhole, a killed agent's socket would close past the cut: the
        # agent kills itself once healed (or once the PS gives up on it) instead
        sig = signal.SIGQUIT if cut_off else signal.SIGKILL
        return sig.name if run.signal_agent(name, sig) else "absent"
    if event in (ChurnEvent.PARTITION, ChurnEvent.HEAL):
        down = event is ChurnEvent.PARTITION
        if run.set_partitioned(name, down):
            return "link " + ("down" if down else "up")
        sig = signal.SIGUSR1 if down else signal.SIGUSR2
        if run.signal_agent(name, sig):
            return "agent blackholed" if down else "agent healed"
        return "absent"
    # slow: the agent polls this file (--control-file)
    from testbed.runlog import write_json_atomic

    write_json_atomic(agents_dir / f"{name}.slow", {"slow": action.factor})
    return f"compute x{action.factor}"


class Replay:
    """Applies a schedule's remaining actions at their times, on a thread of its own."""

    def __init__(self, schedule: ChurnSchedule, run: RunControl, run_dir: Path, dilation: float,
                 event: Callable[..., None], note: Callable[[str], None] = lambda s: None,
                 start: ReplayState | None = None):
        self.schedule = schedule
        self.run = run
        self.run_dir = run_dir
        self.dilation = dilation
        self.event = event  # RunLog.event
        self.note = note
        self.start_state = start or ReplayState(present=set(schedule.initially_present))
        self.stopping = threading.Event()
        self.applied = self.start_state.applied
        self.failure: str | None = None  # why the replay stopped before the trace's end
        self._clock: DeviceClock | None = None  # trace time since begin, once training runs
        self._clock_lock = threading.Lock()
        self._changed = threading.Event()  # D changed: a wait for the next action starts over
        self._thread: threading.Thread | None = None
        self._status_read_s = -math.inf  # when _training_over last read status.json
        self._over = False  # what it read: the PS's training is over
        # devices cut off by their agent, not the network (loopback): one that joins, or joins
        # again after a crash, while its link is down starts cut off; Mininet keeps its port
        # down across its agent's restarts
        self._cut_by_agent: set[str] = set()
        # of those, devices whose agent crashed (SIGQUIT) and may not be dead yet
        self._crashed_cut_off: set[str] = set()

    def start(self) -> None:
        """Start the replay thread (nothing to do when every action was applied already)."""
        if self.applied >= len(self.schedule.actions) and not self.start_state.partitioned:
            return
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        """Whether actions are still to come (a device may still join)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop applying actions; wait for the thread."""
        self.stopping.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def set_dilation(self, dilation: float) -> None:
        """From now on trace time runs at 1 / dilation of wall time."""
        with self._clock_lock:
            self.dilation = dilation
            if self._clock is not None:
                self._clock.set_dilation(dilation, time.monotonic())
        self._changed.set()

    def _wall_until(self, trace_s: float) -> float:
        """Wall seconds from now until trace time trace_s (since begin), at the current D."""
        with self._clock_lock:
            assert self._clock is not None
            return (trace_s - self._clock.device_s(time.monotonic())) * self._clock.dilation

    def _run(self) -> None:
        try:
            self._replay()
        except Exception as exc:  # a bug here must not take the run down silently
            error = str(exc)
            actions = self.schedule.actions
            if isinstance(exc, ForkServerGone) and self.applied < len(actions):
                action = actions[self.applied]  # a join: the one action that starts an agent
                error = (f"{action.device}'s {action.event.value} at t={action.time_s:g} s "
                         f"cannot start its agent: {exc}; no agent can start any more")
            self.failure = (f"the churn trace stopped replaying after {self.applied} of its "
                            f"{len(actions)} actions: {error}")
            # not bugs, said in one line: the fork server killed from outside, a full disk
            if isinstance(exc, ForkServerGone) or out_of_room(exc):
                log.error("%s; the run fails", self.failure)
            else:
                log.exception("churn replay failed")
            try:
                self.event("churn_failed", applied=self.applied, error=str(exc))
            except OSError:
                pass  # the same full disk: the failure is kept above

    def _replay(self) -> None:
        if not self._wait_for_training():
            return
        with self._clock_lock:
            self._clock = DeviceClock(time.monotonic(), self.dilation)
        offset = self.start_state.trace_s
        self.event("churn_clock_start", actions=len(self.schedule.actions),
                   already_applied=self.applied, offset_s=round(offset, 6))
        agents_dir = self.run_dir / "agents"
        for name in sorted(self.start_state.partitioned):  # after --resume: still cut off
            action = ChurnAction(offset, name, ChurnEvent.PARTITION)
            self.event("churn_restore", device=name, action="partition",
                       effect=self._apply(action, agents_dir))
        for action in self.schedule.actions[self.applied:]:
            while not self.stopping.is_set():
                self._changed.clear()  # before reading the clock: a change after it wakes us
                wait_s = self._wall_until(action.time_s - offset)
                if wait_s <= 0:
                    break
                self._changed.wait(wait_s)  # wakes early for a new D or a stop
            if self.stopping.is_set() or self._training_over():
                return
            began_t = time.time()  # the PS may log what the action causes before it returns
            effect = self._apply(action, agents_dir)
            self.applied += 1
            self.event("churn", **action.churn_event(effect), at_t=began_t)
            self.note(f"churn t={action.time_s:g}s {action.event.value} {action.device}: "
                      f"{effect}")

    def _apply(self, action: ChurnAction, agents_dir: Path) -> str:
        name = action.device
        if action.event is ChurnEvent.JOIN and name in self._crashed_cut_off:
            # crashed while cut off, its agent waits for the heal to die: a crashed device
            # has nothing to finish, so it dies now (the PS sees its connection end; a real
            # device's end would wait for the heal or the lease), not after a leave's grace
            self.run.signal_agent(name, signal.SIGKILL)
        effect = apply_action(action, self.run, agents_dir, name in self._cut_by_agent)
        if action.event is ChurnEvent.PARTITION and effect != "link down":
            self._cut_by_agent.add(name)
        elif action.event is ChurnEvent.HEAL:
            self._cut_by_agent.discard(name)
            self._crashed_cut_off.discard(name)  # the agent dies of the heal itself
        elif action.event is ChurnEvent.CRASH and effect == signal.SIGQUIT.name:
            self._crashed_cut_off.add(name)
        elif action.event is ChurnEvent.JOIN:
            self._crashed_cut_off.discard(name)
        return effect

    def _training_over(self) -> bool:
        """Whether the PS has ended its training (or is gone): an action due then is not
        applied, as no run is there to meet it. status.json is read at most every
        :data:`STATUS_EVERY_S` (a generated trace has a hundred thousand actions)."""
        if not self.run.ps_alive():
            return True
        now = time.monotonic()
        if now - self._status_read_s >= STATUS_EVERY_S:
            self._status_read_s = now
            try:
                state = json.loads((self.run_dir / "status.json").read_text()).get("state")
                self._over = state in ENDED_STATES
            except (OSError, json.JSONDecodeError, AttributeError):
                pass  # being rewritten: as it was
        return self._over

    def _wait_for_training(self) -> bool:
        """Block until the PS reports training (True), or the run ends first (False)."""
        status = self.run_dir / "status.json"
        while not self.stopping.wait(0.05):
            if not self.run.ps_alive():
                return False
            try:
                if json.loads(status.read_text()).get("state") not in WAITING_STATES:
                    return True
            except (OSError, json.JSONDecodeError):
                continue
        return False
