"""Real devices against their models: tile times vs the profile's rate, battery vs modelled J."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.report import markdown
from testbed.summary import battery_joules, real_device_models


def _sample(t_s: float, current_a: float, voltage_v: float) -> dict:
    return {"kind": "adb-telemetry", "device": "adb-p1", "elapsed_s": t_s,
            "battery_current_a": current_a, "battery_voltage_v": voltage_v}


def test_battery_joules_integrates_discharge_power() -> None:
    # 0.5 A out of the battery at 4 V = 2 W for 10 s, then 1 W for 10 s (trapezoids)
    samples = [_sample(0, -0.5, 4.0), _sample(10, -0.5, 4.0), _sample(20, -0.25, 4.0)]
    joules, charging = battery_joules(samples)
    assert joules == pytest.approx(2 * 10 + 1.5 * 10, rel=1e-12) and charging == 0
    assert battery_joules(samples[:1]) == (None, 0)
    joules, charging = battery_joules([_sample(0, 0.3, 4.0), _sample(5, 0.3, 4.0)])
    assert joules is not None and joules < 0 and charging == 2  # charging: not consumption


def test_real_device_models_next_to_measurements(tmp_path: Path) -> None:
    events = [{"event": "join", "device": "adb-p1", "kind": "real", "predicted_gflops": 20.0},
              {"event": "join", "device": "phones-0", "kind": "emulated",
               "predicted_gflops": 20.0}]
    devices = [  # two sessions of the phone; the busiest one's rate estimate is used
        {"device": "adb-p1", "tiles_done": 30, "compute_s": 3.0, "observed_gflops": 16.0,
         "energy_j": 9.0},
        {"device": "adb-p1", "tiles_done": 10, "compute_s": 1.0, "observed_gflops": 10.0,
         "energy_j": 3.0},
        {"device": "phones-0", "tiles_done": 99, "compute_s": 1.0, "observed_gflops": 1.0}]
    telemetry = [_sample(0, -0.5, 4.0), _sample(10, -0.5, 4.0),
                 {**_sample(5, -9.0, 4.0), "device": "phones-0"}]
    real = real_device_models(devices, events, telemetry)
    assert set(real) == {"adb-p1"}
    r = real["adb-p1"]
    assert r["tiles_done"] == 40 and r["measured_s_per_tile"] == pytest.approx(0.1)
    assert r["observed_gflops"] == 16.0 and r["predicted_gflops"] == 20.0
    assert r["predicted_s_per_tile"] == pytest.approx(0.1 * 16 / 20)
    assert r["model_error_fraction"] == pytest.approx(0.25)  # the profile is 25 % optimistic
    assert r["measured_energy_j"] == pytest.approx(20.0) and r["modelled_energy_j"] == 12.0
    assert r["energy_samples"] == 2 and r["charging_samples"] == 0
    # a phone that computed nothing has no error figure, and says so in the report
    idle = real_device_models([{"device": "adb-p1", "tiles_done": 0}], events, [])["adb-p1"]
    assert idle["model_error_fraction"] is None and idle["measured_energy_j"] is None

    (tmp_path / "summary.json").write_text(json.dumps({"state": "done", "real_devices": real}))
    text = markdown(tmp_path).read_text()
    assert "## Real devices against their models" in text
    assert "| adb-p1 | 40 | 0.100000 | 0.080000 | +25.0% | 20.000 | 12.000 |" in text
