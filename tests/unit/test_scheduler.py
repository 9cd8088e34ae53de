"""The scheduler on its own: windows sized to speed, affinity, exact cache mirrors, verdicts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from testbed.ps_backend.cache import BlockCache
from testbed.ps_backend.executor import GemmSpec
from testbed.ps_backend.scheduler import DeviceSlot, GemmJob, Scheduler, Verdict
from testbed.ps_backend.tiler import cut


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


def test_full_gemm_through_devices_matches_numpy() -> None:
    s = Scheduler()
    s.add_device(slot("d0"))
    s.add_device(slot("d1"))
    j = job()
    s.submit(j, 16, 16)
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


def test_affinity_prefers_cached_blocks() -> None:
    s = Scheduler()
    s.add_device(slot("d0", window=1))
    j = job(b_key="w@0:T")
    s.submit(j, 16, 64)  # 4 row blocks, 1 column block: B is shared by every tile
    first = s.assign("d0")[0]
    assert first.send_a and first.send_b
    s.accept("d0", first.task.task_id, 0, first.task.a_block() @ first.task.b_block())
    second = s.assign("d0")[0]
    assert second.send_a and not second.send_b  # on a hit only A's block travels


def test_removed_device_requeues_in_flight_with_new_attempt() -> None:
    s = Scheduler()
    s.add_device(slot("d0"))
    s.add_device(slot("d1"))
    j = job()
    s.submit(j, 32, 32)
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
    s.submit(j, 16, 16)
    t = s.assign("d0")[0].task
    outcome = s.accept("d0", t.task_id, t.attempt, bad(t.a_block() @ t.b_block()))
    assert outcome.verdict is Verdict.REJECTED and words in outcome.reason
    assert outcome.requeued and t.attempt == 1 and t in s.pending


def test_result_for_a_task_never_given_is_rejected() -> None:
    s = Scheduler()
    s.add_device(slot("d0"))
    s.add_device(slot("d1"))
    s.submit(job(), 16, 16)
    t = s.assign("d0")[0].task
    outcome = s.accept("d1", t.task_id, t.attempt, t.a_block() @ t.b_block())
    assert outcome.verdict is Verdict.REJECTED and "not given to device d1" in outcome.reason


def test_cache_mirror_stays_exact() -> None:
    """Replaying the PS's decisions on a real device cache never misses a block."""
    rng = random.Random(4)
    s = Scheduler()
    s.add_device(slot("d0", window=3, cache=40_000))  # small: forces evictions
    device: BlockCache[np.ndarray] = BlockCache(40_000)
    for step in range(3):
        s.invalidate(step)
        device.invalidate(step)
        jobs = [job(64, 24, 48, uid=f"s{step}g{i}", version=step, b_key=f"w{i % 2}@{step}:T")
                for i in range(3)]
        for j in jobs:
            s.submit(j, 16, 16)
        while any(j.remaining for j in jobs):
            for a in s.assign("d0"):
                t = a.task
                blocks = []
                for key, block, send, keep in ((t.a_block_key, t.a_block(), a.send_a, a.cache_a),
                                               (t.b_block_key, t.b_block(), a.send_b, a.cache_b)):
                    if send:
                        if keep:
                            device.put(key, step, block.nbytes, block)
                        blocks.append(block)
                    else:
                        cached = device.get(key)
                        assert cached is not None, f"mirror says cached, device lost {key}"
                        blocks.append(cached)
                if rng.random() < 0.5 or True:
                    s.accept("d0", t.task_id, t.attempt, blocks[0] @ blocks[1])
    assert device.used_bytes == s.devices["d0"].cache.used_bytes
