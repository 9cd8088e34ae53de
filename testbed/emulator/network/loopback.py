"""The loopback backend: every process on 127.0.0.1, every link emulated in the application.

Needs no privileges. Each device's agent applies its own link (rate per direction, the one-way
delay of its whole path to the PS, loss). Switch-to-switch links are not shared here: a shared
uplink becomes a real bottleneck only on the Mininet backend; their delays and losses do count.
"""

from __future__ import annotations

import subprocess
from typing import Any, Sequence

from testbed.emulator.network.base import AppShaping, path_delay_s, path_loss
from testbed.topology import DeviceSpec, Topology


class LoopbackNetwork:
    kind = "loopback"

    def __init__(self, topology: Topology):
        self.topology = topology
        self.partitioned: set[str] = set()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def ps_listen_host(self) -> str:
        return "127.0.0.1"

    def ps_address_for(self, device: DeviceSpec) -> str:
        return "127.0.0.1"

    def popen(self, node: str | None, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(list(argv), **kwargs)

    def node_pid(self, node: str | None) -> int | None:
        return None  # every node is this machine's own namespace

    def app_shaping(self, device: DeviceSpec) -> AppShaping:
        return AppShaping(down_bps=device.link.down_bps, up_bps=device.link.up_bps,
                          delay_s=path_delay_s(self.topology, device),
                          loss_fraction=path_loss(self.topology, device))

    def set_partitioned(self, device: DeviceSpec, partitioned: bool) -> bool:
        return False  # the agent blackholes its own traffic

    def set_dilation(self, dilation: float) -> None:
        pass  # every link is the application's, and the agents follow the PS's D

    def describe(self) -> dict[str, Any]:
        return {"backend": "loopback", "rate": "application", "delay": "application",
                "loss": "application"}
