"""The backup search's shortcuts: copies on devices whose overhead is unknown wait outside the
search until they may be backed up (once overdue by OVERDUE_BACKUP_S times the dilation, or once
the holder's overhead is learned from a result, and not a moment before either), the pump's
backup walk leaves out only devices that could not pass, and the walk over copies skips only
ties that cannot win."""

from __future__ import annotations

import random

import pytest

from testbed.ps_backend.scheduler import (
    OVERDUE_BACKUP_S,
    DeviceSlot,
    ReadyIndex,
    Scheduler,
    Verdict,
)
from testbed.ps_backend.tiler import uniform
from tests.unit.test_scheduler import honest, job, slot


def _stuck_and_fast(dilation: float) -> tuple[Scheduler, int, float]:
    """'stuck' holds a tile and never answers; 'fast' is known and idle. (scheduler, the stuck
    tile's id, its predicted return)"""
    s = Scheduler(dilation=dilation)
    s.add_device(slot("stuck", gflops=10, window=1))
    s.add_device(slot("fast", gflops=10, window=1))
    s.submit(job(64, 32, 64), uniform(64, 32, 64))  # two tiles
    (mine,) = s.assign("stuck", now_s=0.0)
    (theirs,) = s.assign("fast", now_s=0.0)
    assert s.accept("fast", theirs.task.task_id, 0, honest(theirs.task),
                    compute_s=1e-4, now_s=1e-3).verdict is Verdict.ACCEPTED
    assert s.devices["stuck"].overhead_s is None and s.devices["fast"].overhead_s is not None
    expected_s = s.devices["stuck"].in_flight[mine.task.task_id].expected_s
    return s, mine.task.task_id, expected_s


@pytest.mark.parametrize("dilation", [1.0, 3.0])
def test_an_unknown_holders_copy_is_backed_up_once_overdue_enough(dilation: float) -> None:
    s, task_id, expected_s = _stuck_and_fast(dilation)
    due_s = expected_s + OVERDUE_BACKUP_S * dilation
    assert s.assign("fast", now_s=expected_s + 0.5 * OVERDUE_BACKUP_S * dilation) == []
    assert s.assign("fast", now_s=due_s * (1 - 1e-6)) == []  # just before: still waiting
    got = s.assign("fast", now_s=due_s * (1 + 1e-6))
    assert [a.task.task_id for a in got] == [task_id] and got[0].backup


def test_an_unknown_holders_copy_is_a_candidate_once_its_overhead_is_known() -> None:
    s, task_id, expected_s = _stuck_and_fast(1.0)
    now_s = expected_s + 0.5 * OVERDUE_BACKUP_S  # overdue, but not by OVERDUE_BACKUP_S
    assert s.assign("fast", now_s=now_s) == []
    s.note_overhead("stuck", 0.0)  # as if a result had told it: the straggler rule applies
    got = s.assign("fast", now_s=now_s)
    assert [a.task.task_id for a in got] == [task_id] and got[0].backup


def test_a_known_holder_learned_from_a_result_lets_its_other_copies_be_backed_up() -> None:
    s = Scheduler()
    s.add_device(slot("slow", gflops=10, window=2))  # equal predictions: windows of two
    s.add_device(slot("fast", gflops=10, window=2))
    s.submit(job(64, 32, 64), uniform(64, 16, 64))  # four tiles
    first, second = s.assign("slow", now_s=0.0)  # the slow one's copies wait: overhead unknown
    for a in s.assign("fast", now_s=0.0):
        s.accept("fast", a.task.task_id, 0, honest(a.task), compute_s=1e-5, now_s=1e-4)
    assert s.assign("fast", now_s=1e-4) == []  # slow's overhead is unknown
    # slow answers its first tile late: its overhead is known now, its second copy straggles
    s.accept("slow", first.task.task_id, 0, honest(first.task), compute_s=0.5, now_s=1.0)
    got = s.assign("fast", now_s=1.0)
    assert [a.task.task_id for a in got] == [second.task.task_id] and got[0].backup


