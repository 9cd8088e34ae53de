"""The link check's rate over a window anchored where the measured flow began."""

from __future__ import annotations

import pytest

from testbed.emulator.network.check import (
    QUIET_S,
    START_S,
    Row,
    device_estimate_s,
    format_device,
    measurement_window_s,
    window_rate_bps,
)
from testbed.topology import parse_topology


def counter(rate_bps: float, begins_s: float, trickle_bps: float = 0.0, until_s: float = 12.0,
            every_s: float = 0.1) -> list[tuple[float, int]]:
    """Samples of a byte counter: a trickle, then a flow at rate_bps from begins_s."""
    samples, total, t = [], 0.0, 0.0
    while t <= until_s:
        samples.append((t, int(total)))
        total += (rate_bps if t >= begins_s else trickle_bps) * every_s / 8
        t = round(t + every_s, 9)
    return samples


def test_the_window_starts_where_the_flow_began_not_where_sampling_did():
    # a previous flow's ACKs trickle in for 3 s before this flow gets through
    samples = counter(1e6, begins_s=3.0, trickle_bps=20e3)
    assert window_rate_bps(samples, 2, 5, 1e6) == pytest.approx(1e6, rel=1e-3)
    # anchored at the first sample it would have measured partly the trickle
    assert window_rate_bps(samples[:1] + samples, 0, 5, 1e9) < 0.5e6


def test_a_flow_that_never_reaches_a_quarter_of_the_rate_is_measured_as_it_is():
    samples = counter(0.2e6, begins_s=0.0)
    assert window_rate_bps(samples, 1, 3, 1e6) == pytest.approx(0.2e6, rel=1e-3)


def test_no_samples_in_the_window_is_an_error_not_a_figure():
    with pytest.raises(RuntimeError, match="window"):
        window_rate_bps(counter(1e6, begins_s=0.0, until_s=2.0), 3, 3, 1e6)
    with pytest.raises(RuntimeError, match="too few"):
        window_rate_bps([(0.0, 0)], 1, 3, 1e6)


def slow_links_topology():
    """p: 1 Mbit down behind a 100-packet queue, 100 Mbit up; q: 1 Mbit each way, 5 ms."""
    return parse_topology({
        "name": "w", "network": {"backend": "mininet", "switches": ["s"],
                                 "ps": {"switch": "s", "link": {"down": "1Gbit", "up": "1Gbit"}}},
        "devices": [{"group": "p", "profile": "snapdragon888", "count": 1, "switch": "s",
                     "link": {"down": "1Mbit", "up": "100Mbit", "queue": 100}},
                    {"group": "q", "profile": "snapdragon888", "count": 1, "switch": "s",
                     "link": {"down": "1Mbit", "up": "1Mbit", "delay": "5ms"}}],
        "job": {"model": {"hidden": 64, "layers": 1, "heads": 1, "ffn": 64, "seq_len": 16}}})


def test_slow_paths_skip_and_measure_longer():
    topo = slow_links_topology()
    p, q = topo.devices
    # 100 frames of 1514 bytes drain in 1.21 s at 1 Mbit/s: skip 3 s, measure 5 s, and 20
    # lumps of 64 KB at 1 Mbit/s take 10.5 s: measure 11
    assert measurement_window_s(topo, p, "down", 3) == (3, 11)
    assert measurement_window_s(topo, p, "up", 3) == (1, 3)
    # no queue given: Linux's 1000 packets, 12 s to drain; the skip is capped at 10 s
    assert measurement_window_s(topo, q, "up", 3) == (10, 40)


def test_lumps_of_an_offloading_sender_are_counted_whole():
    # 64 KB lumps at 1 Mbit/s: one every 0.524 s; a window cut between lumps is off by up to
    # a lump, one cut where lumps arrived is not
    lump, rate = 65536, 1e6
    samples, total, next_lump, t = [], 0, 0.3, 0.0
    while t <= 12.0:
        while next_lump <= t:
            total += lump
            next_lump += lump * 8 / rate
        samples.append((t, total))
        t = round(t + 0.02, 9)
    assert window_rate_bps(samples, 1, 5, rate) == pytest.approx(rate, rel=0.02)


def test_the_estimate_adds_each_measurements_window_and_the_round_trips():
    topo = slow_links_topology()
    p, q = topo.devices
    per_run_s = QUIET_S + START_S + 1  # the quiet wait, the client's start, the extra second
    # p: down (3 + 11) and up (1 + 3), then 10 RTT samples with no delay on its path
    assert device_estimate_s(topo, p) == pytest.approx(2 * per_run_s + 14 + 4 + START_S)
    # q: both ways (10 + 40); 10 samples of 2 x 5 ms
    assert device_estimate_s(topo, q) == pytest.approx(2 * per_run_s + 100 + START_S + 0.1)
    # --duplex adds one run as long as the longer direction's
    assert device_estimate_s(topo, p, duplex=True) == pytest.approx(
        device_estimate_s(topo, p) + per_run_s + 14)


def test_a_devices_progress_line_names_each_figure_and_flags_what_is_off():
    rows = [Row("p-0", "down", 1e6, 0.994e6, 0.1), Row("p-0", "up", 1e8, 0.5e8, 0.1),
            Row("p-0", "rtt", 0.01, 0.0102, 0.1)]
    assert format_device(rows) == "down 0.99 Mbit/s  up 50.00 Mbit/s NO  rtt 10.20 ms"
