"""Churn traces: the CSV format, its parser and its validation.

A churn trace says, in time order, what happens to which devices while a run trains::

    # flaky phones: comments start with '#', blank lines are ignored
    time_s,device,event,arg
    0,phones-3,leave,
    30,phones-0,crash,
    45.5,phones,slow,2.0
    60,phones-0,join,
    90,laptops-1,partition,
    120,laptops-1,heal,
    150,phones:50%,leave,

Naming and units, written down once:

* **Header.** The first line that is neither blank nor a comment is the header, exactly
  ``time_<unit>,device,event,arg``. The time column names its unit: ``us``, ``ms``, ``s``,
  ``min`` or ``h`` (the duration units of :mod:`testbed.units`). Times in the rows are bare
  numbers in that unit; in code they are always seconds (``time_s``). A trace without a unit in
  the header is refused, as a topology quantity without a unit is.
* **time** is a number >= 0 and never decreases from one row to the next. Rows with equal
  times apply in file order. In seconds it is at most :data:`MAX_TIME_S` (a year): a later time
  is a typo or a unit mistake (``1e308`` under ``time_h`` is infinite once in seconds), and no
  run replays it.
* **device** is one of: a device name (``phones-0``, the ``<group>-<index>`` names of the
  topology), a group name (``phones``: every device of the group), or a sampled selector
  ``<group>:<count>`` / ``<group>:<percent>%`` (``phones:2``, ``phones:50%``): that many
  devices of the group, drawn with the run's seed among the devices the event can apply to (see
  :mod:`testbed.churn.schedule`). Names are checked against a topology when one is given
  ("unknown device").
* **event** is ``join`` (the device's agent starts), ``leave`` (graceful: SIGTERM), ``crash``
  (SIGKILL), ``partition`` (its link goes down or is blackholed), ``heal`` (the link comes back)
  or ``slow``. Only ``slow`` takes an ``arg``: the factor by which the device's compute time is
  multiplied from then on (``2.0`` = twice as slow, ``1.0`` = back to normal), a number from
  :data:`MIN_SLOW_FACTOR` to :data:`MAX_SLOW_FACTOR`, the cap of a topology's
  ``behaviour.straggler.factor`` (a device slowed more is gone, not slow, and a replay of it
  never ends) and its inverse (one sped up more is another device); it is written in
  the ``arg`` column, never as ``slow(2.0)``. The ``arg`` cell may be left out for other events.
* **Who starts offline.** A device whose first event (naming it or its whole group) is ``join``
  starts absent; every other device starts present. A ``join``/``leave``/``crash`` at time 0
  sets the starting state instead of being replayed, so ``0,phones-3,leave`` keeps phones-3
  away from the start.
* **At least one event.** A header with no row after it is refused: a trace without events is
  a run without churn, and replayed as one it looked like a quiet run.

Every problem is reported with its line number, all of them at once (:class:`TraceError`). A
line longer than :data:`MAX_LINE_CHARS` is refused without being split into cells: no row of a
valid trace comes near it, and the csv module refuses cells over 128 KiB with an exception.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

from testbed import units
from testbed.errors import InputError
from testbed.topology import MAX_STRAGGLER_FACTOR
from testbed.user_paths import read_user_text

DEVICE_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
SELECTOR_RE = re.compile(r"^([a-z0-9][a-z0-9-]*):(?:([0-9]+)|([0-9]+(?:\.[0-9]*)?)%)$")
TIME_COLUMN_RE = re.compile(r"^time_([A-Za-z]+)$")
COLUMNS = ("device", "event", "arg")
HEADER = "time_s,device,event,arg"
MAX_LINE_CHARS = 1024
# a trace file's size: ~25 bytes a row, so some ten million events (a FedScale import of 10,000
# devices over days is far less); more is a wrong file, read no further
MAX_TRACE_BYTES = 256 * 1024**2
PRECISION_DIGITS = 3  # a trace row keeps times to the millisecond
MAX_TIME_S = 365 * 86_400.0  # a year: the latest time a trace (or session list) may name
MAX_SLOW_FACTOR = MAX_STRAGGLER_FACTOR  # one cap for 'slow' and a topology's straggler factor
# ... and its inverse the least: a device 1000x faster than its profile is another device (a
# factor of 1e-6 made its tiles' times errors of 5e6, past what a run's records may hold)
MIN_SLOW_FACTOR = 1 / MAX_SLOW_FACTOR
NO_EVENTS = (f"no event rows after the header; expected one row per event ({HEADER}) (a run "
             "without churn needs no trace: leave out --churn, or the topology's churn:)")


class ChurnEvent(str, Enum):
    """What happens to a device at a point of a trace."""

    JOIN = "join"
    LEAVE = "leave"
    CRASH = "crash"
    PARTITION = "partition"
    HEAL = "heal"
    SLOW = "slow"


EVENT_NAMES = tuple(e.value for e in ChurnEvent)


class TraceError(InputError):
    """Every problem found in one trace, each with its line number."""


@dataclass(frozen=True)
class TraceEvent:
    """One row of a trace: at ``time_s``, ``event`` happens to ``target``."""

    time_s: float
    target: str  # a device name, a group name, or a selector such as "phones:2"
    event: ChurnEvent
    factor: float | None = None  # slow only: compute time multiplier
    line: int = 0  # line in the source file, 1-based; 0 when made in code

    @property
    def selector(self) -> tuple[str, int | None, float | None] | None:
        """(group, count, fraction) when the target is a sampled selector, else None."""
        match = SELECTOR_RE.match(self.target)
        if not match:
            return None
        count = int(match.group(2)) if match.group(2) is not None else None
        fraction = float(match.group(3)) / 100.0 if match.group(3) is not None else None
        return match.group(1), count, fraction


@dataclass(frozen=True)
class Trace:
    """A parsed trace: its events in file order (which is time order)."""

    events: tuple[TraceEvent, ...]
    source: str = "<trace>"

    @property
    def duration_s(self) -> float:
        """Time of the last event (0 for an empty trace)."""
        return self.events[-1].time_s if self.events else 0.0

    def targets(self) -> list[str]:
        """Every distinct device, group or selector named, in order of first appearance."""
        return list(dict.fromkeys(e.target for e in self.events))


# ----------------------------------------------------------------------------------------------
# Parsing


def _header_problem(cells: list[str]) -> tuple[float, str | None]:
    """Check the header row; return (seconds per time unit, problem or None)."""
    expected = f"expected the header {HEADER!r} (the time column names its unit: " \
               f"time_us, time_ms, time_s, time_min or time_h)"
    names = [c.strip() for c in cells]
    if len(names) != 4 or tuple(names[1:]) != COLUMNS:
        return 1.0, f"{expected}, got {','.join(names)!r}"
    match = TIME_COLUMN_RE.match(names[0])
    if not match:
        return 1.0, f"the time column {names[0]!r} does not name its unit; {expected}"
    unit = match.group(1)
    try:
        seconds = units.parse_duration_s(f"1{unit}")
    except units.UnitError:
        return 1.0, f"unknown time unit {unit!r} in {names[0]!r}; expected one of us, ms, s, " \
                    f"min, h"
    return seconds, None


def _number(cell: str) -> float:
    """float(cell), but for Python's digit separators: `1_0` read as 10, where `0x10` was
    refused; a trace's numbers are plain decimals."""
    if "_" in cell:
        raise ValueError(cell)
    return float(cell)


