"""The scheduler on its own: windows sized to speed, affinity, exact cache mirrors, verdicts."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest

from testbed.ps_backend.scheduler import DeviceSlot, GemmJob, GemmSpec, Scheduler, Verdict
from testbed.ps_backend.tiler import Region, cut, uniform
from testbed.wire.cache import BlockCache


def job(m: int = 64, k: int = 32, n: int = 64, uid: str = "g", version: int = 0,
        b_key: str | None = None) -> GemmJob:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    return GemmJob(uid=uid, spec=GemmSpec("l", "forward", version), a=a, b=b,
                   c=np.empty((m, n)), version=version, a_key=f"{uid}:A",
                   b_key=b_key or f"{uid}:B")


def slot(name: str, gflops: float = 10.0, window: int = 4, cache: int = 1 << 20) -> DeviceSlot:
    return DeviceSlot(device_id=name, name=name, predicted_gflops=gflops,
                      max_in_flight=window, cache_bytes=cache)


def test_cut_covers_every_element_once() -> None:
    seen = np.zeros((70, 45), dtype=int)
    for box in cut(70, 45, 16, 16):
        seen[box.r0:box.r1, box.c0:box.c1] += 1
    assert (seen == 1).all()


def test_windows_follow_predicted_speed() -> None:
    s = Scheduler()
    for name, g in (("p0", 10), ("p1", 10), ("p2", 10), ("laptop", 100)):
        s.add_device(slot(name, g, window=8))
    assert s.devices["p0"].window == 2 and s.devices["laptop"].window == 8
    deep = Scheduler(window_scale=4)  # the planner's windows: deeper, still capped
    for name, g in (("p0", 10), ("p1", 10), ("p2", 10), ("slow", 5), ("laptop", 100)):
        deep.add_device(slot(name, g, window=8))
    assert [deep.devices[n].window for n in ("p0", "slow", "laptop")] == [4, 2, 8]


def test_the_planner_gets_deeper_windows_than_the_queue() -> None:
    from testbed.ps_backend.config import ps_config
    from testbed.ps_backend.scheduler import PLANNED_WINDOW_SCALE, WINDOW_SCALE
    from testbed.topology import load_topology
    from tests.conftest import TINY

    topology = load_topology(TINY)
    assert topology.job.parallelism.planner == "auto"
    assert ps_config(topology).window_scale == PLANNED_WINDOW_SCALE > WINDOW_SCALE
    fifo = dataclasses.replace(topology.job.parallelism, planner="fifo")
    job = dataclasses.replace(topology.job, parallelism=fifo)
    assert ps_config(topology.with_overrides(job=job)).window_scale == WINDOW_SCALE


def test_full_gemm_through_devices_matches_numpy() -> None:
    s = Scheduler()
    s.add_device(slot("d0"))
    s.add_device(slot("d1"))
    j = job()
    s.submit(j, uniform(j.a.shape[0], 16, 16))
    rounds = 0
    while j.remaining:
        rounds += 1
        for d in ("d0", "d1"):
            for a in s.assign(d):
                t = a.task
                assert s.accept(d, t.task_id, t.attempt, t.a_block() @ t.b_block()).verdict \
                    is Verdict.ACCEPTED
    np.testing.assert_allclose(j.c, j.a @ j.b, rtol=1e-12)
    assert rounds < 20


@pytest.mark.parametrize("regions", [[], [Region(0, 32, 16, 16)], [Region(16, 64, 16, 16)],
                                     [Region(0, 32, 16, 16), Region(40, 64, 16, 16)],
                                     [Region(0, 40, 16, 16), Region(32, 64, 16, 16)]])
def test_a_cut_must_cover_every_row_once(regions: list[Region]) -> None:
    s = Scheduler()
    with pytest.raises(ValueError, match="do not cover rows 0:64 once"):
        s.submit(job(64, 32, 64), regions)
    assert not s.tasks and not s.pending


def test_affinity_prefers_cached_blocks() -> None:
    s = Scheduler()
    s.add_device(slot("d0", window=1))
    j = job(b_key="w@0:T")
    # 4 row blocks, 1 column block: B is shared by every tile
    s.submit(j, uniform(j.a.shape[0], 16, 64))
    first = s.assign("d0")[0]
    assert first.send == (True, True)
    s.accept("d0", first.task.task_id, 0, first.task.a_block() @ first.task.b_block())
    second = s.assign("d0")[0]
    assert second.send == (True, False)  # on a hit only A's block travels


def test_removed_device_requeues_in_flight_with_new_attempt() -> None:
    s = Scheduler()
    s.add_device(slot("d0"))
    s.add_device(slot("d1"))
    j = job()
    s.submit(j, uniform(j.a.shape[0], 32, 32))
    given = s.assign("d0")
    requeued = s.remove_device("d0")
    assert {t.task_id for t in requeued} == {a.task.task_id for a in given}
    assert all(t.attempt == 1 for t in requeued)
    t = given[0].task
    # the departed device's late answer is refused (it is no longer registered)
    assert s.accept("d0", t.task_id, 0, t.a_block() @ t.b_block()).verdict is Verdict.REJECTED
    # the re-queued task goes to the next device, first
    assert s.assign("d1")[0].task.task_id == requeued[0].task_id


@pytest.mark.parametrize("bad,words", [
    (lambda c: c[:, :-1], "wrong shape"),
    (lambda c: c.astype(np.float32), "wrong dtype"),
    (lambda c: np.where(c > 0, np.nan, c), "non-finite"),
    (lambda c: c * 1.001, "Freivalds"),
])
def test_bad_results_are_rejected_and_requeued(bad, words: str) -> None:
    s = Scheduler()
    s.add_device(slot("d0"))
    j = job()
    s.submit(j, uniform(j.a.shape[0], 16, 16))
    t = s.assign("d0")[0].task
    outcome = s.accept("d0", t.task_id, t.attempt, bad(t.a_block() @ t.b_block()))
    assert outcome.verdict is Verdict.REJECTED and words in outcome.reason
    assert outcome.requeued and t.attempt == 1 and t in s.pending


def test_result_for_a_task_never_given_is_rejected() -> None:
    s = Scheduler()
    s.add_device(slot("d0"))
    s.add_device(slot("d1"))
    s.submit(job(), uniform(64, 16, 16))
    t = s.assign("d0")[0].task
    outcome = s.accept("d1", t.task_id, t.attempt, t.a_block() @ t.b_block())
    assert outcome.verdict is Verdict.REJECTED and "not given to device d1" in outcome.reason


def drain(s: Scheduler, device: BlockCache[np.ndarray], jobs: list[GemmJob], version: int,
          a_parts: list[tuple[Any, int]] | None = None) -> int:
    """Hand out and compute every tile of ``jobs`` on device d0, replaying the PS's decisions
    on a real device cache as the agent does (``operand_array``: a sent block is cached under
    its key, held as the tile says; a key alone must be a hit); the bytes sent. ``a_parts``
    gets each task with the number of blocks its A came in."""
    name = "d0"
    sent = 0
    while any(j.remaining for j in jobs):
        for a in s.assign(name):
            t = a.task
            sent += a.nbytes
            used = iter(zip(t.blocks, a.send, a.keep))
            operands = []
            for piece_of in (t.a_piece, t.b_piece):
                parts = []
                for piece in t.pieces:
                    (key, _), send, keep = next(used)
                    block = piece_of(piece)
                    if send:
                        if keep:
                            device.put(key, version, block.nbytes, block, a.held)
                        parts.append(block)
                    else:
                        cached = device.get(key, a.held)
                        assert cached is not None, f"mirror says cached, device lost {key}"
                        parts.append(cached)
                operands.append(parts)
            if a_parts is not None:
                a_parts.append((t, len(operands[0])))
            a_op = np.concatenate(operands[0], axis=1)
            b_op = np.concatenate(operands[1], axis=0)
            assert s.accept(name, t.task_id, t.attempt, a_op @ b_op).verdict is \
                Verdict.ACCEPTED
    return sent


def test_cache_mirror_stays_exact() -> None:
    """Replaying the PS's decisions on a real device cache never misses a block, also when a
    tile's K slice is several parts, each its own block (k_block)."""
    s = Scheduler()
    s.add_device(slot("d0", window=3, cache=40_000))  # small: forces evictions
    device: BlockCache[np.ndarray] = BlockCache(40_000)
    for step in range(3):
        s.invalidate(step)
        device.invalidate(step)
        jobs = [job(64, 24, 48, uid=f"s{step}g{i}", version=step, b_key=f"w{i % 2}@{step}:T")
                for i in range(4)]
        for i, j in enumerate(jobs):
            # the last two: K in 2 slices of parts 8 long (24 = 8 + 8 | 8), blocks of the
            # first two's whole-K blocks' tensors cut finer
            s.submit(j, uniform(j.a.shape[0], 16, 16, 2 if i >= 2 else 1, 8 if i >= 2 else 0))
        a_parts: list[tuple[Any, int]] = []
        drain(s, device, jobs, step, a_parts)
        for t, parts in a_parts:
            assert parts == (2 if t.box.k_block and t.k_range == (0, 16) else 1)
        assert any(t.box.k_block for t, _ in a_parts)
    assert device.used_bytes == s.devices["d0"].cache.used_bytes


