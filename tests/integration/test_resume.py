"""A PS killed with SIGKILL mid-step resumes with `testbed up --resume RUN_DIR` in the same step.

The interrupted step's tiles that were journaled before the kill are served from the ledger, not
computed again by devices, and the run ends with the single-process losses (float64).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from testbed.ps_backend.ledger import read_records, step_file_name
from testbed.runlog import read_jsonl
from tests.conftest import (
    REPO,
    TINY,
    cli_argv,
    killed_at_exit,
    read_status,
    reference_losses,
    run_dir_of,
    start_up,
    wait_for,
)

pytestmark = pytest.mark.integration
STEPS = 3
KILL_STEP = 2  # the last step: its journal stays after the run (compaction keeps one step)


def slow_tiny(tmp_path: Path) -> Path:
    """The tiny job with 20 ms links: a step lasts about a second. It opts into devices on
    other machines (a TLS port on loopback), whose certificate and token a resume keeps."""
    raw = yaml.safe_load(TINY.read_text())
    raw["job"].update(steps=STEPS, dtype="float64")
    raw["network"]["ps"] = {"listen": "127.0.0.1:0"}
    for group in raw["devices"]:
        group["link"] = {"down": "1Gbit", "up": "1Gbit", "delay": "20ms"}
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _keys(records) -> list[tuple[str, tuple[int, int, int, int]]]:
    return [(r.gemm, r.box) for r in records]


@pytest.mark.slow
def test_sigkilled_ps_resumes_in_the_same_step(tmp_path: Path) -> None:
    topology = slow_tiny(tmp_path)
    out = tmp_path / "runs"
    first = start_up(topology, out)
    with killed_at_exit(first):
        run_dir = run_dir_of(out)
        journal = run_dir / "ledger" / step_file_name(KILL_STEP)
        wait_for(lambda: read_status(run_dir).get("step", 0) >= KILL_STEP and journal.exists()
                 and len(read_records(journal).records) >= 20, 240,
                 f"step {KILL_STEP} under way with tiles journaled")
        ps_pid = json.loads((run_dir / "pids.json").read_text())["ps"]
        pinned = json.loads((run_dir / "ps.json").read_text())["fingerprint"]
        lan_address = json.loads((run_dir / "ps.json").read_text())["lan_address"]
        token = (run_dir / "join-token").read_text()
        os.kill(ps_pid, signal.SIGKILL)
        output, _ = first.communicate(timeout=120)
    assert first.returncode == 1, output  # the PS died: the run failed
    before = read_records(journal).records
    tiles_per_step = read_jsonl(run_dir / "steps.jsonl")[0]["tiles"]
    assert 0 < len(before) < tiles_per_step, "the kill did not land inside the step"
    assert json.loads((run_dir / "summary.json").read_text())["state"] == "failed"

    resumed = subprocess.run(cli_argv("up", "--resume", str(run_dir), "--no-live"), cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    # the devices that joined from other machines pin this certificate and hold this token,
    # and retry this address (listen port 0: the port the run had, free again)
    assert json.loads((run_dir / "ps.json").read_text())["fingerprint"] == pinned
    assert json.loads((run_dir / "ps.json").read_text())["lan_address"] == lan_address
    assert (run_dir / "join-token").read_text() == token and pinned in resumed.stdout

    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(STEPS))  # no step twice, none missing
    want, _ = reference_losses(topology, STEPS)
    for s, w in zip(steps, want):
        assert abs(s["loss"] - w) <= 1e-8 * abs(w), (s["step"], s["loss"], w)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "done" and summary["steps_done"] == STEPS
    assert abs(summary["final_loss"] - want[-1]) <= 1e-8 * abs(want[-1])
    assert len(summary["losses"]) == STEPS

    # the interrupted step: journaled tiles served from the ledger, the rest from devices
    redone = steps[KILL_STEP]
    assert redone["tiles_from_ledger"] == len(before)
    assert redone["tiles"] + redone["tiles_from_ledger"] == tiles_per_step
    after = read_records(journal).records
    assert _keys(after[:len(before)]) == _keys(before)  # the journal was only appended to
    assert len(set(_keys(after))) == len(after) == tiles_per_step  # no tile computed twice
    events = read_jsonl(run_dir / "events.jsonl")
    resume = [e for e in events if e["event"] == "ps_resume"]
    assert len(resume) == 1 and resume[0]["next_step"] == KILL_STEP
    reused = [e for e in events if e["event"] == "ledger_reuse"]
    assert sum(e["tiles"] for e in reused) == len(before)
    assert all(e["step"] == KILL_STEP for e in reused)


def test_resume_refuses_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    done = subprocess.run(cli_argv("up", "--resume", str(tmp_path), "--no-live"), cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "up.json not found" in done.stderr and str(tmp_path) in done.stderr


@pytest.mark.parametrize("name, text, words", [
    ("up.json", '{"steps": 3, "churn": null,', "up.json: not readable JSON"),
    ("up.json", '{"steps": "3", "churn": null, "dilation": 1.0, "dilation_info": {}}',
     "up.json: not as testbed up writes it; wrong type: steps ('3')"),
])
def test_resume_names_a_damaged_run_file(tmp_path: Path, name: str, text: str,
                                         words: str) -> None:
    (tmp_path / "topology.input.yaml").write_text((REPO / "topologies/default.yaml").read_text())
    (tmp_path / "up.json").write_text('{"steps": 3, "churn": null, "dilation": 1.0, '
                                      '"dilation_info": {"mode": "fixed"}}')
    (tmp_path / name).write_text(text)
    done = subprocess.run(cli_argv("up", "--resume", str(tmp_path), "--no-live"), cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr, done.stderr
