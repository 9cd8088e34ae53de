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


def fidelity_line(summary: dict[str, Any]) -> str:
    """The run's emulation fidelity: device-side tile-time error against its target."""
    p95 = summary.get("tile_error_p95")
    if not isinstance(p95, (int, float)):
        return "- emulation fidelity: no emulated tiles"
    target = summary.get("dilation_target_p95")
    verdict = "" if not isinstance(target, (int, float)) else \
        (f" (target {100 * target:.0f}%: " + ("met)" if p95 <= target else "**MISSED**)"))
    return (f"- emulation fidelity: tile-time error p50 "
            f"{100 * (summary.get('tile_error_p50') or 0):.1f}%, p95 {100 * p95:.1f}%{verdict}; "
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
        "## Events",
        "",
        *(f"- {kind}: {n}" for kind, n in sorted(kinds.items(), key=lambda kv: str(kv[0]))),
        "",
        "![report](report.png)",
        "",
    ]
    out = run_dir / "report.md"
    out.write_text("\n".join(lines))
    return out


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
