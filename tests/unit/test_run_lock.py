"""One `testbed up` per run directory (testbed/run_lock.py), and a LAN listen address that is
taken is refused before anything starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from testbed.cli import main
from testbed.ps_backend.tls import listen_problem
from testbed.run_lock import RunLock, RunLocked, holder
from tests.conftest import TINY


def test_a_held_run_directory_cannot_be_locked_again(tmp_path: Path) -> None:
    assert holder(tmp_path) is None
    lock = RunLock(tmp_path)
    assert holder(tmp_path) == 0  # held; who, pids.json says once the run has written it
    with pytest.raises(RunLocked, match=r"a `testbed up` or `testbed simulate` \(another process\) "
                                        r"is running"):
        RunLock(tmp_path)
    (tmp_path / "pids.json").write_text(f'{{"testbed_up": {os.getpid()}}}')
    assert holder(tmp_path) == os.getpid()
    with pytest.raises(RunLocked, match=rf"a `testbed up` \(pid {os.getpid()}\) is running"):
        RunLock(tmp_path)
    lock.release()
    assert holder(tmp_path) is None
    RunLock(tmp_path).release()
    assert (tmp_path / "up.lock").read_bytes() == b""  # taking it writes nothing


def test_the_lock_of_a_killed_holder_is_free(tmp_path: Path) -> None:
    """kill -9 leaves no stale lock: the kernel drops it with the process."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from testbed.run_lock import RunLock; "
         f"RunLock({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        assert holder(tmp_path) == 0
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert holder(tmp_path) is None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_resume_and_clean_refuse_a_run_that_is_running(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "topology.input.yaml").write_text(TINY.read_text())
    (run_dir / "up.json").write_text('{"steps": 5, "churn": null, "dilation": 1.0, '
                                     '"dilation_info": {"mode": "fixed"}}')
    lock = RunLock(run_dir)
    (run_dir / "pids.json").write_text(f'{{"testbed_up": {os.getpid()}}}')
    try:
        assert main(["up", "--resume", str(run_dir), "--no-live"]) == 2
        err = capsys.readouterr().err
        assert f"--resume {run_dir}: a `testbed up` (pid {os.getpid()}) is running" in err
        assert main(["clean", str(run_dir)]) == 2
        assert f"its `testbed up` (pid {os.getpid()}) is still running" in \
            capsys.readouterr().err
    finally:
        lock.release()
    assert sorted(p.name for p in run_dir.iterdir()) == ["pids.json", "topology.input.yaml",
                                                          "up.json", "up.lock"]


def test_a_listen_port_in_use_is_refused_before_anything_starts(tmp_path: Path, capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert "another process listens on that port" in \
            (listen_problem(f"127.0.0.1:{port}") or "")
        raw = yaml.safe_load(TINY.read_text())
        raw["network"]["ps"] = {"listen": f"127.0.0.1:{port}"}
        path = tmp_path / "lan.yaml"
        path.write_text(yaml.safe_dump(raw))
        out = tmp_path / "runs"
        assert main(["up", str(path), "--no-live", "--out", str(out)]) == 2
    assert f"network.ps.listen: cannot listen on 127.0.0.1:{port}: another process" in \
        capsys.readouterr().err
    assert not out.exists()
    assert listen_problem("0.0.0.0:0") is None
    assert "not an address of this machine" in (listen_problem("192.0.2.1:50051") or "")


def test_records_that_are_no_files_a_run_writes_do_not_hang_or_fill_memory(
        tmp_path: Path, capsys) -> None:
    """A FIFO as up.lock hung `testbed clean` and `report` (an open for reading waits for a
    writer); a FIFO as pids.json hung clean too, and a link to /dev/zero filled its memory."""
    os.mkfifo(tmp_path / "up.lock")
    assert holder(tmp_path) is None  # no testbed up holds a FIFO
    (tmp_path / "steps.jsonl").write_text("")
    for name, make in (("pids.json", lambda p: os.mkfifo(p)),
                       ("network.json", lambda p: os.mkfifo(p)),
                       ("pids.json", lambda p: p.symlink_to("/dev/zero"))):
        for other in ("pids.json", "network.json"):
            (tmp_path / other).unlink(missing_ok=True)
        make(tmp_path / name)
        assert main(["clean", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / name}: not a regular file" in err, err
