"""The seam that says how long a tile takes on an emulated device, and what it costs in energy.

The agent asks its device model once per tile, when the tile's compute starts; an emulated
device then holds the (really computed) result until ``seconds * time_dilation`` have passed.
:class:`RateDeviceModel` is the simplest model: the profile's sustained GFLOPS plus a fixed
per-tile overhead. The performance-model work replaces it through :func:`device_model_for`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from testbed.perf_model.profiles import DeviceProfile


@dataclass(frozen=True)
class TileCost:
    seconds: float  # device time the tile's compute takes
    joules: float  # energy the device spends on it (compute only; radio is counted per byte)


class DeviceModel(Protocol):
    def tile_cost(self, m: int, k: int, n: int, op: str, now_s: float) -> TileCost:
        """Cost of C[m x n] = A[m x k] @ B[k x n] starting at device time now_s."""
        ...

    def telemetry(self, now_s: float) -> dict[str, float]:
        """Device state for the live view and devices.jsonl (temperature, energy so far...)."""
        ...


@dataclass
class RateDeviceModel:
    """time = 2*m*k*n / (gflops * 1e9) + overhead_s; no energy model."""

    gflops: float
    overhead_s: float = 0.0

    def tile_cost(self, m: int, k: int, n: int, op: str, now_s: float) -> TileCost:
        return TileCost(2.0 * m * k * n / (self.gflops * 1e9) + self.overhead_s, 0.0)

    def telemetry(self, now_s: float) -> dict[str, float]:
        return {}


def device_model_for(profile: DeviceProfile, seed: int = 0) -> DeviceModel:
    """The device model a profile asks for (for now: its sustained rate)."""
    return RateDeviceModel(profile.sustained_gflops, profile.tile_overhead_s)
