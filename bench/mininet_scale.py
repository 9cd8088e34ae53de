"""Benchmark: Mininet bring-up time, teardown time and memory per device host.

For each size N (default 50, 200, 500) this builds a star-of-stars topology (N devices spread over
access switches of at most 100 devices behind one core switch, every link shaped by HTB), brings it
up, starts one idle stand-in agent per device host (a Python process that imports numpy and grpc,
says "ready" and sleeps: the real agent's import footprint without its protocol work; replace it
with ``python -m testbed.agent`` once that exists), and prints:

* bring-up time (``MininetNetwork.start``: hosts, links, bridges, addresses, tc),
* the time until every stand-in agent reported ready,
* resident memory per agent process: RSS, PSS (shared pages split between the sharers) and USS
  (pages only that process has), mean over all agents; plus the node shell (bash) RSS,
* teardown time (``MininetNetwork.stop``, including stopping the agents).

Needs root and the Mininet tools (prints what is missing otherwise). Sizes whose estimated memory
(30 MB per device) does not fit in the available memory minus 4 GB are skipped with a note.

    .venv/bin/python bench/mininet_scale.py [--sizes 50 200 500]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import time

import psutil

from testbed.emulator.network.mininet import MininetNetwork
from testbed.emulator.network.probe import probe
from testbed.topology import parse_topology

STAND_IN = [sys.executable, "-c",
            "import numpy, grpc, sys, time; print('ready', flush=True); time.sleep(3600)"]
EST_BYTES_PER_DEVICE = 30e6  # measured: ~20 MB USS per stand-in agent, ~3 MB per shell
RESERVE_BYTES = 4e9  # left for everything else on the machine


def topology(n: int):
    """N devices on ceil(N/100) access switches behind one core switch."""
    aps = [f"ap{i}" for i in range((n + 99) // 100)]
    groups, left = [], n
    for ap in aps:
        count = min(100, left)
        left -= count
        groups.append({"group": f"g-{ap}", "profile": "snapdragon888", "count": count,
                       "switch": ap, "link": {"down": "100Mbit", "up": "20Mbit",
                                              "delay": "10ms"}})
    return parse_topology({
        "name": f"scale-{n}",
        "network": {"backend": "mininet", "switches": ["core", *aps],
                    "links": [{"switches": ["core", ap], "down": "1Gbit", "up": "1Gbit"}
                              for ap in aps],
                    "ps": {"switch": "core", "link": {"down": "10Gbit", "up": "10Gbit"}}},
        "devices": groups,
        "job": {"model": {"hidden": 64, "layers": 1, "heads": 1, "ffn": 64, "seq_len": 16}}})


def run(n: int) -> dict[str, float]:
    """Bring up N device hosts with idle stand-in agents; return the measured figures."""
    net = MininetNetwork(topology(n), progress_every=100)
    try:
        t0 = time.monotonic()
        net.start()
        bringup_s = time.monotonic() - t0
        t1 = time.monotonic()
        agents = [net.popen(d.name, STAND_IN, stdout=subprocess.PIPE, text=True)
                  for d in net.topology.devices]
        for a in agents:
            if a.stdout.readline().strip() != "ready":
                raise RuntimeError(f"stand-in agent {a.pid} did not start")
        ready_s = time.monotonic() - t1
        mem = [psutil.Process(a.pid).memory_full_info() for a in agents]
        shells = [psutil.Process(h.pid).memory_info().rss for h in net.hosts.values()]
    finally:
        t2 = time.monotonic()
        net.stop()
        teardown_s = time.monotonic() - t2
    return {"n": n, "bringup_s": bringup_s, "agents_ready_s": ready_s, "teardown_s": teardown_s,
            "rss_mb": statistics.mean(m.rss for m in mem) / 1e6,
            "pss_mb": statistics.mean(m.pss for m in mem) / 1e6,
            "uss_mb": statistics.mean(m.uss for m in mem) / 1e6,
            "shell_rss_mb": statistics.mean(shells) / 1e6}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark for each size and print one line per size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 200, 500])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    missing = probe().missing()
    if missing:
        print(f"cannot run: missing {'; '.join(missing)}")
        return 1
    print(f"host: {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 1e9:.1f} GB; "
          f"delay mechanism: {probe().delay_mechanism}; stand-in agent: numpy + grpc, idle")
    header = (f"{'devices':>7} {'bring-up s':>10} {'agents ready s':>14} {'teardown s':>10} "
              f"{'RSS MB/agent':>12} {'PSS MB/agent':>12} {'USS MB/agent':>12} "
              f"{'shell RSS MB':>12}")
    print(header, flush=True)
    for n in args.sizes:
        need = n * EST_BYTES_PER_DEVICE
        if need > psutil.virtual_memory().available - RESERVE_BYTES:
            print(f"{n:>7} skipped: ~{need / 1e9:.0f} GB estimated, more than the available "
                  f"memory minus {RESERVE_BYTES / 1e9:.0f} GB")
            continue
        r = run(n)
        print(f"{r['n']:>7} {r['bringup_s']:>10.1f} {r['agents_ready_s']:>14.1f} "
              f"{r['teardown_s']:>10.1f} {r['rss_mb']:>12.1f} {r['pss_mb']:>12.1f} "
              f"{r['uss_mb']:>12.1f} {r['shell_rss_mb']:>12.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
