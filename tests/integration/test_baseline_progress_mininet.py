"""A baseline's progress printed as it runs, read from the real commands' output: `testbed up`
of a pipeline that loses its stage to churn and restarts, and `testbed compare` of
data-parallel under churn on Mininet (lines prefixed by the strategy).

Needs root and the Mininet backend (skips naming what is missing).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from testbed.emulator.network.probe import probe

pytestmark = pytest.mark.integration

_missing = probe().missing()
needs_mininet = pytest.mark.skipif(bool(_missing), reason="Mininet backend unavailable, missing: "
                                                          + "; ".join(_missing))
D = 2
STEP = re.compile(r"step (\d+)( \(again, after a restart\))?: ([\d.]+) s device time "
                  r"\(([\d.]+) s wall\), loss ([\d.]+)")


def write_topology(tmp_path: Path, strategy: str, count: int, batch: int, layers: int,
                   link: dict[str, str]) -> Path:
    """A tiny float64 job (hidden 64) at D = 2: one pipeline stage holds the whole model."""
    raw = {"name": "progress", "seed": 3,
           "network": {"backend": "mininet", "switches": ["ap0"],
                       "ps": {"switch": "ap0", "link": {"down": "1Gbit", "up": "1Gbit"}}},
           "devices": [{"group": "phones", "profile": "snapdragon888", "count": count,
                        "switch": "ap0", "link": link}],
           "job": {"model": {"hidden": 64, "layers": layers, "heads": 2, "ffn": 128, "seq_len": 64},
                   "batch_size": batch, "steps": 4, "dtype": "float64",
                   "optimizer": {"lr": 1e-3},
                   "parallelism": {"strategy": strategy, "micro_batches": 4,
                                   "checkpoint_every": 2}},
           "time_dilation": D}
    path = tmp_path / f"{strategy}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_reading(argv: list[str], tmp_path: Path, timeout_s: float = 150.0
                ) -> tuple[list[tuple[float, str]], float, int]:
    """Run a testbed command; its stdout lines each with the time it was read, the time its
    output ended, and its exit code. Its log (stderr) goes to a file."""
    with (tmp_path / "stderr.log").open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", *argv],
                                stdout=subprocess.PIPE, stderr=err, text=True)
        watchdog = threading.Timer(timeout_s, proc.kill)
        watchdog.start()
        try:
            assert proc.stdout is not None
            lines = [(time.monotonic(), line.rstrip("\n")) for line in proc.stdout]
            ended = time.monotonic()
            code = proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return lines, ended, code


def index(lines: list[tuple[float, str]], pattern: str, start: int = 0) -> int:
    """The first line from ``start`` matching pattern (a regex)."""
    for i in range(start, len(lines)):
        if re.search(pattern, lines[i][1]):
            return i
    raise AssertionError(f"no line matches {pattern!r} after line {start}: "
                         + "\n".join(text for _, text in lines))


@needs_mininet
@pytest.mark.slow
def test_up_prints_a_pipelines_steps_and_its_restart_as_they_happen(tmp_path: Path) -> None:
    """40 steps of ~0.1 s wall on one stage; the stage's device crashes 2 s (trace 1 s x D) in:
    the step lines come in order while the run goes on, then the crash, the new placement and
    the steps from the checkpoint, those it had finished marked again; each step's device time
    is the one the summary takes its median of (the stages' reports, / D)."""
    path = write_topology(tmp_path, "pipeline", 2, 8, 4,
                          {"down": "100Mbit", "up": "50Mbit", "delay": "2ms"})
    trace = tmp_path / "crash.csv"
    trace.write_text("time_s,device,event,arg\n1.0,phones-0,crash,\n")
    out = tmp_path / "runs"
    lines, ended, code = run_reading(["up", str(path), "--steps", "40", "--churn", str(trace),
                                      "--out", str(out)], tmp_path)
    text = "\n".join(t for _, t in lines)
    assert code == 0, text
    placed = index(lines, r"^placed 1 stage: phones-0 \(layers 0-3\); starting its process$")
    started = index(lines, r"^1 stage connected [\d.]+ s after its process started: "
                           r"training starts$", placed)
    crash = index(lines, r"^churn: phones-0 crash \(trace 1 s\): stage 0's process killed",
                  started)
    restart = index(lines, r"^restart 1: placed again, 1 stage: phones-1 \(layers 0-3\); "
                           r"resumes at step (\d+) (from the checkpoint after step \d+|from "
                           r"the start \(no checkpoint yet\)), \d+ steps? redone$", crash)
    resumed = index(lines, r"training resumes$", restart)
    final = index(lines, r"^pipeline: \d+ steps, ", resumed)
    first = [(lines[i][0], STEP.match(lines[i][1])) for i in range(started + 1, crash)]
    second = [(lines[i][0], STEP.match(lines[i][1])) for i in range(resumed + 1, final)]
    assert first and second and all(m for _, m in first + second), text
    # in order, from step 0, and again from the checkpoint after the restart
    resume_at = int(re.search(r"resumes at step (\d+)", lines[restart][1]).group(1))
    assert [int(m.group(1)) for _, m in first] == list(range(len(first)))
    assert [int(m.group(1)) for _, m in second] == list(range(resume_at, 40))
    done_before = {int(m.group(1)) for _, m in first}  # "again": a step it had finished
    assert [bool(m.group(2)) for _, m in second] == [int(m.group(1)) in done_before
                                                     for _, m in second]
    # printed while the run went on, not at its end: it ran on for seconds after step 0's line
    assert ended - first[0][0] > 2.0, (ended - first[0][0], text)
    # the device times are the summary's: each step's slowest stage, / D; its median is over
    # every step run, both attempts', and its steps done are all 40
    (run_dir,) = out.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    report = json.loads((run_dir / "pipeline" / "stage0-attempt1.json").read_text())
    printed = [float(m.group(3)) for _, m in second]
    assert printed == [round(s / D, 3) for s in report["step_s"]]
    every_run = [float(m.group(3)) for _, m in first + second]
    assert statistics.median(every_run) == pytest.approx(summary["step_s"], abs=1e-3)
    assert summary["steps_done"] == 40 and lines[final][1].startswith("pipeline: 40 steps, ")
    assert "after 1 restart(s)" in summary["lost_work"], summary["lost_work"]
    assert [float(m.group(5)) for _, m in second] == [
        round(x, 6) for x in summary["losses"][resume_at:]]


@needs_mininet
@pytest.mark.slow
def test_compare_prints_data_parallels_steps_and_churn_prefixed_as_they_happen(
        tmp_path: Path) -> None:
    """`testbed compare` on Mininet, data-parallel only, phones-1 crashing at trace 0.3 s and
    back at 0.8 s: its lines, prefixed by the strategy, come before its row; the steps while
    phones-1 was away say so; the step times are the PS's, / D."""
    path = write_topology(tmp_path, "data-parallel", 3, 6, 2,
                          {"down": "100Mbit", "up": "50Mbit", "delay": "2ms"})
    trace = tmp_path / "churn.csv"
    trace.write_text("time_s,device,event,arg\n0.3,phones-1,crash,\n0.8,phones-1,join,\n")
    out = tmp_path / "cmp"
    lines, ended, code = run_reading(["compare", str(path), "--strategies", "data-parallel",
                                      "--steps", "8", "--churn", str(trace), "--out", str(out)],
                                     tmp_path)
    text = "\n".join(t for _, t in lines)
    assert code == 0, text
    begun = index(lines, r"^data-parallel: 8 step\(s\) on Mininet\.\.\.$")
    placed = index(lines, r"^  data-parallel: placed 3 replicas: phones-0 \(rows 0-1\), "
                          r"phones-1 \(rows 2-3\), phones-2 \(rows 4-5\)", begun)
    index(lines, r"^  data-parallel: 3 replicas connected to the PS .*training starts$", placed)
    crash = index(lines, r"^  data-parallel: churn: phones-1 crash \(trace 0\.3 s\): replica 1's "
                         r"process killed", placed)
    join = index(lines, r"^  data-parallel: churn: phones-1 join \(trace 0\.8 s\): replica 1's "
                        r"standby connects", crash)
    done = index(lines, r"^data-parallel: done, ", join)
    steps = [(i, STEP.search(t)) for i, (_, t) in enumerate(lines)
             if t.startswith("  data-parallel: step ")]
    assert [int(m.group(1)) for _, m in steps] == list(range(8)), text
    assert all(i < done for i, _ in steps)
    away = [i for i, _ in steps if lines[i][1].endswith("2 of 3 replicas (out: phones-1)")]
    assert away and all(i > crash for i in away), text
    assert not lines[steps[-1][0]][1].endswith(")"), text  # back by the last step
    assert ended - lines[steps[0][0]][0] > 1.0, text  # printed as it ran
    (cmp_dir,) = out.iterdir()
    ps = json.loads((cmp_dir / "data-parallel" / "data_parallel_emulated.json").read_text()
                    )["reports"]["ps"]
    assert [float(m.group(3)) for _, m in steps] == [
        round(s / D, 3) for s in ps["step_s"]]
