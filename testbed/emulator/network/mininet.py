"""The Mininet backend: the PS and every device in its own network namespace, links shaped by tc.

Realizes a :class:`~testbed.topology.Topology` with Mininet's Python API: Linux-bridge switches
(``LinuxBridge``, no controller, no spanning tree), one Mininet ``Host`` per device and one for the
PS, plain veth links, and our own ``tc`` calls for shaping (Mininet's ``TCLink`` would need netem
for queue sizes and silently ignores rates above 1 Gbit).

Naming (every name of a run starts with the run prefix ``P`` = ``tb`` + 3 chars of [a-z0-9]; Linux
interface names have at most 15 characters, which this plan keeps up to 99,999 devices)::

    P                      run prefix, e.g. tbk3x (picked at random, unique among live runs)
    Pps                    the PS host                     e.g. tbk3xps
    Pd<i>                  device host, i = the device's index in Topology.devices (0-based)
    Pa<j>                  host of phone j of the ``adb:`` section's placements (its node name
                           is the phone's device name ``adb-<serial>``; address after the
                           devices': device_ip(len(devices) + j))
    Ps<j>                  switch j = network.switches[j]; a topology without switches gets one
                           implicit switch Ps0 that the PS and every device attach to
    <node>e<port>          an interface: a host's is <host>e0 (in the host's namespace), a
                           switch's ports are <switch>e1, e2, ... (root namespace, bridge ports)

Address plan: one flat 10.0.0.0/8 (each run's hosts live in their own namespaces, so runs do not
collide): the PS is 10.0.0.1, device i is 10.0.0.0 + (i + 2), i.e. 10.0.0.2, 10.0.0.3, ...

Which YAML key becomes which kernel setting (each on the *egress* of one end of a link)::

    direction            where the qdisc sits                       rate from
    down (PS -> device)  switch port facing the device              devices[*].link.down
    up   (device -> PS)  the device host's e0                       devices[*].link.up
    PS link, down        the PS host's e0                           network.ps.link.down
    PS link, up          switch port facing the PS                  network.ps.link.up
    switch link, down    port of the upper switch (nearer the PS)   network.links[*].down
    switch link, up      port of the lower switch                   network.links[*].up

On each of those egresses: ``htb`` root ``1:`` with one class ``1:1`` at ``rate = ceil =
wire_rate_bps(rate_bps) / dilation`` (tc unit ``bit``, i.e. bit/s: HTB charges whole frames, and a
topology's rate is the TCP payload's, :data:`~testbed.emulator.network.base.MSS_BYTES`), burst
max(two frames, 1 ms of the rate) (:data:`MIN_BURST_BYTES`). When the kernel has the u32
classifier, ``1:1`` has two children that share its rate, ``1:2`` (5 % assured, prio 0) for TCP
segments under 128 bytes (pure ACKs, HTTP/2 window updates and pings) and ``1:3`` (the rest, prio
1, the default) for everything else, each allowed the whole rate: a link is full duplex, as
topologies, the simulator and the bound take it, and a direction's ACKs must not wait behind the
other direction's queued data (docs/network.md, "Both ways at once"). Under each leaf, when the
kernel has netem: ``netem delay <delay_s * dilation> loss <loss %> limit <queue or 1000>``;
otherwise, when ``queue`` is given, ``pfifo limit <queue>`` (packets). Without netem, nothing drops
packets: a device's own link, both ways, is shaped at the smaller of its rate and what TCP gets
through its lossy path (:func:`~testbed.emulator.network.base.loss_cap_bps`, Mathis' rate, as the
simulators and the planner cap it), so every process in the host, an agent or a baseline's stage,
gets the same; the delay is the application's: :meth:`MininetNetwork.app_shaping` returns the whole
path's one-way delay, undilated (as the loopback backend returns it, so the agent treats both
alike). ``describe()`` states which mechanism is active. :meth:`MininetNetwork.set_dilation` moves
every egress to a new D in place (``tc class change``, and ``qdisc change`` for netem), between the
steps of an adaptive run (:mod:`testbed.emulator.link_dilation`).

Processes started with :meth:`MininetNetwork.popen` run in the node's namespace (``mnexec -a``) and
carry ``TESTBED_NET_PREFIX=P`` in their environment, which is how :mod:`.cleanup` finds them after
a crash.
"""

