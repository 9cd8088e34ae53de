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
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from testbed.errors import EXIT_BAD_INPUT, EXIT_OK, InputError
from testbed.runlog import device_group
from testbed.summary import lateness_kinds
from testbed.units import format_bytes
from testbed.user_paths import read_user_text

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
                for n in sorted(tiles)], False
    members: dict[str, list[str]] = {}
    for name in tiles:
        members.setdefault(group_of[name], []).append(name)
    bars = []
    for group, names in sorted(members.items()):
        counts = [tiles[n] for n in names]
        bars.append(TileBar(f"{group} ({len(names)})", sum(counts) / len(counts), min(counts),
                            max(counts), sum(n in departed for n in names)))
    return bars, True


# What the report reads of each record, by the type it needs: a run's files hold these as
# testbed writes them; a file that breaks them was edited or damaged, and the report names the
# file, the line and the field instead of failing somewhere in matplotlib.
STEP_NUMBERS = ("wall_s", "device_time_s", "bytes_down", "bytes_up")  # every step has them
STEP_OPTIONAL_NUMBERS = ("loss", "bound_s", "time_dilation", "tile_error_p95")
SUMMARY_NUMBERS = ("wall_s", "time_dilation", "bytes_down", "bytes_up", "tile_error_p50",
                   "tile_error_p95", "lag_p95_s", "efficiency", "final_loss",
                   "dilation_target_p95", "lateness_share_max", "steps_below_bound")
SUMMARY_MAPPINGS = ("network", "real_devices")


def _number_problem(record: dict[str, Any], key: str, required: bool) -> str | None:
    value = record.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        return f"{key}: expected a finite number, got {value!r}"
    return None


def _step_problems(record: Any) -> list[str]:
    if not isinstance(record, dict):
        return [f"expected a JSON object, got {type(record).__name__}"]
    step = record.get("step")
    problems = [] if isinstance(step, int) and not isinstance(step, bool) else \
        [f"step: expected an integer, got {step!r}"]
    problems += [p for key in STEP_NUMBERS if (p := _number_problem(record, key, True))]
    problems += [p for key in STEP_OPTIONAL_NUMBERS
                 if (p := _number_problem(record, key, False))]
    if not isinstance(record.get("sat_out") or {}, dict):
        problems.append(f"sat_out: expected a mapping, got {record['sat_out']!r}")
    return problems


def _summary_problems(summary: Any) -> list[str]:
    if not isinstance(summary, dict):
        return [f"expected a JSON object, got {type(summary).__name__}"]
    problems = [p for key in SUMMARY_NUMBERS if (p := _number_problem(summary, key, False))]
    problems += [f"{key}: expected a mapping, got {summary[key]!r}" for key in SUMMARY_MAPPINGS
                 if not isinstance(summary.get(key) or {}, dict)]
    devices = summary.get("devices") or []
    if not isinstance(devices, list):
        return [*problems, f"devices: expected a list, got {type(devices).__name__}"]
    for i, d in enumerate(devices):
        if not isinstance(d, dict) or "device" not in d:
            problems.append(f"devices[{i}]: expected an object with a device name")
        elif (p := _number_problem(d, "tiles_done", False)) is not None:
            problems.append(f"devices[{i}].{p}")
    real = summary.get("real_devices") or {}
    if isinstance(real, dict):
        problems += [f"real_devices.{name}: expected a mapping" for name, r in real.items()
                     if not isinstance(r, dict)]
    return problems


def _jsonl(path: Path, problems_of: Callable[[Any], list[str]]) -> list[dict[str, Any]]:
    """A JSON-lines file's records, each checked. A line that is not JSON is left out, as
    ``read_jsonl`` does (a run killed while it wrote one, then resumed, leaves it torn); a
    record of the wrong shape is an InputError, with every such line."""
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
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        found = problems_of(record)
        problems += [f"line {number}: {p}" for p in found]
        if not found:
            records.append(record)
    if problems:
        raise InputError(str(path), problems)
    return records


