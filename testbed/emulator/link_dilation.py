"""The links follow a new time dilation: the PS asks the run's owner, and waits, between steps.

An adaptive run changes D in the PS (after its probe, and between steps). The agents follow by
themselves (``ServerMessage.time_dilation``: their holds, clocks and application-level links),
but what the kernel shapes - Mininet's HTB rates, netem's delays - and the churn replay's clock
belong to ``testbed up``, another process. Without them a run at D = 24 kept the rates of
D = 3: its links were 8 times too fast in device time, and its device time came out below the
step's lower bound (efficiency 1.89; docs/architecture.md, "Time").

The two processes share the run directory, so the request and its answer are two small files:

    PS:     dilation.request.json  {"id": "<pid>-<n>", "dilation": D}   then waits
    owner:  dilation.applied.json  {"id": "<pid>-<n>", "dilation": D, "error": null | "..."}

The id carries the PS's pid: a resumed PS never takes an answer meant for the one before it.
Nothing else runs meanwhile: D changes only between steps, with no tile in flight.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from testbed.runlog import write_json_atomic

log = logging.getLogger(__name__)

REQUEST = "dilation.request.json"
APPLIED = "dilation.applied.json"
POLL_S = 0.02
TIMEOUT_S = 120.0  # shaping ~1,000 interfaces again takes a few seconds; a dead owner, forever


class LinksDidNotFollow(RuntimeError):
    """The run's owner did not move the links to the new D (or said why it could not)."""


class DilationRequester:
    """The PS's side: ask for the links at D, return once they are."""

    def __init__(self, run_dir: Path, timeout_s: float = TIMEOUT_S):
        self.run_dir = Path(run_dir)
        self.timeout_s = timeout_s
        self.count = 0

    def __call__(self, dilation: float) -> None:
        self.count += 1
        request_id = f"{os.getpid()}-{self.count}"
        write_json_atomic(self.run_dir / REQUEST, {"id": request_id, "dilation": dilation})
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            answer = _read(self.run_dir / APPLIED)
            if answer is not None and answer.get("id") == request_id:
                if answer.get("error"):
                    raise LinksDidNotFollow(f"the links could not move to time dilation "
                                            f"{dilation:.4g}: {answer['error']}")
                return
            time.sleep(POLL_S)
        raise LinksDidNotFollow(f"the links did not move to time dilation {dilation:.4g} within "
                                f"{self.timeout_s:g} s (no answer in "
                                f"{self.run_dir / APPLIED})")


class DilationFollower:
    """The owner's side: :meth:`poll` applies a new request once and answers it."""

    def __init__(self, run_dir: Path, apply: Callable[[float], None]):
        self.run_dir = Path(run_dir)
        self.apply = apply
        self.last_id: str | None = None

    def poll(self) -> None:
        """Apply a request not seen before, once, and answer it."""
        request = _read(self.run_dir / REQUEST)
        if request is None or request.get("id") == self.last_id:
            return
        self.last_id = request.get("id")
        dilation = float(request["dilation"])
        error = None
        try:
            self.apply(dilation)
        except Exception as exc:  # answered, so that the PS fails with the reason
            log.exception("links at time dilation %.4g failed", dilation)
            error = f"{type(exc).__name__}: {exc}"
        write_json_atomic(self.run_dir / APPLIED, {"id": self.last_id, "dilation": dilation,
                                                   "error": error})


def _read(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