from __future__ import annotations

import logging
import math
import os
import random
import string
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from testbed.emulator.network import cleanup
from testbed.emulator.network.base import (
    FRAME_BYTES,
    AppShaping,
    loss_cap_bps,
    path_delay_s,
    wire_rate_bps,
)
from testbed.emulator.network.probe import Capabilities, probe
from testbed.topology import DeviceSpec, LinkSpec, Topology

log = logging.getLogger(__name__)

IFNAME_MAX = 15
# HTB classes of a shaped egress when small TCP segments go first (tc_commands): the share of
# the rate assured to them (an ACK per two full segments is ~2 % of the other way's data)
ACK_CLASS, DATA_CLASS, ACK_SHARE = 2, 3, 0.05
# An egress's bucket: 1 ms of its rate, and no less than two frames. What a bucket holds after
# an idle moment leaves at once, faster than the link: the 15 kB floor this had before let a
# 3.5 Mbit/s link pass 34 ms of its traffic at once, and a job of small tiles over such links ran
# 0.79-0.88 s a step against the simulator's 1.20 (docs/network.md, "A message after an idle
# moment").
MIN_BURST_BYTES = 2 * FRAME_BYTES
PS_IP = "10.0.0.1"
PREFIX_LEN = 8  # the /8 of the address plan
Progress = Callable[[str, int, int], None]  # (phase, done, total)


def device_ip(index: int) -> str:
    """The address of device `index` (0-based) in the 10.0.0.0/8 plan."""
    n = index + 2
    if n >= 1 << 24:
        raise ValueError(f"device index {index} does not fit in 10.0.0.0/8")
    return f"10.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"


def new_prefix(rng: random.Random | None = None) -> str:
    """A fresh run prefix 'tb' + 3 random chars of [a-z0-9]."""
    rng = rng or random.SystemRandom()
    return "tb" + "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(3))


@dataclass(frozen=True)
class Egress:
    """One shaped egress: an interface, its rate and (netem only) delay, loss, queue."""

    intf: str
    rate_bps: float
    delay_s: float
    loss_fraction: float
    queue_packets: int | None


TcCommands = Callable[[Egress, bool, bool], list[str]]  # tc_commands or tc_change_commands


def tc_commands(e: Egress, netem: bool, acks_first: bool) -> list[str]:
    """The tc commands (without the leading 'tc') that shape one egress (module docstring).

    ``acks_first`` (the kernel has the u32 classifier): two HTB classes share the rate, small
    TCP segments (under 128 bytes: pure ACKs, HTTP/2 window updates and pings) ahead of data.
    """
    leaves = [ACK_CLASS, DATA_CLASS] if acks_first else [1]
    cmds = [f"qdisc replace dev {e.intf} root handle 1: htb default {leaves[-1]}"]
    cmds += [f"class add {c}" for c in _htb_classes(e, acks_first)]
    if acks_first:  # IPv4, TCP, a 20-byte IP header, total length under 128 bytes
        cmds.append(f"filter add dev {e.intf} parent 1: protocol ip prio 1 u32 "
                    f"match ip protocol 6 0xff match u8 0x05 0x0f at 0 "
                    f"match u16 0x0000 0xff80 at 2 flowid 1:{ACK_CLASS}")
    for leaf in leaves:
        if netem and (e.delay_s > 0 or e.loss_fraction > 0):
            cmds.append(f"qdisc add {_netem(e, leaf)}")
        elif e.queue_packets:
            cmds.append(f"qdisc add dev {e.intf} parent 1:{leaf} handle {10 + leaf}: pfifo "
                        f"limit {e.queue_packets}")
    return cmds


def tc_change_commands(e: Egress, netem: bool, acks_first: bool) -> list[str]:
    """The tc commands that move an egress :func:`tc_commands` shaped to ``e``'s rate (and,
    with netem, delay) in place: its queued packets stay (a new D between steps)."""
    cmds = [f"class change {c}" for c in _htb_classes(e, acks_first)]
    if netem and (e.delay_s > 0 or e.loss_fraction > 0):
        cmds += [f"qdisc change {_netem(e, leaf)}"
                 for leaf in ([ACK_CLASS, DATA_CLASS] if acks_first else [1])]
    return cmds


