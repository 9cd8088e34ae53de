"""How long the PS waits for its expected devices before training (``_wait_for_devices``).

A fake server stands in for the gRPC one: its ``call`` runs the function as the loop thread
would, and a timer thread attaches devices (an open Work stream each) at chosen times.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from testbed.ps_backend.main import _wait_for_devices


class _Server:
    def __init__(self) -> None:
        self.core = SimpleNamespace(conns={}, watchdog_reason=None)
        self.lock = threading.Lock()

    def call(self, fn):  # type: ignore[no-untyped-def]
        with self.lock:
            return fn()

    def attach_at(self, times_s: list[float]) -> threading.Thread:
        """Attach one device at each of these seconds from now."""
        start = time.monotonic()

        def run() -> None:
            for i, at in enumerate(times_s):
                time.sleep(max(0.0, start + at - time.monotonic()))
                with self.lock:
                    slot = SimpleNamespace(name=f"d{i}")
                    self.core.conns[i] = SimpleNamespace(slot=slot, outbox=object())
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def test_the_wait_runs_from_the_last_arrival_while_devices_keep_coming() -> None:
    """Devices that keep arriving, each within the timeout of the one before, are all waited
    for, though the last comes long after the timeout from the start (as `testbed up`'s 240
    agents of large.yaml, started one after another, attach over 78-95 s)."""
    server = _Server()
    arrivals = [0.5, 1.0, 1.5, 2.0, 2.5]  # 1.5 s apart at most: a gap shorter than the timeout
    thread = server.attach_at(arrivals)
    started = time.monotonic()
    joined = _wait_for_devices(server, 5, 1.5, threading.Event())  # type: ignore[arg-type]
    waited = time.monotonic() - started
    thread.join()
    assert joined == 5
    assert waited >= arrivals[-1] - 0.05  # it waited for the last one ...
    assert waited < arrivals[-1] + 1.5  # ... and returned once it came, not at a deadline


def test_a_device_that_never_comes_costs_the_timeout_after_the_last_arrival() -> None:
    server = _Server()
    thread = server.attach_at([0.3, 0.6])
    started = time.monotonic()
    joined = _wait_for_devices(server, 3, 1.0, threading.Event())  # type: ignore[arg-type]
    waited = time.monotonic() - started
    thread.join()
    assert joined == 2
    assert 0.6 + 1.0 - 0.05 <= waited < 0.6 + 1.0 + 1.0  # the timeout, from the last arrival


def test_with_no_arrival_the_wait_is_the_timeout() -> None:
    server = _Server()
    started = time.monotonic()
    assert _wait_for_devices(server, 2, 0.5, threading.Event()) == 0  # type: ignore[arg-type]
    assert 0.5 - 0.05 <= time.monotonic() - started < 0.5 + 1.0