def test_backup_walk_keeps_every_device_that_could_pass_in_pump_order() -> None:
    """ReadyIndex.backup_walk against the plain test, device by device: every ready device
    whose one-tile finish (FLOPs / rate + overhead) is below the bar is walked, in pump order,
    and those far above it (their overhead alone) are left out."""
    rng = random.Random(7)
    s = Scheduler()
    slots = [DeviceSlot(f"d{i}", f"d{i}", rng.choice([1.0, 2.0, 10.0, 50.0]), 2, 1 << 16)
             for i in range(400)]
    s.add_devices(slots)
    for x in slots:
        x.rate_flops = x.predicted_gflops * 1e9 * rng.uniform(0.5, 1.5)
        if rng.random() < 0.9:
            x.overhead_s = rng.choice([0.0, rng.uniform(0.0, 0.05), rng.uniform(0.0, 2.0)])
    ready = ReadyIndex(s)
    ready.rebuild()
    order = ready.slots()
    flops_s = 1e8
    for trial in range(200):
        bar_s = rng.uniform(0.0, 0.5)
        unknown_s = rng.choice([None, rng.uniform(0.0, 0.3)])
        start = order[rng.randrange(len(order))]
        start_key = (-start.rate_flops, start.order, start.device_id)
        walked = [key[2] for key in ready.backup_walk(start_key, bar_s, flops_s, unknown_s)]
        after = order[order.index(start):]
        assert walked == [x.device_id for x in after if x.device_id in set(walked)]  # order

        def finish_s(x: DeviceSlot, unknown_s: float | None = unknown_s) -> float | None:
            overhead = x.overhead_s if x.overhead_s is not None else unknown_s
            return None if overhead is None else flops_s / max(x.rate_flops, 1.0) + overhead
        could = [x.device_id for x in after
                 if (f := finish_s(x)) is not None and f < bar_s]
        assert set(could) <= set(walked), trial
        hopeless = [x.device_id for x in after
                    if (f := finish_s(x)) is None or x.overhead_s is not None
                    and x.overhead_s > 1.2 * bar_s]
        assert not set(hopeless) & set(walked), trial


def test_the_walk_skips_only_a_qualified_copys_ties_in_its_list() -> None:
    """BackupIndex.by_remaining: copies handed out at one instant to equal devices tie; a
    ``send(True)`` for one of them skips the rest of those ties (they come later in device
    order and cannot win), not the copies with another remaining time after them."""
    s = Scheduler()
    for name, gflops in (("slow", 1.0), ("b", 10.0), ("c", 10.0), ("d", 10.0), ("fast", 100.0)):
        s.add_device(slot(name, gflops=gflops, window=1))
        s.note_overhead(name, 0.0)
    s.submit(job(80, 32, 64), uniform(80, 16, 64))  # five equal tiles
    for name in ("slow", "b", "c", "d", "fast"):
        assert len(s.assign(name, now_s=0.0)) == 1

    def walked(skip_at: str | None) -> list[str]:
        out: list[str] = []
        (index,) = s._backups.classes.values()  # five tiles of one size
        walk = index.by_remaining(1e-9, OVERDUE_BACKUP_S)
        step = next(walk, None)
        while step is not None:
            out.append(step[1][5].device_id)
            try:
                step = walk.send(out[-1] == skip_at)
            except StopIteration:
                break
        return out

    assert walked(None) == ["slow", "b", "c", "d", "fast"]
    assert walked("b") == ["slow", "b", "fast"]  # c's and d's copies tie with b's
    assert walked("c") == ["slow", "b", "c", "fast"]
    assert walked("slow") == ["slow", "b", "c", "d", "fast"]  # nothing ties with slow's


def test_a_backup_goes_to_the_first_qualifying_copy_among_ties() -> None:
    """The device's own copy comes first among the tied copies and does not qualify; the
    search must go on to the next tied copy instead of skipping the ties."""
    s = Scheduler()
    for name in ("thief", "b", "c"):
        s.add_device(slot(name, gflops=0.001, window=1))
        s.note_overhead(name, 0.0)
    # three equal tiles: three copies with one return time
    s.submit(job(48, 32, 64), uniform(48, 16, 64))
    tiles = [s.assign(name, now_s=0.0)[0].task.task_id for name in ("thief", "b", "c")]
    thief = s.devices["thief"]
    thief.rate_flops, thief.window = 1e12, 2  # it turned out fast, with room for one more
    got = s.assign("thief", now_s=1e-6)
    assert [a.task.task_id for a in got] == [tiles[1]] and got[0].backup  # b's, not none