def _htb_classes(e: Egress, acks_first: bool) -> list[str]:
    """The HTB classes of one egress, after the verb (``class add`` or ``class change``)."""
    rate = max(1, round(e.rate_bps))
    burst_bytes = max(MIN_BURST_BYTES, round(e.rate_bps / 8 * 1e-3))
    burst = f"burst {burst_bytes}b cburst {burst_bytes}b"
    classes = [f"dev {e.intf} parent 1: classid 1:1 htb rate {rate}bit ceil {rate}bit {burst}"]
    if acks_first:
        # a child class at its own rate sends without asking its parent: the two rates must
        # add up to the link's, and each may borrow the rest of it
        acks = max(1, round(rate * ACK_SHARE))
        classes += [f"dev {e.intf} parent 1:1 classid 1:{ACK_CLASS} htb rate {acks}bit "
                    f"ceil {rate}bit prio 0 {burst}",
                    f"dev {e.intf} parent 1:1 classid 1:{DATA_CLASS} htb rate "
                    f"{max(1, rate - acks)}bit ceil {rate}bit prio 1 {burst}"]
    return classes


def _netem(e: Egress, leaf: int) -> str:
    return (f"dev {e.intf} parent 1:{leaf} handle {10 + leaf}: netem delay "
            f"{e.delay_s * 1e6:.0f}us loss {e.loss_fraction * 100:.6f}% "
            f"limit {e.queue_packets or 1000}")