def _is_number(cell: str) -> bool:
    try:
        _number(cell)
    except ValueError:
        return False
    return True


def _parse_time(cell: str, unit_s: float, unit_name: str) -> tuple[float, str | None]:
    try:
        value = _number(cell)
    except ValueError:
        return 0.0, f"time {cell!r} is not a number (write a bare number; the header names the " \
                    f"unit, {unit_name})"
    if not math.isfinite(value) or value < 0:
        return 0.0, f"time must be a finite number >= 0, got {cell!r}"
    return time_in_range_s(value, unit_s, unit_name, "time")


def time_in_range_s(value: float, unit_s: float, unit_name: str, what: str
                    ) -> tuple[float, str | None]:
    """``value`` (in the unit ``unit_name``, ``unit_s`` seconds each) in seconds, or a problem
    when that is past :data:`MAX_TIME_S` (or overflows to infinity)."""
    time_s = value * unit_s
    if not time_s <= MAX_TIME_S:  # also inf: 1e308 h is no number of seconds
        return 0.0, f"{what} {value:g} {unit_name} is past the latest time a trace may name, " \
                    f"{MAX_TIME_S:,.0f} s (a year)"
    return time_s, None


def _parse_target(cell: str) -> str | None:
    """Return a problem with the device cell, or None."""
    if not cell:
        return "the device cell is empty; expected a device name, a group or <group>:<count>"
    if DEVICE_RE.match(cell):
        return None
    selector = SELECTOR_RE.match(cell)
    if selector:
        if selector.group(2) is not None and int(selector.group(2)) == 0:
            return f"selector {cell!r} picks no device; the count must be at least 1"
        if selector.group(3) is not None and not 0 < float(selector.group(3)) <= 100:
            return f"selector {cell!r}: the percentage must be in (0, 100]"
        return None
    return f"{cell!r} is not a device name, group name (lower-case letters, digits, '-') or " \
           f"selector such as 'phones:2' or 'phones:50%'"


