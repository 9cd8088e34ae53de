"""The seam that says how long a tile takes on an emulated device, and what it costs in energy.

The agent asks its device model once per tile, when the tile's compute starts; an emulated
device then holds the (really computed) result until ``seconds * time_dilation`` have passed.

``now_s`` is **device time**: seconds since the device started, on the device's own clock (the
agent's wall-clock time divided by the run's time dilation D). The thermal state and the idle
energy advance on that clock.

:class:`EmulatedDevice` (what :func:`device_model_for` returns for a profile with a model)::

    seconds = model(m, k, n) * noise / s(T) * slowdown
    joules  = P_busy(s(T)) * seconds

``model`` is the profile's exported regression (numpy only, see
:mod:`testbed.perf_model.features`), ``noise`` a factor drawn from the profile's quantiles of
measured/predicted, ``s(T)`` the thermal speed factor (:mod:`testbed.emulator.thermal`),
``P_busy`` the power model (:mod:`testbed.emulator.energy`), ``slowdown`` what the caller
multiplies the device's time by (a churn ``slow``, a straggling tile's factor): the device is
busy that much longer at the same power, so its energy, busy time and heat in
``telemetry`` are the ones its results report. Between tiles the device idles at ``idle_w``
and cools. :class:`RateDeviceModel` remains for profiles without a model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from testbed.emulator.energy import EnergyAccount, PowerParams
from testbed.emulator.thermal import ThermalParams, ThermalState
from testbed.perf_model.features import ExportedTimeModel
from testbed.perf_model.profiles import DeviceProfile


@dataclass(frozen=True)
class TileCost:
    seconds: float  # device time the tile's compute takes
    joules: float  # energy the device spends on it (compute only; radio is counted per byte)


class DeviceModel(Protocol):
    def tile_cost(self, m: int, k: int, n: int, op: str, now_s: float,
                  slowdown: float = 1.0) -> TileCost:
        """Cost of C[m x n] = A[m x k] @ B[k x n] starting at device time now_s, its time
        ``slowdown`` times the device's own (a churn ``slow``, a straggler's factor)."""
        ...

    def telemetry(self, now_s: float) -> dict[str, float]:
        """Device state for the live view and devices.jsonl (temperature, energy so far...)."""
        ...

    def unrun(self, seconds: float, joules: float, tiles: int) -> None:
        """Take off work :meth:`tile_cost` charged that did not run (stopped part-way);
        negative ``seconds`` and ``joules`` charge work re-timed longer (a churn ``slow``
        mid-piece) as the more it is."""
        ...

    def rewind(self, at_s: float, tiles: list[tuple[float, float, float]]) -> None:
        """The tiles :meth:`tile_cost` timed did not run as timed from device time ``at_s``
        on (stopped there, or re-timed by a churn ``slow``): their heat after ``at_s`` is
        taken off and ``tiles`` (start, seconds, watts) heat the device instead."""
        ...

    def settle(self, before_s: float) -> None:
        """No :meth:`rewind` will reach before device time ``before_s``: what ended by then
        need not be kept for one."""
        ...

    def warm(self, tiles: list[tuple[float, float]]) -> None:
        """Heat the device as earlier tiles on it did, ``(start, seconds)`` on its clock (a
        process started again on the device goes on with its earlier processes' heat)."""
        ...

    def skip_draws(self, tiles: int) -> None:
        """Use up the noise draws of ``tiles`` tiles (a process started again on the device
        goes on with its draws)."""
        ...


@dataclass
class RateDeviceModel:
    """time = 2*m*k*n / (gflops * 1e9) + overhead_s; no energy model."""

    gflops: float
    overhead_s: float = 0.0

    def tile_cost(self, m: int, k: int, n: int, op: str, now_s: float,
                  slowdown: float = 1.0) -> TileCost:
        return TileCost((2.0 * m * k * n / (self.gflops * 1e9) + self.overhead_s) * slowdown,
                        0.0)

    def telemetry(self, now_s: float) -> dict[str, float]:
        return {}

    def unrun(self, seconds: float, joules: float, tiles: int) -> None:
        """Nothing to take off: this model keeps no account."""

    def rewind(self, at_s: float, tiles: list[tuple[float, float, float]]) -> None:
        """Nothing to unwind: this model has no thermal state."""

    def settle(self, before_s: float) -> None:
        """Nothing kept: this model has no thermal state."""

    def warm(self, tiles: list[tuple[float, float]]) -> None:
        """Nothing to heat: this model has no thermal state (its time is the rate alone)."""

    def skip_draws(self, tiles: int) -> None:
        """Nothing to use up: this model draws no noise."""


class EmulatedDevice:
    """Regression time model x sampled noise / thermal speed, with energy accounting."""

    def __init__(self, model: ExportedTimeModel, thermal: ThermalParams | None,
                 power: PowerParams | None, seed: int = 0, noise: bool = True,
                 start_s: float = 0.0, rewindable: bool = False) -> None:
        self.model = model
        self.thermal = ThermalState(thermal) if thermal is not None else None
        self.power = power
        self.noise = noise
        self.energy = EnergyAccount()
        self._rng = random.Random(seed)  # stdlib: numpy.random would add ~3 MB to every agent
        self._clock_s = start_s  # device time up to which the energy account has been advanced
        # device time up to which the thermal state has been advanced: the energy account's
        # clock but after a rewind, which takes heat back and not the account's idle seconds
        self._heat_clock_s = start_s
        # the tiles that may still be rewound, each (start, temperature then, seconds, watts):
        # kept only for a caller that rewinds (a baseline's simulation, which times work
        # ahead of its clock); tile-tp's time each tile as it starts and never rewind
        self.rewindable = rewindable
        self._heat: list[tuple[float, float, float, float]] = []

    @property
    def speed(self) -> float:
        """Current thermal speed factor (1 when the profile has no thermal model)."""
        return self.thermal.speed if self.thermal is not None else 1.0

    def _idle_until(self, now_s: float) -> None:
        self._cool_until(now_s)
        idle_s = now_s - self._clock_s
        if idle_s <= 0:
            return
        idle_w = self.power.idle_w if self.power is not None else 0.0
        self.energy.idle_j += idle_w * idle_s
        self.energy.idle_s += idle_s
        self._clock_s = now_s

    def _cool_until(self, now_s: float) -> None:
        """The thermal state idles until now_s."""
        if self.thermal is not None and now_s > self._heat_clock_s:
            self.thermal.advance(now_s - self._heat_clock_s,
                                 self.power.idle_w if self.power is not None else 0.0)
            self._heat_clock_s = now_s

    def _heat_tile(self, start_s: float, seconds: float, watts: float) -> None:
        """The thermal state busy at ``watts`` for ``seconds`` from start_s (or its clock)."""
        if self.thermal is None:
            return
        self._cool_until(start_s)
        start_s = max(start_s, self._heat_clock_s)
        if self.rewindable:
            self._heat.append((start_s, self.thermal.temperature_c, seconds, watts))
        self.thermal.advance(seconds, watts)
        self._heat_clock_s = start_s + seconds

    def predict_seconds(self, m: int, k: int, n: int) -> float:
        """The model's mean time for the tile, without noise or throttling."""
        return self.model.predict_one(m, k, n)

    def tile_cost(self, m: int, k: int, n: int, op: str, now_s: float,
                  slowdown: float = 1.0) -> TileCost:
        """Cost of one tile starting at device time now_s, ``slowdown`` times its modelled
        time (busy that long, at the same power); advances thermal state and energy."""
        self._idle_until(now_s)
        speed = self.speed
        factor = self.model.sample_factor(self._rng) if self.noise else 1.0
        seconds = self.predict_seconds(m, k, n) * factor / speed * slowdown
        busy_w = self.power.busy_w(speed) if self.power is not None else 0.0
        joules = busy_w * seconds
        self._heat_tile(now_s, seconds, busy_w)
        self.energy.compute_j += joules
        self.energy.busy_s += seconds
        self.energy.tiles += 1
        # a tile asked for while the previous one is still "running" starts after it
        self._clock_s = max(self._clock_s, now_s) + seconds
        return TileCost(seconds, joules)

    def unrun(self, seconds: float, joules: float, tiles: int) -> None:
        """Take off work :meth:`tile_cost` charged that did not run: a baseline's piece stopped
        part-way (its device lost, its step given up). ``seconds`` and ``joules`` of compute
        are taken off, ``tiles`` never started; the device idled those seconds instead (its
        clock has passed them). Negative ``seconds`` and ``joules``: work re-timed longer
        (a churn ``slow`` mid-piece), busy where the account had it idle. The heat is
        :meth:`rewind`'s."""
        idle_w = self.power.idle_w if self.power is not None else 0.0
        self.energy.busy_s -= seconds
        self.energy.compute_j -= joules
        self.energy.tiles -= tiles
        self.energy.idle_s += seconds
        self.energy.idle_j += idle_w * seconds

    def rewind(self, at_s: float, tiles: list[tuple[float, float, float]]) -> None:
        """Work :meth:`tile_cost` timed did not run as timed from device time ``at_s`` on: a
        baseline's piece stopped there (its device lost, its step given up: ``tiles`` empty)
        or re-timed from there by a churn ``slow`` (``tiles``: what is left of its GEMMs as
        re-timed, ``(start, seconds, watts)``). The thermal state goes back to what it was
        at ``at_s`` (the tile under way then keeps the heat of what ran of it), then takes
        ``tiles``' heat and idles between them: a tile stopped is heated as far as it ran,
        as tile-tp's, costed as it starts, is. The energy account is :meth:`unrun`'s."""
        if self.thermal is None:
            return
        if not self.rewindable:
            raise RuntimeError("rewind on a device model made without rewindable=True")
        # tiles ended by at_s stay as they ran and are forgotten: the caller rewinds no
        # earlier again
        first = next((h for h in self._heat if h[0] + h[2] > at_s), None)
        self._heat = []
        if first is not None:
            start_s, temperature_c, _, watts = first
            self.thermal.temperature_c = temperature_c
            self._heat_clock_s = start_s
            if at_s > start_s:  # what ran of the tile under way at at_s
                self.thermal.advance(at_s - start_s, watts)
                self._heat_clock_s = at_s
        for start_s, seconds, watts in tiles:
            self._heat_tile(start_s, seconds, watts)

    def settle(self, before_s: float) -> None:
        """Forget the tiles that ended by ``before_s``, which no rewind will reach: a baseline's
        simulation of 20 hotcarbon pipeline steps kept 2,160 a device, a list that grew with
        every step."""
        if self._heat and self._heat[0][0] + self._heat[0][2] <= before_s:
            self._heat = [h for h in self._heat if h[0] + h[2] > before_s]

    def warm(self, tiles: list[tuple[float, float]]) -> None:
        """Heat the device as earlier tiles on it did, ``(start, seconds)`` on its clock in
        order (a process started again on a device, whose earlier process timed them): the
        thermal state and the clock advance as :meth:`tile_cost` advanced them, idle between;
        the energy account is the earlier process's and is left alone."""
        if self.thermal is None:
            return
        idle_w = self.power.idle_w if self.power is not None else 0.0
        for start_s, seconds in tiles:
            if start_s > self._clock_s:
                self.thermal.advance(start_s - self._clock_s, idle_w)
            busy_w = self.power.busy_w(self.speed) if self.power is not None else 0.0
            self.thermal.advance(seconds, busy_w)
            self._clock_s = max(self._clock_s, start_s) + seconds
            self._heat_clock_s = self._clock_s

    def skip_draws(self, tiles: int) -> None:
        """Use up the noise draws of ``tiles`` tiles: a process started again on the device
        goes on with its draws rather than repeating those its earlier processes used."""
        if self.noise:
            for _ in range(tiles):
                self.model.sample_factor(self._rng)

    def telemetry(self, now_s: float) -> dict[str, float]:
        """Temperature, throttle factor and energy so far, at device time now_s."""
        self._idle_until(now_s)
        out = {"throttle_factor": self.speed, "slowdown": 1.0 - self.speed,
               "energy_j": self.energy.compute_j + self.energy.idle_j,
               "compute_energy_j": self.energy.compute_j, "idle_energy_j": self.energy.idle_j,
               "busy_s": self.energy.busy_s, "idle_s": self.energy.idle_s,
               "tiles": float(self.energy.tiles)}
        if self.thermal is not None:
            out["temperature_c"] = self.thermal.temperature_c
        return out


def device_model_for(profile: DeviceProfile, seed: int = 0, noise: bool = True,
                     rewindable: bool = False) -> DeviceModel:
    """The device model a profile asks for: its regression model with thermal and power
    when it has one, else its sustained rate. ``rewindable``: its heat can be rewound
    (:meth:`EmulatedDevice.rewind`; it keeps its tiles for that)."""
    if profile.model is None:
        return RateDeviceModel(profile.sustained_gflops, profile.tile_overhead_s)
    return EmulatedDevice(profile.model, profile.thermal, profile.power, seed=seed, noise=noise,
                          rewindable=rewindable)