@pytest.mark.parametrize("keeps_held", [True, False])
def test_held_blocks_outlast_the_traffic_before_their_next_use(keeps_held: bool) -> None:
    """A forward GEMM whose blocks the plan keeps (``held``), then three GEMMs of other
    tensors that overflow the cache, then a GEMM of the same X blocks (as the weight gradient
    reuses forward's): a device that keeps held blocks last gets none of X again, one that
    does not (an older agent: nothing is marked held for it) gets all of it; the mirror is
    exact either way."""
    s = Scheduler()
    s.add_device(dataclasses.replace(slot("d0", window=2, cache=80_000), keeps_held=keeps_held))
    device: BlockCache[np.ndarray] = BlockCache(80_000)

    def gemm(uid: str, a_key: str, b_key: str) -> GemmJob:
        made = job(64, 32, 64, uid=uid)  # X 16 KB, a tile's A block 4 KB
        made.a_key, made.b_key = a_key, b_key
        return made

    forward = gemm("f", "X", "W")
    s.submit(forward, uniform(64, 16, 16), held=True)
    drain(s, device, [forward], 0)
    between = [gemm(f"t{i}", f"T{i}", f"U{i}") for i in range(3)]  # 96 KB through 48 KB
    for j in between:
        s.submit(j, uniform(64, 16, 16))
    drain(s, device, between, 0)
    later = gemm("b", "X", "V")
    s.submit(later, uniform(64, 16, 16))
    x_bytes = v_bytes = 64 * 32 * 8
    assert drain(s, device, [later], 0) == v_bytes + (0 if keeps_held else x_bytes)
    assert device.used_bytes == s.devices["d0"].cache.used_bytes
    assert list(device.keys()) == list(s.devices["d0"].cache.keys())


