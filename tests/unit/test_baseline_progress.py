"""The emulated baselines' progress as it goes: the records, their lines, and how the runner
reads the stages' and the PS's files while they are being written (no processes here; the
real runs are tests/integration/test_baseline_progress_mininet.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from testbed.baselines.emulate import (
    ChurnApplied,
    Connected,
    JsonlTail,
    PipelineSteps,
    Placed,
    Progress,
    StepDone,
    _replica_steps,
    layer_span,
    progress_line,
    row_span,
)


def test_a_step_line_says_device_time_wall_time_and_loss() -> None:
    line = progress_line(StepDone(3, 5.4887451, wall_s=2.5, dilation=2.0))
    assert line == "step 3: 1.250 s device time (2.50 s wall), loss 5.488745"
    again = progress_line(StepDone(3, None, wall_s=1.0, dilation=1.0, redo=True))
    assert again == "step 3 (again, after a restart): 1.000 s device time (1.00 s wall)"


def test_a_data_parallel_step_names_the_replicas_it_went_without() -> None:
    full = StepDone(0, 1.0, 1.0, 1.0, replicas=3)
    assert "replicas" not in progress_line(full)
    short = StepDone(0, 1.0, 1.0, 1.0, replicas=3, out=("phones-1",))
    assert progress_line(short).endswith(", 2 of 3 replicas (out: phones-1)")


def test_placements_and_restarts_say_where_and_from_which_step() -> None:
    first = Placed("stage", ("phones-1", "phones-2"), (layer_span(0, 1), layer_span(1, 4)))
    assert progress_line(first) == ("placed 2 stages: phones-1 (layer 0), phones-2 "
                                    "(layers 1-3); starting their processes")
    again = Placed("stage", ("phones-1",), (layer_span(0, 4),), attempt=1, start_step=4,
                   redone=3)
    assert progress_line(again) == (
        "restart 1: placed again, 1 stage: phones-1 (layers 0-3); resumes at step 4 from the "
        "checkpoint after step 3, 3 steps redone")
    fresh = Placed("stage", ("phones-3",), ("layers 0-3",), attempt=2, start_step=0, redone=1)
    assert "resumes at step 0 from the start (no checkpoint yet), 1 step redone" \
        in progress_line(fresh)
    dp = Placed("replica", ("phones-0", "phones-1"), (row_span([0, 1]), row_span([1, 4])))
    assert progress_line(dp).startswith("placed 2 replicas: phones-0 (row 0), phones-1 "
                                        "(rows 1-3)")
    assert layer_span(2, 2) == "no decoder layer"


def test_connected_and_churn_lines() -> None:
    assert progress_line(Connected("replica", 3, 11.94)) == (
        "3 replicas connected to the PS 11.9 s after their processes started: training starts")
    assert progress_line(Connected("stage", 1, 1.25, attempt=1)) == (
        "1 stage connected 1.2 s after its process started: training resumes")
    churn = ChurnApplied(1.5, "phones-0", "crash", "stage 0's process killed")
    assert progress_line(churn) == "churn: phones-0 crash (trace 1.5 s): stage 0's process killed"


def test_the_tail_reads_each_complete_line_once_and_waits_for_a_partial_one(
        tmp_path: Path) -> None:
    path = tmp_path / "progress0.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []  # not written yet
    with path.open("a") as fh:
        fh.write(json.dumps({"step": 0}) + "\n" + '{"step": ')
    assert tail.read() == [{"step": 0}]
    assert tail.read() == []  # the half-written line waits ...
    with path.open("a") as fh:
        fh.write('1}\n{"step": 2}\n')
    assert tail.read() == [{"step": 1}, {"step": 2}]  # ... and comes whole


def _report(path: Path, step_s: list[float]) -> None:
    path.write_text(json.dumps({"stage": 0, "step_s": step_s}))


def _progress(path: Path, step: int, loss: float, step_s: float) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps({"step": step, "loss": loss, "step_s": step_s}) + "\n")


def test_a_pipeline_step_waits_for_every_stage_and_takes_the_slowest(tmp_path: Path) -> None:
    """The summary times a step as its slowest stage (compare._emulated_row): a step's line
    waits until the other stages' reports have the step and says their maximum, / D."""
    said: list[Progress] = []
    progress = tmp_path / "progress1.jsonl"
    reports = [tmp_path / "stage0-attempt1.json", tmp_path / "stage1-attempt1.json"]
    executed: list[dict[str, Any]] = [{"step": 4, "loss": 2.0}]  # done in attempt 0
    steps = PipelineSteps(JsonlTail(progress), reports, 4, executed, said.append, 2.0)
    _progress(progress, 4, 2.0, 1.0)
    _report(reports[0], [3.0])
    steps()
    assert said == []  # stage 1 has not written its step 4 yet
    _report(reports[1], [2.0])
    steps()
    assert said == [StepDone(4, 2.0, 3.0, 2.0, redo=True)] and not executed[1]["partial"]
    assert isinstance(said[0], StepDone) and said[0].step_s == 1.5  # device seconds
    _progress(progress, 5, 1.5, 4.0)
    _report(reports[0], [3.0, 1.0])
    steps(final=True)  # the attempt ended: what there is
    assert said[1] == StepDone(5, 1.5, 4.0, 2.0, redo=False)
    assert executed[2]["partial"]  # stage 1 never timed it: left out of the row's median
    assert steps.steps == [4, 5] and [e["step"] for e in executed] == [4, 4, 5]


