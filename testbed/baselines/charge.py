"""What a device is charged for a baseline's work that was stopped part-way: the part that ran.

One rule for the simulated baselines (:meth:`~testbed.baselines.sim_core.BaselineWorld.stop_work`)
and the emulated ones (the stage and replica processes' ledgers, read by
:mod:`testbed.baselines.emulate`). A piece of work (a stage's forward or backward of one
micro-batch, a replica's forward and backward, an AdamW step) is a run of *parts*, each a
GEMM or the piece's memory-bound work, timed back to back in device seconds: ``(start_s,
end_s, joules)``. Stopped at ``stop_s`` (its device lost, its process killed, its step given
up), a part that had ended is charged whole, one not started is not charged, and the part
under way is charged pro rata: ``(stop_s - start_s) / (end_s - start_s)`` of its seconds and
joules.

**The ledger** of an emulated process (``<its report>.work.jsonl``): one JSON line per piece,
appended before the piece's real compute starts (so a process killed at any moment has the
pieces it began)::

    {"t0": 1234.5, "dilation": 2.0, "gemms": 12, "parts": [[0.0, 0.01, 0.05], ...]}

``t0`` is the host's ``time.monotonic()`` when the piece started (one clock for every
namespace), ``parts`` its parts in device seconds from the piece's start, ``gemms`` how many
of them the device model timed (each drew one noise factor; each line drew one straggler
factor): what a process started again on the device skips, so that it goes on with the
device's draws instead of repeating them.

**A churn ``slow`` mid-piece** (:mod:`testbed.baselines.slow`) re-times the piece under way
as the simulated baselines do (:meth:`~testbed.baselines.sim_core.BaselineWorld.set_slow`):
what is left of it after the slow's time takes ``new factor / old factor`` times its seconds
and joules (:func:`retime`; the part under way is split there). The process appends the
piece's parts as re-timed, a line that replaces those of the piece with the same ``t0`` and
draws nothing::

    {"t0": 1234.5, "dilation": 2.0, "retimed": true, "parts": [[0.0, 0.01, 0.05], ...],
     "gemm_parts": 13}

(``gemm_parts``: how many parts, first, are GEMMs: the re-timing splits the part under way,
which may be one.) Wall time stays ``t0 + device seconds x dilation`` along the re-timed
parts, so a kill is charged by the same rule.

**A killed process's stop** (``<ledger>.stopped``, :func:`write_stopped`): the runner writes
when it killed the process (``time.monotonic()``), so that a process started again on the
device heats its model with the GEMMs that ran, up to the kill (:func:`heat_spans`), as the
simulated device's thermal state keeps a stopped piece's heat as far as it ran.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

# (start_s, end_s, joules, ...): a GEMM or memory-bound part; what follows end_s goes with its
# time (the ledger's parts have joules; the simulator's add the device model's seconds, joules)
Part = tuple[float, ...]


def unrun_share(start_s: float, end_s: float, stop_s: float) -> float:
    """The share of a part [start_s, end_s) not run by stop_s: 0 when it had ended, 1 when it
    had not started, pro rata while under way."""
    if stop_s >= end_s:
        return 0.0
    if stop_s <= start_s or end_s <= start_s:
        return 1.0
    return (end_s - stop_s) / (end_s - start_s)


def retimed_parts(parts: Sequence[Part], at_s: float, ratio: float) -> list[list[Part]]:
    """A piece's parts after its device's compute factor changed ``ratio`` times (new / old)
    at ``at_s`` (device seconds, on the parts' clock), each part as what it became: the
    parts ended by then stay, the one under way is split at ``at_s`` (two parts), and
    everything after takes ``ratio`` times its seconds and amounts (what follows ``end_s``:
    joules, and the simulator's model seconds and joules), moved back (or forward) by what
    the earlier ones gained."""
    out: list[list[Part]] = []
    shift = 0.0  # how far the parts from here on move
    for start, end, *amounts in parts:
        if end <= at_s:
            out.append([(start, end, *amounts)])
            continue
        became: list[Part] = []
        if start < at_s:  # under way: the part run keeps its time, the rest is re-timed
            rest = (end - at_s) / (end - start)
            became.append((start, at_s, *(a * (1 - rest) for a in amounts)))
            start, amounts = at_s, [a * rest for a in amounts]
        seconds = end - start
        start += shift
        shift += seconds * (ratio - 1)
        became.append((start, start + seconds * ratio, *(a * ratio for a in amounts)))
        out.append(became)
    return out


def retime(parts: Sequence[Part], at_s: float, ratio: float) -> list[Part]:
    """:func:`retimed_parts`, flat: the piece's parts as re-timed."""
    return [part for became in retimed_parts(parts, at_s, ratio) for part in became]


def ran(parts: Iterable[Part], stop_s: float) -> tuple[float, float]:
    """Device seconds and joules of the parts that ran by stop_s (:func:`unrun_share`)."""
    seconds = joules = 0.0
    for start, end, j in parts:
        done = 1.0 - unrun_share(start, end, stop_s)
        seconds += (end - start) * done
        joules += j * done
    return seconds, joules


@dataclass(frozen=True)
class Charge:
    """An emulated process's work, as its ledger says, up to its stop."""

    device_s: float  # device seconds of the parts that ran
    energy_j: float  # their compute joules
    pieces: int  # pieces begun: straggler draws used
    gemms: int  # GEMMs the device model timed: noise draws used


def ledger_path(report: Path) -> Path:
    """Where a stage's or replica's process appends its ledger: beside its report."""
    return report.with_suffix(".work.jsonl")


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """A ledger's complete lines (none when the process began no piece; a torn last line,
    written as the process was killed, is left out)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in data[:data.rfind(b"\n") + 1].splitlines()
            if line.strip()]


def charge(pieces: Sequence[dict[str, Any]], stopped_at: float | None) -> Charge:
    """The work of a ledger's pieces, up to ``stopped_at`` (``time.monotonic()`` when the
    process was killed; None: it ended by itself, every piece it began ran)."""
    seconds = joules = 0.0
    gemms = 0
    pieces = _retimed(pieces)
    for p in pieces:
        t0, dilation = float(p["t0"]), float(p["dilation"])
        if stopped_at is None or dilation <= 0:
            stop = math.inf if stopped_at is None or stopped_at >= t0 else -math.inf
        else:
            stop = (stopped_at - t0) / dilation
        s, j = ran(((a, e, x) for a, e, x in p["parts"]), stop)
        seconds += s
        joules += j
        gemms += int(p["gemms"])
    return Charge(seconds, joules, len(pieces), gemms)


def _retimed(pieces: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A ledger's pieces, each with its parts as last re-timed (a ``retimed`` line replaces
    the parts of the latest piece with its ``t0``; it is no piece of its own)."""
    out: list[dict[str, Any]] = []
    for p in pieces:
        if not p.get("retimed"):
            out.append(p)
            continue
        for i in range(len(out) - 1, -1, -1):
            if out[i]["t0"] == p["t0"]:
                out[i] = {**out[i], "parts": p["parts"],
                          "gemm_parts": p.get("gemm_parts", out[i]["gemms"])}
                break
    return out


def heat_spans(pieces: Sequence[dict[str, Any]], stopped_at: float | None
               ) -> list[tuple[float, float, float]]:
    """The GEMMs of a ledger's pieces as they ran (re-timed as last re-timed), up to
    ``stopped_at`` (``time.monotonic()`` of the kill; None: every piece ran): ``(t0, start_s,
    seconds)``, the piece's start on the host's clock and the GEMM's device seconds from it
    (the part under way at the stop cut there)."""
    out = []
    for p in _retimed(pieces):
        t0, dilation = float(p["t0"]), float(p["dilation"])
        stop = math.inf if stopped_at is None or dilation <= 0 else (stopped_at - t0) / dilation
        for start, end, *_ in p["parts"][:int(p.get("gemm_parts", p["gemms"]))]:
            if stop > start:
                out.append((t0, float(start), min(float(end), stop) - float(start)))
    return out


def stopped_path(ledger: Path) -> Path:
    """Where the runner writes when it killed the ledger's process."""
    return ledger.with_suffix(".stopped")


def write_stopped(ledger: Path, stopped_at: float) -> None:
    """Note that the ledger's process was killed at ``stopped_at`` (``time.monotonic()``)."""
    stopped_path(ledger).write_text(repr(stopped_at))


def read_stopped(ledger: Path) -> float | None:
    """When the ledger's process was killed (None: it was not, or nothing says so)."""
    try:
        return float(stopped_path(ledger).read_text())
    except (OSError, ValueError):
        return None
