"""The live view of a run: pure render functions over a status snapshot, plus a thin Live loop.

The PS writes ``status.json`` (see :mod:`testbed.runlog`) about twice a second; ``testbed up``
reads it and renders it here. Rendering never touches the run, so it is tested by rendering a
snapshot into a console that writes to a string.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from testbed.runlog import device_group, name_order
from testbed.summary import SAT_OUT_PART, SAT_OUT_WHY
from testbed.units import format_bytes

STATE_STYLE = {"busy": "green", "idle": "yellow", "left": "red", "partitioned": "magenta",
               "quarantined": "bold red", "sat out": "dim"}
MAX_DEVICE_ROWS = 40
VIEW_LINES_BESIDE_DEVICES = 14  # the panel's border, header, losses, faults, sat-out and notes


def device_rows_for(height: int) -> int:
    """How many device rows a terminal of ``height`` lines shows whole beside the rest of the
    view (at most MAX_DEVICE_ROWS): campus's 32 rows on a 30-line terminal ran off its foot."""
    return max(4, min(MAX_DEVICE_ROWS, height - VIEW_LINES_BESIDE_DEVICES))


class Packed:
    """Short labelled figures (``"tiles 904 (81/s)"``) laid out on as many lines as the width
    needs, two spaces apart: a line breaks between figures, never inside one, so a label is
    never on another line than its value (``"tile err p50"`` at the end of one line and its
    ``"0.0%"`` at the start of the next, as an 80-column terminal showed them)."""

    def __init__(self, parts: list[Text]):
        self.parts = parts

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        line = Text()
        for part in self.parts:
            if line.cell_len and line.cell_len + 2 + part.cell_len > width:
                yield line
                line = Text()
            if line.cell_len:
                line.append("  ")
            line.append_text(part)  # a part wider than the line wraps on its own
        if line.cell_len:
            yield line


def render_header(snapshot: dict[str, Any], title: str = "") -> RenderableType:
    """State, steps done, the last step's loss, tile rate, bytes each way, queue, and the last
    step's efficiency, time dilation and fidelity: short labelled figures, packed on as few
    lines as the terminal's width allows (:class:`Packed`)."""
    loss = snapshot.get("loss")
    loss_text = f"{loss:.4f}" if isinstance(loss, (int, float)) else "-"
    parts = [
        f"[bold]{title}[/bold]" if title else "",
        f"state [cyan]{snapshot.get('state', '?')}[/cyan]",
        # steps done: steps.jsonl and the step lines count steps from 0, so "step 1/2" beside
        # step 0's loss read as the second step under way
        f"steps done {snapshot.get('step', 0)}/{snapshot.get('steps', '?')}",
        f"loss [bold]{loss_text}[/bold]",
        f"tiles {snapshot.get('tiles', 0)} ({snapshot.get('tiles_per_s', 0):.0f}/s)",
        f"down {format_bytes(snapshot.get('bytes_down', 0))}",
        f"up {format_bytes(snapshot.get('bytes_up', 0))}",
        f"queued {snapshot.get('pending', 0)}",
        f"requeued {snapshot.get('requeued', 0)}",
        f"rejected {snapshot.get('rejected', 0)}",
    ]
    if isinstance(snapshot.get("efficiency"), (int, float)):  # bound / device time, last step
        parts.append(f"eff {snapshot['efficiency']:.2f}")
    if isinstance(snapshot.get("time_dilation"), (int, float)):
        parts.append(f"D {snapshot['time_dilation']:.2f}")
    if isinstance(snapshot.get("tile_error_p95"), (int, float)):  # last step, device side
        parts.append(f"tile err p50 {100 * (snapshot.get('tile_error_p50') or 0):.1f}% "
                     f"p95 {100 * snapshot['tile_error_p95']:.1f}%")
    if isinstance(snapshot.get("lateness_share"), (int, float)):  # the verdict's figure
        parts.append(f"late <= {100 * snapshot['lateness_share']:.1f}% of the step")
    return Packed([Text.from_markup(p) for p in parts if p])


