"""The scheduler's indexes (pending queue by owner, backups by remaining time) change no choice.

A reference scheduler makes the same decisions by the straightforward scans the scheduler had
before its indexes (walk the whole queue per pick; every copy of every device per backup
search); both are driven through the same randomized runs (plans with owners, FIFO GEMMs,
K splits, results in random order, refusals, wrong values and quarantine, departures and
joins) and must hand out the same tiles, as the same kind of copy, with the same verdicts.
"""

from __future__ import annotations

import math
import random
from collections import deque
from typing import Any

import numpy as np

from testbed.ps_backend.scheduler import (
    MAX_COPIES,
    MIN_BACKUP_GAIN_S,
    OVERDUE_BACKUP_S,
    DeviceSlot,
    GemmJob,
    GemmSpec,
    PendingQueue,
    Scheduler,
    SharedLink,
    Task,
    straggles,
)
from testbed.ps_backend.tiler import TileBox, cut_k, uniform


class ScanningScheduler(Scheduler):
    """The same policy found by full scans (no index)."""

    def _pick_planned(self, slot: DeviceSlot, now_s: float) -> Task | None:
        pending = list(self.pending)
        orphan = steal = None
        backlog: dict[str, int] = {}
        for task in pending:
            if task.done or not self._eligible(slot, task):
                continue
            if task.owner == slot.device_id:
                return self._take(task)
            owner = self.devices.get(task.owner) if task.owner is not None else None
            if owner is None or owner.quarantined or task.task_id in owner.given:
                if orphan is None:
                    orphan = task
            else:
                backlog[owner.device_id] = backlog.get(owner.device_id, 0) + 1
                if steal is None:
                    steal = task
        if orphan is not None:
            if self._tail() and self._is_straggler(slot, orphan):
                return None
            return self._take(orphan)
        if steal is None or slot.overhead_s is None:
            return None
        owner = self.devices[steal.owner or ""]
        overdue_s = max((now_s - c.expected_s for c in [*owner.in_flight.values(),
                                                        *owner.cancelled.values()]),
                        default=0.0)
        theirs = self.finish_wall_s(owner, steal.flops) + max(overdue_s, 0.0) + \
            backlog[owner.device_id] * steal.flops / max(owner.rate_flops, 1.0) * self.dilation \
            + self._backlog_fetch_s(owner, now_s)
        mine = self.finish_wall_s(slot, steal.flops) + self._fetch_s(slot, steal, now_s)
        if straggles(theirs, mine) and theirs - mine >= MIN_BACKUP_GAIN_S:
            for t in pending:
                if t.owner == owner.device_id and not t.done and self._eligible(slot, t):
                    steal = t
            return self._take(steal)
        return None

    def _backup_candidate(self, slot: DeviceSlot, now_s: float) -> Task | None:
        best: Task | None = None
        best_remaining = 0.0
        overdue_s = OVERDUE_BACKUP_S * self.dilation
        for other in self.devices.values():
            if other is slot or other.quarantined:
                continue
            known = other.overhead_s is not None and slot.overhead_s is not None
            for copy in other.in_flight.values():
                task = copy.task
                if (task.done or len(task.holders) >= MAX_COPIES or task.queued
                        or other.device_id not in task.holders
                        or task.task_id in slot.given
                        or (not known and now_s - copy.expected_s < overdue_s)):
                    continue
                remaining = self.remaining_s(copy, now_s)
                # its finish: computing behind what it holds, or sending behind what it owes
                held = len(slot.in_flight) + len(slot.cancelled) + 1
                mine = max(held * (task.flops / max(slot.rate_flops, 1.0)),
                           slot.upload_s(task.result_nbytes)) * self.dilation + \
                    self._overhead_s(slot) + self._fetch_s(slot, task, now_s)
                if (remaining > best_remaining and straggles(remaining, mine)
                        and remaining - mine >= MIN_BACKUP_GAIN_S):
                    best, best_remaining = task, remaining
        return best


class CountingScheduler(Scheduler):
    """The scheduler, counting the backup searches answered from a kept answer."""

    kept_answers = 0

    def _admitted_candidate(self, *args: Any) -> Task | None:
        self.kept_answers += 1
        return super()._admitted_candidate(*args)


