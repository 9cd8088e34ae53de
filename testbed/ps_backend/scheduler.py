"""The scheduler: which device computes which tile, and what becomes of every result.

Plain, single-threaded logic with no I/O (the gRPC server calls it from its event loop; tests call
it directly). Its state:

* a FIFO queue of pending tasks (one task = one tile of one GEMM; a task re-queued after its last
  copy was lost goes to the front, with its ``attempt`` raised so a late answer of the old attempt
  is recognized and dropped);
* one :class:`DeviceSlot` per device: its window (most tiles outstanding), the **copies** of tasks
  it holds (a task may be out on two devices at once, see backups below), an exact mirror of its
  operand cache (:mod:`testbed.wire.cache`), its observed speed, whether it is quarantined.

Names and units, written down once: ``*_s`` are seconds of the PS's monotonic (wall) clock,
except ``compute_s`` which devices report in *device* seconds (wall = device × ``dilation``);
``rate_flops`` is FLOP per device second (EWMA of what the device reports); ``overhead_s`` is how
much longer than its compute a device's round trip really takes (links, queues, the stack), an
EWMA of ``turnaround - compute`` over its valid results, unknown until the first one.

**One straggler rule.** A device's predicted wall finish for a new tile of F FLOPs is
``finish_wall_s = (tiles it holds + 1) · F / rate_flops · dilation + overhead_s``. A time
``t_slow`` *straggles* behind ``t_fast`` when ``t_slow > STRAGGLER_RATIO · t_fast``. The rule is
used both ways:

* at the tail of the queue (fewer pending tiles than free windows) a device whose finish
  straggles behind the best device's is passed over, so the last tiles go to fast devices;
* when a device sits idle (nothing pending it may take) it takes a **backup copy** of an in-flight
  task whose holder's remaining time straggles behind the idle device's finish. The holder's
  remaining time is its predicted return time minus now, or, once overdue, the time it has held
  the tile so far (it is assumed to take as long again). Where the topology gives a device's
  uplink, a return is predicted after the results the device owes have gone up too (the
  larger of its compute queue and its upload queue, ``DeviceSlot.upload_s``), and the idle
  device's finish counts the upload of its own result: a link-bound device is not late when
  its results queue on its uplink, and backing it up only spends links. At most two copies of a
  task exist; a device never gets the same task twice, only devices whose overhead is known (one
  valid result each) take part unless the copy is ``OVERDUE_BACKUP_S`` x dilation past its
  predicted return, and the backup must promise to save at least
  ``MIN_BACKUP_GAIN_S`` (50 ms) of wall time, so that the jitter of a loaded host does not look
  like straggling. The first *valid* result wins and is placed; a later copy is still checked
  (a wrong late tile counts against its device) and then dropped as ``LATE`` (counted as
  wasted).

**Plans.** A GEMM submitted with a plan (:mod:`testbed.ps_backend.planner`) may be K-split (its
tiles return partials that are summed per block in slice order, whatever device computed them,
so C is bit-identical) and its tasks may carry an **owner**: a device takes its own tasks first,
then tasks whose owner is gone or quarantined, then steals another device's pending task only
when that owner's backlog straggles behind its own finish. A GEMM without owners is FIFO.

Affinity: among the first ``AFFINITY_SCAN`` pending tasks, a device gets the one whose operands it
already caches most of (on a hit only the other block travels).

**Indexes, not scans.** The queue (:class:`PendingQueue`) keeps positions and an index by owner,
and the copies in flight are indexed by remaining time, one index per tile size
(:class:`BackupClasses` of :class:`BackupIndex`), so a pick or a backup search does not walk every
task or every device, nor the copies of tiles too large for the device searching; the choices are
those of the plain scans (``tests/unit/test_scheduler_indexes.py`` checks them against such a
reference). Copies on a device whose overhead is unknown wait outside that index until they may be
backed up. A device's search that found nothing is kept until the device's state changes or a copy
it looked at could ripen (:func:`_pays_from_s`); meanwhile its searches look only at the copies
admitted or overdue since (``BackupClasses.admitted``). :meth:`Scheduler.assign_each` offers work
to devices fastest first, as the PS pumps, and stops once no device left could take anything;
:meth:`Scheduler.assign_ready` makes the same choices over a :class:`ReadyIndex`, which files the
ready devices by overhead bucket as well, so that a pump offers a steal or a backup only to devices
whose own overhead and speed let them pass the test (``tests/unit/test_scheduler_ready_index.py``).

**Checks and quarantine.** Every result is checked (:mod:`testbed.ps_backend.validation`). A
device that fails ``quarantine_after`` checks (0: never) is quarantined: it gets no more work, its
copies stop counting (their tasks are re-queued unless another device holds a copy), and the
results it still returns are checked and dropped. The CPU time of the checks (thread time of the
calling thread) is summed in ``validation_cpu_s``.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import itertools
import math
import operator
import statistics
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, Iterator, Sequence

import numpy as np

from testbed.ps_backend.tiler import Region, TileBox, cut_regions, gemm_flops, k_pieces
from testbed.ps_backend.validation import GemmCheck, check_result
from testbed.wire.cache import BlockCache

AFFINITY_SCAN = 32
STRAGGLER_RATIO = 2.0
EWMA_WEIGHT = 0.3  # weight of the newest observation in a device's speed estimate
MAX_COPIES = 2  # a task is out on at most this many devices at once (primary + one backup)
MIN_BACKUP_GAIN_S = 0.05  # a backup must promise to save at least this much wall time
# A device's window is `window_scale` tiles at the median predicted rate, more for a faster
# device, fewer for a slower one, within its max_in_flight. The queue's order (fifo) hands any
# device any tile, so a slow device must not hoard them: 2. The planner's tiles have owners, and a
# window has to keep the owner's downlink busy while a result makes its round trip: 8
# (docs/planning.md, "Windows"; bench/stage_profile.py --window-scale tries others).
WINDOW_SCALE = 2
PLANNED_WINDOW_SCALE = 8
# A copy this long (wall seconds x dilation) past its predicted return may be backed up even
# while its holder's or the idle device's overhead is unknown: a device that heartbeats but never
# returns its first tiles must not hold a step up until its lease ends (it never does).
OVERDUE_BACKUP_S = 2.0


def straggles(slow_s: float, fast_s: float, ratio: float = STRAGGLER_RATIO) -> bool:
    """Whether a finish time ``slow_s`` straggles behind ``fast_s`` (the one straggler rule)."""
    return slow_s > ratio * fast_s


def copy_pays(theirs_s: float, mine_s: float) -> bool:
    """Whether a device that would finish a tile in ``mine_s`` should take it (a steal or a
    backup) from one that would finish in ``theirs_s``: it straggles, and by at least
    ``MIN_BACKUP_GAIN_S``."""
    return straggles(theirs_s, mine_s) and theirs_s - mine_s >= MIN_BACKUP_GAIN_S


def block_key(key: str, rows: tuple[int, int], cols: tuple[int, int], transposed: bool) -> str:
    """The cache key of an operand block: its tensor's key and its rows and columns in the stored
    tensor (a transposed operand's rows are the stored tensor's columns)."""
    if transposed:
        rows, cols = cols, rows
    return f"{key}/r{rows[0]}:{rows[1]}/c{cols[0]}:{cols[1]}"


@dataclass(frozen=True)
class GemmSpec:
    """What one GEMM is, for scheduling, caching and the ledger.

    ``b_key`` names B's tensor when B is a weight (or its transpose) at one version, for example
    ``"layers.0.fc1.weight@3"``: devices cache blocks of B under that name, so that on a cache
    hit only A's block travels. It names the tensor, not the orientation: ``W`` and ``Wᵀ`` share
    blocks (``executor.OperandKeys``). ``None`` when B is an activation (the weight-gradient GEMM).
    """

    layer: str  # e.g. "layers.0.fc1"
    op: str  # "forward", "input_grad" or "weight_grad"
    step: int  # training step, 0-based
    b_key: str | None = None


@dataclass(eq=False)
class GemmJob:
    """One GEMM C = A @ B being computed by devices."""

    uid: str  # deterministic in the run: "s3/layers.0.fc1/forward#41" (step, layer, op, seq)
    spec: GemmSpec
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    version: int  # cache version of its blocks (the training step)
    # the operands' tensors in the step (OperandKeys): their blocks' cache keys, and what the
    # bound counts as held once an earlier stage sent it
    a_key: str
    b_key: str
    remaining: int = 0
    done: Future = field(default_factory=Future)
    submitted_s: float = field(default_factory=time.monotonic)
    digest: str = ""  # checksum of A and B (the ledger checks it before reusing tiles)
    check: GemmCheck | None = None  # Freivalds' shared work for its tiles (Scheduler.submit)
    # an operand that is the transpose of a stored tensor (Wᵀ in forward, dYᵀ in the weight
    # gradient): its blocks are named, sent and cached in the stored orientation (Task)
    a_transposed: bool = False
    b_transposed: bool = False
    # the plan keeps its blocks on the devices for a later GEMM of the step (a linear on one
    # grid: forward's X and W blocks for its backward): caches evict them last
    held: bool = False
    partials: dict[tuple[int, int], dict[int, np.ndarray]] = field(default_factory=dict)


@dataclass(eq=False)
class Task:
    task_id: int
    job: GemmJob
    box: TileBox
    attempt: int = 0
    holder: str | None = None  # the device that completed it, or the last one given it
    done: bool = False
    holders: set[str] = field(default_factory=set)  # devices with a live (trusted) copy
    queued: bool = False  # in the pending queue
    owner: str | None = None  # the device the plan gave it to (None: anyone, FIFO)
    qpos: int = -(1 << 62)  # its position in the pending queue while queued (PendingQueue)
    # fixed facts of the tile, computed once: the scheduler reads them on every pick
    flops: float = field(init=False)
    # the blocks it needs, (cache key, bytes): A's parts along K, then B's (one each unless
    # the tile has K parts, TileBox.k_block)
    blocks: tuple[tuple[str, int], ...] = field(init=False)
    pieces: tuple[tuple[int, int], ...] = field(init=False)  # its K range as ``blocks`` cut it
    a_nbytes: int = field(init=False)
    b_nbytes: int = field(init=False)
    result_nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        job, box = self.job, self.box
        m, n = box.shape
        k0, k1 = self.k_range
        k = k1 - k0
        self.flops = gemm_flops(m, k, n)
        # Blocks are named in their stored tensor's own coordinates, so that another GEMM with
        # the same tensor (same key), in either orientation, and the same block is a cache hit.
        self.pieces = pieces = tuple(k_pieces(k0, k1, box.k_block))
        a_item, b_item = job.a.itemsize, job.b.itemsize
        self.blocks = tuple(
            [(block_key(job.a_key, (box.r0, box.r1), p, job.a_transposed),
              m * (p[1] - p[0]) * a_item) for p in pieces]
            + [(block_key(job.b_key, p, (box.c0, box.c1), job.b_transposed),
                (p[1] - p[0]) * n * b_item) for p in pieces])
        self.a_nbytes = m * k * a_item
        self.b_nbytes = k * n * b_item
        self.result_nbytes = m * n * job.c.itemsize

    @property
    def k_range(self) -> tuple[int, int]:
        box = self.box
        return (box.k0, box.k1) if box.split else (0, self.job.a.shape[1])

    def a_block(self) -> np.ndarray:
        return self.a_piece(self.k_range)

    def b_block(self) -> np.ndarray:
        return self.b_piece(self.k_range)

    def a_piece(self, k: tuple[int, int]) -> np.ndarray:
        """A's rows of the tile over the contraction range ``k`` (one of :attr:`pieces`)."""
        return self.job.a[self.box.r0:self.box.r1, k[0]:k[1]]

    def b_piece(self, k: tuple[int, int]) -> np.ndarray:
        return self.job.b[k[0]:k[1], self.box.c0:self.box.c1]


@dataclass(eq=False)
class Copy:
    """One copy of a task out on one device."""

    task: Task
    attempt: int
    backup: bool  # handed out while another device held the task
    sent_s: float
    expected_s: float  # predicted wall time the result is back
    compute_wall_s: float = 0.0  # the compute part of that prediction
    seq: int = 0  # order of handing out (the backup search breaks ties by it)
    idx_ver: int = 0  # which of its BackupIndex entries is current
    waiting: bool = False  # in BackupIndex's waiting room (its holder's overhead is unknown)


@dataclass
class Assignment:
    """A task handed to a device, and which of its blocks (``Task.blocks``) must travel (False:
    the device holds it) and which the device keeps; ``held``: it keeps them as held blocks
    (the plan uses them again in the step, :attr:`GemmJob.held`)."""

    task: Task
    send: tuple[bool, ...]
    keep: tuple[bool, ...]
    backup: bool = False
    held: bool = False

    @property
    def nbytes(self) -> int:
        """The operand bytes that travel with it (the blocks the device does not hold)."""
        return sum(nbytes for (_, nbytes), sent in zip(self.task.blocks, self.send) if sent)