# -- backups, the straggler rule, quarantine, the ledger's prefill ------------------------------

def honest(t) -> np.ndarray:
    return t.a_block() @ t.b_block()


def two_speeds(**kwargs) -> Scheduler:
    """A fast and a slow device, both with a known round-trip overhead (0 s)."""
    s = Scheduler(**kwargs)
    s.add_device(slot("fast", gflops=100, window=1))
    s.add_device(slot("slow", gflops=0.001, window=1))  # ~0.13 s a tile: worth a backup
    for d in s.devices.values():
        d.overhead_s = 0.0
    return s


def test_straggles_is_one_rule() -> None:
    from testbed.ps_backend.scheduler import STRAGGLER_RATIO, straggles

    assert straggles(STRAGGLER_RATIO * 1.01, 1.0) and not straggles(STRAGGLER_RATIO, 1.0)


def test_idle_device_backs_up_a_straggler_and_the_first_valid_result_wins() -> None:
    s = two_speeds()
    j = job(64, 32, 64)
    s.submit(j, uniform(j.a.shape[0], 32, 64))  # two tiles
    slow_task = s.assign("slow", now_s=0.0)[0].task
    fast_task = s.assign("fast", now_s=0.0)[0].task
    assert s.accept("fast", fast_task.task_id, 0, honest(fast_task), now_s=0.0).verdict \
        is Verdict.ACCEPTED
    backup = s.assign("fast", now_s=0.0)
    assert [a.task for a in backup] == [slow_task] and backup[0].backup
    assert slow_task.holders == {"slow", "fast"}
    won = s.accept("fast", slow_task.task_id, 0, honest(slow_task), now_s=0.0)
    assert won.verdict is Verdict.ACCEPTED and won.backup_won and won.completed_job is j
    late = s.accept("slow", slow_task.task_id, 0, honest(slow_task), now_s=1.0)
    assert late.verdict is Verdict.LATE and late.checked
    assert s.counters.backups == 1 and s.counters.backup_wins == 1 and s.counters.wasted == 1
    np.testing.assert_allclose(j.c, j.a @ j.b, rtol=1e-12)


