"""Import a plain session list: when each device was online, one session per row.

Format (CSV, ``#`` comments and blank lines ignored)::

    device,start_s,end_s
    phones-0,0,120
    phones-0,300,
    phones-1,60,90.5

The header names the time unit of both time columns, the same one: ``start_<u>,end_<u>`` with
``u`` in us, ms, s, min, h. ``end`` may be empty: online until the end of the trace. A session
is [start, end); overlapping or touching sessions of one device are merged. Each session start
becomes ``join`` (a device whose first session starts after 0 therefore starts absent, see
:mod:`testbed.churn.trace`), each end ``leave``. A device of the topology that the list does not
mention gets no events: it stays present for the whole run.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Sequence

from testbed import units
from testbed.churn.trace import ChurnEvent, TraceError, TraceEvent, data_rows, read_trace_text

_COLUMN_RE = re.compile(r"^(start|end)_([A-Za-z]+)$")
HEADER = "device,start_s,end_s"


def _header(cells: list[str]) -> tuple[float, str | None]:
    names = [c.strip() for c in cells]
    expected = f"expected the header {HEADER!r} (both time columns name the same unit: us, " \
               f"ms, s, min or h)"
    if len(names) != 3 or names[0] != "device":
        return 1.0, f"{expected}, got {','.join(names)!r}"
    found = [_COLUMN_RE.match(n) for n in names[1:]]
    if not all(found) or [m.group(1) for m in found if m] != ["start", "end"]:
        return 1.0, f"{expected}, got {','.join(names)!r}"
    unit_names = {m.group(2) for m in found if m}
    if len(unit_names) != 1:
        return 1.0, f"start and end must use the same unit, got {names[1]!r} and {names[2]!r}"
    unit = unit_names.pop()
    try:
        return units.parse_duration_s(f"1{unit}"), None
    except units.UnitError:
        return 1.0, f"unknown time unit {unit!r}; expected one of us, ms, s, min, h"


def _time(cell: str, what: str) -> tuple[float | None, str | None]:
    try:
        value = float(cell)
    except ValueError:
        return None, f"{what} {cell!r} is not a number (the header names the unit)"
    if not math.isfinite(value) or value < 0:
        return None, f"{what} must be a finite number >= 0, got {cell!r}"
    return value, None


def parse_sessions(text: str, devices: Sequence[str],
                   source: str = "<sessions>") -> dict[str, list[tuple[float, float]]]:
    """Parse a session list; return merged [start_s, end_s) sessions per device (inf = open)."""
    known = set(devices)
    problems: list[str] = []
    sessions: dict[str, list[tuple[float, float]]] = {}
    unit_s: float | None = None
    for number, split in data_rows(text, problems):
        cells = [c.strip() for c in split]
        if unit_s is None:
            unit_s, problem = _header(cells)
            if problem:
                problems.append(f"line {number}: {problem}")
            continue
        if len(cells) != 3:
            problems.append(f"line {number}: expected 3 cells ({HEADER}), got {len(cells)}")
            continue
        device, start_cell, end_cell = cells
        row: list[str] = []
        if device not in known:
            row.append(f"unknown device {device!r} (not a device of the topology)")
        start, p1 = _time(start_cell, "start")
        end, p2 = (math.inf, None) if end_cell == "" else _time(end_cell, "end")
        row.extend(p for p in (p1, p2) if p)
        if start is not None and end is not None and not start < end:
            row.append(f"a session must end after it starts ({start_cell} .. {end_cell})")
        problems.extend(f"line {number}: {p}" for p in row)
        if not row and start is not None and end is not None:
            sessions.setdefault(device, []).append((start * unit_s, end * unit_s))
    if unit_s is None:
        problems.append(f"line 1: the file is empty; expected the header {HEADER!r}")
    if problems:
        raise TraceError(source, problems)
    return {d: _merge(s) for d, s in sessions.items()}


def _merge(sessions: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(sessions):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def session_events(sessions: dict[str, list[tuple[float, float]]],
                   devices: Sequence[str]) -> list[TraceEvent]:
    """Join at each session start (after 0), leave at each finite end; time then device order."""
    rows: list[tuple[float, int, int, TraceEvent]] = []
    for index, device in enumerate(devices):
        events: list[TraceEvent] = []
        for lo, hi in sessions.get(device, []):
            if lo > 0:
                events.append(TraceEvent(round(lo, 3), device, ChurnEvent.JOIN))
            if math.isfinite(hi):
                events.append(TraceEvent(round(hi, 3), device, ChurnEvent.LEAVE))
        rows.extend((e.time_s, index, order, e) for order, e in enumerate(events))
    rows.sort(key=lambda r: r[:3])
    return [r[3] for r in rows]


def load_sessions(path: str | Path, devices: Sequence[str]) -> list[TraceEvent]:
    """Read a session list file and return its churn events."""
    path = Path(path)
    return session_events(parse_sessions(read_trace_text(path), devices, str(path)), devices)
