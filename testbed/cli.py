"""The ``testbed`` command. Thin: each sub-command lives in the module that owns its work.

Exit codes: 0 success, 1 failure while running, 2 bad input (nothing was started), 130
interrupted (Ctrl-C or SIGTERM).
A part registers its sub-commands with ``add_parser(subparsers)``; the function it sets as
``func`` takes the parsed arguments and returns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading
from typing import Any

from testbed.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    InputError,
    out_of_room,
)

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


def _validate(args: argparse.Namespace) -> int:
    from testbed.up import load_run_inputs  # what a run checks before it starts, churn included

    inputs = load_run_inputs(args.topology)
    if isinstance(inputs, int):
        return inputs
    topology, churn, _ = inputs
    print(f"{args.topology}: ok ({len(topology.devices)} devices in {len(topology.groups)} "
          f"groups, {topology.job.steps} steps, backend {topology.network.backend}, "
          f"strategy {topology.job.parallelism.strategy}"
          + (f", churn {churn.name}" if churn else "") + ")")
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
                                   "line) and exits 2 if there is any.")
    p.add_argument("topology", help="the topology YAML file")
    p.set_defaults(func=_validate)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # that part is not built yet
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the testbed command line; return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 on --help
        return int(exc.code or 0)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SIGTERM stops a command as Ctrl-C does: its `finally`s run (a network taken down, a
    # run's summary written) where the default action ended the process on the spot
    # (`testbed up` puts handlers of its own over this one while it runs)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return int(args.func(args))
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
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
