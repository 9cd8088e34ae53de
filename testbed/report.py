"""The run report: plots and a short Markdown page made from a run directory's files.

``testbed report RUN_DIR`` (and ``testbed up`` when a run ends) reads ``steps.jsonl``,
``events.jsonl`` and ``summary.json`` and writes:

* ``report.png``: loss per step; step wall time, device time and the bound, with the p95
  tile-time error on a second axis and the time dilation in the title (marked where an adaptive
  run changed it); bytes each way per step; tiles done per device, with departures marked (per
  group past ``DEVICE_BARS`` devices: one bar per device would not be readable);
* ``report.md``: the headline figures, the network mechanism, and the events by kind.

It reads only what the run wrote, so it works on a finished, failed or interrupted run.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import reprlib
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from testbed.emulator.dilation import LATENESS_KINDS
from testbed.errors import EXIT_BAD_INPUT, EXIT_OK, InputError
from testbed.runlog import device_group, name_order
from testbed.summary import (
    DEPARTURES,
    SAT_OUT_PART,
    SAT_OUT_WHY,
    is_number,
    lateness_kinds,
    ps_summary_or_steps,
    steps_summary,
)
from testbed.units import format_bytes
from testbed.user_paths import (
    is_file,
    load_user_json,
    output_problem,
    path_arg,
    read_user_text,
    written_whole,
)

DEVICE_BARS = 30  # past this many devices, the tiles panel shows one bar per group
MAX_RUN_FILE_BYTES = 4 * 1024**3  # a run's files are read whole; a 10,000-device run's are GBs


@dataclass(frozen=True)
class TileBar:
    """One bar of the tiles panel: a device, or a group's devices (mean, with their range)."""

    label: str
    tiles: float
    low: float
    high: float
    departed: int  # how many of its devices left, crashed or lost their link at least once


def tile_bars(devices: list[dict[str, Any]], departed: set[str]
              ) -> tuple[list[TileBar], bool]:
    """The tiles panel's bars, by name, and whether they are groups: one per device, or,
    past ``DEVICE_BARS`` devices (large.yaml has 240), one per group, labelled with its size."""
    tiles: Counter[str] = Counter()
    group_of: dict[str, str] = {}
    for d in devices:
        name = str(d["device"])
        tiles[name] += d.get("tiles_done", 0)
        group_of[name] = device_group(d)
    if len(tiles) <= DEVICE_BARS:
        return [TileBar(n, tiles[n], tiles[n], tiles[n], int(n in departed))
                for n in sorted(tiles, key=name_order)], False
    members: dict[str, list[str]] = {}
    for name in tiles:
        members.setdefault(group_of[name], []).append(name)
    bars = []
    for group, names in sorted(members.items(), key=lambda kv: name_order(kv[0])):
        counts = [tiles[n] for n in names]
        bars.append(TileBar(f"{group} ({len(names)})", sum(counts) / len(counts), min(counts),
                            max(counts), sum(n in departed for n in names)))
    return bars, True


# What the report reads of each record, by the type it needs: a run's files hold these as
# testbed writes them; a file that breaks them was edited or damaged, and the report names the
# file, the line and the field instead of failing somewhere in matplotlib. Every record is
# checked before either report file is written, so a damaged one leaves neither half-made.
#
# A number must also lie within a bound for its kind. Finite is not enough: matplotlib scales an
# axis past its largest value (a step's tile_error_p95 of 1e308 overflowed the axis: "Axis
# limits cannot be NaN or Inf"), and report.md multiplies some figures by 100 or 1000. The
# bounds are far beyond what any run writes, so a value past one is damage, refused with its
# name; it is not clipped, as a clipped plot would draw a wrong value as if it were right.
BOUNDS = {  # kind: (largest magnitude, what the number is)
    "s": (1e9, "seconds: 30 years"),
    "bytes": (1e18, "bytes: an exabyte"),
    "count": (1e15, "a count"),
    "fraction": (1e6, "a fraction: 1 is 100%"),
    "factor": (1e6, "a factor"),
    "J": (1e15, "joules"),
    # a diverged run's loss may be anything a float32 holds (past it, it is inf: refused)
    "loss": (3.5e38, "nats: a float32's range"),
}
# kinds no run writes below 0 (seconds, fractions and joules may be: a lag, a signed tile error,
# a phone's energy measured from its battery while it charged)
NOT_NEGATIVE = ("bytes", "count", "factor")
MAX_STEP = 10**12  # a step index; steps are counted from 0
STEP_NUMBERS = {"wall_s": "s", "device_time_s": "s", "bytes_down": "bytes",
                "bytes_up": "bytes"}  # every step has them