def test_data_parallel_steps_are_the_ps_lines_with_who_was_out(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    path.write_text(json.dumps({"step": 0, "loss": 3.0, "took_part": [0, 2], "step_s": 0.5})
                    + "\n")
    said: list[Progress] = []
    _replica_steps(JsonlTail(path), ["phones-0", "phones-1", "phones-2"], said.append, 1.0)
    assert said == [StepDone(0, 3.0, 0.5, 1.0, replicas=3, out=("phones-1",))]


def test_a_restarted_pipeline_counts_every_attempts_steps() -> None:
    """compare._emulated_row of a pipeline that restarted once after a crash: its steps done
    are the distinct steps of every attempt (not the last attempt's), its median the step runs'
    (from each run's slowest stage), its bytes per step run, and its lost work the restarts
    (it said "no churn replayed": only data-parallel's result has a churn list)."""
    from testbed.baselines.compare import _emulated_row
    from testbed.topology import load_topology

    topology = load_topology(Path(__file__).resolve().parents[2] / "topologies" / "default.yaml")
    stage = {"device": "phones-0", "step_s": [2.0], "device_s": 1.0, "energy_j": 2.0}
    res = {"stages": [stage], "attempt_reports": [stage, {**stage, "step_s": [2.0, 4.0]}],
           "executed": [{"step": 0, "loss": 3.0, "wall_s": 2.0},
                        {"step": 1, "loss": 2.5, "wall_s": 4.0},
                        # the crash: a stage killed before it timed step 2, which is redone
                        {"step": 2, "loss": 2.0, "wall_s": 0.2, "partial": True},
                        {"step": 1, "loss": 2.5, "wall_s": 2.0, "redo": True},
                        {"step": 2, "loss": 2.0, "wall_s": 2.0}],
           "wall_s": 20.0, "restarts": 1, "steps_redone": 2, "churn_events": 1,
           "links": {"phones-0": {"rx_bytes": 800, "tx_bytes": 400}},
           "losses": [3.0, 2.5, 2.0]}
    row = _emulated_row("pipeline", topology, res, 2.0, 475.0)
    assert row["steps_done"] == 3
    assert row["step_s"] == 1.0  # the median of 1, 2, 1, 1 device seconds (not the partial)
    assert row["down_bytes_per_device_step"] == 160 and row["up_bytes_per_device_step"] == 80
    assert row["energy_j_per_step"] == pytest.approx(row["energy_j"] / 3)
    assert row["lost_work"] == "2 steps redone after 1 restart(s)"


def test_compare_reads_tile_tps_lines_as_testbed_up_prints_them() -> None:
    """compare._run_up hands each line of `testbed up`'s output on as it comes (compare prints
    it as `  tile-tp: ...`), not when the run ends, and keeps its log apart for the error."""
    import sys
    import time

    from testbed.baselines.compare import _run_up

    seen: list[tuple[float, str]] = []
    code = ("import sys, time\nprint('step 0: loss 5.4', flush=True)\ntime.sleep(1.5)\n"
            "print('done: 1 step')\nsys.stderr.write('a log line\\n')\nsys.exit(3)\n")
    started = time.monotonic()
    done = _run_up([sys.executable, "-c", code],
                   line=lambda text: seen.append((time.monotonic() - started, text)))
    ended = time.monotonic() - started
    assert [text for _, text in seen] == ["step 0: loss 5.4", "done: 1 step"]
    assert ended - seen[0][0] > 1.0  # the first line came while the run went on
    assert done.returncode == 3 and done.stdout == "step 0: loss 5.4\ndone: 1 step\n"
    assert done.stderr == "a log line\n"
