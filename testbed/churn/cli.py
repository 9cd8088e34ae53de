"""``testbed trace gen|show|import``: make, inspect and convert churn traces.

Durations on the command line carry their unit (``10min``, ``30s``; see :mod:`testbed.units`).
Every command that writes a trace validates what it wrote against the topology before it
returns. Exit codes: 0 ok, 2 bad input (bad trace, topology, pickle or option), 1 failure.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from testbed import units
from testbed.churn.generate import MAX_SHAPE, MIN_SHAPE
from testbed.churn.schedule import NEVER_REACHABLE, build_schedule, groups_of
from testbed.churn.trace import TraceError, TraceEvent, format_trace, load_trace, parse_trace
from testbed.errors import EXIT_BAD_INPUT, EXIT_OK, InputError
from testbed.topology import TopologyError, load_topology
from testbed.user_paths import checked_output, path_arg, written_whole

log = logging.getLogger(__name__)


class _BadInput(Exception):
    """An option or file the user must fix; the message is printed as is."""


def _topology(path: str) -> Any:
    try:
        return load_topology(path)
    except TopologyError as exc:
        raise _BadInput(str(exc)) from exc


def _devices(topology: Any, only_groups: str | None) -> list[str]:
    """The devices to churn: every device, or those of ``only_groups`` (--groups); never none,
    since a trace for no device is an empty file that looks like a quiet run, and never one
    twice: ``--groups phones,phones`` drew two interleaved streams per phone, which failed the
    check of the trace made with "already absent" on lines of a file never written."""
    groups = groups_of(topology)
    known = ", ".join(groups) or "none"
    if only_groups is None:
        devices = [d for members in groups.values() for d in members]
        if not devices:
            raise _BadInput(f"topology {topology.name} has no devices to churn")
        return devices
    chosen = [g.strip() for g in only_groups.split(",")]
    if not any(chosen) or not all(chosen):  # ',phones' was taken, ',' refused
        raise _BadInput(f"--groups: {only_groups!r} "
                        f"{'names no group' if not any(chosen) else 'has an empty name'}; "
                        f"expected comma-separated group names (topology groups: {known})")
    twice = [g for g in dict.fromkeys(chosen) if chosen.count(g) > 1]
    if twice:
        raise _BadInput(f"--groups: {', '.join(twice)} named twice; expected each group once "
                        f"(topology groups: {known})")
    unknown = [g for g in chosen if g not in groups]
    if unknown:
        raise _BadInput(f"--groups: unknown group(s) {', '.join(unknown)} (topology groups: "
                        f"{known})")
    devices = [d for g in chosen for d in groups[g]]
    if not devices:
        raise _BadInput(f"--groups: group(s) {', '.join(chosen)} have no devices (count 0)")
    return devices


def _emit(events: Sequence[TraceEvent], comments: list[str], topology: Any, seed: int,
          output: str | None) -> int:
    """Check the trace text against the topology, then write it to a file or stdout."""
    if not events:  # every run refuses a trace without events (churn.trace.NO_EVENTS)
        raise _BadInput(f"the trace made for {output or 'stdout'} has no events (not written): "
                        f"every device would stay as it starts, and a run without churn needs "
                        f"no trace")
    text = format_trace(events, comments)
    # a problem here is the command's own, in a trace nobody wrote yet: say so, not "<file>: line"
    made = f"the trace made for {output or 'stdout'} (not written)"
    schedule = build_schedule(parse_trace(text, made), groups_of(topology), seed)
    if not schedule.ever_reachable():  # as every run would refuse it
        raise _BadInput(f"{made}: {NEVER_REACHABLE}")
    if output:
        with written_whole(Path(output)) as handle:
            handle.write(text)
        log.info("wrote %s: %d events, %d device actions", output, len(events),
                 len(schedule.actions))
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _cmd_gen(args: argparse.Namespace) -> int:
    from testbed.churn.generate import SessionModel, generate_events, generation_problems

    topology = _topology(args.topology)
    seed = topology.seed if args.seed is None else args.seed
    # a shape the exponential draw would ignore is refused: the user meant a Weibull trace
    misplaced = args.shape is not None and args.dist != "weibull"
    shape = 1.0 if args.shape is None or misplaced else args.shape
    model = SessionModel(args.session_mean, args.absence_mean, args.dist, shape,
                         args.diurnal_amplitude, args.diurnal_period, args.diurnal_peak,
                         args.crash_fraction)
    devices = _devices(topology, args.groups)
    problems = generation_problems(len(devices), model, args.duration)
    if misplaced:
        problems.insert(0, f"--shape: only --dist weibull has a shape, got --shape "
                           f"{args.shape:g} with --dist {args.dist} (add --dist weibull, or "
                           f"drop --shape)")
    if problems:
        raise _BadInput("; ".join(problems))
    events = generate_events(devices, model, args.duration, seed)
    comments = [f"generated by `testbed trace gen` for topology {topology.name}, seed {seed}",
                f"{args.dist} sessions mean {args.session_mean:g} s, absences mean "
                f"{args.absence_mean:g} s" + (f", Weibull shape {shape:g}"
                                              if args.dist == "weibull" else ""),
                f"diurnal amplitude {args.diurnal_amplitude:g}, period "
                f"{args.diurnal_period:g} s; crash fraction {args.crash_fraction:g}; "
                f"duration {args.duration:g} s"]
    return _emit(events, comments, topology, seed, args.output)


def _cmd_import(args: argparse.Namespace) -> int:
    if args.kind == "sessions":
        # a session list has times of its own: these were silently ignored
        given = [option for option, value in (("--start", args.start),
                                              ("--duration", args.duration),
                                              ("--time-scale", args.time_scale))
                 if value is not None]
        if given:
            raise _BadInput(f"{', '.join(given)}: fedscale only; a session list is imported "
                            f"as its times say (drop {', '.join(given)})")
    topology = _topology(args.topology)
    devices = _devices(topology, None)
    if args.kind == "fedscale":
        from testbed.churn.fedscale import import_events, load_behave_trace

        start_s = 0.0 if args.start is None else args.start
        time_scale = 1.0 if args.time_scale is None else args.time_scale
        clients = load_behave_trace(args.source)
        events = import_events(clients, devices, start_s, args.duration, time_scale,
                               args.source)
        comments = [f"imported from FedScale client_behave_trace {Path(args.source).name} "
                    f"({len(clients)} clients; device i takes client i mod {len(clients)})",
                    f"trace time from {start_s:g} s, times divided by {time_scale:g}"]
    else:
        from testbed.churn.sessions import load_sessions

        events = load_sessions(args.source, devices)
        comments = [f"imported from the session list {Path(args.source).name}"]
    return _emit(events, comments, topology, topology.seed, args.output)


def _cmd_show(args: argparse.Namespace) -> int:
    from testbed.churn.show import plot_timeline, schedule_summary, trace_summary

    if args.topology is None:
        if args.plot:
            raise _BadInput("--plot needs --topology (groups must be expanded into devices)")
        if args.seed is not None:  # it was ignored: nothing is picked without the groups
            raise _BadInput("--seed needs --topology (seeded picks such as phones:2 are drawn "
                            "from the topology's groups)")
        for line in trace_summary(load_trace(args.trace)):
            print(line)
        print("(give --topology to check names, expand groups and see availability)")
        return EXIT_OK
    topology = _topology(args.topology)
    seed = topology.seed if args.seed is None else args.seed
    groups = groups_of(topology)
    trace = load_trace(args.trace, groups)
    schedule = build_schedule(trace, groups, seed)
    if not schedule.ever_reachable():  # refused by every run (validate, simulate, up)
        raise _BadInput(f"{args.trace}: {NEVER_REACHABLE}")
    for line in trace_summary(trace):
        print(line)
    print(f"topology {topology.name}")
    for line in schedule_summary(schedule, args.bins):
        print(line)
    if args.plot:
        # the seed is the one seeded picks (phones:2) are drawn with, not the one a generated
        # trace's header names (the seed `trace gen` drew it with)
        origin = "--seed" if args.seed is not None else "the topology's seed"
        plot_timeline(schedule, args.plot,
                      title=f"churn: {Path(args.trace).name} on topology {topology.name} "
                            f"(picks seeded with {seed}, {origin})")
        print(f"timeline: {args.plot}")
    return EXIT_OK


def _guarded(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace],
                                                                        int]:
    def run(args: argparse.Namespace) -> int:
        from testbed.churn.fedscale import FedScaleError

        try:
            # the files it will write, before anything is read or made, and never one it reads
            inputs = [(argument, getattr(args, dest, None)) for argument, dest in
                      (("trace", "trace"), ("source", "source"), ("--topology", "topology"))]
            for option, name in (("-o", getattr(args, "output", None)),
                                 ("--plot", getattr(args, "plot", None))):
                if name:
                    checked_output(name, option, inputs)
            return command(args)
        except (TraceError, FedScaleError, _BadInput, InputError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    return run


def add_parser(subparsers: Any) -> None:
    """Register ``testbed trace gen|show|import``."""
    trace = subparsers.add_parser(
        "trace", help="make, inspect and convert churn traces",
        description="Churn traces: CSV files 'time_s,device,event,arg' replayed by testbed up "
                    "(see docs/churn.md).")
    sub = trace.add_subparsers(dest="trace_command", metavar="ACTION", required=True)

    gen = sub.add_parser("gen", help="generate a seeded synthetic trace",
                         description="Alternate sessions and absences per device, drawn from "
                                     "exponential or Weibull distributions, optionally with a "
                                     "daily availability cycle.")
    gen.add_argument("--topology", required=True, type=path_arg,
                     help="topology YAML naming the devices")
    gen.add_argument("--groups", help="comma-separated groups to churn (default: all)")
    gen.add_argument("--duration", type=units.duration_arg, required=True,
                     help="trace length, 1ms to a year, e.g. 10min")
    gen.add_argument("--session-mean", type=units.duration_arg, required=True,
                     help="mean time a device stays, 1ms to a year, e.g. 2min")
    gen.add_argument("--absence-mean", type=units.duration_arg, required=True,
                     help="mean time a device stays away, 1ms to a year, e.g. 30s")
    gen.add_argument("--dist", choices=("exponential", "weibull"), default="exponential",
                     help="distribution of session and absence lengths (default exponential)")
    gen.add_argument("--shape", type=float, default=None,
                     help=f"Weibull shape k, with --dist weibull only (refused otherwise), "
                          f"{MIN_SHAPE:g} to {MAX_SHAPE:g} (default 1; < 1: heavy-tailed). "
                          f"Below {MIN_SHAPE:g} almost every session is shorter than the "
                          f"trace's millisecond and generation draws millions of "
                          f"samples per kept event; above {MAX_SHAPE:g} every length is about "
                          f"the mean")
    gen.add_argument("--diurnal-amplitude", type=float, default=0.0,
                     help="daily availability swing in [0, 1] (default 0: none)")
    gen.add_argument("--diurnal-period", type=units.duration_arg, default=86400.0,
                     help="period of the availability cycle, 1ms to a year (default 24h)")
    gen.add_argument("--diurnal-peak", type=units.duration_arg, default=0.0,
                     help="time of highest availability, 0 to a year (default 0s)")
    gen.add_argument("--crash-fraction", type=float, default=0.0,
                     help="share of departures that are crashes (default 0)")
    gen.add_argument("--seed", type=units.SEED, help="default: the topology's seed")
    gen.add_argument("-o", "--output", type=path_arg,
                     help="trace file to write (default: stdout)")
    gen.set_defaults(func=_guarded(_cmd_gen))

    show = sub.add_parser("show", help="validate a trace and summarize it; --plot draws it",
                          description="Print a trace's events by kind and, with --topology, "
                                      "the devices it touches and availability over time.")
    show.add_argument("trace", type=path_arg, help="the trace CSV file")
    show.add_argument("--topology", type=path_arg,
                      help="topology YAML: check names, expand groups")
    show.add_argument("--seed", type=units.SEED,
                      help="seed for selectors (default: the topology's)")
    show.add_argument("--bins", type=units.int_arg(1, 1000), default=10,
                      help="intervals of the availability table: it prints BINS + 1 evenly "
                           "spaced times, 0 to the last event (one, 0, when every event is at "
                           "0; default 10)")
    show.add_argument("--plot", metavar="FILE", type=path_arg,
                      help="draw the timeline into this PNG")
    show.set_defaults(func=_guarded(_cmd_show))

    imp = sub.add_parser("import", help="convert a FedScale trace or a session list",
                         description="fedscale: a client_behave_trace pickle (loaded with a "
                                     "restricted unpickler); sessions: a CSV "
                                     "'device,start_s,end_s'.")
    imp.add_argument("kind", choices=("fedscale", "sessions"),
                     help="the source's format (see the description above)")
    imp.add_argument("source", type=path_arg, help="the file to import")
    imp.add_argument("--topology", required=True, type=path_arg,
                     help="topology YAML naming the devices")
    imp.add_argument("--start", type=units.duration_arg, default=None,
                     help="fedscale: trace time that becomes time 0 (default 0s)")
    imp.add_argument("--duration", type=units.duration_arg, default=None,
                     help="fedscale: span to import (default: up to the longest finish_time)")
    imp.add_argument("--time-scale", type=float, default=None,
                     help="fedscale: divide trace times by this (default 1; 60: an hour "
                          "replays in a minute)")
    imp.add_argument("-o", "--output", type=path_arg,
                     help="trace file to write (default: stdout)")
    imp.set_defaults(func=_guarded(_cmd_import))