STEP_OPTIONAL_NUMBERS = {"loss": "loss", "bound_s": "s", "time_dilation": "factor",
                         "tile_error_p95": "fraction"}  # null: none (a simulated run's loss)
SUMMARY_NUMBERS = {"wall_s": "s", "time_dilation": "factor", "bytes_down": "bytes",
                   "bytes_up": "bytes", "tile_error_p50": "fraction",
                   "tile_error_p95": "fraction", "lag_p95_s": "s", "efficiency": "factor",
                   "final_loss": "loss", "dilation_target_p95": "fraction",
                   "lateness_share_max": "fraction", "steps_below_bound": "count"}
SUMMARY_NOT_NULL = ("wall_s", "time_dilation", "bytes_down", "bytes_up")  # may only be absent
SUMMARY_MAPPINGS = ("network", "real_devices", "lateness_shares_worst")
# printed as they are: a list or an object there is no run's (and one nested deep enough
# would end Python's stack in repr)
SUMMARY_PRINTED = ("state", "exit_code", "steps_done", "steps", "tiles", "recomputed_tiles",
                   "requeued_tiles", "rejected", "dilation_min", "dilation_max")
NETWORK_PRINTED = ("backend", "rate", "delay", "loss")
REAL_DEVICE_NUMBERS = {"model_error_fraction": "fraction", "measured_s_per_tile": "s",
                       "predicted_s_per_tile": "s", "measured_energy_j": "J",
                       "modelled_energy_j": "J"}

_SHORT = reprlib.Repr()  # a damaged value in a message: its start, never the whole of it
_SHORT.maxstring = _SHORT.maxother = 40
_SHORT.maxlevel = 2


def _shown(value: Any) -> str:
    """A value for a problem's message: short, and a long integer by its digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20:
        return f"an integer of {len(str(abs(value)))} digits"
    return _SHORT.repr(value)


def _number_problem(record: dict[str, Any], key: str, kind: str, required: bool = False,
                    nullable: bool = True) -> str | None:
    """What is wrong with ``record[key]`` as a number of ``kind`` (see BOUNDS), or None.
    Absent is fine unless ``required``; so is null, unless ``required`` or not ``nullable``."""
    if key not in record:  # "got None" named Python's value for a key the line lacks
        return f"{key}: missing (expected a finite number)" if required else None
    value = record.get(key)
    if value is None and nullable and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) if isinstance(value, float) else
            abs(value) <= sys.float_info.max):  # an int past a float's range has no float
        return f"{key}: expected a finite number, got " + \
            ("null" if value is None else _shown(value))
    limit, what = BOUNDS[kind]
    if value < 0 and kind in NOT_NEGATIVE:
        return f"{key}: expected a number at least 0 ({what}), got {_shown(value)}"
    if abs(value) > limit:
        return f"{key}: expected a number of magnitude at most {limit:g} ({what}), " \
               f"got {_shown(value)}"
    return None


def _printed_problems(record: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    return [f"{key}: expected a string, number, boolean or null, got {_shown(record[key])}"
            for key in keys if isinstance(record.get(key), (list, dict))]


def step_problems(record: Any) -> list[str]:
    if not isinstance(record, dict):
        return [f"expected a JSON object, got {type(record).__name__}"]
    step = record.get("step")
    problems = []
    if "step" not in record:
        problems.append(f"step: missing (expected an integer from 0 to {MAX_STEP:,})")
    elif isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        problems.append(f"step: expected an integer from 0 to {MAX_STEP:,}, got "
                        + ("null" if step is None else _shown(step)))
    problems += [p for key, kind in STEP_NUMBERS.items()
                 if (p := _number_problem(record, key, kind, required=True))]
    problems += [p for key, kind in STEP_OPTIONAL_NUMBERS.items()
                 if (p := _number_problem(record, key, kind))]
    sat_out = record.get("sat_out") or {}
    if not isinstance(sat_out, dict):
        problems.append(f"sat_out: expected a mapping, got {_shown(record['sat_out'])}")
    else:
        problems += [f"sat_out.{p}" for p in _printed_problems(sat_out, tuple(sat_out))]
    return problems


def _device_problems(i: int, d: Any) -> list[str]:
    """One record of summary.json's ``devices``, as the tiles panel reads it."""
    if not isinstance(d, dict) or not isinstance(d.get("device"), str):
        return [f"devices[{i}]: expected an object with a device name (a string)"]
    problems = [f"devices[{i}].{p}" for p in [
        _number_problem(d, "tiles_done", "count", nullable=False)] if p]
    if d.get("group") is not None and not isinstance(d["group"], str):
        problems.append(f"devices[{i}].group: expected a string, got {_shown(d['group'])}")
    return problems


