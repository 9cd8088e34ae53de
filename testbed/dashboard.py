"""The live view of a run: pure render functions over a status snapshot, plus a thin Live loop.

The PS writes ``status.json`` (see :mod:`testbed.runlog`) about twice a second; ``testbed up``
reads it and renders it here. Rendering never touches the run, so it is tested by rendering a
snapshot into a console that writes to a string.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from testbed.runlog import device_group
from testbed.units import format_bytes

STATE_STYLE = {"busy": "green", "idle": "yellow", "left": "red", "partitioned": "magenta",
               "quarantined": "bold red"}
MAX_DEVICE_ROWS = 40


def render_header(snapshot: dict[str, Any], title: str = "") -> RenderableType:
    """One line: state, step, loss, tile rate, bytes each way, queue."""
    loss = snapshot.get("loss")
    loss_text = f"{loss:.4f}" if isinstance(loss, (int, float)) else "-"
    parts = [
        f"[bold]{title}[/bold]" if title else "",
        f"state [cyan]{snapshot.get('state', '?')}[/cyan]",
        f"step {snapshot.get('step', 0)}/{snapshot.get('steps', '?')}",
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
    if snapshot.get("sat_out"):  # groups the planner left out, and why
        parts.append("sat out " + "; ".join(f"{g}: {w}" for g, w in snapshot["sat_out"].items()))
    return Text.from_markup("  ".join(p for p in parts if p))


def _seconds(value: Any) -> str:
    return f"{value * 1e3:.0f} ms" if isinstance(value, (int, float)) else "-"


def render_faults(snapshot: dict[str, Any]) -> RenderableType | None:
    """One line of fault-tolerance figures; None before the PS reports any."""
    if "recoveries" not in snapshot:
        return None
    goodput = snapshot.get("goodput")
    overhead = snapshot.get("validation_overhead_cpu")
    quarantined = snapshot.get("quarantined") or []
    parts = [
        f"recovery p50 {_seconds(snapshot.get('recovery_p50_s'))} "
        f"p95 {_seconds(snapshot.get('recovery_p95_s'))} ({snapshot.get('recoveries', 0)})",
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
    return Text.from_markup("  ".join(parts))


def _short_bytes(size_bytes: float) -> str:
    """Bytes in at most six characters (``786k``, ``1.6M``, ``249M``, ``3.1G``)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if size_bytes >= scale:
            value = size_bytes / scale
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return f"{size_bytes:.0f}"


def render_devices(devices: list[dict[str, Any]]) -> RenderableType:
    """A table of devices: state, tiles done, in flight, bytes, speed, telemetry.

    Compact enough for an 80-column terminal; the device name carries its group. Past
    ``MAX_DEVICE_ROWS`` devices (large.yaml has 240) a row per group instead
    (:func:`render_groups`): the first forty names would hide most of the run.
    """
    if len(devices) > MAX_DEVICE_ROWS:
        return render_groups(devices)
    table = _device_table("device")
    for d in sorted(devices, key=lambda d: str(d.get("device", ""))):
        state = d.get("state", "?")
        telemetry = d.get("telemetry") or {}
        temp = telemetry.get("temperature_c")
        table.add_row(str(d.get("device", "?")),
                      f"[{STATE_STYLE.get(state, 'white')}]{state}[/]",
                      str(d.get("tiles_done", 0)), str(d.get("in_flight", 0)),
                      _short_bytes(d.get("bytes_down", 0)), _short_bytes(d.get("bytes_up", 0)),
                      f"{d.get('observed_gflops', 0):.1f}",
                      f"{temp:.1f}" if isinstance(temp, (int, float)) else "-",
                      f"{d.get('energy_j', 0):.1f}")
    return table


def _device_table(first: str) -> Table:
    table = Table(expand=False, box=None, header_style="bold", pad_edge=False)
    for column in (first, "state", "tiles", "flight", "down", "up", "GFLOPS", "°C",
                   "energy J"):
        table.add_column(column, justify="left" if column in (first, "state") else "right",
                         no_wrap=True)
    return table


def render_groups(devices: list[dict[str, Any]]) -> RenderableType:
    """One row per device group: how many are in each state, and the group's tiles, tiles in
    flight, bytes and energy summed, its mean observed speed and its hottest device."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for d in devices:
        groups.setdefault(device_group(d), []).append(d)
    table = _device_table("group")
    for group, members in sorted(groups.items()):
        states = Counter(str(d.get("state", "?")) for d in members)
        temps = [t for d in members
                 if isinstance(t := (d.get("telemetry") or {}).get("temperature_c"), (int, float))]
        table.add_row(f"{group} ({len(members)})",
                      " ".join(f"[{STATE_STYLE.get(k, 'white')}]{n} {k}[/]"
                               for k, n in sorted(states.items())),
                      str(sum(d.get("tiles_done", 0) for d in members)),
                      str(sum(d.get("in_flight", 0) for d in members)),
                      _short_bytes(sum(d.get("bytes_down", 0) for d in members)),
                      _short_bytes(sum(d.get("bytes_up", 0) for d in members)),
                      f"{sum(d.get('observed_gflops', 0) for d in members) / len(members):.1f}",
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


def render(snapshot: dict[str, Any], title: str = "", notes: list[str] | None = None
           ) -> RenderableType:
    """The whole live view for one snapshot."""
    parts: list[RenderableType] = [render_header(snapshot, title),
                                   render_losses(snapshot.get("losses") or [])]
    faults = render_faults(snapshot)
    if faults is not None:
        parts.append(faults)
    parts.append(render_devices(snapshot.get("devices") or []))
    for note in (notes or [])[-5:]:
        parts.append(Text(note, style="dim"))
    return Panel(Group(*parts), title="testbed", border_style="blue")
