"""Parsers for what an Android phone prints about itself: pure functions over text.

Every parser takes the text a shell command printed and returns plain frozen data with the unit in
each field name. None means "the phone did not say"; a parser never invents a value. Vendors differ,
so every parser is tolerant: unknown lines are skipped, missing fields stay None.

========================================  =========================================================
command                                   parser -> result
========================================  =========================================================
``getprop``                               :func:`parse_getprop` -> ``{name: value}``
``dumpsys battery``                       :func:`parse_dumpsys_battery` -> :class:`BatteryState`
``dumpsys thermalservice``                :func:`parse_dumpsys_thermalservice` -> ThermalState
``cat .../power_supply/battery/uevent``   :func:`parse_power_supply_uevent` -> :class:`BatteryState`
``grep -H . .../thermal_zone*/type        :func:`parse_thermal_zones` -> ``{zone_type: celsius}``
.../thermal_zone*/temp``
``grep -H . .../cpu*/cpufreq/             :func:`parse_cpufreq` -> ``{cpu_index: hz}``
scaling_cur_freq``
========================================  =========================================================

Units and conventions, written down once:

* temperatures in degrees Celsius (``temperature_c``). ``dumpsys battery`` prints tenths of a
  degree; sysfs thermal zones print millidegrees on most kernels, whole degrees on some vendors
  (:func:`normalize_zone_celsius`).
* voltages in volts (``voltage_v``): ``dumpsys battery`` prints mV, sysfs prints µV.
* currents in amperes (``current_a``), **positive = into the battery (charging)**. Kernels print
  µA, some vendors mA, and the sign convention differs between vendors (Qualcomm: negative while
  charging, others positive), so :func:`normalize_current_a` takes the magnitude from the unit
  heuristic and the sign from the charging state when the state is known.
* CPU frequencies in hertz (``cur_freq_hz``); sysfs prints kHz.
* thermal status is the Android ``PowerManager.THERMAL_STATUS_*`` number 0 (none) .. 6 (shutdown).
* a whole number in phone text (API level, uid, pid, CPU index, status) is read with
  :func:`parse_int` only: ASCII digits, at most :data:`MAX_INT_DIGITS` of them. (``str.isdigit``
  is true for '²' and other Unicode digits, which ``int`` then refuses, and ``int`` refuses more
  than 4300 digits: either would end the bridge's thread for the phone.)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

# AOSP BatteryManager.BATTERY_STATUS_* codes.
BATTERY_STATUS = {1: "unknown", 2: "charging", 3: "discharging", 4: "not-charging", 5: "full"}
# AOSP android.os.Temperature.TYPE_* codes; anything else is kept as "type-<n>".
THERMAL_TYPES = {-1: "unknown", 0: "cpu", 1: "gpu", 2: "battery", 3: "skin", 4: "usb-port",
                 5: "power-amplifier", 6: "bcl-voltage", 7: "bcl-current", 8: "bcl-percentage",
                 9: "npu", 10: "tpu", 11: "display", 12: "modem", 13: "soc", 14: "wifi",
                 15: "camera", 16: "flashlight", 17: "speaker", 18: "ambient", 19: "pogo"}
THERMAL_STATUS = {0: "none", 1: "light", 2: "moderate", 3: "severe", 4: "critical",
                  5: "emergency", 6: "shutdown"}


@dataclass(frozen=True)
class BatteryState:
    """One battery reading; None where the phone did not say."""

    level_fraction: float | None = None  # 0..1
    temperature_c: float | None = None
    voltage_v: float | None = None
    current_a: float | None = None  # positive = charging
    status: str | None = None  # charging | discharging | not-charging | full | unknown
    plugged: str | None = None  # ac | usb | wireless | none

    def merged(self, other: BatteryState) -> BatteryState:
        """This reading with its missing fields filled from another one."""
        return replace(other, **{k: v for k, v in vars(self).items() if v is not None})


@dataclass(frozen=True)
class ThermalSensor:
    name: str
    kind: str  # from THERMAL_TYPES, or "type-<n>" for a code this table does not know
    temperature_c: float | None  # None when the HAL reported NaN
    status: int | None = None  # THERMAL_STATUS code of this sensor


@dataclass(frozen=True)
class ThermalState:
    """What ``dumpsys thermalservice`` said; ``available`` False when the service is missing."""

    available: bool
    status: int | None = None  # overall THERMAL_STATUS code
    sensors: tuple[ThermalSensor, ...] = field(default_factory=tuple)

    @property
    def status_name(self) -> str | None:
        """The overall status as a word (``'moderate'``), None when unknown."""
        return None if self.status is None else THERMAL_STATUS.get(self.status,
                                                                   f"status-{self.status}")

    def max_c(self, kind: str | None = None) -> float | None:
        """Hottest sensor (of one kind if given), None if there is none."""
        temps = [s.temperature_c for s in self.sensors
                 if s.temperature_c is not None and (kind is None or s.kind == kind)]
        return max(temps) if temps else None


# ----------------------------------------------------------------------------------------------
# getprop

_PROP_START = re.compile(r"^\[([^\]]+)\]: \[(.*)$")


def parse_getprop(text: str) -> dict[str, str]:
    """Parse ``getprop`` output (``[name]: [value]`` lines; values may span lines)."""
    props: dict[str, str] = {}
    name: str | None = None
    value_lines: list[str] = []
    for line in text.replace("\r\n", "\n").split("\n"):
        if name is None:
            match = _PROP_START.match(line)
            if not match:
                continue
            name, rest = match.group(1), match.group(2)
            value_lines = [rest]
        else:
            value_lines.append(line)
        if value_lines[-1].endswith("]"):
            value_lines[-1] = value_lines[-1][:-1]
            props[name] = "\n".join(value_lines)
            name = None
    return props


# ----------------------------------------------------------------------------------------------
# numbers and units

MAX_INT_DIGITS = 19  # as many as 64 bits hold; a phone's API level, uid or pid has far fewer


def parse_int(text: str | None, most_digits: int = MAX_INT_DIGITS) -> int | None:
    """A whole number >= 0 written in ASCII digits (blanks around it allowed), else None."""
    digits = (text or "").strip()
    if 0 < len(digits) <= most_digits and digits.isascii() and digits.isdigit():
        return int(digits)
    return None


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def normalize_voltage_v(raw: float, hint: str) -> float:
    """Volts from a raw reading; hint 'mV' or 'uV' is what the source usually prints."""
    # Guard against vendors that print the other unit: a phone battery is 2.5 .. 5 V.
    if abs(raw) > 1e5:
        return raw / 1e6
    if abs(raw) > 100:
        return raw / 1e3
    if hint == "uV" and abs(raw) > 10:
        return raw / 1e3  # printed mV in a µV file
    return raw


def normalize_current_a(raw: float, status: str | None) -> float:
    """Amperes, positive into the battery, from a raw µA or mA reading of either sign.

    Magnitude: phones draw or take at most ~10 A, i.e. 10,000 mA; a reading above 10,000 in
    magnitude is therefore µA, otherwise mA. (A µA reading below 10 mA would be misread as mA; a
    phone running a workload draws far more than 10 mA, and the status sign check below still
    holds.) Sign: when the status says charging the current is made positive, discharging negative;
    with no status, the kernel's sign is kept (POWER_SUPPLY ABI: positive = charging).
    """
    magnitude_a = abs(raw) / 1e6 if abs(raw) > 10_000 else abs(raw) / 1e3
    if status == "charging":
        return magnitude_a
    if status in ("discharging", "not-charging"):
        return -magnitude_a
    return math.copysign(magnitude_a, raw) if raw else 0.0


def normalize_zone_celsius(raw: float) -> float | None:
    """Degrees Celsius from a thermal-zone reading in m°C (most), d°C or °C (some vendors)."""
    if abs(raw) >= 1000:
        celsius = raw / 1000.0
    elif abs(raw) >= 200:
        celsius = raw / 10.0
    else:
        celsius = raw
    # Disabled zones report sentinels like -273000 or 255000; those are not temperatures.
    return celsius if -40.0 <= celsius <= 200.0 else None


# ----------------------------------------------------------------------------------------------
# battery

_KV = re.compile(r"^\s*([A-Za-z][A-Za-z0-9 _()-]*?)\s*:\s*(.*?)\s*$")


def parse_dumpsys_battery(text: str) -> BatteryState:
    """Parse ``dumpsys battery`` (AOSP and vendor variants; mV, tenths of a degree)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        match = _KV.match(line)
        if match:
            fields.setdefault(match.group(1).strip().lower(), match.group(2))
    level, scale = _number(fields.get("level")), _number(fields.get("scale")) or 100.0
    status_code = _number(fields.get("status"))
    status = BATTERY_STATUS.get(int(status_code)) if status_code is not None else None
    temp = _number(fields.get("temperature"))
    voltage = _number(fields.get("voltage"))
    current = None
    for key in ("current now", "current_now", "batt_current_ua_now"):
        raw = _number(fields.get(key))
        if raw is not None:
            current = normalize_current_a(raw, status)
            break
    plugged = None
    powered = {k: fields.get(f"{k} powered", "").lower() == "true"
               for k in ("ac", "usb", "wireless", "dock")}
    if any(f"{k} powered" in fields for k in powered):
        plugged = next((k for k, on in powered.items() if on), "none")
    return BatteryState(
        level_fraction=None if level is None or scale <= 0 else max(0.0, min(1.0, level / scale)),
        temperature_c=None if temp is None else temp / 10.0,
        voltage_v=None if voltage is None or voltage <= 0 else normalize_voltage_v(voltage, "mV"),
        current_a=current, status=status, plugged=plugged)


