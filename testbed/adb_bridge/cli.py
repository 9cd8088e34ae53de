"""``testbed adb devices``, ``testbed adb doctor [SERIAL]`` and ``testbed adb measure SERIAL``.

``devices`` lists every phone the adb server knows: state, model, SoC, chosen profile and whether
the reverse rule to the PS (``tcp:<phone_port>``) is in place; a phone that cannot be asked (gone,
silent past its getprop deadline, cut off mid-answer) is a row with its problem, and the others
are listed. ``doctor`` checks, in order, what a phone needs to compute tiles and prints the fix of
the first problem (see ``doctor.py``). ``measure`` runs the GEMM sweep of ``testbed perf
measure`` on the phone and writes the same CSV, only once every shape gave a valid answer.

Whatever a phone says (model, SoC, state detail, cpu_model) is printed through
:func:`~testbed.adb_bridge.client.printable`: one line, short, no terminal escape sequences.
A phone that cannot do what was asked exits 1 in every command, and so does an adb server that
cannot be reached (the message says how to start one: :mod:`.server_address`); 2 is for a bad
command line. A SERIAL the server does not list is a phone that is not there (unplugged, or a
typo): exit 1, with the serials the server does list.

Which adb server, as ``adb`` itself decides: ``--adb HOST:PORT`` when given, else
``$ANDROID_ADB_SERVER_ADDRESS`` (default 127.0.0.1) and ``$ANDROID_ADB_SERVER_PORT`` (default
5037). Which phone, where a command takes one: the SERIAL argument, else ``$ANDROID_SERIAL``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

from testbed.adb_bridge.server_address import adb_address, unreachable
from testbed.agent.tls import parse_address
from testbed.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK
from testbed.perf_model.measure import SWEEPS
from testbed.units import SEED, int_arg, positive_duration_arg
from testbed.user_paths import checked_output, path_arg

if TYPE_CHECKING:
    from testbed.adb_bridge.client import AdbServer

# adbutils is imported inside the commands, after the address is checked: it reads
# ANDROID_ADB_SERVER_PORT at import and raises a bare ValueError on a bad value.

log = logging.getLogger(__name__)


# the phone port the agent dials; the doctor's probe uses it + 1 and the Termux listener + 2
MAX_PHONE_PORT = 65533


def phone_port_arg(text: str) -> int:
    """An argparse type: ``--phone-port``, a TCP port whose + 1 and + 2 are ports too."""
    digits = text.strip()
    if not (digits.isascii() and digits.isdigit()) or not 0 < int(digits) <= MAX_PHONE_PORT:
        raise argparse.ArgumentTypeError(
            f"expected a TCP port from 1 to {MAX_PHONE_PORT} (the doctor's probe uses it + 1 "
            f"and the Termux listener it + 2), got {text!r}")
    return int(digits)


# The deadline of one shape's timing on the phone (adb_bridge/measure.py): MEASURE_START_S for
# python and numpy to start on a slow phone, plus MEASURE_PER_SAMPLE_S per timed call (the
# largest sweep shape, 2 GFLOP, takes about a second on a slow phone; five leave room for a hot,
# throttled one).
MEASURE_START_S = 60.0
MEASURE_PER_SAMPLE_S = 5.0
MAX_PROBE_TIMEOUT_S = 600.0  # a phone's first python start takes tens of seconds, not hours


def probe_timeout_arg(text: str) -> float:
    """An argparse type: ``--probe-timeout``, a duration above 0 and at most 10 min."""
    seconds = positive_duration_arg(text)
    if seconds > MAX_PROBE_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_PROBE_TIMEOUT_S:g}s (10min), "
                                         f"got {text!r}")
    return seconds


def _server(args: argparse.Namespace) -> AdbServer:
    from testbed.adb_bridge.client import AdbServer

    return AdbServer(*parse_address(args.adb))


def _address_checked(command: Callable[[argparse.Namespace], int]
                     ) -> Callable[[argparse.Namespace], int]:
    """``command``, run only once the adb server's address is checked (exit 2 when it is bad),
    before anything imports adbutils (which reads ANDROID_ADB_SERVER_PORT at import)."""
    @functools.wraps(command)
    def checked(args: argparse.Namespace) -> int:
        args.adb_given = args.adb is not None
        args.adb, problem = adb_address(args.adb)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return EXIT_BAD_INPUT
        return command(args)
    return checked


def describe_phone(server: AdbServer, serial: str, state: str, phone_port: int
                   ) -> dict[str, Any]:
    """One row of ``testbed adb devices``: state, and for a phone in state ``device`` what it
    is; a phone that cannot be asked (or answers badly) is a row with its problem."""
    from adbutils.errors import AdbError

    from testbed.adb_bridge import parsers
    from testbed.adb_bridge.client import PhoneShell, printable, split_state
    from testbed.adb_bridge.phone_info import PhoneInfo, choose_profile, support_problem

    name, detail = split_state(state)
    row: dict[str, Any] = {"serial": serial, "state": printable(name)}
    if name != "device":
        if detail:  # adb's own words on the state ("no permissions (...); see [...]")
            row["state_detail"] = printable(detail, most=MAX_PROBLEM_CHARS)
        return row
    try:
        device = server.device(serial)
        props = parsers.parse_getprop(PhoneShell(device, GETPROP_TIMEOUT_S).run("getprop").stdout)
        reverses = [(r.remote, r.local) for r in device.reverse_list()]
    except (AdbError, OSError, EOFError) as exc:  # this phone only: the others are listed
        row["problem"] = printable(str(exc), most=MAX_PROBLEM_CHARS)
        return row
    info = PhoneInfo.from_props(serial, props)
    choice = choose_profile(info, props)
    reverse = next((local for remote, local in reverses if remote == f"tcp:{phone_port}"), None)
    # the phone's own words, as every value below, go through printable: one line, short
    row.update(model=printable(info.model), soc=printable(info.soc),
               android=printable(info.android_release),
               profile=choice.profile or "measured live", profile_reason=printable(choice.reason),
               reverse=f"tcp:{phone_port} -> {printable(reverse)}" if reverse else "none",
               problem=support_problem(info) or "")
    return row


GETPROP_TIMEOUT_S = 10.0  # getprop answers in well under a second
MAX_PROBLEM_CHARS = 200
MAX_PHONES_ASKED_AT_ONCE = 16  # a hung phone costs GETPROP_TIMEOUT_S, not that times the phones


def _devices(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from adbutils.errors import AdbError

    from testbed.adb_bridge.client import printable
    from testbed.adb_bridge.doctor import state_problem

    server = _server(args)
    try:
        states = server.states()
    except (AdbError, OSError, EOFError) as exc:
        print(unreachable(args.adb, exc), file=sys.stderr)
        return EXIT_FAILURE

    def row(item: tuple[str, str]) -> dict[str, Any]:
        return describe_phone(server, *item, args.phone_port)

    with ThreadPoolExecutor(max(1, min(MAX_PHONES_ASKED_AT_ONCE, len(states)))) as pool:
        rows = list(pool.map(row, states.items()))
    columns = ("serial", "state", "model", "soc", "android", "profile", "reverse", "problem")
    for r in rows:  # a phone not in state device: what its state means, and adb's detail
        if r["state"] != "device":
            r["problem"] = state_problem(r["state"], r.get("state_detail", ""))
    if args.json:  # every row has every key, null where the phone could not be asked
        keys = (*columns, "state_detail", "profile_reason")
        print(json.dumps([{k: r.get(k) for k in keys} for r in rows], indent=2))
        return EXIT_OK
    if not rows:
        print(f"no phones on the adb server at {args.adb}: plug one in and turn on USB "
              f"debugging (`testbed adb doctor` says what is missing)")
        return EXIT_OK
    # the serial too (the adb server's text): one line per phone, whatever it is named
    table = [[printable(str(r.get(c, "")), most=MAX_PROBLEM_CHARS) for c in columns]
             for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip())
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)).rstrip())
    return EXIT_OK


def _doctor(args: argparse.Namespace) -> int:
    from testbed.adb_bridge.doctor import Doctor, check_lines

    def waiting(what: str) -> None:  # a check that may take a while: say so before the silence
        log.info("%s", what)

    # each check's line as soon as it is known: the later checks wait up to minutes
    doctor = Doctor(_server(args), serial=args.serial or os.environ.get("ANDROID_SERIAL") or None,
                    push=args.push, phone_port=args.phone_port,
                    probe_timeout_s=Doctor.probe_timeout_s if args.probe_timeout is None
                    else args.probe_timeout,
                    on_check=lambda check: print(check_lines(check), flush=True),
                    on_wait=waiting)
    ok = doctor.run()
    print(doctor.verdict())
    return EXIT_OK if ok else EXIT_FAILURE


def _measure(args: argparse.Namespace) -> int:
    from adbutils.errors import AdbError

    from testbed.adb_bridge.client import PhoneCommandError, printable, split_state
    from testbed.adb_bridge.doctor import serial_problem, state_problem
    from testbed.adb_bridge.measure import AdbGemmRunner, PhoneCannotMeasure
    from testbed.perf_model.measure import SweepProgress, measure, sweep_shapes
    from testbed.perf_model.measurements import write_measurements

    args.serial = args.serial or os.environ.get("ANDROID_SERIAL", "")
    if not args.serial:
        print("error: SERIAL: name the phone (or set ANDROID_SERIAL); `testbed adb devices` "
              "lists them", file=sys.stderr)
        return EXIT_BAD_INPUT
    # one file per phone by default: measuring the next phone keeps this one's figures
    args.out = args.out or f"adb_measurements-{args.serial.replace(os.sep, '_')}.csv"
    checked_output(args.out, "--out")  # before the phone is asked: a sweep takes minutes
    shapes = sweep_shapes(args.size, seed=args.seed)[: args.limit or None]
    doctor_hint = (f"`testbed adb doctor {printable(args.serial)}"
                   + (f" --adb {args.adb}" if args.adb_given else "") + "` says what to do")
    server = _server(args)
    try:
        states = server.states()
    except (AdbError, OSError, EOFError) as exc:
        print(unreachable(args.adb, exc), file=sys.stderr)
        return EXIT_FAILURE
    # A phone that cannot measure, or answers what no timing script prints, exits 1 as a phone
    # problem does in `adb devices` and `adb doctor`: exit 2 says "fix your command line or
    # file", and what a phone prints is neither.
    state = states.get(args.serial)
    if state is None:
        print(f"error: phone {serial_problem(args.serial, args.adb, states)}", file=sys.stderr)
        return EXIT_FAILURE
    name, detail = split_state(state)
    if name != "device":
        problem = state_problem(name, detail)
        print(f"error: phone {printable(args.serial)} is {printable(name)}"
              + (f": {printable(problem, most=300)}" if problem else "")
              + f" (adb server {args.adb}); {doctor_hint}", file=sys.stderr)
        return EXIT_FAILURE
    deadline_s = MEASURE_START_S + (1 + args.repeats) * MEASURE_PER_SAMPLE_S
    progress = SweepProgress(len(shapes), args.passes)
    try:
        runner = AdbGemmRunner(server.device(args.serial), start_s=MEASURE_START_S,
                               per_sample_s=MEASURE_PER_SAMPLE_S, phone_port=args.phone_port)
        try:
            # once the phone can measure: it may have waited for Termux
            progress.start(f"measuring {len(shapes)} shape(s) x {args.passes} pass(es) on "
                           f"{printable(args.serial)}: {len(shapes) * args.passes} timings, "
                           f"each within {deadline_s:g} s")
            rows = measure(shapes, runner, dtype=args.dtype, repeats=args.repeats,
                           passes=args.passes, on_timed=progress)
        finally:
            runner.close()
    except (PhoneCannotMeasure, PhoneCommandError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except (AdbError, OSError, EOFError) as exc:
        print(f"error: adb server at {args.adb}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    info = runner.describe()  # printable already: the phone's words stay on the comment line
    # which shapes: a --limit or another --seed is not the sweep that --size names
    which = (f"; the first {len(shapes)} of its {SWEEPS[args.size]} shapes"
             if len(shapes) < SWEEPS[args.size] else "") + (
             f"; seed {args.seed}" if args.seed else "")
    # written only now, whole (a temporary file renamed over --out): a failed sweep leaves the
    # previous file as it was
    write_measurements(args.out, rows, comments=[
        f"testbed adb measure {printable(args.serial)} --size {args.size}: {info['cpu_model']}, "
        f"{info['backend']}{which}"])
    print(f"{args.out}: {len(rows)} shapes measured on {printable(args.serial)} "
          f"({info['cpu_model']})")
    return EXIT_OK


EXIT_CODES = ("exit codes: 0 done; 1 the adb server or a phone could not do it (the message "
              "says what to do); 2 a bad command line (nothing asked); 130 interrupted")
ADB_OPTION_HELP = ("the adb server, HOST:PORT ([v6]:PORT for IPv6); default: "
                   "$ANDROID_ADB_SERVER_ADDRESS (else 127.0.0.1) and $ANDROID_ADB_SERVER_PORT "
                   "(else 5037), as adb does. No server there: start one with `adb start-server`")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``testbed adb devices|doctor|measure``."""
    adb = subparsers.add_parser(
        "adb", help="real phones over adb: list, check, measure GEMMs",
        description="Android phones on an adb server (`adb start-server` runs one): list them "
                    "(devices), check one can compute tiles (doctor), time GEMMs on one "
                    "(measure). docs/adb-bridge.md says more.", epilog=EXIT_CODES)
    sub = adb.add_subparsers(dest="adb_command", metavar="ADB_COMMAND", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--adb", default=None, metavar="HOST:PORT", help=ADB_OPTION_HELP)

    p = sub.add_parser("devices", help="phones on the adb server: state, model, profile, reverse",
                       description="List every phone the adb server knows: its adb state, "
                                   "model, SoC, Android release, the perf profile a run would "
                                   "give it, its `adb reverse` rule for --phone-port, and what "
                                   "is wrong with it (PROBLEM).", epilog=EXIT_CODES)
    common(p)
    p.add_argument("--phone-port", type=phone_port_arg, default=7700, metavar="PORT",
                   help="the phone port whose `adb reverse` rule the REVERSE column shows (the "
                        "port the agent dials on the phone; default 7700)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_address_checked(_devices))

    p = sub.add_parser("doctor", help="check, in order, what a phone needs to compute tiles; "
                                      "print the fix of the first problem (exit 0: ready)",
                       description="Check, in order, what a phone needs to compute tiles (adb "
                                   "server, phone authorized, Android 7+, a python with numpy "
                                   "and grpc, this checkout's agent, a real join), printing "
                                   "each check as it ends; stop at the first failure and print "
                                   "its fix. Exit 0 only when the phone can compute tiles.",
                       epilog=EXIT_CODES)
    common(p)
    p.add_argument("serial", nargs="?", default="", metavar="SERIAL",
                   help="the phone's adb serial (default: $ANDROID_SERIAL, else the only phone)")
    p.add_argument("--push", action="store_true",
                   help="push this checkout's agent when the phone's differs")
    p.add_argument("--phone-port", type=phone_port_arg, default=7700, metavar="PORT",
                   help="phone port for the join check (default 7700; the probe uses +1, the "
                        "Termux listener's control port +2)")
    # default: Doctor's (None here: its module is too heavy to import for every command line)
    p.add_argument("--probe-timeout", type=probe_timeout_arg, default=None,
                   metavar="DURATION",
                   help="how long to wait for the report of the probe Termux runs, e.g. 40s "
                        "(default 25s, at most 10min; a slow phone's first python start may "
                        "need more)")
    p.set_defaults(func=_address_checked(_doctor))

    repeats, passes = 5, 2
    p = sub.add_parser("measure", help="time GEMM tile shapes on a phone (for the perf model)",
                       description=(
                           "Time GEMM tile shapes on a phone and write the CSV of `testbed perf "
                           "measure`, once the whole sweep succeeded (a failed or interrupted "
                           "sweep writes nothing). Progress is logged to stderr. Each shape's "
                           "timing "
                           f"on the phone must answer within {MEASURE_START_S:g} s + "
                           f"{MEASURE_PER_SAMPLE_S:g} s per timed call (one warm-up and --repeats "
                           f"samples: {MEASURE_START_S + (1 + repeats) * MEASURE_PER_SAMPLE_S:g} s "
                           "by default), with --repeats numbers of seconds from 1 ns up to that "
                           "deadline; a phone that does not is an error naming it and the shape "
                           "(exit 1)."), epilog=EXIT_CODES)
    common(p)
    p.add_argument("serial", nargs="?", default="", metavar="SERIAL",
                   help="the phone's adb serial (default: $ANDROID_SERIAL)")
    p.add_argument("--size", choices=tuple(SWEEPS), default="quick",
                   help="the sweep: " + ", ".join(f"{k} {v} shapes" for k, v in SWEEPS.items())
                        + " (default quick)")
    p.add_argument("--limit", type=int_arg(0, 1_000_000), default=0, metavar="N",
                   help="time only the first N shapes of the sweep (default 0: all of them)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="element type of the matrices (default float32)")
    # at most three digits: the phone's Termux listener takes no more (termux_serve.GEMM_ARGS)
    p.add_argument("--repeats", type=int_arg(1, 999), default=repeats, metavar="N",
                   help=f"samples per shape and pass, 1 to 999 (default {repeats}; each adds "
                        f"{MEASURE_PER_SAMPLE_S:g} s to the deadline of a shape's timing on "
                        f"the phone)")
    p.add_argument("--passes", type=int_arg(1, 1000), default=passes, metavar="N",
                   help=f"sweeps over all shapes, 1 to 1000 (default {passes}); each shape's "
                        "figure is the fastest sample of all passes, so a burst of other work "
                        "on the phone hits one pass only")
    p.add_argument("--seed", type=SEED, default=0, metavar="N",
                   help="seed of the sweep's random shapes (default 0)")
    p.add_argument("--out", metavar="FILE", type=path_arg,
                   help="output CSV (default: adb_measurements-SERIAL.csv; an existing "
                        "file is replaced once the sweep is done; missing directories are made)")
    p.add_argument("--phone-port", type=phone_port_arg, default=7700, metavar="PORT",
                   help="an unrooted phone measures through its Termux listener on this port "
                        "+ 2 (default 7700)")
    p.set_defaults(func=_address_checked(_measure))
