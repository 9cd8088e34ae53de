"""The pump's ready index (ReadyIndex + Scheduler.assign_ready) makes assign_each's choices.

Two schedulers go through the same randomized runs (planned GEMMs with owners, FIFO GEMMs, K
splits, results out of order, refusals, wrong values and quarantine, departures, joins and
devices left out of the pump as a partition does): one pumped as the PS does, by
``assign_each`` over the sorted list of devices with room, the other by ``assign_ready`` over a
``ReadyIndex`` that is only touched where a device changed. Every pump must hand out the same
tiles to the same devices, as the same kind of copy, and every result must get the same verdict.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np

from testbed.ps_backend.scheduler import DeviceSlot, ReadyIndex, Scheduler, SharedLink
from testbed.ps_backend.tiler import cut_k, uniform
from tests.unit.test_scheduler_indexes import _job, _slot


def _plain_order(s: Scheduler, blocked: set[str]) -> list[DeviceSlot]:
    ready = [x for x in s.devices.values() if x.free > 0 and x.device_id not in blocked]
    ready.sort(key=lambda x: x.rate_flops, reverse=True)  # join order, then fastest: stable
    return ready


def _run(seed: int, links: bool = False, dense: bool = False) -> tuple[int, int, int, int]:
    """One random run of both; (tiles handed out, backups, steals-or-orphans seen, devices the
    pump passed over for their kept backup answer); ``links``: devices with links of a known
    rate; ``dense``: events a few milliseconds apart, and devices behind shared links."""
    rng = random.Random(seed)
    plain, indexed = Scheduler(quarantine_after=2), Scheduler(quarantine_after=2)
    ready = ReadyIndex(indexed)
    shared = [(SharedLink(rate), SharedLink(rate)) for rate in (5e3, 2e4)] if dense else []
    stood = 0
    kept = indexed._backups.kept

    def counted(*args: Any) -> Any:
        nonlocal stood
        answer = kept(*args)
        stood += answer is not None and answer.seen == len(indexed._backups.admitted)
        return answer

    indexed._backups.kept = counted  # type: ignore[method-assign]
    blocked: set[str] = set()
    speed: dict[str, float] = {}
    bad: set[str] = set()
    n_dev = 0

    def join() -> None:
        nonlocal n_dev
        # downlinks from none known to slow enough that fetching a tile's blocks costs more
        # than computing it (a thief's test counts the blocks it does not hold)
        down_Bps = rng.choice([math.inf, 2e3, 2e4, 1e5]) if links else math.inf
        # uplinks likewise: a backup's result goes up behind what the device owes
        up_Bps = rng.choice([math.inf, 1e3, 1e4, 1e5]) if links else math.inf
        group = rng.randrange(len(shared) + 1)
        for i, s in enumerate((plain, indexed)):
            slot = _slot(n_dev, random.Random(seed * 1000 + n_dev))
            slot.down_Bps = down_Bps
            slot.up_Bps = up_Bps
            if group < len(shared):
                slot.shared = (shared[group][i],)
            s.add_device(slot)
        speed[f"d{n_dev}"] = rng.choice([0.01, 0.02, 0.05, 0.3, 1.5])
        if rng.random() < 0.08:
            bad.add(f"d{n_dev}")
        n_dev += 1
        ready.rebuild()  # windows were resized

    for _ in range(rng.randint(4, 12)):
        join()
    out: list[tuple[str, int, int, float]] = []
    now = 0.0
    gemms = handed = backups = 0
    for _ in range(1200):
        now += rng.expovariate(400.0 if dense else 20.0)
        r = rng.random()
        live = list(plain.devices)
        if r < (0.003 if dense else 0.05) or not plain.tasks:
            m, k, n = rng.choice([(64, 32, 64), (48, 64, 32), (96, 16, 80), (128, 32, 128)])
            tm, tn, kp = rng.choice([16, 32]), rng.choice([16, 32]), rng.choice([1, 1, 2])
            owners = None
            if (links or rng.random() < 0.75) and live:  # links: every GEMM planned
                owners = {(b.row, b.col, b.part): rng.choice(live)
                          for b in cut_k(m, n, k, tm, tn, kp)}
            for s in (plain, indexed):
                s.submit(_job(f"g{gemms}", m, k, n, gemms), uniform(m, tm, tn, kp), owners=owners)
            gemms += 1
        elif r < 0.07 and len(live) > 2:
            gone = rng.choice(live)
            assert [t.task_id for t in plain.remove_device(gone)] == \
                [t.task_id for t in indexed.remove_device(gone)]
            ready.rebuild()
            out = [o for o in out if o[0] != gone]
        elif r < 0.09:
            join()
        elif r < 0.11 and live:  # a partition: left out of the pump, or back in
            who = rng.choice(live)
            down = who not in blocked
            (blocked.add if down else blocked.discard)(who)
            ready.block(indexed.devices[who], down)
        elif r < 0.5 or not out:
            want = [(x.device_id, [(a.task.task_id, a.task.attempt, a.backup, a.send) for a in got])
                    for x, got in plain.assign_each(_plain_order(plain, blocked), now)]
            got_ix = indexed.assign_ready(ready, now)
            for x, _ in got_ix:
                ready.touch(x)
            have = [(x.device_id, [(a.task.task_id, a.task.attempt, a.backup, a.send)
                                   for a in got]) for x, got in got_ix]
            assert have == want, (seed, now)
            for device, got in want:
                handed += len(got)
                backups += sum(g[2] for g in got)
                for task_id, attempt, *_ in got:
                    out.append((device, task_id, attempt,
                                now + speed[device] * rng.uniform(0.5, 2.0)))
        else:
            out.sort(key=lambda o: o[3])
            i = 0 if rng.random() < 0.8 else rng.randrange(len(out))
            device, task_id, attempt, due = out.pop(i)
            now = max(now, due)
            garbled = rng.random() < 0.03
            verdicts = []
            for s in (plain, indexed):
                slot = s.devices[device]
                copy = slot.in_flight.get(task_id) or slot.cancelled.get(task_id)
                if garbled:
                    verdicts.append(s.refuse(device, task_id, attempt, "garbled").verdict)
                    continue
                c = np.zeros((1, 1)) if copy is None else \
                    copy.task.a_block() @ copy.task.b_block()
                if copy is not None and device in bad:
                    c[0, 0] += 1.0
                outcome = s.accept(device, task_id, attempt, c, compute_s=speed[device] / 2,
                                   now_s=now)
                verdicts.append(outcome.verdict)
                if s is indexed:
                    if outcome.quarantined is not None:
                        ready.rebuild()  # a quarantine resizes the windows
                    else:
                        ready.touch(slot)
            if garbled:
                ready.touch(indexed.devices[device])
            assert verdicts[0] == verdicts[1], (seed, device, task_id)
        assert [t.task_id for t in plain.pending] == [t.task_id for t in indexed.pending]
    assert vars(plain.counters) | {"validation_cpu_s": 0} == \
        vars(indexed.counters) | {"validation_cpu_s": 0}
    return handed, backups, plain.counters.requeued, stood


def test_ready_index_pumps_as_assign_each() -> None:
    handed = backups = requeued = 0
    for seed in range(10):
        h, b, r, _ = _run(seed)
        handed, backups, requeued = handed + h, backups + b, requeued + r
    # the runs exercise plain picks, backups and re-queued tiles
    assert handed >= 2000 and backups >= 3 and requeued >= 50


def test_ready_index_pumps_as_assign_each_with_slow_links() -> None:
    """The same, with the blocks a device would fetch in its steal test (and its owner's)."""
    handed = 0
    for seed in range(10):
        handed += _run(100 + seed, links=True)[0]
    assert handed >= 2000


def test_ready_index_passes_over_devices_whose_kept_answer_stands() -> None:
    """Pumps a few milliseconds apart: the pump passes over a device whose last backup search
    found nothing while that answer stands and no copy was logged since (BackupClasses.kept),
    and hands out what assign_each does. The pump's own first test keeps the answers of the
    devices that fail it (Scheduler._may_back_up): 31 of these seeds' answers stood without
    that, 185 with it; assign_each, the reference here, keeps none of those."""
    handed = backups = stood = 0
    for seed in range(10):
        h, b, _, k = _run(200 + seed, links=True, dense=True)
        handed, backups, stood = handed + h, backups + b, stood + k
    assert handed >= 1000 and backups >= 5 and stood >= 100


def test_ready_index_order_and_least_overhead() -> None:
    s = Scheduler()
    slots = [DeviceSlot(f"d{i}", f"d{i}", g, 4, 1 << 16) for i, g in enumerate([2, 8, 8, 1])]
    for x in slots:
        s.add_device(x)
    ready = ReadyIndex(s)
    ready.rebuild()
    # fastest first, ties in join order
    assert [x.device_id for x in ready.slots()] == ["d1", "d2", "d0", "d3"]
    assert ready.least_overhead_s() == 0.0  # nothing known
    slots[2].overhead_s, slots[0].overhead_s = 0.3, 0.1
    ready.touch(slots[2])
    ready.touch(slots[0])
    assert ready.least_overhead_s() == 0.1
    slots[0].overhead_s = 0.5
    ready.touch(slots[0])
    assert ready.least_overhead_s() == 0.3
    ready.block(slots[1], True)
    assert [x.device_id for x in ready.slots()] == ["d2", "d0", "d3"]
    s.remove_device("d2")
    ready.rebuild()
    assert [x.device_id for x in ready.slots()] == ["d0", "d3"]
    assert ready.least_overhead_s() == 0.5


def test_add_devices_leaves_the_state_of_one_add_device_each() -> None:
    rng = random.Random(5)
    one, many = Scheduler(), Scheduler()
    specs = [(f"d{i}", rng.choice([0.5, 1, 2, 8, 30]), rng.choice([1, 2, 8])) for i in range(40)]
    specs.append(specs[3])  # a device registering again under its id keeps its order
    for device_id, gflops, most in specs:
        one.add_device(DeviceSlot(device_id, device_id, gflops, most, 1 << 16))
    many.add_devices(DeviceSlot(d, d, g, m, 1 << 16) for d, g, m in specs)
    assert [(s.device_id, s.order, s.window) for s in one.devices.values()] == \
        [(s.device_id, s.order, s.window) for s in many.devices.values()]
    assert len({s.window for s in many.devices.values()}) > 2  # windows do differ


def test_sure_backup_rate_is_where_no_backup_below_says_no() -> None:
    """The pump's walk skips _no_backup_below for devices at least _sure_backup_rate fast: at
    that speed and above, the test must say some backup could be taken; a little below the
    exact threshold it may say either. Random classes, overheads and dilations, speeds from
    the sure rate up and around it."""
    import types

    rng = random.Random(11)
    checked = some = 0
    for _ in range(3000):
        s = Scheduler()
        s.dilation = rng.choice([1.0, 2.5, 40.0])
        s._backups = types.SimpleNamespace(min_flops=1.0)  # type: ignore[assignment]
        mosts: Any = [(types.SimpleNamespace(min_flops=10 ** rng.uniform(3, 10)),
                       rng.choice([-1.0, 0.0, 0.04, 0.05, 0.0501, 0.1]) or
                       10 ** rng.uniform(-3, 1)) for _ in range(rng.randint(1, 4))]
        overhead = rng.choice([0.0, 1e-3, 0.02, 10 ** rng.uniform(-4, 0)])
        sure = s._sure_backup_rate(overhead, mosts)
        if math.isinf(sure):
            continue
        some += 1
        for rate in (sure, sure * (1 + 1e-12), sure * 1.01, sure * 1e3, sure * 1e9):
            checked += 1
            assert not s._no_backup_below(rate, overhead, 0.0, mosts), (sure, rate, mosts)
    assert some >= 1000 and checked >= 5000
