"""Import a plain session list: when each device was online, one session per row.

Format (CSV, ``#`` comments and blank lines ignored)::

    device,start_s,end_s
    phones-0,0,120
    phones-0,300,
    phones-1,60,90.5

The header names the time unit of both time columns, the same one: ``start_<u>,end_<u>`` with
``u`` in us, ms, s, min, h. ``end`` may be empty: online until the end of the trace; a written
``end`` is a number like ``start``, at most :data:`~testbed.churn.trace.MAX_TIME_S` (a year) once
in seconds (an ``end`` that overflows is refused, never read as "open"). A session is
[start, end). Both ends are rounded to the millisecond, the precision of a trace row, *before*
anything else; a session that lasts less than that once rounded (``0.0001 .. 0.0004`` s) is
refused with its line, since it would become a join and a leave at the same time. Overlapping or
touching sessions of one device are then merged. Each session start
becomes ``join`` (a device whose first session starts after 0 therefore starts absent, see
:mod:`testbed.churn.trace`), each end ``leave``. A device of the topology that the list does not
mention gets no events: it stays present for the whole run. A list with no session row at all
is refused (the trace it made would be empty, which looks like a run without churn).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Sequence

from testbed import units
from testbed.churn.trace import (
    PRECISION_DIGITS,
    ChurnEvent,
    TraceError,
    TraceEvent,
    data_rows,
    groups_hint,
    merge_sessions,
    read_trace_text,
    rounded_session,
    time_in_range_s,
)

_COLUMN_RE = re.compile(r"^(start|end)_([A-Za-z]+)$")
HEADER = "device,start_s,end_s"


def _header(cells: list[str]) -> tuple[float, str, str | None]:
    names = [c.strip() for c in cells]
    expected = f"expected the header {HEADER!r} (both time columns name the same unit: us, " \
               f"ms, s, min or h)"
    if len(names) != 3 or names[0] != "device":
        return 1.0, "s", f"{expected}, got {','.join(names)!r}"
    found = [_COLUMN_RE.match(n) for n in names[1:]]
    if not all(found) or [m.group(1) for m in found if m] != ["start", "end"]:
        return 1.0, "s", f"{expected}, got {','.join(names)!r}"
    unit_names = {m.group(2) for m in found if m}
    if len(unit_names) != 1:
        return 1.0, "s", f"start and end must use the same unit, got {names[1]!r} and " \
                         f"{names[2]!r}"
    unit = unit_names.pop()
    try:
        return units.parse_duration_s(f"1{unit}"), unit, None
    except units.UnitError:
        return 1.0, "s", f"unknown time unit {unit!r}; expected one of us, ms, s, min, h"


def _time_s(cell: str, what: str, unit_s: float, unit_name: str
            ) -> tuple[float | None, str | None]:
    """The cell in seconds (not yet rounded), or a problem."""
    try:
        value = float(cell)
    except ValueError:
        return None, f"{what} {cell!r} is not a number (the header names the unit)"
    if not math.isfinite(value) or value < 0:
        return None, f"{what} must be a finite number >= 0, got {cell!r}"
    time_s, problem = time_in_range_s(value, unit_s, unit_name, what)
    return (None, problem) if problem else (time_s, None)


def parse_sessions(text: str, devices: Sequence[str],
                   source: str = "<sessions>") -> dict[str, list[tuple[float, float]]]:
    """Parse a session list; return merged [start_s, end_s) sessions per device (inf = open)."""
    known = set(devices)
    stems: dict[str, list[str]] = {}  # a device's name is <group>-<index>
    for device in devices:
        stems.setdefault(device.rpartition("-")[0], []).append(device)
    problems: list[str] = []
    sessions: dict[str, list[tuple[float, float]]] = {}
    unit_s: float | None = None
    unit_name = "s"
    header_line, rows = 0, 0
    for number, split in data_rows(text, problems):
        cells = [c.strip() for c in split]
        if unit_s is None:
            header_line = number
            unit_s, unit_name, problem = _header(cells)
            if problem:
                problems.append(f"line {number}: {problem}")
            continue
        rows += 1
        if len(cells) != 3:
            problems.append(f"line {number}: expected 3 cells ({HEADER}), got {len(cells)}")
            continue
        device, start_cell, end_cell = cells
        row: list[str] = []
        if device not in known:
            row.append(f"unknown device {device!r} (not a device of the topology; "
                       f"{groups_hint(device, stems)})")
        start, p1 = _time_s(start_cell, "start", unit_s, unit_name)
        # only an empty cell means "open": an end that overflowed is a problem of its own
        end, p2 = (math.inf, None) if end_cell == "" else _time_s(end_cell, "end", unit_s,
                                                                   unit_name)
        row.extend(p for p in (p1, p2) if p)
        if start is not None and end is not None:
            if not start < end:
                row.append(f"a session must end after it starts ({start_cell} .. {end_cell})")
            else:
                start, end, short = rounded_session(
                    start, end, f"the session {start_cell} .. {end_cell} {unit_name}",
                    "make it at least 1 ms long")
                row.extend([short] if short else [])
        problems.extend(f"line {number}: {p}" for p in row)
        if not row and start is not None and end is not None:
            sessions.setdefault(device, []).append((start, end))
    if unit_s is None:
        problems.append(f"line 1: the file is empty; expected the header {HEADER!r}")
    elif not rows and not problems:
        # an empty trace looks like a quiet run; a list of no session is a wrong or cut file
        problems.append(f"line {header_line}: no session rows after the header; expected one "
                        f"row per online session ({HEADER})")
    if problems:
        raise TraceError(source, problems)
    return {d: merge_sessions(s) for d, s in sessions.items()}


def session_events(sessions: dict[str, list[tuple[float, float]]],
                   devices: Sequence[str]) -> list[TraceEvent]:
    """Join at each session start (after 0), leave at each finite end; time then device order."""
    rows: list[tuple[float, int, int, TraceEvent]] = []
    for index, device in enumerate(devices):
        events: list[TraceEvent] = []
        for lo, hi in sessions.get(device, []):
            if lo > 0:
                events.append(TraceEvent(round(lo, PRECISION_DIGITS), device, ChurnEvent.JOIN))
            if math.isfinite(hi):
                events.append(TraceEvent(round(hi, PRECISION_DIGITS), device,
                                         ChurnEvent.LEAVE))
        rows.extend((e.time_s, index, order, e) for order, e in enumerate(events))
    rows.sort(key=lambda r: r[:3])
    return [r[3] for r in rows]


def load_sessions(path: str | Path, devices: Sequence[str]) -> list[TraceEvent]:
    """Read a session list file and return its churn events."""
    path = Path(path)
    return session_events(parse_sessions(read_trace_text(path), devices, str(path)), devices)
