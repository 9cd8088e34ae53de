"""The step bound on shapes whose optimum is known by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from testbed.ps_backend.bound import (
    BoundDevice,
    BoundGemm,
    PsLink,
    SwitchLink,
    comm_min_accessed,
    comm_min_bytes,
    comm_min_point,
    comm_min_shares,
    entry_yield,
    group_stages,
    stage_bound,
    stage_key,
    step_bound,
)

INF = float("inf")


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_comm_min_three_cases_match_hand_optima() -> None:
    # cube n^3 on p = 8: no cap binds, each device accesses 3 (n^3/8)^(2/3) = 3 n^2/4
    n = 64
    assert close(comm_min_accessed(n, n, n, 8), 3 * n * n / 4)
    # one device: it touches every matrix whole
    assert close(comm_min_accessed(n, n, n, 1), 3 * n * n)
    # one large dimension (k = 4096, m = n = 8) on p = 2: A and B halves, C whole
    m, k, n2 = 8, 4096, 8
    assert close(comm_min_accessed(m, k, n2, 2), m * n2 + (m * k + k * n2) / 2)
    # two large dimensions (m = n = 1024, k = 4) on p = 16: B and A capped? no: the smallest
    # matrices are A and B (4096 each); C = 1M: balanced point (1024*1024*4/16)^(2/3) = 4096
    assert close(comm_min_accessed(1024, 4, 1024, 16), 3 * 4096)
    with pytest.raises(ValueError):
        comm_min_accessed(0, 1, 1, 1)


def test_comm_min_bytes_down_up_and_total() -> None:
    down, up, total = comm_min_bytes(8, 4096, 8, 2, 4)
    assert down == (8 * 4096 * 2) * 4 and up == 64 * 4
    assert total == pytest.approx(2 * comm_min_accessed(8, 4096, 8, 2) * 4)


def test_comm_min_point_per_share_and_cases() -> None:
    n = 64
    # a cube's 1/8 share: every part (n^3/8)^(2/3) = n^2/4
    assert all(close(x, n * n / 4) for x in comm_min_point(n, n, n, n ** 3 / 8))
    # one device doing it all touches each matrix whole
    assert comm_min_point(8, 16, 32, 8 * 16 * 32) == (8 * 16, 16 * 32, 8 * 32)
    # one large dimension: C (8 x 8) is the smallest, capped; A and B split the rest evenly
    a, b, c = comm_min_point(8, 4096, 8, 8 * 4096 * 8 / 2)
    assert c == 64 and close(a, 8 * 4096 / 2) and close(b, 8 * 4096 / 2)
    assert comm_min_point(8, 8, 8, 0) == (0.0, 0.0, 0.0)


def test_comm_min_shares_sum_over_devices_and_floor_at_once() -> None:
    # 16 equal shares of a 1024 x 4 x 1024 product: each 4096 of A, B and C (two large dims)
    down, up = comm_min_shares(1024, 4, 1024, [1024 * 4 * 1024 / 16] * 16, 4)
    assert close(down, 16 * 2 * 4096 * 4) and close(up, 1024 * 1024 * 4)
    # one device: each operand once, the result once
    assert comm_min_shares(8, 16, 32, [8 * 16 * 32], 8) == ((8 * 16 + 16 * 32) * 8, 8 * 32 * 8)
    # more devices never need less traffic than fewer with the same total work
    few = comm_min_shares(512, 512, 512, [512 ** 3 / 2] * 2, 4)
    many = comm_min_shares(512, 512, 512, [512 ** 3 / 8] * 8, 4)
    assert many[0] + many[1] > few[0] + few[1]


def test_compute_bound_gemm_one_device() -> None:
    # infinite links: the bound is exactly FLOPs / rate
    g = BoundGemm(100, 200, 300, 8, "s")
    dev = BoundDevice("d", 1e9, INF, INF)
    sb = stage_bound([g], [dev], PsLink(), set())
    assert close(sb.bound_s, 2 * 100 * 200 * 300 / 1e9, 1e-6)


def test_link_bound_one_device_must_receive_both_operands() -> None:
    # infinitely fast compute, 1 MB/s each way: it must receive A and B and send C
    m, k, n, s = 64, 64, 64, 8
    dev = BoundDevice("d", INF, 1e6, 1e6, rtt_s=0.01)
    sb = stage_bound([BoundGemm(m, k, n, s, "s")], [dev], PsLink(), set())
    expected = max((m * k + k * n) * s, m * n * s) / 1e6 + 0.01
    assert close(sb.bound_s, expected, 1e-6)


def test_two_equal_devices_halve_the_link_term() -> None:
    m = k = n = 128
    s = 4
    devs = [BoundDevice(f"d{i}", INF, 1e6, INF) for i in range(2)]
    sb = stage_bound([BoundGemm(m, k, n, s, "s")], devs, PsLink(), set())
    # the aggregate down term: (|A| + |B|) over 2 MB/s; per-device LW allows no better
    assert sb.bound_s >= (m * k + k * n) * s / 2e6 * (1 - 1e-9)
    # and no worse than one device alone
    one = stage_bound([BoundGemm(m, k, n, s, "s")], devs[:1], PsLink(), set())
    assert sb.bound_s < one.bound_s


def test_held_operand_is_not_traffic_and_the_ps_link_counts() -> None:
    g = BoundGemm(64, 64, 64, 8, "s", a_name="X", b_name="W")
    devs = [BoundDevice("d", INF, 1e6, INF)]
    fresh = stage_bound([g], devs, PsLink(), set())
    held = stage_bound([g], devs, PsLink(), {"W"})
    assert close(fresh.terms["down"], 2 * 64 * 64 * 8 / 1e6)
    assert close(held.terms["down"], 64 * 64 * 8 / 1e6)
    slow_ps = stage_bound([g], [BoundDevice("d", INF, INF, INF)], PsLink(1e5, INF), set())
    assert close(slow_ps.bound_s, 2 * 64 * 64 * 8 / 1e5)


def test_step_sums_stages_and_shared_inputs_count_once() -> None:
    dev = [BoundDevice("d", 1e9, INF, INF, rtt_s=0.5)]
    fwd = [BoundGemm(32, 32, 32, 8, stage_key(f"l.{p}", "forward"), a_name="x")
           for p in ("qkv_proj", "fc1")]
    pair = [BoundGemm(32, 32, 32, 8, stage_key("l.fc1", op), a_name="dy", b_name=b)
            for op, b in (("input_grad", "w"), ("weight_grad", "x"))]
    sb = step_bound([*fwd, *pair], dev)
    assert [len(g) for g in group_stages([*fwd, *pair])] == [1, 1, 2] and len(sb.stages) == 3
    flops = 2 * 32 ** 3
    assert close(sb.bound_s, 3 * 0.5 + 4 * flops / 1e9)
    # A shared operand counts once: on a slow downlink the pair moves dY, W and X.
    slow = [BoundDevice("d", INF, 1e6, INF)]
    assert close(step_bound(pair, slow).bound_s, 3 * 32 * 32 * 8 / 1e6)


def test_no_devices_is_infinite() -> None:
    assert math.isinf(stage_bound([BoundGemm(2, 2, 2, 8, "s")], [], PsLink(), set()).bound_s)


def test_vectorised_capacity_equals_the_per_device_sum() -> None:
    import random

    from testbed.ps_backend.bound import _DeviceArrays, device_capacity, total_capacity

    rng = random.Random(5)
    for _ in range(200):
        g = BoundGemm(rng.randint(1, 4096), rng.randint(1, 4096), rng.randint(1, 4096),
                      rng.choice([2, 4]), "s")
        devs = [BoundDevice(f"d{i}", 10 ** rng.uniform(8, 12), 10 ** rng.uniform(4, 9),
                            10 ** rng.uniform(4, 9), rng.choice([0.0, 10 ** rng.uniform(-4, 1)]))
                for i in range(rng.randint(1, 30))]
        w = 10 ** rng.uniform(-5, 2)
        for held_a in (False, True):
            for held_b in (False, True):
                # each device in its own window: the stage less its round trip
                each = sum(device_capacity(g, d, max(w - d.rtt_s, 0.0), held_a, held_b)
                           for d in devs)
                assert total_capacity(g, _DeviceArrays.of(devs), w, held_a, held_b) == \
                    pytest.approx(each, rel=1e-9)


def test_fill_counts_each_device_from_its_round_trip_on() -> None:
    import numpy as np

    from testbed.ps_backend.bound import fill_s

    rates, rtts = np.array([1.0, 1.0]), np.array([0.0, 1.0])
    assert close(fill_s(0.5, rates, rtts), 0.5)  # done before the second one's window opens
    assert close(fill_s(3.0, rates, rtts), 2.0)  # 1 alone until t = 1, then 2 per second
    assert fill_s(0.0, rates, rtts) == 0.0
    assert fill_s(10.0, np.array([1.0, INF]), np.array([0.0, 2.0])) == 2.0
    assert fill_s(10.0, np.array([1.0, INF]), np.array([0.0, 20.0])) == 10.0
    assert fill_s(1.0, np.array([0.0]), np.array([0.0])) == INF


def test_a_device_whose_round_trip_outlasts_the_stage_does_not_help() -> None:
    """Two equal devices, one 100 s away: the stage is what the near one takes alone (its
    round trip and its transfers), not half of it."""
    m = k = n = 64
    s = 8
    g = BoundGemm(m, k, n, s, "s")
    near = BoundDevice("near", INF, 1e6, 1e6, rtt_s=0.01)
    far = BoundDevice("far", INF, 1e6, 1e6, rtt_s=100.0)
    alone = stage_bound([g], [near], PsLink(), set())
    assert close(alone.bound_s, (m * k + k * n) * s / 1e6 + 0.01)
    both = stage_bound([g], [near, far], PsLink(), set())
    assert close(both.bound_s, alone.bound_s)
    # the same far device 10 ms away halves the transfers again
    close_by = stage_bound([g], [near, BoundDevice("f", INF, 1e6, 1e6, rtt_s=0.01)], PsLink(),
                           set())
    assert close_by.bound_s < 0.75 * alone.bound_s


def test_a_floating_gemm_counts_only_in_the_last_stage() -> None:
    """A weight gradient may run on with every later stage: the sum of the stages' bounds
    charges it nowhere but in the last stage (with nothing after it to hide in)."""
    from testbed.ps_backend.bound import floats

    assert floats("weight_grad") and not floats("input_grad") and not floats("forward")
    dev = [BoundDevice("d", 1e9, INF, INF, rtt_s=0.5)]
    flops = 2 * 32 ** 3

    def pair(layer: str) -> list[BoundGemm]:
        return [BoundGemm(32, 32, 32, 8, stage_key(layer, op), floating=floats(op))
                for op in ("input_grad", "weight_grad")]
    sb = step_bound([*pair("l.1"), *pair("l.0")], dev)
    assert [s.gemms for s in sb.stages] == [1, 2]  # l.1's dW floats, l.0's is the last stage
    assert close(sb.bound_s, 2 * 0.5 + 3 * flops / 1e9)
    alone = step_bound(pair("l.0"), dev)  # one pair: the last stage, both GEMMs
    assert close(alone.bound_s, 0.5 + 2 * flops / 1e9)


def test_devices_below_a_switch_link_move_no_more_than_it_carries() -> None:
    # 4 devices with 1 MB/s down each below one 1 MB/s access point: the stage's 2 MB of
    # operands take 2 s (not 0.5 s as four own links); a device beside it adds its own 1 MB/s
    s, dev_Bps = 8, 1e6
    g = BoundGemm(250, 500, 250, s, "s")  # A, B 1 MB each; C 0.5 MB
    below = [BoundDevice(f"p{i}", INF, dev_Bps, INF, 0.0, "ap") for i in range(4)]
    links = {"ap": SwitchLink(dev_Bps, INF)}
    free = stage_bound([g], below, PsLink(), set())
    capped = stage_bound([g], below, PsLink(), set(), links=links)
    assert close(free.terms["down"], 0.5) and close(capped.terms["down"], 2.0)
    beside = BoundDevice("laptop", INF, dev_Bps, INF)
    assert close(stage_bound([g], [*below, beside], PsLink(), set(), links=links)
                 .terms["down"], 1.0)
    # a name the links do not know caps nothing
    lost = [BoundDevice(f"p{i}", INF, dev_Bps, INF, 0.0, "elsewhere") for i in range(4)]
    assert stage_bound([g], lost, PsLink(), set(), links=links).terms == free.terms


def test_switch_links_nest_and_the_lowest_cap_binds_first() -> None:
    # two access points of 1 MB/s up, two devices of 1 MB/s up below each, both below a core
    # link of 1.5 MB/s up: 3 MB of results take 2 s; without the core link 1.5 s
    s = 8
    g = BoundGemm(375, 1, 1000, s, "s", "A", "B")  # C 3 MB; A and B held
    devs = [BoundDevice(f"{ap}-{i}", INF, INF, 1e6, 0.0, ap) for ap in ("ap0", "ap1")
            for i in range(2)]
    aps = {"ap0": SwitchLink(INF, 1e6, "core"), "ap1": SwitchLink(INF, 1e6, "core")}
    held = {"A", "B"}
    two_aps = stage_bound([g], devs, PsLink(), held, links={**aps, "core":
                                                              SwitchLink(INF, INF)})
    assert close(two_aps.terms["up"], 1.5)
    core = stage_bound([g], devs, PsLink(), held, links={**aps, "core": SwitchLink(INF, 1.5e6)})
    assert close(core.terms["up"], 2.0)
    # each device from its own round trip on, each link from the shortest below it
    late = [BoundDevice(d.name, INF, INF, 1e6, 0.5 if d.name.endswith("1") else 0.1, d.link)
            for d in devs]
    # ap0 and ap1 each: one device from 0.1 s, then both capped at 1 MB/s: by T, 1.5 MB each
    # once T - 0.1 >= 1.5 (the first alone carries 1 MB/s from 0.1): T = 1.6
    assert close(stage_bound([g], late, PsLink(), held, links=aps).terms["up"], 1.6, 1e-6)


def test_what_devices_receive_through_a_shared_link_caps_their_products() -> None:
    # C[100 x 100] = A·B, k = 100, 4 bytes an entry. Four devices, each with 10k entries/s down
    # and 1k up, below one access point that carries 10k entries/s down. Every device receives
    # its own copy of what it uses (no multicast), so through the access point they get 10k·T
    # entries together, and an entry received yields at most sqrt(c)/2 products, c <= 1k·T the
    # results a device can send: 10k·T · sqrt(1000·T)/2 >= 100³ at T = 6.325^(2/3) = 3.420 s.
    # Each device on a link of its own: a result entry sums at most k = 100 products, so
    # 4 · 1000·T · 100 >= 100³ at T = 2.5 s (sqrt((5k·T)² · 1000·T) alone would allow 1.357).
    s = 4
    g = BoundGemm(100, 100, 100, s, "s")
    devs = [BoundDevice(f"p{i}", INF, 10e3 * s, 1e3 * s, 0.0, "ap") for i in range(4)]
    own = stage_bound([g], devs, PsLink(), set())
    assert close(own.terms["gemm0"], 2.5)
    shared = stage_bound([g], devs, PsLink(), set(), links={"ap": SwitchLink(10e3 * s, INF)})
    assert close(shared.terms["gemm0"], (200 / math.sqrt(1e3)) ** (2 / 3))
    # the distinct bytes alone (the down term) would allow 2 s, the results (up) 2.5 s
    assert close(shared.terms["down"], 2.0) and close(shared.terms["up"], 2.5)
    assert shared.limit == "gemm0"
    # the PS link carries every device's copy the same way
    behind_ps = stage_bound([g], devs, PsLink(10e3 * s, INF), set())
    assert close(behind_ps.terms["gemm0"], shared.terms["gemm0"])
    # a link that carries as much as its devices together caps nothing
    wide = stage_bound([g], devs, PsLink(40e3 * s, INF), set(),
                       links={"ap": SwitchLink(40e3 * s, 4e3 * s)})
    assert close(wide.terms["gemm0"], own.terms["gemm0"])


def test_a_held_operand_lets_each_received_entry_yield_a_row_of_products() -> None:
    # B held: only A travels, and an entry of A is in n products. Four devices below a link of
    # 200 entries/s: 1000 x 10 x 10 multiply-adds need 1e4 entries of A, 50 s through it.
    s = 4
    g = BoundGemm(1000, 10, 10, s, "s", "", "W")
    devs = [BoundDevice(f"p{i}", INF, 400 * s, INF, 0.0, "ap") for i in range(4)]
    capped = stage_bound([g], devs, PsLink(), {"W"}, links={"ap": SwitchLink(200 * s, INF)})
    assert close(capped.terms["gemm0"], 50.0)
    # the yield per entry: n with B held, m with A held, sqrt(c)/2 (at most mn/(m + n)) with
    # neither, unbounded with both
    c = np.array([0.0, 16.0, 1e12])
    assert list(entry_yield(g, c, False, True)) == [10.0] * 3
    assert list(entry_yield(g, c, True, False)) == [1000.0] * 3
    assert list(entry_yield(g, c, False, False)) == [0.0, 2.0, 1000 * 10 / 1010]
    assert np.isinf(entry_yield(g, c, True, True)).all()


def test_links_only_lower_what_the_devices_can_do() -> None:
    import random

    from testbed.ps_backend.bound import _DeviceArrays, total_capacity

    rng = random.Random(11)
    for _ in range(200):
        g = BoundGemm(rng.randint(1, 4096), rng.randint(1, 4096), rng.randint(1, 4096), 4, "s")
        devs = [BoundDevice(f"d{i}", 10 ** rng.uniform(8, 12), 10 ** rng.uniform(4, 9),
                            10 ** rng.uniform(4, 9), rng.choice([0.0, 10 ** rng.uniform(-4, 0)]),
                            rng.choice(["", "ap0", "ap1"]))
                for i in range(rng.randint(1, 30))]
        links = {"ap0": SwitchLink(10 ** rng.uniform(4, 10), 10 ** rng.uniform(4, 10), "core"),
                 "ap1": SwitchLink(10 ** rng.uniform(4, 10), 10 ** rng.uniform(4, 10)),
                 "core": SwitchLink(10 ** rng.uniform(4, 10), 10 ** rng.uniform(4, 10))}
        ps = PsLink(10 ** rng.uniform(4, 10), 10 ** rng.uniform(4, 10))
        w = 10 ** rng.uniform(-4, 1)
        for held_a in (False, True):
            for held_b in (False, True):
                free = total_capacity(g, _DeviceArrays.of(devs), w, held_a, held_b)
                capped = total_capacity(g, _DeviceArrays.of(devs, links), w, held_a, held_b, ps)
                assert 0.0 <= capped <= free * (1 + 1e-12)
                wide = {n: SwitchLink(INF, INF, link.parent) for n, link in links.items()}
                assert total_capacity(g, _DeviceArrays.of(devs, wide), w, held_a, held_b,
                                      PsLink()) == pytest.approx(free, rel=1e-12)
