"""SIGTERM to `testbed up` while it is still starting agents: it starts no more and tears down.
The signals after the first change nothing: the teardown runs on and the exit code is 130."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import TINY, catches, killed_at_exit, run_dir_of, start_up, wait_for

pytestmark = pytest.mark.integration
DEVICES = 60


def _agents(run_dir: Path) -> dict[str, int]:
    try:
        return json.loads((run_dir / "pids.json").read_text()).get("agents") or {}
    except (OSError, json.JSONDecodeError):
        return {}


def test_sigterm_during_agent_startup_stops_starting_and_tears_down(tmp_path: Path) -> None:
    raw = yaml.safe_load(TINY.read_text())
    raw["devices"] = [dict(raw["devices"][0], count=DEVICES)]
    path = tmp_path / "many.yaml"
    path.write_text(yaml.safe_dump(raw))
    proc = start_up(path, tmp_path / "runs")
    with killed_at_exit(proc):
        run_dir = run_dir_of(tmp_path / "runs", timeout_s=120)
        wait_for(lambda: _agents(run_dir), 180, "the first agent to start")
        at_signal = len(_agents(run_dir))
        proc.send_signal(signal.SIGTERM)
        signalled_s = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        took_s = time.monotonic() - signalled_s
    assert proc.returncode == 130, output
    started = _agents(run_dir)
    # at most the agent being started when the signal came; far fewer than DEVICES
    assert len(started) <= at_signal + 1 < DEVICES, (at_signal, len(started))
    pids = json.loads((run_dir / "pids.json").read_text())
    for pid in [pids["ps"], *started.values()]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 130 and summary["interrupted_by"] == ["SIGTERM"]
    print(f"stopped {took_s:.1f} s after SIGTERM with {len(started)} of {DEVICES} agents")


def _signals_back_to_back(pid: int) -> None:
    """INT, INT, TERM, 10 ms apart: the second and third come while the first's KeyboardInterrupt
    is handled, or once the command has returned (at once, the two INTs are one pending
    signal)."""
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
        os.kill(pid, sig)
        time.sleep(0.01)


@pytest.mark.parametrize("when", ["starting", "agents"])
def test_the_signals_after_the_first_change_nothing(tmp_path: Path, when: str) -> None:
    """Starting: the command line's own handler took them (0.3 s after start, exit 143, or -2
    with a traceback from inside `except KeyboardInterrupt`). Agents starting: `testbed up`'s."""
    out = tmp_path / "runs"
    proc = start_up(TINY, out)
    with killed_at_exit(proc):
        wait_for(lambda: catches(proc.pid, signal.SIGTERM), 60, "the SIGTERM handler")
        if when == "agents":
            wait_for(lambda: _agents(run_dir_of(out, timeout_s=120)), 180, "the first agent")
        _signals_back_to_back(proc.pid)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "interrupted" in output, output[-3000:]
    if when == "agents":
        summary = json.loads((run_dir_of(out) / "summary.json").read_text())
        assert summary["exit_code"] == 130 and summary["interrupted_by"][0] == "SIGINT"