def test_a_wrong_losing_copy_is_still_refused() -> None:
    s = two_speeds()
    s.submit(job(64, 32, 64), uniform(64, 32, 64))
    t = s.assign("slow", now_s=0.0)[0].task
    other = s.assign("fast", now_s=0.0)[0].task
    s.accept("fast", other.task_id, 0, honest(other), now_s=0.0)
    s.assign("fast", now_s=0.0)
    s.accept("fast", t.task_id, 0, honest(t), now_s=0.0)
    outcome = s.accept("slow", t.task_id, 0, honest(t) * 2, now_s=1.0)
    assert outcome.verdict is Verdict.REJECTED and outcome.failed_check
    assert s.devices["slow"].failed_checks == 1


def test_no_backup_that_saves_less_than_the_jitter_floor() -> None:
    from testbed.ps_backend.scheduler import MIN_BACKUP_GAIN_S

    s = Scheduler()
    s.add_device(slot("fast", gflops=100, window=1))
    s.add_device(slot("slow", gflops=1, window=1))  # 10x slower, but ~0.1 ms a tile
    for d in s.devices.values():
        d.overhead_s = 0.0
    s.submit(job(64, 32, 64), uniform(64, 32, 64))
    t = s.assign("slow", now_s=0.0)[0].task
    u = s.assign("fast", now_s=0.0)[0].task
    s.accept("fast", u.task_id, 0, honest(u), now_s=0.0)
    assert s.assign("fast", now_s=0.0) == []
    assert [a.task for a in s.assign("fast", now_s=2 * MIN_BACKUP_GAIN_S)] == [t]  # overdue


def test_no_backup_between_equal_devices_or_before_overheads_are_known() -> None:
    s = Scheduler()
    s.add_device(slot("a", gflops=10, window=1))
    s.add_device(slot("b", gflops=10, window=1))
    s.submit(job(64, 32, 64), uniform(64, 32, 64))
    s.assign("a", now_s=0.0)
    t = s.assign("b", now_s=0.0)[0].task
    s.accept("b", t.task_id, 0, honest(t), now_s=0.0)
    assert s.devices["a"].overhead_s is None
    assert s.assign("b", now_s=0.0) == []  # a's overhead is unknown: no speculation
    s.note_overhead("a", 0.0)
    assert s.assign("b", now_s=0.0) == []  # a is not straggling behind b


