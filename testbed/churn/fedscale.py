"""Import FedScale's client availability trace (``client_behave_trace``) as churn events.

The file is a pickle of a dict: client key -> ``{'active': [t...], 'inactive': [t...],
'finish_time': T, 'duration': ..., 'model': ...}`` with times in seconds. FedScale reads client
j's state at time t as: ``u = t mod finish_time``; present when ``active[i] <= u <= inactive[i]``
for some i (the windows repeat with period ``finish_time``). Other keys are ignored.

Mapping onto a run: device i (0-based position in the topology) takes the trace of the key at
position ``i mod n`` of the dict's keys in file order, as FedScale's client manager does with its
client ids. The import covers trace time [start_s, start_s + duration_s) and divides times by
``time_scale`` (so a 24 h trace with ``time_scale=60`` replays in 24 min); a device present at
start_s starts present, each window start is a ``join`` and each window end a ``leave``. The
windows are then handled as a session list's sessions
(:func:`~testbed.churn.trace.rounded_session`): both ends rounded to the millisecond of a trace
row, a window that then lasts nothing refused with its client and ``--time-scale``
(``--time-scale 1e6`` once turned every window into a join and a leave at time 0, exit 0),
windows that touch merged. An instant (``active[i] == inactive[i]``, or a window that ends
exactly at start_s) holds no time and is left out.

Pickles are untrusted input: :class:`RestrictedUnpickler` accepts only plain containers and
numbers (dict, list, tuple, set, frozenset, str, int, float, bool, None; bytes only from
protocol 3 on, where they need no global) and refuses any other global,
so a pickle whose ``__reduce__`` names ``os.system`` (or anything else) is refused before
anything runs. A pickle is also small input that can ask for huge output (an 84-byte file with a
finish time of 1e-300 s has ~1e300 periods in any span): a client's ``finish_time`` must be at
least :data:`MIN_PERIOD_S` (the trace's millisecond resolution), and an import that would write
more than :data:`MAX_EVENTS` events is refused before any is made. A time is a Python int or
float that is a finite number of seconds: an int too large for a float (``10**400``) is refused
with its client and field, as is an import whose span, once divided by ``time_scale``, ends
past :data:`~testbed.churn.trace.MAX_TIME_S` (a year), the latest time a trace may name.
"""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from testbed.churn.trace import (
    MAX_TIME_S,
    ChurnEvent,
    TraceEvent,
    merge_sessions,
    rounded_session,
)

# The only globals a plain-data pickle may need: protocol-2 pickles build sets this way.
_ALLOWED_GLOBALS = {("builtins", "set"), ("builtins", "frozenset"),
                    ("__builtin__", "set"), ("__builtin__", "frozenset")}
MAX_PICKLE_BYTES = 512 * 1024**2
MIN_PERIOD_S = 1e-3  # trace rows have millisecond resolution
MAX_EVENTS = 1_000_000  # ~20 MB of trace; a replay of more is no experiment one run can hold


class FedScaleError(ValueError):
    """A FedScale trace that is refused (unsafe pickle) or not in the expected shape."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds plain containers and numbers only; any global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        """Allow set/frozenset; refuse every other global (functions, classes, modules)."""
        if (module, name) in _ALLOWED_GLOBALS:
            return set if name == "set" else frozenset
        raise FedScaleError(f"refused: the pickle asks for the global {module}.{name}; only "
                            f"plain containers and numbers are accepted (a pickle that carries "
                            f"code is never loaded)")

    def persistent_load(self, pid: Any) -> Any:
        """Refuse persistent ids (they would call back into code)."""
        raise FedScaleError("refused: the pickle uses persistent ids; only plain containers "
                            "and numbers are accepted")


def restricted_loads(data: bytes) -> Any:
    """Unpickle plain data only; raise FedScaleError for anything that would run code."""
    try:
        return RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()
    except FedScaleError:
        raise
    except Exception as exc:  # a corrupt pickle raises many kinds
        raise FedScaleError(f"not a readable pickle: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class ClientWindows:
    """One FedScale client: active windows [active[i], inactive[i]] repeating every period."""

    key: str
    active_s: tuple[float, ...]
    inactive_s: tuple[float, ...]
    finish_time_s: float

    def is_active(self, time_s: float) -> bool:
        """FedScale's rule: present when some window holds ``time_s mod finish_time``."""
        u = time_s % self.finish_time_s
        return any(a <= u <= b for a, b in zip(self.active_s, self.inactive_s))

    def present_intervals(self, start_s: float, end_s: float) -> list[tuple[float, float]]:
        """Merged [begin, end] intervals of presence that overlap [start_s, end_s]."""
        period = self.finish_time_s
        raw: list[tuple[float, float]] = []
        for k in range(math.floor(start_s / period) - 1, math.ceil(end_s / period) + 1):
            for a, b in zip(self.active_s, self.inactive_s):
                # FedScale never looks past finish_time within a period
                lo, hi = max(k * period + a, start_s), min(k * period + min(b, period), end_s)
                if lo <= hi and lo < end_s:  # the span is [start_s, end_s)
                    raw.append((lo, hi))
        raw.sort()
        merged: list[tuple[float, float]] = []
        for lo, hi in raw:
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return merged


