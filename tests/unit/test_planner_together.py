"""GEMMs submitted together (a backward pair spread over every device), predicted as one
stream of tiles a device."""

from __future__ import annotations

import dataclasses

from testbed.ps_backend.planner import (
    TILE_OVERHEAD_S,
    GemmPlan,
    PlanDevice,
    plan_gemm,
    predict_s,
    predict_together_s,
)

INF = float("inf")


def _one_tile(d: PlanDevice) -> GemmPlan:
    return GemmPlan(500, 500, 1, (1, 1, 1), (d.name,), counts={d.name: 1})


def test_the_next_gemms_blocks_come_down_while_the_first_result_goes_up() -> None:
    # 500 x 500 x 500 in float32: A, B and C 1 MB each; 1 MB/s each way, 1 ms of compute
    d = PlanDevice("d", 2 * 500 ** 3 / 1e-3, 1e6, 1e6, rtt_s=0.01)
    alone = predict_s(500, 500, 500, 4, (1, 1, 1), [d])
    # alone: A and B down (2 s), compute, C up (1 s), the tile's fixed cost, one round trip
    assert abs(alone - (2.0 + 1e-3 + 1.0 + TILE_OVERHEAD_S + 0.01)) < 1e-9
    both = predict_together_s([(500, 500, 500, _one_tile(d))] * 2, 4, [d])
    # the second GEMM's A and B follow the first's (down by 4 s) while the first C goes up;
    # then compute and its C: one fill and one drain fewer than the two apart
    assert abs(both - (4.0 + 1e-3 + 1.0 + 2 * TILE_OVERHEAD_S + 0.01)) < 1e-9
    assert both < 2 * alone


def test_one_gemm_alone_is_its_own_plans_prediction() -> None:
    classes = [PlanDevice("laptops", 300e9, 37.5e6, 12.5e6, 0.01, count=4),
               PlanDevice("phones", 20e9, 12.5e6, 2.5e6, 0.023, count=59)]  # pseudo-devices
    for m, k, n in [(2048, 256, 1024), (1024, 2048, 256), (512, 128, 512)]:
        plan = plan_gemm(m, k, n, 4, classes, 1.25e9, 1.25e9)
        got = predict_together_s([(m, k, n, plan)], 4, classes, 1.25e9, 1.25e9)
        assert abs(got - plan.predicted_s) <= 1e-12 * plan.predicted_s, (m, k, n)


def test_a_pair_spread_over_every_device_is_between_its_slower_gemm_and_their_sum() -> None:
    classes = [PlanDevice("laptops", 300e9, 37.5e6, 12.5e6, 0.01, count=4),
               PlanDevice("phones", 20e9, 12.5e6, 2.5e6, 0.023, count=59)]
    t, o, i = 2048, 1024, 256
    dx = plan_gemm(t, o, i, 4, classes, 1.25e9, 1.25e9)  # dX = dY · W
    dw = plan_gemm(o, t, i, 4, classes, 1.25e9, 1.25e9)  # dW = dYᵀ · X
    both = predict_together_s([(t, o, i, dx), (o, t, i, dw)], 4, classes, 1.25e9, 1.25e9)
    assert max(dx.predicted_s, dw.predicted_s) <= both < dx.predicted_s + dw.predicted_s
    # a class a plan leaves out adds nothing: the same GEMMs on classes with an extra one
    idle = dataclasses.replace(classes[1], name="idle")
    assert predict_together_s([(t, o, i, dx), (o, t, i, dw)], 4, [*classes, idle],
                              1.25e9, 1.25e9) == both
