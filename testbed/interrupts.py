"""Ctrl-C, SIGTERM and SIGHUP as one interrupt, and blocks an interrupt may not cut in two.

The command line (:func:`testbed.cli.main`) puts :func:`interrupt` on the three signals: it
raises KeyboardInterrupt, so a command's ``finally`` blocks run and an interrupted run keeps
what it did. A KeyboardInterrupt can come between any two lines, though, and some pairs of
lines must not be told apart: a finished step's line in ``steps.jsonl`` and the count its
summary gives (a simulated step written but not counted made a summary that said 12 steps
over 13 lines). Such pairs run inside :func:`held`: an interrupt that comes in it is raised as
the block ends.

Only this handler defers: a KeyboardInterrupt from Python's own SIGINT handler (a library
caller's Ctrl-C) still comes at once.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

_held = 0  # blocks under way (they nest)
_pending = False  # an interrupt came while one was


def interrupt(_signum: int, _frame: Any) -> None:
    """The signal handler: KeyboardInterrupt now, or as the block under way ends."""
    global _pending
    if _held:
        _pending = True
        return
    raise KeyboardInterrupt


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
