"""Thermal slowdown, energy sums, radio and carbon figures, and time dilation (no real compute)."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.emulator import energy
from testbed.emulator.device_model import EmulatedDevice, RateDeviceModel, device_model_for
from testbed.emulator.dilation import (
    auto_dilation,
    calibrate_host_gflops,
    device_seconds,
    lag_seconds,
    wall_seconds,
)
from testbed.emulator.thermal import ThermalParams, ThermalState, steady_state
from testbed.perf_model.profiles import load_profile

TILE = (256, 2048, 256)  # about 30 ms on the phone profile: few tiles per simulated minute


def sustained_stream(device: EmulatedDevice, duration_s: float, gap_s: float = 0.0
                     ) -> list[tuple[float, float]]:
    """Drive tile_cost with a simulated clock: (start time, slowdown vs the unthrottled model)."""
    now_s, curve = 0.0, []
    base_s = device.predict_seconds(*TILE)
    while now_s < duration_s:
        cost = device.tile_cost(*TILE, "forward", now_s)
        curve.append((now_s, cost.seconds / base_s))
        now_s += cost.seconds + gap_s
    return curve


def test_phone_under_sustained_load_shows_its_slowdown_curve() -> None:
    profile = load_profile("snapdragon888")
    device = device_model_for(profile, seed=0, noise=False)
    assert isinstance(device, EmulatedDevice)
    curve = sustained_stream(device, 900.0)
    times = np.array([t for t, _ in curve])
    stretch = np.array([s for _, s in curve])  # time multiplier 1 / speed
    slowdown = 1 - 1 / stretch
    expected = profile.raw["thermal"]["expected_sustained_slowdown"]
    assert slowdown[0] == pytest.approx(0.0)
    assert np.all(np.diff(slowdown) >= -1e-12), "a sustained load never speeds a device up"
    assert slowdown[times < 30].max() < 0.02, "no throttling in the first half minute"
    assert slowdown[times > 600].min() == pytest.approx(expected, abs=0.02)
    assert slowdown[(times > 120) & (times < 300)].max() > 0.05, "it builds over minutes"
    _, speed = steady_state(profile.thermal, profile.power.idle_w, profile.power.active_w)
    assert slowdown[-1] == pytest.approx(1 - speed, abs=0.01)


def test_device_cools_down_when_idle() -> None:
    device = device_model_for(load_profile("snapdragon888"), noise=False)
    sustained_stream(device, 600.0)
    hot = device.telemetry(600.0)
    cool = device.telemetry(600.0 + 5 * device.thermal.params.tau_s)
    assert hot["slowdown"] > 0.15 and cool["slowdown"] == 0.0
    assert cool["temperature_c"] < hot["temperature_c"]


def test_run_energy_is_the_sum_over_tiles_and_idle_time() -> None:
    profile = load_profile("snapdragon888")
    device = device_model_for(profile, seed=3)
    now_s, tile_j = 0.0, 0.0
    for i in range(400):
        cost = device.tile_cost(64 + i % 5 * 32, 512, 128, "forward", now_s)
        tile_j += cost.joules
        now_s += cost.seconds + 0.01 * (i % 3)
    end_s = now_s + 30.0
    t = device.telemetry(end_s)
    busy_s, idle_s = t["busy_s"], t["idle_s"]
    assert busy_s + idle_s == pytest.approx(end_s)
    assert t["compute_energy_j"] == pytest.approx(tile_j)
    assert t["energy_j"] == pytest.approx(tile_j + profile.power.idle_w * idle_s)


def test_tile_energy_follows_power_at_the_current_speed() -> None:
    power = energy.PowerParams(active_w=5.0, idle_w=0.5)
    params = ThermalParams(capacity_j_per_k=0.01, conductance_w_per_k=0.05)
    model = load_profile("snapdragon888").model
    device = EmulatedDevice(model, params, power, noise=False)
    for _ in range(200):
        speed = device.speed
        cost = device.tile_cost(*TILE, "forward", device._clock_s)
        assert cost.joules == pytest.approx(power.busy_w(speed) * cost.seconds)
    assert device.speed < 1.0


def test_radio_energy_per_byte_and_carbon() -> None:
    per_byte = energy.radio_joules_per_byte(10e6 * 8)  # HotCarbon'25: 10 MB/s, 0.5 W
    assert per_byte == pytest.approx(50e-9)
    assert energy.radio_joules(1e6, 80e6) == pytest.approx(0.05)
    assert energy.carbon_g(3.6e6, 400.0) == pytest.approx(400.0)
    account = energy.EnergyAccount(compute_j=10.0, idle_j=5.0)
    account.add_radio(2e6, 80e6)
    summary = energy.run_summary({"phones-0": account, "phones-1": energy.EnergyAccount(1, 1)},
                                 grid_g_per_kwh=500.0)
    assert summary["total"]["total_j"] == pytest.approx(15.1 + 2.0)
    assert summary["total"]["carbon_g"] == pytest.approx(17.1 / 3.6e6 * 500.0)
    with pytest.raises(ValueError):
        energy.radio_joules_per_byte(0)


def test_thermal_advance_is_exact_whatever_the_step() -> None:
    params = ThermalParams()
    one, many = ThermalState(params), ThermalState(params)
    one.advance(100.0, 3.0)
    for _ in range(1000):
        many.advance(0.1, 3.0)
    assert one.temperature_c == pytest.approx(many.temperature_c)


def test_auto_dilation_is_a_pure_function() -> None:
    assert auto_dilation(10.0, host_gflops=100.0, headroom=0.5) == 1.0
    assert auto_dilation(500.0, host_gflops=100.0, headroom=0.5) == pytest.approx(10.0)
    assert auto_dilation(0.0, 1.0) == 1.0
    for bad in ((1.0, 0.0, 0.5), (1.0, 1.0, 0.0), (-1.0, 1.0, 0.5)):
        with pytest.raises(ValueError):
            auto_dilation(*bad)
    d = 4.0
    assert device_seconds(wall_seconds(2.5, d), d) == pytest.approx(2.5)
    assert lag_seconds(10.5, 2.5, d) == pytest.approx(0.5)


def test_host_calibration_measures_a_positive_rate() -> None:
    result = calibrate_host_gflops(duration_s=0.05, cores=2)
    assert result["single_thread_gflops"] > 0.1
    assert result["host_gflops"] == pytest.approx(2 * result["single_thread_gflops"])


def test_profiles_without_model_keep_the_rate_model() -> None:
    from dataclasses import replace
    profile = replace(load_profile("snapdragon888"), model=None)
    assert isinstance(device_model_for(profile), RateDeviceModel)


def test_a_slowed_tile_is_busy_longer_in_the_telemetry_too() -> None:
    """A churn `slow` or a straggler's factor makes the tile take that much longer at the
    same power: the results' seconds and joules, and the device's own account (busy time,
    compute energy, heat), all say so; the factor was applied after the model once, and
    devices.jsonl's telemetry then said a fifth of the energy the results did."""
    profile = load_profile("snapdragon888")
    plain = device_model_for(profile, seed=1, noise=False)
    slowed = device_model_for(profile, seed=1, noise=False)
    now_s = 0.0
    for _ in range(40):
        a = plain.tile_cost(*TILE, "forward", now_s)
        b = slowed.tile_cost(*TILE, "forward", now_s, slowdown=5.0)
        now_s += b.seconds  # both start each tile at the same device time
    assert b.seconds > 5 * a.seconds * (1 - 1e-9)  # hotter too, so no faster than 5x
    late = slowed.telemetry(now_s)
    early = plain.telemetry(now_s)
    assert late["busy_s"] == pytest.approx(5 * early["busy_s"], rel=0.05)
    assert late["compute_energy_j"] == pytest.approx(5 * early["compute_energy_j"], rel=0.05)
    assert late["temperature_c"] > early["temperature_c"]
    assert late["busy_s"] + late["idle_s"] == pytest.approx(now_s, rel=1e-9)
