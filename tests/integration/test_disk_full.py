"""A disk that fills while `testbed up` trains: the run ends promptly (exit 1, one line), the
steps it recorded before stay, and nothing of it is left running.

Before, the PS's lease watcher and gRPC handlers died on the failed writes (status.json, events,
the tile journal), the step never finished and the run hung until killed. The run directory is
on a tmpfs of the test's own, filled by the test once training is under way; needs root (it
skips otherwise)."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, killed_at_exit, run_dir_of, start_up, wait_for

pytestmark = pytest.mark.integration
TINY = REPO / "tests" / "data" / "tiny.yaml"


@pytest.fixture
def small_disk(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(directory: Path) -> None:
    """Write a file until the file system is full. Unbuffered: a buffered file's close would
    try again to write what the full disk refused, and raise from the `with` line."""
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def test_a_disk_that_fills_during_training_ends_the_run_with_its_steps_kept(small_disk, tmp_path):
    out = small_disk / "runs"
    # a churn action every 0.2 s, so that testbed up's own replay thread writes events too
    trace = tmp_path / "slow.csv"
    trace.write_text("time_s,device,event,arg\n" + "".join(
        f"{i / 5:g},phones-0,slow,{1 + i % 2}\n" for i in range(1, 3000)))
    up = start_up(TINY, out, "--steps", "100000", "--churn", str(trace))
    with killed_at_exit(up):
        run_dir = run_dir_of(out)
        steps = run_dir / "steps.jsonl"
        wait_for(lambda: steps.exists() and len(steps.read_text().splitlines()) >= 2, 120,
                 "two steps recorded")
        pids = [p.pid for p in psutil.Process(up.pid).children(recursive=True)]
        _fill(small_disk)
        output, _ = up.communicate(timeout=90)  # it hung for ever before
    assert up.returncode == 1, output
    assert "No space left on device" in output and "Traceback" not in output, output
    recorded = steps.read_text().splitlines()
    assert len(recorded) >= 2  # what was written before is still there
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and
                                              psutil.Process(p).status() != "zombie"
                                              for p in pids):
        time.sleep(0.1)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive, alive
