"""Plans count on the devices present: a group is planned for what it has, rounded up to a step
of its topology count (``planned_count``), so a departure costs the step its device's share
and not a plan that deals that share to the others."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from testbed.churn.schedule import load_schedule
from testbed.ps_backend.step_plan import PLAN_COUNT_STEP, planned_count
from testbed.simulate.sim import Simulation
from testbed.topology import load_topology

DEFAULT = Path(__file__).resolve().parents[2] / "topologies" / "default.yaml"


@pytest.mark.parametrize("count", [1, 2, 6, 59, 1000])
def test_a_group_is_planned_for_the_least_step_at_or_above_its_devices(count: int) -> None:
    steps = [count]
    while steps[-1] > 1:
        steps.append(min(steps[-1] - 1, int(steps[-1] * PLAN_COUNT_STEP)))
    for present in range(count + 3):
        got = planned_count(count, present)
        if present == 0:
            assert got == 0
            continue
        assert got in steps and got >= min(present, count), (present, got)
        assert not [s for s in steps if min(present, count) <= s < got], (present, got)
    assert planned_count(59, 58) == 59 and planned_count(59, 53) == 53  # a tenth below


def _step_s(topology_path: Path, trace: Path | None = None) -> float:
    topology = load_topology(topology_path).with_overrides(steps=1)
    schedule = load_schedule(trace, topology) if trace is not None else None
    sim = Simulation(topology, schedule, noise=False)
    sim.start()
    device_s, _, _ = sim.run_step(0)
    return device_s


def test_a_phone_absent_from_the_start_costs_what_a_topology_without_it_runs(
        tmp_path: Path) -> None:
    """default.yaml with one of its 6 phones gone from the start against the same file
    declaring 5: 5.35 s against 4.11 when plans counted on all 6 (each of the 5 then took a
    sixth more), 4.12 since."""
    raw = yaml.safe_load(DEFAULT.read_text())
    phones = next(g for g in raw["devices"] if g["group"] == "phones")
    assert phones["count"] == 6
    phones["count"] = 5
    five = tmp_path / "five.yaml"
    five.write_text(yaml.safe_dump(raw))
    trace = tmp_path / "away.csv"
    trace.write_text("time_s,device,event,arg\n0,phones-5,leave,\n")
    away_s, five_s = _step_s(DEFAULT, trace), _step_s(five)
    assert away_s == pytest.approx(five_s, rel=0.03), (away_s, five_s)


def test_counts_change_between_steps_only(tmp_path: Path) -> None:
    """A phone that crashes inside step 0 leaves step 0's plans as they were (a linear's
    forward and backward are planned for the same devices); step 1 plans for five, and the PS
    is told to prepare them between the steps (needs_prepare), off its loop thread."""
    trace = tmp_path / "crash.csv"
    trace.write_text("time_s,device,event,arg\n0.5,phones-5,crash,\n")
    topology = load_topology(DEFAULT).with_overrides(steps=2)
    sim = Simulation(topology, load_schedule(trace, topology), noise=False)
    seen: list[tuple[int, dict[str, int]]] = []
    plan = sim.planner.plan

    def spy(job, slots):  # type: ignore[no-untyped-def]
        cut = plan(job, slots)
        seen.append((job.spec.step, sim.planner._counts()))
        return cut
    sim.planner.plan = spy  # type: ignore[method-assign]
    sim.start(plan_workers=1)
    assert not sim.planner.needs_prepare()  # start's plans are for these counts
    sim.run_step(0)
    assert not sim.devices["phones-5"].present
    assert {c["phones"] for s, c in seen if s == 0} == {6}
    assert sim.planner.needs_prepare()
    sim.run_step(1)
    assert {c["phones"] for s, c in seen if s == 1} == {5}


def test_a_device_that_joins_inside_a_step_does_not_displace_one_its_plans_counted_on(
        tmp_path: Path) -> None:
    """phones-0 is away for step 0, so step 1 plans for five phones, and joins again inside
    step 1. It sorts first by name, but the five that step 1's plans met first keep its tiles:
    taken from them, it would have had blocks they were sent and hold."""
    trace = tmp_path / "rejoin.csv"
    trace.write_text("time_s,device,event,arg\n0,phones-0,leave,\n5.5,phones-0,join,\n")
    topology = load_topology(DEFAULT).with_overrides(steps=3)
    sim = Simulation(topology, load_schedule(trace, topology), noise=False)
    owners: dict[int, set[str]] = {}
    present: dict[int, set[str]] = {}
    plan = sim.planner.plan

    def spy(job, slots):  # type: ignore[no-untyped-def]
        slots = list(slots)
        cut = plan(job, slots)
        names = {s.device_id: s.name for s in slots}
        owners.setdefault(job.spec.step, set()).update(
            names[d] for d in (cut.owners or {}).values())
        present.setdefault(job.spec.step, set()).update(names.values())
        return cut
    sim.planner.plan = spy  # type: ignore[method-assign]
    sim.start(plan_workers=1)
    for step in range(3):
        sim.run_step(step)
    assert "phones-0" in present[1]  # it joined inside step 1
    assert "phones-0" not in owners[1]
    assert {f"phones-{i}" for i in range(1, 6)} <= owners[1]
    assert "phones-0" in owners[2]  # and step 2 plans for all six
