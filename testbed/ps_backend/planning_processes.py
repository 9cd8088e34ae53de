"""Planning the linears of a job side by side: this process and planning processes of its own.

:meth:`StepPlanner.prepare <testbed.ps_backend.step_plan.StepPlanner.prepare>` searches every
linear's plans before the first step. The searches are pure functions of the topology's groups
and the devices present, and a large topology's take half a minute in one process (large and
campus: 30 s), so with more than one core :func:`prepare_together` shares the linears out:
whichever stream is free takes the next one not taken yet (the searches of one linear take
from under a second to ten, and nothing predicts which).

A planning process is ``python -m testbed.ps_backend.planning_processes``: a plain child
process, not ``multiprocessing``'s. The PS calls this with gRPC's threads running, so it must
not fork, and ``multiprocessing``'s spawn leaves a resource tracker process behind for the rest
of the PS's life. The child reads pickled frames on its stdin and writes them on its stdout:

    parent -> child   (config, slots, shapes, item)    then, for each request, an index or None
    child -> parent   ("take",) ...                    then ("done", caches, forward shapes,
                                                             CPU s), or ("done", None) if it
                                                             took nothing

A thread of the parent answers each child's requests from the same counter the parent takes
from. A child starts in about half a second: a small job's linears are all taken by the parent
before then, and the child is stopped without waiting for it. It asks for its first linear
only once the planner is imported: asking first, a child took a small job's linear and then
imported for half a second while the parent waited (the test topology's 0.2 s of planning
became 0.9 s). A child that fails leaves the linears it took to be searched at their first
GEMM (``StepPlanner.plan``); the parent logs it.

How far it is (:class:`Progress`): a linear counts as planned once this process has searched it
or once the child that took it asks for another, and a thread of the parent's says so every
10 s while the searches run (:func:`progress_line`): a thousand devices' plans took a minute
(docs/simulate.md, "Speed"), with nothing said between the start and the end.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, Callable, NamedTuple

from testbed.pdeathsig import die_with_parent

log = logging.getLogger(__name__)


class SlotView(NamedTuple):
    """What planning reads of a device slot: sent to a planning process instead of the slot,
    which holds the device's queues and cache."""

    device_id: str
    name: str
    group: str
    quarantined: bool
    predicted_gflops: float


class _Counter:
    """The next linear not taken yet, shared by the parent's loop and its answering threads."""

    def __init__(self, count: int):
        self.count = count
        self.next = 0
        self.lock = threading.Lock()

    def take(self) -> int | None:
        with self.lock:
            if self.next >= self.count:
                return None
            self.next += 1
            return self.next - 1

    def close(self) -> None:
        with self.lock:
            self.next = self.count


def progress_line(planned: int, total: int, wall_s: float) -> str:
    """The line said every 10 s while the linears are planned (:class:`Progress`)."""
    return f"planning: {planned} of {total} GEMM shapes planned ({wall_s:.0f} s so far)"


