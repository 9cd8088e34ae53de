"""The topology's ``adb:`` section: schema, validation, and the frozen spec the bridge reads.

Schema (units written out, see :mod:`testbed.units`)::

    adb:
      enabled: true              # default false: no bridge unless asked
      server: 127.0.0.1:5037     # the adb server to follow (host:port)
      serials: all               # 'all', or a list of serials to take (others are ignored)
      profile: auto              # auto (by SoC) | measured (live) | a profile name
      phone_port: 7700           # port the agent dials on the phone (adb reverse source)
      telemetry_interval: 2s     # how often battery/thermal/cpufreq are polled
      link: {down: 100Mbit, up: 20Mbit, delay: 10ms}   # shaping in the phone's relay (optional)

``link.down`` is PS -> phone, ``link.up`` phone -> PS. ``loss`` is refused: the relay carries a
TCP byte stream, where a lost packet is only ever a retransmission delay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from testbed import units
from testbed.adb_bridge.relay import RelayShaping

Problems = list[tuple[str, str]]
_KEYS = ("enabled", "server", "serials", "profile", "phone_port", "telemetry_interval", "link")
_LINK_KEYS = ("down", "up", "delay")


@dataclass(frozen=True)
class AdbSpec:
    """The validated ``adb:`` section."""

    enabled: bool = False
    server_host: str = "127.0.0.1"
    server_port: int = 5037
    serials: tuple[str, ...] | None = None  # None = every phone
    profile: str = "auto"
    phone_port: int = 7700
    telemetry_interval_s: float = 2.0
    shaping: RelayShaping = RelayShaping()


def validate_adb_section(raw: Any, path: str = "adb") -> tuple[AdbSpec, Problems]:
    """Check an ``adb:`` section; return the spec and every problem as (yaml_path, message)."""
    problems: Problems = []
    if raw is None:
        return AdbSpec(), problems
    if not isinstance(raw, dict):
        return AdbSpec(), [(path, f"expected a mapping, got {type(raw).__name__}")]
    for key in raw:
        if key not in _KEYS:
            problems.append((f"{path}.{key}", f"unknown key (expected one of: "
                                              f"{', '.join(_KEYS)})"))
    spec = AdbSpec()
    enabled = raw.get("enabled", False)
    if not isinstance(enabled, bool):
        problems.append((f"{path}.enabled", f"expected true or false, got {enabled!r}"))
        enabled = False
    host, port = _server(raw.get("server", "127.0.0.1:5037"), f"{path}.server", problems)
    serials = _serials(raw.get("serials", "all"), f"{path}.serials", problems)
    profile = raw.get("profile", "auto")
    if not isinstance(profile, str) or not profile:
        problems.append((f"{path}.profile", f"expected auto, measured or a profile name, got "
                                            f"{profile!r}"))
        profile = "auto"
    elif profile not in ("auto", "measured"):
        from testbed.perf_model.profiles import find_profile, list_profiles
        if find_profile(profile) is None:
            problems.append((f"{path}.profile", f"no device profile named {profile!r}; expected "
                                                f"auto, measured or one of "
                                                f"{', '.join(list_profiles())}"))
    phone_port = raw.get("phone_port", 7700)
    if isinstance(phone_port, bool) or not isinstance(phone_port, int) or \
            not 1 <= phone_port <= 65535:
        problems.append((f"{path}.phone_port", f"expected a TCP port 1..65535, got "
                                               f"{phone_port!r}"))
        phone_port = 7700
    interval_s = spec.telemetry_interval_s
    if "telemetry_interval" in raw:
        try:
            interval_s = units.parse_duration_s(raw["telemetry_interval"])
            if interval_s < 0.1:
                problems.append((f"{path}.telemetry_interval", f"must be at least 100ms, got "
                                                               f"{raw['telemetry_interval']!r}"))
                interval_s = spec.telemetry_interval_s
        except units.UnitError as exc:
            problems.append((f"{path}.telemetry_interval", str(exc)))
    shaping = _link(raw.get("link"), f"{path}.link", problems)
    return AdbSpec(enabled, host, port, serials, profile, phone_port, interval_s,
                   shaping), problems


def _server(value: Any, path: str, problems: Problems) -> tuple[str, int]:
    host, _, port = str(value).rpartition(":")
    if not isinstance(value, str) or not host or not port.isdigit() or \
            not 1 <= int(port) <= 65535:
        problems.append((path, f"expected HOST:PORT such as '127.0.0.1:5037', got {value!r}"))
        return "127.0.0.1", 5037
    return host, int(port)


def _serials(value: Any, path: str, problems: Problems) -> tuple[str, ...] | None:
    if value == "all":
        return None
    if not isinstance(value, list) or not value:
        problems.append((path, f"expected 'all' or a non-empty list of serials, got {value!r}"))
        return None
    out: list[str] = []
    for i, serial in enumerate(value):
        if not isinstance(serial, str) or not serial or any(c.isspace() for c in serial):
            problems.append((f"{path}[{i}]", f"expected a serial (no spaces), got {serial!r}"))
        elif serial in out:
            problems.append((f"{path}[{i}]", f"serial {serial!r} is listed twice"))
        else:
            out.append(serial)
    return tuple(out)


def _link(value: Any, path: str, problems: Problems) -> RelayShaping:
    if value is None:
        return RelayShaping()
    if not isinstance(value, dict):
        problems.append((path, f"expected a mapping like {{down: 100Mbit, up: 20Mbit, "
                               f"delay: 10ms}}, got {value!r}"))
        return RelayShaping()
    for key in value:
        if key == "loss":
            problems.append((f"{path}.loss", "loss cannot be applied on the ADB relay (it "
                                             "carries a TCP stream); leave it out"))
        elif key not in _LINK_KEYS:
            problems.append((f"{path}.{key}", f"unknown key (expected one of: "
                                              f"{', '.join(_LINK_KEYS)})"))
    rates: dict[str, float | None] = {}
    for key in ("down", "up"):
        rates[key] = None
        if key in value:
            try:
                rates[key] = units.parse_rate_bps(value[key])
            except units.UnitError as exc:
                problems.append((f"{path}.{key}", str(exc)))
    delay_s = 0.0
    if "delay" in value:
        try:
            delay_s = units.parse_duration_s(value["delay"])
        except units.UnitError as exc:
            problems.append((f"{path}.delay", str(exc)))
    return RelayShaping(down_bps=rates["down"], up_bps=rates["up"], delay_s=delay_s)
