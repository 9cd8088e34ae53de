"""SIGTERM to `testbed up` while it is still starting agents: it starts no more and tears down."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import TINY, killed_at_exit, run_dir_of, start_up, wait_for

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
