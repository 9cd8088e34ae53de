"""Shared fixtures: topologies written into tmp dirs, `testbed up` as a subprocess, and a
session-wide reaper so that no test leaves a child process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import pytest
import yaml

# Before anything here starts gRPC: its fork handlers crashed children forked from this process
# (subprocess with a preexec_fn) once tests had used gRPC, SIGSEGV before exec in 106 of 300
# forks of a probe; with fork support off, none. The product's own processes that fork with a
# preexec_fn (`testbed up`) never start gRPC themselves.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "data" / "tiny.yaml"


def tiny_topology(tmp_path: Path, name: str = "tiny", **changes: Any) -> Path:
    """tests/data/tiny.yaml with top-level or job-level keys changed, written into tmp_path."""
    raw = yaml.safe_load(TINY.read_text())
    for key, value in changes.items():
        if key in raw["job"]:
            raw["job"][key] = value
        else:
            raw[key] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def planning_topology(tmp_path: Path) -> Path:
    """The tiny job on 10 MB/s links, where the planner's searches choose among grids (hidden
    128, 4,096 tokens a step, float32 as the PS trains it), written into tmp_path."""
    raw = yaml.safe_load(TINY.read_text())
    for group in raw["devices"]:
        group["link"] = {"down": "10MB/s", "up": "10MB/s", "delay": "5ms"}
    raw["job"]["model"].update(hidden=128, ffn=512, seq_len=64)
    raw["job"]["dtype"] = "float32"
    path = tmp_path / "planning.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def planning_child_takes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning side by side: this process takes its first linear only once a planning
    process (unpatched) has taken one; without it a small job's linears may all be taken here
    before the child has started, and nothing would come back to merge."""
    from testbed.ps_backend import planning_processes

    real_take = planning_processes._Counter.take

    def take_after_the_other(counter: Any) -> int | None:
        if threading.current_thread() is threading.main_thread():
            deadline = time.monotonic() + 60
            while counter.next == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        return real_take(counter)
    monkeypatch.setattr(planning_processes._Counter, "take", take_after_the_other)


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "testbed.cli", *args]


@pytest.fixture
def cli_here(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
             ) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``cli_here(*argv, env=None)``: `testbed ARGV` through the command line's entry point in
    this process, ``env`` set for the call, and what a subprocess would show: its exit code,
    stdout and stderr (no interpreter and no torch import to wait for)."""
    from testbed.cli import main

    def run(*argv: str, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        with monkeypatch.context() as m:
            for key, value in (env or {}).items():
                m.setenv(key, value)
            code = main(list(argv))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["testbed", *argv], code, out.out, out.err)
    return run


def start_up(topology: Path, out: Path, *extra: str) -> subprocess.Popen:
    """Start `testbed up TOPOLOGY --no-live --out OUT` as a user would."""
    return subprocess.Popen(cli_argv("up", str(topology), "--no-live", "--out", str(out),
                                        *extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO)


@contextlib.contextmanager
def killed_at_exit(*procs: subprocess.Popen) -> Iterator[None]:
    """Kill and reap those of ``procs`` still running when the block ends, however it ends: a
    failed wait or assertion must not leave a `testbed up` (or a process it started) running
    into the next test. A process the block saw end is left as it is."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()  # reaped, and its pipe drained


def run_dir_of(out: Path, timeout_s: float = 60) -> Path:
    """The (single) run directory `testbed up` made under out, once it exists."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dirs = [d for d in out.glob("*") if d.is_dir()] if out.exists() else []
        if dirs:
            return dirs[0]
        time.sleep(0.05)
    raise TimeoutError(f"no run directory under {out}")


def read_status(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def closed_port() -> int:
    """A loopback port nothing listens on, outside the ephemeral range, where another test's
    connection could take a port released a moment before (tests/fakes/ports.py)."""
    from tests.fakes.ports import free_ports

    return free_ports(1)


def wait_for(predicate: Any, timeout_s: float = 15.0, what: str = "") -> Any:
    """``predicate()``'s first true value, polled every 50 ms; TimeoutError after
    ``timeout_s`` naming ``what`` (else the predicate)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what or predicate}")


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler of its own on ``sig`` (``SigCgt`` in its
    /proc status): a signal sent before then takes the default action (SIGTERM: exit -15). A
    test that signals a command it just started waits for this instead of sleeping a guess
    (a loaded host took 2-3 s to import the command line)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((line.split()[1] for line in status.splitlines()
                   if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) >> (sig - 1) & 1)


def stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (state ``T`` in its /proc stat): a
    SIGSTOP is sent when kill() returns, not yet acted on, and a test that signals another
    process next must not race it."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
        states = [Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0]
                  for t in threads]
    except OSError:  # a thread ended while it was read: look again
        return False
    return bool(states) and all(state in ("T", "t") for state in states)


def host_cmdlines() -> list[str]:
    """Every process's command line on this host; one that exits while /proc is read is
    skipped (read once each: a check and then a second read fail when it ends between)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                out.append((Path("/proc") / d / "cmdline").read_bytes().decode(errors="replace"))
            except OSError:
                pass
    return out


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for the test, and the count it had back afterwards (the pool is
    the process's: left at 1, every later test would run single-threaded)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference_losses(topology: Path, steps: int) -> tuple[list[float], dict[str, Any]]:
    """Losses and final weights of the same job trained in one process, no devices."""
    from testbed.ps_backend.engine.trainer import Trainer
    from testbed.topology import load_topology

    topo = load_topology(topology)
    trainer = Trainer(topo.job, topo.seed, executor=None)
    losses = [r.loss for r in trainer.run(steps)]
    return losses, {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="session", autouse=True)
def reap_children() -> Iterator[None]:
    """After the session: kill any child process a test left behind (and fail loudly)."""
    yield
    leftovers = psutil.Process(os.getpid()).children(recursive=True)
    for child in leftovers:
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    if leftovers:
        print(f"reaped {len(leftovers)} stray child process(es): "
              f"{[c.pid for c in leftovers]}", file=sys.stderr)
