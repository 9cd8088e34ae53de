"""testbed simulate: run directory, the PS's planner's tiles, churn replay, bad input, scale."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from testbed.churn.schedule import load_schedule
from testbed.cli import main
from testbed.runlog import read_jsonl
from testbed.simulate.chain import step_chain
from testbed.simulate.run import simulate
from testbed.simulate.sim import Simulation
from testbed.topology import load_topology

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"
TRACE = "time_s,device,event,arg\n0.002,phones-1,leave,\n0.004,phones-2,crash,\n" \
        "0.006,phones-1,join,\n0.008,laptops-0,slow,2\n"


def test_run_directory_is_complete_and_marked(tmp_path: Path) -> None:
    topology = load_topology(TINY).with_overrides(steps=2)
    summary = simulate(topology, tmp_path, noise=False)
    assert summary["simulated"] is True and summary["state"] == "done"
    steps = read_jsonl(tmp_path / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1]
    chain = [g for group in step_chain(topology.job) for g in group]
    for s in steps:
        assert s["gemms"] == len(chain) == 39
        assert s["device_time_s"] > 0 and 0 < s["efficiency"] <= 1.0
        assert s["bytes_down"] > 0 and s["bytes_up"] > 0
    assert summary["energy"]["total"]["total_j"] > 0
    assert summary["energy"]["total"]["carbon_g"] > 0
    assert (tmp_path / "report.png").stat().st_size > 0
    assert len(read_jsonl(tmp_path / "devices.jsonl")) == 4


def test_every_tile_of_every_gemm_is_accepted_once(tmp_path: Path) -> None:
    topology = load_topology(TINY).with_overrides(steps=1)
    sim = Simulation(topology, noise=False)
    sim.start()
    _, stats, _ = sim.run_step(0)
    assert stats.tiles == sum(sim.tiles_per_gemm.values())
    assert not sim.scheduler.tasks and not sim.scheduler.pending
    # bytes up: every result tile's C once, whatever the tiling
    chain = [g for group in step_chain(topology.job) for g in group]
    assert stats.bytes_up >= sum(g.m * g.n * 8 for g in chain)  # K-split partials: more


def test_churn_replays_the_schedule_in_order(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE)
    topology = load_topology(TINY).with_overrides(steps=2)
    schedule = load_schedule(trace, topology)
    (tmp_path / "run").mkdir()
    simulate(topology, tmp_path / "run", schedule, report=False)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    churn = [(e["action"], e["device"]) for e in events if e["event"] == "churn"]
    assert churn == [(a.event.value, a.device) for a in schedule.actions]
    membership = [(e["event"], e["device"]) for e in events
                  if e["event"] in ("join", "leave", "disconnect")][4:]  # after the first four
    assert membership == [("leave", "phones-1"), ("disconnect", "phones-2"),
                          ("join", "phones-1")]
    times = [e["elapsed_s"] for e in events if e["event"] == "churn"]
    assert times == pytest.approx([a.time_s for a in schedule.actions], abs=1e-9)


def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("count: 3", "count: -3"))
    out = tmp_path / "runs"
    assert main(["simulate", str(bad), "--out", str(out)]) == 2
    trace = tmp_path / "t.csv"
    trace.write_text("time_s,device,event,arg\n1,nobody-7,leave,\n")
    assert main(["simulate", str(TINY), "--churn", str(trace), "--out", str(out)]) == 2
    assert main(["simulate", str(TINY), "--steps", "0", "--out", str(out)]) == 2
    assert not out.exists()


@pytest.mark.slow
def test_a_thousand_devices(tmp_path: Path) -> None:
    text = TINY.read_text().replace("count: 3", "count: 900").replace("count: 1", "count: 100")
    path = tmp_path / "big.yaml"
    path.write_text(text)
    topology = load_topology(path).with_overrides(steps=1)
    start = time.monotonic()
    summary = simulate(topology, tmp_path, report=False)
    assert summary["state"] == "done" and summary["steps_done"] == 1
    assert time.monotonic() - start < 600
    joins = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "join"]
    assert len(joins) == 1000
    assert json.loads((tmp_path / "summary.json").read_text())["tiles"] > 0
