"""Teardown of the Mininet backend leaves nothing: after a normal stop, and after the process that
started the network was SIGKILLed and `testbed clean PREFIX` ran.

Compares listings taken before, during and after: root-namespace interfaces (``ip -o link``),
named namespaces (``ip netns list``), network namespaces in use (``/proc/*/ns/net``) and processes.
Other engineers may create their own interfaces at the same time, so "nothing left" is checked as:
nothing with this run's prefix, none of this run's namespaces or pids, and ``ip netns`` unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import psutil
import pytest
import yaml

from testbed import cli
from testbed.emulator.network import cleanup
from testbed.emulator.network.mininet import MininetNetwork
from testbed.emulator.network.probe import probe
from testbed.topology import load_topology, parse_topology

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(probe().missing()),
                                 reason="Mininet backend unavailable, missing: "
                                        + "; ".join(probe().missing()))]

TOPOLOGY = {
    "name": "teardown",
    "network": {"backend": "mininet", "switches": ["core", "ap0", "ap1"],
                "links": [{"switches": ["core", "ap0"], "down": "1Gbit", "up": "1Gbit"},
                          {"switches": ["core", "ap1"], "down": "1Gbit", "up": "1Gbit"}],
                "ps": {"switch": "core", "link": {"down": "1Gbit", "up": "1Gbit"}}},
    "devices": [{"group": "a", "profile": "snapdragon888", "count": 3, "switch": "ap0",
                 "link": {"down": "10Mbit", "up": "2Mbit", "delay": "5ms", "queue": 50}},
                {"group": "b", "profile": "m2pro", "count": 2, "switch": "ap1",
                 "link": {"down": "100Mbit", "up": "50Mbit"}}],
    "job": {"model": {"hidden": 64, "layers": 1, "heads": 1, "ffn": 64, "seq_len": 16}},
}
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@dataclass(frozen=True)
class Listing:
    links: frozenset[str]  # root-namespace interface names
    named_netns: str  # `ip netns list`
    netns: frozenset[int]  # inodes of the network namespaces processes are in
    pids: frozenset[int]


def listing(started_before: float | None = None) -> Listing:
    """What exists now: root interfaces, named namespaces, namespaces in use, processes.

    ``started_before``: count only the namespaces of processes started before then. The kernel
    gives a new namespace the inode number of one freed (within a second here), so after a run
    another program's namespace may carry the number one of the run's had."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    links = frozenset(line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines())
    named = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    netns = set()
    for pid in psutil.pids():
        try:
            if started_before is None or psutil.Process(pid).create_time() <= started_before:
                netns.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
        except (OSError, psutil.Error):
            pass
    return Listing(links, named, frozenset(netns), frozenset(psutil.pids()))


def expected_root_links(prefix: str) -> set[str]:
    """Bridges and switch ports of TOPOLOGY under the naming plan (host ends are not in root)."""
    s0, s1, s2 = (f"{prefix}s{j}" for j in range(3))
    ports = {f"{s0}e1"}  # the PS
    ports |= {f"{s1}e{p}" for p in range(1, 4)} | {f"{s2}e{p}" for p in range(1, 3)}  # devices
    ports |= {f"{s0}e2", f"{s1}e4", f"{s0}e3", f"{s2}e3"}  # switch links core-ap0, core-ap1
    return {s0, s1, s2} | ports


def netns_of(pids: set[int]) -> set[int]:
    """The network namespaces (inodes) of these pids, without the root namespace."""
    out = set()
    for pid in pids:
        try:
            out.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
        except OSError:
            pass
    return out - {os.stat(f"/proc/{os.getpid()}/ns/net").st_ino}  # the test runs in the root


def assert_nothing_left(prefix: str, before: Listing, run_netns: set[int], pids: set[int],
                        ended_s: float) -> None:
    """Nothing of the run that ended at ``ended_s`` (its network stopped or cleaned) is left."""
    after = listing(started_before=ended_s)
    assert not [n for n in after.links if n.startswith(prefix)], after.links - before.links
    assert after.named_netns == before.named_netns
    assert run_netns, "the run's hosts had namespaces of their own"
    assert not (run_netns & after.netns), "a namespace of the run is still in use"
    assert not (pids & after.pids), f"processes of the run still alive: {pids & after.pids}"
    assert cleanup.find_leftovers(prefix).empty
    assert not cleanup.record_path(prefix).exists()


