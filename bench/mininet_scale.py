"""Benchmark: Mininet bring-up, agents joining, teardown, and memory per agent, at scale.

For each size N (default 50, 200, 500) this builds a star-of-stars topology (N devices spread over
access switches of at most 100 devices behind one core switch, every link shaped by HTB), brings it
up, starts the real parameter server (``python -m testbed.ps_backend``) in the PS's host and one
real emulated agent (a snapdragon888 phone) in every device host, as ``testbed up`` does (same
environment, the same flags from ``testbed.up.agent_argv``, see ``--launch`` below). The PS is told
to expect a million devices with a join timeout of an hour, so it waits and never sends work: the
agents stay idle (joined, heartbeats and telemetry only). (Not N + 1: the PS counts a device that
re-joined twice until the first registration's lease expires, and would then start training.) It
prints:

* bring-up time (``MininetNetwork.start``: hosts, links, bridges, addresses, tc);
* PS start: until the PS wrote ``ps.json`` (it listens);
* the time to start the N agent processes (``--launch forkserver``, the default: forks of the
  agent fork server, as ``testbed up`` starts them, the server started with the PS; ``--launch
  exec``: ``python -m testbed.agent`` through ``mnexec``, as before), and the time from starting
  the first agent until the PS's ``events.jsonl`` has a ``join`` of every device;
* memory per agent process, mean over all agents once they are idle: RSS, PSS (shared pages split
  between the sharers) and USS (pages only that process has); the largest RSS; the PS's RSS and a
  node shell's RSS;
* CPU seconds (user + system) per agent by then, and how many joins were re-joins (an agent whose
  stream broke, e.g. a lease that expired while the machine was overloaded);
* teardown time (``MininetNetwork.stop``: stopping PS and agents, namespaces, bridges).

Needs root and the Mininet tools (prints what is missing otherwise). Sizes whose estimated memory
(EST_BYTES_PER_DEVICE per device) does not fit in the available memory minus 4 GB are skipped.

    .venv/bin/python bench/mininet_scale.py [--sizes 50 200 500] [--settle-s 5] [--keep DIR]
        [--launch forkserver|exec]
    .venv/bin/python bench/mininet_scale.py --quick   # 20 devices, 2 s to settle
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from testbed.capacity import agent_cache_bytes
from testbed.emulator.agent_forkserver import AgentForkServer, server_argv
from testbed.emulator.network.mininet import MininetNetwork
from testbed.emulator.network.probe import probe
from testbed.topology import parse_topology
from testbed.up import agent_argv, child_env

EST_BYTES_PER_DEVICE = 32e6  # measured: ~26 MB USS per idle agent, ~3.4 MB per node shell
RESERVE_BYTES = 4e9  # left for everything else on the machine
JOIN_TIMEOUT_S = 600.0
NEVER_DEVICES = 1_000_000  # the PS waits for this many devices, i.e. for ever

log = logging.getLogger("bench.mininet_scale")


def topology_dict(n: int) -> dict[str, Any]:
    """N devices on ceil(N/100) access switches behind one core switch, and a tiny job."""
    aps = [f"ap{i}" for i in range((n + 99) // 100)]
    groups, left = [], n
    for ap in aps:
        count = min(100, left)
        left -= count
        groups.append({"group": f"g-{ap}", "profile": "snapdragon888", "count": count,
                       "switch": ap, "link": {"down": "100Mbit", "up": "20Mbit",
                                              "delay": "10ms"}})
    return {"name": f"scale-{n}", "seed": 1,
            "network": {"backend": "mininet", "switches": ["core", *aps],
                        "links": [{"switches": ["core", ap], "down": "1Gbit", "up": "1Gbit"}
                                  for ap in aps],
                        "ps": {"switch": "core", "link": {"down": "10Gbit", "up": "10Gbit"}}},
            "devices": groups,
            "job": {"model": {"hidden": 64, "layers": 1, "heads": 1, "ffn": 64, "seq_len": 16},
                    "steps": 1},
            "time_dilation": 1}


def joins(events: Path) -> tuple[int, int]:
    """(distinct devices that joined, join events) in the PS's events.jsonl so far."""
    try:
        lines = events.read_text().splitlines()
    except FileNotFoundError:
        return 0, 0
    names = []
    for line in lines:
        if '"event": "join"' in line:
            try:
                names.append(json.loads(line)["device"])
            except (ValueError, KeyError):  # a line being written
                continue
    return len(set(names)), len(names)