def _parse_event(cell: str, arg: str) -> tuple[ChurnEvent | None, float | None, str | None]:
    name = cell.strip().lower()
    if name.startswith("slow(") and name.endswith(")"):
        return None, None, f"write the slow factor in the arg column ('slow,{name[5:-1]}'), " \
                           f"not as {cell!r}"
    if name not in EVENT_NAMES:
        return None, None, f"unknown event {cell!r}; expected one of {', '.join(EVENT_NAMES)}"
    event = ChurnEvent(name)
    if event is ChurnEvent.SLOW:
        try:
            factor = _number(arg)
        except ValueError:
            return None, None, f"'slow' needs a factor in the arg column (e.g. 2.0), got {arg!r}"
        if not (MIN_SLOW_FACTOR <= factor <= MAX_SLOW_FACTOR):  # also refuses nan and inf
            return None, None, f"the slow factor must be a finite number from " \
                               f"{MIN_SLOW_FACTOR:g} to {MAX_SLOW_FACTOR:g} (the cap of a " \
                               f"topology's straggler factor, and its inverse), got {arg!r}"
        return event, factor, None
    if arg:
        return None, None, f"{name!r} takes no argument, got {arg!r}"
    return event, None, None


def split_row(line: str, max_chars: int = MAX_LINE_CHARS) -> list[str] | None:
    """The CSV cells of one line; None when the line is longer than ``max_chars``."""
    if len(line) > max_chars:
        return None
    try:
        return next(csv.reader([line]))
    except csv.Error:  # only oversized cells, which the length check already excludes
        return None


def data_rows(text: str, problems: list[str]) -> Iterator[tuple[int, list[str]]]:
    """Each line of a trace or session list that is not blank or a comment: its number and its
    cells. A line too long to split is one more of ``problems`` instead."""
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        cells = split_row(stripped)
        if cells is None:
            problems.append(f"line {number}: {len(stripped):,} characters is longer than the "
                            f"{MAX_LINE_CHARS:,} a row may have")
            continue
        yield number, cells


def parse_trace(text: str, source: str = "<trace>",
                groups: Mapping[str, Sequence[str]] | None = None) -> Trace:
    """Parse trace text (names checked against ``groups`` if given); raise TraceError with
    every problem and its line number."""
    problems: list[str] = []
    events: list[TraceEvent] = []
    unit_s: float | None = None
    unit_name = "s"
    last_time_s, last_line = 0.0, 0
    header_line, rows = 0, 0
    for number, cells in data_rows(text, problems):
        if unit_s is None:
            header_line = number
            unit_s, problem = _header_problem(cells)
            unit_name = cells[0].strip().removeprefix("time_") if not problem else "s"
            if problem:
                problems.append(f"line {number}: {problem}")
                if not _is_number(cells[0]):
                    continue  # a header with bad names: go on and check the rows
                unit_s = 1.0  # no header at all: this is a data row, check it too
            else:
                continue
        rows += 1
        cells = [c.strip() for c in cells]
        if len(cells) == 3:
            cells.append("")
        if len(cells) != 4:
            problems.append(f"line {number}: expected 4 cells ({HEADER}), got {len(cells)}")
            continue
        time_s, time_problem = _parse_time(cells[0], unit_s, unit_name)
        target_problem = _parse_target(cells[1])
        event, factor, event_problem = _parse_event(cells[2], cells[3])
        row_problems = [p for p in (time_problem, target_problem, event_problem) if p]
        if time_problem is None and time_s < last_time_s:
            row_problems.append(f"time goes backwards: {cells[0]} is before the time of line "
                                f"{last_line} ({last_time_s / unit_s:g})")
        problems.extend(f"line {number}: {p}" for p in row_problems)
        if time_problem is None and time_s >= last_time_s:
            last_time_s, last_line = time_s, number
        if not row_problems and event is not None:
            events.append(TraceEvent(time_s, cells[1], event, factor, number))
    if unit_s is None:
        problems.append(f"line 1: the trace is empty; expected the header {HEADER!r}")
    elif not rows and not problems:
        # it ran as no churn at all, without a word: a wrong or cut file, as a session list
        # with no row is (testbed.churn.sessions)
        problems.append(f"line {header_line}: {NO_EVENTS}")
    if groups is not None:
        problems.extend(name_problems(events, groups))
        problems.sort(key=lambda p: int(p.split(":", 1)[0].removeprefix("line ")))
    if problems:
        raise TraceError(source, problems)
    return Trace(tuple(events), source)