def render_sat_out(sat_out: Any) -> RenderableType | None:
    """The groups the planner left out of the last step, why, and what the reasons mean; None
    when none sat out. A reason's ``(N of M)``: N of the group's M devices sat out."""
    if not isinstance(sat_out, dict) or not sat_out:
        return None
    parts = [Text("sat out (planner, last step):", style="bold")]
    parts += [Text(f"{g}: {w}" + (";" if i < len(sat_out) - 1 else ""))
              for i, (g, w) in enumerate(sat_out.items())]
    said = {"PS link" if str(w).startswith("PS link") else str(w).split(" ")[0]
            for w in sat_out.values()}
    legend = [f"{k}: {why}" for k, why in SAT_OUT_WHY.items() if k in said]
    if any(re.search(r"\(\d+ of \d+\)", str(w)) for w in sat_out.values()):
        legend.append(f"(N of M): {SAT_OUT_PART}")
    parts += [Text(f"{entry}" + (";" if i < len(legend) - 1 else ""), style="dim")
              for i, entry in enumerate(legend)]  # each whole on its line
    return Packed(parts)


def _seconds(value: Any) -> str:
    return f"{value * 1e3:.0f} ms" if isinstance(value, (int, float)) else "-"


def render_faults(snapshot: dict[str, Any]) -> RenderableType | None:
    """One line of fault-tolerance figures; None before the PS reports any."""
    if "recoveries" not in snapshot:
        return None
    goodput = snapshot.get("goodput")
    overhead = snapshot.get("validation_overhead_cpu")
    quarantined = snapshot.get("quarantined") or []
    recoveries = snapshot.get("recoveries", 0)
    parts = [  # "recovery p50 - p95 - (0)" left the count in brackets unnamed
        f"recoveries {recoveries}" + (
            f": p50 {_seconds(snapshot.get('recovery_p50_s'))} "
            f"p95 {_seconds(snapshot.get('recovery_p95_s'))}" if recoveries else ""),
        f"recomputed {snapshot.get('recomputed_tiles', 0)}",
        f"backups {snapshot.get('backup_wins', 0)}/{snapshot.get('backups', 0)} won",
        f"goodput {goodput * 100:.1f}%" if isinstance(goodput, (int, float)) else "goodput -",
        f"checks {snapshot.get('checks', 0)} failed {snapshot.get('failed_checks', 0)}",
        f"validation {overhead * 100:.2f}% CPU" if isinstance(overhead, (int, float))
        else "validation -",
        f"ledger reused {snapshot.get('tiles_from_ledger', 0)}",
    ]
    if quarantined:
        parts.append(f"[bold red]quarantined {', '.join(quarantined)}[/]")
    return Packed([Text.from_markup(p) for p in parts])


