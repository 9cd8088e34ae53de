"""Flow-level network: max-min fair sharing on hand-checkable cases."""

from __future__ import annotations

import math
import random

import pytest

from testbed.simulate.network import FlowNetwork, max_min_rates

MB = 1e6


def test_one_flow_per_link_gets_the_link_rate() -> None:
    rates = max_min_rates([[0], [1]], [10 * MB, 3 * MB])
    assert rates == pytest.approx([10 * MB, 3 * MB], rel=1e-12)


def test_two_flows_sharing_a_bottleneck_split_it() -> None:
    # both cross their own fast device link and one shared 8 MB/s link
    rates = max_min_rates([[0, 2], [1, 2]], [100 * MB, 100 * MB, 8 * MB])
    assert rates == pytest.approx([4 * MB, 4 * MB], rel=1e-12)


def test_a_flow_limited_elsewhere_leaves_the_rest_to_the_other() -> None:
    # flow 0's own link gives it 2 MB/s; the shared 10 MB/s link leaves 8 to flow 1
    rates = max_min_rates([[0, 2], [1, 2]], [2 * MB, 100 * MB, 10 * MB])
    assert rates == pytest.approx([2 * MB, 8 * MB], rel=1e-12)


def test_unlimited_path_is_infinite_and_three_levels() -> None:
    # link 0: 3 flows share 6 -> 2 each... but flow 2 also crosses link 1 (1 MB/s) -> 1;
    # the other two split the 5 left: 2.5 each
    rates = max_min_rates([[0], [0], [0, 1], [2]], [6 * MB, 1 * MB, math.inf])
    assert rates[:3] == pytest.approx([2.5 * MB, 2.5 * MB, 1 * MB], rel=1e-12)
    assert math.isinf(rates[3])


def test_network_times_with_delay_and_departure() -> None:
    net = FlowNetwork()
    shared = net.add_link(10 * MB)
    a = net.start(10 * MB, [shared], delay_s=0.5, tag="a")
    net.start(5 * MB, [shared], tag="b")
    # both at 5 MB/s: b's last byte leaves at 1 s; then a alone at 10 MB/s: 5 MB more in 0.5 s
    t = net.next_drain_s()
    assert t == pytest.approx(1.0)
    done = net.advance(t)
    assert [(f.tag, at) for f, at in done] == [("b", pytest.approx(1.0))]
    assert a.left_bytes == pytest.approx(5 * MB)
    t = net.next_drain_s()
    assert t == pytest.approx(1.5)
    done = net.advance(t)
    assert [(f.tag, at) for f, at in done] == [("a", pytest.approx(2.0))]  # + 0.5 s delay


def test_zero_capacity_stalls_until_restored() -> None:
    net = FlowNetwork()
    link = net.add_link(1 * MB)
    net.start(1 * MB, [link])
    net.set_capacity(link, 0.0)
    assert math.isinf(net.next_drain_s())
    net.advance(3.0)
    net.set_capacity(link, 1 * MB)
    assert net.next_drain_s() == pytest.approx(4.0)


def test_network_rows_follow_a_plain_reference_through_random_events() -> None:
    """Flows kept as array rows (reused, paths of any length) move as a per-flow walk does:
    at every event each flow's rate is max_min_rates of the flows present, bytes drain at
    those rates, and flows drain in start order with their delay."""
    rng = random.Random(7)
    net = FlowNetwork()
    caps = [rng.choice([1, 2, 5, 10, math.inf]) * MB for _ in range(12)]
    for c in caps:
        net.add_link(c)
    ref: dict[int, list] = {}  # flow id -> [path, bytes left, delay, size]
    drained_total = 0
    for _ in range(400):
        r = rng.random()
        if r < 0.45 or not ref:
            path = rng.sample(range(12), rng.randint(1, 6))  # wider than the first rows
            size = rng.uniform(0.1, 3) * MB
            # twins (same path, same size) drain at the same moment: in start order, whatever
            # rows they were given
            for _ in range(2 if rng.random() < 0.3 else 1):
                f = net.start(size, path, delay_s=rng.choice([0, 0.01]))
                ref[f.flow_id] = [path, f.nbytes, f.delay_s, f.nbytes]
        elif r < 0.55:
            fid = rng.choice(list(ref))
            net.cancel(fid)
            del ref[fid]
        elif r < 0.6:
            link = rng.randrange(12)
            caps[link] = rng.choice([0, 1, 3]) * MB
            net.set_capacity(link, caps[link])
        ids = list(ref)
        want = max_min_rates([ref[i][0] for i in ids], caps)
        got = [net.flows[i].rate_Bps for i in ids]
        assert got == pytest.approx(list(want), rel=1e-9)
        t = net.next_drain_s()
        if math.isinf(t):
            continue
        to = net.now_s + (t - net.now_s) * rng.choice([0.5, 1.0])
        dt = to - net.now_s
        for i, w in zip(ids, want):
            ref[i][1] = 0.0 if math.isinf(w) else ref[i][1] - w * dt
        done = net.advance(to)
        expect = [i for i in ids if ref[i][1] <= 1e-6 + 1e-9 * ref[i][3]]
        assert [f.flow_id for f, _ in done] == expect
        for f, at in done:
            assert at == pytest.approx(to + ref[f.flow_id][2])
            del ref[f.flow_id]
        drained_total += len(done)
        for i in ref:
            assert net.flows[i].left_bytes == pytest.approx(ref[i][1], rel=1e-9, abs=1e-3)
    assert drained_total > 50 and len(net.flows) == len(ref)


def test_a_flow_drains_late_in_a_long_run() -> None:
    # hours into a run the clock's step is ~1 ps: what a flow has left after an advance may be
    # less than one step's worth, and it must still drain (a simulation once hung there)
    for i in range(500):
        net = FlowNetwork()
        link = net.add_link(10 * MB)
        net.advance(4096.0 + i * 0.37)
        net.start(1000.0 + i * 7.3, [link])
        drained = []
        for _ in range(3):
            drained = net.advance(net.next_drain_s())
            if drained:
                break
        assert len(drained) == 1, i
        assert drained[0][1] == pytest.approx(4096.0 + i * 0.37 + (1000.0 + i * 7.3) / (10 * MB),
                                              rel=1e-12)
