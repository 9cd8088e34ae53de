"""Unlucky moments of a real `testbed up` (tiny job on loopback): what goes wrong around a run
rather than in it must not cost the run its summary, its report or a clear reason.

* the reader of its output goes away (`testbed up ... | head`): the run goes on to the end;
* the terminal closes (SIGHUP to the whole process group): it stops as on SIGTERM, resumable;
* every agent is killed: the run fails within seconds, saying so, not after the PS's
  120 s watchdog blaming the devices;
* a child that cannot be reaped (its fork server stopped) does not stop the teardown;
* the agents' fork server killed with a join of the churn trace ahead: the join fails the run
  in one line, not a traceback from the replay's thread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from testbed.up import REAP_S, STOP_GRACE_S
from tests.conftest import (
    REPO,
    cli_argv,
    killed_at_exit,
    read_status,
    run_dir_of,
    tiny_topology,
    wait_for,
)

pytestmark = pytest.mark.integration
SLOW_LINKS = {"down": "1Gbit", "up": "1Gbit", "delay": "20ms"}  # about 1 s a step


def slow_tiny(tmp_path: Path, steps: int) -> Path:
    path = tiny_topology(tmp_path, steps=steps)
    text = path.read_text().replace("delay: 0ms", "delay: 20ms")
    path.write_text(text)
    return path


def start(topology: Path, out: Path) -> subprocess.Popen:
    """`testbed up` in a session of its own, as a terminal's foreground job is a group."""
    return subprocess.Popen(cli_argv("up", str(topology), "--no-live", "--out", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, start_new_session=True)


def steps_done(run_dir: Path) -> int:
    try:
        return len((run_dir / "steps.jsonl").read_text().splitlines())
    except OSError:
        return 0


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_reader_that_goes_away_does_not_stop_the_run(tmp_path: Path) -> None:
    # 3 steps: after step 0's line, two more steps' lines and the end's go to no reader
    proc = start(slow_tiny(tmp_path, steps=3), tmp_path / "runs")
    with killed_at_exit(proc):
        assert proc.stdout is not None
        for line in proc.stdout:  # `| head`: read until the first step, then go away
            if line.startswith("step 0:"):
                break
        proc.stdout.close()
        assert proc.wait(120) == 0
    run_dir = run_dir_of(tmp_path / "runs")
    assert summary(run_dir)["state"] == "done" and summary(run_dir)["steps_done"] == 3
    assert (run_dir / "report.md").exists()


def test_a_closed_terminal_stops_the_run_as_sigterm_does(tmp_path: Path) -> None:
    proc = start(slow_tiny(tmp_path, steps=30), tmp_path / "runs")
    with killed_at_exit(proc):
        run_dir = run_dir_of(tmp_path / "runs")
        wait_for(lambda: steps_done(run_dir) >= 1, 120, "the first step")
        os.killpg(proc.pid, signal.SIGHUP)  # the kernel's hangup reaches the foreground group
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    got = summary(run_dir)
    assert got["interrupted_by"] == ["SIGHUP"] and got["state"] == "interrupted", got
    assert 1 <= got["steps_done"] < 30 and (run_dir / "report.md").exists()


def test_every_agent_killed_fails_the_run_at_once(tmp_path: Path) -> None:
    proc = start(slow_tiny(tmp_path, steps=60), tmp_path / "runs")
    with killed_at_exit(proc):
        run_dir = run_dir_of(tmp_path / "runs")
        wait_for(lambda: steps_done(run_dir) >= 1, 120, "the first step")
        agents = json.loads((run_dir / "pids.json").read_text())["agents"]
        for pid in agents.values():
            os.kill(pid, signal.SIGKILL)
        killed_s = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        took_s = time.monotonic() - killed_s
    assert proc.returncode == 1, output
    assert f"every device's agent has died ({len(agents)} of them: SIGKILL)" in output, output
    assert took_s < 60, took_s  # the PS's watchdog would take 120 s
    assert summary(run_dir)["state"] == "failed"


def test_a_child_that_cannot_be_reaped_does_not_stop_the_teardown(tmp_path: Path) -> None:
    """With the agents' fork server stopped, their exits never arrive: they are waited for a
    bounded time, all together, and the summary and report are still written."""
    proc = start(slow_tiny(tmp_path, steps=30), tmp_path / "runs")
    server = None
    with killed_at_exit(proc):
        run_dir = run_dir_of(tmp_path / "runs")
        wait_for(lambda: steps_done(run_dir) >= 1, 120, "the first step")
        server = json.loads((run_dir / "pids.json").read_text())["agent_forkserver"]
        try:
            os.kill(server, signal.SIGSTOP)
            start_s = time.monotonic()
            proc.send_signal(signal.SIGINT)
            output, _ = proc.communicate(timeout=180)
            took_s = time.monotonic() - start_s
        finally:
            if psutil.pid_exists(server):
                os.kill(server, signal.SIGKILL)
    assert proc.returncode == 130, output
    # the agents' grace, then one reaping deadline for all of them (REAP_S each, one after
    # another, took 31 s with this topology's four agents), then the stopped fork server's own
    # close: 16 s here, 10 s of room for the report and a slower host
    assert took_s < STOP_GRACE_S + REAP_S + 5.0 + 10.0, took_s
    assert "Traceback" not in output, output
    assert summary(run_dir)["interrupted_by"] == ["SIGINT"]
    assert (run_dir / "report.md").exists()


def test_a_ps_stopped_by_a_signal_of_its_own_is_an_interrupted_run(tmp_path: Path) -> None:
    """SIGTERM to the PS alone (not to `testbed up`): the PS stops as interrupted, and so does
    the run (130, as for any interrupted run), not a failure."""
    proc = start(slow_tiny(tmp_path, steps=30), tmp_path / "runs")
    with killed_at_exit(proc):
        run_dir = run_dir_of(tmp_path / "runs")
        wait_for(lambda: steps_done(run_dir) >= 1, 120, "the first step")
        os.kill(json.loads((run_dir / "pids.json").read_text())["ps"], signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert summary(run_dir)["state"] == "interrupted" and summary(run_dir)["exit_code"] == 130


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def test_a_run_whose_fork_server_was_killed_fails_at_once_in_one_line(
        tmp_path: Path) -> None:
    """Its agents die with it, and a join the trace still has (an hour away) cannot start
    one: the run fails within seconds, saying so, where it waited for the join (or for the
    PS's watchdog, which blamed the devices). The join's own line: test_up_run.py."""
    trace = tmp_path / "join.csv"
    trace.write_text("time_s,device,event,arg\n3600,phones-2,join,\n")  # absent until then
    topology = slow_tiny(tmp_path, steps=1000)
    topology.write_text(topology.read_text() + f"churn: {trace}\n")
    proc = start(topology, tmp_path / "runs")
    with killed_at_exit(proc):
        run_dir = run_dir_of(tmp_path / "runs")
        wait_for(lambda: read_status(run_dir).get("state") == "training", 120, "training")
        server = json.loads((run_dir / "pids.json").read_text())["agent_forkserver"]
        assert _parent(server) == proc.pid  # this run's, and no one else's
        os.kill(server, signal.SIGKILL)
        killed = time.monotonic()
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, output
    assert time.monotonic() - killed < 60, output  # not the join's hour, nor the watchdog
    assert "Traceback" not in output, output
    assert (f"the agent fork server (pid {server}) was killed by SIGKILL; see "
            f"{run_dir / 'agents' / 'forkserver.log'}: every agent it forked died with it, and "
            "no agent can start any more (the churn trace's joins neither), so no step can "
            "finish") in output, output
    assert summary(run_dir)["state"] == "failed"
