"""Loopback ports a test may name before anything listens on them.

A port bound to 0 and then released comes from the kernel's ephemeral range, where any
connection of another test (or a client retrying in a loop, which can even connect to itself)
may take it before the test uses it. These come from outside that range, read from
/proc/sys/net/ipv4/ip_local_port_range, so only a socket bound to that very number can."""

from __future__ import annotations

import random
import socket
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral ports (Linux's default 32768-60999 when unreadable)."""
    try:
        low, high = (int(x) for x in RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive loopback ports, all free now, outside the
    ephemeral range (below it when there is room, else above it)."""
    low, high = ephemeral_range()
    if low - count > 10000:
        choices = range(10000, low - count)
    else:
        choices = range(high + 1, 65536 - count)
    for _ in range(200):
        base = random.choice(choices)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} free loopback port(s) in a row outside {low}-{high}")
