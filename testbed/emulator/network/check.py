"""``testbed net check``: bring a topology's network up and measure every device's path to the PS.

For each device (one after another, so that shared links do not mix the measurements):

* throughput each way: ``iperf3`` (TCP) keeps the path saturated, sent by the PS for ``down``
  and by the device for ``up``, and the figure is what the receiving host's interface took in:
  the kernel's byte counter of that interface, sampled every 20 ms next to a clock reading, over
  a window anchored where the flow began (:func:`window_rate_bps`). It is compared with the
  *path's* configured rate in that direction: the smallest rate on the way (device link, switch
  links, PS link), or what TCP gets through the path's loss when that is less (Mathis' rate,
  :func:`~testbed.emulator.network.base.loss_cap_bps`: the rate the backend shapes without netem;
  with netem the kernel drops packets and the kernel's TCP may do better). HTB charges whole
  frames and the backend sets each class's rate so that the payload gets the configured one
  (docs/network.md, "A rate is the payload's").
  Why the kernel and not iperf3's own report: iperf3 counts bytes when its process reads them,
  so on a loaded 2-core machine a descheduled receiver moved bytes between one-second intervals
  (single intervals of a 1 Mbit/s path read 0.42-1.25 Mbit/s) and out of the window; CI
  measured 1 Mbit/s as 0.85 Mbit/s that way. Each measurement starts once both ends' interfaces
  have been quiet for a second (the last one's sender drains its unsent bytes for seconds on a
  slow link). The window scales with the path: slow start overfills the bottleneck's queue and
  TCP then recovers, which on a 1 Mbit/s link behind a 100-packet queue (1.2 s to drain) lasts
  seconds, so the first ``max(1, 2 x drain)`` seconds are skipped and at least ``4 x drain``
  seconds measured, and at least 20 of the sender's 64 KB offload lumps
  (:func:`measurement_window_s`).
* round-trip time with a small TCP echo (64-byte messages, ``TCP_NODELAY``), median of N samples,
  compared with twice the path's one-way delay. When the kernel has no netem, the backend hands the
  delay to the application (:meth:`MininetNetwork.app_shaping`); the echo client then holds each
  message on the agent's own link code (``testbed.agent.link.LinkDirection``) before sending and
  again on receipt, as the agent does for its traffic, so the check measures the delay mechanism
  that is actually active. Both echo programs run at real-time priority where the host allows
  it, so that the host's CPU load does not read as link delay.

A direction passes when ``|measured - configured| <= tolerance * configured`` for rates and
``<= tolerance * configured + 1 ms`` for the RTT. This module also runs as a program: the echo
server and client that the check starts inside the hosts (``python -m ...check echo-server``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from testbed.agent.hold import HOLD_RT_PRIORITY, hold_until
from testbed.emulator.network.base import (
    FRAME_BYTES,
    AppShaping,
    loss_cap_bps,
    path_delay_s,
    switch_path,
)
from testbed.emulator.network.mininet import MininetNetwork
from testbed.topology import DeviceSpec, Topology

log = logging.getLogger(__name__)

IPERF_PORT = 5201
ECHO_PORT = 5300
ECHO_SIZE_BYTES = 64
RTT_ABS_TOLERANCE_S = 1e-3


def path_rate_bps(topology: Topology, device: DeviceSpec, direction: str) -> float:
    """The smallest configured rate on the device's path to the PS in 'down' or 'up', and no
    more than TCP gets through the path's loss (:func:`loss_cap_bps`, as every part models it)."""
    key = "down_bps" if direction == "down" else "up_bps"
    links = [device.link, topology.network.ps.link,
             *(sl.link for sl in switch_path(topology, device.group.switch))]
    return min(min(getattr(link, key) for link in links), loss_cap_bps(topology, device))


# -- measurements ------------------------------------------------------------------------------