def parse_power_supply_uevent(text: str) -> BatteryState:
    """Parse ``/sys/class/power_supply/battery/uevent`` (``POWER_SUPPLY_X=value`` lines)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key.startswith("POWER_SUPPLY_"):
            fields[key[len("POWER_SUPPLY_"):].upper()] = value.strip()
    status_word = fields.get("STATUS", "").strip().lower().replace(" ", "-") or None
    status = status_word if status_word in BATTERY_STATUS.values() else (
        "unknown" if status_word else None)
    capacity = _number(fields.get("CAPACITY"))
    temp = _number(fields.get("TEMP"))
    voltage = _number(fields.get("VOLTAGE_NOW"))
    current = _number(fields.get("CURRENT_NOW"))
    return BatteryState(
        level_fraction=None if capacity is None else max(0.0, min(1.0, capacity / 100.0)),
        temperature_c=None if temp is None else temp / 10.0,  # ABI: tenths of a degree
        voltage_v=None if voltage is None or voltage <= 0 else normalize_voltage_v(voltage, "uV"),
        current_a=None if current is None else normalize_current_a(current, status),
        status=status, plugged=None)


# ----------------------------------------------------------------------------------------------
# thermal

_TEMPERATURE = re.compile(r"Temperature\{([^}]*)\}")
_STATUS_LINE = re.compile(r"^\s*Thermal Status:\s*(-?[0-9]+)\s*$", re.MULTILINE)


def _temperature_fields(body: str) -> dict[str, str]:
    out = {}
    for part in body.split(","):
        key, sep, value = part.strip().partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def parse_dumpsys_thermalservice(text: str) -> ThermalState:
    """Parse ``dumpsys thermalservice`` (Android 10+); tolerant of unknown types and NaN."""
    if "thermalservice" in text and ("Can't find service" in text or "not found" in text):
        return ThermalState(available=False)
    status_match = _STATUS_LINE.search(text)
    # Prefer the live HAL section; fall back to the cached one when the HAL part is missing.
    sections = re.split(r"^\s*(Current temperatures from HAL:|Cached temperatures:)\s*$", text,
                        flags=re.MULTILINE)
    chosen = None
    for i in range(1, len(sections) - 1, 2):
        if sections[i].startswith("Current") and _TEMPERATURE.search(sections[i + 1]):
            chosen = sections[i + 1]
            break
    if chosen is None:
        chosen = text
    sensors: dict[str, ThermalSensor] = {}
    for match in _TEMPERATURE.finditer(chosen):
        f = _temperature_fields(match.group(1))
        name = f.get("mName", "")
        type_code = _number(f.get("mType"))
        kind = ("unknown" if type_code is None else
                THERMAL_TYPES.get(int(type_code), f"type-{int(type_code)}"))
        status = _number(f.get("mStatus"))
        sensors.setdefault(name, ThermalSensor(name=name, kind=kind,
                                               temperature_c=_number(f.get("mValue")),
                                               status=None if status is None else int(status)))
    if status_match is None and not sensors:
        return ThermalState(available=False)
    return ThermalState(available=True,
                        status=parse_int(status_match.group(1)) if status_match else None,
                        sensors=tuple(sensors.values()))


_GREP_LINE = re.compile(r"^(/\S+?):(.*)$")


def _grep_h(text: str) -> list[tuple[str, str]]:
    out = []
    for line in text.splitlines():
        match = _GREP_LINE.match(line.strip())
        if match:
            out.append((match.group(1), match.group(2).strip()))
    return out


def parse_thermal_zones(text: str) -> dict[str, float]:
    """Parse ``grep -H . thermal_zone*/type thermal_zone*/temp`` into ``{type: celsius}``.

    Zones whose temp cannot be read or is a sentinel are left out; two zones with one type get
    ``type``, ``type#2``.
    """
    types: dict[str, str] = {}
    temps: dict[str, float] = {}
    order: list[str] = []
    for path, value in _grep_h(text):
        zone, _, leaf = path.rpartition("/")
        if zone not in order:
            order.append(zone)
        if leaf == "type":
            types[zone] = value
        elif leaf == "temp":
            raw = _number(value)
            celsius = None if raw is None else normalize_zone_celsius(raw)
            if celsius is not None:
                temps[zone] = celsius
    out: dict[str, float] = {}
    for zone in order:
        if zone not in temps:
            continue
        name = types.get(zone) or zone.rpartition("/")[2]
        key, n = name, 2
        while key in out:
            key, n = f"{name}#{n}", n + 1
        out[key] = temps[zone]
    return out


_CPU = re.compile(r"/cpu([0-9]+)/cpufreq/")


def parse_cpufreq(text: str) -> dict[int, float]:
    """Parse ``grep -H . cpu*/cpufreq/scaling_cur_freq`` into ``{cpu: hz}`` (sysfs prints kHz)."""
    out: dict[int, float] = {}
    for path, value in _grep_h(text):
        match = _CPU.search(path)
        cpu = parse_int(match.group(1)) if match else None
        khz = _number(value)
        if cpu is not None and khz is not None and 0 < khz * 1e3 < math.inf:  # 1e306 kHz
            out[cpu] = khz * 1e3
    return dict(sorted(out.items()))
