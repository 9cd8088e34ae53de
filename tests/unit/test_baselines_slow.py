"""A churn ``slow`` in the emulated baselines' processes (no Mininet): the hold under way is
re-timed from the slow's time as the simulated baselines re-time it, the ledger charges the
re-timed piece, and a process started later begins with the factor in force."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

from testbed.baselines import cost
from testbed.baselines.charge import charge, read_ledger, retime
from testbed.baselines.sim_core import BaselineWorld
from testbed.baselines.slow import POLL_S, SlowControl, control_path, write_slow
from testbed.baselines.stage_proc import HeldDevice
from testbed.topology import Topology, parse_topology

RAW: dict[str, Any] = {
    "name": "slow", "seed": 7, "network": {"switches": ["ap0"],
                                           "ps": {"switch": "ap0",
                                                  "link": {"down": "1Gbit", "up": "1Gbit"}}},
    "devices": [{"group": "phones", "profile": "snapdragon888", "count": 2, "switch": "ap0",
                 "link": {"down": "100Mbit", "up": "20Mbit"}}],
    "job": {"model": {"hidden": 32, "layers": 2, "heads": 2, "ffn": 64, "seq_len": 16},
            "batch_size": 4, "steps": 2, "dtype": "float64",
            "parallelism": {"strategy": "pipeline", "micro_batches": 4}}}
HOLD_S = 0.4  # wall seconds the piece under test holds, unslowed
# a hold on a loaded host ends late by the scheduler's wake-up; and a speed-up is read within
# one poll period
LATE_S = 0.05


def topology() -> Topology:
    return parse_topology(RAW)


def work(t: Topology) -> tuple[list[cost.Gemm], float]:
    return cost.stage_work(t.job.model, 2, True, "F", 1, 8)


def piece_s(t: Topology) -> float:
    """The piece's device seconds, unslowed (a device's first piece: the same draws each time)."""
    probe = HeldDevice(t, "phones-0", 0.0)
    probe.end(probe.begin(*work(t)))
    return probe.device_s


def test_retime_stretches_what_is_left_after_the_slow_and_splits_the_part_under_way() -> None:
    parts = [(0.0, 1.0, 10.0), (1.0, 3.0, 4.0), (3.0, 4.0, 1.0)]
    got = retime(parts, 2.0, 3.0)
    want = [(0.0, 1.0, 10.0), (1.0, 2.0, 2.0), (2.0, 5.0, 6.0), (5.0, 8.0, 3.0)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-12)
    faster = retime(parts, 2.0, 0.5)
    assert faster[-1][1] == pytest.approx(2.0 + 0.5 * 2.0, rel=1e-12)
    assert sum(p[2] for p in faster) == pytest.approx(10.0 + 2.0 + 1.0 + 0.5, rel=1e-12)
    assert retime(parts, 4.0, 3.0) == parts  # ended before the slow: as it was
    whole = retime(parts, 0.0, 2.0)  # before its start: all of it
    assert [p[1] for p in whole] == pytest.approx([2.0, 6.0, 8.0], rel=1e-12)


def test_an_emulated_piece_is_retimed_as_the_simulated_one_is(tmp_path: Path) -> None:
    """The same piece slowed x3 at 40% of its time: the emulated device's seconds and joules
    are BaselineWorld.set_slow's (one seed, so the same device model's draws)."""
    t = topology()
    gemms, mem = work(t)
    world = BaselineWorld(t)
    dev = world.devices["phones-0"]
    queued_s = world.compute(dev, gemms, mem, lambda: None)
    world.pass_time(0.4 * queued_s)
    world.set_slow(dev, 3.0)
    control = tmp_path / "devices"
    held = HeldDevice(t, "phones-0", HOLD_S / piece_s(t), None,
                      control_path(control, "phones-0"))
    held.begin(gemms, mem)
    assert held.device_s == pytest.approx(queued_s, rel=1e-9)
    at = held._t0 + 0.4 * HOLD_S
    time.sleep(max(0.0, at - time.monotonic()))
    write_slow(control, "phones-0", 3.0, at)
    held.follow_slow()
    assert (held.device_s, held.energy_j) == pytest.approx((dev.compute_s, dev.energy_j),
                                                           rel=1e-9)
    assert held.device_s == pytest.approx((0.4 + 0.6 * 3) * queued_s, rel=1e-9)


def test_a_slow_mid_hold_holds_the_rest_factor_times_longer_and_charges_it(
        tmp_path: Path) -> None:
    """A slow x3 written halfway through a hold, stamped with that time: the hold ends at
    0.5 h + 1.5 h; the report's and the ledger's seconds and joules follow; a kill inside the
    re-timed rest is charged pro rata along it."""
    t = topology()
    base_s = piece_s(t)
    D = HOLD_S / base_s
    ledger, control = tmp_path / "s.work.jsonl", tmp_path / "devices"
    held = HeldDevice(t, "phones-0", D, ledger, control_path(control, "phones-0"))
    until = held.begin(*work(t))
    t0 = held._t0
    assert until - t0 == pytest.approx(HOLD_S, rel=1e-9)
    base_j = held.energy_j
    stamp = t0 + 0.5 * HOLD_S
    time.sleep(max(0.0, stamp - time.monotonic()))  # the piece's real compute, say
    write_slow(control, "phones-0", 3.0, stamp)  # the runner, once the slow's time has come
    held.end(until)
    ended = time.monotonic()
    assert ended - t0 >= 2.0 * HOLD_S * (1 - 1e-6)
    assert ended - t0 <= 2.0 * HOLD_S + LATE_S
    assert held.device_s == pytest.approx(2.0 * base_s, rel=1e-9)
    assert held.energy_j == pytest.approx(2.0 * base_j, rel=1e-9)
    pieces = read_ledger(ledger)
    assert [bool(p.get("retimed")) for p in pieces] == [False, True]
    whole = charge(pieces, None)
    assert (whole.device_s, whole.energy_j, whole.pieces) == pytest.approx(
        (held.device_s, held.energy_j, 1), rel=1e-9)
    # killed at 1.25 h of wall: half a hold unslowed + 0.75 h of the x3 rest (a quarter of it)
    killed = charge(pieces, t0 + 1.25 * HOLD_S)
    assert killed.device_s == pytest.approx(1.25 * base_s, rel=1e-9)
    # the piece after it is timed at x3 from its start
    held.begin(*work(t))
    assert held.slow == 3.0 and held._until is not None
    assert held._until - held._t0 > 2.0 * HOLD_S


def test_a_speed_up_during_the_real_compute_applies_from_its_time(tmp_path: Path) -> None:
    """Slowed x4 from before the piece, then x1 a quarter into its hold, while the process
    still computes (no polling then): read as the hold starts, from the slow's time."""
    t = topology()
    base_s = piece_s(t)
    D = HOLD_S / base_s / 4  # the slowed piece holds HOLD_S
    control = tmp_path / "devices"
    write_slow(control, "phones-0", 4.0, time.monotonic())
    held = HeldDevice(t, "phones-0", D, None, control_path(control, "phones-0"))
    until = held.begin(*work(t))
    t0 = held._t0
    assert until - t0 == pytest.approx(HOLD_S, rel=1e-9)
    stamp = t0 + 0.25 * HOLD_S
    time.sleep(max(0.0, stamp - time.monotonic()))
    write_slow(control, "phones-0", 1.0, stamp)
    held.end(until)  # the compute is done: the hold reads the file first
    ended = time.monotonic()
    want = 0.25 * HOLD_S + 0.75 * HOLD_S / 4
    assert ended - t0 >= want * (1 - 1e-6)
    assert ended - t0 <= want + LATE_S
    assert held.device_s == pytest.approx((0.25 * 4 + 0.75) * base_s, rel=1e-9)


