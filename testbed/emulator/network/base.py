"""What a network backend is: the object that realizes a topology's network.

``testbed up`` talks to a backend only through :class:`Network`. A backend places the PS and
every device on a node (the loopback backend: this machine's 127.0.0.1; the Mininet backend: one
network namespace per host), starts processes there, and reports which parts of each link it
cannot enforce in the kernel: those come back as :class:`AppShaping` and the agent applies them
in the application (token bucket per direction, one-way delay, loss), as DESIGN.md §6 says.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from testbed.agent.link import mathis_rate_bps
from testbed.topology import DeviceSpec, SwitchLink, Topology

# A topology's link rate is what the application's bytes get: a saturated TCP flow's payload,
# as the loopback backend (the agent's token bucket counts messages), the simulator, the planner
# and the bound all count it. A kernel shaper charges whole Ethernet frames: a full-size segment
# (MTU 1500; 1448 payload bytes behind 20 of IP and 32 of TCP with timestamps, 14 of Ethernet)
# is a 1514-byte frame, so the kernel's rate is the topology's times FRAME_BYTES / MSS_BYTES
# (HTB at the topology's rate gave the payload 0.956 of it: docs/network.md, "A rate is the
# payload's").
MSS_BYTES = 1448
FRAME_BYTES = 1514


def wire_rate_bps(payload_bps: float) -> float:
    """The rate a kernel shaper that charges frames needs for ``payload_bps`` of TCP payload."""
    return payload_bps * FRAME_BYTES / MSS_BYTES


@dataclass(frozen=True)
class AppShaping:
    """Link behaviour the application must emulate for one device (None/0 = the kernel does it)."""

    down_bps: float | None = None  # PS -> device
    up_bps: float | None = None  # device -> PS
    delay_s: float = 0.0  # one-way, each direction
    loss_fraction: float = 0.0

    def argv(self) -> list[str]:
        """The agent's command-line flags that apply this shaping."""
        out: list[str] = []
        if self.down_bps:
            out += ["--down-bps", repr(self.down_bps)]
        if self.up_bps:
            out += ["--up-bps", repr(self.up_bps)]
        if self.delay_s:
            out += ["--delay-s", repr(self.delay_s)]
        if self.loss_fraction:
            out += ["--loss", repr(self.loss_fraction)]
        return out


class Network(Protocol):
    kind: str  # "loopback" or "mininet"

    def start(self) -> None:
        """Bring the network up (idempotent). Raise RuntimeError with a clear message on failure."""
        ...

    def stop(self) -> None:
        """Remove exactly what start() created. Safe to call twice and after a failed start."""
        ...

    def ps_listen_host(self) -> str:
        """Address the PS binds to."""
        ...

    def ps_address_for(self, device: DeviceSpec) -> str:
        """Address a device dials to reach the PS."""
        ...

    def popen(self, node: str | None, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start a process on a node: None for the PS's node, else a device name."""
        ...

    def node_pid(self, node: str | None) -> int | None:
        """The pid whose network and mount namespaces a process on this node joins; None when
        a process of this machine's own namespaces is on the node already (loopback). How
        the agent fork server places each agent it forks."""
        ...

    def app_shaping(self, device: DeviceSpec) -> AppShaping:
        """What of this device's path the application must still emulate."""
        ...

    def set_partitioned(self, device: DeviceSpec, partitioned: bool) -> bool:
        """Take a device's link down (True) or up; False if the backend cannot (the app does)."""
        ...

    def set_dilation(self, dilation: float) -> None:
        """Follow a new time dilation D (between steps): what this backend shapes in the kernel
        moves to it; what the application shapes follows the PS's announcement by itself."""
        ...

    def describe(self) -> dict[str, Any]:
        """Facts for the run log and summary.json: backend, delay mechanism, ..."""
        ...


def switch_path(topology: Topology, switch: str | None) -> list[SwitchLink]:
    """The switch links from ``switch`` up the tree to the PS's switch, nearest first (none
    from the PS's own switch, or for no switch)."""
    parents = {link.lower: link for link in topology.network.links}
    path: list[SwitchLink] = []
    while switch in parents:
        path.append(parents[switch])
        switch = parents[switch].upper
    return path


def path_delay_s(topology: Topology, device: DeviceSpec) -> float:
    """One-way delay from the PS to a device: its own link, the switch links, the PS's link."""
    delay = device.link.delay_s + topology.network.ps.link.delay_s
    for sl in switch_path(topology, device.group.switch):
        delay += sl.link.delay_s
    return delay


def path_loss(topology: Topology, device: DeviceSpec) -> float:
    """Loss probability on the whole PS-device path (independent losses per hop)."""
    keep = (1 - device.link.loss_fraction) * (1 - topology.network.ps.link.loss_fraction)
    for sl in switch_path(topology, device.group.switch):
        keep *= 1 - sl.link.loss_fraction
    return 1 - keep


def loss_cap_bps(topology: Topology, device: DeviceSpec) -> float:
    """What TCP gets through the device's lossy path (inf: no loss, or no delay): Mathis' rate
    for the path's round trip and loss. Every part that models loss caps the device's own link
    at this rate, both ways: the simulators, the planner and the bound, the agent on loopback,
    the Mininet backend's kernel rates without netem (with netem the kernel drops packets)."""
    return mathis_rate_bps(path_delay_s(topology, device), path_loss(topology, device))


def loss_without_delay(topology: Topology) -> list[str]:
    """The device groups whose path has loss but no delay: Mathis' rate needs a round trip, so
    their loss caps nothing anywhere but in a kernel with netem. Notes, not errors: a run with
    them is still a valid run (TCP at a sub-millisecond round trip barely feels 1 % loss)."""
    out = []
    for i, group in enumerate(topology.groups):
        first = DeviceSpec(f"{group.group}-0", 0, group)  # a group's devices share one path
        loss = path_loss(topology, first)
        if group.count and loss > 0 and path_delay_s(topology, first) <= 0:
            out.append(f"note: devices[{i}] ({group.group}): its path to the PS has a loss of "
                       f"{100 * loss:g}% and no delay, which caps no rate: TCP's rate under "
                       "loss is MSS/RTT x sqrt(3/(2p)) (docs/network.md), so the simulator and "
                       "an emulation without netem apply none; give the path a delay")
    return out
