"""A linear's backward pair planned as one: the grid, the owners, and the pair through the
scheduler (dY blocks shared between the two GEMMs, results bit-identical)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np

from testbed.ps_backend.planner import (
    PlanDevice,
    deal_pair,
    plan_gemm,
    plan_pair,
    split_boxes,
)
from testbed.ps_backend.scheduler import DeviceSlot, GemmJob, GemmSpec, Scheduler, Verdict
from testbed.ps_backend.tiler import uniform

PHONES = PlanDevice("phones", 20e9, 10e6, 10e6, 0.0, count=15)  # hotcarbon's 15 phones


def test_fit_gives_fifteen_equal_devices_one_tile_each_of_five_by_three() -> None:
    weights = [(f"d{i}", 1.0) for i in range(15)]
    boxes = split_boxes((5, 3, 1), weights, fit=True)
    sizes = [(b[1] - b[0]) * (b[3] - b[2]) * (b[5] - b[4]) for b in boxes.values()]
    assert sorted(sizes) == [1] * 15
    # plain bisection cuts 15 devices 7 | 8 and the rows 2 | 3: someone gets two tiles
    plain = split_boxes((5, 3, 1), weights)
    assert max((b[1] - b[0]) * (b[3] - b[2]) for b in plain.values()) > 1


def test_a_pair_on_slow_links_is_planned_faster_together_than_apart() -> None:
    t, o, i = 8192, 3072, 768  # OPT-125m's fc1 at batch 16 x 512 tokens
    pair = plan_pair(t, o, i, 4, [PHONES], max_tile_elems=1 << 22)
    assert pair is not None
    apart = plan_gemm(t, o, i, 4, [PHONES]).predicted_s + \
        plan_gemm(o, t, i, 4, [PHONES]).predicted_s
    assert pair.predicted_s < 0.8 * apart
    n_t, n_o, n_c = pair.grid
    # dX = dY·W is K-split over the output blocks, dW = dYᵀ·X over the token blocks, and the
    # two cut dY the same way: dX's row blocks are dW's K slices and the other way round
    assert pair.dx.grid == (n_t, n_c, n_o) and pair.dw.grid == (n_o, n_c, n_t)
    assert pair.dx.k_parts == n_o and pair.dw.k_parts == n_t
    assert pair.dx.tile_m == -(-t // n_t) and pair.dw.tile_m == -(-o // n_o)
    assert pair.dx.tile_n == pair.dw.tile_n and n_t * n_o > 1
    assert pair.counts == {"phones": 15}


def test_deal_pair_gives_both_tiles_of_a_block_to_one_device_and_boxes_to_each() -> None:
    devices = [PlanDevice(f"d{i}", 20e9 * (1 + i % 3), 10e6, 10e6) for i in range(7)]
    pair = plan_pair(4096, 1024, 512, 4, [PlanDevice("p", 20e9, 10e6, 10e6, count=7)])
    assert pair is not None
    dx, dw = deal_pair(pair, 4096, 1024, 512, 4, devices)
    n_t, n_o, n_c = pair.grid
    assert len(dx) == len(dw) == n_t * n_o * n_c
    for (tb, c, ob), owner in dx.items():
        assert dw[(ob, c, tb)] == owner
    for d in {*dx.values()}:  # each device's blocks form a box of the grid
        mine = [key for key, owner in dx.items() if owner == d]
        rows, cols, parts = ({key[j] for key in mine} for j in range(3))
        assert len(mine) == len(rows) * len(cols) * len(parts)


def _pair_jobs(t: int, o: int, i: int) -> tuple[GemmJob, GemmJob, np.ndarray, np.ndarray,
                                                 np.ndarray]:
    rng = np.random.default_rng(3)
    dy, w, x = (rng.standard_normal(s) for s in ((t, o), (o, i), (t, i)))
    dx = GemmJob(uid="dx", spec=GemmSpec("l", "input_grad", 0), a=dy, b=w,
                 c=np.empty((t, i)), version=0, a_key="dY", b_key="W")
    dw = GemmJob(uid="dw", spec=GemmSpec("l", "weight_grad", 0), a=dy.T, b=x,
                 c=np.empty((o, i)), version=0, a_key="dY", b_key="X", a_transposed=True)
    return dx, dw, dy, w, x


def _run_pair(order_seed: int, departs: bool = False
              ) -> tuple[np.ndarray, np.ndarray, dict[str, set[str]]]:
    """The pair through three devices with deal_pair's owners, results in a shuffled order;
    (dX, dW, the dY block keys of each GEMM's tiles)."""
    t, o, i = 96, 64, 32
    devices = [PlanDevice(f"d{j}", 10e9, 1e6, 1e6) for j in range(3)]
    pair = plan_pair(t, o, i, 8, [PlanDevice("p", 10e9, 1e6, 1e6, count=3)])
    assert pair is not None and pair.grid[0] * pair.grid[1] > 1
    dx_owners, dw_owners = deal_pair(pair, t, o, i, 8, devices)
    s = Scheduler()
    for d in devices:
        s.add_device(DeviceSlot(d.name, d.name, 10.0, 4, 1 << 20))
    dx, dw, dy, w, x = _pair_jobs(t, o, i)
    for gemm, plan, owners in ((dx, pair.dx, dx_owners), (dw, pair.dw, dw_owners)):
        s.submit(gemm, uniform(gemm.a.shape[0], plan.tile_m, plan.tile_n, plan.k_parts),
                 owners=owners)
    sent: dict[str, set[str]] = {"dx": set(), "dw": set()}
    rng = random.Random(order_seed)
    if departs:
        s.assign("d2")
        s.remove_device("d2")  # its tasks go back to the queue: orphans anyone takes
    while dx.remaining or dw.remaining:
        out = [(d, a) for d in list(s.devices) for a in s.assign(d)]
        assert out
        rng.shuffle(out)
        for d, a in out:
            task = a.task
            sent[task.job.uid].add(task.blocks[0][0])  # its dY block
            assert s.accept(d, task.task_id, task.attempt,
                            task.a_block() @ task.b_block()).verdict is Verdict.ACCEPTED
    np.testing.assert_allclose(dx.c, dy @ w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw.c, dy.T @ x, rtol=1e-12, atol=1e-12)
    return dx.c.copy(), dw.c.copy(), sent


def test_a_pair_through_the_scheduler_is_bit_identical_and_shares_its_dy_blocks() -> None:
    dx, dw, sent = _run_pair(0)
    for seed, departs in ((1, False), (2, True)):
        dx2, dw2, _ = _run_pair(seed, departs)
        assert np.array_equal(dx, dx2) and np.array_equal(dw, dw2)
    # dW's dYᵀ blocks are the very blocks (the same cache keys) dX's tiles use, and each
    # device owns the dX and dW tiles of a block (deal_pair): a dY block travels once
    assert sent["dw"] == sent["dx"] and len(sent["dx"]) > 1


def _planner(groups: list[tuple[str, int, float]], link: tuple[float, float, float],
             ps_link_Bps: tuple[float, float] = (float("inf"), float("inf"))) -> object:
    from testbed.ps_backend.step_plan import StepPlanner

    config = SimpleNamespace(planner="auto", planned_groups=groups,
                             group_links={g: link for g, _, _ in groups}, plan_links={},
                             fair_share_paths={},
                             ps_link_Bps=ps_link_Bps, group_paths={},
                             shared_down_Bps={},
                             max_message_bytes=64 << 20, tile_m=256, tile_n=256)
    return StepPlanner(config)


def test_the_step_planner_gives_a_slow_link_pair_one_layout() -> None:
    planner = _planner([("phones", 15, 20.0)], (10e6, 10e6, 0.0))
    slots = [DeviceSlot(f"p{j}", f"phones-{j}", 20.0, 4, 64 << 20, group="phones")
             for j in range(15)]
    t, o, i = 8192, 768, 768
    dx, dw, _, _, _ = (np.broadcast_to(np.zeros((), dtype=np.float32), s)
                       for s in ((t, o), (o, i), (t, i), (t, i), (o, i)))
    jobs = [GemmJob(uid="dx", spec=GemmSpec("l.q_proj", "input_grad", 0), a=dx, b=dw,
                    c=np.empty((0, 0)), version=0, a_key="dY", b_key="W"),
            GemmJob(uid="dw", spec=GemmSpec("l.q_proj", "weight_grad", 0), a=dx.T,
                    b=np.broadcast_to(np.zeros((), dtype=np.float32), (t, i)),
                    c=np.empty((0, 0)), version=0, a_key="dY", b_key="X", a_transposed=True)]
    cut_x, cut_w = (planner.plan(j, slots) for j in jobs)  # type: ignore[attr-defined]
    ((x,), own_x, _), ((w,), own_w, _) = cut_x, cut_w
    tm_x, tn_x, k_x, tm_w, tn_w, k_w = x.tile_m, x.tile_n, x.k_parts, w.tile_m, w.tile_n, w.k_parts
    assert own_x is not None and own_w is not None
    assert k_x * tm_w >= o and k_w * tm_x >= t  # each GEMM's K slices are the other's rows
    assert -(-o // k_x) == tm_w and -(-t // k_w) == tm_x and tn_x == tn_w
    for (tb, c, ob), owner in own_x.items():
        assert own_w[(ob, c, tb)] == owner
    assert len(set(own_x.values())) == 15


def test_a_pair_on_two_halves_shares_the_ps_link() -> None:
    # dX and dW of a pair split over two halves of the devices run at once: each half's plan
    # gets half the PS link, so neither is predicted to have all of it (campus's shared uplink)
    ps_Bps = 10e6
    planner = _planner([("laptops", 4, 100.0)], (1e9, 1e9, 0.0), (ps_Bps, ps_Bps))
    slots = [DeviceSlot(f"l{j}", f"laptops-{j}", 100.0, 4, 64 << 20, group="laptops")
             for j in range(4)]
    t, o, i, item = 1024, 256, 1024, 4
    halves = [planner.half_of(slots, h) for h in (0, 1)]  # type: ignore[attr-defined]
    dx = planner._plan_for(t, o, i, item, halves[0], 0)  # type: ignore[attr-defined]
    dw = planner._plan_for(o, t, i, item, halves[1], 1)  # type: ignore[attr-defined]
    assert dx.predicted_s >= (t * o + o * i) * item / (ps_Bps / 2)  # dY and W come down
    assert dw.predicted_s >= (o * t + t * i) * item / (ps_Bps / 2)  # dYᵀ and X
    # the pair's time, split or spread, is at least what both GEMMs bring down over the link
    _, predicted_s = planner._split_pair((t, o, i), item, slots)  # type: ignore[attr-defined]
    assert predicted_s >= (2 * t * o + o * i + t * i) * item / ps_Bps