def read_trace_text(path: Path) -> str:
    """A churn file's text (a trace or a session list; a byte order mark dropped, as
    :func:`read_user_text` drops it), or a TraceError saying why not."""
    try:
        return read_user_text(path, MAX_TRACE_BYTES)
    except OSError as exc:
        raise TraceError(str(path), [f"cannot read the file: {exc.strerror}"]) from exc
    except UnicodeDecodeError as exc:
        # "not a text file: invalid start byte" for a UTF-16 export, which is text
        raise TraceError(str(path), [f"not UTF-8 text (byte {exc.start}: {exc.reason}); save "
                                     f"it as UTF-8 (a trace and a session list are CSV "
                                     f"text)"]) from exc


def load_trace(path: str | Path, groups: Mapping[str, Sequence[str]] | None = None) -> Trace:
    """Read and parse a trace file; with ``groups`` also check every name against them."""
    path = Path(path)
    return parse_trace(read_trace_text(path), str(path), groups)


def check_names(trace: Trace, groups: Mapping[str, Sequence[str]]) -> None:
    """Raise TraceError for every name that is neither a device nor a group of ``groups``."""
    problems = name_problems(trace.events, groups)
    if problems:
        raise TraceError(trace.source, problems)


def name_problems(events: Iterable[TraceEvent], groups: Mapping[str, Sequence[str]]
                  ) -> list[str]:
    """One problem per event whose device, group or selector is not in ``groups``."""
    devices = {d for members in groups.values() for d in members}
    problems: list[str] = []
    for e in events:
        selector = e.selector
        if selector is not None:
            group = selector[0]
            if group not in groups:
                known = ", ".join(groups) or "none"
                problems.append(f"line {e.line}: unknown group {group!r} in selector "
                                f"{e.target!r} (groups: {known})")
            elif selector[1] is not None and selector[1] > len(groups[group]):
                problems.append(f"line {e.line}: selector {e.target!r} asks for {selector[1]} "
                                f"devices but group {group!r} has {len(groups[group])}")
        elif e.target not in devices and e.target not in groups:
            problems.append(f"line {e.line}: unknown device {e.target!r} (not a device or group "
                            f"of the topology; {groups_hint(e.target, groups)})")
    return problems


def groups_hint(name: str, groups: Mapping[str, Sequence[str]]) -> str:
    """The groups, and for a name of a group's form (``phones-4``) the devices that group has:
    a trace made for a larger topology named phones-4 of three phones with no hint of why."""
    stem = name.rpartition("-")[0]
    members = groups.get(stem) or ()
    if members:
        span = members[0] if len(members) == 1 else f"{members[0]} .. {members[-1]}"
        return f"group {stem!r} has {len(members)}: {span}"
    return f"groups: {', '.join(groups) or 'none'}"


# ----------------------------------------------------------------------------------------------
# Sessions (shared by the importers)


def rounded_session(start_s: float, end_s: float, what: str, fix: str
                    ) -> tuple[float, float, str | None]:
    """A session's ends rounded to the millisecond a trace row keeps, and a problem naming
    ``what`` when it then lasts nothing: its join and leave would fall at the same time, and
    dropping it silently would hide a wrong unit or time scale. ``end_s`` may be inf (open)."""
    start, end = round(start_s, PRECISION_DIGITS), round(end_s, PRECISION_DIGITS)
    if start < end:
        return start, end, None
    return start, end, (f"{what} is shorter than the millisecond a trace row resolves: its join "
                        f"and leave would fall at the same time ({start:g} s); {fix}")


def merge_sessions(sessions: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sessions that overlap or touch (once rounded) as one: never a leave and a join at the
    same time."""
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(sessions):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


# ----------------------------------------------------------------------------------------------
# Writing


def format_event(e: TraceEvent) -> str:
    """One CSV row (time in seconds, at most millisecond precision)."""
    arg = f"{e.factor:g}" if e.factor is not None else ""
    return f"{e.time_s:.3f}".rstrip("0").rstrip(".") + f",{e.target},{e.event.value},{arg}"


def format_trace(events: Iterable[TraceEvent], comments: Sequence[str] = ()) -> str:
    """The text of a trace file: comment lines, the header, one row per event."""
    lines = [f"# {c}" if c else "#" for c in comments]
    lines.append(HEADER)
    lines.extend(format_event(e) for e in events)
    return "\n".join(lines) + "\n"