def test_an_overdue_copy_is_backed_up() -> None:
    s = Scheduler()
    s.add_device(slot("a", gflops=10, window=1))
    s.add_device(slot("b", gflops=10, window=1))
    for d in s.devices.values():
        d.overhead_s = 0.01
    s.submit(job(64, 32, 64), uniform(64, 32, 64))
    t = s.assign("a", now_s=0.0)[0].task
    u = s.assign("b", now_s=0.0)[0].task
    s.accept("b", u.task_id, 0, honest(u), now_s=0.011)
    assert s.assign("b", now_s=0.012) == []  # a is about due
    assert [x.task for x in s.assign("b", now_s=0.2)] == [t]  # 20x its expected time


def test_at_most_two_copies_and_never_twice_to_one_device() -> None:
    s = Scheduler()
    for name, g in (("slow", 0.001), ("f1", 100), ("f2", 100)):
        s.add_device(slot(name, gflops=g, window=1))
        s.devices[name].overhead_s = 0.0
    # four tiles: not the tail yet, the slow device gets one
    s.submit(job(64, 32, 64), uniform(64, 16, 64))
    t = s.assign("slow", now_s=0.0)[0].task
    for name in ("f1", "f2", "f1", "f2"):
        for a in s.assign(name, now_s=0.0):
            assert a.task is not t or name == "f2"  # f2 is the one idle when t straggles
            s.accept(name, a.task.task_id, 0, honest(a.task), now_s=0.0)
    assert s.counters.backups == 1 and t.done
    assert s.assign("f1", now_s=0.0) == [] and s.assign("slow", now_s=0.0) == []
    # the losing copy no longer counts as in flight, but still fills the slow device's window
    assert t.task_id not in s.devices["slow"].in_flight
    slow_copy = s.devices["slow"].cancelled[t.task_id]
    assert slow_copy.task is t and not t.holders and s.counters.cancelled == 1


def test_tail_rule_passes_over_a_straggler() -> None:
    s = two_speeds()
    s.devices["fast"].max_in_flight = s.devices["fast"].window = 4
    s.submit(job(32, 32, 64), uniform(32, 32, 64))  # one tile, and the fast device has free windows
    assert s.assign("slow", now_s=0.0) == []
    assert len(s.assign("fast", now_s=0.0)) == 1


def test_a_departure_requeues_only_tasks_nobody_else_holds() -> None:
    s = two_speeds()
    s.submit(job(64, 32, 64), uniform(64, 32, 64))
    t = s.assign("slow", now_s=0.0)[0].task
    u = s.assign("fast", now_s=0.0)[0].task
    s.accept("fast", u.task_id, 0, honest(u), now_s=0.0)
    s.assign("fast", now_s=0.0)  # backup of t
    assert s.remove_device("slow") == [] and t.attempt == 0
    assert s.remove_device("fast") == [t] and t.attempt == 1 and t in s.pending


def test_quarantine_after_failed_checks() -> None:
    s = Scheduler(quarantine_after=2)
    s.add_device(slot("liar", gflops=100, window=8))
    s.add_device(slot("honest", gflops=10, window=4))
    assert s.devices["liar"].window == 4
    s.submit(job(64, 32, 64), uniform(64, 16, 16))  # 16 tiles
    given = [a.task for a in s.assign("liar")]
    first = s.accept("liar", given[0].task_id, 0, honest(given[0]) * 3)
    assert first.failed_check and first.quarantined is None
    second = s.accept("liar", given[1].task_id, 0, honest(given[1]) * -1)
    assert second.quarantined is not None and s.devices["liar"].quarantined
    assert {t.task_id for t in second.quarantined} == {t.task_id for t in given[2:]}
    assert s.assign("liar") == []
    # its remaining results are still checked: a wrong one refused, a right one dropped
    assert s.accept("liar", given[2].task_id, 0, honest(given[2]) * 2).verdict \
        is Verdict.REJECTED
    assert s.accept("liar", given[3].task_id, 0, honest(given[3])).verdict is Verdict.LATE
    j = given[0].job
    while j.remaining:
        for a in s.assign("honest"):
            s.accept("honest", a.task.task_id, a.task.attempt, honest(a.task))
    np.testing.assert_allclose(j.c, j.a @ j.b, rtol=1e-12)


