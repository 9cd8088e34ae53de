"""Agents forked by the fork server land in their own Mininet node, carry the run's marker, and
`testbed clean PREFIX` finds them (what ``mnexec -a`` gave a freshly started agent)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from testbed.emulator.agent_forkserver import AgentForkServer, server_argv
from testbed.emulator.network import cleanup
from testbed.emulator.network.mininet import MininetNetwork
from testbed.emulator.network.probe import probe
from testbed.topology import parse_topology
from tests.conftest import wait_for

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(probe().missing()),
                                 reason="Mininet backend unavailable, missing: "
                                        + "; ".join(probe().missing()))]

WAIT_S = 60.0


def _netns(pid: int) -> int:
    return Path(f"/proc/{pid}/ns/net").stat().st_ino


def test_forked_agents_are_in_their_nodes_with_the_runs_marker(tmp_path):
    topo = parse_topology({
        "name": "forks",
        "network": {"backend": "mininet", "switches": ["ap0"],
                    "ps": {"switch": "ap0", "link": {"down": "1Gbit", "up": "1Gbit"}}},
        "devices": [{"group": "a", "profile": "snapdragon888", "count": 2, "switch": "ap0",
                     "link": {"down": "10Mbit", "up": "10Mbit"}}],
        "job": {"model": {"hidden": 64, "layers": 1, "heads": 1, "ffn": 64, "seq_len": 16}}})
    with MininetNetwork(topo) as net:
        server_log = tmp_path / "forkserver.log"
        with open(server_log, "ab") as out:
            proc = net.popen(None, server_argv(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=out)
        server = AgentForkServer(proc, server_log)
        try:
            agents = {}
            for device in topo.devices:
                log = tmp_path / f"{device.name}.log"
                # the PS's address inside the network, nobody listening: the agent retries
                agents[device.name] = (server.start(
                    ["--ps", f"{net.host_ip(None)}:1", "--name", device.name], log,
                    net.node_pid(device.name)), log)
            marker = f"{cleanup.ENV_MARKER}={net.prefix}".encode()
            found = cleanup.find_processes(net.prefix)
            for name, (agent, log) in agents.items():
                wait_for(lambda log=log: log.exists() and "joining again" in log.read_text(),
                         WAIT_S, f"{name}'s join attempt")
                node = net.node_pid(name)
                assert node is not None
                assert _netns(agent.pid) == _netns(node) != _netns(server.pid), name
                assert marker in Path(f"/proc/{agent.pid}/environ").read_bytes().split(b"\0")
                assert agent.pid in found, name
            for agent, _ in agents.values():
                agent.terminate()
                assert agent.wait(WAIT_S) == 0
        finally:
            server.close()
