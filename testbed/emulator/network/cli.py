"""Sub-commands of the network part: ``testbed net check TOPOLOGY``.

``net check`` exits 0 when every measured link is within the tolerance, 1 when one is not or the
network cannot start, 2 on bad input. (``testbed clean``, which also removes a run's network
leftovers, lives in :mod:`testbed.up`.)
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from testbed.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK
from testbed.names import is_name
from testbed.topology import DeviceSpec, TopologyError, load_topology
from testbed.units import int_arg, number_arg
from testbed.user_paths import path_arg

log = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> None:
    """Register `net check` on the testbed command."""
    net = subparsers.add_parser(
        "net", help="network tools (check a topology's links)",
        description="Network tools. `testbed net check TOPOLOGY` brings the topology's "
                    "network up on Mininet and measures every device link against its "
                    "configuration (docs/network.md).")
    net_sub = net.add_subparsers(dest="net_command", metavar="NET_COMMAND", required=True)
    p = net_sub.add_parser(
        "check", help="bring a topology's network up and measure every device link",
        usage="%(prog)s [-h] TOPOLOGY [--tolerance FRACTION] [--seconds S]\n"
              "                         [--samples N] [--duplex] [--devices NAME [NAME ...]]\n"
              "                         [--per-group N]",
        description="Bring the topology's network up on the Mininet backend (root, Mininet, "
                    "iperf3), measure each device's throughput both ways (iperf3) and RTT, "
                    "print them against the configured values. Exit 0 when all are within "
                    "the tolerance, 1 when one is not or the network cannot start, 2 on bad "
                    "input (nothing started).")
    # optional for argparse only: `--devices a b TOPOLOGY` gives --devices every name, and
    # run_check takes the topology back from there (argparse said "required: topology")
    p.add_argument("topology", nargs="?", metavar="TOPOLOGY", type=path_arg,
                   help="the topology YAML file")
    p.add_argument("--tolerance", type=number_arg(0, 1, above_low=True), default=0.10,
                   metavar="FRACTION",
                   help="relative tolerance, a fraction above 0 up to 1 (default 0.10, i.e. "
                        "10%%; the RTT gets 1 ms more)")
    p.add_argument("--seconds", type=number_arg(0, 3600, above_low=True), default=3.0,
                   metavar="S", help="least seconds measured per direction (default 3); slow paths "
                        "measure longer and skip more of slow start: 4x and 2x the "
                        "time their device link's queue takes to drain")
    p.add_argument("--samples", type=int_arg(1, 10_000), default=10, metavar="N",
                   help="RTT samples per device (default 10)")
    p.add_argument("--duplex", action="store_true",
                   help="also measure both directions at once (rows down* and up*): each "
                        "must still get its own rate, as training's tiles down and results "
                        "up do")
    p.add_argument("--devices", nargs="+", metavar="NAME",
                   help="only these devices (default: all, one after another, about 15-30 s each: "
                        "on a large topology, a few of each group)")
    p.add_argument("--per-group", type=int_arg(1, 1_000_000), metavar="N",
                   help="only the first N devices of each group (a group's devices share one "
                        "link configuration); with --devices, those and these")
    p.set_defaults(func=run_check)


def select_devices(devices: list[DeviceSpec], names: list[str] | None,
                   per_group: int | None) -> list[DeviceSpec]:
    """The devices to measure, in the topology's order: all of them, or the named ones and the
    first ``per_group`` of each group. Raises ValueError naming a device that does not exist."""
    if not names and per_group is None:
        return devices
    known = {d.name for d in devices}
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise ValueError(f"--devices: no such device(s) {unknown} (devices are named "
                         f"<group>-<index>, e.g. {devices[0].name})")
    chosen = set(names or [])
    if per_group is not None:
        seen: dict[str, int] = {}
        for d in devices:
            seen[d.group.group] = seen.get(d.group.group, 0) + 1
            if seen[d.group.group] <= per_group:
                chosen.add(d.name)
    return [d for d in devices if d.name in chosen]


def _topology_argument(args: argparse.Namespace) -> str | None:
    """Find the topology file when ``--devices`` took it (``--devices a b TOPOLOGY``): its last
    name, when that cannot be a device's (:mod:`testbed.names`: no '.' or '/'). The problem, or
    None."""
    if args.topology is not None:
        return None
    last = args.devices[-1] if args.devices else None
    if last is not None and not is_name(last):
        args.devices, args.topology = args.devices[:-1], last
        return None if args.devices else "--devices: expected at least one device name"
    return ("no topology file: give it first, `testbed net check TOPOLOGY [--devices NAME "
            "...]`" + (f" (--devices took {args.devices})" if args.devices else ""))


def _duration(seconds: float) -> str:
    """A duration for a person: seconds under two minutes, else minutes."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def run_check(args: argparse.Namespace) -> int:
    """`testbed net check`: exit 0 all within tolerance, 1 otherwise, 2 on bad input."""
    from testbed.emulator.network.check import (
        check_devices,
        device_estimate_s,
        format_device,
        format_table,
    )
    from testbed.emulator.network.mininet import MininetNetwork
    from testbed.emulator.network.probe import probe

    problem = _topology_argument(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        topology = load_topology(args.topology)
    except TopologyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        devices = select_devices(list(topology.devices), args.devices, args.per_group)
    except ValueError as exc:
        print(f"error: {exc} in {args.topology}", file=sys.stderr)
        return EXIT_BAD_INPUT
    caps = probe()
    missing = caps.missing() + ([] if caps.iperf3 else ["iperf3 (Debian package iperf3)"])
    if missing:
        print(f"error: net check needs the Mininet backend; missing: {'; '.join(missing)}",
              file=sys.stderr)
        return EXIT_FAILURE
    so_far: list[Any] = []  # the rows of the devices measured, as each is done
    try:
        with MininetNetwork(topology, capabilities=caps) as net:
            print(f"network {net.prefix}: {len(net.hosts)} hosts up in {net.bringup_s:.1f} s; "
                  f"rate: HTB, delay and loss: {caps.delay_mechanism}")
            estimate_s = sum(device_estimate_s(topology, d, args.seconds, args.samples,
                                               args.duplex) for d in devices)
            print(f"measuring {len(devices)} device(s) one after another, about "
                  f"{_duration(estimate_s)}" + ("" if args.devices or args.per_group or
                                                 len(devices) < 10 else
                                                 "; --per-group N or --devices NAME ... "
                                                 "measures fewer"),
                  flush=True)
            width = len(str(len(devices)))

            def measured(n: int, device: Any, rows: list[Any]) -> None:
                so_far.extend(rows)
                print(f"[{n:>{width}}/{len(devices)}] {device.name}: {format_device(rows)}",
                      flush=True)

            rows = check_devices(net, devices, args.tolerance, args.seconds, args.samples,
                                 args.duplex, on_device=measured)
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:  # the network is down (the `with`); the devices done still count
        if so_far:
            done = len({r.device for r in so_far})
            print(format_table(so_far))
            print(f"interrupted after {done} of {len(devices)} device(s); "
                  f"{sum(r.ok for r in so_far)}/{len(so_far)} within tolerance so far")
        raise
    print(format_table(rows))
    bad = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(bad)}/{len(rows)} within tolerance")
    return EXIT_FAILURE if bad else EXIT_OK