def test_quarantine_after_zero_never_quarantines() -> None:
    s = Scheduler(quarantine_after=0)
    s.add_device(slot("liar", window=8))
    s.add_device(slot("other", window=8))  # could take the failed tiles: the liar may not
    s.submit(job(64, 32, 64), uniform(64, 16, 16))
    while given := s.assign("liar"):
        for a in given:
            s.accept("liar", a.task.task_id, 0, honest(a.task) * 2)
    # every tile failed once on it, and none is given to it a second time
    assert not s.devices["liar"].quarantined and s.devices["liar"].failed_checks == 16
    assert len(s.pending) == 16 and all(t.attempt == 1 for t in s.pending)


def test_validation_can_be_switched_off() -> None:
    s = Scheduler(check_values=False)
    s.add_device(slot("d0"))
    s.submit(job(), uniform(64, 16, 16))
    t = s.assign("d0")[0].task
    assert s.accept("d0", t.task_id, 0, honest(t) * 1.5).verdict is Verdict.ACCEPTED


def test_prefilled_tiles_are_placed_and_not_queued() -> None:
    s = Scheduler()
    s.add_device(slot("d0", window=32))
    j = job(64, 32, 64)
    full = j.a @ j.b
    boxes = cut(64, 64, 16, 16)
    prefilled = {(b.r0, b.r1, b.c0, b.c1): full[b.r0:b.r1, b.c0:b.c1] for b in boxes[:10]}
    assert s.submit(j, uniform(j.a.shape[0], 16, 16), prefilled) == 10
    assert len(s.pending) == 6 and j.remaining == 6
    while j.remaining:
        for a in s.assign("d0"):
            s.accept("d0", a.task.task_id, 0, honest(a.task))
    np.testing.assert_allclose(j.c, full, rtol=1e-12)
    everything = job(64, 32, 64, uid="h")
    served = s.submit(everything, uniform(64, 16, 16),
                      {(b.r0, b.r1, b.c0, b.c1): full[b.r0:b.r1, b.c0:b.c1] for b in boxes})
    assert served == 16 and everything.done.done() and not s.pending


@pytest.mark.parametrize("seed", range(6))
def test_random_churn_speeds_and_liars_still_compute_every_tile_once(seed: int) -> None:
    """Random speeds, departures, joins, wrong results and backups: C = A·B, each tile once."""
    rng = random.Random(seed)
    s = Scheduler(quarantine_after=rng.choice([0, 1, 3]))
    names = iter(f"d{i}" for i in range(1000))
    liars: set[str] = set()

    def add() -> None:
        name = next(names)
        s.add_device(slot(name, gflops=rng.choice([1, 10, 100]), window=rng.randint(1, 4)))
        if rng.random() < 0.2:
            liars.add(name)
    for _ in range(4):
        add()
    jobs = [job(48, 16, 48, uid=f"g{i}") for i in range(3)]
    for j in jobs:
        s.submit(j, uniform(j.a.shape[0], 16, 16))
    placed: dict[int, int] = {}
    now = 0.0
    for _ in range(2000):
        if not any(j.remaining for j in jobs):
            break
        now += rng.random() * 0.01
        r = rng.random()
        if r < 0.03 and len(s.devices) > 1:
            s.remove_device(rng.choice(list(s.devices)))
        elif r < 0.06 or not [d for d in s.devices.values() if not d.quarantined]:
            add()
        name = rng.choice(list(s.devices))
        s.assign(name, now_s=now)
        d = s.devices[name]
        if d.in_flight and rng.random() < 0.8:
            copy = rng.choice(list(d.in_flight.values()))
            c = honest(copy.task)
            if name in liars and rng.random() < 0.5:
                c = c * 1.25 + 0.5
            outcome = s.accept(name, copy.task.task_id, copy.attempt, c, now_s=now)
            if outcome.verdict is Verdict.ACCEPTED:
                assert name not in liars or np.allclose(c, honest(copy.task))
                placed[copy.task.task_id] = placed.get(copy.task.task_id, 0) + 1
    assert not any(j.remaining for j in jobs), "the jobs did not finish"
    assert set(placed.values()) == {1}
    for j in jobs:
        np.testing.assert_allclose(j.c, j.a @ j.b, rtol=1e-12)


