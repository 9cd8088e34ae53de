"""The PS's domain core without gRPC: plain data in, plain data out, GEMMs end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from testbed.ps_backend.core import (
    Descriptor,
    DeviceConn,
    Outgoing,
    PsConfig,
    PsCore,
    ResultIn,
    TileOut,
)
from testbed.ps_backend.scheduler import GemmJob, GemmSpec
from testbed.ps_backend.service import message_to_pb
from testbed.ps_backend.tiler import uniform
from testbed.ps_backend.validation import MAX_NAME_CHARS
from testbed.runlog import RunLog, read_jsonl
from testbed.wire.cache import BlockCache
from testbed.wire.tensors import operand_array


def _core() -> PsCore:
    config = PsConfig(token="secret", run_name="core-test", dtype=np.dtype("float64"),
                      tile_m=4, tile_n=4, min_offload_flops=0.0, planner="fifo")
    return PsCore(config)


def _descriptor(name: str, instance: str = "") -> Descriptor:
    return Descriptor(name=name, group="g", kind="real", profile="", predicted_gflops=1.0,
                      max_in_flight=8, cache_bytes=1 << 20, platform="test", instance=instance)


def _drain(queue: object) -> list[Outgoing]:
    out = []
    while not queue.empty():  # type: ignore[attr-defined]
        out.append(queue.get_nowait())  # type: ignore[attr-defined]
    return out


def _one_tile_out(core: PsCore) -> tuple[DeviceConn, GemmJob, TileOut]:
    """A device joined and attached, and the one tile of a 4 x 2 x 4 GEMM it was sent."""
    conn = core.join(_descriptor("dev"))
    core.attach(conn.device_id, conn.session_key)
    job = GemmJob(uid="g", spec=GemmSpec("l", "forward", 0), a=np.ones((4, 2)),
                  b=np.ones((2, 4)), c=np.empty((4, 4)), version=0, a_key="A", b_key="B")
    core.submit(job)
    assert conn.outbox is not None
    (tile,) = [t for out in _drain(conn.outbox) for t in out.tiles]
    return conn, job, tile


def _block(a: np.ndarray, b: np.ndarray, row: int, col: int) -> np.ndarray:
    return a[row * 4:(row + 1) * 4] @ b[:, col * 4:(col + 1) * 4]


def test_a_gemm_goes_out_as_plain_tiles_and_comes_back_placed() -> None:
    core = _core()
    assert core.check_token("secret") and not core.check_token("other")
    conn = core.join(_descriptor("dev"))
    assert core.attach(conn.device_id, "wrong key") is None
    assert core.attach(conn.device_id, conn.session_key) is conn
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((8, 3)), rng.standard_normal((3, 8))
    job = GemmJob(uid="s0/l/forward#0", spec=GemmSpec("l", "forward", 0), a=a, b=b,
                  c=np.empty((8, 8)), version=0, a_key="A", b_key="B")
    core.submit(job)
    assert conn.outbox is not None
    tiles, sent = [], {}
    for _ in range(4):  # the window is smaller than the GEMM: results free slots for the rest
        batch = [t for out in _drain(conn.outbox) for t in out.tiles]
        if not batch:
            break
        tiles += batch
        # a block travels once per device: later tiles name the blocks it already holds
        for op in (o for t in batch for o in (t.a, t.b)):
            assert (op.block is None) == (op.key in sent)
            sent.setdefault(op.key, op.block)
        core.on_results(conn, [ResultIn(t.task_id, t.attempt, _block(a, b, t.row, t.col),
                                        16 * 8, 0.01, 0.0, 0.0, 0.0, 0.0, 0.0) for t in batch])
    assert len(tiles) == 4  # 8x8 in 4x4 tiles
    assert core.stats.bytes_down == sum(block.nbytes for block in sent.values())
    assert job.done.done()
    np.testing.assert_array_equal(job.done.result(), job.c)
    np.testing.assert_allclose(job.c, a @ b, rtol=1e-12, atol=1e-12)
    assert core.stats.tiles == 4 and core.stats.bytes_up == 4 * 16 * 8


def test_a_result_whose_tensor_did_not_decode_is_refused_and_requeued() -> None:
    core = _core()
    conn, job, tile = _one_tile_out(core)
    core.on_results(conn, [ResultIn(tile.task_id, tile.attempt, None, 3, 0.01, 0.0, 0.0, 0.0,
                                     0.0, 0.0, tensor_problem="needs 128 bytes, got 3")])
    rejects = [out.reject for out in _drain(conn.outbox) if out.reject is not None]
    assert rejects and rejects[0][0] == tile.task_id and "bad tensor" in rejects[0][1]
    assert core.results_refused == 1 and not job.done.done()


def test_results_that_follow_a_leave_are_late_not_refused() -> None:
    """An agent stopping sends Leave, and results already on its stream can arrive after it
    (a CI run of tests/integration/test_mininet_partition.py recorded two as rejects)."""
    core = _core()
    conn, job, tile = _one_tile_out(core)
    assert core.leave(conn.device_id, conn.session_key, "SIGTERM") == 1  # re-queued
    core.on_results(conn, [ResultIn(tile.task_id, tile.attempt, job.a @ job.b, 128, 0.01, 0.0,
                                     0.0, 0.0, 0.0, 0.0)])
    assert core.stats.rejected == 0 and core.stats.late == 1
    assert not [out for out in _drain(conn.outbox) if out is not None and out.reject]


def test_leave_needs_the_session_key() -> None:
    core = _core()
    conn = core.join(_descriptor("dev"))
    assert core.leave(conn.device_id, "not the key", "bye") is None
    assert conn.device_id in core.conns
    assert core.leave(conn.device_id, conn.session_key, "bye") == 0
    assert conn.device_id not in core.conns


def test_devices_that_ask_one_name_go_by_numbered_ones(tmp_path: Path) -> None:
    """Machines sharing a host name (`testbed join`'s default name) are distinct devices to
    every record of the run; a name that was given up is free again."""
    core = PsCore(_core().config, RunLog(tmp_path))
    first, second, third = (core.join(_descriptor("pi", instance)) for instance in "abc")
    assert [c.slot.name for c in (first, second, third)] == ["pi", "pi-2", "pi-3"]
    for conn in (first, second, third):
        core.attach(conn.device_id, conn.session_key)
    assert len({c.slot.name for c in core.conns.values()}) == 3
    assert core.leave(second.device_id, second.session_key, "bye") == 0
    assert core.join(_descriptor("pi", "d")).slot.name == "pi-2"
    # cut to the longest name the PS takes, and still numbered apart
    long = "x" * MAX_NAME_CHARS
    assert [core.join(_descriptor(long, i)).slot.name for i in "ef"] == [
        long, "x" * (MAX_NAME_CHARS - 2) + "-2"]
    joins = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "join"]
    assert [(e["device"], e.get("asked_name")) for e in joins[:3]] == [
        ("pi", None), ("pi-2", "pi"), ("pi-3", "pi")]
    assert all("instance" not in e for e in joins)  # it lets its holder take the name back


def test_the_same_device_joining_again_takes_its_name_back_and_its_tiles_requeue(
        tmp_path: Path) -> None:
    """An agent joins again only once its session is over on its side; the registration the
    PS still holds is dropped then, not at its lease's end."""
    core = PsCore(_core().config, RunLog(tmp_path))
    old = core.join(_descriptor("dev", "k1"))
    core.attach(old.device_id, old.session_key)
    core.submit(GemmJob(uid="g", spec=GemmSpec("l", "forward", 0), a=np.ones((4, 2)),
                        b=np.ones((2, 4)), c=np.empty((4, 4)), version=0, a_key="A",
                        b_key="B"))
    assert old.slot.in_flight
    new = core.join(_descriptor("dev", "k1"))
    assert new.slot.name == "dev" and old.device_id not in core.conns
    assert core.stats.requeued >= 1
    (left,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "leave"]
    assert left["device_id"] == old.device_id and left["reason"] == "the same device joined again"
    assert left["requeued_tiles"] >= 1
    # an empty instance never matches: a device that gives none is numbered, never taken over
    assert core.join(_descriptor("dev")).slot.name == "dev-2"
    assert old.device_id not in core.conns and new.device_id in core.conns


def test_a_block_sent_for_w_transposed_serves_w_from_the_device_cache() -> None:
    """Forward's Wᵀ brings W's block; the input gradient's W is then a cache hit on both sides,
    and the device computes both products exactly as with fresh contiguous operands."""
    core = _core()
    conn = core.join(_descriptor("dev"))
    core.attach(conn.device_id, conn.session_key)
    assert conn.outbox is not None
    rng = np.random.default_rng(2)
    w, x, dy = (rng.standard_normal((4, 4)) for _ in range(3))
    device_cache: BlockCache[np.ndarray] = BlockCache(1 << 20)
    forward = GemmJob(uid="s0/l/forward#0", spec=GemmSpec("l", "forward", 0, "w@0"), a=x,
                      b=w.T, c=np.empty((4, 4)), version=0, a_key="x", b_key="w@0",
                      b_transposed=True)
    input_grad = GemmJob(uid="s0/l/input_grad#1", spec=GemmSpec("l", "input_grad", 0, "w@0"),
                         a=dy, b=w, c=np.empty((4, 4)), version=0, a_key="dy", b_key="w@0")
    sent_b = []
    for job in (forward, input_grad):
        core.submit(job)
        (out,) = _drain(conn.outbox)
        (tile,) = out.tiles
        sent_b.append(tile.b.block is not None)
        message = message_to_pb(out)  # what the service puts on the wire
        a = operand_array(message.tiles[0].a, device_cache)
        b = operand_array(message.tiles[0].b, device_cache)
        assert b.flags.c_contiguous
        np.testing.assert_array_equal(a @ b, job.a @ np.ascontiguousarray(job.b))
        core.on_results(conn, [ResultIn(tile.task_id, tile.attempt, a @ b, 128, 0.01, 0.0, 0.0,
                                        0.0, 0.0, 0.0)])
        assert job.done.done()
    assert sent_b == [True, False]  # W's block travelled once, for Wᵀ
    assert core.stats.bytes_down == 3 * 16 * 8  # x, w, dy: one 4x4 float64 block each


@pytest.mark.parametrize("keeps_held", [True, False])
def test_a_held_gemms_blocks_go_out_held_to_a_device_that_keeps_them(keeps_held: bool,
                                                                      monkeypatch) -> None:
    """A GEMM the plan keeps on the devices (``Cut.held``) marks its blocks held on the wire
    for a device that said it keeps held blocks (``DeviceDescriptor.keeps_held``), and for one
    that did not (an older agent), marks nothing: its cache and the PS's mirror stay plain
    LRU."""
    from testbed.ps_backend.service import descriptor_from_pb
    from testbed.ps_backend.step_plan import Cut
    from testbed.wire import testbed_pb2 as pb

    core = _core()
    monkeypatch.setattr(core.planner, "plan", lambda job, slots: Cut(uniform(4, 4, 4), None,
                                                                      True))
    conn = core.join(descriptor_from_pb(pb.DeviceDescriptor(
        name="dev", kind="real", predicted_gflops=1.0, max_in_flight=8, cache_bytes=1 << 20,
        keeps_held=keeps_held)))
    core.attach(conn.device_id, conn.session_key)
    assert conn.outbox is not None
    x, w = np.ones((4, 4)), np.ones((4, 4))
    core.submit(GemmJob(uid="s0/l/forward#0", spec=GemmSpec("l", "forward", 0), a=x, b=w,
                        c=np.empty((4, 4)), version=0, a_key="x", b_key="w"))
    (out,) = _drain(conn.outbox)
    tile = message_to_pb(out).tiles[0]
    assert (tile.a.held, tile.b.held) == (keeps_held, keeps_held)
    assert core.scheduler.devices[conn.device_id].keeps_held is keeps_held


def _first_messages(down_Bps: float) -> list[Outgoing]:
    """The messages of a device's first pump for a 16-tile GEMM (4x4 float64 blocks:
    192 bytes a tile) when its group's downlink carries ``down_Bps``."""
    config = PsConfig(token="secret", run_name="core-test", dtype=np.dtype("float64"),
                      tile_m=4, tile_n=4, min_offload_flops=0.0, planner="fifo",
                      group_links={"g": (down_Bps, down_Bps, 0.0)})
    core = PsCore(config)
    conn = core.join(_descriptor("dev"))
    core.attach(conn.device_id, conn.session_key)
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((16, 3)), rng.standard_normal((3, 16))
    core.submit(GemmJob(uid="s0/l/forward#0", spec=GemmSpec("l", "forward", 0), a=a, b=b,
                        c=np.empty((16, 16)), version=0, a_key="A", b_key="B"))
    assert conn.outbox is not None
    return _drain(conn.outbox)


def test_tiles_whose_blocks_take_long_to_arrive_go_one_message_each() -> None:
    """A message's first tile waits at most DOWN_BATCH_DELAY_S for the blocks behind it: on
    a fast link one pump's tiles travel together (the PS's cost is per message), on a slow one
    each goes alone, so the device computes the first while the next arrives."""
    fast = _first_messages(1e9)  # 192 B in 0.2 us
    assert len(fast) == 1 and len(fast[0].tiles) >= 2  # the device's window: two tiles
    slow = _first_messages(1e4)  # 192 B in 19 ms
    assert [len(m.tiles) for m in slow] == [1] * len(fast[0].tiles)
    # the same tiles in the same order, so the device's cache and the PS's mirror agree
    assert [t.task_id for m in slow for t in m.tiles] == [t.task_id for t in fast[0].tiles]


def test_a_tile_of_parts_joins_cached_blocks_and_its_parts_serve_a_finer_cut() -> None:
    """A GEMM whose K is cut into parts (k_block) sends each part as its own block; the device
    joins them along K into exactly the one-block operand, and caches each part, so a later
    GEMM on the same tensors cut at the parts finds every block held (and the other way round:
    the parts' keys are the finer cut's keys)."""
    core = _core()
    conn = core.join(_descriptor("dev"))
    core.attach(conn.device_id, conn.session_key)
    assert conn.outbox is not None
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((4, 6)), rng.standard_normal((4, 6))
    device_cache: BlockCache[np.ndarray] = BlockCache(1 << 20)
    jobs = [GemmJob(uid=f"s0/l/forward#{j}", spec=GemmSpec("l", "forward", 0, "w@0"), a=x,
                    b=w.T, c=np.empty((4, 4)), version=0, a_key="x", b_key="w@0",
                    b_transposed=True) for j in range(2)]
    sent = []

    def compute(tile) -> None:  # type: ignore[no-untyped-def]
        assert len(tile.a.parts) == len(tile.b.parts) == (3 if tile.k == 6 else 0)
        sent.append(sum(len(p.tensor.data) for op in (tile.a, tile.b) for p in (*op.parts, op)))
        a = operand_array(tile.a, device_cache, 1)
        b = operand_array(tile.b, device_cache, 0)
        assert a.shape == (4, tile.k) and b.shape == (tile.k, 4)
        core.on_results(conn, [ResultIn(tile.task_id, tile.attempt, a @ b, 128, 0.01, 0.0,
                                        0.0, 0.0, 0.0, 0.0)])

    # whole K (6) in parts of 2, then K split in 3 slices of 2: the same blocks
    for job, k_parts, k_block in ((jobs[0], 1, 2), (jobs[1], 3, 0)):
        core.scheduler.submit(job, uniform(job.a.shape[0], 4, 4, k_parts, k_block))
        core.pump()
        tiles = []
        while not job.done.done():  # the window is 2 tiles: results free slots for the rest
            tiles += (batch := [t for out in _drain(conn.outbox)
                                for t in message_to_pb(out).tiles])
            assert batch
            for tile in batch:
                compute(tile)
        assert len(tiles) == k_parts
    # one product of the joined parts: the device computes with A and B as C-ordered arrays
    # (operand_array joins the parts into exactly x and a C-ordered copy of w.T), and `x @ w.T`
    # would take another BLAS path (a transposed B), with no promise of the same bits
    np.testing.assert_array_equal(jobs[0].c, x @ np.ascontiguousarray(w.T))
    np.testing.assert_allclose(jobs[1].c, x @ w.T, rtol=1e-12, atol=1e-12)
    assert sent == [2 * 4 * 6 * 8, 0, 0, 0]  # x and w once, as parts; then all held
    assert core.stats.bytes_down == 2 * 4 * 6 * 8


def test_a_done_runs_figures_are_its_steps_and_results_after_the_last_step_are_apart() -> None:
    """A stress run's summary said late 64 where its steps said 62: results that came back
    after the last step were in the summary's totals and in no step."""
    core = _core()
    conn, job, tile = _one_tile_out(core)
    result = ResultIn(tile.task_id, tile.attempt, job.a @ job.b, 128, 0.01, 0.0, 0.0, 0.0,
                      0.0, 0.0)
    core.on_results(conn, [result])
    step = core.take_step_stats()  # the last step: what steps.jsonl records
    assert step.tiles == 1 and step.late == 0
    core.on_results(conn, [result])  # the same result again, after the step: late
    done = core.summary_figures(done=True)
    assert (done["tiles"], done["late"], done["bytes_up"]) == (step.tiles, step.late,
                                                               step.bytes_up)
    assert done["after_last_step"] == {"late": 1, "bytes_up": 128}
    # a run that did not end its steps counts what it spent, the step under way included
    unfinished = core.summary_figures(done=False)
    assert (unfinished["late"], unfinished["bytes_up"]) == (1, 2 * 128)
    assert "after_last_step" not in unfinished


@pytest.mark.parametrize("dilation", [1.0, 4.0])
def test_a_lease_is_device_time_so_wall_time_stretches_with_the_dilation(
        dilation: float) -> None:
    """At D 4 a device silent for 5 s of wall time (1.25 s of device time) was dropped, where
    `testbed simulate` and the baselines hold it for the lease's 5 s of device time."""
    core = _core()
    core.set_dilation(dilation)
    conn = core.join(_descriptor("dev"))
    core.attach(conn.device_id, conn.session_key)
    lease_wall_s = core.config.lease_s * dilation
    assert core.expire_leases(conn.last_seen_s + lease_wall_s - 0.01) == []
    assert core.expire_leases(conn.last_seen_s + lease_wall_s + 0.01) == [conn.device_id]
