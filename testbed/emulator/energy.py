"""Energy of an emulated device: compute, idle and radio power, and the carbon it implies.

Power model (watts), per device profile::

    P_busy(s) = idle_w + (active_w - idle_w) * s     while computing a tile at speed factor s
    P_idle    = idle_w                               while waiting for work
    P_radio   = radio_w                              while the radio sends or receives

* Compute energy of a tile: ``P_busy(s) * seconds`` (device seconds).
* Idle energy: ``idle_w * idle_seconds``.
* Radio energy: the radio is on while bytes move, so ``radio_w * 8 * size_bytes / rate_bps``;
  per byte that is ``radio_w * 8 / rate_bps`` J/B. With the HotCarbon'25 setting (Wi-Fi radio
  0.5 W, 10 MB/s links, arXiv 2507.01803) that is 0.5 / 10e6 = 50 nJ per byte. The run passes the
  device's own link rate for each direction.
* Carbon: ``grams = joules / 3.6e6 * grid_g_per_kwh``. The default grid intensity is a stated
  assumption (:data:`DEFAULT_GRID_G_PER_KWH`); a run should pass the one of its region.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from testbed.emulator.dilation import DeviceClock
from testbed.perf_model.profiles import WIFI_RADIO_W, PowerParams, load_profile

DEFAULT_GRID_G_PER_KWH = 475.0  # world-average electricity, gCO2e/kWh (IEA, 2019 figure)
J_PER_KWH = 3.6e6


def compute_joules(seconds: float, speed: float, power: PowerParams) -> float:
    """Energy of computing for `seconds` at speed factor s."""
    return power.busy_w(speed) * seconds


def idle_joules(idle_s: float, power: PowerParams) -> float:
    """Energy of waiting idle_s seconds."""
    return power.idle_w * max(0.0, idle_s)


def radio_joules_per_byte(rate_bps: float, radio_w: float = WIFI_RADIO_W) -> float:
    """J per byte moved over a link of rate_bps with the radio drawing radio_w."""
    if rate_bps <= 0:
        raise ValueError(f"rate_bps must be positive, got {rate_bps}")
    return radio_w * 8.0 / rate_bps


def radio_joules(size_bytes: float, rate_bps: float, radio_w: float = WIFI_RADIO_W) -> float:
    """Energy of moving size_bytes over a link of rate_bps."""
    return size_bytes * radio_joules_per_byte(rate_bps, radio_w)


def carbon_g(joules: float, grid_g_per_kwh: float = DEFAULT_GRID_G_PER_KWH) -> float:
    """Grams of CO2e for `joules` of electricity at the given grid intensity."""
    return joules / J_PER_KWH * grid_g_per_kwh


@dataclass
class EnergyAccount:
    """Running sums of one device's energy, by cause (joules)."""

    compute_j: float = 0.0
    idle_j: float = 0.0
    radio_j: float = 0.0
    tiles: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    bytes_moved: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def total_j(self) -> float:
        """All energy so far."""
        return self.compute_j + self.idle_j + self.radio_j

    def add_radio(self, size_bytes: float, rate_bps: float, radio_w: float = WIFI_RADIO_W) -> float:
        """Count radio energy for size_bytes over rate_bps; return the joules added."""
        joules = radio_joules(size_bytes, rate_bps, radio_w)
        self.radio_j += joules
        self.bytes_moved += size_bytes
        return joules

    def summary(self, grid_g_per_kwh: float = DEFAULT_GRID_G_PER_KWH) -> dict[str, float]:
        """Figures for devices.jsonl / summary.json, with the carbon they imply."""
        return {"compute_j": self.compute_j, "idle_j": self.idle_j, "radio_j": self.radio_j,
                "total_j": self.total_j, "tiles": float(self.tiles), "busy_s": self.busy_s,
                "idle_s": self.idle_s, "bytes_moved": self.bytes_moved,
                "grid_g_per_kwh": grid_g_per_kwh,
                "carbon_g": carbon_g(self.total_j, grid_g_per_kwh)}


def run_summary(devices: dict[str, EnergyAccount],
                grid_g_per_kwh: float = DEFAULT_GRID_G_PER_KWH) -> dict[str, Any]:
    """Per-device and whole-run energy and carbon, for summary.json."""
    per_device = {name: acc.summary(grid_g_per_kwh) for name, acc in devices.items()}
    total = {key: sum(d[key] for d in per_device.values())
             for key in ("compute_j", "idle_j", "radio_j", "total_j")}
    total["carbon_g"] = carbon_g(total["total_j"], grid_g_per_kwh)
    return {"grid_g_per_kwh": grid_g_per_kwh, "devices": per_device, "total": total}


