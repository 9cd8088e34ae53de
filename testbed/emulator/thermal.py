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

from testbed.perf_model.profiles import ThermalParams

__all__ = ["ThermalParams", "ThermalState", "steady_state", "conductance_for_slowdown"]


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