def _summary_problems(summary: Any) -> list[str]:
    if not isinstance(summary, dict):
        return [f"expected a JSON object, got {type(summary).__name__}"]
    problems = [p for key, kind in SUMMARY_NUMBERS.items()
                if (p := _number_problem(summary, key, kind,
                                         nullable=key not in SUMMARY_NOT_NULL))]
    problems += _printed_problems(summary, SUMMARY_PRINTED)
    problems += [f"{key}: expected a mapping, got {_shown(summary[key])}"
                 for key in SUMMARY_MAPPINGS if not isinstance(summary.get(key) or {}, dict)]
    network = summary.get("network") or {}
    if isinstance(network, dict):
        problems += [f"network.{p}" for p in _printed_problems(network, NETWORK_PRINTED)]
    shares = summary.get("lateness_shares_worst") or {}
    if isinstance(shares, dict):
        problems += [f"lateness_shares_worst.{p}" for kind in LATENESS_KINDS
                     if (p := _number_problem(shares, kind, "fraction"))]
    devices = summary.get("devices") or []
    if not isinstance(devices, list):
        return [*problems, f"devices: expected a list, got {type(devices).__name__}"]
    for i, d in enumerate(devices):
        problems += _device_problems(i, d)
    real = summary.get("real_devices") or {}
    if isinstance(real, dict):
        for name, r in real.items():
            if not isinstance(r, dict):
                problems.append(f"real_devices.{name}: expected a mapping")
                continue
            problems += [f"real_devices.{name}.{p}" for key, kind in REAL_DEVICE_NUMBERS.items()
                         if (p := _number_problem(r, key, kind))]
            problems += [f"real_devices.{name}.{p}" for p in _printed_problems(r, ("tiles_done",))]
    return problems


def event_problems(record: Any) -> list[str]:
    if not isinstance(record, dict):
        return [f"expected a JSON object, got {type(record).__name__}"]
    event = record.get("event")
    if event is not None and not isinstance(event, str):  # events are counted by it
        return [f"event: expected a string, got {_shown(event)}"]
    device = record.get("device")
    if event in DEPARTURES and device is not None and not isinstance(device, str):
        return [f"device: expected a string, got {_shown(device)}"]
    return []


def _not_json(exc: json.JSONDecodeError) -> str:
    # pos 0: the whole value, such as nesting too deep or an integer of too many digits
    # (load_user_json reports those there); a position would only mislead
    where = f"line {exc.lineno}, column {exc.colno}: " if exc.pos else ""
    return f"{where}not valid JSON: {exc.msg}"


def _jsonl(path: Path, problems_of: Callable[[Any], list[str]]) -> list[dict[str, Any]]:
    """A JSON-lines file's records, each checked. A torn line is left out, as ``read_jsonl``
    does (a run killed while it wrote one, then resumed, leaves it); a record of the wrong shape,
    or a line that is no record at all, is an InputError, with every such line."""
    try:
        lines = read_user_text(path, MAX_RUN_FILE_BYTES, errors="replace").splitlines() \
            if path.exists() else []
    except OSError as exc:
        raise InputError(str(path), [f"cannot read the file: {exc.strerror}"]) from exc
    records, problems = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = load_user_json(line)
        except json.JSONDecodeError as exc:
            # A torn line is the start of a record cut off: the decoder reads into it before it
            # fails. One it refuses at once (pos 0; load_user_json puts nesting too deep and an
            # integer of too many digits there) was never a record of ours.
            if exc.pos == 0:
                problems.append(f"line {number}: not valid JSON: {exc.msg}")
            continue
        found = problems_of(record)
        problems += [f"line {number}: {p}" for p in found]
        if not found:
            records.append(record)
    if problems:
        raise InputError(str(path), problems)
    return records