def test_a_speed_up_is_read_while_the_hold_sleeps(tmp_path: Path) -> None:
    """The runner writes the speed-up while the hold is asleep (another thread here): the
    hold ends within a poll period of the re-timed end, not at the end it began with."""
    import threading

    t = topology()
    base_s = piece_s(t)
    D = HOLD_S / base_s / 4
    control = tmp_path / "devices"
    write_slow(control, "phones-0", 4.0, time.monotonic())
    held = HeldDevice(t, "phones-0", D, None, control_path(control, "phones-0"))
    until = held.begin(*work(t))
    t0 = held._t0
    stamp = t0 + 0.25 * HOLD_S
    runner = threading.Timer(max(0.0, stamp - time.monotonic()), write_slow,
                             args=(control, "phones-0", 1.0, stamp))
    runner.start()
    try:
        held.end(until)
    finally:
        runner.cancel()
        runner.join()
    ended = time.monotonic()
    want = 0.25 * HOLD_S + 0.75 * HOLD_S / 4
    assert want * (1 - 1e-6) <= ended - t0 <= want + POLL_S + LATE_S
    assert ended - t0 < 0.8 * HOLD_S  # not the end it began with


def test_a_process_started_after_a_slow_begins_with_it(tmp_path: Path) -> None:
    """A restarted stage or a replica's standby reads its device's control file when it
    starts: its first piece is timed at the factor in force, not re-timed (no extra line)."""
    t = topology()
    base_s = piece_s(t)
    control = tmp_path / "devices"
    write_slow(control, "phones-0", 2.5, time.monotonic() - 10.0)
    ledger = tmp_path / "r.work.jsonl"
    held = HeldDevice(t, "phones-0", 0.0, ledger, control_path(control, "phones-0"))
    assert held.slow == 2.5
    held.end(held.begin(*work(t)))
    assert held.device_s == pytest.approx(2.5 * base_s, rel=1e-9)
    assert [bool(p.get("retimed")) for p in read_ledger(ledger)] == [False]
    other = HeldDevice(t, "phones-1", 0.0, None, control_path(control, "phones-1"))
    assert other.slow == 1.0  # one file per device; none for phones-1


def test_a_control_file_that_cannot_be_read_keeps_the_last_factor(tmp_path: Path) -> None:
    path = tmp_path / "phones-0.slow"
    control = SlowControl(path)
    assert control.current.factor == 1.0 and control.current.at_s == -math.inf
    write_slow(tmp_path, "phones-0", 2.0, 5.0)
    assert (control.poll().factor, control.poll().at_s) == (2.0, 5.0)
    path.write_text("{not json")
    assert control.poll().factor == 2.0
    path.write_text('{"slow": 0}')  # the trace refuses it; a process never divides by it
    assert control.poll().factor == 2.0
