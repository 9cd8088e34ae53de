"""Planning before the first step says how far it is: `testbed simulate` prints, and the PS
logs, how many GEMM shapes are planned of how many every 10 s, where a job at scale printed one
line as planning started and one as it ended, minutes apart, with nothing between.

The searches are made slow here (a sleep before each linear's) and the period short, so that
lines are due within a test; the plans must be the ones made without anyone watching.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from testbed.cli import main
from testbed.ps_backend import main as ps_main
from testbed.ps_backend import step_plan
from testbed.ps_backend.planning_processes import Progress, prepare_together, progress_line
from testbed.simulate import run as simulate_run
from testbed.simulate.chain import linears, step_chain
from testbed.simulate.sim import Simulation
from testbed.topology import Topology, load_topology
from tests.conftest import TINY, planning_child_takes_first, planning_topology

SEARCH_S = 0.1  # each linear's searches take at least this long here
EVERY_S = 0.02  # and a line is due this often


def _shapes(topology: Topology) -> int:
    return len({(lin.d_out, lin.d_in) for lin in linears(topology.job)})


def _slow_searches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each linear's searches in this process take SEARCH_S longer."""
    real = step_plan.StepPlanner.prepare_shape

    def slow(self: step_plan.StepPlanner, *args: Any) -> None:
        time.sleep(SEARCH_S)
        real(self, *args)
    monkeypatch.setattr(step_plan.StepPlanner, "prepare_shape", slow)


def _started(topology: Topology) -> Simulation:
    sim = Simulation(topology, noise=False, during_every_s=EVERY_S)
    sim.start()
    return sim


def test_prepare_says_how_many_shapes_are_planned_while_it_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    topology = load_topology(planning_topology(tmp_path)).with_overrides(steps=1)
    quiet = _started(topology)
    quiet.plan_ahead()
    _slow_searches(monkeypatch)
    said: list[tuple[int, int, float]] = []
    watched = _started(topology)
    assert watched.plan_ahead(progress=lambda *line: said.append(line)) == _shapes(topology)
    shapes = _shapes(topology)
    assert len(said) >= shapes  # one linear takes SEARCH_S, several periods
    assert {total for _, total, _ in said} == {shapes}
    planned = [done for done, _, _ in said]
    assert planned == sorted(planned) and planned[0] == 0 and planned[-1] in (shapes - 1, shapes)
    walls = [wall_s for _, _, wall_s in said]
    assert walls == sorted(walls) and walls[-1] >= (shapes - 1) * SEARCH_S
    # the plans are the ones made without progress
    assert watched.planner.prepared() == quiet.planner.prepared()


def test_nothing_is_said_when_planning_ends_before_a_period() -> None:
    said: list[tuple[int, int, float]] = []
    with Progress(3, lambda *line: said.append(line), every_s=60.0) as counted:
        for _ in range(3):
            counted.one_done()
    assert said == [] and counted.planned == 3


def test_linears_a_planning_process_searched_count_as_planned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A linear counts once its process is done with it: here, or in the child that took it
    (it asks for another), so that a count of 2 processes reaches every shape."""
    topology = load_topology(planning_topology(tmp_path)).with_overrides(steps=1)
    sim = _started(topology)
    tokens = topology.job.batch_size * topology.job.model.seq_len
    shapes = sorted({(tokens, lin.d_out, lin.d_in) for lin in linears(topology.job)})
    slots = [d.slot for d in sim.devices.values() if d.slot is not None]
    planning_child_takes_first(monkeypatch)
    counted = Progress(len(shapes))
    assert prepare_together(sim.planner, shapes, 4, slots, 2, counted) == 2
    assert counted.planned == len(shapes)


def test_testbed_simulate_prints_the_planning_progress(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = planning_topology(tmp_path)
    shapes = _shapes(load_topology(path))
    _slow_searches(monkeypatch)
    monkeypatch.setattr(step_plan, "planning_workers", lambda: 1)  # every search slowed here
    monkeypatch.setattr(simulate_run, "simulate",
                        functools.partial(simulate_run.simulate, during_every_s=SEARCH_S / 2))
    assert main(["simulate", str(path), "--steps", "1", "--out", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith("planning: ")]
    assert at, lines
    assert lines[at[0]].startswith(f"planning: 0 of {shapes} GEMM shapes planned (")
    # between the line saying planning starts and the one saying it is done
    assert lines[at[0] - 1].startswith("planning every linear's tiles")
    assert lines[at[-1] + 1].startswith(f"planned {shapes} GEMM shape(s) in ")


def test_the_ps_logs_the_planning_progress(caplog: pytest.LogCaptureFixture) -> None:
    """``_plan_ahead`` hands the planner a progress callback that logs the same line."""
    class Planner:
        cpu_s = 0.0
        processes = 1

        def prepare(self, shapes: list[Any], item: int, slots: list[Any], workers: int = 1,
                    progress: Any = None) -> int:
            assert progress is not None, "no progress callback"
            progress(2, 5, 30.4)
            return 5

        def region_shapes(self) -> list[str]:
            return []
    core = SimpleNamespace(planner=Planner(), scheduler=SimpleNamespace(devices={}))
    server = SimpleNamespace(core=core, call=lambda fn: fn())
    layer = SimpleNamespace(out_features=8, in_features=8)
    trainer = SimpleNamespace(
        job=SimpleNamespace(batch_size=1, model=SimpleNamespace(seq_len=4)),
        model=SimpleNamespace(gemm_layers=lambda: [layer]),
        dtype=SimpleNamespace(itemsize=4))
    runlog = SimpleNamespace(event=lambda *_a, **_k: None)
    with caplog.at_level(logging.INFO, logger=ps_main.log.name):
        ps_main._plan_ahead(server, trainer, runlog)  # type: ignore[arg-type]
    assert progress_line(2, 5, 30.4) in caplog.messages
    assert progress_line(2, 5, 30.4) == "planning: 2 of 5 GEMM shapes planned (30 s so far)"


def test_a_long_step_says_how_many_of_its_gemms_are_submitted(tmp_path: Path) -> None:
    """At 1,000 devices a step's device seconds crawled (1.062 -> 1.067 s in 30 s of wall
    time) and its tiles said nothing of how many were left: the line now says how many of the
    step's GEMMs are submitted, from 0 (or 1) up to all of them."""
    topology = load_topology(TINY).with_overrides(steps=1)
    seen: list[tuple[int, int]] = []
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    simulate_run.simulate(topology, run_dir, noise=False, report=False, during_every_s=0.0,
                          during=lambda *args: seen.append(args[-2:]))
    step_gemms = sum(len(group) for group in step_chain(topology.job))
    assert {of for _, of in seen} == {step_gemms} == {27}
    submitted = [gemms for gemms, _ in seen]
    assert submitted == sorted(submitted) and submitted[0] <= 1
    assert submitted[-1] == step_gemms
