"""The scheduler: which device computes which tile, and what becomes of every result.

Plain, single-threaded logic with no I/O (the gRPC server calls it from its event loop; tests call
it directly). Its state:

* a FIFO queue of pending tasks (one task = one tile of one GEMM; a task re-queued after its device
  left goes to the front, with its ``attempt`` raised so a late answer of the old attempt is
  recognized and dropped);
* one :class:`DeviceSlot` per device: its window (most tiles outstanding), the tasks in flight,
  an exact mirror of its operand cache (:mod:`testbed.ps_backend.cache`), its observed speed.

Sizing work to speed: a device's window is its declared maximum scaled by its predicted speed
relative to the median device (a laptop holds more tiles than a phone), and at the tail of a GEMM
(fewer pending tiles than free windows) a device whose predicted finish for the next tile is more
than ``STRAGGLER_RATIO`` times the best device's is passed over, so the last tiles go to fast
devices. Affinity: among the first ``AFFINITY_SCAN`` pending tasks, a device gets the one whose
operands it already caches most of (on a hit only the other block travels).
"""

from __future__ import annotations

import enum
import itertools
import statistics
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from testbed.ps_backend.cache import BlockCache
from testbed.ps_backend.executor import GemmSpec
from testbed.ps_backend.tiler import TileBox, cut, gemm_flops
from testbed.ps_backend.validation import check_result

AFFINITY_SCAN = 32
STRAGGLER_RATIO = 2.0
EWMA_WEIGHT = 0.3  # weight of the newest observation in a device's speed estimate


@dataclass(eq=False)
class GemmJob:
    """One GEMM C = A @ B being computed by devices."""

    uid: str  # unique in the run, e.g. "s3/layers.0.fc1/forward#41"
    spec: GemmSpec
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    version: int  # cache version of its blocks (the training step)
    a_key: str
    b_key: str
    remaining: int = 0
    done: Future = field(default_factory=Future)
    submitted_s: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class Task:
    task_id: int
    job: GemmJob
    box: TileBox
    attempt: int = 0
    holder: str | None = None
    done: bool = False
    sent_s: float = 0.0

    @property
    def flops(self) -> float:
        m, n = self.box.shape
        return gemm_flops(m, self.job.a.shape[1], n)

    @property
    def a_block_key(self) -> str:
        return f"{self.job.a_key}/r{self.box.r0}:{self.box.r1}"

    @property
    def b_block_key(self) -> str:
        return f"{self.job.b_key}/c{self.box.c0}:{self.box.c1}"

    def a_block(self) -> np.ndarray:
        return self.job.a[self.box.r0:self.box.r1, :]

    def b_block(self) -> np.ndarray:
        return self.job.b[:, self.box.c0:self.box.c1]


@dataclass
class Assignment:
    """A task handed to a device, and which operands must travel (False: the device caches it)."""

    task: Task
    send_a: bool
    send_b: bool
    cache_a: bool  # whether the device should keep A's block
    cache_b: bool


@dataclass(eq=False)
class DeviceSlot:
    device_id: str
    name: str
    predicted_gflops: float
    max_in_flight: int
    cache_bytes: int
    group: str = ""
    kind: str = "emulated"
    profile: str = ""
    window: int = 1
    in_flight: dict[int, Task] = field(default_factory=dict)
    given: set[int] = field(default_factory=set)  # every task id ever handed to it
    cache: BlockCache[None] = field(init=False)
    rate_flops: float = 0.0  # observed speed, FLOP/s (EWMA of the device's own compute times)
    tiles_done: int = 0
    tiles_rejected: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    compute_s: float = 0.0
    energy_j: float = 0.0

    def __post_init__(self) -> None:
        self.cache = BlockCache(self.cache_bytes)
        self.rate_flops = self.predicted_gflops * 1e9

    @property
    def free(self) -> int:
        return self.window - len(self.in_flight)

    def finish_estimate_s(self, flops: float) -> float:
        """Predicted time until a new tile of this size would be done (its queue first)."""
        per_tile = flops / max(self.rate_flops, 1.0)
        return (len(self.in_flight) + 1) * per_tile


