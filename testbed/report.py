"""The run report: plots and a short Markdown page made from a run directory's files.

``testbed report RUN_DIR`` (and ``testbed up`` when a run ends) reads ``steps.jsonl``,
``events.jsonl`` and ``summary.json`` and writes:

* ``report.png``: loss per step; step wall time (and device time when dilated); bytes each way
  per step; tiles done per device, with departures marked;
* ``report.md``: the headline figures, the network mechanism, and the events by kind.

It reads only what the run wrote, so it works on a finished, failed or interrupted run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from testbed.runlog import read_jsonl
from testbed.units import format_bytes


def _load(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return read_jsonl(run_dir / "steps.jsonl"), read_jsonl(run_dir / "events.jsonl"), summary


def plot(run_dir: Path) -> Path:
    """Draw report.png for a run directory; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, events, summary = _load(run_dir)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ax_loss, ax_time), (ax_bytes, ax_dev) = axes
    x = [s["step"] for s in steps]
    ax_loss.plot(x, [s["loss"] for s in steps], marker=".")
    ax_loss.set(title="loss", xlabel="step", ylabel="cross-entropy (nats)")
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
    ax_time.set(title="step time", xlabel="step", ylabel="s")
    ax_time.legend(loc="upper left")
    fid = [(s["step"], s["tile_error_p95"], s.get("time_dilation")) for s in steps
           if isinstance(s.get("tile_error_p95"), (int, float))]
    if fid:  # fidelity per step on a second axis: p95 tile-time error and D
        ax_err = ax_time.twinx()
        ax_err.plot([f[0] for f in fid], [100 * f[1] for f in fid], color="tab:red",
                    linestyle="--", label="p95 tile error %")
        ax_err.plot([f[0] for f in fid], [f[2] or 1 for f in fid], color="tab:gray",
                    linestyle=":", label="time dilation D")
        ax_err.set(ylabel="% / D")
        ax_err.legend(loc="upper right")
    ax_bytes.plot(x, [s["bytes_down"] / 1e6 for s in steps], label="down (PS to devices)")
    ax_bytes.plot(x, [s["bytes_up"] / 1e6 for s in steps], label="up (devices to PS)")
    ax_bytes.set(title="payload per step", xlabel="step", ylabel="MB")
    ax_bytes.legend()
    devices = summary.get("devices") or []
    tiles: Counter[str] = Counter()
    for d in devices:
        tiles[d["device"]] += d.get("tiles_done", 0)
    names = sorted(tiles)
    ax_dev.barh(names, [tiles[n] for n in names])
    departed = {e.get("device") for e in events
                if e.get("event") in ("leave", "disconnect", "lease_expired")}
    for label in ax_dev.get_yticklabels():
        if label.get_text() in departed:
            label.set_color("red")
    ax_dev.set(title="tiles per device (red: departed at least once)", xlabel="tiles")
    fig.suptitle(f"{run_dir.name}: {summary.get('state', '?')}, "
                 f"{summary.get('steps_done', len(steps))} steps")
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


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
                  "than computing it; `speed`: too slow to shorten the GEMM):", ""]
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
        f"; late tiles can account for up to {100 * share:.1f}% of a step's device time"
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
        f"final loss {loss:.4f}" if isinstance(loss, float) else "- final loss: none",
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
        return 2
    for path in make_report(run_dir):
        print(path)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `testbed report`."""
    p = sub.add_parser("report", help="plots and a summary page for a run directory",
                       description="Write report.png and report.md into a run directory from "
                                   "its steps, events and summary.")
    p.add_argument("run_dir", help="the run directory")
    p.set_defaults(func=_run)
