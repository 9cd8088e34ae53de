"""Synthetic churn: seeding, the distributions' means, diurnal modulation, crashes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from testbed.churn.generate import SessionModel, generate_events, sample_lengths_s
from testbed.churn.schedule import build_schedule
from testbed.churn.trace import ChurnEvent, Trace, format_trace, parse_trace

DEVICES = [f"phones-{i}" for i in range(8)]


def _schedule(devices: list[str], model: SessionModel, duration_s: float, seed: int):
    events = generate_events(devices, model, duration_s, seed)
    # through the file format, as `testbed trace gen` writes it
    trace = parse_trace(format_trace(events), "gen")
    return build_schedule(trace, {"phones": devices}, seed)


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    model = SessionModel(60.0, 30.0, "weibull", 0.7, crash_fraction=0.2)
    a = generate_events(DEVICES, model, 3600.0, seed=7)
    b = generate_events(DEVICES, model, 3600.0, seed=7)
    c = generate_events(DEVICES, model, 3600.0, seed=8)
    assert a == b and len(a) > 100
    assert a != c


def test_a_device_stream_does_not_depend_on_the_other_devices() -> None:
    model = SessionModel(60.0, 30.0)
    alone = generate_events(DEVICES[:1], model, 3600.0, seed=3)
    with_others = generate_events(DEVICES, model, 3600.0, seed=3)
    assert alone == [e for e in with_others if e.target == DEVICES[0]]


@pytest.mark.parametrize("distribution, shape", [("exponential", 1.0), ("weibull", 0.5),
                                                 ("weibull", 2.0)])
def test_sampled_lengths_have_the_requested_mean(distribution: str, shape: float) -> None:
    rng = np.random.default_rng(1)
    samples = sample_lengths_s(rng, distribution, 120.0, shape, size=40_000)
    # standard error of the mean: sd / sqrt(n); Weibull(0.5) has sd = sqrt(5) * mean
    tolerance = 4 * 120.0 * math.sqrt(5) / math.sqrt(40_000)  # 4 s.e. of the widest one
    assert abs(samples.mean() - 120.0) < tolerance
    assert (samples > 0).all()


def test_weibull_shape_changes_the_spread() -> None:
    rng = np.random.default_rng(2)
    heavy = sample_lengths_s(rng, "weibull", 100.0, 0.5, size=20_000)
    narrow = sample_lengths_s(rng, "weibull", 100.0, 3.0, size=20_000)
    assert heavy.std() > 3 * narrow.std()


def _sessions_and_absences(schedule, end_s: float) -> tuple[list[float], list[float]]:
    sessions, absences = [], []
    for spans in schedule.intervals(end_s).values():
        present = spans["present"]
        sessions += [hi - lo for lo, hi in present if lo > 0 and hi < end_s]
        absences += [b_lo - a_hi for (_, a_hi), (b_lo, _) in zip(present, present[1:])]
    return sessions, absences


@pytest.mark.parametrize("distribution, shape", [("exponential", 1.0), ("weibull", 0.7)])
def test_generated_sessions_and_absences_follow_the_parameters(distribution: str,
                                                               shape: float) -> None:
    model = SessionModel(60.0, 20.0, distribution, shape)
    end_s = 20_000.0
    sessions, absences = _sessions_and_absences(_schedule(DEVICES, model, end_s, 5), end_s)
    assert len(sessions) > 1000 and len(absences) > 1000
    assert np.mean(sessions) == pytest.approx(60.0, rel=0.10)
    assert np.mean(absences) == pytest.approx(20.0, rel=0.10)


def test_diurnal_availability_follows_the_daily_cycle() -> None:
    devices = [f"phones-{i}" for i in range(60)]
    day_s = 86400.0
    flat = SessionModel(1800.0, 1800.0, diurnal_period_s=day_s)
    daily = SessionModel(1800.0, 1800.0, diurnal_amplitude=0.8, diurnal_period_s=day_s,
                         diurnal_peak_s=0.25 * day_s)
    times = np.arange(0.0, 2 * day_s, 600.0)
    hour = (times % day_s) / 3600.0
    peak = (hour >= 3) & (hour < 9)  # around 06:00
    trough = (hour >= 15) & (hour < 21)  # around 18:00
    for model, expect_swing in ((flat, False), (daily, True)):
        schedule = _schedule(devices, model, 2 * day_s, 11)
        present = np.array([p for p, _ in schedule.availability(list(times))]) / len(devices)
        swing = present[peak].mean() - present[trough].mean()
        if expect_swing:
            # target: a0 (1 ± 0.8) = 0.9 vs 0.1 at the extremes; averaged over 6 h windows
            assert swing > 0.4, swing
        else:
            assert abs(swing) < 0.1, swing
            assert present.mean() == pytest.approx(0.5, abs=0.08)


def test_crash_fraction_sets_the_share_of_crashes() -> None:
    events = generate_events(DEVICES, SessionModel(30.0, 10.0, crash_fraction=0.25), 20_000.0,
                             seed=4)
    departures = [e for e in events if e.event in (ChurnEvent.LEAVE, ChurnEvent.CRASH)]
    crashes = sum(e.event is ChurnEvent.CRASH for e in departures)
    assert crashes / len(departures) == pytest.approx(0.25, abs=0.03)


def test_a_device_absent_for_the_whole_trace_gets_a_leave_at_zero() -> None:
    # availability ~0.01: most devices start absent and never come back within 1 s
    model = SessionModel(1.0, 1e6)
    events = generate_events(DEVICES, model, 1.0, seed=0)
    schedule = build_schedule(Trace(tuple(events)), {"phones": DEVICES}, 0)
    absent = [d for d in DEVICES if d not in schedule.initially_present]
    assert len(absent) >= 6
    for device in absent:
        assert [(e.time_s, e.event) for e in events if e.target == device] == \
            [(0.0, ChurnEvent.LEAVE)]
        assert schedule.states_at(1.0)[device][0] is False


def test_bad_parameters_are_named() -> None:
    with pytest.raises(ValueError) as info:
        generate_events(DEVICES, SessionModel(-1.0, 10.0, "gamma", diurnal_amplitude=2.0),
                        0.0, seed=0)
    message = str(info.value)
    for part in ("--dist", "--session-mean", "--diurnal-amplitude", "--duration"):
        assert part in message
