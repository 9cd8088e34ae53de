"""The replay plan: a validated trace + the run's devices + a seed -> timed actions per device.

Pure: nothing is started here. ``testbed up`` walks :attr:`ChurnSchedule.actions` in order and
applies each one (join starts an agent, leave sends SIGTERM, crash SIGKILL, partition takes the
link down or blackholes it, heal restores it, slow scales compute by ``factor``).

Rules, written down once:

* **Devices and groups.** ``groups`` maps a group name to its device names in topology order
  (``phones -> [phones-0, ..., phones-5]``). A group event becomes one action per member; a
  selector ``phones:2`` / ``phones:50%`` becomes actions for that many members (a percentage is
  of the group's size, rounded, at least 1) drawn with ``random.Random(seed)`` among the members
  the event can apply to at that moment, in the order the trace lists its selectors. The same
  trace, devices and seed always give the same schedule.
* **Starting state.** A device whose first event by name or by whole group is ``join`` starts
  absent, every other device present (selectors do not count, they depend on the state). Then
  ``join``/``leave``/``crash`` at time 0 are folded into the starting state and not replayed:
  ``initially_present`` is who ``testbed up`` starts. ``partition``/``heal``/``slow`` at time 0
  stay actions at time 0.
* **Consistency.** A join needs an absent device, a leave or crash a present one, a partition an
  unpartitioned one, a heal a partitioned one; ``slow`` always applies. A partition is of the
  link, so it may begin or end while the device is absent. Any violation is an error with the
  line number and the device (strict), so a trace that validates replays exactly as written.
* **Order.** Actions are sorted by (time_s, line in the trace, device position in the
  topology): deterministic and equal to the file's order for equal times.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from testbed.churn.trace import ChurnEvent, Trace, TraceError, TraceEvent, check_names, load_trace

PRESENCE_EVENTS = (ChurnEvent.JOIN, ChurnEvent.LEAVE, ChurnEvent.CRASH)
# The most device actions a trace may expand to, as many as `testbed trace gen` and `trace
# import` may write rows: a row naming a group acts on each of its devices, and 300 such rows
# (8 KB) over a group of 10,000 took 1.8 GB and 25 s before the run, 3,000 rows past 3.6 GB
MAX_ACTIONS = 1_000_000
# why a run refuses a schedule that is not ChurnSchedule.ever_reachable (testbed.up's words)
NEVER_REACHABLE = ("no device is ever present and reachable (each is gone or cut off from time 0 "
                   "on, and none joins or heals), so no step could make progress")


@dataclass(frozen=True)
class ChurnAction:
    """One thing to do to one device at ``time_s`` seconds after training starts."""

    time_s: float
    device: str
    event: ChurnEvent
    factor: float | None = None  # slow only: compute time multiplier
    line: int = 0  # the trace line it came from (for events.jsonl)
    target: str = ""  # the trace's device cell (a device, group or selector)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for events.jsonl."""
        out: dict[str, Any] = {"time_s": self.time_s, "device": self.device,
                               "event": self.event.value, "trace_line": self.line,
                               "trace_target": self.target}
        if self.factor is not None:
            out["factor"] = self.factor
        return out

    def churn_event(self, effect: str) -> dict[str, Any]:
        """The fields of its ``churn`` event in events.jsonl (the replay's and both
        simulators'): :meth:`to_dict` with the action under ``action`` (``event`` names the
        record's kind) and what was done about it."""
        record = self.to_dict()
        return {**{k: v for k, v in record.items() if k != "event"},
                "action": record["event"], "effect": effect}


@dataclass
class _DeviceState:
    present: bool
    partitioned: bool = False
    slow_factor: float = 1.0
    last_line: int = 0  # the line that last changed presence