def test_pending_queue_keeps_deque_order() -> None:
    rng = random.Random(3)
    q, ref = PendingQueue(), deque()
    tasks = []
    job = GemmJob("g", GemmSpec("l", "forward", 0), np.zeros((4, 4)), np.zeros((4, 4)),
                  np.zeros((4, 4)), 0, "a", "b")
    for i in range(3000):
        op = rng.random()
        if op < 0.4 or not ref:
            t = Task(i, job, TileBox(0, 0, 0, 4, 0, 4), owner=rng.choice([None, "x", "y"]))
            tasks.append(t)
            (q.append if rng.random() < 0.6 else q.appendleft)(t)
            (ref.append if q.last() is t else ref.appendleft)(t)
        elif op < 0.8:
            t = rng.choice(list(ref))
            ref.remove(t)
            q.remove(t)
        else:
            assert q.popleft() is ref.popleft()
        assert len(q) == len(ref) and q.first() is (ref[0] if ref else None)
        if i % 97 == 0:
            assert list(q) == list(ref)
            for owner in (None, "x", "y"):
                assert list(q.owned(owner)) == [t for t in ref if t.owner == owner]


def _job(uid: str, m: int, k: int, n: int, seed: int) -> GemmJob:
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    return GemmJob(uid=uid, spec=GemmSpec("l", "forward", 0), a=a, b=b, c=np.zeros((m, n)),
                   version=0, a_key=f"{uid}:A", b_key=f"{uid}:B")


def _slot(i: int, rng: random.Random) -> DeviceSlot:
    return DeviceSlot(device_id=f"d{i}", name=f"d{i}", predicted_gflops=rng.choice([1, 2, 8]),
                      max_in_flight=rng.choice([2, 4, 8]), cache_bytes=1 << 16)


def test_indexed_choices_equal_scanning_choices() -> None:
    backups = requeued = 0
    for seed in range(8):
        b, r, _ = _run_pair(seed)
        backups += b
        requeued += r
    assert backups >= 10 and requeued >= 100  # the runs exercise backups and re-queues


def test_indexed_choices_equal_scanning_choices_on_slow_links() -> None:
    backups = 0
    for seed in range(8):
        backups += _run_pair(50 + seed, links=True)[0]
    assert backups >= 10


def test_kept_backup_answers_equal_scanning_choices() -> None:
    """Pumps a few milliseconds apart, devices behind shared links whose queues drain: a
    device's search that found nothing is kept until a copy could ripen (its remaining time
    grows once overdue, the device's queue drains) or something it depends on changes, and the
    choices stay the scanning ones."""
    backups = kept = 0
    for seed in range(8):
        b, _, k = _run_pair(100 + seed, links=True, dense=True)
        backups += b
        kept += k
    assert backups >= 10 and kept >= 300


