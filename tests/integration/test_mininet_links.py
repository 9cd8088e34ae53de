"""Link fidelity on the Mininet backend: shaped rates each way and RTT against their configuration.

Needs root, mnexec, brctl, HTB and iperf3 (skips naming what is missing). The delay is checked
through whichever mechanism the probe found: netem in the kernel, or (without netem) the
application-level delay that ``app_shaping()`` hands out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from testbed.emulator.network.base import FRAME_BYTES, MSS_BYTES, AppShaping, loss_cap_bps
from testbed.emulator.network.check import (
    check_devices,
    format_table,
    measure_duplex_bps,
    path_rate_bps,
    start_iperf_server,
)
from testbed.emulator.network.mininet import MininetNetwork
from testbed.emulator.network.probe import probe
from testbed.topology import parse_topology

pytestmark = pytest.mark.integration

_missing = probe().missing() + ([] if probe().iperf3 else ["iperf3"])
needs_mininet = pytest.mark.skipif(bool(_missing), reason="Mininet backend unavailable, missing: "
                                                          + "; ".join(_missing))

JOB = {"model": {"hidden": 64, "layers": 1, "heads": 1, "ffn": 64, "seq_len": 16}}


def fidelity_topology():
    """1, 10 and 100 Mbit each way, behind a switch link and the PS link (both faster)."""
    link = {"switches": ["core", "ap0"], "down": "1Gbit", "up": "1Gbit", "delay": "1ms"}
    groups = [("a", "10Mbit", "1Mbit", "10ms"), ("b", "100Mbit", "10Mbit", "5ms"),
              ("c", "1Mbit", "100Mbit", "20ms")]
    return parse_topology({
        "name": "fidelity",
        "network": {"backend": "mininet", "switches": ["core", "ap0"], "links": [link],
                    "ps": {"switch": "core", "link": {"down": "1Gbit", "up": "1Gbit",
                                                      "delay": "1ms"}}},
        "devices": [{"group": g, "profile": "snapdragon888", "count": 1, "switch": "ap0",
                     "link": {"down": d, "up": u, "delay": t, "queue": 100}}
                    for g, d, u, t in groups],
        "job": JOB})


@needs_mininet
@pytest.mark.slow
def test_rates_each_way_and_rtt_within_tolerance():
    topo = fidelity_topology()
    progress: list[tuple[int, str, list]] = []
    with MininetNetwork(topo) as net:
        rows = check_devices(net, list(topo.devices), tolerance=0.10, seconds=3, samples=10,
                             on_device=lambda n, d, its: progress.append((n, d.name, its)))
    table = format_table(rows)
    assert len(rows) == 9, table
    # the progress named each device once, in order, with its own rows as they were measured
    assert [(n, name) for n, name, _ in progress] == [(1, "a-0"), (2, "b-0"), (3, "c-0")]
    assert [r for _, _, its in progress for r in its] == rows
    configured = {(r.device, r.quantity): r.configured for r in rows}
    # the configuration under test is what we think it is: path rates and RTTs
    assert configured[("a-0", "down")] == 10e6 and configured[("a-0", "up")] == 1e6
    assert configured[("c-0", "down")] == 1e6 and configured[("c-0", "up")] == 100e6
    assert configured[("b-0", "rtt")] == pytest.approx(2 * (5e-3 + 1e-3 + 1e-3))
    bad = [r for r in rows if not r.ok]
    assert not bad, "links off by more than the tolerance:\n" + table


@needs_mininet
def test_a_link_carries_its_rate_both_ways_at_once():
    """Tiles go down while results go up on one device link. Each direction's ACKs travel
    the other way, behind that direction's queued data; a shaped egress that queued them with
    the data cut a 2 Mbit/s link's upload to 1.2 Mbit/s while a download ran (the ACKs of the
    download waited behind a queue of upload data and the other way round)."""
    topo = parse_topology({
        "name": "duplex",
        "network": {"backend": "mininet", "switches": ["ap0"],
                    "ps": {"switch": "ap0", "link": {"down": "1Gbit", "up": "1Gbit"}}},
        "devices": [{"group": "a", "profile": "snapdragon888", "count": 1, "switch": "ap0",
                     "link": {"down": "2Mbit", "up": "2Mbit", "queue": 100}}],
        "job": JOB})
    with MininetNetwork(topo) as net:
        start_iperf_server(net, None)
        rates = measure_duplex_bps(net, topo.devices[0], seconds=4)
    assert rates["down"] == pytest.approx(2e6, rel=0.10), rates
    assert rates["up"] == pytest.approx(2e6, rel=0.10), rates


def one_20mbit_device(name: str):
    """One device on a 20 Mbit/s link each way, the PS on 1 Gbit."""
    return parse_topology({
        "name": name,
        "network": {"backend": "mininet", "switches": ["ap0"],
                    "ps": {"switch": "ap0", "link": {"down": "1Gbit", "up": "1Gbit"}}},
        "devices": [{"group": "a", "profile": "snapdragon888", "count": 1, "switch": "ap0",
                     "link": {"down": "20Mbit", "up": "20Mbit"}}],
        "job": JOB})


def payload_bps(net: MininetNetwork, *extra: str, seconds: int = 5) -> float:
    """iperf3 from device a-0 to the PS's server (``-R``: back), slow start's 2 s omitted: the
    payload's bits a second (iperf3 counts payload only)."""
    run = net.popen("a-0", ["iperf3", "-c", net.host_ip(None), "-t", str(seconds), "-O", "2",
                            "-J", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 0, err
    return json.loads(out)["end"]["sum_received"]["bits_per_second"]


@needs_mininet
def test_a_link_rate_is_what_tcp_payload_gets():
    """A topology's rate is the application's bytes', as on loopback and in the simulator: HTB
    charges whole frames (1514 bytes for 1448 of payload), so at the configured rate a
    saturated flow's payload got 0.956 of it; the kernel's rate is scaled up by that."""
    with MininetNetwork(one_20mbit_device("goodput"), dilation=2) as net:
        start_iperf_server(net, None)
        bps = payload_bps(net)
    # dilation 2: the kernel carries 10 Mbit/s of payload; at the rate unscaled 0.956 of it
    assert 0.97 * 10e6 <= bps <= 1.01 * 10e6, (bps, FRAME_BYTES / MSS_BYTES)


@needs_mininet
def test_without_netem_a_lossy_link_carries_what_tcp_gets_through_it():
    """Without netem nothing drops packets, so the kernel shapes a lossy device link at Mathis'
    rate for the path (loss_cap_bps), both ways: every process in the host gets it, a
    baseline's stage as an agent (which applied the cap itself before, and the stages not at
    all). netem is switched off here so that the kernel's own loss does not take part."""
    topo = parse_topology({
        "name": "lossy",
        "network": {"backend": "mininet", "switches": ["ap0"],
                    "ps": {"switch": "ap0", "link": {"down": "1Gbit", "up": "1Gbit",
                                                     "delay": "5ms"}}},
        "devices": [{"group": "a", "profile": "snapdragon888", "count": 1, "switch": "ap0",
                     "link": {"down": "20Mbit", "up": "20Mbit", "delay": "15ms",
                              "loss": "1%"}}],
        "job": JOB})
    cap = loss_cap_bps(topo, topo.devices[0])
    assert cap == pytest.approx(8 * MSS_BYTES / 0.040 * (3 / 0.02) ** 0.5)  # 3.55 Mbit/s
    with MininetNetwork(topo, capabilities=replace(probe(), netem=False)) as net:
        assert net.app_shaping(topo.devices[0]) == AppShaping(delay_s=pytest.approx(0.020))
        start_iperf_server(net, None)
        rates = {"up": payload_bps(net), "down": payload_bps(net, "-R")}
    # the payload tests' tolerance (below); at the link's 20 Mbit/s this fails by 5x
    for direction, bps in rates.items():
        assert 0.97 * cap <= bps <= 1.01 * cap, (direction, rates, cap)


@needs_mininet
def test_app_shaping_reports_the_active_delay_mechanism():
    topo = fidelity_topology()
    net = MininetNetwork(topo)
    c0 = topo.devices[2]
    shaping = net.app_shaping(c0)
    if probe().netem:
        assert shaping == AppShaping()
        assert net.describe()["delay"] == "netem"
    else:
        assert shaping == AppShaping(delay_s=pytest.approx(0.022))
        assert shaping.down_bps is None and shaping.up_bps is None  # HTB shapes rates
        assert net.describe()["delay"] == "application"
    assert path_rate_bps(topo, c0, "down") == 1e6


CONNECT = [sys.executable, "-c",
           "import socket, sys; s = socket.socket(); s.settimeout(1.0); "
           "sys.exit(s.connect_ex((sys.argv[1], int(sys.argv[2]))))"]
LISTEN = [sys.executable, "-c",
          "import socket, time; s = socket.create_server(('10.0.0.1', 7001)); time.sleep(600)"]


@needs_mininet
def test_partition_cuts_a_device_off_and_heal_restores_it():
    topo = fidelity_topology()
    with MininetNetwork(topo) as net:
        server = net.popen(None, LISTEN)
        device, other = topo.devices[0], topo.devices[1]

        def reachable(d) -> bool:
            return net.popen(d.name, [*CONNECT, net.ps_address_for(d), "7001"]).wait(10) == 0

        def becomes_reachable(d, tries: int = 10) -> bool:
            return any(reachable(d) for _ in range(tries))

        assert becomes_reachable(device)  # the server needs a moment to listen
        assert net.set_partitioned(device, True)
        assert not reachable(device)
        assert reachable(other)  # only that device is cut off
        assert net.set_partitioned(device, False)
        assert becomes_reachable(device, tries=5)
        assert server.poll() is None


@needs_mininet
def test_a_new_dilation_moves_the_kernels_rates_both_ways():
    """An adaptive run changes D between steps; the links must follow (link_dilation): brought
    up at D 1 and moved to D 4, a 20 Mbit/s link carries 5 Mbit/s of payload each way (down:
    the switch port's egress in the root namespace; up: the device host's own)."""
    with MininetNetwork(one_20mbit_device("redilate"), dilation=1) as net:
        net.set_dilation(4)
        assert net.describe()["dilation"] == 4
        start_iperf_server(net, None)
        rates = {"up": payload_bps(net, seconds=4), "down": payload_bps(net, "-R", seconds=4)}
    # the same tolerance as the payload test above: 20 Mbit/s / 4
    for direction, bps in rates.items():
        assert 0.97 * 5e6 <= bps <= 1.01 * 5e6, (direction, rates)