def _seconds(value: Any) -> float | None:
    """``value`` as a float when it is an int or float that is finite as a float, else None."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        seconds = float(value)  # an int past ~1.8e308 raises here rather than becoming inf
    except OverflowError:
        return None
    return seconds if math.isfinite(seconds) else None


def _shown(value: Any) -> str:
    """A short repr for a message: a huge int is described, never printed in full."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits (too large for a float)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _client(key: Any, raw: Any) -> tuple[ClientWindows | None, list[str]]:
    where = f"client {key!r}"
    if not isinstance(raw, dict):
        return None, [f"{where}: expected a dict with 'active', 'inactive', 'finish_time', "
                      f"got {type(raw).__name__}"]
    problems = [f"{where}: missing key {k!r}" for k in ("active", "inactive", "finish_time")
                if k not in raw]
    if problems:
        return None, problems
    active, inactive, finish = raw["active"], raw["inactive"], raw["finish_time"]
    for name, seq in (("active", active), ("inactive", inactive)):
        if not isinstance(seq, (list, tuple)):
            problems.append(f"{where}.{name}: expected a list of times in seconds >= 0, got "
                            f"{type(seq).__name__}")
            continue
        bad = next((i for i, v in enumerate(seq)
                    if (t := _seconds(v)) is None or t < 0), None)
        if bad is not None:
            problems.append(f"{where}.{name}: expected a list of times in seconds >= 0; "
                            f"[{bad}] is {_shown(seq[bad])}")
    finish_s = _seconds(finish)
    if finish_s is None or finish_s < MIN_PERIOD_S:
        problems.append(f"{where}.finish_time: expected a number of seconds >= {MIN_PERIOD_S:g}, "
                        f"got {_shown(finish)}")
    if problems:
        return None, problems
    if len(active) != len(inactive) or not active:
        return None, [f"{where}: 'active' and 'inactive' must be non-empty and of equal length "
                      f"(got {len(active)} and {len(inactive)})"]
    for i, (a, b) in enumerate(zip(active, inactive)):
        if a > b:
            problems.append(f"{where}: window {i} ends ({b}) before it starts ({a})")
    if problems:
        return None, problems
    return ClientWindows(str(key), tuple(map(float, active)), tuple(map(float, inactive)),
                         float(finish)), []  # each checked by _seconds: float() cannot overflow


def parse_behave_trace(data: Any, source: str = "<pickle>") -> list[ClientWindows]:
    """Check unpickled data has FedScale's shape; return the clients in key order."""
    if not isinstance(data, dict) or not data:
        raise FedScaleError(f"{source}: expected a non-empty dict of client -> availability, "
                            f"got {type(data).__name__}")
    clients: list[ClientWindows] = []
    problems: list[str] = []
    for key, raw in data.items():
        client, found = _client(key, raw)
        problems.extend(found)
        if client is not None:
            clients.append(client)
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"]
                                 if len(problems) > 20 else [])
        raise FedScaleError(f"{source}: {len(problems)} problem(s):\n" +
                            "\n".join(f"  - {p}" for p in shown))
    return clients