class MininetNetwork:
    """A topology realized as Mininet hosts and Linux bridges; see the module docstring."""

    kind = "mininet"

    def __init__(self, topology: Topology, prefix: str | None = None, dilation: float = 1.0,
                 capabilities: Capabilities | None = None, progress: Progress | None = None,
                 progress_every: int = 50):
        if dilation < 1:
            raise ValueError(f"dilation must be >= 1, got {dilation}")
        self.topology = topology
        self.caps = capabilities or probe()
        self.dilation = dilation
        self.progress = progress
        self.progress_every = progress_every
        self._requested_prefix = cleanup.check_prefix(prefix) if prefix else None
        self.prefix = ""
        self.net: Any = None
        self.hosts: dict[str | None, Any] = {}  # None = the PS
        self.device_port: dict[str, str] = {}  # device name -> its switch port (root ns)
        self.procs: list[subprocess.Popen] = []
        # the shaped egresses (switch ports in the root namespace; each host's e0 by node) and
        # each interface's topology rate and link, to shape them again for a new D
        self.root_egress: list[Egress] = []
        self.host_egress: dict[str | None, Egress] = {}
        self.nominal: dict[str, tuple[float, LinkSpec]] = {}
        self.started = False
        self.bringup_s = 0.0
        self.teardown_s = 0.0

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> MininetNetwork:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Bring the network up (idempotent); on any failure remove what was made and raise."""
        if self.started:
            return
        missing = self.caps.missing()
        if missing:
            raise RuntimeError("the Mininet backend cannot run here; missing: " +
                               "; ".join(missing))
        t0 = time.monotonic()
        self._claim_prefix()
        try:
            self._build()
        except BaseException as exc:
            log.error("%s: bring-up failed (%s); removing what was made", self.prefix, exc)
            self.stop()
            if isinstance(exc, Exception):
                raise RuntimeError(f"Mininet bring-up failed: {exc}") from exc
            raise
        self.started = True
        self.bringup_s = time.monotonic() - t0
        log.info("%s: network up: %d hosts, %d switches in %.1f s (rate: htb, delay/loss: %s)",
                 self.prefix, len(self.hosts), len(self.net.switches), self.bringup_s,
                 self.caps.delay_mechanism)

    def stop(self) -> None:
        """Remove exactly this run's processes, hosts, switches and interfaces (safe twice)."""
        if not self.prefix:
            return
        t0 = time.monotonic()
        live = [p.pid for p in self.procs if p.poll() is None]
        if live:
            cleanup.kill_pids(live)
        for p in self.procs:
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        if self.net is not None:
            for node in list(self.net.hosts) + list(self.net.switches):
                try:
                    node.terminate()  # SIGHUP to the node's shell; its namespace then dies
                except OSError as exc:
                    log.debug("%s: terminate %s: %s", self.prefix, node.name, exc)
        left = cleanup.remove_leftovers(self.prefix)
        if not left.empty:
            log.debug("%s: swept %d process(es) and %d interface(s)", self.prefix,
                      len(left.pids), len(left.links))
        self.teardown_s = time.monotonic() - t0
        log.info("%s: network down in %.1f s", self.prefix, self.teardown_s)
        self.net = None
        self.hosts.clear()
        self.started = False
        self.prefix = ""

    def _claim_prefix(self) -> None:
        info = {"topology": self.topology.name, "backend": "mininet"}
        if self._requested_prefix:
            if not cleanup.claim_run(self._requested_prefix, info):
                raise RuntimeError(f"run prefix {self._requested_prefix} is already in use "
                                   f"(see {cleanup.record_path(self._requested_prefix)})")
            self.prefix = self._requested_prefix
            return
        for _ in range(50):
            prefix = new_prefix()
            if not cleanup.find_links(prefix) and cleanup.claim_run(prefix, info):
                self.prefix = prefix
                return
        raise RuntimeError("could not find a free run prefix after 50 tries")

    # -- building ---------------------------------------------------------------------------

    def _names(self) -> tuple[dict[str, str], str]:
        P = self.prefix
        declared = self.topology.network.switches or ("default",)
        return {s: f"{P}s{j}" for j, s in enumerate(declared)}, declared[0]

    def _build(self) -> None:
        from mininet.link import Link
        from mininet.log import lg
        from mininet.net import Mininet
        from mininet.node import Host
        from mininet.nodelib import LinuxBridge

        lg.setLogLevel("error")  # not its br_netfilter notes: bridging works here
        P = self.prefix
        topo = self.topology
        switch_name, default_switch = self._names()
        devices = topo.devices
        longest = max([f"{P}d{len(devices)}e0", f"{P}s{len(switch_name)}e{len(devices) + 9}"],
                      key=len)
        if len(longest) > IFNAME_MAX:
            raise RuntimeError(f"interface name {longest!r} would exceed {IFNAME_MAX} characters")
        net = Mininet(topo=None, switch=LinuxBridge, controller=None, host=Host, link=Link,
                      build=False, inNamespace=False, autoSetMacs=False, waitConnected=False)
        self.net = net
        switches = {s: net.addSwitch(name, stp=False) for s, name in switch_name.items()}
        ports = {s: 0 for s in switches}
        egress: list[Egress] = []  # root namespace (switch ports)
        host_egress: dict[str | None, Egress] = {}

        def link(host: Any, sw: str, up_link: LinkSpec, host_rate_bps: float,
                 port_rate_bps: float) -> str:
            ports[sw] += 1
            port = f"{switch_name[sw]}e{ports[sw]}"
            net.addLink(host, switches[sw], intfName1=f"{host.name}e0", intfName2=port)
            egress.append(self._egress(port, port_rate_bps, up_link))
            return port

        total = len(devices) + 1
        self._report("hosts", 0, total)
        ps = net.addHost(f"{P}ps", ip=f"{PS_IP}/{PREFIX_LEN}")
        self.hosts[None] = ps
        ps_link = topo.network.ps.link
        link(ps, topo.network.ps.switch or default_switch, ps_link, ps_link.down_bps,
             ps_link.up_bps)
        host_egress[None] = self._egress(f"{ps.name}e0", ps_link.down_bps, ps_link)
        for i, device in enumerate(devices):
            h = net.addHost(f"{P}d{i}", ip=f"{device_ip(i)}/{PREFIX_LEN}")
            self.hosts[device.name] = h
            dl = device.link
            # without netem nothing drops packets: the kernel carries what TCP would get
            # through the lossy path instead, for every process in the host (agents, baselines)
            cap = math.inf if self.caps.netem else loss_cap_bps(topo, device)
            self.device_port[device.name] = link(h, device.group.switch or default_switch, dl,
                                                 min(dl.up_bps, cap), min(dl.down_bps, cap))
            host_egress[device.name] = self._egress(f"{h.name}e0", min(dl.up_bps, cap), dl)
            if (i + 2) % self.progress_every == 0:
                self._report("hosts", i + 2, total)
        for j, (name, switch, pl) in enumerate(self.phone_places()):
            h = net.addHost(f"{P}a{j}", ip=f"{device_ip(len(devices) + j)}/{PREFIX_LEN}")
            self.hosts[name] = h
            self.device_port[name] = link(h, switch or default_switch, pl, pl.up_bps,
                                          pl.down_bps)
            host_egress[name] = self._egress(f"{h.name}e0", pl.up_bps, pl)
        self._report("hosts", total, total)
        for sl in topo.network.links:
            ports[sl.upper] += 1
            ports[sl.lower] += 1
            up_port = f"{switch_name[sl.upper]}e{ports[sl.upper]}"
            low_port = f"{switch_name[sl.lower]}e{ports[sl.lower]}"
            net.addLink(switches[sl.upper], switches[sl.lower], intfName1=up_port,
                        intfName2=low_port)
            egress.append(self._egress(up_port, sl.link.down_bps, sl.link))
            egress.append(self._egress(low_port, sl.link.up_bps, sl.link))
        self._report("configure", 0, total)
        net.build()  # addresses on every host (ifconfig in each namespace)
        net.start()  # brctl addbr/addif, bridges up
        self.root_egress, self.host_egress = egress, host_egress
        self._shape_all(tc_commands)
        self._report("shape", len(host_egress), len(host_egress))

    def phone_places(self) -> list[tuple[str, str | None, LinkSpec]]:
        """(node name, switch, link) of each phone the topology's ``adb:`` section places."""
        spec = self.topology.extra.get("adb")
        if spec is None or not getattr(spec, "enabled", False):
            return []
        return [(p.name, p.switch, p.link)
                for p in getattr(spec, "placements", ())]

    def interface_counters(self, node: str | None) -> dict[str, Any]:
        """Byte and packet counters of a node's interface, read from its namespace."""
        host = self._host(node)
        intf = f"{host.name}e0"
        # /proc/PID/net/dev lists the interfaces of PID's network namespace
        for line in open(f"/proc/{host.pid}/net/dev").read().splitlines()[2:]:
            name, _, rest = line.partition(":")
            if name.strip() == intf:
                f = [int(x) for x in rest.split()]
                return {"intf": intf, "host_pid": host.pid, "rx_bytes": f[0], "rx_packets": f[1],
                        "tx_bytes": f[8], "tx_packets": f[9]}
        raise KeyError(f"no interface {intf} in host {host.name}")

    def _egress(self, intf: str, rate_bps: float, spec: LinkSpec) -> Egress:
        self.nominal[intf] = (rate_bps, spec)  # set_dilation shapes it again from these
        return Egress(intf, wire_rate_bps(rate_bps) / self.dilation, spec.delay_s * self.dilation,
                      spec.loss_fraction, spec.queue_packets)

    def _shape_all(self, commands: TcCommands) -> None:
        """Shape every egress: the switch ports in one tc batch, then each host's own."""
        self._shape_root(self.root_egress, commands)
        for n, (node, e) in enumerate(self.host_egress.items(), start=1):
            self._shape_host(self.hosts[node], e, commands)
            if n % self.progress_every == 0:
                self._report("shape", n, len(self.host_egress))

    def _shape_root(self, egress: list[Egress], commands: TcCommands) -> None:
        batch = "".join(c + "\n" for e in egress
                        for c in commands(e, self.caps.netem, self.caps.u32))
        done = subprocess.run(["tc", "-batch", "-"], input=batch, capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"tc on the switch ports failed: {done.stderr.strip()}")

    def _shape_host(self, host: Any, e: Egress, commands: TcCommands) -> None:
        script = " && ".join(f"tc {c}" for c in commands(e, self.caps.netem, self.caps.u32))
        out = host.cmd(f"{script} && echo TC-OK")
        if "TC-OK" not in out:
            raise RuntimeError(f"tc in host {host.name} failed: {out.strip()}")

    def set_dilation(self, dilation: float) -> None:
        """Shape every egress for a new D in place (rates / D, netem delays x D; queued packets
        stay): the PS changes D between steps when it is adaptive, and the kernel's links must
        follow as the agents' clocks and application-level delays do."""
        if dilation < 1:
            raise ValueError(f"dilation must be >= 1, got {dilation}")
        if not self.started:
            raise RuntimeError("the network is not started")
        t0 = time.monotonic()
        self.dilation = dilation
        self.root_egress = [self._egress(e.intf, *self.nominal[e.intf]) for e in self.root_egress]
        self.host_egress = {node: self._egress(e.intf, *self.nominal[e.intf])
                            for node, e in self.host_egress.items()}
        self._shape_all(tc_change_commands)
        log.info("%s: links shaped for time dilation %.4g in %.2f s", self.prefix, dilation,
                 time.monotonic() - t0)

    def _report(self, phase: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(phase, done, total)
        if total >= self.progress_every or done == total:
            log.info("%s: %s %d/%d", self.prefix, phase, done, total)

    # -- the Network protocol ---------------------------------------------------------------

    def ps_listen_host(self) -> str:
        """The PS host's address (the PS binds here, inside its namespace)."""
        return PS_IP

    def ps_address_for(self, device: DeviceSpec) -> str:
        """Every device reaches the PS at its address; the bridges forward."""
        return PS_IP

    def host_ip(self, node: str | None) -> str:
        """The address of a node: None for the PS, else a device name."""
        if node is None:
            return PS_IP
        return self._host(node).IP()

    def node_name(self, node: str | None) -> str:
        """The Mininet host name of a node (None = the PS)."""
        return self._host(node).name

    def _host(self, node: str | None) -> Any:
        if not self.started:
            raise RuntimeError("the network is not started")
        try:
            return self.hosts[node]
        except KeyError:
            raise KeyError(f"no node {node!r} in this network") from None

    def popen(self, node: str | None, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start argv inside a node's namespace (None = the PS); stop() ends it."""
        host = self._host(node)
        env = dict(kwargs.pop("env", None) or os.environ)
        env[cleanup.ENV_MARKER] = self.prefix
        proc = subprocess.Popen(["mnexec", "-a", str(host.pid), *argv], env=env, **kwargs)
        self.procs.append(proc)
        return proc

    def node_pid(self, node: str | None) -> int | None:
        """The node's shell: its namespaces are the node's (what ``mnexec -a`` joins)."""
        return int(self._host(node).pid)

    def app_shaping(self, device: DeviceSpec) -> AppShaping:
        """Rates are in the kernel (HTB), and so is loss: netem's, else the rate TCP gets
        through the lossy path (:func:`loss_cap_bps`) on the device's link; delay is netem's,
        else the app's."""
        if self.caps.netem:
            return AppShaping()
        return AppShaping(delay_s=path_delay_s(self.topology, device))

    def set_partitioned(self, device: DeviceSpec, partitioned: bool) -> bool:
        """Take the device's switch port down (partitioned) or up again."""
        port = self.device_port[device.name]
        state = "down" if partitioned else "up"
        subprocess.run(["ip", "link", "set", "dev", port, state], check=True,
                       capture_output=True)
        log.info("%s: %s link %s (%s)", self.prefix, device.name, state, port)
        return True

    def describe(self) -> dict[str, Any]:
        """Facts for the run log and summary.json."""
        mech = self.caps.delay_mechanism
        return {"backend": "mininet", "prefix": self.prefix, "switch": "linux-bridge",
                "controller": None, "hosts": len(self.hosts),
                "rate": "htb, small TCP segments first" if self.caps.u32 else "htb",
                "delay": mech,
                "loss": "netem" if self.caps.netem else "rate (TCP under loss, in htb)",
                "queue": "netem limit" if self.caps.netem else "pfifo (when set)",
                "dilation": self.dilation, "address_plan": f"10.0.0.0/8, PS {PS_IP}",
                "bringup_s": round(self.bringup_s, 3)}
