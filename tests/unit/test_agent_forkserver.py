"""The agent fork server: agents forked from one process that imported them (loopback: no
namespaces; tests/integration/test_mininet_run.py runs them in Mininet nodes through
`testbed up`, and test_agent_forkserver_mininet.py checks where they land)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from testbed.emulator.agent_forkserver import (
    MODULE,
    AgentForkServer,
    ForkServerGone,
    server_argv,
)
from tests.conftest import closed_port, wait_for

WAIT_S = 60.0  # a fork server imports numpy and grpc first: seconds on a loaded 2-core host


@pytest.fixture
def forkserver(tmp_path: Path) -> Iterator[AgentForkServer]:
    log_path = tmp_path / "forkserver.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(server_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    server = AgentForkServer(proc, log_path)
    yield server
    server.close()


def logged(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text()


def retrying_agent(forkserver: AgentForkServer, log: Path):
    """An agent whose PS is not there: it retries its join until it is stopped."""
    return forkserver.start(["--ps", f"127.0.0.1:{closed_port()}", "--name", "a-0"], log,
                            ns_pid=None)


def test_an_agent_with_bad_arguments_exits_2_with_its_message_in_its_log(forkserver, tmp_path):
    log = tmp_path / "a.log"
    agent = forkserver.start(["--name", "a-0"], log, ns_pid=None)  # --ps missing
    assert agent.wait(WAIT_S) == 2
    assert agent.poll() == 2
    assert "the following arguments are required: --ps" in log.read_text()


def test_a_forked_agent_runs_grpc_and_stops_on_sigterm(forkserver, tmp_path):
    log = tmp_path / "a.log"
    agent = retrying_agent(forkserver, log)
    # it got as far as a gRPC call (refused: nobody listens) and its backoff
    wait_for(lambda: logged(log, "joining again"), WAIT_S, f"a retry in {log}")
    assert agent.poll() is None
    # a fork of the server, not a new interpreter: the server's command line, its parent
    cmdline = Path(f"/proc/{agent.pid}/cmdline").read_bytes()
    assert MODULE.encode() in cmdline
    assert _parent_of(agent.pid) == forkserver.pid
    agent.terminate()
    assert agent.wait(WAIT_S) == 0  # the agent's own SIGTERM handler: a clean stop
    agent.terminate()  # known to have exited: nothing to signal, no error


def _parent_of(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[1])  # after the state: ppid


def test_a_killed_agent_reports_minus_the_signal(forkserver, tmp_path):
    agent = retrying_agent(forkserver, tmp_path / "a.log")
    with pytest.raises(subprocess.TimeoutExpired):
        agent.wait(0.2)
    agent.kill()
    assert agent.wait(WAIT_S) == -signal.SIGKILL


def test_agents_die_with_the_server_and_later_starts_fail(forkserver, tmp_path):
    agent = retrying_agent(forkserver, tmp_path / "a.log")
    wait_for(lambda: logged(tmp_path / "a.log", "joining again"), WAIT_S, "a retry")
    forkserver.close()
    assert agent.wait(WAIT_S) == -signal.SIGKILL
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and _alive(agent.pid):
        time.sleep(0.05)
    assert not _alive(agent.pid), "the agent outlived its fork server"
    with pytest.raises(ForkServerGone, match="fork server"):
        retrying_agent(forkserver, tmp_path / "b.log")


def test_a_killed_server_says_how_it_ended_at_the_next_start(forkserver, tmp_path):
    """What the churn replay's join gets when the server was SIGKILLed (one line, no
    traceback: tests/unit/test_up_run.py)."""
    agent = retrying_agent(forkserver, tmp_path / "a.log")
    forkserver.proc.kill()
    assert agent.wait(WAIT_S) == -signal.SIGKILL  # the server's end reached the client
    with pytest.raises(ForkServerGone) as gone:
        retrying_agent(forkserver, tmp_path / "b.log")
    assert str(gone.value) == (f"the agent fork server (pid {forkserver.pid}) was killed by "
                               f"SIGKILL; see {tmp_path / 'forkserver.log'}")


def _alive(pid: int) -> bool:
    """Running (a zombie, reaped by nobody in a container, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"
