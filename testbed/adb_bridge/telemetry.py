"""Telemetry from one phone: the shell commands, and one sample built from their answers.

The commands are fixed strings (the fake adb server in the tests answers exactly these):

* ``dumpsys battery`` and the power-supply uevent for the battery (level, temperature, voltage,
  current, charging state; the uevent fills what dumpsys leaves out, current above all);
* ``dumpsys thermalservice`` (overall thermal status, HAL temperatures);
* thermal zones and cpufreq through ``grep -H .`` (one line per file, ``path:value``; a file that
  cannot be read prints an error line that the parsers skip).

A sample is a flat dict for ``devices.jsonl`` (units in the key names, see :mod:`.parsers`).
"""

from __future__ import annotations

from typing import Any, Callable

from testbed.adb_bridge import parsers

CMD_BATTERY = "dumpsys battery"
CMD_UEVENT = "cat /sys/class/power_supply/battery/uevent"
CMD_THERMAL = "dumpsys thermalservice"
CMD_ZONES = ("grep -H . /sys/class/thermal/thermal_zone*/type "
             "/sys/class/thermal/thermal_zone*/temp")
CMD_CPUFREQ = "grep -H . /sys/devices/system/cpu/cpu*/cpufreq/scaling_cur_freq"
COMMANDS = (CMD_BATTERY, CMD_UEVENT, CMD_THERMAL, CMD_ZONES, CMD_CPUFREQ)

Shell = Callable[[str], tuple[int, str]]  # command -> (exit code, stdout)


def sample(shell: Shell) -> dict[str, Any]:
    """Run the telemetry commands through ``shell`` and build one sample."""
    answers = {cmd: shell(cmd) for cmd in COMMANDS}

    def text(cmd: str) -> str:
        return answers[cmd][1]

    return build_sample(text(CMD_BATTERY), text(CMD_UEVENT), text(CMD_THERMAL), text(CMD_ZONES),
                        text(CMD_CPUFREQ))


def build_sample(battery: str, uevent: str, thermal: str, zones: str, cpufreq: str
                 ) -> dict[str, Any]:
    """One telemetry sample from the five command outputs (pure)."""
    bat = parsers.parse_dumpsys_battery(battery).merged(parsers.parse_power_supply_uevent(uevent))
    th = parsers.parse_dumpsys_thermalservice(thermal)
    zone_c = parsers.parse_thermal_zones(zones)
    freq_hz = parsers.parse_cpufreq(cpufreq)
    return {
        "battery_level_fraction": bat.level_fraction,
        "battery_temperature_c": bat.temperature_c,
        "battery_voltage_v": bat.voltage_v,
        "battery_current_a": bat.current_a,
        "battery_status": bat.status,
        "plugged": bat.plugged,
        "thermal_status": th.status,
        "thermal_status_name": th.status_name,
        "thermal_max_c": th.max_c() if th.sensors else (max(zone_c.values()) if zone_c else None),
        "thermal_sensors_c": {s.name: s.temperature_c for s in th.sensors},
        "thermal_zones_c": zone_c,
        "cpu_freq_hz": {str(k): v for k, v in freq_hz.items()},
    }