def device_presence_s(events: list[dict[str, Any]], end_elapsed_s: float,
                      dilation: float = 1.0, from_event: str | None = None) -> dict[str, float]:
    """Device seconds each device was a member of the run, from events.jsonl.

    A device is present from its ``join`` to its ``leave``/``disconnect``/``lease_expired``
    (or the end of the run); a device that joins again adds its new stretch. Wall time becomes
    device time on a :class:`DeviceClock` that follows the PS's D: the one it started with (its
    ``ps_start`` record, else ``dilation``), the probe's choice and each change between steps
    (an adaptive run's). With ``from_event`` (``training_start``), only from that event on:
    what the devices spent waiting for each other, the probe and the planner is left out.
    """
    clock = DeviceClock(0.0, dilation)
    since: dict[str, float] = {}  # device seconds at each present device's join
    total: dict[str, float] = {}
    counting = from_event is None
    for e in events:
        name, kind, t = e.get("device"), e.get("event"), float(e.get("elapsed_s", 0.0))
        if kind == "ps_start" and e.get("time_dilation"):
            clock = DeviceClock(0.0, float(e["time_dilation"]))
        elif kind in ("dilation_probe", "dilation_change"):
            clock.set_dilation(float(e["chosen"] if kind == "dilation_probe" else e["new"]), t)
        elif kind == from_event and not counting:
            counting = True
            since = dict.fromkeys(since, clock.device_s(t))  # those present count from here
        elif not name:
            continue
        elif kind == "join":
            since.setdefault(name, clock.device_s(t))
        elif kind in ("leave", "disconnect", "lease_expired") and name in since:
            joined = since.pop(name)
            if counting:
                total[name] = total.get(name, 0.0) + clock.device_s(t) - joined
    if not counting:  # the event never came: nothing to count
        return {}
    end = clock.device_s(end_elapsed_s)
    for name, joined in since.items():
        total[name] = total.get(name, 0.0) + max(0.0, end - joined)
    return total


def run_energy(devices: list[dict[str, Any]], events: list[dict[str, Any]],
               power: dict[str, PowerParams | None], links: dict[str, tuple[float, float]],
               dilation: float, end_elapsed_s: float,
               grid_g_per_kwh: float = DEFAULT_GRID_G_PER_KWH,
               from_event: str | None = None) -> dict[str, Any]:
    """The run's energy per device and in total, from what the run recorded.

    ``devices`` are the PS's final device records (``compute_s`` and ``energy_j`` summed over
    the device's accepted tiles, ``bytes_down``/``bytes_up``); ``power`` and ``links`` (down, up
    bit/s) come from each device's profile and topology link. Per device:

    * compute: the tiles' own joules (the device model's ``P_busy(s)·seconds``);
    * idle: ``idle_w · (present device-seconds - compute seconds)``, present time from events;
    * radio: ``radio_w · 8 · bytes / rate`` for each direction.

    Devices without a power model are listed with ``null`` energy. ``from_event``: idle time
    from that event on only (:func:`device_presence_s`).
    """
    presence = device_presence_s(events, end_elapsed_s, dilation, from_event)
    accounts: dict[str, EnergyAccount] = {}
    merged: dict[str, dict[str, float]] = {}
    for d in devices:  # a device that rejoined has several records: add them up
        m = merged.setdefault(d["device"], {"compute_s": 0.0, "energy_j": 0.0, "tiles": 0,
                                            "bytes_down": 0, "bytes_up": 0})
        for key in m:
            m[key] += d.get(key if key != "tiles" else "tiles_done", 0) or 0
    no_model = []
    for name, m in merged.items():
        params = power.get(name)
        if params is None:
            no_model.append(name)
            continue
        down_bps, up_bps = links.get(name, (0.0, 0.0))
        acc = EnergyAccount(compute_j=m["energy_j"], tiles=int(m["tiles"]), busy_s=m["compute_s"])
        acc.idle_s = max(0.0, presence.get(name, 0.0) - m["compute_s"])
        acc.idle_j = idle_joules(acc.idle_s, params)
        if down_bps > 0:
            acc.add_radio(m["bytes_down"], down_bps, params.radio_w)
        if up_bps > 0:
            acc.add_radio(m["bytes_up"], up_bps, params.radio_w)
        accounts[name] = acc
    out = run_summary(accounts, grid_g_per_kwh)
    out["devices_without_power_model"] = sorted(no_model)
    return out


def topology_energy(topology: Any, devices: list[dict[str, Any]], events: list[dict[str, Any]],
                    dilation: float, grid_g_per_kwh: float = DEFAULT_GRID_G_PER_KWH,
                    from_event: str | None = None) -> dict[str, Any]:
    """run_energy with power models and link rates taken from a topology's devices."""
    power: dict[str, PowerParams | None] = {}
    links: dict[str, tuple[float, float]] = {}
    by_group = {g.group: load_profile(str(g.profile_path)).power for g in topology.groups}
    for spec in topology.devices:
        power[spec.name] = by_group[spec.group.group]
        links[spec.name] = (spec.link.down_bps, spec.link.up_bps)
    end = max((float(e.get("elapsed_s", 0.0)) for e in events), default=0.0)
    return run_energy(devices, events, power, links, dilation, end, grid_g_per_kwh, from_event)
