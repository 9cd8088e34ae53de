"""What this machine can do for the Mininet backend, found out by trying, never by guessing.

:func:`probe` answers once per process (cached): are we root, are the programs there (``mnexec``
from the Debian ``mininet`` package, ``brctl`` from ``bridge-utils``, ``ip`` and ``tc`` from
``iproute2``, ``iperf3``), does the Python ``mininet`` package import, can we make a network
namespace, does the kernel have the ``htb`` and ``netem`` qdiscs and the ``u32`` classifier. The
qdisc probes run inside a throwaway anonymous network namespace (``unshare --net``) on its own
``lo``: the kernel deletes the namespace with the probing process, so nothing is left behind and
nothing outside is touched.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass

log = logging.getLogger(__name__)

PROGRAMS = ("mnexec", "brctl", "ip", "tc", "unshare")


@dataclass(frozen=True)
class Capabilities:
    """The answers of one probe; ``missing()`` names what stops the Mininet backend."""

    root: bool
    programs: dict[str, bool]
    mininet_python: bool
    netns: bool
    htb: bool
    netem: bool
    iperf3: bool
    u32: bool = False  # the u32 classifier: pure ACKs get their own class (mininet.tc_commands)

    def missing(self) -> list[str]:
        """Everything the Mininet backend needs that is not here, in words a user can act on."""
        out: list[str] = []
        if not self.root:
            out.append("root privileges (network namespaces and qdiscs need CAP_NET_ADMIN)")
        hints = {"mnexec": "mnexec (Debian package mininet)",
                 "brctl": "brctl (Debian package bridge-utils)",
                 "ip": "ip (Debian package iproute2)", "tc": "tc (Debian package iproute2)",
                 "unshare": "unshare (Debian package util-linux)"}
        out += [hints[p] for p, ok in self.programs.items() if not ok]
        if not self.mininet_python:
            out.append("the Python package mininet (pip install mininet)")
        if self.root and not self.netns:
            out.append("network namespaces (unshare --net failed)")
        if self.root and self.netns and not self.htb:
            out.append("the kernel's HTB qdisc (sch_htb)")
        return out

    @property
    def mininet_usable(self) -> bool:
        """True when the Mininet backend can start here."""
        return not self.missing()

    @property
    def delay_mechanism(self) -> str:
        """Where link delay and loss are applied: 'netem' (kernel) or 'application'."""
        return "netem" if self.netem else "application"

    def as_dict(self) -> dict[str, object]:
        """The answers as plain data for the run log."""
        return {"root": self.root, "programs": dict(self.programs),
                "mininet_python": self.mininet_python, "netns": self.netns, "htb": self.htb,
                "netem": self.netem, "iperf3": self.iperf3, "u32": self.u32}


def _in_scratch_netns(script: str) -> bool:
    """Run a shell script in a new, anonymous network namespace; True when it exits 0."""
    try:
        done = subprocess.run(["unshare", "--net", "sh", "-ec", script], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.debug("netns probe failed to run: %s", exc)
        return False
    if done.returncode != 0:
        log.debug("netns probe %r: exit %d: %s", script, done.returncode, done.stderr.strip())
    return done.returncode == 0


@functools.lru_cache(maxsize=1)
def probe() -> Capabilities:
    """Probe this machine once (cached for the process)."""
    root = os.geteuid() == 0
    programs = {p: shutil.which(p) is not None for p in PROGRAMS}
    mininet_python = importlib.util.find_spec("mininet") is not None
    can_try = root and programs["unshare"] and programs["ip"]
    netns = can_try and _in_scratch_netns("ip link set lo up")
    tc_ok = netns and programs["tc"]
    htb = tc_ok and _in_scratch_netns(
        "ip link set lo up; tc qdisc add dev lo root handle 1: htb default 1; "
        "tc class add dev lo parent 1: classid 1:1 htb rate 10mbit")
    netem = tc_ok and _in_scratch_netns("ip link set lo up; tc qdisc add dev lo root netem "
                                        "delay 1ms loss 1%")
    u32 = htb and _in_scratch_netns(
        "ip link set lo up; tc qdisc add dev lo root handle 1: htb default 1; "
        "tc class add dev lo parent 1: classid 1:1 htb rate 10mbit; "
        "tc filter add dev lo parent 1: protocol ip prio 1 u32 match ip protocol 6 0xff "
        "flowid 1:1")
    caps = Capabilities(root, programs, mininet_python, bool(netns), bool(htb), bool(netem),
                        shutil.which("iperf3") is not None, bool(u32))
    log.debug("network capabilities: %s", caps.as_dict())
    return caps
