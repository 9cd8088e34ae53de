"""``testbed adb devices``, ``testbed adb doctor [SERIAL]`` and ``testbed adb measure SERIAL``.

``devices`` lists every phone the adb server knows: state, model, SoC, chosen profile and whether
the reverse rule to the PS (``tcp:<phone_port>``) is in place. ``doctor`` checks, in order, what a
phone needs to compute tiles and prints the fix of the first problem (see ``doctor.py``).
``measure`` runs the GEMM sweep of ``testbed perf measure`` on the phone and writes the same CSV.

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

from testbed.agent.tls import parse_address
from testbed.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK
from testbed.units import SEED, int_arg, positive_duration_arg
from testbed.user_paths import checked_output

if TYPE_CHECKING:
    from testbed.adb_bridge.client import AdbServer

# adbutils is imported inside the commands, after the address is checked: it reads
# ANDROID_ADB_SERVER_PORT at import and raises a bare ValueError on a bad value.

log = logging.getLogger(__name__)


DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 5037


def adb_address(flag: str | None, environ: dict[str, str] | None = None
                ) -> tuple[str, str | None]:
    """The adb server ``HOST:PORT`` to use, and the problem with it (None when fine).

    ``--adb`` wins; else ``ANDROID_ADB_SERVER_ADDRESS`` and ``ANDROID_ADB_SERVER_PORT``, the
    variables the ``adb`` client reads, each with adb's default. HOST:PORT is checked as a PS
    address is (:func:`testbed.agent.tls.parse_address`: ``[v6]:PORT`` for IPv6). A bad
    ``ANDROID_ADB_SERVER_PORT`` is a problem even with ``--adb``: adbutils reads it when it is
    imported, and raises a bare ValueError."""
    env = os.environ if environ is None else environ
    port_text = env.get("ANDROID_ADB_SERVER_PORT", "").strip()
    if port_text and (not (port_text.isascii() and port_text.isdigit())
                      or not 0 < int(port_text) < 65536):
        return flag or port_text, (f"ANDROID_ADB_SERVER_PORT: expected a TCP port (1-65535), "
                                   f"got {port_text!r}")
    if flag is not None:
        try:
            parse_address(flag)
        except ValueError as exc:
            return flag, f"--adb: {exc}"
        return flag, None
    host = env.get("ANDROID_ADB_SERVER_ADDRESS", "").strip() or DEFAULT_HOST
    address = f"[{host}]" if ":" in host and not host.startswith("[") else host
    address += f":{port_text or DEFAULT_PORT}"
    try:
        parse_address(address)
    except ValueError as exc:
        return address, f"ANDROID_ADB_SERVER_ADDRESS: {exc}"
    return address, None


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
        args.adb, problem = adb_address(args.adb)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return EXIT_BAD_INPUT
        return command(args)
    return checked


def describe_phone(server: AdbServer, serial: str, state: str, phone_port: int
                   ) -> dict[str, Any]:
    """One row of ``testbed adb devices`` (only state for phones not in state ``device``)."""
    from testbed.adb_bridge import parsers
    from testbed.adb_bridge.phone_info import PhoneInfo, choose_profile, support_problem

    row: dict[str, Any] = {"serial": serial, "state": state}
    if state != "device":
        return row
    device = server.device(serial)
    props = parsers.parse_getprop(device.shell2("getprop", v2=True).stdout)
    info = PhoneInfo.from_props(serial, props)
    choice = choose_profile(info, props)
    reverses = [(r.remote, r.local) for r in device.reverse_list()]
    reverse = next((local for remote, local in reverses if remote == f"tcp:{phone_port}"), None)
    row.update(model=info.model, soc=info.soc, android=info.android_release,
               profile=choice.profile or "measured live", profile_reason=choice.reason,
               reverse=f"tcp:{phone_port} -> {reverse}" if reverse else "none",
               problem=support_problem(info) or "")
    return row


def _devices(args: argparse.Namespace) -> int:
    from adbutils.errors import AdbError

    server = _server(args)
    try:
        rows = [describe_phone(server, s, st, args.phone_port)
                for s, st in server.states().items()]
    except (AdbError, OSError) as exc:
        print(f"error: adb server at {args.adb}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    if not rows:
        print(f"no phones on the adb server at {args.adb}")
        return EXIT_OK
    columns = ("serial", "state", "model", "soc", "android", "profile", "reverse", "problem")
    table = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip())
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)).rstrip())
    return EXIT_OK


def _doctor(args: argparse.Namespace) -> int:
    from testbed.adb_bridge.doctor import Doctor

    doctor = Doctor(_server(args), serial=args.serial or os.environ.get("ANDROID_SERIAL") or None,
                    push=args.push, phone_port=args.phone_port,
                    probe_timeout_s=Doctor.probe_timeout_s if args.probe_timeout is None
                    else args.probe_timeout)
    ok = doctor.run()
    print(doctor.report())
    return EXIT_OK if ok else EXIT_FAILURE


def _measure(args: argparse.Namespace) -> int:
    from adbutils.errors import AdbError

    from testbed.adb_bridge.measure import AdbGemmRunner, PhoneCannotMeasure
    from testbed.perf_model.measure import measure, sweep_shapes
    from testbed.perf_model.measurements import write_measurements

    args.serial = args.serial or os.environ.get("ANDROID_SERIAL", "")
    if not args.serial:
        print("error: SERIAL: name the phone (or set ANDROID_SERIAL)", file=sys.stderr)
        return EXIT_BAD_INPUT
    # one file per phone by default: measuring the next phone keeps this one's figures
    args.out = args.out or f"adb_measurements-{args.serial.replace(os.sep, '_')}.csv"
    checked_output(args.out, "--out")  # before the phone is asked: a sweep takes minutes
    server = _server(args)
    try:
        states = server.states()
        if states.get(args.serial) != "device":
            print(f"error: phone {args.serial!r} is {states.get(args.serial, 'not connected')} "
                  f"on the adb server at {args.adb}", file=sys.stderr)
            return EXIT_FAILURE
        runner = AdbGemmRunner(server.device(args.serial), phone_port=args.phone_port)
        try:
            shapes = sweep_shapes(args.size, seed=args.seed)[: args.limit or None]
            rows = measure(shapes, runner, dtype=args.dtype, repeats=args.repeats,
                           passes=args.passes)
        finally:
            runner.close()
    except PhoneCannotMeasure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except (AdbError, OSError) as exc:
        print(f"error: adb server at {args.adb}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    info = runner.describe()
    write_measurements(args.out, rows, comments=[
        f"testbed adb measure {args.serial} --size {args.size}: {info['cpu_model']}, "
        f"{info['backend']}"])
    print(f"{args.out}: {len(rows)} shapes measured on {args.serial} ({info['cpu_model']})")
    return EXIT_OK


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``testbed adb devices|doctor|measure``."""
    adb = subparsers.add_parser("adb", help="real phones over adb: list, check, measure GEMMs")
    sub = adb.add_subparsers(dest="adb_command", metavar="ADB_COMMAND", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--adb", default=None,
                       help="adb server HOST:PORT, [v6]:PORT for IPv6 (default: "
                            "$ANDROID_ADB_SERVER_ADDRESS:$ANDROID_ADB_SERVER_PORT, else "
                            "127.0.0.1:5037, as adb does)")

    p = sub.add_parser("devices", help="phones on the adb server: state, model, profile, reverse")
    common(p)
    p.add_argument("--phone-port", type=int_arg(1, 65533), default=7700,
                   help="the phone port the agent dials (reverse source), default 7700")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_address_checked(_devices))

    p = sub.add_parser("doctor", help="check, in order, what a phone needs to compute tiles; "
                                      "print the fix of the first problem (exit 0: ready)")
    common(p)
    p.add_argument("serial", nargs="?", default="",
                   help="the phone's adb serial (default: $ANDROID_SERIAL, else the only phone)")
    p.add_argument("--push", action="store_true",
                   help="push this checkout's agent when the phone's differs")
    p.add_argument("--phone-port", type=int_arg(1, 65533), default=7700,
                   help="phone port for the join check (default 7700; the probe uses +1, the "
                        "Termux listener's control port +2)")
    # default: Doctor's (None here: its module is too heavy to import for every command line)
    p.add_argument("--probe-timeout", type=probe_timeout_arg, default=None,
                   metavar="DURATION",
                   help="how long to wait for the report of the probe Termux runs, e.g. 40s "
                        "(default 25s, at most 10min; a slow phone's first python start may "
                        "need more)")
    p.set_defaults(func=_address_checked(_doctor))

    p = sub.add_parser("measure", help="time GEMM tile shapes on a phone (for the perf model)")
    common(p)
    p.add_argument("serial", nargs="?", default="",
                   help="the phone's adb serial (default: $ANDROID_SERIAL)")
    p.add_argument("--size", choices=("quick", "full"), default="quick", help="sweep size")
    p.add_argument("--limit", type=int_arg(0, 1_000_000), default=0,
                   help="time only the first N shapes")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--repeats", type=int_arg(1, 10_000), default=5,
                   help="samples per shape and pass")
    p.add_argument("--passes", type=int_arg(1, 1000), default=2,
                   help="sweeps over all shapes; each shape's figure is the fastest sample of "
                        "all passes, so a burst of other work on the phone hits one pass only")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the shape sweep")
    p.add_argument("--out", help="output CSV (default: adb_measurements-SERIAL.csv; an existing "
                                  "file is replaced once the sweep is done)")
    p.add_argument("--phone-port", type=int_arg(1, 65533), default=7700,
                   help="an unrooted phone measures through its Termux listener on this port "
                        "+ 2 (default 7700)")
    p.set_defaults(func=_address_checked(_measure))