def _load(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """steps.jsonl, events.jsonl and summary.json, checked for what the report reads of them."""
    path = run_dir / "summary.json"
    summary: Any = {}
    if path.exists():
        try:
            summary = json.loads(read_user_text(path, MAX_RUN_FILE_BYTES, errors="replace"))
        except OSError as exc:
            raise InputError(str(path), [f"cannot read the file: {exc.strerror}"]) from exc
        except json.JSONDecodeError as exc:
            raise InputError(str(path), [f"line {exc.lineno}, column {exc.colno}: not valid "
                                         f"JSON: {exc.msg}"]) from exc
        problems = _summary_problems(summary)
        if problems:
            raise InputError(str(path), problems)
    events = _jsonl(run_dir / "events.jsonl", lambda r: [] if isinstance(r, dict) else
                    [f"expected a JSON object, got {type(r).__name__}"])
    return _jsonl(run_dir / "steps.jsonl", _step_problems), events, summary


def plot(run_dir: Path) -> Path:
    """Draw report.png for a run directory; return its path."""
    import matplotlib.pyplot as plt

    fig = draw(run_dir)
    out = run_dir / "report.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def draw(run_dir: Path) -> Any:
    """report.png's figure (a matplotlib Figure): loss, step time against the bound with the
    tile-time error, payload, tiles per device or group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps, events, summary = _load(run_dir)
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
    ax_time.plot(x, [s["wall_s"] for s in steps], marker=".", label="wall")
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
    dilation_text = "" if not dilations or dilations == [1.0] else \
        f" at time dilation D {dilations[0]:.2f}" if len(dilations) == 1 else \
        f" at time dilation D {dilations[0]:.2f}-{dilations[-1]:.2f}"
    ax_time.set(title="step time" + dilation_text, xlabel="step", ylabel="s")
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
                    linestyle="--", label="p95 tile error %")
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
    departed = {str(e.get("device")) for e in events
                if e.get("event") in ("leave", "disconnect", "lease_expired")}
    bars, grouped = tile_bars(summary.get("devices") or [], departed)
    ax_dev.barh([b.label for b in bars], [b.tiles for b in bars],
                xerr=[[b.tiles - b.low for b in bars], [b.high - b.tiles for b in bars]]
                if grouped else None)
    for label, bar in zip(ax_dev.get_yticklabels(), bars):
        if bar.departed:
            label.set_color("red")
    ax_dev.set(title="tiles per device by group: mean, range (red: departed)"
               if grouped else "tiles per device (red: departed at least once)", xlabel="tiles")
    fig.suptitle(f"{run_dir.name}: {summary.get('state', '?')}, "
                 f"{summary.get('steps_done', len(steps))} steps")
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
                  "Left out of some GEMMs by the planner (`link`: moving its share costs more "
                  "than computing it; `speed`: too slow to shorten the GEMM; `in N of M ... "
                  "GEMMs`: it computed the others):", ""]
        lines += [f"- {g}: {', '.join(sorted(w))}" for g, w in sorted(sat_out.items())]
    return [*lines, ""] if lines else []


def fidelity_line(summary: dict[str, Any]) -> str:
    """The run's emulation fidelity: device-side tile-time error and how much of a step's
    device time the tiles' lateness can account for, against the target."""
    p95 = summary.get("tile_error_p95")
    if not isinstance(p95, (int, float)):
        return "- emulation fidelity: no emulated tiles"
    target, ok = summary.get("dilation_target_p95"), summary.get("fidelity_ok")
    verdict = "" if not isinstance(target, (int, float)) or ok is None else \
        (f" (target {100 * target:.0f}%: " + ("met)" if ok else "**MISSED**)"))
    share = summary.get("lateness_share_max")
    late = "" if not isinstance(share, (int, float)) else \
        f"; late devices can account for up to {100 * share:.1f}% of a step's device time" \
        f"{lateness_kinds(summary)}"
    return (f"- emulation fidelity{verdict}: tile-time error p50 "
            f"{100 * (summary.get('tile_error_p50') or 0):.1f}%, p95 {100 * p95:.1f}%{late}; "
            f"p95 lag {1e3 * (summary.get('lag_p95_s') or 0):.1f} ms; time dilation "
            f"{summary.get('dilation_min')}..{summary.get('dilation_max')}")


def markdown(run_dir: Path) -> Path:
    """Write report.md for a run directory; return its path."""
    steps, events, summary = _load(run_dir)
    kinds = Counter(e.get("event") for e in events)
    network = summary.get("network") or {}
    loss = summary.get("final_loss")
    lines = [
        f"# Run {run_dir.name}",
        "",
        f"- state: {summary.get('state', '?')} (exit code {summary.get('exit_code', '?')})",
        f"- steps: {summary.get('steps_done', len(steps))} of {summary.get('steps', '?')}; "
        + (f"final loss {loss:.4f}" if isinstance(loss, float) else "final loss: none"),
        f"- tiles: {summary.get('tiles', 0)}, recomputed {summary.get('recomputed_tiles', 0)}, "
        f"re-queued {summary.get('requeued_tiles', 0)}, rejected {summary.get('rejected', 0)}",
        f"- payload: down {format_bytes(summary.get('bytes_down', 0))}, "
        f"up {format_bytes(summary.get('bytes_up', 0))}",
        f"- wall time {summary.get('wall_s', 0):.1f} s, time dilation "
        f"{summary.get('time_dilation', 1):.2f}",
        fidelity_line(summary),
        f"- network: {network.get('backend', '?')} (rate: {network.get('rate', '?')}, "
        f"delay: {network.get('delay', '?')}, loss: {network.get('loss', '?')})",
        "",
        *_planning_lines(steps, summary),
        "## Events",
        "",
        *(f"- {kind}: {n}" for kind, n in sorted(kinds.items(), key=lambda kv: str(kv[0]))),
        "",
        "![report](report.png)",
        "",
        *_real_devices(summary.get("real_devices") or {}),
    ]
    out = run_dir / "report.md"
    out.write_text("\n".join(lines))
    return out


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
    """Both report files."""
    return [plot(run_dir), markdown(run_dir)]


def _run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "steps.jsonl").exists():
        print(f"error: {run_dir}: no steps.jsonl here; is this a run directory?", file=sys.stderr)
        return EXIT_BAD_INPUT
    for path in make_report(run_dir):
        print(path)
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `testbed report`."""
    p = sub.add_parser("report", help="plots and a summary page for a run directory",
                       description="Write report.png and report.md into a run directory from "
                                   "its steps, events and summary.")
    p.add_argument("run_dir", help="the run directory")
    p.set_defaults(func=_run)