def _short_bytes(size_bytes: float) -> str:
    """Bytes in at most five characters (``786k``, ``1.6M``, ``249M``, ``3.1G``): one decimal
    below 10 of a unit, none from 10 on, judged on the rounded figure (9.96 MB is ``10M``,
    not ``10.0M``), and the next unit from 999.5 of one on (``1.0M``, not ``1000k``)."""
    units = (("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1.0))
    for i, (unit, scale) in enumerate(units):
        if size_bytes >= scale * (1 - 5e-4) or not unit:
            value = size_bytes / scale
            if i and round(value) >= 1000:  # 999.7k rounds to 1000k: say 1.0M
                unit, value = units[i - 1][0], value / 1000
            return f"{value:.1f}{unit}" if round(value, 1) < 10 and unit else \
                f"{value:.0f}{unit}"
    return f"{size_bytes:.0f}"


def _sits_out(d: dict[str, Any], sat_out: dict[str, Any]) -> bool:
    """Whether a device is one the planner left out: idle, of a group that sat out the last
    step, and no tile done (a group that sat out in part has its computing devices too)."""
    return d.get("state") == "idle" and device_group(d) in sat_out \
        and not d.get("tiles_done") and not d.get("in_flight")


def _gflops(d: dict[str, Any]) -> str:
    """The speed the PS observed, or ``-`` before the device's first tile (the PS's figure is
    then its profile's prediction, not an observation)."""
    gflops = d.get("observed_gflops")
    return f"{gflops:.1f}" if d.get("tiles_done") and isinstance(gflops, (int, float)) else "-"


def render_devices(devices: list[dict[str, Any]], sat_out: dict[str, Any] | None = None,
                   max_rows: int = MAX_DEVICE_ROWS) -> RenderableType:
    """A table of devices: state, tiles done, in flight, bytes, observed speed, temperature and
    compute energy (``comp J``: the tiles' joules; the report's device energy adds idle and
    radio energy to it).

    Compact enough for an 80-column terminal; the device name carries its group. An idle
    device with no tile of a group the planner left out of the last step (``sat_out``) reads
    ``sat out``. Past ``max_rows`` devices (large.yaml has 240; a short terminal shows fewer:
    :func:`device_rows_for`) a row per group instead (:func:`render_groups`): the first forty
    names would hide most of the run.
    """
    sat_out = sat_out if isinstance(sat_out, dict) else {}
    if len(devices) > max_rows:
        return render_groups(devices, sat_out)
    table = _device_table("device")
    for d in sorted(devices, key=lambda d: name_order(str(d.get("device", "")))):
        state = "sat out" if _sits_out(d, sat_out) else d.get("state", "?")
        telemetry = d.get("telemetry") or {}
        temp = telemetry.get("temperature_c")
        table.add_row(str(d.get("device", "?")),
                      f"[{STATE_STYLE.get(state, 'white')}]{state}[/]",
                      str(d.get("tiles_done", 0)), str(d.get("in_flight", 0)),
                      _short_bytes(d.get("bytes_down", 0)), _short_bytes(d.get("bytes_up", 0)),
                      _gflops(d),
                      f"{temp:.1f}" if isinstance(temp, (int, float)) else "-",
                      f"{d.get('energy_j', 0):.1f}")
    return table


def _device_table(first: str) -> Table:
    table = Table(expand=False, box=None, header_style="bold", pad_edge=False)
    for column in (first, "state", "tiles", "flight", "down", "up", "GFLOPS", "°C",
                   "comp J"):
        table.add_column(column, justify="left" if column in (first, "state") else "right",
                         no_wrap=True)
    return table


def render_groups(devices: list[dict[str, Any]],
                  sat_out: dict[str, Any] | None = None) -> RenderableType:
    """One row per device group: how many are in each state (``sat out`` as in
    :func:`render_devices`), and the group's tiles, tiles in flight, bytes and compute energy
    summed, the mean observed speed of its devices that computed, and its hottest device."""
    sat_out = sat_out if isinstance(sat_out, dict) else {}
    groups: dict[str, list[dict[str, Any]]] = {}
    for d in devices:
        groups.setdefault(device_group(d), []).append(d)
    table = _device_table("group")
    for group, members in sorted(groups.items(), key=lambda kv: name_order(kv[0])):
        states = Counter("sat out" if _sits_out(d, sat_out) else str(d.get("state", "?"))
                         for d in members)
        temps = [t for d in members
                 if isinstance(t := (d.get("telemetry") or {}).get("temperature_c"), (int, float))]
        speeds = [d["observed_gflops"] for d in members if d.get("tiles_done")
                  and isinstance(d.get("observed_gflops"), (int, float))]
        table.add_row(f"{group} ({len(members)})",
                      " ".join(f"[{STATE_STYLE.get(k, 'white')}]{n} {k}[/]"
                               for k, n in sorted(states.items())),
                      str(sum(d.get("tiles_done", 0) for d in members)),
                      str(sum(d.get("in_flight", 0) for d in members)),
                      _short_bytes(sum(d.get("bytes_down", 0) for d in members)),
                      _short_bytes(sum(d.get("bytes_up", 0) for d in members)),
                      f"{sum(speeds) / len(speeds):.1f}" if speeds else "-",
                      f"{max(temps):.1f}" if temps else "-",
                      f"{sum(d.get('energy_j', 0) for d in members):.1f}")
    return table


def render_losses(losses: list[float], width: int = 60) -> RenderableType:
    """A one-line sparkline of the recent losses."""
    if not losses:
        return Text("loss: no step finished yet", style="dim")
    recent = losses[-width:]
    lo, hi = min(recent), max(recent)
    bars = "▁▂▃▄▅▆▇█"
    span = (hi - lo) or 1.0
    line = "".join(bars[min(7, int((v - lo) / span * 7.999))] for v in recent)
    return Text(f"loss {recent[0]:.3f} {line} {recent[-1]:.3f}")


def render(snapshot: dict[str, Any], title: str = "", notes: list[str] | None = None,
           max_rows: int = MAX_DEVICE_ROWS) -> RenderableType:
    """The whole live view for one snapshot; ``max_rows``: device rows at most, past which a
    row per group (:func:`device_rows_for` of the terminal's height)."""
    parts: list[RenderableType] = [render_header(snapshot, title),
                                   render_losses(snapshot.get("losses") or [])]
    faults = render_faults(snapshot)
    if faults is not None:
        parts.append(faults)
    sat_out = render_sat_out(snapshot.get("sat_out"))
    if sat_out is not None:
        parts.append(sat_out)
    parts.append(render_devices(snapshot.get("devices") or [], snapshot.get("sat_out"),
                                max_rows))
    for note in (notes or [])[-5:]:
        parts.append(Text(note, style="dim"))
    return Panel(Group(*parts), title="testbed", border_style="blue")
