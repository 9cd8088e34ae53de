"""Runtime faults of a real `testbed up` on loopback (tests/unit/test_run_faults.py has the
logic of each without processes): the run stopped with Ctrl-Z for longer than a lease and the
watchdog trains on after ``fg``; a run whose PS is killed says how many steps it did; a run
whose ``ledger/`` is removed fails naming the directory."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from testbed.runlog import read_jsonl
from tests.conftest import REPO, TINY, cli_argv, read_status, run_dir_of, wait_for

pytestmark = pytest.mark.integration


def _topology(tmp_path: Path, steps: int, **job: object) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw["job"].update(steps=steps, **job)
    for group in raw["devices"]:  # ~0.3 s a step: room to act between steps
        group["link"] = {"down": "1Gbit", "up": "1Gbit", "delay": "10ms"}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@contextlib.contextmanager
def _up(topology: Path, out: Path) -> Iterator[subprocess.Popen]:
    """`testbed up` in a process group of its own (what a terminal's job is), killed with
    every process of its group when the block ends, however it ends."""
    proc = subprocess.Popen(cli_argv("up", str(topology), "--no-live", "--out", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)


def _step(run_dir: Path, at_least: int) -> bool:
    return read_status(run_dir).get("step", 0) >= at_least


def test_ctrl_z_longer_than_a_lease_and_the_watchdog_then_fg_trains_on(tmp_path: Path) -> None:
    """SIGSTOP to the whole job for 7 s (lease 5 s, no_progress_s 3 s), then SIGCONT: before,
    the PS dropped every device on waking and failed "no device attached for 7 s"."""
    out = tmp_path / "runs"
    with _up(_topology(tmp_path, steps=8, watchdog={"no_progress_s": 3}), out) as up:
        run_dir = run_dir_of(out)
        wait_for(lambda: _step(run_dir, 2), 120, "step 2")
        os.killpg(up.pid, signal.SIGSTOP)  # Ctrl-Z
        time.sleep(7)
        os.killpg(up.pid, signal.SIGCONT)  # fg
        output, _ = up.communicate(timeout=180)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert up.returncode == 0 and summary["state"] == "done", output
    events = read_jsonl(run_dir / "events.jsonl")
    paused = [e for e in events if e.get("event") == "ps_paused"]
    assert len(paused) == 1 and 6 < paused[0]["seconds"] < 8, paused
    assert not [e for e in events if e.get("event") in ("lease_expired", "watchdog")]


def test_a_ps_killed_mid_run_leaves_a_summary_with_the_steps_it_recorded(tmp_path: Path) -> None:
    """Before: summary.json {"state": "failed"} and "failed: 0 steps, final loss None"."""
    out = tmp_path / "runs"
    with _up(_topology(tmp_path, steps=1000), out) as up:
        run_dir = run_dir_of(out)
        wait_for(lambda: _step(run_dir, 2), 120, "step 2")
        os.kill(json.loads((run_dir / "pids.json").read_text())["ps"], signal.SIGKILL)
        output, _ = up.communicate(timeout=120)
    steps = read_jsonl(run_dir / "steps.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert up.returncode == 1 and not (run_dir / "ps_summary.json").exists(), output
    assert summary["state"] == "failed" and summary["steps_done"] == len(steps) >= 2, summary
    assert summary["losses"] == [s["loss"] for s in steps]
    assert f"failed: {len(steps)} steps, final loss {steps[-1]['loss']:.4f}" in output, output
    report = (run_dir / "report.md").read_text()
    assert f"- steps: {len(steps)} of 1000; final loss {steps[-1]['loss']:.4f}" in report


def test_a_run_whose_ledger_is_removed_fails_naming_it(tmp_path: Path) -> None:
    """Before: error "FileNotFoundError(2, 'No such file or directory')", without the path."""
    out = tmp_path / "runs"
    with _up(_topology(tmp_path, steps=1000), out) as up:
        run_dir = run_dir_of(out)
        wait_for(lambda: _step(run_dir, 1), 120, "step 1")
        shutil.rmtree(run_dir / "ledger")
        output, _ = up.communicate(timeout=120)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert up.returncode == 1 and summary["state"] == "failed", output
    # found by the next segment's open (FileNotFoundError) or by the journal's append under
    # way (the run's records cannot be written), whichever comes first: both name the path
    ledger = str(run_dir / "ledger")
    assert summary["error"].startswith(("FileNotFoundError: ", "cannot write the run's records")) \
        and ledger in summary["error"], summary["error"]
    assert f"error: {summary['error']}" in output, output


def test_an_agent_that_dies_unasked_is_said_during_and_after_the_run(tmp_path: Path) -> None:
    """An agent killed by no churn event (the OOM killer, a bug): the PS trains on without it,
    and the run says so, in its output, events.jsonl and summary.json, with a warning at the
    end. Before, only a `disconnect` event told, and the summary read as a full run."""
    out = tmp_path / "runs"
    steps = 6
    with _up(_topology(tmp_path, steps=steps), out) as up:
        run_dir = run_dir_of(out)
        wait_for(lambda: _step(run_dir, 1), 120, "step 1")
        name, pid = sorted(json.loads((run_dir / "pids.json").read_text())["agents"].items())[0]
        os.kill(pid, signal.SIGKILL)
        output, _ = up.communicate(timeout=120)
    assert up.returncode == 0, output
    died = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "agent_died"]
    assert [(e["device"], e["exit"]) for e in died] == [(name, "SIGKILL")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "done" and summary["steps_done"] == steps
    assert [d["device"] for d in summary["agent_deaths"]] == [name]
    assert f"{name}'s agent died (SIGKILL) and no churn event asked it to" in output, output
    words = " ".join(output.split())  # the console wraps long lines
    assert f"WARNING: 1 device agent(s) died with no churn event asking them to: {name} " \
           "(SIGKILL)" in words, output


def test_the_agents_fork_server_killed_is_named_as_the_cause(tmp_path: Path) -> None:
    """The process every agent is forked from, killed (the OOM killer's largest target): every
    agent dies with it, and the run says why before it says that each died."""
    out = tmp_path / "runs"
    with _up(_topology(tmp_path, steps=1000), out) as up:
        run_dir = run_dir_of(out)
        wait_for(lambda: _step(run_dir, 1), 120, "step 1")
        os.kill(json.loads((run_dir / "pids.json").read_text())["agent_forkserver"],
                signal.SIGKILL)
        output, _ = up.communicate(timeout=120)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert up.returncode == 1 and summary["state"] == "failed", output
    # the run's error names the fork server as the cause (no agent can start again)
    assert ("was killed by SIGKILL; see " in summary["error"]
            and "every agent it forked died with it, and no agent can start any more"
            in summary["error"]), summary["error"]
    cause = output.index("was killed by SIGKILL; see ")
    assert "every agent it forked died with it" in output, output
    assert cause < output.index("'s agent died (SIGKILL)"), output
    events = [e["event"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert events.count("agent_forkserver_died") == 1 and events.count("agent_died") == 4
