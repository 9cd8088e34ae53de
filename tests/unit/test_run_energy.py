"""A run's energy is the power model's sum over its tiles, its idle time and its radio bytes."""

from __future__ import annotations

import pytest

from testbed.emulator.energy import PowerParams, device_presence_s, run_energy


def test_presence_from_events() -> None:
    events = [{"event": "join", "device": "a", "elapsed_s": 1.0},
              {"event": "join", "device": "b", "elapsed_s": 2.0},
              {"event": "disconnect", "device": "a", "elapsed_s": 5.0},
              {"event": "join", "device": "a", "elapsed_s": 7.0},
              {"event": "ps_stop", "elapsed_s": 10.0}]
    assert device_presence_s(events, 10.0) == {"a": 4.0 + 3.0, "b": 8.0}


def test_presence_counts_each_stretch_at_the_d_it_ran_at() -> None:
    # an adaptive run: started at D 2, the probe chose 4 at 6 s, a change to 8 at 10 s
    events = [{"event": "ps_start", "time_dilation": 2.0, "elapsed_s": 0.5},
              {"event": "join", "device": "a", "elapsed_s": 2.0},
              {"event": "dilation_probe", "chosen": 4.0, "elapsed_s": 6.0},
              {"event": "join", "device": "b", "elapsed_s": 8.0},
              {"event": "dilation_change", "old": 4.0, "new": 8.0, "elapsed_s": 10.0},
              {"event": "leave", "device": "b", "elapsed_s": 14.0}]
    presence = device_presence_s(events, 18.0, dilation=99.0)  # ps_start's D wins
    assert presence["a"] == pytest.approx(4.0 / 2 + 4.0 / 4 + 8.0 / 8)
    assert presence["b"] == pytest.approx(2.0 / 4 + 4.0 / 8)
    # without the PS's record the given D starts the timeline
    assert device_presence_s(events[1:], 18.0, dilation=1.0)["a"] == \
        pytest.approx(4.0 / 1 + 4.0 / 4 + 8.0 / 8)


def test_presence_from_the_start_of_training_leaves_out_the_wait_before_it() -> None:
    # what `testbed compare` charges tile-tp's row, as the baselines' rows are charged: the
    # devices' idle time while they joined and the PS probed and planned is left out
    events = [{"event": "ps_start", "time_dilation": 2.0, "elapsed_s": 0.0},
              {"event": "join", "device": "a", "elapsed_s": 1.0},
              {"event": "join", "device": "b", "elapsed_s": 2.0},
              {"event": "join", "device": "c", "elapsed_s": 2.5},
              {"event": "leave", "device": "c", "elapsed_s": 3.0},  # gone before training
              {"event": "training_start", "elapsed_s": 5.0},
              {"event": "leave", "device": "b", "elapsed_s": 7.0},
              {"event": "join", "device": "c", "elapsed_s": 8.0}]
    assert device_presence_s(events, 9.0) == \
        pytest.approx({"a": 8.0 / 2, "b": 5.0 / 2, "c": 0.5 / 2 + 1.0 / 2})
    assert device_presence_s(events, 9.0, from_event="training_start") == \
        pytest.approx({"a": 4.0 / 2, "b": 2.0 / 2, "c": 1.0 / 2})
    assert device_presence_s(events[:5], 9.0, from_event="training_start") == {}  # never began


def test_run_energy_sums_the_power_model() -> None:
    power = PowerParams(active_w=5.0, idle_w=0.5, radio_w=0.5)
    events = [{"event": "join", "device": "p", "elapsed_s": 0.0},
              {"event": "ps_stop", "elapsed_s": 20.0}]
    # two records: the device left and came back (both stretches count)
    devices = [{"device": "p", "compute_s": 3.0, "energy_j": 15.0, "tiles_done": 10,
                "bytes_down": 10_000_000, "bytes_up": 1_000_000},
               {"device": "p", "compute_s": 1.0, "energy_j": 5.0, "tiles_done": 4,
                "bytes_down": 0, "bytes_up": 0},
               {"device": "x", "compute_s": 1.0, "energy_j": 0.0, "tiles_done": 1}]
    out = run_energy(devices, events, {"p": power, "x": None}, {"p": (80e6, 8e6)},
                     dilation=2.0, end_elapsed_s=20.0)
    d = out["devices"]["p"]
    assert d["compute_j"] == pytest.approx(20.0)
    assert d["idle_j"] == pytest.approx(0.5 * (20.0 / 2.0 - 4.0))  # device time minus busy
    assert d["radio_j"] == pytest.approx(0.5 * 8 * 10e6 / 80e6 + 0.5 * 8 * 1e6 / 8e6)
    assert out["total"]["total_j"] == pytest.approx(d["compute_j"] + d["idle_j"] + d["radio_j"])
    assert out["total"]["carbon_g"] == pytest.approx(out["total"]["total_j"] / 3.6e6 * 475.0)
    assert out["devices_without_power_model"] == ["x"]