def wait_for(what: str, ready: Any, proc: subprocess.Popen, timeout_s: float) -> float:
    """Poll ready() until true; return the seconds it took; raise if proc died or time ran out."""
    t0 = time.monotonic()
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"the PS exited with {proc.returncode} before {what}")
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"no {what} within {timeout_s:g} s")
        time.sleep(0.1)
    return time.monotonic() - t0


def run(n: int, work: Path, settle_s: float, launch: str) -> dict[str, float]:
    """Bring up N device hosts with real idle agents against a waiting PS; return the figures."""
    raw = topology_dict(n)
    topo_path = work / f"scale-{n}.yaml"
    topo_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    run_dir = work / f"run-{n}"
    (run_dir / "agents").mkdir(parents=True)
    topology = parse_topology(raw)
    cache_bytes = agent_cache_bytes(topology.job)  # as testbed up's
    env = child_env(secrets.token_hex(16))
    net = MininetNetwork(topology, progress_every=100)
    server: AgentForkServer | None = None
    agents: list[Any] = []  # ForkedAgent or Popen: the same calls
    try:
        t0 = time.monotonic()
        net.start()
        bringup_s = time.monotonic() - t0
        if launch == "forkserver":  # as testbed up: it imports the agent while the PS starts
            with open(run_dir / "agents" / "forkserver.log", "wb") as out:
                server = AgentForkServer(net.popen(None, server_argv(), env=env,
                                                   stdin=subprocess.PIPE,
                                                   stdout=subprocess.PIPE, stderr=out))
        with open(run_dir / "ps.log", "wb") as out:
            ps = net.popen(None, [sys.executable, "-m", "testbed.ps_backend",
                                  "--topology", str(topo_path), "--run-dir", str(run_dir),
                                  "--listen", f"{net.ps_listen_host()}:0",
                                  # never reached (re-joins may count twice): no work is sent
                                  "--expect-devices", str(NEVER_DEVICES),
                                  "--join-timeout-s", "3600"],
                           env=env, stdout=out, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL)
        ps_start_s = wait_for("ps.json", (run_dir / "ps.json").exists, ps, 120)
        port = json.loads((run_dir / "ps.json").read_text())["port"]
        t1 = time.monotonic()
        for d in topology.devices:
            args = agent_argv(net, topology, d, port, cache_bytes, run_dir / "agents")
            log_path = run_dir / "agents" / f"{d.name}.log"
            if server is not None:
                agents.append(server.start(args, log_path, net.node_pid(d.name)))
                continue
            with open(log_path, "wb") as out:
                agents.append(net.popen(d.name, [sys.executable, "-m", "testbed.agent", *args],
                                        env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL))
        started_s = time.monotonic() - t1
        events = run_dir / "events.jsonl"
        joined_s = started_s + wait_for(f"{n} joins", lambda: joins(events)[0] >= n, ps,
                                        JOIN_TIMEOUT_S)
        dead = [a.pid for a in agents if a.poll() is not None]
        if dead:
            raise RuntimeError(f"{len(dead)} agent(s) exited; see {run_dir}/agents/")
        time.sleep(settle_s)  # idle: heartbeats and telemetry only
        dead = [a.pid for a in agents if a.poll() is not None]
        if dead or (run_dir / "steps.jsonl").read_text():
            raise RuntimeError(f"{len(dead)} agent(s) exited or the PS trained; see {run_dir}")
        procs = [psutil.Process(a.pid) for a in agents]
        mem = [p.memory_full_info() for p in procs]
        cpu = [sum(p.cpu_times()[:2]) for p in procs]
        distinct, join_events = joins(events)
        ps_rss = psutil.Process(ps.pid).memory_info().rss
        shells = [psutil.Process(h.pid).memory_info().rss for h in net.hosts.values()]
    finally:
        t2 = time.monotonic()
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.wait(30)
        if server is not None:
            server.close()
        net.stop()
        teardown_s = time.monotonic() - t2
    return {"n": n, "bringup_s": bringup_s, "ps_start_s": ps_start_s, "started_s": started_s,
            "joined_s": joined_s, "teardown_s": teardown_s,
            "rss_mb": statistics.mean(m.rss for m in mem) / 1e6,
            "pss_mb": statistics.mean(m.pss for m in mem) / 1e6,
            "uss_mb": statistics.mean(m.uss for m in mem) / 1e6,
            "max_rss_mb": max(m.rss for m in mem) / 1e6,
            "ps_rss_mb": ps_rss / 1e6, "shell_rss_mb": statistics.mean(shells) / 1e6,
            "agent_cpu_s": statistics.mean(cpu), "rejoins": join_events - distinct}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark for each size and print one line per size."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="devices, one line each (default 50 200 500; quick: 20)")
    parser.add_argument("--settle-s", type=float, default=None,
                        help="idle time after the last join before memory is read, seconds "
                             "(default 5; quick: 2)")
    parser.add_argument("--quick", action="store_true",
                        help="20 devices, 2 s to settle: a smoke run")
    parser.add_argument("--launch", choices=("forkserver", "exec"), default="forkserver",
                        help="agents forked by the fork server, as testbed up starts them "
                             "(default), or one python -m testbed.agent each")
    parser.add_argument("--keep", default="",
                        help="keep topologies and PS/agent logs in this (new) directory")
    args = parser.parse_args(argv)
    if args.sizes is None:
        args.sizes = [20] if args.quick else [50, 200, 500]
    if args.settle_s is None:
        args.settle_s = 2.0 if args.quick else 5.0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    missing = probe().missing()
    if missing:
        print(f"cannot run: missing {'; '.join(missing)}")
        return 1
    print(f"host: {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 1e9:.1f} GB; "
          f"delay mechanism: {probe().delay_mechanism}; agents ({args.launch}): "
          f"snapdragon888 phones with testbed up's flags, idle against a waiting PS")
    header = (f"{'devices':>7} {'bring-up s':>10} {'PS up s':>7} {'agents started s':>16} "
              f"{'all joined s':>12} {'teardown s':>10} {'RSS MB':>7} {'PSS MB':>7} "
              f"{'USS MB':>7} {'max RSS':>7} {'PS RSS':>7} {'shell RSS':>9} "
              f"{'agent CPU s':>11} {'re-joins':>8}")
    print(header, flush=True)
    with tempfile.TemporaryDirectory(prefix="mininet-scale-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for n in args.sizes:
            need = n * EST_BYTES_PER_DEVICE
            if need > psutil.virtual_memory().available - RESERVE_BYTES:
                print(f"{n:>7} skipped: ~{need / 1e9:.0f} GB estimated, more than the available "
                      f"memory minus {RESERVE_BYTES / 1e9:.0f} GB", flush=True)
                continue
            r = run(n, work, args.settle_s, args.launch)
            print(f"{r['n']:>7} {r['bringup_s']:>10.1f} {r['ps_start_s']:>7.1f} "
                  f"{r['started_s']:>16.1f} {r['joined_s']:>12.1f} {r['teardown_s']:>10.1f} "
                  f"{r['rss_mb']:>7.1f} {r['pss_mb']:>7.1f} {r['uss_mb']:>7.1f} "
                  f"{r['max_rss_mb']:>7.1f} {r['ps_rss_mb']:>7.1f} {r['shell_rss_mb']:>9.1f} "
                  f"{r['agent_cpu_s']:>11.2f} {r['rejoins']:>8}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