def test_normal_stop_leaves_nothing():
    before = listing()
    net = MininetNetwork(parse_topology(TOPOLOGY))
    net.start()
    try:
        prefix = net.prefix
        sleepers = {net.popen(d.name, SLEEPER).pid for d in net.topology.devices}
        sleepers.add(net.popen(None, SLEEPER).pid)
        shells = {h.pid for h in net.hosts.values()}
        during = listing()
        run_netns = netns_of(shells)
        assert len(run_netns) == len(net.topology.devices) + 1  # one per host
        assert netns_of(sleepers) <= run_netns  # popen runs inside the hosts
        new_links = {n for n in during.links - before.links if n.startswith(prefix)}
        assert new_links == expected_root_links(prefix)
        assert all(len(n) <= 15 for n in new_links)
        assert cleanup.find_leftovers(prefix).pids  # the sweep would see the run
    finally:
        net.stop()
    assert_nothing_left(prefix, before, run_netns, sleepers | shells, time.time())
    net.stop()  # a second stop is harmless


CHILD = textwrap.dedent("""
    import json, sys, time
    from testbed.topology import load_topology, parse_topology
    from testbed.emulator.network.mininet import MininetNetwork
    net = MininetNetwork(load_topology(sys.argv[1]))
    net.start()
    pids = [net.popen(d.name, [sys.executable, "-c", "import time; time.sleep(600)"]).pid
            for d in net.topology.devices]
    pids += [h.pid for h in net.hosts.values()]
    print(json.dumps({"prefix": net.prefix, "pids": pids}), flush=True)
    time.sleep(600)
""")


def test_sigkill_then_clean_leaves_nothing(tmp_path, capsys):
    path = tmp_path / "teardown.yaml"
    path.write_text(yaml.safe_dump(TOPOLOGY))
    load_topology(path)  # valid
    before = listing()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE,
                             text=True)
    try:
        line = child.stdout.readline()
        facts = json.loads(line)
        prefix, pids = facts["prefix"], set(facts["pids"])
        run_netns = netns_of(pids)
        # while its owner lives, the prefix is a run's network, not leftovers: refused, kept
        assert cli.main(["clean", prefix]) == 2
        assert "still running" in capsys.readouterr().err
        assert cleanup.find_leftovers(prefix).pids and cleanup.record_path(prefix).exists()
        assert all(psutil.pid_exists(pid) for pid in pids)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    left = cleanup.find_leftovers(prefix)
    assert left.pids and left.links, "a SIGKILLed run leaves things behind for clean to remove"
    record = [r for r in cleanup.run_records() if r["prefix"] == prefix]
    assert record and not record[0]["alive"]
    assert cli.main(["clean", prefix]) == 0
    assert prefix in capsys.readouterr().out
    assert_nothing_left(prefix, before, run_netns, pids, time.time())


def test_clean_refuses_a_malformed_prefix(capsys):
    assert cli.main(["clean", "e"]) == 2
    assert ("error: 'e' is neither a run directory nor a network prefix (expected a directory "
            f"made by testbed up, or {cleanup.PREFIX_FORM})") in capsys.readouterr().err


def test_up_killed_during_bringup_then_clean_run_dir_leaves_nothing(tmp_path):
    """SIGKILL `testbed up` while Mininet is building its hosts; `testbed clean RUN_DIR` then finds
    the prefix in network.json (written before the first host) and removes everything."""
    raw = dict(TOPOLOGY, devices=[dict(TOPOLOGY["devices"][0], count=120)])
    path = tmp_path / "bringup.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "runs"
    before = listing()
    up = subprocess.Popen([sys.executable, "-m", "testbed.cli", "up", str(path), "--no-live",
                           "--out", str(out)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        prefix = None
        while time.monotonic() < deadline and up.poll() is None:
            runs = list(out.glob("*/network.json")) if out.exists() else []
            if runs:
                prefix = json.loads(runs[0].read_text()).get("prefix")
                # the bridges exist once Mininet starts the switches; hosts are shaped after
                if prefix and f"{prefix}s0" in cleanup.find_links(prefix):
                    break
            time.sleep(0.02)
        assert prefix, "network.json with the prefix never appeared during bring-up"
        run_dir = runs[0].parent
        assert json.loads(runs[0].read_text()).get("state") == "starting", \
            "bring-up finished before the kill; the test needs it mid-way"
    finally:
        up.send_signal(signal.SIGKILL)
        up.wait()
    assert not (run_dir / "pids.json").exists() or \
        not json.loads((run_dir / "pids.json").read_text()).get("agents")
    assert not cleanup.find_leftovers(prefix).empty, "the kill left nothing: not mid-way"
    assert cli.main(["clean", str(run_dir)]) == 0
    left = cleanup.find_leftovers(prefix)
    assert left.empty, left
    after = listing()
    assert not [n for n in after.links if n.startswith(prefix)]
    assert after.named_netns == before.named_netns
    assert not cleanup.record_path(prefix).exists()
