"""The run directory: what a run leaves behind (DESIGN.md §9).

``runs/<YYYYmmdd-HHMMSS>-<name>/``::

    topology.yaml    the resolved topology (defaults filled in, paths absolute)
    events.jsonl     one JSON object per line: every join, leave, crash, partition, requeue...
    steps.jsonl      one line per training step: loss, wall and device time, tiles, bytes
    stages.jsonl     one line per stage of each step's GEMM chain (forward layer by layer, the
                     backward pairs): device seconds some GEMM of it was out, and its bound
    devices.jsonl    per-device samples: tiles done, bytes, telemetry (one line per device per
                     sample period, a session's final one as it ends, state left or
                     quarantined, and one per device still attached at the end)
    status.json      the latest snapshot for the live view (replaced atomically)
    summary.json     written at the end: totals, network mechanism, dilation, energy
    ps.json          the PS's address and pid, written once it listens
    ps.log           the PS process's log; agents/<device>.log for each agent

    clock.json       the run's time origin, written once by whichever writer comes first

Every JSON line has ``t`` (Unix time, s) and ``elapsed_s``: seconds since the run's origin in
``clock.json``. ``testbed up`` and the PS are two processes that both append to
``events.jsonl``; reading the origin from one file puts both on one clock, across ``--resume``
too (a resumed run keeps counting from the first start).

Reading JSON lines back (:func:`read_jsonl`, :func:`read_jsonl_checked`): every writer appends
whole lines of ASCII JSON objects. A *torn* line is the start of a record cut off (a process
killed while writing; a later ``--resume`` appends after it): the decoder reads into it before it
fails, and it is skipped. A line the decoder refuses at once (nesting too deep, an integer of too
many digits, not JSON at all), a JSON value that is not an object, and a line that is not UTF-8
(no writer of ours writes a byte above 0x7f) were never records of ours: damage.
:func:`read_jsonl` skips them too (reports and summaries show what can be read);
:func:`read_jsonl_checked`, which ``testbed up --resume`` reads with before it starts anything,
refuses them with the line's number (:class:`RunFileError`).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable

from testbed.user_paths import load_user_json, read_user_text, written_whole

# the most a run record testbed up writes (up.json, pids.json, network.json) is read as: a few
# hundred bytes, and pids.json of 10,000 agents 319 KB (json.dumps of such a record)
RUN_JSON_MAX_BYTES = 1 << 20


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON so that a reader never sees a half-written file, and a write that fails (a
    full disk) leaves the old file as it was and no temporary file beside it."""
    with written_whole(path) as handle:
        handle.write(json.dumps(obj, indent=2, default=str) + "\n")


class RunFileError(ValueError):
    """A run file that is not as the run wrote it: ``str()`` names the file and the line."""


def _jsonl_lines(path: Path) -> list[tuple[int, dict[str, Any] | None, str | None]]:
    """(line number, record or None, why the line is damage or None) for each non-empty line;
    a torn line has neither record nor reason. [] when the file does not exist."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    out: list[tuple[int, dict[str, Any] | None, str | None]] = []
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            out.append((number, None, f"byte {exc.start + 1} is not UTF-8 (not a record of "
                                      "ours)"))
            continue
        try:
            record = load_user_json(line)
        except json.JSONDecodeError as exc:
            # pos > 0: the decoder read into a record cut off (torn); pos 0: never a record
            out.append((number, None, None if exc.pos else f"not valid JSON: {exc.msg}"))
            continue
        if not isinstance(record, dict):
            out.append((number, None, f"expected a JSON object, found {type(record).__name__}"))
            continue
        out.append((number, record, None))
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record (JSON object) of a JSON-lines file; torn and damaged lines are skipped
    (the module docstring says which is which). OSError when the path cannot be read (a
    directory in its place)."""
    return [record for _, record, _ in _jsonl_lines(path) if record is not None]