@dataclass(frozen=True)
class ChurnSchedule:
    """What churn does during a run: who starts, then every action in order."""

    devices: tuple[str, ...]  # all devices of the run, topology order
    initially_present: frozenset[str]
    actions: tuple[ChurnAction, ...]
    seed: int
    source: str = "<trace>"
    groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        """Time of the last action (0 when there is none)."""
        return self.actions[-1].time_s if self.actions else 0.0

    def counts_by_event(self) -> dict[str, int]:
        """Number of device actions per event kind (all kinds, zeros included)."""
        counts = Counter(a.event.value for a in self.actions)
        return {e.value: counts.get(e.value, 0) for e in ChurnEvent}

    def states_at(self, time_s: float) -> dict[str, tuple[bool, bool, float]]:
        """(present, partitioned, slow factor) per device after all actions at <= time_s."""
        replay = _Replay(self)
        replay.until(time_s)
        return {d: (s.present, s.partitioned, s.slow_factor) for d, s in replay.states.items()}

    def intervals(self, end_s: float | None = None) -> dict[str, dict[str, list[tuple[float,
                                                                                       float]]]]:
        """Per device, the [start, end) intervals it is present and partitioned, up to end_s."""
        end = self.duration_s if end_s is None else end_s
        out: dict[str, dict[str, list[tuple[float, float]]]] = {
            d: {"present": [], "partitioned": []} for d in self.devices}
        since: dict[tuple[str, str], float] = {(d, "present"): 0.0
                                               for d in self.initially_present}
        for a in self.actions:
            if a.event is ChurnEvent.SLOW:
                continue
            kind = "present" if a.event in PRESENCE_EVENTS else "partitioned"
            starting = a.event in (ChurnEvent.JOIN, ChurnEvent.PARTITION)
            if starting:
                since[(a.device, kind)] = a.time_s
            else:
                start = since.pop((a.device, kind))
                out[a.device][kind].append((start, min(a.time_s, end)))
        for (device, kind), start in since.items():
            if start < end:
                out[device][kind].append((start, end))
        return out

    def ever_reachable(self) -> bool:
        """Whether at some time, after every action at that time, a device is present and not
        cut off: else no step of a run under this schedule can make progress."""
        replay = _Replay(self)
        replay.until(0.0)
        while not replay.reachable:
            if replay.next_time_s is None:
                return False
            replay.until(replay.next_time_s)
        return True

    def unreachable_for_good_s(self) -> float | None:
        """The time from which no device is present and reachable and none comes back (every
        device gone or cut off after the last action), or None. A run still training then
        cannot finish its step: ``testbed up`` and ``testbed simulate`` fail when the PS's
        progress watchdog fires (``simulate`` with the watchdog off: as stalled)."""
        replay = _Replay(self)
        replay.until(0.0)
        since: float | None = None if replay.reachable else 0.0
        while replay.next_time_s is not None:
            t = replay.next_time_s
            replay.until(t)
            if replay.reachable:
                since = None
            elif since is None:
                since = t
        return since

    def availability(self, times_s: Sequence[float]) -> list[tuple[int, int]]:
        """At each time (ascending), (devices present, devices present and reachable)."""
        replay = _Replay(self)
        out: list[tuple[int, int]] = []
        for t in times_s:
            replay.until(t)
            out.append((replay.present, replay.reachable))
        return out

    def device_states(self, times_s: Sequence[float]) -> list[tuple[tuple[bool, bool], ...]]:
        """At each time (ascending), every device's (present, partitioned), in topology order
        (:attr:`devices`)."""
        replay = _Replay(self)
        out: list[tuple[tuple[bool, bool], ...]] = []
        for t in times_s:
            replay.until(t)
            out.append(tuple((replay.states[d].present, replay.states[d].partitioned)
                             for d in self.devices))
        return out


class _Replay:
    """A schedule's devices as its actions apply in order, with how many are present and how
    many present and reachable: the one walk behind every question asked of the timeline."""

    def __init__(self, schedule: ChurnSchedule) -> None:
        self.states = {d: _DeviceState(d in schedule.initially_present)
                       for d in schedule.devices}
        self.present = self.reachable = len(schedule.initially_present)  # none starts cut off
        self._actions = schedule.actions
        self._next = 0  # the first action not applied yet

    @property
    def next_time_s(self) -> float | None:
        """When the next action not applied yet happens (None: every one has)."""
        return self._actions[self._next].time_s if self._next < len(self._actions) else None

    def until(self, time_s: float) -> None:
        """Apply every action at or before ``time_s`` not applied yet."""
        actions = self._actions
        while self._next < len(actions) and actions[self._next].time_s <= time_s:
            a = actions[self._next]
            state = self.states[a.device]
            was_present, was_reachable = state.present, state.present and not state.partitioned
            _apply(state, a.event, a.factor)
            self.present += state.present - was_present
            self.reachable += (state.present and not state.partitioned) - was_reachable
            self._next += 1


def _apply(state: _DeviceState, event: ChurnEvent, factor: float | None) -> None:
    if event is ChurnEvent.JOIN:
        state.present = True
    elif event in (ChurnEvent.LEAVE, ChurnEvent.CRASH):
        state.present = False
    elif event is ChurnEvent.PARTITION:
        state.partitioned = True
    elif event is ChurnEvent.HEAL:
        state.partitioned = False
    elif factor is not None:
        state.slow_factor = factor


def _applies(state: _DeviceState, event: ChurnEvent) -> str | None:
    """Why ``event`` cannot happen to a device in ``state``, or None when it can."""
    if event is ChurnEvent.JOIN and state.present:
        return "is already present"
    if event in (ChurnEvent.LEAVE, ChurnEvent.CRASH) and not state.present:
        return "is already absent"
    if event is ChurnEvent.PARTITION and state.partitioned:
        return "is already partitioned"
    if event is ChurnEvent.HEAL and not state.partitioned:
        return "is not partitioned"
    return None


def _members(e: TraceEvent, groups: Mapping[str, Sequence[str]]) -> list[str] | None:
    """The devices an event names deterministically (None for a selector)."""
    if e.selector is not None:
        return None
    return list(groups[e.target]) if e.target in groups else [e.target]


