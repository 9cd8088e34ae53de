"""The ``testbed`` command. Thin: each sub-command lives in the module that owns its work.

Exit codes: 0 success, 1 failure while running, 2 bad input (nothing was started), 130
interrupted (Ctrl-C, SIGTERM or SIGHUP). The first of those signals decides: the ones after it
are ignored, so they cannot cut the teardown short or turn the exit code into a death by
signal (:mod:`testbed.interrupts`).
A part registers its sub-commands with ``add_parser(subparsers)``; the function it sets as
``func`` takes the parsed arguments and returns the exit code.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import io
import logging
import os
import select
import signal
import sys
import threading
from typing import Any

from testbed import interrupts
from testbed.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    InputError,
    out_of_room,
)
from testbed.user_paths import path_arg

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each stops a command: exit 130

# Modules that add sub-commands; each has add_parser(subparsers). Imported lazily so that
# `testbed validate` does not pay for torch.
COMMAND_MODULES = (
    "testbed.up",
    "testbed.simulate.run",
    "testbed.baselines.compare",
    "testbed.report",
    "testbed.perf_model.cli",
    "testbed.churn.cli",
    "testbed.adb_bridge.cli",
    "testbed.emulator.network.cli",
    "testbed.agent.join",
)


def _adb_phones(topology: Any) -> str:
    """The validate line's words for an enabled ``adb:`` section: which real phones a run adds
    (the line counted the emulated devices alone and said nothing of the phones)."""
    adb = topology.extra.get("adb")
    if adb is None or not getattr(adb, "enabled", False):
        return ""
    serials = getattr(adb, "serials", None)
    server = f"{adb.server_host}:{adb.server_port}"
    if serials is None:
        return f", adb: every phone the server at {server} lists in state device"
    return f", adb: phone{'' if len(serials) == 1 else 's'} {', '.join(serials)} of {server}"


def _validate(args: argparse.Namespace) -> int:
    from testbed.up import load_run_inputs  # what a run checks before it starts, churn included

    inputs = load_run_inputs(args.topology)
    if isinstance(inputs, int):
        return inputs
    topology, churn, schedule = inputs
    def counted(n: int, what: str) -> str:
        return f"{n} {what}" + ("" if n == 1 else "s")

    def parameters(n: int) -> str:  # 125,239,296 -> 125.2 M
        for unit, name in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
            if n >= unit:
                return f"{n / unit:.1f} {name}"
        return str(n)

    members = {d.group.group for d in topology.devices}
    empty = [g.group for g in topology.groups if g.group not in members]
    print(f"{args.topology}: ok ({counted(len(topology.devices), 'device')} in "
          f"{counted(len(members), 'group')}"
          + (f" (no devices in {', '.join(empty)})" if empty else "")
          + f", {counted(topology.job.steps, 'step')}, "
          f"a model of {parameters(topology.job.model.parameters)} parameters, "
          f"backend {topology.network.backend}, "
          f"strategy {topology.job.parallelism.strategy}"
          + (f", churn {churn.name}" if churn else "") + _adb_phones(topology) + ")")
    if schedule is not None and churn is not None:
        from testbed.churn.show import stall_note

        stall = stall_note(schedule)
        if stall:  # valid, and a run that trains past it stalls there
            print(f"note: {args.topology}: the churn trace {churn.name}: {stall}")
    from testbed.up import backend_problems

    backend = topology.network.backend
    if backend == "auto" and any(backend_problems(topology, b) for b in ("loopback", "mininet")):
        # auto: the machine decides, so ask this one (a file with network.ps.listen validated
        # "ok" and nothing more here, where testbed up then refused it on Mininet)
        from testbed.emulator.network.probe import probe

        backend = "mininet" if probe().mininet_usable else "loopback"
        where = f"network.backend auto is {backend} on this machine; "
    else:
        where = ""
    if backend != "auto":
        for problem in backend_problems(topology, backend):
            print(f"note: {args.topology}: {where}testbed up would refuse it: {problem}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="testbed",
        description="Emulate phones and laptops that train a transformer together: a real "
                    "parameter server cuts every GEMM into tiles that devices compute over gRPC.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = sub.add_parser("validate", help="check a topology file; print every problem with its path",
                       description="Check a topology file and the churn trace it names, as "
                                   "`testbed up` and `testbed simulate` do before they start. "
                                   "Prints every problem with its YAML path (a trace's: its "
                                   "line) and exits 2 if there is any. A valid file that "
                                   "`testbed up` would refuse on its declared network backend "
                                   "(a baseline on loopback, network.ps.listen on Mininet; for "
                                   "backend auto, the one this machine would choose) gets a "
                                   "note saying why.")
    p.add_argument("topology", type=path_arg, help="the topology YAML file")
    p.set_defaults(func=_validate)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # that part is not built yet
        module.add_parser(sub)
    _own_errors(parser)
    return parser


def _own_errors(parser: argparse.ArgumentParser) -> None:
    """Each command's parser says its own usage for an argument it does not know: argparse
    leaves unknown arguments to the top parser, whose error showed `usage: testbed [-h] [-v]
    COMMAND ...` for `testbed net check TOPOLOGY --bogus`. Every leaf command records its
    parser (``_parser``), and :func:`parse_args` reports leftovers through it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                command.set_defaults(_parser=command)  # a nested command's own overrides it
                _own_errors(command)