class Verdict(enum.Enum):
    ACCEPTED = "accepted"  # placed into C
    LATE = "late"  # a duplicate or a superseded attempt: dropped quietly
    REJECTED = "rejected"  # refused: the device is told why


@dataclass
class Outcome:
    verdict: Verdict
    reason: str = ""
    completed_job: GemmJob | None = None  # set when this result finished its GEMM
    requeued: bool = False  # the task went back to the queue (bad result)
    task: Task | None = None


class Scheduler:
    """Queue, windows, caches and result bookkeeping for one run."""

    def __init__(self, on_event: Callable[..., None] | None = None, check_values: bool = True):
        self.pending: deque[Task] = deque()
        self.devices: dict[str, DeviceSlot] = {}
        self.tasks: dict[int, Task] = {}  # live tasks of unfinished GEMMs
        self._ids = itertools.count()
        self._on_event = on_event or (lambda kind, **fields: None)
        self.check_values = check_values
        self.requeued_total = 0
        self.recomputed_total = 0  # accepted results of attempt > 0

    # -- devices -------------------------------------------------------------------------------
    def add_device(self, slot: DeviceSlot) -> None:
        """Register a device and size every window again."""
        self.devices[slot.device_id] = slot
        self._resize_windows()

    def set_max_in_flight(self, device_id: str, tiles: int) -> None:
        """A device changed how many tiles it wants outstanding."""
        slot = self.devices.get(device_id)
        if slot is not None:
            slot.max_in_flight = max(1, tiles)
            self._resize_windows()

    def remove_device(self, device_id: str) -> list[Task]:
        """Forget a device; its in-flight tasks go back to the front of the queue."""
        slot = self.devices.pop(device_id, None)
        if slot is None:
            return []
        requeued = list(slot.in_flight.values())
        for task in reversed(requeued):
            self._requeue(task)
        self._resize_windows()
        return requeued

    def _resize_windows(self) -> None:
        if not self.devices:
            return
        median = statistics.median(s.predicted_gflops for s in self.devices.values()) or 1.0
        for s in self.devices.values():
            scaled = round(2 * s.predicted_gflops / median)
            s.window = max(1, min(s.max_in_flight, scaled))

    def _requeue(self, task: Task) -> None:
        task.attempt += 1
        task.holder = None
        self.requeued_total += 1
        self.pending.appendleft(task)

    # -- work in -------------------------------------------------------------------------------
    def submit(self, job: GemmJob, tile_m: int, tile_n: int) -> None:
        """Queue every tile of a GEMM."""
        boxes = cut(job.a.shape[0], job.b.shape[1], tile_m, tile_n)
        job.remaining = len(boxes)
        for box in boxes:
            task = Task(next(self._ids), job, box)
            self.tasks[task.task_id] = task
            self.pending.append(task)

    def invalidate(self, before_version: int) -> None:
        """Weights advanced: every device drops older cached blocks (mirrors too)."""
        for slot in self.devices.values():
            slot.cache.invalidate(before_version)

    # -- work out ------------------------------------------------------------------------------
    def assign(self, device_id: str, now_s: float | None = None) -> list[Assignment]:
        """Hand a device as many tasks as its window allows; update its cache mirror."""
        slot = self.devices.get(device_id)
        if slot is None:
            return []
        now_s = time.monotonic() if now_s is None else now_s
        out: list[Assignment] = []
        while slot.free > 0 and self.pending:
            task = self._pick(slot)
            if task is None:
                break
            out.append(self._give(slot, task, now_s))
        return out

    def _pick(self, slot: DeviceSlot) -> Task | None:
        while self.pending and self.pending[0].done:  # finished by another attempt
            self.pending.popleft()
        if not self.pending:
            return None
        if self._tail() and self._is_straggler(slot, self.pending[0].flops):
            return None
        best_i, best_score = 0, -1
        for i, task in enumerate(itertools.islice(self.pending, AFFINITY_SCAN)):
            if task.done:
                continue
            score = ((task.a_block_key in slot.cache) * task.a_block().nbytes
                     + (task.b_block_key in slot.cache) * task.b_block().nbytes)
            if score > best_score:
                best_i, best_score = i, score
        task = self.pending[best_i]
        del self.pending[best_i]
        return task

    def _tail(self) -> bool:
        return len(self.pending) < sum(max(s.free, 0) for s in self.devices.values())

    def _is_straggler(self, slot: DeviceSlot, flops: float) -> bool:
        best = min(s.finish_estimate_s(flops) for s in self.devices.values())
        return slot.finish_estimate_s(flops) > STRAGGLER_RATIO * best

    def _give(self, slot: DeviceSlot, task: Task, now_s: float) -> Assignment:
        task.holder, task.sent_s = slot.device_id, now_s
        slot.in_flight[task.task_id] = task
        slot.given.add(task.task_id)
        send, keep = [], []
        for key, block in ((task.a_block_key, task.a_block()), (task.b_block_key, task.b_block())):
            hit = key in slot.cache
            cacheable = slot.cache.cacheable(block.nbytes)
            if hit:
                slot.cache.get(key)  # refresh, exactly as the device does when it uses the block
            else:
                slot.cache.put(key, task.job.version, block.nbytes, None)
                slot.bytes_down += block.nbytes
            send.append(not hit)
            keep.append(cacheable)
        return Assignment(task, send[0], send[1], keep[0], keep[1])

    # -- results in ----------------------------------------------------------------------------
    def accept(self, device_id: str, task_id: int, attempt: int, c: np.ndarray,
               compute_s: float = 0.0, energy_j: float = 0.0) -> Outcome:
        """Check a result and place it into its GEMM's C; say what became of it."""
        slot = self.devices.get(device_id)
        if slot is None:
            return Outcome(Verdict.REJECTED, f"device {device_id} is not registered")
        slot.bytes_up += c.nbytes
        task = slot.in_flight.get(task_id)
        if task is None or task.attempt != attempt:
            if task_id in slot.given:
                return Outcome(Verdict.LATE, f"task {task_id} attempt {attempt} is no longer "
                                             f"outstanding on {device_id}")
            slot.tiles_rejected += 1
            return Outcome(Verdict.REJECTED, f"task {task_id} attempt {attempt} was not given "
                                             f"to device {device_id}")
        del slot.in_flight[task_id]
        if task.done:
            return Outcome(Verdict.LATE, f"task {task_id} was already completed", task=task)
        problem = check_result(task.a_block(), task.b_block(), c, check_values=self.check_values)
        if problem:
            slot.tiles_rejected += 1
            self._requeue(task)
            return Outcome(Verdict.REJECTED, f"task {task_id}: {problem}", requeued=True,
                           task=task)
        box = task.box
        task.job.c[box.r0:box.r1, box.c0:box.c1] = c
        task.done = True
        task.holder = device_id
        del self.tasks[task_id]
        slot.tiles_done += 1
        slot.compute_s += compute_s
        slot.energy_j += energy_j
        if compute_s > 0:
            rate = task.flops / compute_s
            slot.rate_flops = (1 - EWMA_WEIGHT) * slot.rate_flops + EWMA_WEIGHT * rate
        if attempt > 0:
            self.recomputed_total += 1
        job = task.job
        job.remaining -= 1
        return Outcome(Verdict.ACCEPTED, completed_job=job if job.remaining == 0 else None,
                       task=task)

    def refuse(self, device_id: str, task_id: int, attempt: int, reason: str) -> Outcome:
        """A result that could not even be decoded: refuse it; re-queue the task if outstanding."""
        slot = self.devices.get(device_id)
        task = slot.in_flight.get(task_id) if slot is not None else None
        if slot is None or task is None or task.attempt != attempt:
            return Outcome(Verdict.REJECTED, f"task {task_id}: {reason}")
        del slot.in_flight[task_id]
        slot.tiles_rejected += 1
        self._requeue(task)
        return Outcome(Verdict.REJECTED, f"task {task_id}: {reason}", requeued=True, task=task)

    # -- views ---------------------------------------------------------------------------------
    def in_flight(self) -> Iterable[Task]:
        for slot in self.devices.values():
            yield from slot.in_flight.values()