def _run_pair(seed: int, links: bool = False, dense: bool = False) -> tuple[int, int, int]:
    """Drive both schedulers through one random run; (backups, re-queues, searches answered
    from a kept answer). ``links``: devices with links of a known rate, slow enough that the
    blocks a device would fetch and the results it owes decide many steals and backups.
    ``dense``: events a few milliseconds apart, and devices in groups behind shared links."""
    rng = random.Random(seed)
    pair = (CountingScheduler(quarantine_after=2, dilation=rng.choice([1.0, 3.0])),
            ScanningScheduler(quarantine_after=2, dilation=1.0))
    shared: list[tuple[SharedLink, SharedLink]] = [
        (SharedLink(rate), SharedLink(rate)) for rate in (5e3, 2e4)] if dense else []
    pair[1].dilation = pair[0].dilation
    speed: dict[str, float] = {}  # device seconds per tile (fixed per device)
    bad: set[str] = set()
    n_dev = 0

    def join() -> None:
        nonlocal n_dev
        slots = []
        down_Bps = rng.choice([math.inf, 2e3, 2e4, 1e5]) if links else math.inf
        up_Bps = rng.choice([math.inf, 1e3, 1e4, 1e5]) if links else math.inf
        group = rng.randrange(len(shared) + 1)
        for i, s in enumerate(pair):
            slot_rng = random.Random(seed * 1000 + n_dev)
            slots.append(_slot(n_dev, slot_rng))
            slots[-1].down_Bps = down_Bps
            slots[-1].up_Bps = up_Bps
            if group < len(shared):
                slots[-1].shared = (shared[group][i],)
            s.add_device(slots[-1])
        speed[slots[0].device_id] = rng.choice([0.01, 0.02, 0.05, 0.3, 1.5])
        if rng.random() < 0.1:
            bad.add(slots[0].device_id)
        n_dev += 1

    for _ in range(rng.randint(3, 9)):
        join()
    out: list[tuple[str, int, int, float]] = []  # (device, task, attempt, due time)
    now = 0.0
    gemms = 0
    decisions = backups = 0
    for _ in range(1500):
        now += rng.expovariate(400.0 if dense else 20.0)
        r = rng.random()
        live = [d for d in pair[0].devices]
        if r < (0.01 if dense else 0.05) or not pair[0].tasks:  # a new GEMM, planned or FIFO
            m, k, n = rng.choice([(64, 32, 64), (48, 64, 32), (96, 16, 80)])
            tm, tn, kp = rng.choice([16, 32]), rng.choice([16, 32]), rng.choice([1, 1, 2])
            boxes = cut_k(m, n, k, tm, tn, kp)
            owners = None
            if rng.random() < 0.7 and live:
                owners = {(b.row, b.col, b.part): rng.choice(live) for b in boxes}
            for s in pair:
                s.submit(_job(f"g{gemms}", m, k, n, gemms), uniform(m, tm, tn, kp), owners=owners)
            gemms += 1
        elif r < 0.08 and len(live) > 2:  # a departure
            gone = rng.choice(live)
            assert [t.task_id for t in pair[0].remove_device(gone)] == \
                [t.task_id for t in pair[1].remove_device(gone)]
            out = [o for o in out if o[0] != gone]
        elif r < 0.10:
            join()
        elif r < 0.5 or not out:  # pump, fastest first, at this moment
            order = sorted((s for s in pair[0].devices.values() if s.free > 0),
                           key=lambda s: (-s.rate_flops, s.device_id))
            indexed = {slot.device_id: [(a.task.task_id, a.task.attempt, a.backup, a.send)
                                        for a in got]
                       for slot, got in pair[0].assign_each(order, now)}
            for slot in order:
                got = [(a.task.task_id, a.task.attempt, a.backup, a.send)
                       for a in pair[1].assign(slot.device_id, now_s=now)]
                assert indexed.get(slot.device_id, []) == got, (seed, now, slot.device_id)
                decisions += 1
                backups += sum(g[2] for g in got)
                for task_id, attempt, *_ in got:
                    due = now + speed[slot.device_id] * rng.uniform(0.5, 2.0)
                    out.append((slot.device_id, task_id, attempt, due))
        else:  # the earliest-due result comes back (or a random one: reordering)
            out.sort(key=lambda o: o[3])
            i = 0 if rng.random() < 0.8 else rng.randrange(len(out))
            device, task_id, attempt, due = out.pop(i)
            now = max(now, due)
            verdicts = []
            garbled = rng.random() < 0.03
            for s in pair:
                task = s.devices[device].in_flight.get(task_id) or \
                    s.devices[device].cancelled.get(task_id)
                if garbled:
                    verdicts.append(s.refuse(device, task_id, attempt, "garbled").verdict)
                    continue
                if task is None:
                    c = np.zeros((1, 1))
                else:
                    c = task.task.a_block() @ task.task.b_block()
                    if device in bad:  # one wrong element: Freivalds sees it for any vector
                        c[0, 0] += 1.0
                compute = speed[device] / (2 if device not in bad else 1)
                verdicts.append(s.accept(device, task_id, attempt, c, compute_s=compute,
                                         now_s=now).verdict)
            assert verdicts[0] == verdicts[1], (seed, device, task_id)
        assert [t.task_id for t in pair[0].pending] == [t.task_id for t in pair[1].pending]
    assert decisions > 100
    counters = [dict(vars(s.counters), validation_cpu_s=0.0) for s in pair]  # CPU time varies
    assert counters[0] == counters[1]
    assert pair[0].counters.backups == backups
    return backups, counters[0]["requeued"], pair[0].kept_answers
