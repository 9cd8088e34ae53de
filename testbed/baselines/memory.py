"""How much memory a device of a profile may give one training process.

Figures and their sources are in ``testbed/baselines/data/device_memory.yaml``: installed RAM of
each shipped profile's device and the share one process may hold (an assumption, written down
there). A profile not listed gets its kind's default, marked as assumed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from testbed import units
from testbed.perf_model.profiles import DeviceProfile

DATA = Path(__file__).resolve().parent / "data" / "device_memory.yaml"


@dataclass(frozen=True)
class DeviceMemory:
    ram_bytes: int
    usable_fraction: float
    source: str

    @property
    def usable_bytes(self) -> int:
        """What one training process may hold."""
        return int(self.ram_bytes * self.usable_fraction)


@functools.cache
def _table() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(DATA.read_text())
    return data


def _entry(raw: dict[str, Any]) -> DeviceMemory:
    return DeviceMemory(units.parse_size_bytes(raw["ram"]), float(raw["usable"]),
                        str(raw["source"]))


def device_memory(profile: DeviceProfile) -> DeviceMemory:
    """The memory figures of a profile's device (its kind's assumed default if not listed)."""
    table = _table()
    if profile.name in table["profiles"]:
        return _entry(table["profiles"][profile.name])
    return _entry(table["defaults"].get(profile.kind or "phone", table["defaults"]["phone"]))


def gib(nbytes: float) -> str:
    """Bytes as GiB with two decimals (for messages)."""
    return f"{nbytes / 2**30:.2f} GiB"
