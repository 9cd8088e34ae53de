"""What ``testbed trace show`` prints and draws: pure text from a trace or schedule, one PNG.

The text summary needs no topology (rows by event, names used, time span); with a schedule (a
topology was given) it adds the starting state, device actions by event and device, and the
availability over time: at ``bins + 1`` evenly spaced times from 0 to the last action (one, 0,
when every action is at 0), the devices present and the devices present and reachable (not
partitioned). The plot is a timeline, one row per device (present: bar, partitioned: hatched
red, crash: x, slow: its factor), over the availability curve.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Sequence

from testbed.churn.schedule import ChurnSchedule
from testbed.churn.trace import EVENT_NAMES, ChurnEvent, Trace
from testbed.user_paths import written_whole


def _time_grid(end_s: float, bins: int) -> list[float]:
    """``bins + 1`` evenly spaced times from 0 to the last action, the span the trace's header
    line states (a floor of 1 s ran the rows to t=1.0 s under a header of "0 .. 0 s"); one, 0,
    when every action is at 0."""
    if end_s <= 0:
        return [0.0]
    return [end_s * i / bins for i in range(bins + 1)]


def _time_digits(times_s: list[float]) -> int:
    """Decimals that tell the grid's times apart: one, up to three (a trace row's millisecond)
    for a grid finer than a tenth of a second."""
    step_s = times_s[1] - times_s[0] if len(times_s) > 1 else 1.0
    return 1 if step_s >= 0.1 else min(3, math.ceil(-math.log10(step_s)))


NAMES_LISTED = 12  # more names than this are counted per name stem (group-N)
# an availability bar has a character per device up to this many, then a share each: a
# thousand devices printed lines a thousand characters wide
BAR_WIDTH = 64


def names_used(names: list[str]) -> str:
    """The names a trace uses: each, when few; else how many, and per stem (a device name's
    group, ``phones`` of ``phones-42``) how many and from which number to which: a trace of a
    thousand devices printed ten kilobytes of names on one line."""
    if len(names) <= NAMES_LISTED:
        return ", ".join(names) or "none"
    stems: dict[str, list[int]] = {}
    bare: list[str] = []
    for name in names:
        stem, _, number = name.rpartition("-")
        if stem and number.isascii() and number.isdigit():
            stems.setdefault(stem, []).append(int(number))
        else:
            bare.append(name)
    parts = [f"{stem}-{min(ns)} .. {stem}-{max(ns)}: {len(ns):,}" for stem, ns in stems.items()]
    parts += bare[:NAMES_LISTED] + ([f"{len(bare) - NAMES_LISTED:,} more"]
                                     if len(bare) > NAMES_LISTED else [])
    return f"{len(names):,} ({'; '.join(parts)})"


def _seconds(time_s: float) -> str:
    """A trace time to its millisecond, as its rows hold it (``:g`` kept six digits: a trace
    whose last row is at 172299.919 s said ``0 .. 172300 s``)."""
    return f"{time_s:,.3f}".rstrip("0").rstrip(".")


def trace_summary(trace: Trace) -> list[str]:
    """Lines describing a trace on its own (no topology needed)."""
    counts = Counter(e.event.value for e in trace.events)
    return [
        f"trace {trace.source}: {len(trace.events)} event{'' if len(trace.events) == 1 else 's'}, "
        f"0 .. {_seconds(trace.duration_s)} s",
        "rows by event: " + ", ".join(f"{name} {counts.get(name, 0)}" for name in EVENT_NAMES),
        "names used: " + names_used(trace.targets()),
    ]


def schedule_summary(schedule: ChurnSchedule, bins: int = 10) -> list[str]:
    """Lines describing the expanded schedule: starting state, actions, availability."""
    n = len(schedule.devices)
    absent = [d for d in schedule.devices if d not in schedule.initially_present]
    lines = [
        f"devices: {n} ({', '.join(f'{g} {len(m)}' for g, m in schedule.groups.items())}); "
        f"picks seeded with {schedule.seed} (which devices a row such as phones:2 takes)",
        f"starts present: {n - len(absent)} of {n}" +
        (f" (absent: {names_used(absent)})" if absent else ""),
        "device actions by event: " + ", ".join(f"{k} {v}" for k, v in
                                                 schedule.counts_by_event().items()),
    ]
    per_device = Counter((a.device, a.event.value) for a in schedule.actions)
    touched = [d for d in schedule.devices if any(per_device[(d, e)] for e in EVENT_NAMES)]
    if len(touched) <= NAMES_LISTED:
        for d in touched:
            lines.append(f"  {d:<14} " + " ".join(f"{e} {per_device[(d, e)]}"
                                                  for e in EVENT_NAMES if per_device[(d, e)]))
    else:  # per group: ten thousand devices printed ten thousand lines
        touched_set = set(touched)
        for group, members in schedule.groups.items():
            counts = Counter({e: sum(per_device[(d, e)] for d in members) for e in EVENT_NAMES})
            hit = sum(1 for d in members if d in touched_set)
            if hit:
                lines.append(f"  {group:<14} {hit:,} of {len(members):,} devices: " +
                             " ".join(f"{e} {counts[e]:,}" for e in EVENT_NAMES if counts[e]))
    if n > BAR_WIDTH:
        bar_key = f"a bar character is {n / BAR_WIDTH:.3g} devices"
    else:
        bar_key = f"bar: {schedule.devices[0]} .. {schedule.devices[-1]}" if n else "bar"
    lines.append(f"availability over time (present / reachable of {n}; {bar_key}, # present, "
                 "+ partitioned, . absent):")
    times = _time_grid(schedule.duration_s, bins)
    digits = _time_digits(times)
    if n <= BAR_WIDTH:  # which devices: a character each
        rows = [(sum(p for p, _ in states), sum(p and not cut for p, cut in states),
                 _device_bar(states)) for states in schedule.device_states(times)]
    else:  # how many: a thousand devices' states at a thousand times are ten million tuples
        rows = [(present, reachable, _share_bar(n, present, reachable))
                for present, reachable in schedule.availability(times)]
    for t, (present, reachable, bar) in zip(times, rows):
        lines.append(f"  t={t:>9.{digits}f} s  {present:>3} {reachable:>3}  {bar}")
    stall = stall_note(schedule)
    if stall:
        lines.append(f"note: {stall}")
    return lines


def stall_note(schedule: ChurnSchedule) -> str | None:
    """What a run under the schedule meets if it trains past the time every device is gone or
    cut off for good, or None: the trace passed every check and the run stalled there."""
    since = schedule.unreachable_for_good_s()
    if since is None:
        return None
    return (f"from t={_seconds(since)} s on no device is present and reachable and none comes "
            "back: a run still training then stalls, and testbed up and testbed simulate fail "
            "when the PS's progress watchdog fires (job.watchdog.no_progress_s after)")


def _device_bar(states: Sequence[tuple[bool, bool]]) -> str:
    """A character per device in topology order: ``#`` present and reachable, ``+`` present but
    partitioned, ``.`` absent (``......##``: only the last two devices are there)."""
    return "".join(("+" if cut else "#") if present else "." for present, cut in states)


def _share_bar(n: int, present: int, reachable: int) -> str:
    """Past :data:`BAR_WIDTH` devices, that many characters in proportion (rounded): the
    reachable share as ``#``, then the partitioned ``+``, then the absent ``.``."""
    reachable, present = (round(x * BAR_WIDTH / n) for x in (reachable, present))
    return "#" * reachable + "+" * (present - reachable) + "." * (BAR_WIDTH - present)


def plot_timeline(schedule: ChurnSchedule, path: str | Path, title: str = "") -> None:
    """Draw the per-device timeline and the availability curve into a PNG file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end_s = max(schedule.duration_s * 1.05, 1.0)
    intervals = schedule.intervals(end_s)
    devices = list(schedule.devices)
    height = 1.5 + 0.3 * len(devices)
    fig, (ax, ax_avail) = plt.subplots(2, 1, figsize=(10, height + 2.5), sharex=True,
                                       gridspec_kw={"height_ratios": [height, 2.5]})
    for row, d in enumerate(devices):
        y = len(devices) - 1 - row
        spans = [(lo, hi - lo) for lo, hi in intervals[d]["present"]]
        ax.broken_barh(spans, (y - 0.35, 0.7), facecolors="tab:green", alpha=0.8)
        cut = [(lo, hi - lo) for lo, hi in intervals[d]["partitioned"]]
        ax.broken_barh(cut, (y - 0.35, 0.7), facecolors="none", edgecolors="tab:red",
                       hatch="///")
    ys = {d: len(devices) - 1 - i for i, d in enumerate(devices)}
    crashes = [(a.time_s, ys[a.device]) for a in schedule.actions if a.event is ChurnEvent.CRASH]
    if crashes:
        ax.scatter(*zip(*crashes), marker="x", color="black", zorder=3, label="crash")
        ax.legend(loc="upper right", fontsize="small")
    for a in schedule.actions:
        if a.event is ChurnEvent.SLOW:
            ax.plot([a.time_s, a.time_s], [ys[a.device] - 0.35, ys[a.device] + 0.35],
                    color="tab:orange", linewidth=2)
            ax.annotate(f" slow ×{a.factor:g}", (a.time_s, ys[a.device]), fontsize=8,
                        va="center", color="black")
    ax.set_yticks(range(len(devices)), list(reversed(devices)), fontsize=8)
    ax.set_title(title or f"churn: {Path(schedule.source).name} (seed {schedule.seed})")
    times = sorted({0.0, end_s, *(a.time_s for a in schedule.actions)})
    avail = schedule.availability(times)
    ax_avail.step(times, [p for p, _ in avail], where="post", label="present")
    ax_avail.step(times, [r for _, r in avail], where="post", label="reachable",
                  linestyle="--")
    ax_avail.set_ylim(0, len(devices) + 0.5)
    ax_avail.set_ylabel("devices")
    ax_avail.set_xlabel("time (s)")
    ax_avail.legend(loc="lower left", fontsize="small")
    fig.tight_layout()
    with written_whole(Path(path), binary=True) as handle:
        fig.savefig(handle, format="png", dpi=100)
    plt.close(fig)