def test_the_tail_rule_ignores_a_device_that_cannot_take_the_task() -> None:
    """A fast device that already failed the last task must not stall it for slower ones."""
    s = Scheduler()
    s.add_device(slot("rogue", gflops=1000, window=1))
    s.add_device(slot("honest", gflops=10, window=2))
    s.devices["honest"].overhead_s = 0.005
    s.submit(job(16, 32, 16), uniform(16, 16, 16))  # one tile
    t = s.assign("rogue")[0].task
    s.accept("rogue", t.task_id, 0, honest(t) * 2)  # refused, re-queued
    assert s.assign("rogue") == []  # not to the device that failed it, while another can
    assert [a.task for a in s.assign("honest")] == [t]


def test_a_lone_device_may_retry_its_own_failed_task() -> None:
    s = Scheduler(quarantine_after=0)
    s.add_device(slot("only", window=1))
    s.submit(job(16, 32, 16), uniform(16, 16, 16))
    t = s.assign("only")[0].task
    s.accept("only", t.task_id, 0, honest(t) * 2)
    again = s.assign("only")
    assert [a.task for a in again] == [t] and t.attempt == 1


# -- plans: K split and owners ----------------------------------------------------------------
def _three_devices() -> Scheduler:
    s = Scheduler()
    for d in ("d0", "d1", "d2"):
        s.add_device(slot(d))
    return s


def _finish(s: Scheduler, j: GemmJob, order_seed: int, departs: bool) -> np.ndarray:
    """Compute a submitted GEMM's tiles, results returned in a shuffled order; with
    ``departs``, d2 leaves holding its first tiles (they go back to the queue: orphans anyone
    takes)."""
    rng = random.Random(order_seed)
    if departs:
        s.assign("d2")
        s.remove_device("d2")
    while j.remaining:
        out = [(d, a) for d in list(s.devices) for a in s.assign(d)]
        rng.shuffle(out)
        for d, a in out:
            t = a.task
            assert s.accept(d, t.task_id, t.attempt, t.a_block() @ t.b_block()).verdict \
                is Verdict.ACCEPTED
    return j.c.copy()


def _run_k_split(order_seed: int, departs: bool = False) -> np.ndarray:
    """A K-split GEMM through three devices."""
    s = _three_devices()
    j = job(m=32, k=96, n=32)
    owners = {(r, c, p): f"d{(r + c + p) % 3}" for r in range(2) for c in range(2)
              for p in range(3)}
    s.submit(j, uniform(j.a.shape[0], 16, 16, 3), owners=owners)
    assert all(t.box.split and t.a_block().shape[1] == 32 for t in s.tasks.values())
    return _finish(s, j, order_seed, departs)