class Progress:
    """How many of ``total`` linears are planned, in any process; while it is entered, a thread
    of its own calls ``say(planned, total, wall s since entered)`` every ``every_s`` (``say``
    None: it only counts)."""

    def __init__(self, total: int, say: Callable[[int, int, float], None] | None = None,
                 every_s: float = 10.0):
        self.total = total
        self.planned = 0
        self.say = say
        self.every_s = every_s
        self.lock = threading.Lock()  # this process's loop and the children's answering threads
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_s = time.monotonic()

    def one_done(self) -> None:
        """One more linear's searches are done."""
        with self.lock:
            self.planned += 1

    def __enter__(self) -> Progress:
        self._started_s = time.monotonic()
        if self.say is not None:
            self._thread = threading.Thread(target=self._tell, name="planning-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _tell(self) -> None:
        assert self.say is not None
        while not self._stop.wait(self.every_s):
            with self.lock:
                planned = self.planned
            self.say(planned, self.total, time.monotonic() - self._started_s)


class _Child:
    """One planning process and the thread that answers it."""

    def __init__(self, counter: _Counter, setup: tuple[Any, ...],
                 progress: Progress | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        self.counter = counter
        self.progress = progress
        self.took = 0
        self.result: tuple[Any, ...] | None = None
        # a linear taken and counted as one step: stop_if_idle must not see it taken and
        # not counted (it would kill a child holding a linear)
        self.lock = threading.Lock()
        assert self.proc.stdin is not None
        try:
            pickle.dump(setup, self.proc.stdin)
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died at once; answer() finds its stdout closed
        self.thread = threading.Thread(target=self.answer, name="planning-answers", daemon=True)
        self.thread.start()

    def answer(self) -> None:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        try:
            while True:
                message = pickle.load(stdout)
                if message[0] == "take" and self.took and self.progress is not None:
                    self.progress.one_done()  # it asks again: the last it took is searched
                if message[0] == "done":
                    self.result = message
                    return
                with self.lock:
                    i = self.counter.take()
                    self.took += i is not None
                pickle.dump(i, stdin)
                stdin.flush()
        except (EOFError, OSError, pickle.UnpicklingError):
            return  # it ended without its result: see finish()

    def stop_if_idle(self) -> bool:
        """Stop the child if it took no linear (called once the counter is closed: it cannot
        take one any more); whether it did."""
        with self.lock:
            idle = self.took == 0
        if idle:
            self.proc.kill()
        return idle

    def finish(self) -> tuple[Any, ...] | None:
        """Wait for the child's result; None if it took nothing or failed."""
        self.thread.join()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    # a child stopped while idle (stop_if_idle) leaves unsent bytes in its
                    # stdin's buffer (the None that answer() could not flush): closing flushes
                    # them into a broken pipe, which failed a PS's run (CI, 1 in ~1,300 tests)
                    pass
        code = self.proc.wait()
        if self.took and (self.result is None or self.result[1] is None):
            log.warning("a planning process failed (exit %s); the %d linear(s) it took are "
                        "planned at their first GEMM", code, self.took)
            return None
        return self.result if self.took else None


def prepare_together(planner: Any, shapes: list[tuple[int, int, int]], item: int,
                     slots: list[Any], workers: int, progress: Progress | None = None) -> int:
    """Search ``shapes`` (longest first) with ``planner`` in this process and in ``workers -
    1`` planning processes; merge what they send into ``planner``'s caches and CPU seconds.
    Returns how many processes took part (this one included); ``progress`` counts the linears
    searched, in every process."""
    counter = _Counter(len(shapes))
    views = [SlotView(s.device_id, s.name, s.group, s.quarantined, s.predicted_gflops)
             for s in slots]
    setup = (planner.config, views, shapes, item)
    children = [_Child(counter, setup, progress) for _ in range(workers - 1)]
    try:
        while (i := counter.take()) is not None:
            planner.prepare_shape(shapes[i], item, slots)
            if progress is not None:
                progress.one_done()
    finally:
        counter.close()
        busy = [c for c in children if not c.stop_if_idle()]
    for child in children:
        result = child.finish()
        if result is not None:
            _, caches, forward_shapes, cpu_s = result
            planner.merge_prepared(caches, forward_shapes, cpu_s)
    return 1 + len(busy)


def _die_with_parent() -> None:
    """End with the process that started this one, however that ends (a PS killed mid-plan
    must not leave it searching), and leave Ctrl-C to it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()  # not Linux: it ends when it has searched what it took
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(1)


def _child(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """A planning process: take linears until none is left, each searched on a planner of its
    own, then send its caches, forward shapes and CPU seconds."""
    from testbed.ps_backend.step_plan import StepPlanner

    config, slots, shapes, item = pickle.load(stdin)
    planner = StepPlanner(config)
    started = time.thread_time()
    took = 0
    while True:
        pickle.dump(("take",), stdout)
        stdout.flush()
        i = pickle.load(stdin)
        if i is None:
            break
        planner.prepare_shape(shapes[i], item, slots)
        took += 1
    if took:
        pickle.dump(("done", *planner.prepared(), time.thread_time() - started), stdout)
    else:
        pickle.dump(("done", None), stdout)
    stdout.flush()


if __name__ == "__main__":
    _die_with_parent()
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not break a frame
    _child(sys.stdin.buffer, protocol)