def _load(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """steps.jsonl, events.jsonl and summary.json, checked for all the report reads of them.

    A run without summary.json (``testbed up`` killed, or still running), or whose summary
    has no ``steps_done`` (the PS left no summary, before ``testbed up`` filled one from the
    steps), takes what :func:`testbed.summary.ps_summary_or_steps` gives, as summary.json
    would have: the PS's ps_summary.json, else the figures of the steps recorded."""
    path = run_dir / "summary.json"
    summary: Any = {}
    if path.exists():
        try:
            summary = load_user_json(read_user_text(path, MAX_RUN_FILE_BYTES, errors="replace"))
        except OSError as exc:
            raise InputError(str(path), [f"cannot read the file: {exc.strerror}"]) from exc
        except json.JSONDecodeError as exc:
            raise InputError(str(path), [_not_json(exc)]) from exc
        problems = _summary_problems(summary)
        if problems:
            raise InputError(str(path), problems)
    events = _jsonl(run_dir / "events.jsonl", event_problems)
    steps = _jsonl(run_dir / "steps.jsonl", step_problems)
    if "steps_done" not in summary:
        base = ps_summary_or_steps(run_dir, steps)
        if base.get("totals_from") == "steps.jsonl":
            # figures of checked steps; a sum past a summary's bound (steps at theirs) is none
            base = {key: value for key, value in base.items()
                    if not _summary_problems({key: value})}
        problems = _summary_problems(base)
        if problems:
            raise InputError(str(run_dir / "ps_summary.json"), problems)
        summary = {**base, **summary}
        if not path.exists():
            summary = _unfinished(run_dir, summary)
    return steps, events, summary


def _unfinished(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """A run without summary.json: ``running`` while a `testbed up` holds it (its report said
    ``failed``), and the network ``testbed up`` described in network.json (the report said
    ``?`` for each of its figures)."""
    from testbed.run_lock import holder

    out = dict(summary)
    pid = holder(run_dir)
    if pid is not None and out.get("state") == "failed":
        out.update(state="running", running_pid=pid)
    if "network" not in out:
        try:
            network = load_user_json(read_user_text(run_dir / "network.json", 1 << 20))
        except (OSError, ValueError):
            network = None
        if isinstance(network, dict) and not _summary_problems({"network": network}):
            out["network"] = network
    return out


def _outputs(run_dir: Path, names: tuple[str, ...]) -> list[Path]:
    """The report files' paths in ``run_dir``, or InputError (exit 2) naming each that cannot
    be written (a directory in its place, a read-only directory), asked before any work."""
    paths = [run_dir / name for name in names]
    problems = [f"{p.name}: {why}" for p in paths if (why := output_problem(p))]
    if problems:
        raise InputError(str(run_dir), problems)
    return paths


def _png(fig: Any) -> bytes:
    """A figure as PNG, the figure closed: drawn whole in memory before any file is written."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=90)
    finally:
        plt.close(fig)
    return buffer.getvalue()


def plot(run_dir: Path) -> Path:
    """Draw report.png for a run directory; return its path."""
    (out,) = _outputs(run_dir, ("report.png",))
    image = _png(draw(run_dir))
    with written_whole(out, binary=True) as handle:
        handle.write(image)
    return out


def draw(run_dir: Path) -> Any:
    """report.png's figure (a matplotlib Figure): loss, step time against the bound with the
    tile-time error, payload, tiles per device or group."""
    return _figure(run_dir.name, *_load(run_dir))


def _figure(name: str, steps: list[dict[str, Any]], events: list[dict[str, Any]],
            summary: dict[str, Any]) -> Any:
    """:func:`draw`'s figure from the run's checked records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ax_loss, ax_time), (ax_bytes, ax_dev) = axes
    x = [s["step"] for s in steps]
    for ax in (ax_loss, ax_time, ax_bytes):  # whole steps, even for a run of one
        if x:
            ax.set_xlim(min(x) - 0.5, max(x) + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    losses = [(s["step"], s["loss"]) for s in steps if isinstance(s.get("loss"), (int, float))]
    ax_loss.plot([p[0] for p in losses], [p[1] for p in losses], marker=".")
    ax_loss.set(title="loss", xlabel="step", ylabel="cross-entropy (nats)")
    if not losses:  # say why the panel is empty rather than draw empty axes
        ax_loss.text(0.5, 0.5, "no loss: a simulated run has no tensors"
                     if summary.get("simulated") else "no loss recorded", ha="center",
                     va="center", transform=ax_loss.transAxes)
        ax_loss.set_yticks([])
    ax_time.plot(x, [s["wall_s"] for s in steps], marker=".", label="wall time")
    if any(s.get("device_time_s") != s.get("wall_s") for s in steps):
        ax_time.plot(x, [s["device_time_s"] for s in steps], marker=".", label="device time")
    bounded = [(s["step"], s["bound_s"]) for s in steps if s.get("bound_s") is not None]
    if bounded:  # the analytic lower bound no schedule of the step's GEMMs can beat
        if not any(s.get("device_time_s") != s.get("wall_s") for s in steps):
            ax_time.plot(x, [s["device_time_s"] for s in steps], marker=".",
                         label="device time")
        ax_time.plot([b[0] for b in bounded], [b[1] for b in bounded], marker=".",
                     linestyle="--", label="bound (bound_s)")
    # D in the title (it is a factor, not a percentage: on the error axis it lay flat at 0)
    dilations = sorted({float(s["time_dilation"]) for s in steps
                        if isinstance(s.get("time_dilation"), (int, float))})
    d_title = "" if not dilations or dilations == [1.0] else \
        f" at time dilation D {dilations[0]:.2f}" if len(dilations) == 1 else \
        f" at time dilation D {dilations[0]:.2f}-{dilations[-1]:.2f}"
    ax_time.set(title="step time" + d_title, xlabel="step", ylabel="seconds")
    previous = None
    for s in steps:  # an adaptive run: where D changed, at that step's wall time
        d = s.get("time_dilation")
        if len(dilations) > 1 and isinstance(d, (int, float)) and d != previous:
            ax_time.annotate(f"D {d:.2f}", (s["step"], s["wall_s"]), fontsize="x-small",
                             textcoords="offset points", xytext=(0, 5), ha="center")
        previous = d
    top = max((v for s in steps for v in (s.get("wall_s"), s.get("device_time_s"),
                                          s.get("bound_s")) if isinstance(v, (int, float))),
              default=0.0)
    if top > 0:  # room above the lines for the legend
        ax_time.set_ylim(0, 1.4 * top)
    handles, labels = ax_time.get_legend_handles_labels()
    fid = [(s["step"], s["tile_error_p95"]) for s in steps
           if isinstance(s.get("tile_error_p95"), (int, float))]
    if fid:  # fidelity per step on a second axis: p95 tile-time error
        ax_err = ax_time.twinx()
        ax_err.plot([f[0] for f in fid], [100 * f[1] for f in fid], color="tab:red",
                    linestyle="--", marker=".", label="p95 tile error %")  # (one step: a dot)
        ax_err.set_ylim(0, 1.4 * max(100 * f[1] for f in fid) or 1.0)
        ax_err.set(ylabel="p95 tile-time error %")
        more_handles, more_labels = ax_err.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax_time.legend(handles, labels, loc="upper left", ncol=2, fontsize="small")
    ax_bytes.plot(x, [s["bytes_down"] / 1e6 for s in steps], marker=".",
                  label="down (PS to devices)")
    ax_bytes.plot(x, [s["bytes_up"] / 1e6 for s in steps], marker=".", label="up (devices to PS)")
    ax_bytes.set(title="payload per step", xlabel="step", ylabel="MB")
    ax_bytes.legend()
    departed = {str(e.get("device")) for e in events if e.get("event") in DEPARTURES}
    bars, grouped = tile_bars(summary.get("devices") or [], departed)
    ax_dev.barh([b.label for b in bars], [b.tiles for b in bars],
                xerr=[[b.tiles - b.low for b in bars], [b.high - b.tiles for b in bars]]
                if grouped else None)
    for label, bar in zip(ax_dev.get_yticklabels(), bars):
        if bar.departed:
            label.set_color("red")
    ax_dev.set(title="tiles per device by group: mean, range (red: departed)"
               if grouped else "tiles per device (red: departed at least once)", xlabel="tiles")
    done = summary.get("steps_done", len(steps))
    fig.suptitle(f"{name}: {summary.get('state', '?')}, {done} step{'' if done == 1 else 's'}"
                 + (" so far" if summary.get("state") == "running" else ""))
    fig.tight_layout()
    return fig


def _planning_lines(steps: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    """The planner's part of report.md: efficiency against the bound, groups that sat out."""
    lines: list[str] = []
    eff = summary.get("efficiency")
    if isinstance(eff, (int, float)):
        lines.append(f"- schedule efficiency (bound / device time): {eff:.2f}")
    below = summary.get("steps_below_bound") or 0
    if below:
        lines.append(f"- **{below} step(s) below their lower bound**: the emulated links or "
                     f"time dilation did not follow the topology; device times are wrong")
    sat_out: dict[str, set[str]] = {}
    for s in steps:
        for group, why in (s.get("sat_out") or {}).items():
            sat_out.setdefault(group, set()).add(str(why))
    if sat_out:
        lines += ["", "## Device groups that sat out", "",
                  "Left out of some GEMMs by the planner ("
                  + "; ".join(f"`{k}`: {why}" for k, why in SAT_OUT_WHY.items())
                  + f"; `(N of M)`: {SAT_OUT_PART}; `in N of M ... GEMMs`: it computed the "
                  "others):", ""]
        lines += [f"- {g}: {', '.join(sorted(w))}" for g, w in sorted(sat_out.items())]
    return [*lines, ""] if lines else []


def fidelity_line(summary: dict[str, Any]) -> str:
    """The run's emulation fidelity: how much of a step's device time the tiles' lateness can
    account for, against the target (the verdict's figure, :func:`fidelity_ok`), then the
    device-side tile-time error and the result lag (which the verdict does not judge)."""
    p95 = summary.get("tile_error_p95")
    if summary.get("simulated"):
        return "- emulation fidelity: no emulated tiles (a simulation runs in virtual time)"
    if not isinstance(p95, (int, float)) and summary.get("totals_from") == "steps.jsonl":
        # a run still running, or one that died, has no run-wide figures: not "no tiles"
        if not summary.get("steps_done"):  # "no summary of the run" beside its summary.json
            return "- emulation fidelity: unknown (no step finished)"
        return "- emulation fidelity: unknown (the PS wrote no run-wide figures, " \
               "ps_summary.json; steps.jsonl has each step's tile_error_p95 and lateness_share)"
    if not isinstance(p95, (int, float)):
        return "- emulation fidelity: no emulated tiles"
    target, ok = summary.get("dilation_target_p95"), summary.get("fidelity_ok")
    share = summary.get("lateness_share_max")
    judged = "the lateness" if isinstance(share, (int, float)) else "the p95 tile-time error"
    verdict = "" if not isinstance(target, (int, float)) or ok is None else \
        f" (target: {judged} at most {100 * target:.0f}%: " + ("met)" if ok else "**MISSED**)")
    late = "" if not isinstance(share, (int, float)) else \
        f" late devices can account for up to {100 * share:.1f}% of a step's device time" \
        f"{lateness_kinds(summary)};"
    lag = summary.get("lag_p95_s")
    return (f"- emulation fidelity{verdict}:{late} tile-time error (a tile's time on its device "
            f"against its model's) p50 {100 * (summary.get('tile_error_p50') or 0):.1f}%, p95 "
            f"{100 * p95:.1f}%"
            + (f"; p95 result lag (wall-clock time a result came after its model's time) "
               f"{1e3 * lag:.1f} ms" if isinstance(lag, (int, float)) else ""))


def markdown(run_dir: Path) -> Path:
    """Write report.md for a run directory; return its path."""
    (out,) = _outputs(run_dir, ("report.md",))
    text = _markdown_text(run_dir.name, *_load(run_dir))
    with written_whole(out) as handle:
        handle.write(text)
    return out


def _markdown_text(name: str, steps: list[dict[str, Any]], events: list[dict[str, Any]],
                   summary: dict[str, Any]) -> str:
    """report.md's text from the run's checked records."""
    kinds = Counter(e.get("event") for e in events)
    network = summary.get("network") or {}
    loss = summary.get("final_loss")
    lines = [
        f"# Run {name}",
        "",
        _state_line(summary),
        *_error_line(summary.get("error")),
        f"- steps: {summary.get('steps_done', len(steps))} of {summary.get('steps', '?')}; "
        + (f"final loss {loss:.4f} (cross-entropy, nats)"
           if is_number(loss) else "final loss: none" + (
               " (a simulation computes no tensors)" if summary.get("simulated") else "")),
        f"- tiles: {summary.get('tiles', 0)}, recomputed {summary.get('recomputed_tiles', 0)}, "
        f"re-queued {summary.get('requeued_tiles', 0)}, rejected {summary.get('rejected', 0)}",
        f"- payload: down {format_bytes(summary.get('bytes_down', 0))}, "
        f"up {format_bytes(summary.get('bytes_up', 0))}",
        *_time_lines(summary),
        *_energy_line(summary.get("energy")),
        *_partial_line(summary),
        *_resumed_line(summary, steps),
        fidelity_line(summary),
        f"- network: {network.get('backend', '?')} (rate: {network.get('rate', '?')}, "
        f"delay: {network.get('delay', '?')}, loss: {network.get('loss', '?')})",
        "",
        *_planning_lines(steps, summary),
        "## Events",
        "",
        *(f"- {kind}: {n}{_churn_actions(events) if kind == 'churn' else ''}"
          for kind, n in sorted(kinds.items(), key=lambda kv: str(kv[0]))),
        "",
        "![report](report.png)",
        "",
        *_real_devices(summary.get("real_devices") or {}),
    ]
    return "\n".join(lines)


MAX_ERROR_CHARS = 500  # a failed run's reason on its page: its first lines say it


def _state_line(summary: dict[str, Any]) -> str:
    """How the run ended (or that it has not), with its exit code and what stopped it."""
    state = summary.get("state", "?")
    if state == "running":
        pid = summary.get("running_pid")
        who = f" (pid {pid})" if pid else ""
        command = "testbed simulate" if summary.get("simulated") else "testbed up"
        return (f"- state: running: a `{command}`{who} holds this run directory; this page "
                f"counts the steps it has finished so far")
    by = summary.get("interrupted_by")
    signals = ", ".join(str(x) for x in by) if isinstance(by, list) and by else None
    code = summary.get("exit_code")
    why = [f"exit code {code}" if code is not None else "", f"by {signals}" if signals else ""]
    return f"- state: {state}" + (f" ({', '.join(w for w in why if w)})" if any(why) else "")


def dilation_text(summary: dict[str, Any]) -> str | None:
    """The run's time dilation D: one figure, or the range an adaptive run went through
    (``2.31``, ``2.31-4.80``); None when the summary has none."""
    low, high = summary.get("dilation_min"), summary.get("dilation_max")
    if is_number(low) and is_number(high) and abs(high - low) >= 0.005:
        return f"{low:.2f}-{high:.2f}"
    for value in (low, high, summary.get("time_dilation")):
        if is_number(value):
            return f"{value:.2f}"
    return None


def _time_lines(summary: dict[str, Any]) -> list[str]:
    """The run's time: wall time and device time with the time dilation between them, or for a
    simulated run its virtual device time and what simulating it took; what is not recorded
    says so (a run's report said "wall time 0.0 s, time dilation 1.00" for it)."""
    wall, device = summary.get("wall_s"), summary.get("device_time_s")
    if summary.get("simulated"):
        wall = wall if is_number(wall) else device  # a simulated step's wall is its device time
        took = summary.get("sim_wall_s")
        return [(f"- simulated device time {wall:.1f} s" if is_number(wall) else
                 "- simulated device time: not recorded")
                + (f" (simulating took {took:.1f} s of wall time; virtual time needs no time "
                   f"dilation)" if is_number(took) else "")]
    dilation = dilation_text(summary)
    wall_text = f"wall time {wall:.1f} s (the PS's: from waiting for its devices to its end)" \
        if is_number(wall) else "wall time: not recorded"
    device_text = f"its steps' device time {device:.2f} s (their wall time / D)" \
        if is_number(device) else "device time: not recorded"
    return [f"- {wall_text}; {device_text}; time dilation D "
            f"{dilation if dilation is not None else 'not recorded'}"]


def _churn_actions(events: list[dict[str, Any]]) -> str:
    """What the ``churn`` events did, by action (`` (crash 1, join 1, slow 2)``): "churn: 6"
    alone did not say whether devices left, came back or slowed down."""
    actions = Counter(str(e.get("action")) for e in events
                      if e.get("event") == "churn" and e.get("action") is not None)
    return " (" + ", ".join(f"{a} {n}" for a, n in sorted(actions.items())) + ")" \
        if actions else ""


def _resumed_line(summary: dict[str, Any], steps: list[dict[str, Any]]) -> list[str]:
    """For a resumed run, whose summary totals are its last session's (docs/fault-tolerance.md,
    "Resume"), the whole run's from steps.jsonl: a run of 40 steps of 70 tiles, killed after
    12 and resumed, said "steps: 40 of 40" over "tiles: 1905" and nothing of why."""
    resumes = summary.get("resumes")
    if not is_number(resumes) or resumes < 1 or not steps:
        return []
    run = steps_summary(steps)
    device = f", device time {run['device_time_s']:.2f} s" \
        if is_number(run.get("device_time_s")) else ""
    return [f"- resumed {resumes:g} time(s): the tiles, payload, times and energy above are the "
            f"last session's; the run's {run['steps_done']} step(s) in steps.jsonl: "
            f"{run['tiles']} tiles, down {format_bytes(run['bytes_down'])}, up "
            f"{format_bytes(run['bytes_up'])}{device}"]


def _partial_line(summary: dict[str, Any]) -> list[str]:
    """For a run stopped in a step: which figures count that step's work (the PS's totals) and
    which only the finished steps (architecture.md, "Exit codes")."""
    if summary.get("state") not in ("interrupted", "failed") or \
            summary.get("totals_from") == "steps.jsonl":
        return []
    return ["- tiles, payload, wall time and energy count the work of the step under way when "
            "the run stopped too; steps, loss, device time and efficiency count finished steps"]


def _error_line(error: Any) -> list[str]:
    """Why a run failed (summary.json's ``error``), on one line; none when it did not."""
    if not isinstance(error, str) or not error.strip():
        return []
    text = " ".join(error.split())
    cut = text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."
    return [f"- error: {cut}"]


def _energy_line(energy: Any) -> list[str]:
    """The devices' energy (summary.json's ``energy.total``) when the run has it: all of it,
    and its compute, idle and radio parts; none when a figure is missing or not a number."""
    total = energy.get("total") if isinstance(energy, dict) else None
    keys = ("total_j", "compute_j", "idle_j", "radio_j", "carbon_g")
    if not isinstance(total, dict) or not all(
            isinstance(total.get(k), (int, float)) and not isinstance(total.get(k), bool)
            and math.isfinite(total[k]) for k in keys):
        return []
    return [f"- device energy {total['total_j']:.1f} J (compute {total['compute_j']:.1f} J, "
            f"idle {total['idle_j']:.1f} J, radio {total['radio_j']:.1f} J), carbon "
            f"{total['carbon_g']:.3g} gCO2e"]


def _num(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def _real_devices(real: dict[str, Any]) -> list[str]:
    """The report's table of real devices against their models (empty without any)."""
    if not real:
        return []
    lines = ["## Real devices against their models", "",
             "| device | tiles | measured s/tile | predicted s/tile | model error | "
             "measured J (battery) | modelled J |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in sorted(real.items()):
        err = r.get("model_error_fraction")
        charging = " (charging: lower bound)" if r.get("charging_samples") else ""
        lines.append(f"| {name} | {r.get('tiles_done', 0)} | "
                     f"{_num(r.get('measured_s_per_tile'), '.6f')} | "
                     f"{_num(r.get('predicted_s_per_tile'), '.6f')} | "
                     f"{_num(err * 100 if isinstance(err, (int, float)) else None, '+.1f')}% | "
                     f"{_num(r.get('measured_energy_j'), '.3f')}{charging} | "
                     f"{_num(r.get('modelled_energy_j'), '.3f')} |")
    lines += ["", "Model error = predicted rate / measured rate - 1 (positive: the profile is "
              "optimistic). Measured energy: battery current x voltage from the phone's "
              "telemetry, integrated over the run.", ""]
    return lines


def make_report(run_dir: Path) -> list[Path]:
    """Both report files: the run's records are read and checked once, and both files made in
    memory, before either is written (a damaged record leaves neither half-made)."""
    png, md = _outputs(run_dir, ("report.png", "report.md"))
    run = _load(run_dir)
    image, text = _png(_figure(run_dir.name, *run)), _markdown_text(run_dir.name, *run)
    with written_whole(png, binary=True) as handle:
        handle.write(image)
    with written_whole(md) as handle:
        handle.write(text)
    return [png, md]


def _not_a_run_dir(run_dir: Path) -> str:
    """Why a path is no run directory to report on (a topology given for the run said "no
    steps.jsonl here", as if it were a directory)."""
    try:
        exists, is_dir = run_dir.exists(), run_dir.is_dir()
    except OSError as exc:  # a name too long for the file system, say
        return f"cannot read it: {exc.strerror or exc}; expected a run directory"
    except ValueError:  # a NUL in the name
        exists = is_dir = False
    if not exists:
        return "no such directory; expected a run directory (runs/<time>-<name>/)"
    if not is_dir:
        return "not a directory; expected a run directory (runs/<time>-<name>/)"
    try:  # a baseline's `testbed up` writes no steps.jsonl (docs/baselines.md)
        strategy = load_user_json(read_user_text(run_dir / "summary.json", 1 << 20)).get(
            "strategy")
    except (OSError, ValueError, AttributeError):
        strategy = None
    if strategy in ("pipeline", "data-parallel"):
        return (f"a {strategy} run: report.md and report.png are tile-tp's only; its "
                f"summary.json and {strategy}/ hold its figures (docs/baselines.md)")
    try:  # a `testbed compare` directory holds a run directory per strategy
        runs = sorted(p.name for p in run_dir.iterdir() if is_file(p / "steps.jsonl"))
    except OSError:
        runs = []
    if runs:  # a comparison's runs, or runs/ itself
        named = ", ".join(runs[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
        return (f"no steps.jsonl here, but in {named} inside it: run directories; report one "
                f"of them, e.g. {run_dir / runs[0]}")
    return "no steps.jsonl here; is this a run directory?"


def _run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not is_file(run_dir / "steps.jsonl"):  # False for a name no file can have, too
        print(f"error: {run_dir}: {_not_a_run_dir(run_dir)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for path in make_report(run_dir):
        print(path)
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `testbed report`."""
    p = sub.add_parser("report", help="plots and a summary page for a run directory",
                       description="Write report.png and report.md into a run directory from "
                                   "its steps, events and summary.")
    p.add_argument("run_dir", type=path_arg, help="the run directory")
    p.set_defaults(func=_run)