@pytest.mark.parametrize("dilation", [1.0, 3.0])
def test_a_block_waits_behind_what_a_shared_link_carries_for_the_others(dilation: float) -> None:
    """Two devices below one shared 1 MB/s link, each with a 1 MB/s link of its own: what the
    first is handed crosses the shared link first, so a block for the idle second one waits
    for it (stealing and backups count that wait); a device beside the link does not."""
    from testbed.ps_backend.scheduler import SharedLink

    s = Scheduler(dilation=dilation)
    uplink = SharedLink(1e6)
    for name in ("a", "b", "c"):
        d = slot(name, gflops=10, window=1)
        d.down_Bps = 1e6
        d.shared = (uplink,) if name != "c" else ()
        s.add_device(d)
    s.submit(job(64, 32, 64), uniform(64, 32, 64))  # two tiles, each A and B blocks of its own
    (given,) = s.assign("a", now_s=0.0)
    sent = sum(nbytes for (key, nbytes), new in zip(given.task.blocks, given.send) if new)
    assert sent > 0 and uplink.free_s == pytest.approx(sent / 1e6 * dilation)
    assert s.devices["b"].queued_s(0.0) == pytest.approx(sent / 1e6 * dilation)
    assert s.devices["c"].queued_s(0.0) == 0.0
    left = next(t for t in s.pending if not t.done)
    assert s._fetch_s(s.devices["b"], left, 0.0) > s._fetch_s(s.devices["c"], left, 0.0)


@pytest.mark.parametrize("dilation", [1.0, 3.0])
def test_a_copy_is_expected_back_after_the_results_its_device_owes_went_up(dilation: float
                                                                          ) -> None:
    """A device of fast compute on a 32 KB/s uplink handed three tiles of 32 KB results: the
    k-th copy is due once k results have gone up (a link-bound device is not late when its
    results queue on its uplink, and a backup of them would only be wasted)."""
    s = Scheduler(dilation=dilation)
    d = slot("a", gflops=1e6, window=3)
    d.up_Bps = 64 * 64 * 8 / 1.0  # one float64 64 x 64 result a second
    d.overhead_s = 0.0
    s.add_device(d)
    d.window = 3
    s.submit(job(192, 32, 64), uniform(192, 64, 64))  # three tiles
    given = s.assign("a", now_s=0.0)
    assert len(given) == 3
    due = sorted(c.expected_s for c in s.devices["a"].in_flight.values())
    assert due == pytest.approx([1.0 * dilation, 2.0 * dilation, 3.0 * dilation], rel=1e-6)


@pytest.mark.parametrize("dilation", [1.0, 3.0])
def test_a_backup_counts_the_upload_of_its_own_result(dilation: float) -> None:
    """An idle device of fast compute backs up a slow device's tile (0.13 s of compute left)
    unless its own uplink would take 0.1 s to return the result: then it could not save
    enough (the straggler rule's factor of 2)."""
    def backed_up(up_Bps: float) -> bool:
        s = Scheduler(dilation=dilation)
        s.add_device(slot("slow", gflops=0.001, window=1))
        s.add_device(slot("idle", gflops=100, window=1))
        s.devices["idle"].up_Bps = up_Bps
        for d in s.devices.values():
            d.overhead_s = 0.0
        # two tiles of 32 x 64, 0.13 s each on "slow"
        s.submit(job(64, 32, 64), uniform(64, 32, 64))
        (held,) = s.assign("slow", now_s=0.0)
        (other,) = s.assign("idle", now_s=0.0)
        assert s.accept("idle", other.task.task_id, 0, honest(other.task),
                        now_s=0.0).verdict is Verdict.ACCEPTED
        got = s.assign("idle", now_s=0.0)
        return [a.task.task_id for a in got] == [held.task.task_id] and got[0].backup

    assert backed_up(float("inf"))
    assert not backed_up(32 * 64 * 8 / 0.1)
