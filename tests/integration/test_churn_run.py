"""Replayed churn on loopback: half the devices leave or crash while the job trains.

Real PS and agent processes and real gRPC. Every step completes, the final weights equal the
single-process run's (float64), only tiles that were in flight at the departures are computed
again, and the replay is exactly the seeded plan of the trace.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from testbed.runlog import read_jsonl
from tests.conftest import TINY, killed_at_exit, reference_losses, run_dir_of, start_up

pytestmark = pytest.mark.integration

# 20 ms one-way delays make a step of the tiny job last about a second, so the departures
# (1.5 s and 3 s after training starts) land inside steps.
TRACE = """# two of the four devices go: one crashes, one leaves (seeded picks)
time_s,device,event,arg
1.5,phones:1,crash,
3.0,phones:1,leave,
"""


def churn_topology(tmp_path: Path, steps: int = 8) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw["job"]["steps"] = steps
    raw["job"]["dtype"] = "float64"
    for group in raw["devices"]:
        group["link"] = {"down": "1Gbit", "up": "1Gbit", "delay": "20ms"}
    trace = tmp_path / "half-go.csv"
    trace.write_text(TRACE)
    raw["churn"] = str(trace)
    path = tmp_path / "churn.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    return torch.load(checkpoints[-1], weights_only=True)["model"]


@pytest.mark.slow
def test_half_the_devices_go_and_the_result_is_unchanged(tmp_path: Path) -> None:
    from testbed.churn import load_schedule
    from testbed.topology import load_topology

    topology = churn_topology(tmp_path)
    proc = start_up(topology, tmp_path / "runs")
    output, _ = proc.communicate(timeout=300)
    run_dir = run_dir_of(tmp_path / "runs")
    assert proc.returncode == 0, output
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(8))
    want_losses, want_weights = reference_losses(topology, 8)
    for s, want in zip(steps, want_losses):
        assert abs(s["loss"] - want) <= 1e-8 * abs(want), (s["step"], s["loss"], want)
    got = _final_weights(run_dir)
    scale = max(w.abs().max().item() for w in want_weights.values())
    for name, want in want_weights.items():
        assert (got[name] - want).abs().max().item() <= 1e-8 * scale, name

    events = read_jsonl(run_dir / "events.jsonl")
    # the replay is the seeded plan, action for action
    topo = load_topology(topology)
    schedule = load_schedule(topo.churn, topo)
    churn = [e for e in events if e["event"] == "churn"]
    assert [(e["device"], e["action"], e["time_s"]) for e in churn] == \
        [(a.device, a.event.value, a.time_s) for a in schedule.actions]
    assert [e["effect"] for e in churn] == ["SIGKILL", "SIGTERM"]
    # the plain output says each action, as the live view's notes do (it said none)
    for e in churn:
        assert f"churn t={e['time_s']:g}s {e['action']} {e['device']}: {e['effect']}" \
            in output, output
    victims = {a.device for a in schedule.actions}
    assert len(victims) == 2 and victims <= {"phones-0", "phones-1", "phones-2"}

    # both departures happened during training, were recorded, and their tiles re-queued
    start = next(e["elapsed_s"] for e in events if e["event"] == "training_start")
    departures = [e for e in events if e["event"] in ("leave", "disconnect", "lease_expired")]
    assert {e["device"] for e in departures} == victims
    last_step_t = steps[-1]["elapsed_s"]
    assert all(start < e["elapsed_s"] < last_step_t for e in departures)
    in_flight = sum(e["in_flight"] for e in departures)
    requeued = sum(e["requeued_tiles"] for e in departures)
    recomputed = sum(s["recomputed_tiles"] for s in steps)
    assert requeued <= in_flight
    assert recomputed <= in_flight, (recomputed, in_flight)

    # the departures moved the phones' count: the PS planned for the phones left between
    # steps (a `planned` event before a later step), not at a step's first GEMMs
    planned = [e for e in events if e["event"] == "planned"]
    assert planned[0]["before_step"] == 0 and any(e["before_step"] > 0 for e in planned), \
        planned

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "done" and summary["departures"] == 2
    assert summary["agent_deaths"] == []  # the trace's crash (SIGKILL) was asked for
    assert summary["tiles_in_flight_at_departures"] == in_flight
    assert summary["recomputed_tiles"] == recomputed
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == summary["recoveries"] == sum(e["requeued_tiles"] > 0
                                                         for e in departures)
    for key in ("recovery_p50_s", "recovery_p95_s", "goodput", "validation_overhead_cpu",
                "goodput_gflops"):
        assert key in summary, key
    assert 0 < summary["goodput"] <= 1


# Devices rejoin and the trace ends early (3 s into a run of ~10): every device the trace leaves
# alone must stay until the end. A laptop partitioned for less than a lease (5 s) and healed must
# get back to work: nothing it was sent may stay "in flight" forever.
REJOIN_TRACE = """# two phones crash and rejoin, the laptop is cut off briefly; nothing after 3 s
time_s,device,event,arg
0.5,phones-0,crash,
0.5,laptops-0,partition,
1.0,phones-1,leave,
1.5,laptops-0,heal,
2.0,phones-0,join,
3.0,phones-1,join,
"""


@pytest.mark.slow
def test_rejoined_devices_stay_and_a_healed_device_works_on(tmp_path: Path) -> None:
    topology = churn_topology(tmp_path, steps=10)
    (tmp_path / "half-go.csv").write_text(REJOIN_TRACE)
    proc = start_up(topology, tmp_path / "runs")
    output, _ = proc.communicate(timeout=400)
    run_dir = run_dir_of(tmp_path / "runs")
    assert proc.returncode == 0, output
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(10))  # no stall
    events = read_jsonl(run_dir / "events.jsonl")
    churn = [e for e in events if e["event"] == "churn"]
    assert [(e["device"], e["action"]) for e in churn] == [
        ("phones-0", "crash"), ("laptops-0", "partition"), ("phones-1", "leave"),
        ("laptops-0", "heal"), ("phones-0", "join"), ("phones-1", "join")]
    assert steps[-1]["elapsed_s"] > churn[-1]["elapsed_s"] + 2, "the trace did not end early"

    # After its last trace event every device is present until the last step: no departure of
    # any device between the end of the trace and the end of training.
    end = steps[-1]["elapsed_s"]
    late = [e for e in events if e["event"] in ("leave", "disconnect", "lease_expired")
            and churn[-1]["elapsed_s"] < e["elapsed_s"] < end]
    assert not late, late
    final = json.loads((run_dir / "summary.json").read_text())
    assert final["state"] == "done"
    # every device, the rejoined ones included, did tiles after the trace ended: the per-device
    # samples taken last show all four with more tiles than at the end of the trace
    samples = read_jsonl(run_dir / "devices.jsonl")
    after = {}
    at_end_of_trace = {}
    for s in samples:
        name = s.get("device")
        if s["elapsed_s"] <= churn[-1]["elapsed_s"] + 0.5:
            at_end_of_trace[name] = s.get("tiles_done", 0)
        elif s["elapsed_s"] <= end:
            after[name] = s.get("tiles_done", 0)
    for name in ("phones-0", "phones-1", "phones-2", "laptops-0"):
        assert after.get(name, 0) > at_end_of_trace.get(name, 0), (name, after,
                                                                    at_end_of_trace)

    # One clock: a crash is recorded by testbed up before the PS sees its stream break.
    crash = churn[0]
    broken = [e for e in events if e["event"] in ("disconnect", "lease_expired", "leave")
              and e["device"] == "phones-0"]
    assert broken and crash["elapsed_s"] <= broken[0]["elapsed_s"], (crash, broken[0])
    assert abs(crash["t"] - crash["elapsed_s"] - (broken[0]["t"] - broken[0]["elapsed_s"])) \
        <= 1e-3


def test_a_join_right_after_a_leave_or_crash_brings_the_device_back(tmp_path: Path) -> None:
    """A join 5 ms after a leave, and one at the same time as a crash: each device leaves, then
    joins again (its agent had been signalled but not reaped, and the join was dropped while
    its record said applied), and works on to the end."""
    topology = churn_topology(tmp_path, steps=4)
    (tmp_path / "half-go.csv").write_text(
        "time_s,device,event,arg\n1.0,phones-0,leave,\n1.0,phones-1,crash,\n"
        "1.0,phones-1,join,\n1.005,phones-0,join,\n")
    proc = start_up(topology, tmp_path / "runs")
    output, _ = proc.communicate(timeout=400)
    run_dir = run_dir_of(tmp_path / "runs")
    assert proc.returncode == 0, output
    events = read_jsonl(run_dir / "events.jsonl")
    for name in ("phones-0", "phones-1"):
        joins = [e for e in events if e["event"] == "join" and e["device"] == name]
        assert len(joins) == 2, (name, joins)  # at the start, and again after the trace's
    summary = json.loads((run_dir / "summary.json").read_text())
    for name in ("phones-0", "phones-1"):  # a record per session: the first left, one stays
        states = [d["state"] for d in summary["devices"] if d["device"] == name]
        assert "left" in states and any(s != "left" for s in states), (name, states)


@pytest.mark.slow
def test_the_churn_clock_starts_with_training_not_before(tmp_path: Path) -> None:
    """Trace time 0 is training's start, as testbed simulate counts it: default.yaml on
    loopback probes its D and plans for seconds first, and a laptops crash at 0.3 s landed
    there, on no tile (its disconnects with nothing in flight)."""
    raw = yaml.safe_load((TINY.parents[2] / "topologies" / "default.yaml").read_text())
    raw["network"]["backend"] = "loopback"
    raw["job"]["steps"] = 1
    trace = tmp_path / "early.csv"
    trace.write_text("time_s,device,event,arg\n0.3,laptops,crash,\n0.6,laptops,join,\n")
    raw["churn"] = str(trace)
    topology = tmp_path / "default-lo.yaml"
    topology.write_text(yaml.safe_dump(raw))
    proc = start_up(topology, tmp_path / "runs")
    output, _ = proc.communicate(timeout=400)
    run_dir = run_dir_of(tmp_path / "runs")
    assert proc.returncode == 0, output
    events = read_jsonl(run_dir / "events.jsonl")
    at = {e["event"]: e["elapsed_s"] for e in reversed(events)}  # each kind's first
    assert at["churn_clock_start"] >= at["training_start"], (at, output)
    crashes = [e for e in events if e["event"] == "churn" and e["action"] == "crash"]
    assert crashes and all(e["elapsed_s"] >= at["training_start"] for e in crashes)


def test_a_trace_that_takes_every_device_away_for_good_fails_the_run_at_once(
        tmp_path: Path) -> None:
    """Every device leaves at 1 s and none comes back, the watchdog off: the run fails within
    seconds, as testbed simulate does ("the churn trace brings none back"), where it waited
    for ever (a left agent exits 0, which the every-agent-gone rule passed over)."""
    topology = churn_topology(tmp_path, steps=50)
    raw = yaml.safe_load(topology.read_text())
    raw["job"]["watchdog"] = {"no_progress_s": 0}
    topology.write_text(yaml.safe_dump(raw))
    (tmp_path / "half-go.csv").write_text(
        "time_s,device,event,arg\n1.0,phones,leave,\n1.0,laptops,leave,\n")
    proc = start_up(topology, tmp_path / "runs")
    with killed_at_exit(proc):  # it waited for ever before
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, output
    summary = json.loads((run_dir_of(tmp_path / "runs") / "summary.json").read_text())
    assert summary["state"] == "failed" and 1 <= summary["steps_done"] < 50, summary
    assert "no device is left: the churn trace took every one away (4 of 4 started) and " \
        "brings none back" in summary["error"], summary["error"]


# Cut off, a crashed device tells the PS nothing, as a leaving one cannot: the PS learns at its
# lease's end, or at a heal that comes first (docs/churn.md, "Crash while cut off"). phones-0
# stays cut off; phones-1 is healed 1.5 s after its crash, well within the lease (5 s).
CUT_CRASH_TRACE = """time_s,device,event,arg
0.5,phones-0,partition,
0.5,phones-1,partition,
1.0,phones-0,crash,
1.0,phones-1,crash,
2.5,phones-1,heal,
"""
STEPS_PAST_THE_LEASE = 10  # training lasts past the cut's lease (0.5 + 5 s)


def test_a_crash_while_cut_off_reaches_the_ps_at_the_lease_or_at_the_heal(
        tmp_path: Path) -> None:
    """On loopback the replay's SIGKILL closed the agent's socket past its own blackhole: the
    PS counted both crashes as disconnects at once."""
    topology = churn_topology(tmp_path, steps=STEPS_PAST_THE_LEASE)
    (tmp_path / "half-go.csv").write_text(CUT_CRASH_TRACE)
    proc = start_up(topology, tmp_path / "runs")
    with killed_at_exit(proc):
        output, _ = proc.communicate(timeout=300)
    run_dir = run_dir_of(tmp_path / "runs")
    assert proc.returncode == 0, output
    events = read_jsonl(run_dir / "events.jsonl")
    churn = [e for e in events if e["event"] == "churn"]
    assert [(e["device"], e["action"], e["effect"]) for e in churn] == [
        ("phones-0", "partition", "agent blackholed"),
        ("phones-1", "partition", "agent blackholed"),
        ("phones-0", "crash", "SIGQUIT"), ("phones-1", "crash", "SIGQUIT"),
        ("phones-1", "heal", "agent healed")]
    departures = {e["device"]: e for e in events
                  if e["event"] in ("leave", "disconnect", "lease_expired")}
    assert set(departures) == {"phones-0", "phones-1"}, departures
    cut_t, crash_t, heal_t = churn[0]["t"], churn[2]["t"], churn[4]["t"]
    lease = departures["phones-0"]
    # 5 s after the last message the PS heard, at most a heartbeat (1 s) before the cut
    assert lease["event"] == "lease_expired" and lease["t"] >= cut_t + 4.0, (lease, cut_t)
    healed = departures["phones-1"]
    assert healed["event"] == "disconnect" and heal_t <= healed["t"] < cut_t + 4.0, \
        (healed, heal_t, crash_t)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "done" and summary["agent_deaths"] == [], summary