def _commands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def bare_group(parser: argparse.ArgumentParser,
               argv: list[str]) -> argparse.ArgumentParser | None:
    """The command group ``argv`` names without one of its commands (``testbed``, ``testbed
    perf``), or None: such a line printed one line of usage and "the following arguments are
    required: COMMAND", not what the commands are."""
    if any(a in ("-h", "--help") for a in argv):
        return None
    current = parser
    for word in (a for a in argv if not a.startswith("-")):
        commands = _commands(current)
        if commands is None or word not in commands.choices:
            return None
        current = commands.choices[word]
    return current if _commands(current) is not None else None


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, with an unknown argument reported by its command's parser, and a
    group named without a command answered with the group's help (exit 2)."""
    group = bare_group(parser, sys.argv[1:] if argv is None else argv)
    if group is not None:
        group.print_help(sys.stderr)
        print(f"{group.prog}: error: name one of the commands above", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the testbed command line; return the exit code."""
    # SIGTERM and SIGHUP (a closed terminal) stop a command as Ctrl-C does: its `finally`s run
    # (a network taken down, a run's summary written) where the default action ended the
    # process on the spot (`testbed up` puts handlers of its own over these while it runs).
    # SIGINT too: a shell without job control starts a background command with SIGINT
    # ignored, and Python then installs no handler of its own, so `kill -INT` did nothing.
    # Before the parser is built: it imports every command's module (0.4 s, and 2-3 s on a
    # loaded host), and a SIGTERM then ended the process on the spot (exit -15)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        interrupts.arm()
        previous = {s: signal.signal(s, interrupts.interrupt) for s in STOP_SIGNALS}
    streams = sys.stdout, sys.stderr
    try:
        try:
            args = parse_args(build_parser(), argv)
        except SystemExit as exc:  # argparse exits 2 on bad usage, 0 on --help
            return int(exc.code or 0)
        out, err = ReaderSafe(sys.stdout), ReaderSafe(sys.stderr)
        sys.stdout, sys.stderr = out, err
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        code = int(args.func(args))
        interrupts.disarm()  # the code is decided: a signal from now on stops nothing
        out.flush()  # here, not at exit: a full disk must still change the exit code
        if out.failed is not None and code == EXIT_OK:
            print(f"error: standard output: {out.failed.strerror}; what the command printed "
                  "is incomplete", file=sys.stderr)
            return EXIT_FAILURE
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except InputError as exc:  # one a command let through: still bad input, said plainly
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:
        if not out_of_room(exc):
            raise
        # the machine's, not the code's: one line, and what was written before stays
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"error: {exc.strerror}{where} while writing; the files written before are "
              f"kept as they were", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        sys.stdout, sys.stderr = streams
        interrupts.disarm()
        # The program itself (no argv: the console script, `python -m testbed.cli`) exits
        # next, and a signal then must not end it by the default action: a SIGTERM right
        # after a Ctrl-C made exit 130 a death by SIGTERM (143). A caller in Python gets its
        # own handlers back
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_IGN if argv is None else handler)


class ReaderSafe:
    """A standard stream whose reader may go away (`testbed up | head`, a terminal closed):
    the first write that fails sends the rest to /dev/null, so a run goes on to its summary
    and report instead of ending at its next line of progress (rich's own handling of a broken
    pipe raises SystemExit). A stream that was closed before the command started (``>&-``:
    Python's is None) is /dev/null from the start. A write that fails for another reason
    than a reader gone (a full disk under ``> trace.csv``) is kept in ``failed``: the output
    is incomplete, and :func:`main` says so in its exit code."""

    READER_GONE = (errno.EPIPE, errno.EIO)  # EIO: the terminal went away

    def __init__(self, stream: Any):
        if stream is None:
            stream = open(os.devnull, "w")  # kept open for the process's life
        self._stream = stream
        # Under PYTHONUNBUFFERED (-u; many container images set it) the text layer writes to
        # the raw file and drops what a short write left over: a full disk under
        # ``> trace.csv`` cut the file at 8 KB without an error. Those writes are looped here.
        raw = getattr(stream, "buffer", None)
        self._raw = raw if isinstance(raw, io.RawIOBase) else None
        self._gone = False
        self.failed: OSError | None = None

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                if self._raw is None:
                    self._stream.write(text)
                else:
                    self._write_all(text.encode(self._stream.encoding, self._stream.errors))
            except OSError as exc:
                self._lost(exc)
        return len(text)

    def _write_all(self, data: bytes) -> None:
        assert self._raw is not None
        self._stream.flush()  # what was written past this wrapper, first
        view = memoryview(data)
        while view:
            written = self._raw.write(view)  # the next write after a short one raises
            if written is None:  # a non-blocking descriptor that is full: wait, not spin
                select.select([], [self._raw.fileno()], [])
                continue
            view = view[written:]

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except OSError as exc:
                self._lost(exc)

    def _lost(self, exc: OSError) -> None:
        self._gone = True
        if exc.errno not in self.READER_GONE:
            self.failed = exc
        try:  # what the stream still buffers goes to /dev/null at exit, not to an error
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, io.UnsupportedOperation):
            pass

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the stream's
        return getattr(self._stream, name)


if __name__ == "__main__":
    sys.exit(main())
