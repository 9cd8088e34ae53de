"""``testbed net check``: bring a topology's network up and measure every device's path to the PS.

For each device (one after another, so that shared links do not mix the measurements):

* throughput each way with ``iperf3`` (TCP, ``-O 1`` drops the first second of slow start): the
  receiving end runs the client with ``-R`` (the device's host for ``down``, the PS's for ``up``),
  the sending end the server, so the figure is always measured where the bytes arrive: the mean
  goodput (TCP payload) over the receiver's own non-omitted one-second intervals. It is compared
  with the *path's* configured rate in that direction: the smallest rate on the way (device link,
  switch links, PS link). HTB counts Ethernet frames, so TCP payload is ~4% below the configured
  rate on a 1500-byte MTU; that is inside the tolerance and deliberately not corrected.
* round-trip time with a small TCP echo (64-byte messages, ``TCP_NODELAY``), median of N samples,
  compared with twice the path's one-way delay. When the kernel has no netem, the backend hands the
  delay to the application (:meth:`MininetNetwork.app_shaping`); the echo client then holds each
  message on the agent's own link code (``testbed.agent.link.LinkDirection``) before sending and
  again on receipt, as the agent does for its traffic, so the check measures the delay mechanism
  that is actually active.

A direction passes when ``|measured - configured| <= tolerance * configured`` for rates and
``<= tolerance * configured + 1 ms`` for the RTT. This module also runs as a program: the echo
server and client that the check starts inside the hosts (``python -m ...check echo-server``).
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Protocol

from testbed.emulator.network.base import AppShaping, path_delay_s
from testbed.emulator.network.mininet import MininetNetwork
from testbed.topology import DeviceSpec, Topology

log = logging.getLogger(__name__)

IPERF_PORT = 5201
ECHO_PORT = 5300
ECHO_SIZE_BYTES = 64
RTT_ABS_TOLERANCE_S = 1e-3


def path_rate_bps(topology: Topology, device: DeviceSpec, direction: str) -> float:
    """The smallest configured rate on the device's path to the PS in 'down' or 'up'."""
    key = "down_bps" if direction == "down" else "up_bps"
    rates = [getattr(device.link, key), getattr(topology.network.ps.link, key)]
    parents = {link.lower: link for link in topology.network.links}
    switch = device.group.switch
    while switch in parents:
        rates.append(getattr(parents[switch].link, key))
        switch = parents[switch].upper
    return min(rates)


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


def measure_throughput_bps(net: MininetNetwork, device: DeviceSpec, direction: str,
                           seconds: float = 3.0, port: int = IPERF_PORT) -> float:
    """TCP goodput between a device and the PS in 'down' (PS sends) or 'up' (device sends).

    The receiving end always runs the iperf3 client with -R, so that the figure is measured where
    the bytes arrive, by the process that also keeps the clock (an iperf3 server started in the
    sending end's host must already listen on `port`: see :func:`start_iperf_server`).
    """
    receiver, sender = (device.name, None) if direction == "down" else (None, device.name)
    argv = ["iperf3", "-c", net.host_ip(sender), "-p", str(port), "-J", "-R",
            "-t", f"{seconds:g}", "-O", "1"]
    proc = net.popen(receiver, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True)
    out, err = proc.communicate(timeout=seconds + 60)
    try:
        report = json.loads(out)
    except ValueError:
        raise RuntimeError(f"iperf3 for {device.name} {direction}: no JSON report: "
                           f"{err.strip() or out[:200]}") from None
    if "error" in report:
        raise RuntimeError(f"iperf3 for {device.name} {direction}: {report['error']}")
    return _receiver_rate_bps(report)


def _receiver_rate_bps(report: dict) -> float:
    """Bits per second over the receiver's own non-omitted intervals.

    The end summary can also count bytes that were still queued when the sender's clock stopped
    (up to ~12 s of them behind a 1000-packet queue at 1 Mbit/s); the intervals cannot.
    """
    kept = [i["sum"] for i in report.get("intervals", []) if not i["sum"].get("omitted")]
    seconds = sum(float(k["seconds"]) for k in kept)
    if seconds <= 0:
        raise RuntimeError("iperf3 reported no measured interval")
    return 8 * sum(float(k["bytes"]) for k in kept) / seconds


class DelayLine(Protocol):
    """Holds traffic for the app-level part of a link (agent side, both directions)."""

    def hold_up(self) -> None: ...

    def hold_down(self) -> None: ...


class AgentDelayLine:
    """App-level delay through the agent's own link code (``testbed.agent.link.LinkDirection``).

    Rates stay None: the kernel (HTB) shapes them; only delay (and loss, not measured here) is
    the application's, exactly as the agent gets them from ``app_shaping()``.
    """

    def __init__(self, shaping: AppShaping, nbytes: int = 0):
        from testbed.agent.link import LinkDirection

        self.nbytes = nbytes
        self.up = LinkDirection(None, shaping.delay_s, 0.0)
        self.down = LinkDirection(None, shaping.delay_s, 0.0)

    @staticmethod
    def _hold(direction: Any, nbytes: int) -> None:
        now = time.monotonic()
        wait = direction.deliver_at(nbytes, now) - now
        if wait > 0:
            time.sleep(wait)

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
    quantity: str  # "down", "up" (bit/s) or "rtt" (s)
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


def check_devices(net: MininetNetwork, devices: list[DeviceSpec], tolerance: float = 0.10,
                  seconds: float = 3.0, samples: int = 10) -> list[Row]:
    """Measure each device's path (throughput both ways, RTT) on a started network."""
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
        server.terminate()
        server.wait()
        rows.append(Row(device.name, "rtt", 2 * path_delay_s(topo, device),
                        measure_rtt_s(net, device, samples), tolerance))
        log.info("checked %d/%d devices (%s)", n, len(devices), device.name)
    return rows


def _fmt(quantity: str, value: float) -> str:
    return f"{value * 1e3:.2f} ms" if quantity == "rtt" else f"{value / 1e6:.2f} Mbit/s"


def format_table(rows: list[Row]) -> str:
    """A plain-text table of rows: device, quantity, configured, measured, error, verdict."""
    lines = [f"{'device':<16} {'what':<5} {'configured':>14} {'measured':>14} {'error':>8}  ok"]
    for r in rows:
        lines.append(f"{r.device:<16} {r.quantity:<5} {_fmt(r.quantity, r.configured):>14} "
                     f"{_fmt(r.quantity, r.measured):>14} {r.error * 100:>7.1f}%  "
                     f"{'yes' if r.ok else 'NO'}")
    return "\n".join(lines)


# -- the echo programs run inside the hosts ----------------------------------------------------

def _echo_server(bind: str, port: int) -> int:
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
