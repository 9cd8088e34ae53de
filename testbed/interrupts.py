"""Ctrl-C, SIGTERM and SIGHUP as one interrupt, and blocks an interrupt may not cut in two.

The command line (:func:`testbed.cli.main`) puts :func:`interrupt` on the three signals: it
raises KeyboardInterrupt, so a command's ``finally`` blocks run and an interrupted run keeps
what it did. A KeyboardInterrupt can come between any two lines, though, and some pairs of
lines must not be told apart: a finished step's line in ``steps.jsonl`` and the count its
summary gives (a simulated step written but not counted made a summary that said 12 steps
over 13 lines). Such pairs run inside :func:`held`: an interrupt that comes in it is raised as
the block ends.

One signal stops a command; the ones after it stop nothing more. The first raises (or is
held); from then on the handler does nothing (:func:`disarm`), so a second Ctrl-C, or the
SIGTERM a supervisor sends after it, cannot cut the teardown the first started (a
KeyboardInterrupt raised inside ``except KeyboardInterrupt`` ended ``testbed up`` with a
traceback, killed by SIGINT). A command that takes the signals itself (``testbed up``
while its run exists) disarms this handler when one comes, and the command line disarms it
once the command has returned: its exit code is decided. SIGKILL still ends a process at
once. :func:`arm` makes the next signal stop the next command again (the command line calls
it as a command starts).

Only this handler defers: a KeyboardInterrupt from Python's own SIGINT handler (a library
caller's Ctrl-C) still comes at once.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

_held = 0  # blocks under way (they nest)
_pending = False  # an interrupt came while one was
_armed = True  # the next signal stops the command (False: one already has, or it has ended)


def interrupt(_signum: int, _frame: Any) -> None:
    """The signal handler: KeyboardInterrupt now, or as the block under way ends; nothing
    once disarmed."""
    global _pending
    if not _armed:
        return
    disarm()
    if _held:
        _pending = True
        return
    raise KeyboardInterrupt


def arm() -> None:
    """A command starts: the next signal stops it (nothing left pending from one before)."""
    global _armed, _pending
    _armed, _pending = True, False


def disarm() -> None:
    """A stop is under way, or the command has ended: later signals are ignored."""
    global _armed
    _armed = False


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Run the block whole: an interrupt that comes in it is raised when it ends."""
    global _held, _pending
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _pending:
            _pending = False
            raise KeyboardInterrupt
