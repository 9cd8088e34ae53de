"""The tile planner: shapes, K split, sitting out, dealing."""

from __future__ import annotations

from testbed.ps_backend.planner import PlanDevice, deal_owners, k_slices, plan_gemm

INF = float("inf")


def test_weight_gradient_gemm_on_slow_links_is_k_split() -> None:
    # dW = dYᵀ X: contraction over 8192 tokens, a small 768 x 768 result; 15 phones at 10 MB/s
    phones = PlanDevice("phones", 9e9, 10e6, 10e6, 0.0, count=15)
    plan = plan_gemm(768, 8192, 768, 4, [phones])
    assert plan.k_parts > 1
    assert plan.used == ("phones",) and not plan.sat_out


def test_compute_bound_gemm_uses_every_device_and_no_k_split_when_links_are_free() -> None:
    fast = PlanDevice("fast", 10e9, INF, INF, count=4)
    plan = plan_gemm(256, 64, 256, 8, [fast], k_split=False)
    assert plan.k_parts == 1 and plan.tiles >= 4
    assert plan.tile_m * plan.grid[0] >= 256 and plan.tile_n * plan.grid[1] >= 256


def test_a_device_on_a_slow_link_sits_out() -> None:
    good = PlanDevice("laptops", 100e9, 100e6, 100e6, count=2)
    slow = PlanDevice("modem", 100e9, 10e3, 10e3, count=1)
    plan = plan_gemm(512, 512, 512, 4, [good, slow])
    assert plan.used == ("laptops",)
    assert plan.sat_out == {"modem": "link"}


def test_tile_size_limit_is_kept() -> None:
    d = PlanDevice("d", 1e9, INF, INF, count=1)
    plan = plan_gemm(1024, 64, 1024, 8, [d], max_tile_elems=128 * 128)
    assert plan.tile_m * plan.tile_n <= 128 * 128


def test_k_slices_cover_k_in_order() -> None:
    assert k_slices(10, 3) == [(0, 4), (4, 8), (8, 10)]


def test_deal_owners_contiguous_and_proportional() -> None:
    tiles = [(r, c, 0) for r in range(2) for c in range(4)]
    owners = deal_owners(tiles, {"a": 3.0, "b": 1.0})
    assert sorted(owners.values()).count("a") == 6 and list(owners.values()).count("b") == 2
    # a's run is the first six in (s, r, c) order: row 0 whole, so it gets A's row block once
    assert all(owners[(0, c, 0)] == "a" for c in range(4))
    assert deal_owners(tiles, {"a": 0.0}) == {}