def start_iperf_server(net: MininetNetwork, node: str | None = None,
                       port: int = IPERF_PORT) -> subprocess.Popen:
    """Start an iperf3 server in a node's host (None = the PS); stop() of the network ends it."""
    proc = net.popen(node, ["iperf3", "-s", "-B", net.host_ip(node), "-p", str(port)],
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait_listening(net, node, port)
    return proc


def _wait_listening(net: MininetNetwork, node: str | None, port: int,
                    timeout_s: float = 10.0) -> None:
    """Wait until something in a node's host listens on port (checked from inside the host)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        probe = net.popen(node, ["ss", "-Hltn", f"sport = :{port}"], stdout=subprocess.PIPE,
                          text=True)
        out, _ = probe.communicate(timeout=5)
        if out.strip():
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} in {net.node_name(node)} after "
                       f"{timeout_s} s")


DEFAULT_QUEUE_PACKETS = 1000  # Linux's txqueuelen, the queue when a link sets none
FRAME_BITS = FRAME_BYTES * 8
MAX_SKIP_S = 10
# a sender's segmentation offload hands the link lumps of up to 64 KB, which the receiving
# counter sees arrive whole; a window of this many lumps keeps one lump more or less (their
# sizes vary) within 5 % of it (a 5-s window at 1 Mbit/s held ~10 and read 10.1 % high once in CI)
GSO_LUMP_BITS = 65536 * 8
MIN_LUMPS = 20


def measurement_window_s(topology: Topology, device: DeviceSpec, direction: str,
                         seconds: float) -> tuple[int, float]:
    """(seconds skipped, seconds measured) of a saturated run on the device's path.

    Both scale with the time the device link's queue takes to drain at the path's rate: the
    skipped part covers slow start's overshoot and its recovery, the measured part makes the
    bytes that cross the window's two edges a small share of it; and the measured part holds at
    least ``MIN_LUMPS`` of the sender's offload lumps.
    """
    rate_bps = path_rate_bps(topology, device, direction)
    queue = device.link.queue_packets or DEFAULT_QUEUE_PACKETS
    drain_s = queue * FRAME_BITS / rate_bps
    skip = min(MAX_SKIP_S, max(1, math.ceil(2 * drain_s)))
    return skip, max(seconds, math.ceil(4 * min(drain_s, MAX_SKIP_S)),
                     math.ceil(MIN_LUMPS * GSO_LUMP_BITS / rate_bps))


def measure_throughput_bps(net: MininetNetwork, device: DeviceSpec, direction: str,
                           seconds: float = 3.0, port: int = IPERF_PORT) -> float:
    """Bits per second a device's path delivers in 'down' (PS sends) or 'up' (device sends).

    The receiving end runs the iperf3 client with -R (an iperf3 server started in the sending
    end's host must already listen on `port`: see :func:`start_iperf_server`); the check samples
    the receiving interface's byte counter while it runs (:func:`window_rate_bps`).
    """
    receiver, sender = (device.name, None) if direction == "down" else (None, device.name)
    return _measure(net, device, ["-c", net.host_ip(sender), "-R"], receiver, {direction: receiver},
                    seconds, port)[direction]


def measure_duplex_bps(net: MininetNetwork, device: DeviceSpec, seconds: float = 3.0,
                       port: int = IPERF_PORT) -> dict[str, float]:
    """Bits per second the path delivers each way while both ways are saturated at once.

    The link is full duplex: each direction has its own configured rate, and the ACKs of one
    direction's flow travel behind the other's data (iperf3 --bidir from the device to the
    server in the PS's host, :func:`start_iperf_server`). Both receiving interfaces' counters
    are sampled as in :func:`measure_throughput_bps`.
    """
    return _measure(net, device, ["-c", net.host_ip(None), "--bidir"], device.name,
                    {"down": device.name, "up": None}, seconds, port)


def _measure(net: MininetNetwork, device: DeviceSpec, iperf_args: list[str],
             client: str | None, receivers: dict[str, str | None], seconds: float,
             port: int) -> dict[str, float]:
    """Run an iperf3 client in `client` and measure each direction's receiving interface."""
    windows = {d: measurement_window_s(net.topology, device, d, seconds) for d in receivers}
    _wait_quiet(net, [device.name, None])
    run_s = max(skip + secs for skip, secs in windows.values()) + 1  # traffic outlasts it
    argv = ["iperf3", *iperf_args, "-p", str(port), "-t", f"{run_s:g}"]
    proc = net.popen(client, argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                     text=True)
    samples: dict[str, list[tuple[float, int]]] = {d: [] for d in receivers}
    deadline = time.monotonic() + run_s + 60
    while proc.poll() is None and time.monotonic() < deadline:
        for d, node in receivers.items():
            samples[d].append(_rx_bytes_now(net, node))
        time.sleep(SAMPLE_EVERY_S)
    _, err = proc.communicate(timeout=5)
    if proc.returncode != 0:
        raise RuntimeError(f"iperf3 for {device.name} {'+'.join(receivers)} failed "
                           f"(exit {proc.returncode}): {err.strip()}")
    return {d: window_rate_bps(samples[d], *windows[d],
                               path_rate_bps(net.topology, device, d)) for d in receivers}


SAMPLE_EVERY_S = 0.02
FLOW_STARTED_FRACTION = 0.25


def window_rate_bps(samples: list[tuple[float, int]], skip_s: float, seconds: float,
                    configured_bps: float) -> float:
    """The rate of a byte counter over a window anchored where the measured flow began.

    samples: (time, bytes received so far), in time order. The flow began at the first sample
    interval that carried a quarter of the configured rate: the start of the measuring process
    is no anchor, because the previous measurement's unsent bytes can hold the control
    connection back for seconds on a slow link, and the ACKs and handshakes before the flow
    carry far less. The window opens skip_s after that and spans seconds (as far as samples
    reach); a flow that never reaches a quarter of the rate is measured from the first sample.
    The rate is taken between the window's first and last samples that saw bytes arrive.
    """
    if len(samples) < 2:
        raise RuntimeError("too few counter samples to measure a rate")
    began = samples[0][0]
    for (t0, b0), (t1, b1) in zip(samples, samples[1:]):
        if t1 > t0 and 8 * (b1 - b0) / (t1 - t0) >= FLOW_STARTED_FRACTION * configured_bps:
            began = t0
            break
    # the edges are samples that saw bytes arrive: on a slow link the sender's segmentation
    # offload delivers whole 64 KB lumps (0.5 s of a 1 Mbit/s link) at once, and a window cut
    # between lumps would count a share of one it did not wait for
    edges = [samples[i] for i in range(1, len(samples))
             if began + skip_s <= samples[i][0] <= began + skip_s + seconds
             and samples[i][1] > samples[i - 1][1]]
    if len(edges) < 2 or edges[-1][0] <= edges[0][0]:
        raise RuntimeError(f"no bytes arrived in the window {skip_s:g}-{skip_s + seconds:g} s "
                           "after the flow began")
    (t0, b0), (t1, b1) = edges[0], edges[-1]
    return 8 * (b1 - b0) / (t1 - t0)


QUIET_S = 1.0  # longer than a 64 KB lump takes on a 1 Mbit/s link
QUIET_TIMEOUT_S = 60.0


def _wait_quiet(net: MininetNetwork, nodes: list[str | None]) -> None:
    """Wait until no byte crosses the nodes' interfaces for QUIET_S (at most QUIET_TIMEOUT_S).

    A measurement that ended leaves its sender's unsent bytes to drain: seconds of them on a
    slow link, which the next flow's ACKs would queue behind and its counter would count.
    """
    def totals() -> list[int]:
        return [c["rx_bytes"] + c["tx_bytes"] for c in map(net.interface_counters, nodes)]

    deadline = time.monotonic() + QUIET_TIMEOUT_S
    last, since = totals(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = totals()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= QUIET_S:
            return
    log.warning("interfaces of %s still carry traffic after %g s; measuring anyway",
                ", ".join(net.node_name(n) for n in nodes), QUIET_TIMEOUT_S)


def _rx_bytes_now(net: MininetNetwork, node: str | None) -> tuple[float, int]:
    """(monotonic time, bytes received so far) of a node's interface, read back to back."""
    now = time.monotonic()
    return now, int(net.interface_counters(node)["rx_bytes"])


class DelayLine(Protocol):
    """Holds traffic for the app-level part of a link (agent side, both directions)."""

    def hold_up(self) -> None: ...

    def hold_down(self) -> None: ...


class AgentDelayLine:
    """App-level delay through the agent's own link code (``testbed.agent.link.LinkDirection``).

    Each hold ends as the agent's downlink arrivals do, through ``hold_until`` (a real-time
    sleep): with four busy loops on two cores a plain sleep woke on the next 4 ms scheduler tick
    and the RTTs of the check's 1 Mbit/s path read 32 ms for 24.

    Rates stay None: the kernel (HTB) shapes them, a lossy path's at what TCP gets through it;
    only delay is the application's, exactly as the agent gets it from ``app_shaping()``.
    """

    def __init__(self, shaping: AppShaping, nbytes: int = 0):
        from testbed.agent.link import LinkDirection

        self.nbytes = nbytes
        self.up = LinkDirection(None, shaping.delay_s, 0.0)
        self.down = LinkDirection(None, shaping.delay_s, 0.0)

    @staticmethod
    def _hold(direction: Any, nbytes: int) -> None:
        hold_until(direction.deliver_at(nbytes, time.monotonic()))

    def hold_up(self) -> None:
        self._hold(self.up, self.nbytes)

    def hold_down(self) -> None:
        self._hold(self.down, self.nbytes)


def start_echo_server(net: MininetNetwork, port: int = ECHO_PORT) -> subprocess.Popen:
    """Start the TCP echo server in the PS's host."""
    proc = net.popen(None, [sys.executable, "-m", __name__, "echo-server", "--bind",
                            net.ps_listen_host(), "--port", str(port)],
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait_listening(net, None, port)
    return proc


def measure_rtt_s(net: MininetNetwork, device: DeviceSpec, samples: int = 10,
                  port: int = ECHO_PORT) -> float:
    """Median RTT of small TCP messages from a device to the PS, app-level delay included."""
    shaping = net.app_shaping(device)
    proc = net.popen(device.name, [sys.executable, "-m", __name__, "echo-client", "--connect",
                                   net.ps_address_for(device), "--port", str(port),
                                   "--samples", str(samples), "--delay-s",
                                   repr(shaping.delay_s)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60 + samples * (4 * shaping.delay_s + 1))
    if proc.returncode != 0:
        raise RuntimeError(f"echo client for {device.name} failed: {err.strip()}")
    return float(json.loads(out)["median_rtt_s"])


# -- the check ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One measured quantity of one device against its configured value."""

    device: str
    quantity: str  # "down", "up" (bit/s), "down*", "up*" (both at once) or "rtt" (s)
    configured: float
    measured: float
    tolerance: float  # relative

    @property
    def error(self) -> float:
        """Relative error (measured - configured) / configured."""
        return (self.measured - self.configured) / self.configured if self.configured else 0.0

    @property
    def ok(self) -> bool:
        slack = self.tolerance * self.configured
        if self.quantity == "rtt":
            slack += RTT_ABS_TOLERANCE_S
        return abs(self.measured - self.configured) <= slack


# what a measurement costs beside its window: the iperf3 client's start and the check's own
# process starts (python for the echo client), on a loaded 2-core host
START_S = 1.0


def device_estimate_s(topology: Topology, device: DeviceSpec, seconds: float = 3.0,
                      samples: int = 10, duplex: bool = False) -> float:
    """About how long :func:`check_devices` takes for one device: per measurement the quiet
    wait, the skipped and measured window, the traffic's extra second and a start; the RTT
    samples at the path's round trip. A plan for the user's patience, not a measurement."""
    def run_s(directions: tuple[str, ...]) -> float:
        return QUIET_S + START_S + 1 + max(
            sum(measurement_window_s(topology, device, d, seconds)) for d in directions)

    total = run_s(("down",)) + run_s(("up",)) + (run_s(("down", "up")) if duplex else 0.0)
    return total + START_S + samples * 2 * path_delay_s(topology, device)


def check_devices(net: MininetNetwork, devices: list[DeviceSpec], tolerance: float = 0.10,
                  seconds: float = 3.0, samples: int = 10, duplex: bool = False,
                  on_device: Callable[[int, DeviceSpec, list[Row]], None] | None = None
                  ) -> list[Row]:
    """Measure each device's path (throughput each way, RTT) on a started network; with
    ``duplex`` also both ways at once (rows ``down*`` and ``up*``). ``on_device(n, device,
    its rows)`` after each device (n counts from 1), for progress on long checks."""
    topo = net.topology
    start_iperf_server(net, None)
    start_echo_server(net)
    rows: list[Row] = []
    for n, device in enumerate(devices, start=1):
        server = start_iperf_server(net, device.name)  # the sender of the 'up' measurement
        for direction in ("down", "up"):
            measured = measure_throughput_bps(net, device, direction, seconds)
            rows.append(Row(device.name, direction, path_rate_bps(topo, device, direction),
                            measured, tolerance))
        if duplex:
            for direction, measured in measure_duplex_bps(net, device, seconds).items():
                rows.append(Row(device.name, f"{direction}*",
                                path_rate_bps(topo, device, direction), measured, tolerance))
        server.terminate()
        server.wait()
        rows.append(Row(device.name, "rtt", 2 * path_delay_s(topo, device),
                        measure_rtt_s(net, device, samples), tolerance))
        if on_device is not None:
            on_device(n, device, [r for r in rows if r.device == device.name])
    return rows


def _fmt(quantity: str, value: float) -> str:
    return f"{value * 1e3:.2f} ms" if quantity == "rtt" else f"{value / 1e6:.2f} Mbit/s"


def format_device(rows: list[Row]) -> str:
    """One device's rows on one line: each quantity measured, and NO after one out of
    tolerance (the progress of a long check; the table at the end has the errors)."""
    return "  ".join(f"{r.quantity} {_fmt(r.quantity, r.measured)}{'' if r.ok else ' NO'}"
                     for r in rows)


def _error_text(row: Row) -> str:
    """The relative error in percent; '-' against nothing configured (a link without delay has
    no relative error: its RTT passes on the 1 ms alone, and '0.0%' read as measured 0)."""
    return f"{row.error * 100:.1f}%" if row.configured else "-"


def format_table(rows: list[Row]) -> str:
    """A plain-text table of rows: device, quantity, configured, measured, error, verdict."""
    # device names run to 24 characters (testbed.names); a fixed 16 pushed longer ones'
    # rows out of their columns
    w = max([16, *(len(r.device) for r in rows)])
    lines = [f"{'device':<{w}} {'what':<5} {'configured':>14} {'measured':>14} {'error':>8}  ok"]
    for r in rows:
        lines.append(f"{r.device:<{w}} {r.quantity:<5} {_fmt(r.quantity, r.configured):>14} "
                     f"{_fmt(r.quantity, r.measured):>14} {_error_text(r):>8}  "
                     f"{'yes' if r.ok else 'NO'}")
    if any(r.quantity.endswith("*") for r in rows):
        lines.append("* both directions saturated at once")
    return "\n".join(lines)


# -- the echo programs run inside the hosts ----------------------------------------------------

def _realtime() -> None:
    """Run this echo program at real-time priority where the host allows it.

    The check measures links; without it each wake-up of the echo programs on a busy 2-core
    host came a 4 ms scheduler tick late now and then, and read as link delay.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(HOLD_RT_PRIORITY))
    except (OSError, AttributeError):
        pass  # measured at normal priority: late wake-ups add to the RTT


def _echo_server(bind: str, port: int) -> int:
    _realtime()
    with socket.create_server((bind, port), reuse_port=False) as server:
        while True:
            conn, _ = server.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while True:
                    data = conn.recv(4096)
                    if not data:
                        break
                    conn.sendall(data)


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    buf = b""
    while len(buf) < size:
        chunk = conn.recv(size - len(buf))
        if not chunk:
            raise ConnectionError("echo server closed the connection")
        buf += chunk
    return buf


def _echo_client(host: str, port: int, samples: int, delay_s: float) -> int:
    _realtime()
    line: DelayLine = AgentDelayLine(AppShaping(delay_s=delay_s), ECHO_SIZE_BYTES)
    rtts = []
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = bytes(ECHO_SIZE_BYTES)
        conn.sendall(payload)  # one unmeasured exchange: ARP resolution, connection warm-up
        _recv_exact(conn, ECHO_SIZE_BYTES)
        for _ in range(samples):
            t0 = time.perf_counter()
            line.hold_up()
            conn.sendall(payload)
            _recv_exact(conn, ECHO_SIZE_BYTES)
            line.hold_down()
            rtts.append(time.perf_counter() - t0)
    print(json.dumps({"median_rtt_s": statistics.median(rtts), "rtts_s": rtts}))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the echo helpers (run inside Mininet hosts by the check)."""
    parser = argparse.ArgumentParser(prog="python -m testbed.emulator.network.check")
    sub = parser.add_subparsers(dest="role", required=True)
    s = sub.add_parser("echo-server")
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, default=ECHO_PORT)
    c = sub.add_parser("echo-client")
    c.add_argument("--connect", required=True)
    c.add_argument("--port", type=int, default=ECHO_PORT)
    c.add_argument("--samples", type=int, default=10)
    c.add_argument("--delay-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.role == "echo-server":
        return _echo_server(args.bind, args.port)
    return _echo_client(args.connect, args.port, args.samples, args.delay_s)


if __name__ == "__main__":
    sys.exit(main())