def _initially_present(trace: Trace, devices: Sequence[str],
                       groups: Mapping[str, Sequence[str]]) -> set[str]:
    first: dict[str, ChurnEvent] = {}
    for e in trace.events:
        for d in _members(e, groups) or []:
            first.setdefault(d, e.event)
    return {d for d in devices if first.get(d) is not ChurnEvent.JOIN}


def _wanted(selector: tuple[str, int | None, float | None], members: int) -> int:
    """How many devices a selector picks from a group of ``members``: a share of it rounded
    half up (``phones:50%`` of 5 takes 3; Python's round() took 2, half to even), at least one."""
    _, count, fraction = selector
    return count if count is not None else max(1, math.floor((fraction or 0.0) * members + 0.5))


def _pick(e: TraceEvent, groups: Mapping[str, Sequence[str]],
          states: Mapping[str, _DeviceState], rng: random.Random) -> tuple[list[str], str | None]:
    """Draw the devices of a selector among the group members the event applies to."""
    assert e.selector is not None
    group, count, fraction = e.selector
    members = list(groups[group])
    wanted = _wanted(e.selector, len(members))
    eligible = [d for d in members if _applies(states[d], e.event) is None]
    if wanted > len(eligible):
        return [], (f"selector {e.target!r} needs {wanted} device(s) of {group!r} that can "
                    f"{e.event.value}, only {len(eligible)} can "
                    f"({', '.join(eligible) or 'none'})")
    chosen = set(rng.sample(eligible, wanted))
    return [d for d in members if d in chosen], None


def _check_expansion(trace: Trace, groups: Mapping[str, Sequence[str]]) -> None:
    """TraceError when the trace's rows act on more than :data:`MAX_ACTIONS` devices in all,
    before any is expanded (a selector on as many as it picks, :func:`_wanted`)."""
    total = 0
    for e in trace.events:
        if e.selector is not None:
            total += min(_wanted(e.selector, len(groups[e.selector[0]])),
                         len(groups[e.selector[0]]))
        else:
            total += len(groups[e.target]) if e.target in groups else 1
        if total > MAX_ACTIONS:
            raise TraceError(trace.source, [
                f"line {e.line}: the rows up to here act on more than {MAX_ACTIONS:,} devices "
                f"in all (a row naming a group acts on each of its devices); at most "
                f"{MAX_ACTIONS:,} device actions are accepted"])


def build_schedule(trace: Trace, groups: Mapping[str, Sequence[str]],
                   seed: int = 0) -> ChurnSchedule:
    """Expand a trace over the run's devices; raise TraceError on any inconsistency."""
    check_names(trace, groups)
    _check_expansion(trace, groups)
    devices = [d for members in groups.values() for d in members]
    position = {d: i for i, d in enumerate(devices)}
    present = _initially_present(trace, devices, groups)
    states = {d: _DeviceState(d in present) for d in devices}
    rng = random.Random(seed)
    problems: list[str] = []
    actions: list[ChurnAction] = []
    for e in trace.events:
        targets = _members(e, groups)
        if targets is None:
            targets, problem = _pick(e, groups, states, rng)
            if problem:
                problems.append(f"line {e.line}: {problem}")
        for d in targets:
            state = states[d]
            why = _applies(state, e.event)
            if why:
                since = f" (since line {state.last_line})" if state.last_line else \
                    " (at the start)"
                problems.append(f"line {e.line}: {e.event.value} {e.target}: {d} {why}"
                                f"{since if e.event in PRESENCE_EVENTS else ''}")
                continue
            _apply(state, e.event, e.factor)
            if e.event in PRESENCE_EVENTS:
                state.last_line = e.line
                if e.time_s == 0:  # folded into the starting state
                    (present.add if e.event is ChurnEvent.JOIN else present.discard)(d)
                    continue
            actions.append(ChurnAction(e.time_s, d, e.event, e.factor, e.line, e.target))
    if problems:
        raise TraceError(trace.source, problems)
    actions.sort(key=lambda a: (a.time_s, a.line, position[a.device]))
    return ChurnSchedule(tuple(devices), frozenset(present), tuple(actions), seed, trace.source,
                         {g: tuple(m) for g, m in groups.items()})


def groups_of(topology: Any) -> dict[str, list[str]]:
    """Group name -> device names in topology order, from a :class:`testbed.topology.Topology`."""
    out: dict[str, list[str]] = {g.group: [] for g in topology.groups}
    for device in topology.devices:
        out[device.group.group].append(device.name)
    return out


def load_schedule(path: str | Path, topology: Any, seed: int | None = None) -> ChurnSchedule:
    """Read a trace file and expand it over a topology's devices (seed: the topology's)."""
    groups = groups_of(topology)
    trace = load_trace(path, groups)
    return build_schedule(trace, groups, topology.seed if seed is None else seed)
