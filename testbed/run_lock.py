"""One `testbed up` per run directory: an exclusive ``flock`` on ``RUN_DIR/up.lock``.

`testbed up` takes it when it makes a run directory, and ``--resume`` before it reads anything
it will change; it is held until the command exits. `testbed simulate` holds its run's too, so
`testbed report` of it meanwhile says running rather than failed. The kernel drops a ``flock``
when its holder dies, ``kill -9`` included, so a held lock means a live `testbed up` (or
simulate), with no pid to go stale or be reused (two ``--resume`` of one run, two seconds apart,
both ran when the guard was "its PS pid is alive", written only once the PS had started). The
file stays empty: a refused ``--resume`` changes no file of the run, so the pid a message names
is pids.json's ``testbed_up`` (which the holder rewrites as it starts each process). The
descriptor is not inherited (PEP 446), so the PS and the agents do not hold it.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from testbed.runlog import RUN_JSON_MAX_BYTES
from testbed.user_paths import load_user_json, read_user_text

LOCK_NAME = "up.lock"


class RunLocked(Exception):
    """Another `testbed up` (or `testbed simulate`) holds the run directory."""

    def __init__(self, run_dir: Path, pid: int | None):
        self.run_dir, self.pid = run_dir, pid
        # pids.json names a testbed up; a testbed simulate writes none
        who = f"a `testbed up` (pid {pid})" if pid else \
            "a `testbed up` or `testbed simulate` (another process)"
        super().__init__(f"{run_dir}: {who} is running this run; stop it first (Ctrl-C where "
                         "it runs, or kill it)")


class RunLock:
    """The held lock of one run directory; :meth:`release` (or process exit) lets it go."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._fd: int | None = os.open(self.run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            raise RunLocked(self.run_dir, _up_pid(self.run_dir)) from None
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def holder(run_dir: Path) -> int | None:
    """The pid of the `testbed up` holding ``run_dir`` (0 when unknown), or None when none does."""
    try:
        # O_NONBLOCK: a FIFO put there would block an open for reading until a writer came
        # (`testbed clean` and `report` hung on one); no testbed up holds such a lock
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _up_pid(run_dir) or 0
    finally:
        os.close(fd)  # (closing drops the shared lock taken when it was free)
    return None


def _up_pid(run_dir: Path) -> int | None:
    """pids.json's ``testbed_up``, when it reads as one (for messages only)."""
    try:
        pid = load_user_json(read_user_text(Path(run_dir) / "pids.json", RUN_JSON_MAX_BYTES)).get(
            "testbed_up")
    except (OSError, ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None