def load_behave_trace(path: str | Path) -> list[ClientWindows]:
    """Load a client_behave_trace pickle safely; return its clients in key order."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_PICKLE_BYTES:
            raise FedScaleError(f"{path}: {size} bytes is more than the {MAX_PICKLE_BYTES} "
                                f"accepted")
        data = path.read_bytes()
    except OSError as exc:
        raise FedScaleError(f"{path}: cannot read the file: {exc.strerror}") from exc
    try:
        loaded = restricted_loads(data)
    except FedScaleError as exc:
        raise FedScaleError(f"{path}: {exc}") from exc
    return parse_behave_trace(loaded, str(path))


def event_bound(client: ClientWindows, start_s: float, end_s: float) -> float:
    """An upper bound of the events one device following ``client`` gets in [start_s, end_s)."""
    periods = (end_s - start_s) / client.finish_time_s + 3  # present_intervals' range, + margin
    return 2.0 * len(client.active_s) * periods + 1


def replay_sessions(client: ClientWindows, start_s: float, end_s: float, time_scale: float
                    ) -> tuple[list[tuple[float, float]], str | None]:
    """The client's presence in [start_s, end_s) as replay-time sessions (inf: still present at
    the end), rounded and merged as a session list's are; or a problem naming the client and
    --time-scale when a window lasts less than a trace row's millisecond once divided."""
    sessions: list[tuple[float, float]] = []
    for lo, hi in client.present_intervals(start_s, end_s):
        if lo == hi:
            continue  # an instant (active == inactive, or a window ending at start_s): no time
        end = math.inf if hi >= end_s else (hi - start_s) / time_scale
        fix = "lower --time-scale so that it lasts at least 1 ms" + (
            ", or move --start" if lo == start_s > 0 else "")  # --start may have cut it short
        begin, end, short = rounded_session(
            (lo - start_s) / time_scale, end,
            f"client {client.key!r}: the window {lo:g} .. {hi:g} s of trace time, divided by "
            f"--time-scale {time_scale:g},", fix)
        if short:
            return [], short
        sessions.append((begin, end))
    return merge_sessions(sessions), None


def import_events(clients: Sequence[ClientWindows], devices: Sequence[str],
                  start_s: float = 0.0, duration_s: float | None = None,
                  time_scale: float = 1.0, source: str = "<pickle>") -> list[TraceEvent]:
    """Churn events for ``devices`` (device i takes client i mod n), time 0 = start_s."""
    if not clients:
        raise FedScaleError("the trace has no clients")
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise FedScaleError(f"--time-scale must be a finite number > 0, got {time_scale:g}")
    if duration_s is None:
        last_s = max(clients[i % len(clients)].finish_time_s for i in range(len(devices)))
        if not start_s < last_s:  # the span "up to the longest finish_time" is empty
            raise FedScaleError(f"--start {start_s:g} s is at or past the end of the trace "
                                f"(the longest finish_time of the clients the devices take: "
                                f"{last_s:g} s); give an earlier --start, or a --duration")
        duration_s = last_s - start_s
    if not (start_s >= 0 and duration_s > 0):
        raise FedScaleError(f"the imported span must be non-empty: start {start_s:g} s, "
                            f"duration {duration_s:g} s")
    end_s = start_s + duration_s
    if not math.isfinite(end_s):
        raise FedScaleError(f"the imported span must be finite: start {start_s:g} s, "
                            f"duration {duration_s:g} s")
    if not duration_s / time_scale <= MAX_TIME_S:
        raise FedScaleError(f"the imported span, {duration_s:g} s of trace time divided by "
                            f"--time-scale {time_scale:g}, would replay over "
                            f"{duration_s / time_scale:g} s, past the latest time a trace may "
                            f"name ({MAX_TIME_S:,.0f} s, a year); import a shorter span with "
                            f"--duration or raise --time-scale")
    expected = sum(event_bound(clients[i % len(clients)], start_s, end_s)
                   for i in range(len(devices)))
    if expected > MAX_EVENTS:
        raise FedScaleError(f"the import would write up to {expected:,.0f} events, more than the "
                            f"{MAX_EVENTS:,} accepted (a short finish_time repeats the windows "
                            f"very often); import a shorter span with --duration")
    per_client: list[list[tuple[float, float]]] = []
    problems: list[str] = []
    for client in clients[:len(devices)]:  # the clients some device takes
        sessions, problem = replay_sessions(client, start_s, end_s, time_scale)
        per_client.append(sessions)
        problems.extend([problem] if problem else [])
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"]
                                 if len(problems) > 20 else [])
        raise FedScaleError(f"{source}: {len(problems)} client(s) with a window that lasts "
                            f"less than a millisecond once divided by --time-scale "
                            f"{time_scale:g}:\n" +
                            "\n".join(f"  - {p}" for p in shown))
    rows: list[tuple[float, int, int, TraceEvent]] = []
    for index, device in enumerate(devices):
        sessions = per_client[index % len(clients)]
        events: list[TraceEvent] = []
        for lo, hi in sessions:
            if lo > 0:
                events.append(TraceEvent(lo, device, ChurnEvent.JOIN))
            if math.isfinite(hi):
                events.append(TraceEvent(hi, device, ChurnEvent.LEAVE))
        if not sessions:
            events.append(TraceEvent(0.0, device, ChurnEvent.LEAVE))  # never present
        rows.extend((e.time_s, index, order, e) for order, e in enumerate(events))
    rows.sort(key=lambda r: r[:3])
    return [r[3] for r in rows]
