"""A linear's forward and backward planned on one grid (planner.plan_layer): the owners, the
prediction, the step planner's choice, and the layer through the scheduler (backward finds
forward's W and X blocks cached, results bit-identical)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np

from testbed.ps_backend import planner
from testbed.ps_backend.planner import (
    PlanDevice,
    deal_layer,
    plan_gemm,
    plan_layer,
    predict_layer_s,
    predict_pair_s,
)
from testbed.ps_backend.scheduler import DeviceSlot, GemmJob, GemmSpec, Scheduler, Verdict
from testbed.ps_backend.step_plan import StepPlanner
from testbed.ps_backend.tiler import TileBox, cut_regions

TOKENS, OUT, IN = 96, 64, 32  # a layer this planner cuts on one grid for both passes
SLOW = PlanDevice("p", 10e9, 1e6, 1e6, count=3)  # 3 devices on 1 MB/s links


def test_a_layer_plan_gives_every_block_one_owner_in_both_passes() -> None:
    layer = plan_layer(TOKENS, OUT, IN, 8, [SLOW])
    assert layer is not None
    n_t, n_o, n_c = layer.pair.grid
    f_t, f_o, f_c = layer.fine
    assert layer.fine != (1, 1, 1)  # cut into parts: the case below checks their owners
    fwd, dx_plan, dw_plan = layer.forward, layer.pair.dx, layer.pair.dw
    # forward Y = X·Wᵀ on the same cube: rows are token parts, columns output parts, and the
    # K split runs over the input blocks, each a run of f_c parts; dX's K over the output
    # blocks, dW's over the token blocks
    assert fwd.grid == (n_t * f_t, n_o * f_o, n_c) and fwd.k_parts == n_c
    assert dx_plan.grid == (n_t * f_t, n_c * f_c, n_o)
    assert dw_plan.grid == (n_o * f_o, n_c * f_c, n_t)
    assert fwd.tile_m == dx_plan.tile_m and fwd.tile_n == dw_plan.tile_m
    assert dx_plan.tile_n == dw_plan.tile_n
    devices = [PlanDevice(f"d{j}", 10e9 * (1 + j), 1e6, 1e6) for j in range(3)]
    forward, dx, dw = deal_layer(layer, TOKENS, OUT, IN, 8, devices)
    assert (len(forward), len(dx), len(dw)) == (math.prod(fwd.grid), math.prod(dx_plan.grid),
                                                math.prod(dw_plan.grid))
    # a part's tiles in every pass go to its block's owner
    for (tf, of, cb), owner in forward.items():
        for cf in range(cb * f_c, (cb + 1) * f_c):
            assert dx[(tf, cf, of // f_o)] == owner and dw[(of, cf, tf // f_t)] == owner
    assert len(set(forward.values())) == 3


def test_holding_forward_blocks_makes_the_backward_cheaper_than_the_pair_alone() -> None:
    for grid in [(3, 2, 1), (2, 2, 2), (6, 1, 2)]:
        _, backward = predict_layer_s(TOKENS, OUT, IN, 8, grid, [SLOW])
        # the pair alone receives W and X again
        assert backward < predict_pair_s(TOKENS, OUT, IN, 8, grid, [SLOW])


def test_a_layer_floor_is_under_its_prediction_and_pruning_changes_nothing(monkeypatch) -> None:
    # fleets of a few devices, where predicting every grid takes seconds (with 15 phones and a
    # 20-device mix it took 36 s); test_planner's floor-cut test covers fleets of hundreds.
    # The mix is one where both classes take part
    cases = [(TOKENS, OUT, IN, [SLOW]), (8192, 3072, 768, [PlanDevice("ph", 20e9, 10e6, 10e6,
                                                              count=6)]),
             (4096, 768, 3072, [PlanDevice("l", 60e9, 50e6, 50e6, 0.004, count=2),
                                PlanDevice("ph", 20e9, 25e6, 12.5e6, 0.01, count=4)])]
    pruned = [plan_layer(t, o, i, 4, classes, 1.25e8, 1.25e8) for t, o, i, classes in cases]
    monkeypatch.setattr(planner, "_floor_s", lambda *args: 0.0)  # every grid predicted
    monkeypatch.setattr(planner, "_cube_floor_s", lambda *args, **kwargs: 0.0)
    full = [plan_layer(t, o, i, 4, classes, 1.25e8, 1.25e8) for t, o, i, classes in cases]
    assert pruned == full
    assert pruned[2].forward.used == pruned[2].pair.used == ("l", "ph")


def _config(cache: int) -> tuple[StepPlanner, list[DeviceSlot]]:
    config = SimpleNamespace(planner="auto", planned_groups=[("p", 3, 10.0)],
                             group_links={"p": (1e6, 1e6, 0.0)}, plan_links={},
                             fair_share_paths={},
                             ps_link_Bps=(float("inf"), float("inf")), group_paths={},
                             shared_down_Bps={},
                             max_message_bytes=64 << 20, tile_m=256, tile_n=256)
    slots = [DeviceSlot(f"d{j}", f"p-{j}", 10.0, 4, cache, group="p") for j in range(3)]
    return StepPlanner(config), slots


def _layer_jobs(seed: int = 3) -> tuple[list[GemmJob], dict[str, np.ndarray]]:
    """Forward Y = X·Wᵀ, then dX = dY·W and dW = dYᵀ·X, named as the executor names them."""
    rng = np.random.default_rng(seed)
    x, w, dy = (rng.standard_normal(s) for s in ((TOKENS, IN), (OUT, IN), (TOKENS, OUT)))
    fwd = GemmJob(uid="fwd", spec=GemmSpec("l", "forward", 0, "W@0"), a=x, b=w.T,
                  c=np.empty((TOKENS, OUT)), version=0, a_key="X", b_key="W@0",
                  b_transposed=True)
    dx = GemmJob(uid="dx", spec=GemmSpec("l", "input_grad", 0, "W@0"), a=dy, b=w,
                 c=np.empty((TOKENS, IN)), version=0, a_key="dY", b_key="W@0")
    dw = GemmJob(uid="dw", spec=GemmSpec("l", "weight_grad", 0), a=dy.T, b=x,
                 c=np.empty((OUT, IN)), version=0, a_key="dY", b_key="X", a_transposed=True)
    return [fwd, dx, dw], {"x": x, "w": w, "dy": dy}


def test_the_step_planner_keeps_a_layers_grid_for_its_backward() -> None:
    planner_, slots = _config(64 << 20)
    (fwd, dx, dw), _ = _layer_jobs()
    cuts = planner_.plan(fwd, slots), planner_.plan(dx, slots), planner_.plan(dw, slots)
    assert all(c.owners is not None and len(c.regions) == 1 for c in cuts)
    (f,), (x,), (w,) = (c.regions for c in cuts)
    owners = [c.owners or {} for c in cuts]
    # forward (tm, to, n_c), dX (tm, tc, n_o), dW (to, tc, n_t) on one grid (n_t, n_o, n_c),
    # each K slice a run of parts as long as the other passes' tiles: forward's K parts are
    # dX's and dW's columns, dX's K parts forward's columns, dW's forward's rows
    assert (f.tile_m, f.tile_n) == (x.tile_m, w.tile_m) and x.tile_n == w.tile_n
    assert (f.k_block or -(-IN // f.k_parts)) == x.tile_n
    assert (x.k_block or -(-OUT // x.k_parts)) == f.tile_n
    assert (w.k_block or -(-TOKENS // w.k_parts)) == f.tile_m
    # every tile of a block's parts, in every pass, goes to the block's owner: a dX tile
    # whose K slice (output columns) covers a forward tile's columns and whose columns lie in
    # its K slice (input columns), on the same token rows; likewise dW's
    def k_of(b: TileBox, k: int) -> tuple[int, int]:
        return (b.k0, b.k1) if b.split else (0, k)

    fwd_boxes = cut_regions(OUT, IN, (f,))
    checked = 0
    for fb in fwd_boxes:
        owner = owners[0][(fb.row, fb.col, fb.part)]
        fk0, fk1 = k_of(fb, IN)
        for xb in cut_regions(IN, OUT, (x,)):
            xk0, xk1 = k_of(xb, OUT)
            if (xb.r0, xb.r1) == (fb.r0, fb.r1) and fk0 <= xb.c0 < fk1 and xk0 <= fb.c0 < xk1:
                assert owners[1][(xb.row, xb.col, xb.part)] == owner
                checked += 1
        for wb in cut_regions(IN, TOKENS, (w,)):
            wk0, wk1 = k_of(wb, TOKENS)
            if (wb.r0, wb.r1) == (fb.c0, fb.c1) and fk0 <= wb.c0 < fk1 and wk0 <= fb.r0 < wk1:
                assert owners[2][(wb.row, wb.col, wb.part)] == owner
                checked += 1
    assert checked >= 2 * len(fwd_boxes)
    # caches too small to hold a layer's blocks for its backward: forward plans on its own
    small, slots = _config(4096)
    (g,) = small.plan(fwd, slots).regions
    assert (g.tile_m, g.tile_n, g.k_parts) == (lambda p: (p.tile_m, p.tile_n, p.k_parts))(
        plan_gemm(TOKENS, IN, OUT, 8, [SLOW], max_tile_elems=small._max_tile_elems(8)))


def _run_layer(order_seed: int) -> tuple[list[np.ndarray], set[str]]:
    """The layer through the scheduler with the step planner's plans, results in a shuffled
    order: (Y, dX, dW; the blocks the backward sent)."""
    planner_, slots = _config(64 << 20)
    jobs, m = _layer_jobs()
    s = Scheduler()
    for slot in slots:
        s.add_device(slot)
    rng = random.Random(order_seed)
    backward_sent: set[str] = set()
    parts = 0
    for batch in (jobs[:1], jobs[1:]):
        for job in batch:
            cut = planner_.plan(job, slots)
            s.submit(job, cut.regions, owners=cut.owners, held=cut.held)
            parts = max(parts, *(g.k_block for g in cut.regions))
        while any(job.remaining for job in batch):
            out = [(d, a) for d in list(s.devices) for a in s.assign(d)]
            assert out
            rng.shuffle(out)
            for d, a in out:
                task = a.task
                if task.job.spec.op != "forward":
                    backward_sent.update(key for (key, _), sent in zip(task.blocks, a.send)
                                         if sent)
                assert s.accept(d, task.task_id, task.attempt,
                                task.a_block() @ task.b_block()).verdict is Verdict.ACCEPTED
    x, w, dy = m["x"], m["w"], m["dy"]
    for job, want in zip(jobs, (x @ w.T, dy @ w, dy.T @ x)):
        np.testing.assert_allclose(job.c, want, rtol=1e-12, atol=1e-12)
    assert parts, "the plan cuts no K slice into parts: the case this checks"
    return [job.c.copy() for job in jobs], backward_sent


def test_a_layer_through_the_scheduler_sends_only_dy_backward_and_is_bit_identical() -> None:
    results, sent = _run_layer(0)
    assert sent and all(key.startswith("dY/") for key in sent), sent
    for seed in (1, 2):
        again, _ = _run_layer(seed)
        assert all(np.array_equal(a, b) for a, b in zip(results, again))