# A message's first tile waits at most this long (device seconds on the device's downlink) for
# the blocks of the tiles after it in the same message: the down side of the agent's
# MAX_BATCH_DELAY_S. Small tiles still travel together; a phone's 1.6 MB block goes alone, so the
# phone computes its first tile while the next one's blocks arrive.
DOWN_BATCH_DELAY_S = 0.002


def message_runs(assignments: list[Assignment], down_Bps: float) -> list[list[Assignment]]:
    """One pump's tiles for a device cut into messages, in order (PsCore.pump, the simulator).

    A tile starts a new message when its blocks would keep the message's first tile waiting
    longer than :data:`DOWN_BATCH_DELAY_S` at ``down_Bps`` (bytes per device second; unknown,
    ``inf``: one message, as the PS's cost is mostly per message).
    """
    rate = down_Bps if down_Bps > 0 else math.inf  # no rate known: as fast as can be
    runs: list[list[Assignment]] = []
    waited = 0.0
    for a in assignments:
        if runs and waited + a.nbytes / rate <= DOWN_BATCH_DELAY_S:
            runs[-1].append(a)
            waited += a.nbytes / rate
        else:
            runs.append([a])
            waited = 0.0
    return runs


@dataclass(eq=False)
class SharedLink:
    """A link several devices' downloads cross (the PS's own, a switch link above them): when
    (wall, the scheduler's clock) what was handed to the devices below it has crossed it."""

    down_Bps: float  # bytes per device second
    free_s: float = 0.0


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
    keeps_held: bool = False  # its cache evicts held blocks last (wire/cache.py), as the mirror
    order: int = 0  # registration order (the backup search breaks ties by it)
    window: int = 1
    in_flight: dict[int, Copy] = field(default_factory=dict)
    # losing copies: another device's copy of the task won while this one was out. They no
    # longer count as in flight (nothing waits for them, a departure re-queues nothing for
    # them), but they still occupy the window: the device is busy with them until they return.
    cancelled: dict[int, Copy] = field(default_factory=dict)
    given: set[int] = field(default_factory=set)  # every task id ever handed to it
    # counts every change of in_flight or cancelled (the scheduler's own, the only ones): what
    # a device holds and owes is computed again only after one
    copies_changed: int = field(default=0, init=False)
    _owed: tuple[int, int] = field(default=(-1, 0), init=False, repr=False)  # (changes, bytes)
    cache: BlockCache[None] = field(init=False)
    rate_flops: float = 0.0  # observed speed, FLOP per device second (EWMA)
    peak_rate_flops: float = 0.0  # fastest tile seen (the bound must not assume slower)
    overhead_s: float | None = None  # observed wall turnaround minus compute (EWMA)
    quarantined: bool = False
    failed_checks: int = 0
    tiles_done: int = 0
    tiles_rejected: int = 0
    tiles_late: int = 0
    backups_won: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    compute_s: float = 0.0
    energy_j: float = 0.0
    # the device's downlink, bytes per device second, from the topology (the planner sets it;
    # inf: unknown). Stealing and backups count what a device must still receive at this rate.
    down_Bps: float = math.inf
    # when (wall, the scheduler's clock) what it was handed has come down at that rate: a
    # thief's blocks queue behind its own, and an owner handed its box a moment ago is not
    # behind (without it, the first devices of a pump stole from those not yet pumped)
    down_free_s: float = 0.0
    # the links it shares with other devices on the way from the PS (the planner sets them):
    # a block for it waits behind what they carry for the others too
    shared: tuple[SharedLink, ...] = ()
    up_Bps: float = math.inf  # its uplink, bytes per device second (the planner sets it)

    def queued_s(self, now_s: float) -> float:
        """Wall seconds until a block handed to it now could start down: behind what its own
        link and every shared link on its path still carry."""
        free = self.down_free_s
        for link in self.shared:
            free = max(free, link.free_s)
        return max(0.0, free - now_s)

    @property
    def owed_nbytes(self) -> int:
        """The result bytes of the copies it holds (cancelled ones too: it still sends them)."""
        if self._owed[0] != self.copies_changed:
            self._owed = (self.copies_changed, sum(c.task.result_nbytes for c in itertools.chain(
                self.in_flight.values(), self.cancelled.values())))
        return self._owed[1]

    def upload_s(self, nbytes: int, owed_nbytes: int | None = None) -> float:
        """Device seconds its uplink needs for the results it owes and ``nbytes`` more (0 when
        its uplink is unknown)."""
        if not 0 < self.up_Bps < math.inf:
            return 0.0
        owed = self.owed_nbytes if owed_nbytes is None else owed_nbytes
        return (owed + nbytes) / self.up_Bps

    def __post_init__(self) -> None:
        self.cache = BlockCache(self.cache_bytes)
        self.rate_flops = self.predicted_gflops * 1e9

    @property
    def free(self) -> int:
        return 0 if self.quarantined else \
            self.window - len(self.in_flight) - len(self.cancelled)

    def finish_estimate_s(self, flops: float) -> float:
        """Predicted device seconds until a new tile of this size would be done (queue first)."""
        per_tile = flops / max(self.rate_flops, 1.0)
        return (len(self.in_flight) + len(self.cancelled) + 1) * per_tile


# An entry of the backup index: (key, order, seq, ver, copy, slot); key is -expected_s in the
# by-return list and sent_s in the overdue list. (order, seq) is unique per copy, so sorting
# never compares copies.
_Entry = tuple[float, int, int, int, Copy, DeviceSlot]
# A copy admitted to a search list, as logged: (copy, holder, its index version, its index)
_Logged = tuple[Copy, DeviceSlot, int, "BackupIndex"]
# the log of admissions drops the copies that left once it is this many times as long as what
# it kept the last time (and at least ADMITTED_LOG_MIN long): a logged copy holds its task, and
# with it its GEMM's operands and result
ADMITTED_LOG_GROWTH = 4
ADMITTED_LOG_MIN = 256
# a kept answer ends this much before its copies could ripen (the sums' rounding)
_RIPE_MARGIN_S = 1e-6


@dataclass
class _NoneFound:
    """A device's backup search that found nothing: the device's state it ran with
    (Scheduler._search_state), how far into BackupClasses.admitted it looked, and the wall
    time before which no copy it looked at can qualify with that state (:func:`_pays_from_s`).
    A copy's remaining time jumps when it becomes overdue; that is logged like an admission,
    so the copy is looked at again then."""

    state: tuple[Any, ...]
    seen: int
    until_s: float


def _counts(copy: Copy, slot: DeviceSlot, ver: int, devices: dict[str, DeviceSlot]) -> bool:
    """Whether a copy filed at index version ``ver`` still counts: not refiled since, its
    device still registered and trusted, the copy still out on it. (The backup walk and
    ``BackupIndex.sharing_blocks`` test the same inline, as they run for every copy.)"""
    return (ver == copy.idx_ver and devices.get(slot.device_id) is slot
            and not slot.quarantined and slot.in_flight.get(copy.task.task_id) is copy)


def _pays_from_s(now_s: float, remaining: float, overdue: bool, mine_s: float,
                 mine_low_s: float) -> float:
    """No earlier than this can a copy that fails ``copy_pays(remaining, mine_s)`` at now_s
    pass it with nothing but time changing, while it stays overdue (``overdue``) or not yet
    overdue (becoming overdue is an event of its own). The device's finish falls at most as
    fast as time passes (its queue drains), never below ``mine_low_s`` (without the queue).
    An overdue copy's remaining time grows as time passes, so it gains on ``STRAGGLER_RATIO``
    times the finish at most 1 + ratio times as fast, on the gain (``MIN_BACKUP_GAIN_S``)
    twice as fast; the remaining time of one not overdue falls, so it gains on the ratio at
    most ratio - 1 times as fast, and never on the gain (inf: it cannot pass)."""
    ratio, gain = STRAGGLER_RATIO, MIN_BACKUP_GAIN_S
    if overdue:
        return now_s + max(0.0, ratio * mine_low_s - remaining, mine_low_s + gain - remaining,
                           (ratio * mine_s - remaining) / (1.0 + ratio),
                           (mine_s + gain - remaining) / 2.0)
    if remaining - mine_s < gain:
        return math.inf
    return now_s + max(0.0, (ratio * mine_s - remaining) / (ratio - 1.0))


def _none_pays_from_s(now_s: float, most: float, mine_s: float, mine_low_s: float) -> float:
    """:func:`_pays_from_s` for copies a search did not reach: none has more remaining time
    than ``most`` now, nor a smaller finish than ``mine_s``; overdue or not, both bounds."""
    return min(_pays_from_s(now_s, most, True, mine_s, mine_low_s),
               _pays_from_s(now_s, most, False, mine_s, mine_low_s))


def _merge(into: list[_Entry], new: list[_Entry]) -> None:
    """Merge new entries into a sorted list (a few: binary insertion; many: one linear merge)."""
    if len(new) <= 8:
        for e in new:
            bisect.insort(into, e)
    else:
        new.sort()
        into.extend(new)
        into.sort()  # two sorted runs: timsort merges them in linear time
    new.clear()