def _run_regions(order_seed: int, departs: bool = False) -> np.ndarray:
    """A GEMM in two regions of rows, K-split two and three ways, through three devices."""
    s = _three_devices()
    j = job(m=48, k=96, n=32)
    regions = [Region(0, 16, 16, 32, 2), Region(16, 48, 16, 16, 3)]
    owners = {(0, 0, p): "d0" for p in range(2)} | {
        (r, c, p): f"d{1 + (r + c + p) % 2}" for r in (1, 2) for c in range(2) for p in range(3)}
    s.submit(j, regions, owners=owners)
    assert j.remaining == 2 + 2 * 2 * 3
    return _finish(s, j, order_seed, departs)


@pytest.mark.parametrize("run, m", [(_run_k_split, 32), (_run_regions, 48)])
def test_partials_are_summed_in_slice_order_bit_identical(run: Any, m: int) -> None:
    """Each block of C is its partials' sum in slice order, whichever device sent which and
    when (one grid's K split, and regions of rows each split its own way)."""
    first = run(0)
    assert np.array_equal(first, run(1))
    assert np.array_equal(first, run(2, departs=True))
    j = job(m=m, k=96, n=32)
    np.testing.assert_allclose(first, j.a @ j.b, rtol=1e-12, atol=1e-12)


def test_planned_tasks_go_to_their_owner_first() -> None:
    s = Scheduler()
    s.add_device(slot("d0", window=2))
    s.add_device(slot("d1", window=2))
    j = job(m=32, k=16, n=32)
    owners = {(r, c, 0): "d1" if r == 1 else "d0" for r in range(2) for c in range(2)}
    s.submit(j, uniform(j.a.shape[0], 16, 16), owners=owners)
    got = [a.task.box.row for a in s.assign("d1")]
    assert got == [1, 1]
    # d0 gets its own row; d1 (no speed seen yet) never steals
    assert [a.task.box.row for a in s.assign("d0")] == [0, 0]


def test_a_planned_task_its_owner_failed_goes_to_another_device() -> None:
    """With quarantine off, a liar that owns a task and fails it must not hold the GEMM up."""
    s = Scheduler()
    s.add_device(slot("liar", window=1))
    s.add_device(slot("honest", window=1))
    j = job(m=16, k=16, n=16)
    s.submit(j, uniform(j.a.shape[0], 16, 16), owners={(0, 0, 0): "liar"})
    assert s.assign("honest") == []  # the owner has not had it yet: no steal without a backlog
    (given,) = s.assign("liar")
    t = given.task
    outcome = s.accept("liar", t.task_id, t.attempt, (t.a_block() @ t.b_block()) * 1.5)
    assert outcome.verdict is not Verdict.ACCEPTED
    (retry,) = s.assign("honest")
    assert retry.task.task_id == t.task_id
    assert s.accept("honest", t.task_id, retry.task.attempt,
                    t.a_block() @ t.b_block()).verdict is Verdict.ACCEPTED
    assert not j.remaining
    np.testing.assert_allclose(j.c, j.a @ j.b, rtol=1e-12)


def test_planned_tasks_of_an_owner_that_never_returns_are_taken_by_others() -> None:
    """An owner that heartbeats but holds its tiles forever must not keep its planned ones."""
    s = Scheduler()
    s.add_device(slot("stuck", window=1))
    s.add_device(slot("honest", window=1))
    j = job(m=48, k=16, n=16)
    s.submit(j, uniform(j.a.shape[0], 16, 16),
             owners={(0, 0, 0): "honest", (1, 0, 0): "stuck", (2, 0, 0): "stuck"})
    (mine,) = s.assign("honest", now_s=0.0)
    (held,) = s.assign("stuck", now_s=0.0)  # never answered
    t = mine.task
    assert s.accept("honest", t.task_id, t.attempt, t.a_block() @ t.b_block(),
                    now_s=0.01).verdict is Verdict.ACCEPTED
    (taken,) = s.assign("honest", now_s=1000.0)  # the stuck owner is 1000 s overdue
    assert taken.task.box.row == 2 and not taken.backup
    assert held.task.box.row == 1
