"""Plans made before the first step are the plans the step would make, and the step makes none.

The PS plans every linear's GEMMs before training (``StepPlanner.prepare``, from
``main._plan_ahead``) so that no search runs on the loop thread inside a step. Here the
simulator, which shares the StepPlanner, runs a step of the same topology with and without the
plans made ahead: the same device time and tiles, and with them made ahead no search runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from testbed.ps_backend import planning_processes, step_plan
from testbed.simulate.chain import linears
from testbed.simulate.sim import Simulation
from testbed.topology import Topology, load_topology
from tests.conftest import planning_child_takes_first, planning_topology


def _topology(tmp_path: Path) -> Topology:
    return load_topology(planning_topology(tmp_path)).with_overrides(steps=1)


def _shapes(topology: Topology) -> int:
    return len({(lin.d_out, lin.d_in) for lin in linears(topology.job)})


def _forbid_searches(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, a planner search fails the test (the plans must all be made)."""
    def no_search(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a search ran inside the step")
    for name in ("plan_gemm", "plan_pair", "plan_layer", "plan_regions"):
        monkeypatch.setattr(step_plan, name, no_search)


def _step(topology: Topology, ahead: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[float, int]:
    sim = Simulation(topology, noise=False)
    sim.start()
    if ahead:
        assert sim.plan_ahead() == _shapes(topology)
        _forbid_searches(monkeypatch)
    device_s, stats, _record = sim.run_step(0)
    monkeypatch.undo()
    return device_s, stats.tiles


def test_plans_made_ahead_are_the_steps_own(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    topology = _topology(tmp_path)
    without = _step(topology, False, monkeypatch)
    with_ahead = _step(topology, True, monkeypatch)
    assert with_ahead == without


def test_fifo_plans_nothing_ahead(tmp_path: Path) -> None:
    topology = _topology(tmp_path)
    job = topology.job
    topology = topology.with_overrides(job=dataclasses.replace(
        job, parallelism=dataclasses.replace(job.parallelism, planner="fifo")))
    sim = Simulation(topology, noise=False)
    sim.start()
    slots = [d.slot for d in sim.devices.values() if d.slot is not None]
    assert sim.planner.prepare([(256, 128, 128)], 4, slots) == 0


def test_plans_made_in_two_processes_are_the_ones_made_in_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare(workers=2)``: a planning process takes linears beside this one; what it sends
    back fills the same caches with the same plans, and the step then searches nothing."""
    topology = _topology(tmp_path)

    def prepared(workers: int) -> Simulation:
        sim = Simulation(topology, noise=False)
        sim.start()
        assert sim.plan_ahead(workers) == _shapes(topology)
        return sim

    alone = prepared(1)
    planning_child_takes_first(monkeypatch)
    together = prepared(2)
    monkeypatch.undo()
    assert together.planner.processes == 2
    (caches, forward_shapes), (caches_alone, forward_alone) = \
        together.planner.prepared(), alone.planner.prepared()
    for name in step_plan.PREPARED_CACHES:
        assert caches[name] and caches[name] == caches_alone[name], name
    assert forward_shapes == forward_alone
    assert together.planner.cpu_s > 0.0

    _forbid_searches(monkeypatch)
    device_s, stats, _ = together.run_step(0)
    monkeypatch.undo()
    assert (device_s, stats.tiles) == _step(topology, False, monkeypatch)


def test_a_child_stopped_with_bytes_still_unsent_does_not_fail_the_ps() -> None:
    """A child stopped while idle (stop_if_idle kills it) can leave the None its answering
    thread could not flush in its stdin's buffer; closing that pipe flushed it into a broken
    pipe, and the PS failed its run with BrokenPipeError (seen once in CI)."""
    counter = planning_processes._Counter(0)
    child = planning_processes._Child(counter, ("not a config",))
    child.proc.kill()
    child.proc.wait()
    assert child.proc.stdin is not None
    child.proc.stdin.write(b"unsent: the pipe's reader is gone")  # buffered, not flushed
    assert child.finish() is None  # it took nothing; no BrokenPipeError