class BackupIndex:
    """The copies in flight, ordered for the backup search (:meth:`Scheduler._backup_candidate`).

    A copy's remaining time is ``expected_s - now`` until it is overdue and ``now - sent_s``
    after, so at any ``now`` the copies not yet overdue, by ``expected_s`` descending, and the
    overdue ones, by ``sent_s`` ascending, are two lists each in non-increasing remaining time;
    merging them walks every copy longest-remaining first, and the search stops as soon as no
    copy further down could qualify. Copies that leave (a result, a departure, a quarantine) are
    dropped lazily when met; copies of tasks that already have ``MAX_COPIES`` holders are parked
    and come back when a holder lets go (``unpark``).

    A copy on a device whose overhead is not known yet (no valid result so far) is no candidate
    until it is overdue by ``OVERDUE_BACKUP_S`` (scaled by the dilation), so it waits outside
    the two lists until then, or until its holder's overhead becomes known (:meth:`known`),
    whichever comes first. Searches then do not walk past such copies one by one (with
    thousands of devices, the copies of devices getting their first tiles sit at the top of the
    order, hundreds per search), and ``most_remaining_s`` is over candidates only.
    """

    def __init__(self, devices: dict[str, DeviceSlot], log: list[_Logged]):
        self._devices = devices  # the scheduler's own dict (read-only here)
        # every copy admitted to the search or overdue since, in order (BackupClasses' log)
        self._log = log
        self._by_expected: list[_Entry] = []  # sorted: expected_s descending
        self._by_sent: list[_Entry] = []  # overdue copies, sorted: sent_s ascending
        self._new: list[_Entry] = []  # added since the last sort
        self._new_overdue: list[_Entry] = []
        self._heap: list[tuple[float, int, int, int, Copy, DeviceSlot]] = []  # not yet overdue
        self._earliest: list[tuple[float, int, int, int, Copy, DeviceSlot]] = []  # all, heap
        self._parked: dict[int, list[tuple[Copy, DeviceSlot]]] = {}
        # the waiting room: per holder, and all of them by predicted return (a heap)
        self._waiting: dict[str, list[_Entry]] = {}
        self._waiting_due: list[tuple[float, int, int, int, Copy, DeviceSlot]] = []
        self.min_flops = math.inf  # no current entry has fewer FLOPs (a bound, not exact)
        self.min_nbytes = math.inf  # nor fewer operand bytes (A and B blocks; a bound)
        self.min_result_nbytes: float = math.inf  # nor fewer result bytes (a bound)
        # per operand block key, the copies whose task uses it (a superset: copies that left
        # are dropped when met and at compaction), so a device can find the copies whose
        # blocks it holds
        self._by_block: dict[str, list[tuple[Copy, DeviceSlot, int]]] = {}
        self._added = 0
        self._kept = 0

    def add(self, copy: Copy, slot: DeviceSlot) -> None:
        """Index a copy just handed out."""
        entry = (copy.expected_s, slot.order, copy.seq, copy.idx_ver, copy, slot)
        heapq.heappush(self._earliest, entry)
        copy.waiting = slot.overhead_s is None
        if copy.waiting:
            self._waiting.setdefault(slot.device_id, []).append(entry)
            heapq.heappush(self._waiting_due, entry)
        else:
            self._admit(entry)
        self._file_blocks(copy, slot)
        self._added += 1
        if self._added > max(64, 2 * self._kept):  # also keeps min_flops close
            self._compact()

    def _file_blocks(self, copy: Copy, slot: DeviceSlot) -> None:
        task = copy.task
        self.min_flops = min(self.min_flops, task.flops)
        self.min_nbytes = min(self.min_nbytes, task.a_nbytes + task.b_nbytes)
        self.min_result_nbytes = min(self.min_result_nbytes, task.result_nbytes)
        held = (copy, slot, copy.idx_ver)
        by_block = self._by_block
        for key, _ in task.blocks:
            listed = by_block.get(key)
            if listed is None:
                by_block[key] = [held]
            else:
                listed.append(held)

    def blocks(self) -> int:
        """How many blocks the copies in the search are filed under (some may be stale)."""
        return len(self._by_block)

    def sharing_blocks(self, cache: BlockCache[Any]) -> Iterator[tuple[Copy, DeviceSlot]]:
        """The copies in the search whose task uses a block in ``cache`` (each once)."""
        by_block = self._by_block
        keys: Iterable[str] = cache.keys() if len(cache) <= len(by_block) else \
            (k for k in by_block if k in cache)
        seen: set[int] = set()
        devices = self._devices
        gone: list[str] = []
        for key in keys:
            listed = by_block.get(key)
            if not listed:
                continue
            live = [h for h in listed  # current(), for the held tuple: the rest is dropped
                    if h[2] == h[0].idx_ver and devices.get(h[1].device_id) is h[1]
                    and not h[1].quarantined and h[1].in_flight.get(h[0].task.task_id) is h[0]]
            if len(live) < len(listed):
                if live:
                    by_block[key] = live
                else:
                    gone.append(key)
            for copy, slot, _ in live:
                if not copy.waiting and id(copy) not in seen:
                    seen.add(id(copy))
                    yield copy, slot
        for key in gone:  # not while iterating by_block's keys
            del by_block[key]

    def _admit(self, entry: _Entry) -> None:
        """Into the search lists (an entry of the by-return heap's form)."""
        copy = entry[4]
        copy.waiting = False
        self._new.append((-entry[0], entry[1], entry[2], entry[3], copy, entry[5]))
        heapq.heappush(self._heap, entry)
        self._log.append((copy, entry[5], entry[3], self))

    def known(self, slot: DeviceSlot) -> None:
        """The device's overhead became known: its waiting copies are candidates now."""
        for entry in self._waiting.pop(slot.device_id, ()):
            if entry[4].waiting and self.current(entry):
                self._admit(entry)

    def current(self, entry: _Entry) -> bool:
        """Whether an entry still stands for a copy that counts (else it is dropped)."""
        return _counts(entry[4], entry[5], entry[3], self._devices)

    def park(self, copy: Copy, slot: DeviceSlot) -> None:
        """Out of the search until a holder of its task lets go (its task has enough copies)."""
        copy.idx_ver += 1
        self._parked.setdefault(copy.task.task_id, []).append((copy, slot))

    def unpark(self, task: Task) -> None:
        """A holder of the task let go: its other copies are candidates again."""
        for copy, slot in self._parked.pop(task.task_id, ()):
            if slot.in_flight.get(task.task_id) is copy:
                copy.idx_ver += 1
                self.add(copy, slot)

    def _sync(self, now_s: float, overdue_s: float = math.inf) -> None:
        due = self._waiting_due
        # the same expression as the backup search's test of a copy whose holder is unknown
        while due and now_s - due[0][0] >= overdue_s:
            entry = heapq.heappop(due)
            if entry[4].waiting and self.current(entry):
                self._admit(entry)
        _merge(self._by_expected, self._new)
        heap = self._heap
        while heap and heap[0][0] <= now_s:  # overdue now: into the by-send-time list
            expected, order, seq, ver, copy, slot = heapq.heappop(heap)
            if ver == copy.idx_ver:
                self._new_overdue.append((copy.sent_s, order, seq, ver, copy, slot))
                self._log.append((copy, slot, ver, self))  # remaining jumped: look again
        _merge(self._by_sent, self._new_overdue)

    def _compact(self) -> None:
        self._sync(-math.inf)
        self._by_expected = [e for e in self._by_expected if self.current(e)]
        self._by_sent = [e for e in self._by_sent if self.current(e)]
        self._heap = [h for h in self._heap if self.current(h)]
        heapq.heapify(self._heap)
        self._earliest = [h for h in self._earliest if self.current(h)]
        heapq.heapify(self._earliest)
        self._waiting_due = [h for h in self._waiting_due if h[4].waiting and self.current(h)]
        heapq.heapify(self._waiting_due)
        waiting: dict[str, list[_Entry]] = {}
        for h in self._waiting_due:
            waiting.setdefault(h[5].device_id, []).append(h)
        self._waiting = waiting
        for task_id in [t for t, copies in self._parked.items()
                        if not any(s.in_flight.get(t) is c for c, s in copies)]:
            del self._parked[task_id]
        self.min_flops = self.min_nbytes = self.min_result_nbytes = math.inf
        self._by_block = {}
        for e in self._earliest:  # every current entry: in the lists or waiting
            self._file_blocks(e[4], e[5])
        for copies in self._parked.values():
            for copy, _ in copies:
                self.min_flops = min(self.min_flops, copy.task.flops)
                self.min_nbytes = min(self.min_nbytes, copy.task.a_nbytes + copy.task.b_nbytes)
                self.min_result_nbytes = min(self.min_result_nbytes, copy.task.result_nbytes)
        self._added = 0
        self._kept = len(self._by_expected) + len(self._waiting_due)

    def earliest_expected_s(self) -> float:
        """The earliest predicted return of any copy in the search (inf: none)."""
        heap = self._earliest
        while heap and not self.current(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def empty(self) -> bool:
        """Whether no copy that counts is indexed here any more, parked ones included."""
        return math.isinf(self.earliest_expected_s()) and not any(
            slot.in_flight.get(copy.task.task_id) is copy
            for copies in self._parked.values() for copy, slot in copies)

    def most_remaining_s(self, now_s: float, overdue_s: float) -> float:
        """No candidate copy has more remaining time than this at now_s (-inf: none);
        ``overdue_s``: how long past its return a copy of an unknown holder must be."""
        self._sync(now_s, overdue_s)
        first, second = self._by_expected, self._by_sent
        self._clean_head(first)
        self._clean_head(second)
        most = -math.inf
        if first:
            most = -first[0][0] - now_s
        if second:
            most = max(most, now_s - second[0][0])
        return most

    def _clean_head(self, entries: list[_Entry]) -> None:
        """Drop leading entries that are no candidates (gone, or their task has its copies):
        a stale head would make most_remaining_s a loose bound."""
        while entries:
            e = entries[0]
            if not self.current(e):
                del entries[0]
            elif len(e[4].task.holders) >= MAX_COPIES:
                self.park(e[4], e[5])
                del entries[0]
            else:
                return

    def by_remaining(self, now_s: float, overdue_s: float
                     ) -> Generator[tuple[float, _Entry], bool | None, None]:
        """(remaining_s, entry) of every candidate copy, remaining time non-increasing.

        Entries that no longer stand for a counting copy are dropped on the way. The caller
        may stop at any point (and must not add copies before it does). Sending ``True`` for
        an entry skips the rest of its list's entries with the same return (not overdue) or
        send time (overdue): they follow it in (device order, copy sequence) order, so none
        of them can win a tie the entry won (copies handed out at one instant to devices of
        one kind share a remaining time by the hundred).
        """
        self._sync(now_s, overdue_s)
        first, second = self._by_expected, self._by_sent
        devices = self._devices
        i = j = 0
        head1: _Entry | None = None
        head2: _Entry | None = None
        while True:
            while head1 is None and i < len(first):
                e = first[i]
                c, d = e[4], e[5]  # current(e), inlined: this runs for every copy walked
                if not (e[3] == c.idx_ver and devices.get(d.device_id) is d
                        and not d.quarantined and d.in_flight.get(c.task.task_id) is c):
                    del first[i]
                elif -e[0] > now_s:
                    head1 = e
                else:
                    i = len(first)  # the rest is overdue: the second list has it
            while head2 is None and j < len(second):
                e = second[j]
                c, d = e[4], e[5]
                if not (e[3] == c.idx_ver and devices.get(d.device_id) is d
                        and not d.quarantined and d.in_flight.get(c.task.task_id) is c):
                    del second[j]
                elif e[4].expected_s <= now_s:
                    head2 = e
                else:
                    j += 1  # not overdue at this (earlier) time: the first list has it
            if head1 is None and head2 is None:
                return
            # the same expressions as Scheduler.remaining_s
            r1 = head1[4].expected_s - now_s if head1 is not None else -math.inf
            r2 = now_s - head2[4].sent_s if head2 is not None else -math.inf
            if r1 >= r2:
                assert head1 is not None
                if (yield r1, head1):
                    i = bisect.bisect_right(first, head1[0], i, key=_first_item)
                else:
                    i += 1
                head1 = None
            else:
                assert head2 is not None
                if (yield r2, head2):
                    j = bisect.bisect_right(second, head2[0], j, key=_first_item)
                else:
                    j += 1
                head2 = None


class BackupClasses:
    """The copies in flight, one :class:`BackupIndex` per tile size (a task's FLOPs).

    A backup search (:meth:`Scheduler._backup_candidate`) walks one size at a time, and within
    a size it stops as soon as the device could not finish a tile of that size in time: the
    walk over every size at once stopped only at the smallest tile's bound, so a slow device
    walked past every large tile in flight. With a thousand devices of six kinds, each plan
    giving every kind its own tile size, no tile pending and thousands out, a result's pump
    walked every copy for each of a hundred idle devices (0.4-2 s of the PS's time a result;
    docs/simulate.md, "Heterogeneous groups at a thousand devices"). A plan has a few sizes a
    GEMM, so the classes are few; a class is dropped once nothing is indexed in it.
    """

    def __init__(self, devices: dict[str, DeviceSlot]):
        self._devices = devices
        self.classes: dict[float, BackupIndex] = {}
        # every copy admitted to a search list, in order, and per device whose last search
        # found nothing: what it was searched with and until when that answer stands
        # (Scheduler._backup_candidate)
        self.admitted: list[_Logged] = []
        self.found_none: dict[str, _NoneFound] = {}
        self._synced_s = -math.inf
        self._log_kept = 0  # its length after the last trim

    def add(self, copy: Copy, slot: DeviceSlot) -> None:
        """Index a copy just handed out (:meth:`BackupIndex.add`). A new tile size (a new
        GEMM's, mostly) first drops the classes nothing counts in any more: their entries hold
        the finished GEMMs' tasks, and with them their operands."""
        index = self.classes.get(copy.task.flops)
        if index is None:
            for flops in [f for f, c in self.classes.items() if c.empty()]:
                del self.classes[flops]
            index = self.classes[copy.task.flops] = BackupIndex(self._devices, self.admitted)
        if len(self.admitted) > max(ADMITTED_LOG_MIN, ADMITTED_LOG_GROWTH * self._log_kept):
            self._trim_log()
        index.add(copy, slot)

    def _trim_log(self) -> None:
        """Drop the logged copies that no longer count (their results came back, their
        devices left), in place (the indexes hold the list); each kept answer's place in the
        log moves with it. A search skips such copies anyway."""
        log, devices = self.admitted, self._devices
        kept: list[_Logged] = []
        before = [0] * (len(log) + 1)  # how many entries are kept before each old place
        for i, entry in enumerate(log):
            before[i] = len(kept)
            if _counts(entry[0], entry[1], entry[2], devices):
                kept.append(entry)
        before[len(log)] = len(kept)
        for answer in self.found_none.values():
            answer.seen = before[answer.seen]
        log[:] = kept
        self._log_kept = len(kept)

    def sync(self, now_s: float, overdue_s: float) -> None:
        """Bring every class to ``now_s``: the copies overdue by then move to their list, and
        those of devices of unknown overhead overdue long enough are admitted (and logged).
        Once per time: a copy added since is not overdue by ``overdue_s`` at that time."""
        if now_s == self._synced_s:
            return
        self._synced_s = now_s
        for index in self.classes.values():
            index._sync(now_s, overdue_s)

    def kept(self, slot: DeviceSlot, now_s: float, state: tuple[Any, ...]
             ) -> _NoneFound | None:
        """The device's kept answer (nothing found) if it stands for the copies it looked at:
        its state is the same, its time not up (then only the copies logged since its
        ``seen`` need a look)."""
        kept = self.found_none.get(slot.device_id)
        return kept if kept is not None and now_s < kept.until_s and kept.state == state \
            else None

    def known(self, slot: DeviceSlot) -> None:
        """The device's overhead became known (:meth:`BackupIndex.known`)."""
        for index in self.classes.values():
            index.known(slot)

    def unpark(self, task: Task) -> None:
        """A holder of the task let go (:meth:`BackupIndex.unpark`)."""
        index = self.classes.get(task.flops)
        if index is not None:
            index.unpark(task)

    @property
    def min_flops(self) -> float:
        """No copy indexed has fewer FLOPs (inf: none; a bound, not exact)."""
        return min((index.min_flops for index in self.classes.values()), default=math.inf)

    def earliest_expected_s(self) -> float:
        """The earliest predicted return of any copy in the search (inf: none)."""
        return min((index.earliest_expected_s() for index in self.classes.values()),
                   default=math.inf)

    def mosts(self, now_s: float, overdue_s: float) -> list[tuple[BackupIndex, float]]:
        """Each class with copies in the search, and the most remaining time of any (the
        classes that hold nothing any more are dropped here)."""
        out = []
        for flops, index in list(self.classes.items()):
            most = index.most_remaining_s(now_s, overdue_s)
            if most > -math.inf:
                out.append((index, most))
            elif index.empty():
                del self.classes[flops]
        return out


_first_item = operator.itemgetter(0)

_GONE = -(1 << 62)  # a removed task's position: no queue entry matches it


class PendingQueue:
    """The FIFO of pending tasks: append, appendleft, removal anywhere, and an index by owner.

    Removal is lazy (a removed task's entries stay until they reach an end or the queue is
    compacted), so taking a task from the middle costs O(1) instead of a scan. Every entry
    carries its position: appends count up, appendlefts count down, so the positions order the
    tasks exactly as a deque with the same operations would (deletions do not reorder). The
    per-owner deques keep each owner's tasks in that same order.
    """

    def __init__(self, is_dead: Callable[[str], bool] = lambda owner: False) -> None:
        self._is_dead = is_dead  # whether an owner is gone or quarantined
        self._dead: set[str] = set()  # owners with (possibly) queued tasks that are dead
        self._retried: dict[int, Task] = {}  # queued tasks of attempt > 0
        self._q: deque[tuple[int, Task]] = deque()
        self._by_owner: dict[str | None, deque[tuple[int, Task]]] = {}
        self._front = 0
        self._back = 0
        self._live = 0

    @staticmethod
    def _valid(entry: tuple[int, Task]) -> bool:
        return entry[1].qpos == entry[0]

    def _add(self, task: Task, pos: int, left: bool) -> None:
        task.queued, task.qpos = True, pos
        entry = (pos, task)
        owned = self._by_owner.get(task.owner)
        if owned is None:
            owned = self._by_owner[task.owner] = deque()
        if task.owner is not None and self._is_dead(task.owner):
            self._dead.add(task.owner)
        if task.attempt > 0:
            self._retried[task.task_id] = task
        if left:
            self._q.appendleft(entry)
            owned.appendleft(entry)
        else:
            self._q.append(entry)
            owned.append(entry)
        self._live += 1

    def append(self, task: Task) -> None:
        """Queue a task at the back."""
        self._add(task, self._back, left=False)
        self._back += 1

    def appendleft(self, task: Task) -> None:
        """Queue a task at the front."""
        self._front -= 1
        self._add(task, self._front, left=True)

    def remove(self, task: Task) -> None:
        """Take a queued task out (wherever it is)."""
        if task.qpos == _GONE:
            raise ValueError(f"task {task.task_id} is not queued")
        task.queued, task.qpos = False, _GONE
        self._retried.pop(task.task_id, None)
        self._live -= 1
        if len(self._q) > 2 * self._live + 256:
            self._compact()

    def popleft(self) -> Task:
        """Take the first task out."""
        task = self.first()
        if task is None:
            raise IndexError("pop from an empty queue")
        self.remove(task)
        return task

    def first(self) -> Task | None:
        """The first task (None: empty)."""
        q = self._q
        while q and not self._valid(q[0]):
            q.popleft()
        return q[0][1] if q else None

    def last(self) -> Task | None:
        """The last task (None: empty)."""
        q = self._q
        while q and not self._valid(q[-1]):
            q.pop()
        return q[-1][1] if q else None

    def _compact(self) -> None:
        self._q = deque(e for e in self._q if self._valid(e))
        for owner in list(self._by_owner):
            kept = deque(e for e in self._by_owner[owner] if self._valid(e))
            if kept:
                self._by_owner[owner] = kept
            else:
                del self._by_owner[owner]
                if owner is not None:
                    self._dead.discard(owner)

    def owned(self, owner: str | None) -> Iterator[Task]:
        """The queued tasks of one owner, in queue order."""
        q = self._by_owner.get(owner)
        if q is None:
            return
        while q and not self._valid(q[0]):
            q.popleft()
        if not q:
            del self._by_owner[owner]
            if owner is not None:
                self._dead.discard(owner)
            return
        for entry in q:
            if self._valid(entry):
                yield entry[1]

    def owned_any(self, owner: str | None) -> bool:
        """Whether one owner has a queued task."""
        return next(self.owned(owner), None) is not None

    def owner_gone(self, owner: str) -> None:
        """An owner left or was quarantined: its queued tasks are orphans."""
        if owner in self._by_owner:
            self._dead.add(owner)

    def owner_back(self, owner: str) -> None:
        """A device registered under this id (its queued tasks are its own again)."""
        self._dead.discard(owner)

    def dead_owners(self) -> list[str]:
        """Dead owners that may have queued tasks."""
        return list(self._dead)

    def retried(self) -> list[Task]:
        """Queued tasks that were handed out before (the only ones an owner can have had)."""
        return list(self._retried.values())

    def __iter__(self) -> Iterator[Task]:
        for entry in self._q:
            if self._valid(entry):
                yield entry[1]

    def __len__(self) -> int:
        return self._live

    def __bool__(self) -> bool:
        return self._live > 0

    def __contains__(self, task: object) -> bool:
        return isinstance(task, Task) and task.queued and any(t is task for t in self)


_UNKNOWN = DeviceSlot("", "", 1.0, 1, 0)  # a device whose overhead is not known yet
_Key = tuple[float, int, str]  # a ready device's place: (-rate_flops, order, device_id)


def _unique(keys: Iterable[_Key]) -> Iterator[_Key]:
    """A sorted walk without repeats."""
    last = None
    for key in keys:
        if key != last:
            yield key
        last = key


_ZERO_BUCKET = -(1 << 30)  # the overhead bucket of devices whose overhead is 0
BUCKETS_PER_OCTAVE = 4  # overhead buckets: each spans a factor of 2 ** (1 / 4)


def overhead_bucket(overhead_s: float) -> int:
    """The bucket of a known overhead (ReadyIndex): floor(log2(overhead) x 4); 0 has its own."""
    if overhead_s <= 0.0:
        return _ZERO_BUCKET
    return math.floor(math.log2(overhead_s) * BUCKETS_PER_OCTAVE)


def bucket_floor_s(bucket: int) -> float:
    """No overhead in the bucket is below this (a margin for the rounding of log2)."""
    if bucket == _ZERO_BUCKET:
        return 0.0
    return 2.0 ** (bucket / BUCKETS_PER_OCTAVE) * (1 - 1e-6)


class ReadyIndex:
    """The devices with room in their window, fastest first, kept filed instead of sorted.

    The order is the PS pump's: ``rate_flops`` descending, then registration order (a stable
    sort of the devices in join order). A device's place changes only when its rate, window or
    copies do, so the caller :meth:`touch`-es the devices it knows changed (the one a result
    came from, the ones just given tiles) and calls :meth:`rebuild` when windows were resized
    (a join, a departure, a quarantine). ``blocked`` devices (the caller's: e.g. partitioned)
    are left out. It also keeps the least known overhead of any registered device, a lower
    bound of every ready device's ``_overhead_s`` (an unknown one is the mean of the known).

    For the backup search it files the ready devices once more, those of known overhead by
    overhead bucket (a factor of 2 ** (1/4) each) and those of unknown overhead apart, each list
    in pump order, so that :meth:`backup_walk` can leave out, list by list, the devices too slow
    for a backup given their overhead: with thousands of idle devices, most fail the backup
    search's first test on their own overhead, not on their speed.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self._sched = scheduler
        self._keys: list[tuple[float, int, str]] = []  # sorted: (-rate_flops, order, id)
        self._key_of: dict[str, tuple[float, int, str]] = {}
        # the same keys by overhead bucket (known overheads) and of unknown overhead
        self._buckets: dict[int, list[_Key]] = {}
        self._bucket_of: dict[str, int | None] = {}  # None: in _unknown_keys
        self._unknown_keys: list[_Key] = []
        self._blocked: set[str] = set()
        self._overheads: list[tuple[float, str]] = []  # heap, stale entries dropped lazily
        self._filed_overhead: dict[str, float] = {}
        # devices touched since the last assign_ready (None: all of them count as touched)
        self._fresh: set[str] | None = None
        self._newest_task = -1  # the newest task id at the last assign_ready

    def touch(self, slot: DeviceSlot) -> None:
        """File a device again after its rate, window or copies changed (or it left)."""
        device_id = slot.device_id
        if self._fresh is not None:
            self._fresh.add(device_id)
        old = self._key_of.pop(device_id, None)
        if old is not None:
            del self._keys[bisect.bisect_left(self._keys, old)]
            bucket = self._bucket_of.pop(device_id)
            filed = self._unknown_keys if bucket is None else self._buckets[bucket]
            del filed[bisect.bisect_left(filed, old)]
            if bucket is not None and not filed:
                del self._buckets[bucket]
        if (self._sched.devices.get(device_id) is slot and slot.free > 0
                and device_id not in self._blocked):
            key = (-slot.rate_flops, slot.order, device_id)
            bisect.insort(self._keys, key)
            self._key_of[device_id] = key
            if slot.overhead_s is None:
                self._bucket_of[device_id] = None
                bisect.insort(self._unknown_keys, key)
            else:
                bucket = self._bucket_of[device_id] = overhead_bucket(slot.overhead_s)
                bisect.insort(self._buckets.setdefault(bucket, []), key)
        overhead = slot.overhead_s
        if overhead is not None and self._filed_overhead.get(device_id) != overhead:
            self._filed_overhead[device_id] = overhead
            heapq.heappush(self._overheads, (overhead, device_id))
            if len(self._overheads) > 2 * len(self._filed_overhead) + 64:
                self._overheads = [(o, d) for d, o in self._filed_overhead.items()]
                heapq.heapify(self._overheads)

    def mark_fresh(self, slot: DeviceSlot) -> None:
        """Offer a device work at the next pump even if nothing about it changes."""
        if self._fresh is not None:
            self._fresh.add(slot.device_id)

    def block(self, slot: DeviceSlot, blocked: bool) -> None:
        """Leave a device out (True) or let it back in (False)."""
        (self._blocked.add if blocked else self._blocked.discard)(slot.device_id)
        self.touch(slot)

    def rebuild(self) -> None:
        """File every registered device again (windows were resized)."""
        self._keys.clear()
        self._key_of.clear()
        self._buckets.clear()
        self._bucket_of.clear()
        self._unknown_keys.clear()
        self._fresh = None
        self._filed_overhead = {d: o for d, o in self._filed_overhead.items()
                                if d in self._sched.devices}
        for slot in self._sched.devices.values():
            self.touch(slot)

    def slots(self) -> list[DeviceSlot]:
        """The ready devices in pump order."""
        devices = self._sched.devices
        return [devices[key[2]] for key in self._keys]

    def take_fresh(self) -> set[str] | None:
        """The devices touched since the last call (None: any device may be), and start over.

        A device not touched since the last pump holds no pending tile of its own unless
        tiles were submitted since (then: None), for that pump offered it its own tiles first.
        """
        fresh, self._fresh = self._fresh, set()
        newest = next(reversed(self._sched.tasks), -1)
        if newest > self._newest_task:
            fresh = None
        self._newest_task = max(self._newest_task, newest)
        return fresh

    def backup_walk(self, start: _Key, bar_s: float, flops_s: float,
                    unknown_overhead_s: float | None) -> Iterator[_Key]:
        """The ready devices from ``start`` on (inclusive), in pump order, leaving out those
        that cannot finish a tile in less than ``bar_s`` wall seconds: a tile that takes
        ``flops_s`` wall seconds at 1 FLOP/s (FLOPs x dilation), plus the device's overhead,
        at least its bucket's floor. ``unknown_overhead_s``: what a device of unknown overhead
        counts (None: leave them all out). A superset of the devices that pass; the caller
        tests each."""
        lists: list[tuple[float, list[_Key]]] = [
            (bucket_floor_s(b), keys) for b, keys in self._buckets.items()]
        if unknown_overhead_s is not None and self._unknown_keys:
            lists.append((unknown_overhead_s, self._unknown_keys))
        runs: list[list[_Key]] = []
        for floor_s, keys in lists:
            # margins: a bound for finish_wall_s's rounding, never tighter than the test
            room_s = bar_s - floor_s + 1e-9 * (abs(bar_s) + floor_s)
            if not room_s > 0.0:
                continue
            begin = bisect.bisect_left(keys, start)
            rate = flops_s / room_s * (1 - 1e-9)  # faster than this, or it cannot pass
            end = len(keys) if rate < 1.0 else bisect.bisect_left(keys, (-rate,))
            if begin < end:
                runs.append(keys[begin:end])
        if len(runs) == 1:
            return iter(runs[0])
        return heapq.merge(*runs)

    def least_overhead_s(self) -> float:
        """No ready device's ``Scheduler._overhead_s`` is below this."""
        heap, devices, filed = self._overheads, self._sched.devices, self._filed_overhead
        while heap:
            overhead, device_id = heap[0]
            slot = devices.get(device_id)
            if slot is not None and slot.overhead_s == overhead and \
                    filed.get(device_id) == overhead:
                return overhead
            heapq.heappop(heap)
            if slot is None:
                filed.pop(device_id, None)
        return 0.0  # nothing known: an unknown overhead counts as 0


class Verdict(enum.Enum):
    ACCEPTED = "accepted"  # placed into C
    LATE = "late"  # a duplicate, a losing copy or a superseded attempt: dropped
    REJECTED = "rejected"  # refused: the device is told why


@dataclass
class Outcome:
    verdict: Verdict
    reason: str = ""
    completed_job: GemmJob | None = None  # set when this result finished its GEMM
    requeued: bool = False  # the task went back to the queue (bad result)
    task: Task | None = None
    checked: bool = False  # the values went through the check
    failed_check: bool = False  # the result was refused by a check (not a protocol error)
    quarantined: list[Task] | None = None  # set when this result quarantined its device:
    # the tasks that went back to the queue
    backup_won: bool = False  # the accepted copy was a backup
    attempt: int = 0
    cancelled: list[str] = field(default_factory=list)  # devices whose losing copy stopped
    # counting as in flight when this result won
    sent_s: float = 0.0  # when the accepted copy was handed out (the PS's monotonic clock)


@dataclass
class SchedulerCounters:
    """Totals since the start of the run."""

    requeued: int = 0  # tasks put back in the queue
    recomputed: int = 0  # accepted results of attempt > 0
    backups: int = 0  # backup copies handed out
    backup_wins: int = 0  # accepted results that came from a backup copy
    wasted: int = 0  # valid results dropped because another copy won
    cancelled: int = 0  # losing copies that stopped counting as in flight when another won
    checks: int = 0  # results whose values were checked
    failed_checks: int = 0
    validation_cpu_s: float = 0.0  # CPU time of the loop thread inside the checks
    flops_accepted: float = 0.0
    flops_returned: float = 0.0  # every result that came back (accepted, late, refused)
    prefilled: int = 0  # tiles served from the ledger, never sent to a device


class Scheduler:
    """Queue, windows, copies, caches and result bookkeeping for one run."""

    def __init__(self, on_event: Callable[..., None] | None = None, check_values: bool = True,
                 freivalds_vectors: int = 1, quarantine_after: int = 3, dilation: float = 1.0,
                 speculate: bool = True, window_scale: float = WINDOW_SCALE):
        self.devices: dict[str, DeviceSlot] = {}
        self.pending = PendingQueue(self._owner_dead)
        self._backups = BackupClasses(self.devices)
        self._orders = itertools.count()  # registration order of devices
        self._copy_seq = itertools.count()  # order in which copies are handed out
        self.tasks: dict[int, Task] = {}  # live tasks of unfinished GEMMs
        self._ids = itertools.count()
        self._on_event = on_event or (lambda kind, **fields: None)
        self.check_values = check_values
        self.freivalds_vectors = freivalds_vectors
        self.quarantine_after = quarantine_after
        self.dilation = dilation
        self.speculate = speculate
        self.window_scale = window_scale  # tiles a median-speed device may have out
        self.counters = SchedulerCounters()
        self._mean_overhead_s: float | None = None  # cache of _overhead_s's fallback

    @property
    def requeued_total(self) -> int:
        return self.counters.requeued

    @property
    def recomputed_total(self) -> int:
        return self.counters.recomputed

    # -- devices -------------------------------------------------------------------------------
    def _owner_dead(self, owner: str) -> bool:
        slot = self.devices.get(owner)
        return slot is None or slot.quarantined

    def add_device(self, slot: DeviceSlot) -> None:
        """Register a device and size every window again."""
        self.add_devices([slot])

    def add_devices(self, slots: Iterable[DeviceSlot]) -> None:
        """Register devices in turn and size every window once: the state add_device leaves
        after each of them (windows depend only on the devices registered)."""
        for slot in slots:
            old = self.devices.get(slot.device_id)
            slot.order = old.order if old is not None else next(self._orders)  # dict order
            self.devices[slot.device_id] = slot
            self.pending.owner_back(slot.device_id)
        self._resize_windows()

    def set_max_in_flight(self, device_id: str, tiles: int) -> None:
        """A device changed how many tiles it wants outstanding."""
        slot = self.devices.get(device_id)
        if slot is not None:
            slot.max_in_flight = max(1, tiles)
            self._resize_windows()

    def remove_device(self, device_id: str) -> list[Task]:
        """Forget a device; tasks it alone held go back to the front of the queue."""
        slot = self.devices.pop(device_id, None)
        if slot is None:
            return []
        self.pending.owner_gone(device_id)
        requeued = self._release_all(slot)
        self._resize_windows()
        return requeued

    def account_pause(self, lost_s: float, now_s: float) -> None:
        """The PS did not run for ``lost_s`` (:meth:`PsCore.account_pause`): every copy out was
        handed out that much later, as its predicted return, the backup search and the overhead
        learned from its result see it (never later than ``now_s``). Without this, each copy out
        was overdue on waking and backed up, and each result then taught its device an overhead
        of about the pause (9 s after 30 s: a tiny run, as the unit test pauses it)."""
        index = BackupClasses(self.devices)
        for slot in self.devices.values():
            for copy in (*slot.in_flight.values(), *slot.cancelled.values()):
                copy.sent_s = min(copy.sent_s + lost_s, now_s)
                copy.expected_s += lost_s
            if slot.quarantined:
                continue
            for copy in slot.in_flight.values():  # filed again at their new times
                copy.idx_ver += 1
                index.add(copy, slot)
        self._backups = index

    def quarantine(self, device_id: str) -> list[Task]:
        """Stop trusting a device: no more work; tasks it alone held are re-queued."""
        slot = self.devices.get(device_id)
        if slot is None or slot.quarantined:
            return []
        slot.quarantined = True
        self.pending.owner_gone(device_id)
        self._resize_windows()
        return self._release_all(slot, keep_copies=True)

    def _release_all(self, slot: DeviceSlot, keep_copies: bool = False) -> list[Task]:
        """Drop the device's claim on its copies; re-queue tasks nobody else holds."""
        requeued: list[Task] = []
        for copy in slot.in_flight.values():
            if self._release(copy.task, slot.device_id, front=False):
                requeued.append(copy.task)
        for task in reversed(requeued):
            self.pending.appendleft(task)
        if not keep_copies:
            slot.in_flight.clear()
            slot.cancelled.clear()
            slot.copies_changed += 1
        return requeued

    def _release(self, task: Task, device_id: str, front: bool = True) -> bool:
        """The device's copy no longer counts; re-queue the task if nobody holds it now."""
        task.holders.discard(device_id)
        if not task.done and task.holders:
            self._backups.unpark(task)  # its other copy may be backed up again
        if task.done or task.holders or task.queued:
            return False
        task.attempt += 1
        task.holder = None
        task.queued = True
        self.counters.requeued += 1
        if front:
            self.pending.appendleft(task)
        return True

    def _resize_windows(self) -> None:
        self._mean_overhead_s = None  # the set of devices changed
        trusted = [s for s in self.devices.values() if not s.quarantined]
        if not trusted:
            return
        median = statistics.median(s.predicted_gflops for s in trusted) or 1.0
        for s in trusted:
            scaled = round(self.window_scale * s.predicted_gflops / median)
            s.window = max(1, min(s.max_in_flight, scaled))

    # -- work in -------------------------------------------------------------------------------
    def submit(self, job: GemmJob, regions: Sequence[Region],
               prefilled: dict[tuple[int, ...], np.ndarray] | None = None,
               owners: dict[tuple[int, int, int], str] | None = None, held: bool = False
               ) -> int:
        """Queue every tile of a GEMM cut in ``regions`` (runs of C's rows, each cut its own
        way, :func:`~testbed.ps_backend.tiler.cut_regions`; a uniform cut is one,
        :func:`~testbed.ps_backend.tiler.uniform`); tiles in ``prefilled`` (by box key) are
        placed at once. ``owners`` maps tile ``(row, col, part)`` to the device the plan gave
        it (tasks are queued in the plan's dealing order, ``(part, row, col)``, region by
        region); ``held``, that the devices keep its blocks for later (:attr:`GemmJob.held`).
        Returns how many tiles were prefilled. A GEMM whose every tile is prefilled is
        done when this returns (its future is resolved).
        """
        m = job.a.shape[0]
        if not regions or regions[0].r0 != 0 or regions[-1].r1 != m or any(
                a.r1 != b.r0 for a, b in zip(regions, regions[1:])):
            raise ValueError(f"{job.uid}: regions {regions} do not cover rows 0:{m} once")
        boxes = cut_regions(job.b.shape[1], job.a.shape[1], regions)
        job.held = held
        if self.check_values:  # Freivalds' work shared by the GEMM's tiles (K-split: per slice)
            job.check = GemmCheck(job.a, job.b, [(b.c0, b.c1, b.k0, b.k1) if b.split
                                                 else (b.c0, b.c1) for b in boxes],
                                  self.freivalds_vectors)
        served = 0
        job.remaining = len(boxes)
        for box in boxes:
            ready = prefilled.get(box.key) if prefilled else None
            if ready is not None and ready.shape == box.shape:
                self._store(job, box, ready)
                job.remaining -= 1
                served += 1
                continue
            task = Task(next(self._ids), job, box, queued=True,
                        owner=owners.get((box.row, box.col, box.part)) if owners else None)
            self.tasks[task.task_id] = task
            self.pending.append(task)
        self.counters.prefilled += served
        if job.remaining == 0 and not job.done.done():
            job.done.set_result(job.c)
        return served

    def invalidate(self, before_version: int) -> None:
        """Weights advanced: every device drops older cached blocks (mirrors too)."""
        for slot in self.devices.values():
            slot.cache.invalidate(before_version)

    # -- work out ------------------------------------------------------------------------------
    def finish_wall_s(self, slot: DeviceSlot, flops: float) -> float:
        """Predicted wall seconds until the device would return a new tile of this size."""
        return slot.finish_estimate_s(flops) * self.dilation + self._overhead_s(slot)

    def _overhead_s(self, slot: DeviceSlot) -> float:
        """The device's overhead; before its first result, the mean of the known ones."""
        if slot.overhead_s is not None:
            return slot.overhead_s
        if self._mean_overhead_s is None:  # recomputed only after an observation changed it
            known = [s.overhead_s for s in self.devices.values() if s.overhead_s is not None]
            self._mean_overhead_s = sum(known) / len(known) if known else 0.0
        return self._mean_overhead_s

    def _eligible(self, slot: DeviceSlot, task: Task) -> bool:
        """A device gets a task it had before (and failed) only if no other device could."""
        return task.task_id not in slot.given or not any(
            o is not slot and not o.quarantined and task.task_id not in o.given
            for o in self.devices.values())

    def assign(self, device_id: str, now_s: float | None = None) -> list[Assignment]:
        """Hand a device as many tasks as its window allows (backups when idle)."""
        slot = self.devices.get(device_id)
        if slot is None or slot.quarantined:
            return []
        now_s = time.monotonic() if now_s is None else now_s
        out: list[Assignment] = []
        speculate = self.speculate
        while slot.free > 0 and self.pending:
            task = self._pick(slot, now_s)
            if task is None:
                break
            out.append(self._give(slot, task, now_s, backup=False))
        if speculate and not self._pending_live():
            while slot.free > 0:
                task = self._backup_candidate(slot, now_s)
                if task is None:
                    break
                self.counters.backups += 1
                out.append(self._give(slot, task, now_s, backup=True))
        return out

    def assign_each(self, slots: Sequence[DeviceSlot], now_s: float
                    ) -> list[tuple[DeviceSlot, list[Assignment]]]:
        """:meth:`assign` for each device in turn, as the PS pumps: ``slots`` fastest first
        (``rate_flops`` non-increasing). The same assignments; it stops early once nothing is
        pending and no device left in the list could take a backup (a bound: each finishes no
        sooner than a one-tile device as fast as the next one, with the smallest overhead of
        those left)."""
        out: list[tuple[DeviceSlot, list[Assignment]]] = []
        floors: list[float] | None = None  # per position: the least overhead from there on
        for i, slot in enumerate(slots):
            if not self._pending_live():
                if floors is None:
                    unknown = self._overhead_s(_UNKNOWN)  # what _overhead_s gives those
                    floors = list(itertools.accumulate(
                        (unknown if o is None else o
                         for o in [s.overhead_s for s in reversed(slots)]), min))[::-1]
                if self._no_backup_below(slot.rate_flops, floors[i], now_s):
                    break
            got = self.assign(slot.device_id, now_s=now_s)
            if got:
                out.append((slot, got))
        return out

    def assign_ready(self, ready: ReadyIndex, now_s: float
                     ) -> list[tuple[DeviceSlot, list[Assignment]]]:
        """:meth:`assign_each` over ``ready.slots()`` without building that list: the same
        assignments (its stop bound uses the least overhead of any device, no larger than
        ``assign_each``'s, so it may offer a few more devices nothing, never fewer anything).
        The caller touches the devices given tiles afterwards."""
        out: list[tuple[DeviceSlot, list[Assignment]]] = []
        devices = self.devices
        keys = ready._keys  # not changed before the caller touches (after this returns)
        fresh = ready.take_fresh()
        floor = ready.least_overhead_s()
        fresh_keys = None if fresh is None else \
            sorted(ready._key_of[d] for d in fresh if d in ready._key_of)
        pos: _Key | None = keys[0] if keys else None  # where the walk (re)starts, inclusive
        while pos is not None:
            if not self._pending_live():  # from here on to the end of this pump: backups only
                self._assign_backups(ready, pos, floor, now_s, out)
                break
            first = self.pending.first()
            walk, bar = self._pending_walk(ready, pos, fresh_keys, now_s)
            pos = None
            for key in walk:
                slot = devices[key[2]]
                if not self._pending_live() or self.pending.first() is not first:
                    pos = key  # backups only, or another steal candidate: walk again
                    break
                # _pick_planned's test for a device with no tile of its own (one not touched
                # since the last pump has none; see take_fresh)
                if fresh is not None and (slot.device_id not in fresh or not
                                          self.pending.owned_any(slot.device_id)) and \
                        not self._would_steal(slot, bar, now_s):
                    continue
                got = self.assign(slot.device_id, now_s=now_s)
                if slot.free > 0 and self.pending.owned_any(slot.device_id):
                    ready.mark_fresh(slot)  # passed over with tiles of its own: offer again
                if got:
                    out.append((slot, got))
                    if fresh is not None:  # the queue, the owners and the copies changed
                        at = bisect.bisect_right(keys, key)
                        pos = keys[at] if at < len(keys) else None
                        break
        return out

    def _pending_walk(self, ready: ReadyIndex, start: _Key, fresh_keys: list[_Key] | None,
                      now_s: float) -> tuple[Iterator[_Key], float]:
        """assign_ready's walk while tiles are pending, from ``start`` on (inclusive), in pump
        order, and the steal bar it was made for: every device if any could get a tile (after a
        submit, or with orphans: no bound), else the devices with tiles of their own (fresh:
        touched since the last pump; a device not touched holds no pending tile of its own, for
        that pump offered it them) and those fast enough for a steal given their overhead (a
        superset of those passing _would_steal)."""
        keys = ready._keys
        begin = bisect.bisect_left(keys, start)
        if fresh_keys is None:
            return (keys[j] for j in range(begin, len(keys))), -math.inf
        bar = self._steal_bar_s(now_s)
        if bar == -math.inf:
            return (keys[j] for j in range(begin, len(keys))), bar
        first = self.pending.first()
        assert first is not None
        own = fresh_keys[bisect.bisect_left(fresh_keys, start):]
        steal_bar_s = min(bar / STRAGGLER_RATIO, bar - MIN_BACKUP_GAIN_S)
        thieves = ready.backup_walk(start, steal_bar_s, first.flops * self.dilation, None)
        return _unique(heapq.merge(own, thieves)), bar

    def _assign_backups(self, ready: ReadyIndex, start: _Key, floor_s: float, now_s: float,
                        out: list[tuple[DeviceSlot, list[Assignment]]]) -> None:
        """assign_ready's walk once nothing is pending: backups only, to the ready devices
        from ``start`` on, in pump order; those whose overhead and speed cannot pass
        _backup_candidate's first test are left out (ReadyIndex.backup_walk), the others are
        tested exactly before assign is called (it would hand them nothing, change nothing)."""
        index = self._backups
        if not self.speculate or math.isinf(index.min_flops):
            return
        overdue_s = OVERDUE_BACKUP_S * self.dilation
        mosts = index.mosts(now_s, overdue_s)
        most = max((m for _, m in mosts), default=-math.inf)
        if most <= 0.0:
            return
        # _backup_candidate gives a device whose overhead is unknown only copies overdue by
        # OVERDUE_BACKUP_S: unless one is, leave those devices out (nor will one be in this
        # pump: new copies are due later)
        unknown = self._overhead_s(_UNKNOWN) \
            if now_s - index.earliest_expected_s() >= overdue_s else None
        # a device passes only if its finish at the smallest tile is below both bars (most is
        # non-increasing in this pump: it only loses copies to new holders, new ones are shorter)
        bar_s = min(most / STRAGGLER_RATIO, most - MIN_BACKUP_GAIN_S)
        devices = self.devices
        current: list[tuple[BackupIndex, float]] | None = mosts
        sure_rate = self._sure_backup_rate(floor_s, mosts)
        for key in ready.backup_walk(start, bar_s, index.min_flops * self.dilation, unknown):
            slot = devices[key[2]]
            if current is None:
                current = index.mosts(now_s, overdue_s)
                sure_rate = self._sure_backup_rate(floor_s, current)
            if slot.rate_flops < sure_rate and \
                    self._no_backup_below(slot.rate_flops, floor_s, now_s, current):
                break
            if slot.overhead_s is None and \
                    not now_s - index.earliest_expected_s() >= overdue_s:
                continue  # as above: nothing it could take
            # a device whose kept answer stands looks only at the copies logged since
            # (_backup_candidate): none, and it is handed nothing; else _backup_candidate's
            # first test, for each tile size: without it, assign would hand it nothing
            state = self._search_state(slot) if slot.overhead_s is not None else None
            kept = index.kept(slot, now_s, state) if state is not None else None
            if kept.seen < len(index.admitted) if kept is not None else \
                    self._may_back_up(slot, now_s, current, state):
                got = self.assign(slot.device_id, now_s=now_s)
                if got:
                    out.append((slot, got))
                    current = None  # the copies changed
            if slot.free > 0 and self.pending.owned_any(slot.device_id):
                ready.mark_fresh(slot)  # passed over with tiles of its own: offer them again

    def _may_back_up(self, slot: DeviceSlot, now_s: float,
                     mosts: list[tuple[BackupIndex, float]], state: tuple[Any, ...] | None
                     ) -> bool:
        """_backup_candidate's first test for each tile size (``mosts``: the classes synced to
        now_s, with their most remaining time): whether the longest copy of any could qualify.
        A device that fails it found nothing: its answer is kept as a search's would be
        (``state``: its _search_state, None if its overhead is unknown), so that the pumps
        after this one pass over it until a copy could ripen (half the devices of
        mixed-1000's pumps failed it, each pump again)."""
        horizon = math.inf
        fetch = 0 < slot.down_Bps < math.inf
        for index, most in mosts:
            floor = self._backup_floor_s(slot, now_s, index)
            if copy_pays(most, floor):
                return True
            if state is not None:  # as _candidate_in's first test
                queued_s = slot.queued_s(now_s) if fetch else 0.0
                horizon = min(horizon, _none_pays_from_s(now_s, most, floor, floor - queued_s))
        if state is not None:
            classes = self._backups
            classes.found_none[slot.device_id] = _NoneFound(
                state, len(classes.admitted), horizon - _RIPE_MARGIN_S)
        return False

    def _steal_bar_s(self, now_s: float) -> float:
        """With tiles pending, all planned and none an orphan: the finish ``_pick_planned``
        compares a thief's with (its steal candidate's owner's); -inf if there are orphans
        or unplanned tiles (then no bound: every device must be offered)."""
        pending = self.pending
        if pending.owned_any(None) or pending.dead_owners() or pending.retried():
            return -math.inf
        task = pending.first()
        owner = self.devices.get(task.owner) if task is not None and task.owner else None
        if task is None or task.done or owner is None or owner.quarantined:
            return -math.inf
        # the same expressions as _pick_planned (every pending tile is eligible for every
        # device: none was handed out before, attempt 0)
        backlog = sum(1 for t in pending.owned(owner.device_id) if not t.done)
        overdue_s = max((now_s - c.expected_s for c in itertools.chain(
            owner.in_flight.values(), owner.cancelled.values())), default=0.0)
        return self.finish_wall_s(owner, task.flops) + max(overdue_s, 0.0) + \
            backlog * task.flops / max(owner.rate_flops, 1.0) * self.dilation + \
            self._backlog_fetch_s(owner, now_s)

    def _would_steal(self, slot: DeviceSlot, bar_s: float, now_s: float) -> bool:
        """Whether _pick_planned would let this device (no tile of its own, no orphans) steal
        from an owner whose finish is ``bar_s``: its test, the blocks the device would have to
        fetch included (on slow links most idle devices fail on those, not on their speed)."""
        if bar_s == -math.inf:
            return True  # no bound: offer it
        if slot.overhead_s is None:
            return False
        task = self.pending.first()
        assert task is not None
        if task.task_id in slot.given:
            return True  # not this device's steal candidate: let _pick_planned decide
        mine = self.finish_wall_s(slot, task.flops) + self._fetch_s(slot, task, now_s)
        return copy_pays(bar_s, mine)

    def _sure_backup_rate(self, overhead_s: float, mosts: list[tuple[BackupIndex, float]]
                       ) -> float:
        """A speed (FLOP/s) at and above which :meth:`_no_backup_below` is False for this
        overhead and these classes, solved from its test with a margin against its rounding
        (inf: none known; the test then decides). The pump's walk asks that test of every
        device it passes, fastest first: four hundred a result on a thousand devices. (Were
        the margin ever short, the walk would only go on past where it could have stopped:
        each device it meets is tested exactly.)"""
        ratio, gain, dilation = STRAGGLER_RATIO, MIN_BACKUP_GAIN_S, self.dilation
        sure = math.inf
        for size, most in mosts:
            bar = min(most / ratio, most - gain)  # copy_pays(most, mine) for any mine below
            room = bar - overhead_s
            if most > 0.0 and room > 1e-6 * bar and not math.isinf(size.min_flops):
                sure = min(sure, size.min_flops * dilation / room * (1 + 1e-6))
        return sure

    def _no_backup_below(self, rate_flops: float, overhead_s: float, now_s: float,
                         mosts: list[tuple[BackupIndex, float]] | None = None) -> bool:
        """Whether no device at most this fast, with at least this overhead, can take a
        backup copy now, of any tile size (``mosts``: the index's :meth:`BackupClasses.mosts`
        at now_s, if known)."""
        index = self._backups
        if not self.speculate or math.isinf(index.min_flops):
            return True
        if mosts is None:
            mosts = index.mosts(now_s, OVERDUE_BACKUP_S * self.dilation)
        rate = max(rate_flops, 1.0)
        for size, most in mosts:
            # the least finish_wall_s of such a device at this size (1 - 1e-9: rounding of
            # the sum can only make the bound looser, never wrong)
            mine_min = ((size.min_flops / rate) * self.dilation + overhead_s) * (1 - 1e-9)
            if most > 0.0 and copy_pays(most, mine_min):
                return False
        return True

    def _pending_live(self) -> bool:
        first = self.pending.first()
        while first is not None and first.done:  # finished by another copy
            self.pending.remove(first)
            first = self.pending.first()
        return first is not None

    def _pick(self, slot: DeviceSlot, now_s: float) -> Task | None:
        if not self._pending_live():
            return None
        first, last = self.pending.first(), self.pending.last()
        assert first is not None and last is not None
        if first.owner is not None or last.owner is not None:
            return self._pick_planned(slot, now_s)
        if self._tail() and self._is_straggler(slot, first):
            return None
        best, best_score = first, -1
        for task in itertools.islice(self.pending, AFFINITY_SCAN):
            if task.done or not self._eligible(slot, task):
                continue
            score = sum(nbytes for key, nbytes in task.blocks if key in slot.cache)
            if score > best_score:
                best, best_score = task, score
        if best_score < 0:  # only tasks this device already had (it failed them): leave them
            return None if len(self.pending) <= AFFINITY_SCAN else self._pick_beyond(slot)
        return self._take(best)

    def _take(self, task: Task) -> Task:
        self.pending.remove(task)
        return task

    def _orphaned(self, task: Task) -> bool:
        """Whether a planned task has no owner to wait for (see _pick_planned)."""
        owner = self.devices.get(task.owner) if task.owner is not None else None
        return owner is None or owner.quarantined or task.task_id in owner.given

    def _first_orphan(self, slot: DeviceSlot) -> Task | None:
        """The first orphan in queue order the device may take.

        Orphans are the tasks without an owner, those of dead owners and those their owner
        gave back (which were handed out before: attempt > 0); the candidates of each kind are
        few, so this does not walk the queue.
        """
        best: Task | None = None

        def consider(task: Task) -> None:
            nonlocal best
            if best is None or task.qpos < best.qpos:
                best = task
        for owner in [None, *self.pending.dead_owners()]:
            for task in self.pending.owned(owner):
                if not task.done and self._eligible(slot, task) and self._orphaned(task):
                    consider(task)
                    break
        for task in self.pending.retried():
            if not task.done and self._eligible(slot, task) and self._orphaned(task):
                consider(task)
        return best

    def _pick_planned(self, slot: DeviceSlot, now_s: float) -> Task | None:
        """Own tasks first, then orphans (owner gone), then steal from a backlogged owner.

        In queue order: the device's first own task; else the first orphan; else the first
        task of a live owner, stolen (the owner's last one) if that owner's backlog straggles.
        The queue's per-owner index finds each without walking the whole queue.
        """
        for task in self.pending.owned(slot.device_id):
            if not task.done and self._eligible(slot, task):
                return self._take(task)
        # An owner that had a task and gave it back (failed check, refusal, lease) is no
        # longer its owner: it would not be offered it again while others can take it, and
        # nobody else would steal it from an owner without a backlog. An orphan.
        orphan = self._first_orphan(slot)
        if orphan is not None:
            if self._tail() and self._is_straggler(slot, orphan):
                return None
            return self._take(orphan)
        if slot.overhead_s is None:
            return None
        steal = next((t for t in self.pending if not t.done and self._eligible(slot, t)
                      and not self._orphaned(t)), None)
        if steal is None:
            return None
        task = steal
        owner = self.devices[task.owner or ""]
        backlog = sum(1 for t in self.pending.owned(owner.device_id)
                      if not t.done and self._eligible(slot, t) and not self._orphaned(t))
        # An owner whose tiles are overdue is as far behind as the most overdue of them: a
        # device that heartbeats but never returns would otherwise keep its planned tiles.
        # Cancelled copies count: they still fill its window until it answers them.
        overdue_s = max((now_s - c.expected_s for c in itertools.chain(
            owner.in_flight.values(), owner.cancelled.values())), default=0.0)
        theirs = self.finish_wall_s(owner, task.flops) + max(overdue_s, 0.0) + \
            backlog * task.flops / max(owner.rate_flops, 1.0) * self.dilation + \
            self._backlog_fetch_s(owner, now_s)
        mine = self.finish_wall_s(slot, task.flops) + self._fetch_s(slot, task, now_s)
        if copy_pays(theirs, mine):
            for t in self.pending.owned(owner.device_id):  # its last pending task: its run's end
                if not t.done and self._eligible(slot, t):
                    steal = t
            return self._take(steal)
        return None

    def _fetch_s(self, slot: DeviceSlot, task: Task, now_s: float) -> float:
        """Wall seconds the device needs to receive the task's blocks it does not hold, after
        what it was handed before (0 when its downlink is unknown)."""
        if not 0 < slot.down_Bps < math.inf:
            return 0.0
        missing = sum(nbytes for key, nbytes in task.blocks if key not in slot.cache)
        return missing / slot.down_Bps * self.dilation + slot.queued_s(now_s)

    def _backlog_fetch_s(self, owner: DeviceSlot, now_s: float) -> float:
        """Wall seconds the owner needs to receive the distinct blocks of its pending tasks
        that it does not hold, after what it was handed before (0 when its downlink is
        unknown)."""
        if not 0 < owner.down_Bps < math.inf:
            return 0.0
        missing: dict[object, int] = {}
        for t in self.pending.owned(owner.device_id):
            if t.done:
                continue
            for key, nbytes in t.blocks:
                if key not in owner.cache:
                    missing[key] = nbytes
        return sum(missing.values()) / owner.down_Bps * self.dilation + owner.queued_s(now_s)

    def _pick_beyond(self, slot: DeviceSlot) -> Task | None:
        for task in self.pending:
            if not task.done and self._eligible(slot, task):
                return self._take(task)
        return None

    def _tail(self) -> bool:
        return len(self.pending) < sum(max(s.free, 0) for s in self.devices.values())

    def _is_straggler(self, slot: DeviceSlot, task: Task) -> bool:
        """At the tail: whether the device straggles behind the best one that could take it."""
        best = min(self.finish_wall_s(s, task.flops) for s in self.devices.values()
                   if s is slot or (not s.quarantined and task.task_id not in s.given))
        return straggles(self.finish_wall_s(slot, task.flops), best)

    def remaining_s(self, copy: Copy, now_s: float) -> float:
        """Predicted wall seconds until a copy comes back (overdue: as long as it has taken)."""
        if now_s < copy.expected_s:
            return copy.expected_s - now_s
        return now_s - copy.sent_s

    def _backup_floor_s(self, slot: DeviceSlot, now_s: float, index: BackupIndex) -> float:
        """No ``mine`` in _backup_candidate's ``qualifies`` of a copy in ``index`` (one tile
        size) is below this: its terms at the fewest FLOPs and result bytes of those copies,
        the same expressions in the same order (so also after rounding); the blocks the device
        lacks only add. It counts what the device holds, owes and has queued
        on its path, which ``finish_wall_s`` does not: on large.yaml's phones 3 of 4 copies the
        walk tested failed on those alone; on a thousand devices' slow uplinks, most failed on
        their own result's upload."""
        rate = max(slot.rate_flops, 1.0)
        held = len(slot.in_flight) + len(slot.cancelled) + 1
        fetch = 0 < slot.down_Bps < math.inf
        result = index.min_result_nbytes
        return max(held * (index.min_flops / rate),
                   slot.upload_s(0 if math.isinf(result) else int(result),
                                 slot.owed_nbytes)) * self.dilation + \
            self._overhead_s(slot) + (slot.queued_s(now_s) if fetch else 0.0)

    def _search_state(self, slot: DeviceSlot) -> tuple[Any, ...]:
        """What a backup search depends on of the searching device, but for time: equal
        states give equal answers at one time (the tiles it holds and the results it owes,
        its speed, overhead and links, what its cache holds, the links it shares; their
        queues only grow but for time). The tasks it was ever given only grow too, and
        only rule copies out."""
        return (slot.copies_changed, slot.rate_flops, slot.overhead_s, slot.down_Bps,
                slot.up_Bps, slot.down_free_s, slot.cache.changes, slot.shared,
                slot.quarantined, self.dilation)

    def _backup_candidate(self, slot: DeviceSlot, now_s: float) -> Task | None:
        """The in-flight task with the longest remaining time whose holder straggles behind
        this device (ties: the first device registered, then the first copy handed out): the
        best of each tile size's (:meth:`_candidate_in`, one :class:`BackupIndex` each), by
        the same order; a size whose longest copy is shorter than the best so far is not
        searched.

        A search that finds nothing is remembered with the device's state and the time until
        which none of the copies it looked at can qualify (:func:`_pays_from_s`); until then,
        and while that state holds, a search of the device looks only at the copies admitted
        since (``BackupClasses.admitted``). With a thousand devices, no tile pending and
        thousands out, each result's pump searched about fifty idle devices, each in vain
        but for one in seventy (docs/simulate.md, "Heterogeneous groups at a thousand
        devices")."""
        overdue_s = OVERDUE_BACKUP_S * self.dilation
        classes = self._backups
        classes.sync(now_s, overdue_s)  # admitted by time now: logged, so looked at below
        known = slot.overhead_s is not None  # else copies ripen by OVERDUE_BACKUP_S: no memo
        state = self._search_state(slot) if known else ()
        kept = classes.kept(slot, now_s, state) if known else None
        if kept is not None:
            return self._admitted_candidate(slot, now_s, kept, classes)
        seen = len(classes.admitted)
        horizon = [math.inf]
        best: Task | None = None
        best_remaining = 0.0
        best_key = (0, 0)
        for index, most in classes.mosts(now_s, overdue_s):
            if most < best_remaining:
                continue  # none of its copies could beat the best (a tie still may)
            found = self._candidate_in(index, most, slot, now_s, horizon)
            if found is not None:
                task, remaining, key = found
                if best is None or remaining > best_remaining or \
                        (remaining == best_remaining and key < best_key):
                    best, best_remaining, best_key = task, remaining, key
        if best is None and known:
            classes.found_none[slot.device_id] = _NoneFound(
                state, seen, horizon[0] - _RIPE_MARGIN_S)
        else:
            classes.found_none.pop(slot.device_id, None)
        return best

    def _admitted_candidate(self, slot: DeviceSlot, now_s: float, kept: _NoneFound,
                            classes: BackupClasses) -> Task | None:
        """_backup_candidate while its kept answer stands: the best of the copies admitted
        since it was found (none before them can qualify yet), by the same order; a search that
        finds nothing again is kept, with those copies looked at too."""
        horizon = [math.inf]
        best: Task | None = None
        best_remaining = 0.0
        best_key = (0, 0)
        log = classes.admitted
        tests: dict[int, Callable[[float, Copy, DeviceSlot], bool]] = {}
        for copy, other, ver, index in log[kept.seen:]:
            if not _counts(copy, other, ver, self.devices) or \
                    len(copy.task.holders) >= MAX_COPIES:
                continue  # gone, or parked (its unparking logs it again)
            qualifies = tests.get(id(index))
            if qualifies is None:
                qualifies = tests[id(index)] = self._backup_test(slot, now_s, index, horizon)
            remaining = self.remaining_s(copy, now_s)
            if remaining >= best_remaining and qualifies(remaining, copy, other):
                key = (other.order, copy.seq)
                if best is None or remaining > best_remaining or key < best_key:
                    best, best_remaining, best_key = copy.task, remaining, key
        if best is None:
            classes.found_none[slot.device_id] = _NoneFound(
                kept.state, len(log), min(kept.until_s, horizon[0] - _RIPE_MARGIN_S))
        else:
            del classes.found_none[slot.device_id]
        return best

    def _backup_test(self, slot: DeviceSlot, now_s: float, index: BackupIndex,
                     horizon: list[float]) -> Callable[[float, Copy, DeviceSlot], bool]:
        """_candidate_in's test of one copy of ``index`` for ``slot`` at now_s, alone (the
        copies it finds by block, and those logged since a kept answer): the walk's bound
        (``could``) and its test (``qualifies``), the earliest time a copy that fails could
        pass lowering ``horizon[0]``."""
        floor = self._backup_floor_s(slot, now_s, index)
        queued_s = slot.queued_s(now_s) if 0 < slot.down_Bps < math.inf else 0.0
        qualifies = self._qualifier(slot, now_s, horizon)

        def test(remaining: float, copy: Copy, other: DeviceSlot) -> bool:
            if remaining > 0.0 and copy_pays(remaining, floor):
                return qualifies(remaining, copy, other)
            horizon[0] = min(horizon[0], _pays_from_s(
                now_s, remaining, now_s >= copy.expected_s, floor, floor - queued_s))
            return False

        return test

    def _qualifier(self, slot: DeviceSlot, now_s: float, horizon: list[float]
                   ) -> Callable[[float, Copy, DeviceSlot], bool]:
        """Whether a copy qualifies as ``slot``'s backup at now_s: the test of
        ``_backup_candidate`` for one copy (``finish_wall_s(slot, flops)`` and
        ``_fetch_s(slot, task)``, the same expressions inlined, as this runs for every copy
        tested, with the compute queue raised to the upload queue where that is longer: a
        backup's result goes up behind what the device owes). A copy that fails on time alone
        lowers ``horizon[0]`` to when it could pass (:func:`_pays_from_s`). Stealing and the
        tail's straggler test (finish_wall_s) do not count the upload yet."""
        overdue_s = OVERDUE_BACKUP_S * self.dilation
        held = len(slot.in_flight) + len(slot.cancelled) + 1
        rate = max(slot.rate_flops, 1.0)
        dilation = self.dilation
        overhead_s = self._overhead_s(slot)
        down_Bps = slot.down_Bps
        fetch = 0 < down_Bps < math.inf
        queued_s = slot.queued_s(now_s)
        owed = slot.owed_nbytes
        cache = slot.cache

        def qualifies(remaining: float, copy: Copy, other: DeviceSlot) -> bool:
            task = copy.task
            known = other.overhead_s is not None and slot.overhead_s is not None
            if (other is slot or task.done or task.queued or other.device_id not in task.holders
                    or task.task_id in slot.given
                    or (not known and now_s - copy.expected_s < overdue_s)):
                return False
            mine = max(held * (task.flops / rate),
                       slot.upload_s(task.result_nbytes, owed)) * dilation + overhead_s
            if fetch:
                if not copy_pays(remaining, mine + queued_s):
                    # nor with the blocks it lacks: they only add (exactly so)
                    horizon[0] = min(horizon[0], _pays_from_s(
                        now_s, remaining, now_s >= copy.expected_s, mine + queued_s, mine))
                    return False
                fetch_s = sum(nbytes for key, nbytes in task.blocks
                              if key not in cache) / down_Bps * dilation
                if copy_pays(remaining, mine + (fetch_s + queued_s)):  # as _fetch_s sums it
                    return True
                horizon[0] = min(horizon[0], _pays_from_s(
                    now_s, remaining, now_s >= copy.expected_s, mine + (fetch_s + queued_s),
                    mine + fetch_s))
                return False
            if copy_pays(remaining, mine + 0.0):  # _fetch_s's 0.0, for the same sum
                return True
            horizon[0] = min(horizon[0], _pays_from_s(
                now_s, remaining, now_s >= copy.expected_s, mine, mine))
            return False

        return qualifies

    def _candidate_in(self, index: BackupIndex, most: float, slot: DeviceSlot, now_s: float,
                      horizon: list[float]) -> tuple[Task, float, tuple[int, int]] | None:
        """The best candidate among one tile size's copies (``most``: their most remaining
        time now), with its remaining time and tie key, or None; ``horizon[0]`` is lowered to
        the earliest time a copy here that does not qualify now could (:func:`_pays_from_s`;
        for the copies the walk did not reach, from the bound it stopped at).

        The index walks copies longest-remaining first, so the walk stops at the first copy that
        could not qualify even at the smallest tile size in flight (``min_flops``), behind the tiles
        the device holds, the results it owes and the blocks queued on its path
        (``_backup_floor_s``): the device's finish only grows with a tile's FLOPs. On a link of
        known rate it stops sooner, where no copy could qualify even at the fewest operand bytes in
        flight (``min_nbytes``) fetched whole; below that point only copies whose blocks the device
        already holds can, and the index finds those by block (``sharing_blocks``) instead of
        walking every copy (with hundreds of idle devices on slow links, most copies fail on the
        blocks the device would have to fetch, not on its speed).
        """
        if math.isinf(index.min_flops):
            return None
        overdue_s = OVERDUE_BACKUP_S * self.dilation
        floor = self._backup_floor_s(slot, now_s, index)
        down_Bps = slot.down_Bps
        fetch = 0 < down_Bps < math.inf
        queued_s = slot.queued_s(now_s) if fetch else 0.0

        def unreached(remaining: float, mine_s: float) -> None:
            # the copies past where the walk stopped
            horizon[0] = min(horizon[0],
                             _none_pays_from_s(now_s, remaining, mine_s, mine_s - queued_s))

        if not copy_pays(most, floor):
            unreached(most, floor)
            return None  # not even the longest copy could qualify
        mine_min = self.finish_wall_s(slot, index.min_flops)
        qualifies = self._qualifier(slot, now_s, horizon)
        cache = slot.cache

        def could(remaining: float) -> bool:
            # qualifies' own test at floor, no larger than any copy's ``mine``: a copy that
            # fails it fails qualifies, and so does every copy with less remaining time
            return copy_pays(remaining, floor)

        # below ``whole``, a copy qualifies only if the device holds one of its blocks (the
        # margin: the sum's rounding may only make the bound looser)
        whole = mine_min
        if fetch:
            # the least ``mine`` of a copy whose blocks the device fetches whole: past the
            # compute, its upload or what it owes may be the larger term (1 - 1e-9: as above)
            whole = (max(mine_min, floor) + index.min_nbytes / down_Bps * self.dilation) * \
                (1 - 1e-9)
        best: Task | None = None
        best_remaining = 0.0
        best_key = (0, 0)
        shared = False  # whether to look for the copies sharing a block by block
        # below ``whole``: how many more copies the walk tests (each fails qualifies unless
        # it shares a block) before finding them by block is cheaper (-1: above ``whole``)
        budget = -1
        walk = index.by_remaining(now_s, overdue_s)
        step = next(walk, None)
        while step is not None:
            remaining, entry = step
            if remaining < best_remaining or remaining <= 0.0 or not could(remaining):
                if best is None and whole > floor:
                    # a search that finds nothing is kept until a copy could ripen: of the
                    # copies below, those sharing no block with the cache fetch theirs whole,
                    # and the rest are found by block (tested one by one, below); the floor
                    # alone ended a third of mixed-1000's kept answers within half a ms
                    shared = True
                    unreached(remaining, whole)
                else:
                    unreached(remaining, floor)
                break  # nor can any copy after it: every candidate was walked
            if budget < 0 and not copy_pays(remaining, whole):
                if not (whole > mine_min and best is None):
                    unreached(remaining, whole)
                    break
                # what sharing_blocks would scan: its keys, at least
                budget = min(len(cache), index.blocks())
            if budget >= 0:
                if budget == 0:
                    shared = True
                    unreached(remaining, whole)  # the copies sharing no block
                    break
                budget -= 1
            copy, other = entry[4], entry[5]
            qualified = False
            if len(copy.task.holders) >= MAX_COPIES:
                index.park(copy, other)
            elif qualifies(remaining, copy, other):
                qualified = True
                key = (other.order, copy.seq)
                if best is None or key < best_key:  # equal remaining: the scan order's first
                    best, best_remaining, best_key = copy.task, remaining, key
            try:  # a qualified copy's ties after it in its list come later in that order
                step = walk.send(qualified)
            except StopIteration:
                break
        if shared:
            test = self._backup_test(slot, now_s, index, horizon)
            for copy, other in index.sharing_blocks(cache):
                if len(copy.task.holders) >= MAX_COPIES:
                    continue  # the walk parks these; either way no candidate
                remaining = self.remaining_s(copy, now_s)
                if remaining >= best_remaining and test(remaining, copy, other):
                    key = (other.order, copy.seq)
                    if best is None or remaining > best_remaining or key < best_key:
                        best, best_remaining, best_key = copy.task, remaining, key
        return None if best is None else (best, best_remaining, best_key)

    def _give(self, slot: DeviceSlot, task: Task, now_s: float, backup: bool) -> Assignment:
        compute_wall_s = slot.finish_estimate_s(task.flops) * self.dilation
        # back once computed and once the results ahead of it and its own have gone up
        upload_wall_s = slot.upload_s(task.result_nbytes) * self.dilation
        expected = now_s + max(compute_wall_s, upload_wall_s) + (slot.overhead_s or 0.0)
        task.holder = slot.device_id
        task.holders.add(slot.device_id)
        copy = Copy(task, task.attempt, backup, now_s, expected, compute_wall_s,
                    seq=next(self._copy_seq))
        slot.in_flight[task.task_id] = copy
        slot.copies_changed += 1
        self._backups.add(copy, slot)
        slot.given.add(task.task_id)
        send, keep = [], []
        sent = 0
        held = task.job.held and slot.keeps_held
        for key, nbytes in task.blocks:
            hit = key in slot.cache
            cacheable = slot.cache.cacheable(nbytes)
            if hit:  # refresh, exactly as the device does when it uses the block
                slot.cache.get(key, held)
            else:
                slot.cache.put(key, task.job.version, nbytes, None, held)
                sent += nbytes
            send.append(not hit)
            keep.append(cacheable)
        slot.bytes_down += sent
        if sent and 0 < slot.down_Bps < math.inf:
            slot.down_free_s = max(slot.down_free_s, now_s) + \
                sent / slot.down_Bps * self.dilation
        if sent:
            for link in slot.shared:
                link.free_s = max(link.free_s, now_s) + sent / link.down_Bps * self.dilation
        return Assignment(task, tuple(send), tuple(keep), backup, held)

    # -- results in ----------------------------------------------------------------------------
    def accept(self, device_id: str, task_id: int, attempt: int, c: np.ndarray,
               compute_s: float = 0.0, energy_j: float = 0.0,
               now_s: float | None = None) -> Outcome:
        """Check a result and place it into its GEMM's C; say what became of it."""
        slot = self.devices.get(device_id)
        if slot is None:
            return Outcome(Verdict.REJECTED, f"device {device_id} is not registered")
        slot.bytes_up += c.nbytes
        copy = slot.in_flight.get(task_id)
        losing = slot.cancelled.get(task_id)
        if copy is None and losing is not None and losing.attempt == attempt:
            copy = slot.in_flight[task_id] = slot.cancelled.pop(task_id)  # checked as before
            slot.copies_changed += 1
        if copy is None or copy.attempt != attempt:
            if task_id in slot.given and copy is None:
                slot.tiles_late += 1
                return Outcome(Verdict.LATE, f"task {task_id} attempt {attempt} is no longer "
                                             f"outstanding on {device_id}", attempt=attempt)
            slot.tiles_rejected += 1
            return Outcome(Verdict.REJECTED, f"task {task_id} attempt {attempt} was not given "
                                             f"to device {device_id}", attempt=attempt)
        del slot.in_flight[task_id]
        slot.copies_changed += 1
        task = copy.task
        self.counters.flops_returned += task.flops
        problem = self._check(task, c)
        if problem:
            return self._failed(slot, copy, problem)
        trusted = device_id in task.holders
        task.holders.discard(device_id)
        now_s = time.monotonic() if now_s is None else now_s
        self._observe(slot, copy, compute_s, now_s)
        if task.done or not trusted:
            slot.tiles_late += 1
            if task.done:
                self.counters.wasted += 1
            why = "was already completed" if task.done else \
                f"came from quarantined device {device_id}"
            return Outcome(Verdict.LATE, f"task {task_id} {why}", task=task, checked=True,
                           attempt=attempt)
        return self._place(slot, copy, c, compute_s, energy_j)

    def _observe(self, slot: DeviceSlot, copy: Copy, compute_s: float, now_s: float) -> None:
        """Learn a device's speed and round-trip overhead from one valid result."""
        if compute_s > 0:
            rate = copy.task.flops / compute_s
            slot.rate_flops = (1 - EWMA_WEIGHT) * slot.rate_flops + EWMA_WEIGHT * rate
            slot.peak_rate_flops = max(slot.peak_rate_flops, rate)
        overhead = max(0.0, now_s - copy.sent_s - copy.compute_wall_s)
        first = slot.overhead_s is None
        slot.overhead_s = overhead if slot.overhead_s is None else \
            (1 - EWMA_WEIGHT) * slot.overhead_s + EWMA_WEIGHT * overhead
        self._mean_overhead_s = None
        if first:
            self._backups.known(slot)  # its copies still out may be backed up now

    def note_overhead(self, device_id: str, overhead_s: float) -> None:
        """Set a device's overhead as if learned from results (its copies out become
        backup candidates); ``DeviceSlot.overhead_s`` must not be set around the scheduler."""
        slot = self.devices[device_id]
        first = slot.overhead_s is None
        slot.overhead_s = overhead_s
        self._mean_overhead_s = None
        if first:
            self._backups.known(slot)

    def _check(self, task: Task, c: np.ndarray) -> str | None:
        start = time.thread_time()
        job = task.job
        box = task.box
        problem = check_result(task.a_block(), task.b_block(), c, check_values=self.check_values,
                               vectors=self.freivalds_vectors, gemm=job.check, box=box.key)
        self.counters.validation_cpu_s += time.thread_time() - start
        self.counters.checks += 1
        return problem

    def _failed(self, slot: DeviceSlot, copy: Copy, problem: str) -> Outcome:
        task = copy.task
        slot.tiles_rejected += 1
        slot.failed_checks += 1
        self.counters.failed_checks += 1
        requeued = self._release(task, slot.device_id)
        outcome = Outcome(Verdict.REJECTED, f"task {task.task_id}: {problem}", requeued=requeued,
                          task=task, checked=True, failed_check=True, attempt=copy.attempt)
        if (self.quarantine_after > 0 and not slot.quarantined
                and slot.failed_checks >= self.quarantine_after):
            outcome.quarantined = self.quarantine(slot.device_id)
        return outcome

    def _place(self, slot: DeviceSlot, copy: Copy, c: np.ndarray, compute_s: float,
               energy_j: float) -> Outcome:
        task = copy.task
        self._store(task.job, task.box, c)
        task.done = True
        task.holder = slot.device_id
        self.tasks.pop(task.task_id, None)
        cancelled = []
        for other_id in task.holders - {slot.device_id}:  # the losing copies
            other = self.devices.get(other_id)
            losing = other.in_flight.pop(task.task_id, None) if other is not None else None
            if other is not None and losing is not None:
                other.cancelled[task.task_id] = losing
                other.copies_changed += 1
                cancelled.append(other_id)
                self.counters.cancelled += 1
        task.holders.clear()
        slot.tiles_done += 1
        slot.compute_s += compute_s
        slot.energy_j += energy_j
        self.counters.flops_accepted += task.flops
        if copy.attempt > 0:
            self.counters.recomputed += 1
        if copy.backup:
            self.counters.backup_wins += 1
            slot.backups_won += 1
        job = task.job
        job.remaining -= 1
        return Outcome(Verdict.ACCEPTED, completed_job=job if job.remaining == 0 else None,
                       task=task, checked=True, backup_won=copy.backup, attempt=copy.attempt,
                       cancelled=cancelled, sent_s=copy.sent_s)

    @staticmethod
    def _store(job: GemmJob, box: TileBox, c: np.ndarray) -> None:
        """Place a tile into C; a K-split partial waits for its block's others, then the block
        is their sum in slice order (the same bits whichever device sent which partial)."""
        if not box.split:
            job.c[box.r0:box.r1, box.c0:box.c1] = c
            return
        parts = job.partials.setdefault((box.row, box.col), {})
        parts[box.part] = c
        if len(parts) < box.parts:
            return
        total = parts[0].copy()
        for s in range(1, box.parts):
            total += parts[s]
        job.c[box.r0:box.r1, box.c0:box.c1] = total
        del job.partials[(box.row, box.col)]

    def refuse(self, device_id: str, task_id: int, attempt: int, reason: str) -> Outcome:
        """A result that could not even be decoded: refuse it; re-queue the task if outstanding."""
        slot = self.devices.get(device_id)
        copy = slot.in_flight.get(task_id) if slot is not None else None
        if slot is None or copy is None or copy.attempt != attempt:
            return Outcome(Verdict.REJECTED, f"task {task_id}: {reason}", attempt=attempt)
        del slot.in_flight[task_id]
        slot.copies_changed += 1
        slot.tiles_rejected += 1
        requeued = self._release(copy.task, device_id)
        return Outcome(Verdict.REJECTED, f"task {task_id}: {reason}", requeued=requeued,
                       task=copy.task, attempt=attempt)

    # -- views ---------------------------------------------------------------------------------
    def in_flight(self) -> Iterable[Task]:
        for slot in self.devices.values():
            for copy in slot.in_flight.values():
                yield copy.task
