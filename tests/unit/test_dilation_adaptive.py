"""Adaptive time dilation: the decision rule, the probe loop, the controller, the device clock,
and the topology's ``time_dilation`` forms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.emulator.dilation import (
    MAX_RAISE,
    RAISE_MARGIN,
    DeviceClock,
    DilationController,
    error_quantiles,
    next_dilation,
    probe_dilation,
    tile_error,
)
from testbed.errors import InputError
from testbed.topology import load_topology
from tests.conftest import tiny_topology

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"


def test_tile_error_is_hold_against_model_time_times_d() -> None:
    assert tile_error(10.0, 10.33, 0.1, 3.0) == pytest.approx(0.1)
    assert tile_error(10.0, 10.3, 0.1, 3.0) == pytest.approx(0.0, abs=1e-12)


def test_next_dilation_raises_by_the_error_ratio_and_lowers_gently() -> None:
    up = next_dilation(2.0, 0.2, 0.1)
    assert 2.0 * 2 < up <= 2.0 * 2 * 1.5  # error twice the target: D more than doubles
    assert next_dilation(2.0, 0.08, 0.1) == 2.0  # within the target, no headroom: unchanged
    assert next_dilation(2.0, 0.01, 0.1) == pytest.approx(1.6)  # lots of headroom: lower
    assert next_dilation(1.0, 0.0, 0.1) == 1.0  # never below 1
    assert next_dilation(1.0, 100.0, 0.1) == MAX_RAISE  # one outlier cannot explode D
    with pytest.raises(ValueError):
        next_dilation(0.5, 0.1, 0.1)


def _host(lateness_s: float, model_s: float = 0.01):
    """A host where every tile is lateness_s wall seconds late whatever D is."""
    def measure(dilation: float) -> tuple[list[float], float | None]:
        return [lateness_s / (dilation * model_s)] * 40, None
    return measure


def test_probe_picks_larger_d_on_a_slower_host_and_meets_the_target() -> None:
    d_fast, fast = probe_dilation(_host(0.0005), 1.0, 0.1)
    d_slow, slow = probe_dilation(_host(0.02), 1.0, 0.1)
    assert d_slow > d_fast
    for d, lateness in ((d_fast, 0.0005), (d_slow, 0.02)):
        assert lateness / (d * 0.01) <= 0.1 + 1e-9  # the chosen D meets the target
    assert [r["dilation"] for r in slow][0] == 1.0 and len(slow) >= 2


def test_probe_and_controller_keep_d_when_late_tiles_cannot_move_a_step_that_far() -> None:
    # every tile 150 % late, but the lateness accounts for 2 % of the round's device time
    d, history = probe_dilation(lambda _d: ([1.5] * 40, 0.02), 3.0, 0.1)
    assert d == 3.0 and history[-1]["late_share"] == 0.02
    d, _ = probe_dilation(lambda _d: ([1.5] * 40, 0.3), 3.0, 0.1)  # 30 %: raise
    assert d > 3.0
    c = DilationController(3.0, 0.1)
    c.observe([1.5] * 40, 0.02)
    assert c.between_steps() == 3.0
    c.observe([1.5] * 40, None)  # a step whose share is unknown: judged by its tiles
    assert c.between_steps() > 3.0
    c = DilationController(3.0, 0.1)
    c.observe([1.5] * 40, 0.25)
    assert c.between_steps() > 3.0


def test_probe_without_samples_keeps_the_start() -> None:
    d, history = probe_dilation(lambda _d: ([], None), 3.0, 0.1)
    assert d == 3.0 and history[0]["p95"] is None


def test_controller_changes_d_only_when_asked_and_restarts_its_window() -> None:
    c = DilationController(1.0, 0.1, min_tiles=10)
    c.observe([0.5] * 5)
    assert c.between_steps() == 1.0  # too few tiles to judge
    c.observe([0.5] * 10)
    assert c.dilation == 1.0  # observing never changes D by itself
    new = c.between_steps()
    assert new > 1.0 and len(c.window) == 0
    c.observe([0.05] * 20)
    assert c.between_steps() == new


def test_error_quantiles_count_early_tiles_by_size() -> None:
    q = error_quantiles([0.0] * 90 + [-0.5] * 10)
    assert q["p50"] == 0.0 and q["p95"] == pytest.approx(0.5)
    assert error_quantiles([]) == {"p50": None, "p95": None}


def test_device_clock_is_continuous_when_d_changes() -> None:
    clock = DeviceClock(100.0, 2.0)
    assert clock.device_s(104.0) == pytest.approx(2.0)
    clock.set_dilation(4.0, 104.0)
    assert clock.device_s(104.0) == pytest.approx(2.0)  # no jump
    assert clock.device_s(112.0) == pytest.approx(4.0)


@pytest.mark.parametrize("value,fixed,target", [
    ("auto", None, 0.10), ({"target_p95": "5%"}, None, 0.05), ({"target_p95": 0.2}, None, 0.2),
    (3, 3.0, 0.10)])
def test_topology_time_dilation_forms(tmp_path: Path, value: object, fixed: float | None,
                                      target: float) -> None:
    topo = load_topology(tiny_topology(tmp_path, time_dilation=value))
    assert topo.time_dilation == fixed and topo.dilation_target_p95 == pytest.approx(target)
    again = tmp_path / "again.yaml"
    import yaml
    raw = yaml.safe_load(tiny_topology(tmp_path, name="x", time_dilation=value).read_text())
    raw["time_dilation"] = topo.to_yaml()["time_dilation"]  # what a run directory records
    again.write_text(yaml.safe_dump(raw))
    assert load_topology(again).dilation_target_p95 == pytest.approx(target)


@pytest.mark.parametrize("value", [{"target_p95": 0}, {"target": "10%"}, {"target_p95": "150%"},
                                   0.5, "fast"])
def test_topology_bad_time_dilation_names_the_field(tmp_path: Path, value: object) -> None:
    with pytest.raises(InputError) as err:
        load_topology(tiny_topology(tmp_path, time_dilation=value))
    assert "time_dilation" in str(err.value)


def test_probe_does_not_judge_its_cold_first_round() -> None:
    calls: list[float] = []

    def measure(dilation: float) -> tuple[list[float], float | None]:
        calls.append(dilation)
        # the first round pays once for the devices' first tiles: 5x late; then 4% at D = 2
        return [5.0] * 40 if len(calls) == 1 else [0.04 * 2.0 / dilation] * 40, None

    d, history = probe_dilation(measure, 2.0, 0.1)
    assert d == 2.0 and calls == [2.0, 2.0]  # warm-up, then one judged round that met it
    assert history[0]["warmup"] is True and "warmup" not in history[1]
    d_cold, _ = probe_dilation(lambda _d: ([5.0] * 40, None), 2.0, 0.1, warmup=False)
    assert d_cold > 2.0  # without the warm-up a cold round raises D


def test_controller_raises_fast_and_lowers_only_over_a_long_window() -> None:
    c = DilationController(4.0, 0.1, min_tiles=20, lower_min_tiles=100, lower_min_steps=3)
    c.observe([0.005] * 50)  # ample headroom, but seen over 50 tiles only
    assert c.between_steps() == 4.0
    c.observe([0.005] * 50)
    assert c.between_steps() == 4.0  # 100 tiles, but from 2 steps only
    c.observe([0.005] * 5)
    assert c.between_steps() == pytest.approx(3.2)  # 105 tiles over 3 steps: lowered (x0.8)
    c.observe([0.005] * 200)
    assert c.between_steps() == pytest.approx(3.2)  # the count of steps restarted at the change
    c.observe([0.3] * 20)  # one step of 20 tiles is enough to raise
    assert c.between_steps() > 3.2 * 2


def test_controller_window_keeps_whole_steps_and_the_latest_step_entire() -> None:
    c = DilationController(10.0, 0.1, window_tiles=400)
    # one step of 1200 tiles, its p95 in the target; its last 400 alone would miss it (12.5%
    # of them late)
    c.observe([0.0] * 1150 + [0.5] * 50)
    assert len(c.window) == 1200 and c.between_steps() == 10.0
    c.observe([0.0] * 300)
    c.observe([0.0] * 300)  # the 1200-tile step is dropped whole once 600 newer tiles suffice
    assert len(c.window) == 600


def test_a_missed_fidelity_target_says_by_how_much_and_what_to_change() -> None:
    from testbed.summary import fidelity_warning

    line = fidelity_warning({"tile_error_p95": 0.75, "dilation_target_p95": 0.1,
                             "dilation_min": 2.2, "dilation_max": 2.2})
    assert "missed its target (10%)" in line and "p95 tile-time error 75.0%" in line
    assert "(time dilation 2.2)" in line  # "2.2..2.2" for a D that never moved
    moved = fidelity_warning({"tile_error_p95": 0.75, "dilation_target_p95": 0.1,
                              "dilation_min": 1.4799371097, "dilation_max": 3.2})
    assert "(time dilation 1.48..3.2)" in moved, moved
    assert "A larger time_dilation" in line and "time_dilation: {target_p95: ...}" in line
    line = fidelity_warning({"tile_error_p95": 0.75, "dilation_target_p95": 0.1,
                             "dilation_min": 2.2, "dilation_max": 2.2,
                             "lateness_share_max": 0.234,
                             "lateness_shares_worst": {"compute": 0.05, "start": 0.034,
                                                       "uplink": 0.15}})
    assert "moved a step's device time by up to 23.4% (compute holds 5.0%, tile starts " \
        "3.4%, uplinks 15.0%)" in line
    # D 2.2 x the worse of p95 and share over the target (75 % / 10 %) x the margin, at most
    # MAX_RAISE: the D the controller would try next
    assert f"(try time_dilation: {2.2 * MAX_RAISE:.3g};" in line
    line = fidelity_warning({"tile_error_p95": 0.05, "dilation_target_p95": 0.1,
                             "dilation_min": 1.28, "dilation_max": 1.28,
                             "lateness_share_max": 0.2})
    assert f"(try time_dilation: {1.28 * 2 * RAISE_MARGIN:.3g};" in line


def test_lateness_bound_adds_each_gemms_latest_device() -> None:
    from testbed.emulator.dilation import lateness_bound_s

    late = {("g0", "laptop-0"): 0.004, ("g0", "laptop-1"): 0.006, ("g0", "phone-0"): 0.001,
            ("g1", "phone-0"): 0.010, ("g1", "laptop-0"): 0.002}
    # g0 ends at most 6 ms late (its latest device), g1 at most 10 ms: 16 ms for the step
    assert lateness_bound_s(late) == pytest.approx(0.016)
    assert lateness_bound_s({}) == 0.0


def test_the_verdict_holds_when_late_tiles_cannot_move_a_step_by_the_target() -> None:
    from testbed.emulator.dilation import fidelity_ok
    from testbed.ps_backend.main import Fidelity

    assert fidelity_ok(0.05, None, 0.1) is True  # no share known: the p95 error decides
    assert fidelity_ok(1.5, 0.02, 0.1) is True  # tiny tiles miss, the steps hold
    assert fidelity_ok(1.5, 0.2, 0.1) is False
    # holds within the target, but late starts and results moved the step: not faithful
    assert fidelity_ok(0.05, 0.3, 0.1) is False
    assert fidelity_ok(None, None, 0.1) is None and fidelity_ok(0.5, 0.5, None) is None
    fid = Fidelity(0.1)
    # a step of 2.4 s whose late tiles can account for 24 ms of it, then one for 480 ms
    late = {"compute": {("g0", "phone-0"): 0.024}, "start": {}, "uplink": {}}
    step = fid.add([1.5] * 20 + [0.0] * 20, [0.0] * 40, 3.0, late, 2.4)
    assert step["lateness_share"] == pytest.approx(0.01)
    assert step["lateness_shares"] == {"compute": pytest.approx(0.01), "start": 0.0,
                                       "uplink": 0.0}
    assert fid.fields()["fidelity_ok"] is True and fid.fields()["tile_error_p95"] > 0.1
    # the compute holds keep their times; late starts and results can account for 480 ms
    late = {"compute": {}, "start": {("g1", "phone-0"): 0.08},
            "uplink": {("g1", "phone-0"): 0.3, ("g2", "phone-1"): 0.1}}
    fid.add([0.0] * 40, [0.0] * 40, 3.0, late, 2.4)
    out = fid.fields()
    assert out["lateness_share_max"] == pytest.approx(0.2) and out["fidelity_ok"] is False
    # (uplinks: g1's 0.3 s and g2's 0.1 s; all kinds: g1's phone 0.38 s and g2's 0.1 s)
    assert out["lateness_shares_worst"] == {
        "compute": 0.0, "start": pytest.approx(0.08 / 2.4, abs=1e-6),
        "uplink": pytest.approx(0.4 / 2.4, abs=1e-6)}


def test_lateness_shares_add_the_kinds_per_gemm_and_device_before_the_bound() -> None:
    from testbed.emulator.dilation import lateness_shares

    late = {"compute": {("g0", "a"): 0.1, ("g0", "b"): 0.3},
            "start": {("g0", "a"): 0.25},
            "uplink": {("g1", "b"): 0.2, ("g0", "b"): -0.5}}  # b ran ahead on g0's uplink
    shares = lateness_shares(late, 2.0)
    # g0: a is 0.35 s late in all, b 0.3 s (its uplink ahead makes up for none of its
    # compute): 0.35; g1: 0.2; each kind alone is less
    assert shares["all"] == pytest.approx(0.55 / 2.0)
    assert shares["compute"] == pytest.approx(0.3 / 2.0)
    assert shares["start"] == pytest.approx(0.25 / 2.0)
    assert shares["uplink"] == pytest.approx(0.2 / 2.0)
    with pytest.raises(ValueError):
        lateness_shares(late, 0.0)


def test_a_device_timeline_judges_starts_and_uplink_against_its_model() -> None:
    from testbed.emulator.dilation import DeviceTimeline

    # 1 MB/s uplink, 10 ms one way, at time dilation 2: 100 kB take 0.2 s of wall, the delay
    # 20 ms. Wall times on the host's clock, lateness in device seconds
    line = DeviceTimeline(1e6, 0.010)
    # operands at 1.0, computed 1.0-1.5, result at the PS at 1.0 + 0.5 + 0.2 + 0.02: on time
    start, up = line.result(1.0, 1.0, 1.5, 100_000, 1.72, 2.0)
    assert start == 0.0 and up == pytest.approx(0.0, abs=1e-12)
    # the next tile's operands came at 1.2 but it could start only when the first was done
    # (1.5): it started at 1.6, 0.1 s of wall late. Its result (done at 1.65) queued behind
    # the first on the uplink until 1.7 (1.72 less the delay), so 1.92 was due: 2.12 is 0.2 s
    # of wall, 0.1 s of device time late
    start, up = line.result(1.2, 1.6, 1.65, 100_000, 2.12, 2.0)
    assert start == pytest.approx(0.05) and up == pytest.approx(0.1)
    # the third is judged from when the second really arrived, not from when it was due:
    # queued until 2.1, due 2.32, on time
    start, up = line.result(1.9, 1.9, 2.0, 100_000, 2.32, 2.0)
    assert start == pytest.approx(0.0) and up == pytest.approx(0.0, abs=1e-12)
    # early (a reference rate the device beat): negative, to make up for late ones
    assert line.result(3.0, 3.0, 3.1, 100_000, 3.3, 2.0) == (0.0, pytest.approx(-0.01))
    # 1.5 s late after 1.9 s without a word (heartbeats every 1 s): late, as a faithful link
    # would not have kept it
    assert line.result(4.0, 4.0, 4.1, 100_000, 5.82, 2.0, silent_s=1.9, heartbeat_s=1.0) \
        == (0.0, pytest.approx(0.75))
    # 3 s late after 3.4 s of silence: more than two heartbeats beyond its own 0.2 s transfer
    # and the delay, so the device was cut off (a partition), not late
    assert line.result(6.0, 6.0, 6.1, 100_000, 9.32, 2.0, silent_s=3.4, heartbeat_s=1.0) \
        == (0.0, 0.0)
    with pytest.raises(ValueError):
        DeviceTimeline(0.0, 0.01)


def test_the_controller_raises_d_when_results_are_late_though_holds_keep_time() -> None:
    c = DilationController(2.0, 0.1, min_tiles=20)
    c.observe([0.01] * 100, late_share=0.4)  # every hold on time, the step 40 % late
    assert c.between_steps() == pytest.approx(2.0 * 0.4 / 0.1 * RAISE_MARGIN)
    c.observe([0.01] * 100, late_share=0.02)
    assert c.between_steps() == pytest.approx(2.0 * 0.4 / 0.1 * RAISE_MARGIN)


def test_a_step_faster_than_its_bound_is_counted_and_the_run_warns() -> None:
    from types import SimpleNamespace

    from testbed.ps_backend.bound import BoundTotals
    from testbed.summary import run_warnings

    bound = BoundTotals()
    step = SimpleNamespace(bound_s=1.25, bytes_min_down=1.0, bytes_min_up=1.0, sat_out={})
    bound.add(step, 2.34)
    assert bound.fields()["steps_below_bound"] == 0 and run_warnings(bound.fields()) == []
    bound.add(step, 0.66)  # links 8x too fast: what a run whose links kept an old D reported
    bound.add(step, 1.25)  # at the bound exactly: possible
    bound.add(step, 0.5, from_ledger=40)  # a resumed step's journaled tiles cost no time
    fields = bound.fields()
    assert fields["steps_below_bound"] == 1
    (line,) = run_warnings(fields)
    assert "1 step(s) took less device time than their lower bound" in line
    both = run_warnings({**fields, "fidelity_ok": False, "tile_error_p95": 0.75,
                         "dilation_target_p95": 0.1, "dilation_min": 2.2, "dilation_max": 2.2})
    assert len(both) == 2 and "p95 tile-time error 75.0%" in both[1]


def test_a_missed_fidelity_target_names_the_steps_that_missed(tmp_path: Path) -> None:
    """`make up` on a fast host: step 0 alone (its start-up) missed, 16.6 %, the 19 others
    2.9-5 %, and the warning read as if the run had missed throughout."""
    from testbed.runlog import RunLog
    from testbed.summary import fidelity_warning, write_summary

    log = RunLog(tmp_path)
    for step, share in enumerate([0.166, 0.05, 0.038, 0.12]):
        log.step(step=step, loss=5.0, wall_s=1.0, tiles=10, lateness_share=share)
    log.close()
    (tmp_path / "ps_summary.json").write_text(json.dumps({
        "state": "done", "steps_done": 4, "steps": 4, "tiles": 40, "wall_s": 4.0,
        "tile_error_p95": 0.05, "dilation_target_p95": 0.1, "dilation_min": 1.15,
        "dilation_max": 1.15, "lateness_share_max": 0.166, "fidelity_ok": False}))
    summary = write_summary(tmp_path, load_topology(TINY), {"backend": "loopback"}, 1.15, 0, {})
    assert summary["steps_late"] == [0, 3]
    assert "missed its target (10%) in 2 of 4 steps (0, 3): " in fidelity_warning(summary)
    summary["steps_late"] = [0]
    assert "missed its target (10%) in step 0 of 4: " in fidelity_warning(summary)