def read_jsonl_checked(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) of every record of a JSON-lines file, torn lines skipped;
    RunFileError naming the file and line for a damaged line, and when the path is not a regular
    file (absent is fine: no records)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise RunFileError(f"{path}: cannot be read ({exc.strerror})") from exc
    if not stat.S_ISREG(mode):
        raise RunFileError(f"{path}: expected a file of JSON lines, found "
                           f"{'a directory' if stat.S_ISDIR(mode) else 'no regular file'}")
    try:
        lines = _jsonl_lines(path)
    except OSError as exc:
        raise RunFileError(f"{path}: cannot be read ({exc.strerror})") from exc
    for number, _, problem in lines:
        if problem is not None:
            raise RunFileError(f"{path}: line {number}: {problem}")
    return [(number, record) for number, record, _ in lines if record is not None]


CLOCK_FILE = "clock.json"


def device_group(record: dict[str, Any]) -> str:
    """The group of a device record (devices.jsonl, status.json, summary.json's devices):
    every writer names it; a record without one counts as a group of its own."""
    return str(record.get("group") or record.get("device", "?"))


def name_order(name: str) -> list[Any]:
    """A sort key for device names that puts ``phones-2`` before ``phones-10``."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


def run_origin_s(run_dir: Path) -> float:
    """The run's time origin (Unix s): created once by the first caller, read by every other.

    Written to a private file and hard-linked into place, so a second process either sees no
    clock.json (and links its own, of which exactly one wins) or a complete one.
    """
    path = run_dir / CLOCK_FILE
    for _ in range(2):
        try:
            return read_origin(path)
        except FileNotFoundError:
            pass
        tmp = run_dir / f".{CLOCK_FILE}.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"started_unix_s": time.time()}) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another writer was first: read its origin
        finally:
            tmp.unlink()
    return read_origin(path)


def read_origin(path: Path) -> float:
    """The origin (Unix s) a ``clock.json`` holds: FileNotFoundError when there is none,
    RunFileError naming the file when it is not as :func:`run_origin_s` writes it."""
    try:
        text = read_user_text(path, 4096)
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        raise RunFileError(f"{path}: cannot be read "
                           f"({getattr(exc, 'strerror', None) or exc})") from exc
    try:
        obj = load_user_json(text)
    except json.JSONDecodeError as exc:
        raise RunFileError(f"{path}: not valid JSON ({exc.msg})") from exc
    origin = obj.get("started_unix_s") if isinstance(obj, dict) else None
    if isinstance(origin, bool) or not isinstance(origin, (int, float)) \
            or not math.isfinite(origin) or origin < 0:
        raise RunFileError(f"{path}: started_unix_s: expected a Unix time in seconds (a finite "
                           f"number >= 0), found {origin!r}")
    return float(origin)


class RunLog:
    """Appends events, steps and device samples to a run directory; safe across threads."""

    def __init__(self, run_dir: Path, started_s: float | None = None,
                 elapsed_s: Callable[[], float] | None = None, strict: bool = True):
        """``elapsed_s``: where the run's time comes from (default: the wall clock since the
        origin); `testbed simulate` passes its virtual clock, so both modes write one format.

        A write that fails (a full disk) raises, unless ``strict`` is off: then the first
        failure is kept in :attr:`write_error` and later records are dropped. The PS and
        `testbed up` write from threads (gRPC handlers, the lease watcher, the churn replay) that
        must not die of it (the run stalled); they fail the run on :meth:`write_failure`
        instead, the PS between steps, `testbed up` at its next poll."""
        self.strict = strict
        self.write_error: OSError | None = None
        self.run_dir = run_dir
        self.started_s = started_s if started_s is not None else run_origin_s(run_dir)
        self._elapsed_s = elapsed_s
        self._lock = threading.Lock()
        self._files = {name: open(run_dir / f"{name}.jsonl", "a", buffering=1)
                       for name in ("events", "steps", "devices")}

    def _write(self, name: str, record: dict[str, Any], at_t: float | None = None) -> None:
        if self._elapsed_s is None or at_t is not None:
            now = time.time() if at_t is None else at_t
            elapsed = now - self.started_s
        else:
            elapsed = float(self._elapsed_s())
            now = self.started_s + elapsed
        line = json.dumps({"t": round(now, 6), "elapsed_s": round(elapsed, 6), **record},
                          default=str)
        with self._lock:
            if self.write_error is not None and not self.strict:
                return  # the run is failing on it; a torn record would only add to it
            try:
                if name not in self._files:  # stages, tiles: only runs that have them
                    self._files[name] = open(self.run_dir / f"{name}.jsonl", "a", buffering=1)
                self._files[name].write(line + "\n")
            except OSError as exc:
                self.note_write_error(exc)
                if self.strict:
                    raise

    def write_failure(self) -> str | None:
        """Why the run's records are incomplete (the first failed write), or None."""
        exc = self.write_error
        if exc is None:
            return None
        where = f": {exc.filename}" if exc.filename else ""
        return f"cannot write the run's records in {self.run_dir} ({exc.strerror or exc}{where})"

    def note_write_error(self, exc: OSError) -> None:
        """Keep the first failed write of the run's records, this log's or a file beside it
        (status.json, the tile journal): the PS fails the run on it between steps."""
        if self.write_error is None:
            self.write_error = exc

    def event(self, kind: str, /, *, at_t: float | None = None, **fields: Any) -> None:
        """Record one event (join, leave, crash, requeue, reject, ...). ``at_t``: the wall time
        it happened, when that was before now (an action stamped when it began, so that what it
        caused, logged by another thread meanwhile, never reads as earlier)."""
        self._write("events", {"event": kind, **fields}, at_t)

    def step(self, **fields: Any) -> None:
        """Record one finished training step."""
        self._write("steps", fields)

    def stages(self, step: int, stages: list[tuple[str, float, float, str]],
               dilation: float = 1.0) -> None:
        """Record one step's stages (``StepRecord.stages``: stage, wall seconds some GEMM of it
        was out, its bound, the bound's limiting term) as device seconds (wall / ``dilation``)."""
        for stage, spent_s, bound_s, limit in stages:
            self._write("stages", {"step": step, "stage": stage,
                                   "device_s": round(spent_s / dilation, 6),
                                   "bound_s": round(bound_s, 6), "limit": limit})

    def tile(self, *, step: int, gemm: str, task: int, device: str, attempt: int,
             backup: bool, bytes_up: int, sent_s: float, arrived_s: float, started_s: float,
             done_s: float, compute_s: float, accepted_s: float) -> None:
        """Record one accepted tile (``--trace-tiles`` of ``testbed up`` and ``testbed
        simulate``): handed out, on the device, started, done, accepted. On a real run the
        times are monotonic seconds, the PS's for ``sent_s``/``accepted_s`` and the device's
        own for the rest (one clock for every process of this host; a phone's differs); in a
        simulation, virtual seconds. ``compute_s``: the modelled compute time."""
        self._write("tiles", {
            "step": step, "gemm": gemm, "task": task, "device": device, "attempt": attempt,
            "backup": backup, "bytes_up": bytes_up, "sent_s": round(sent_s, 6),
            "arrived_s": round(arrived_s, 6), "started_s": round(started_s, 6),
            "done_s": round(done_s, 6), "compute_s": round(compute_s, 9),
            "accepted_s": round(accepted_s, 6)})

    def device(self, **fields: Any) -> None:
        """Record one device sample."""
        self._write("devices", fields)

    def finish(self, devices: list[dict[str, Any]], state: str) -> list[dict[str, Any]]:
        """End a run in virtual time as the PS ends one: the devices' final records, ``ps_stop``,
        the files closed; returns the events as written (for the summary's counts)."""
        for record in devices:
            self.device(**record)
        self.event("ps_stop", state=state)
        self.close()
        return read_jsonl(self.run_dir / "events.jsonl")

    def close(self) -> None:
        failed: OSError | None = None
        with self._lock:
            for f in self._files.values():
                try:
                    f.close()  # flushes: on a full disk, what it holds is lost either way
                except OSError as exc:
                    failed = failed or exc
        if failed is not None:
            self.note_write_error(failed)
            if self.strict:
                raise failed
