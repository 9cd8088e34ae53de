"""Thermal state of an emulated device: heat from power, cooling toward ambient, throttling.

A lumped RC model (one heat capacity, one thermal conductance to the ambient air)::

    C dT/dt = P - G (T - T_amb)

For a constant power P over an interval dt it has the exact solution
``T(t + dt) = T_eq + (T(t) - T_eq) exp(-dt / tau)`` with ``T_eq = T_amb + P / G`` and
``tau = C / G``; :meth:`ThermalState.advance` uses it, so the result does not depend on how
finely time is stepped.

Throttling: the device runs at a speed factor ``s`` (1 = full clock) that falls linearly from 1
at ``throttle_start_c`` to ``min_speed`` at ``throttle_full_c``; a tile's time is divided by s.
Power follows the clock to first order, ``P = P_idle + (P_active - P_idle) s`` while busy (see
:mod:`testbed.emulator.energy`), which is what makes a sustained load settle at an equilibrium
slowdown instead of running away. "Slowdown" is ``1 - s`` (the throughput lost).

Units: temperatures in degrees Celsius (``_c``), heat capacity in J/K, conductance in W/K,
power in W, time in seconds of device time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ThermalParams:
    """Parameters of the lumped thermal model of one device."""

    ambient_c: float = 25.0
    capacity_j_per_k: float = 20.0
    conductance_w_per_k: float = 0.135
    throttle_start_c: float = 45.0
    throttle_full_c: float = 70.0
    min_speed: float = 0.5

    @property
    def tau_s(self) -> float:
        """Thermal time constant C / G in seconds."""
        return self.capacity_j_per_k / self.conductance_w_per_k

    def speed(self, temperature_c: float) -> float:
        """Speed factor s(T) in [min_speed, 1]."""
        if temperature_c <= self.throttle_start_c:
            return 1.0
        span = self.throttle_full_c - self.throttle_start_c
        x = min(1.0, (temperature_c - self.throttle_start_c) / span)
        return 1.0 - (1.0 - self.min_speed) * x

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "thermal") -> "ThermalParams":
        """Read a profile's thermal section; ValueError naming the field on a problem."""
        known = {f: getattr(cls, f) for f in cls.__dataclass_fields__}
        unknown = [key for key in data if key not in known and key != "provenance"
                   and key != "expected_sustained_slowdown"]
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; expected "
                             f"{', '.join(known)}")
        values = {}
        for key, default in known.items():
            value = data.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}.{key}: expected a number, got {value!r}")
            values[key] = float(value)
        params = cls(**values)
        if params.capacity_j_per_k <= 0 or params.conductance_w_per_k <= 0:
            raise ValueError(f"{where}: capacity_j_per_k and conductance_w_per_k must be > 0")
        if params.throttle_full_c <= params.throttle_start_c:
            raise ValueError(f"{where}.throttle_full_c: must be above throttle_start_c")
        if not 0 < params.min_speed <= 1:
            raise ValueError(f"{where}.min_speed: expected a number in (0, 1]")
        return params


class ThermalState:
    """The temperature of one device, advanced interval by interval."""

    def __init__(self, params: ThermalParams, temperature_c: float | None = None) -> None:
        self.params = params
        self.temperature_c = params.ambient_c if temperature_c is None else temperature_c

    @property
    def speed(self) -> float:
        """Current speed factor s (1 = not throttled)."""
        return self.params.speed(self.temperature_c)

    def advance(self, dt_s: float, power_w: float) -> float:
        """Hold power_w for dt_s seconds; return the new temperature."""
        if dt_s <= 0:
            return self.temperature_c
        p = self.params
        t_eq = p.ambient_c + power_w / p.conductance_w_per_k
        self.temperature_c = t_eq + (self.temperature_c - t_eq) * math.exp(-dt_s / p.tau_s)
        return self.temperature_c


def steady_state(params: ThermalParams, idle_w: float, active_w: float) -> tuple[float, float]:
    """(temperature_c, speed) a device settles at under 100% load; solved by bisection.

    At equilibrium T = T_amb + P(s(T)) / G with P(s) = idle_w + (active_w - idle_w) s.
    f(T) = T_amb + P(s(T)) / G - T falls monotonically in T, so bisection finds its root.
    """
    def excess(t_c: float) -> float:
        s = params.speed(t_c)
        return params.ambient_c + (idle_w + (active_w - idle_w) * s) / params.conductance_w_per_k \
            - t_c

    low, high = params.ambient_c, params.ambient_c + active_w / params.conductance_w_per_k + 1.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if excess(mid) > 0:
            low = mid
        else:
            high = mid
    t_c = 0.5 * (low + high)
    return t_c, params.speed(t_c)


def conductance_for_slowdown(params: ThermalParams, idle_w: float, active_w: float,
                             slowdown: float) -> float:
    """The conductance G (W/K) at which sustained load settles at the given slowdown 1 - s.

    With s* = 1 - slowdown, T* is where s(T*) = s*, and G = P(s*) / (T* - T_amb).
    """
    s = 1.0 - slowdown
    if not params.min_speed < s < 1.0:
        raise ValueError(f"slowdown {slowdown} is outside what the throttle curve can reach")
    fraction = (1.0 - s) / (1.0 - params.min_speed)
    t_c = params.throttle_start_c + fraction * (params.throttle_full_c - params.throttle_start_c)
    return (idle_w + (active_w - idle_w) * s) / (t_c - params.ambient_c)
