"""``testbed join``: this machine becomes a device of a run on another machine (a LAN device).

The run's topology must opt in with ``network.ps.listen: HOST:PORT``; ``testbed up`` then
prints the exact join command with the PS's certificate fingerprint. The connection is TLS with
that certificate pinned, and the token comes from a file or the environment, never from the
command line (where every user of the machine could read it in the process list).

Every argument is checked here, before the agent starts (exit 2): PS_ADDRESS is ``HOST:PORT``
(an IP address or a host name, port 1-65535, ``[v6]:PORT``), the fingerprint 64 hex digits,
``--name`` a topology name (:data:`testbed.names.NAME_RE`; the default is this host's name
made one: lower-cased, other characters as ``-``, cut to 24). The token file's first line must
be printable text (``testbed.agent.__main__.read_token``). A PS that is not up yet is then
tried again and again, one line each time, as the agent does.

Exit codes: 0 the run ended, 2 bad input, 3 refused (the token, another certificate than the
pinned one, a server that does not speak TLS), 130 stopped by SIGINT, SIGTERM or SIGHUP after
leaving the run (the agent's exit on a signal is 0 otherwise: a churn trace's leave is a
SIGTERM).
"""

from __future__ import annotations

import argparse
import os
import re
import socket

from testbed.agent.tls import PinError, normalize, ps_address_arg
from testbed.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED
from testbed.names import MAX_NAME_CHARS, NAME_RULE, is_name
from testbed.units import int_arg
from testbed.wire import MAX_IN_FLIGHT


def device_name_arg(text: str) -> str:
    """An argparse type: a device name as a topology names things (:mod:`testbed.names`), or
    the parser's error naming the option (exit 2)."""
    if not is_name(text):
        raise argparse.ArgumentTypeError(f"expected {NAME_RULE}, got {text!r}")
    return text


def fingerprint_arg(text: str) -> str:
    """An argparse type: the PS certificate's fingerprint in canonical form ('' if not given)."""
    if not text:
        return ""
    try:
        return normalize(text)
    except PinError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def default_name(hostname: str) -> str:
    """``hostname`` as a device name: lower-case, other characters as '-', at most 24."""
    name = re.sub(r"[^a-z0-9-]+", "-", hostname.split(".")[0].lower()).strip("-")
    return name[:MAX_NAME_CHARS].rstrip("-") or "device"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``testbed join``."""
    p = sub.add_parser(
        "join", help="make this machine a device of a run on another machine (TLS)",
        description="Join a run whose topology sets network.ps.listen, as a real device: "
                    "connect over TLS, trust only the PS certificate with the given "
                    "fingerprint, compute tiles until the run ends (exit 0). `testbed up` "
                    "prints this command with the address and fingerprint filled in. Ctrl-C, "
                    "SIGTERM or SIGHUP leave the run (the PS re-queues this device's tiles in "
                    "flight) and exit 130; a refused token, another certificate or a port "
                    "that does not speak TLS exits 3.")
    p.add_argument("ps_address", metavar="PS_ADDRESS", type=ps_address_arg,
                   help="HOST:PORT the run printed ([v6]:PORT for IPv6)")
    p.add_argument("--fingerprint", type=fingerprint_arg,
                   default=os.environ.get("TESTBED_TLS_FINGERPRINT", ""),
                   help="the PS certificate's fingerprint, sha256:... (default: "
                        "$TESTBED_TLS_FINGERPRINT)")
    p.add_argument("--token-file", default=os.environ.get("TESTBED_TOKEN_FILE", ""),
                   help="file holding the run's join token (default: $TESTBED_TOKEN_FILE, "
                        "else $TESTBED_TOKEN)")
    p.add_argument("--name", type=device_name_arg, default=default_name(socket.gethostname()),
                   help="device name in the run's records: lower-case letters, digits and "
                        "'-', at most 24 (default: this host's name, made one)")
    p.add_argument("--profile", default="",
                   help="device profile (name or path) whose sustained GFLOPS the PS starts "
                        "from; the PS then learns the real speed from the tiles")
    p.add_argument("--max-in-flight", type=int_arg(1, MAX_IN_FLIGHT), default=2,
                   help=f"tiles outstanding at most (1 to {MAX_IN_FLIGHT}; default 2)")
    p.set_defaults(func=_join)


def _join(args: argparse.Namespace) -> int:
    import sys

    from testbed.agent.__main__ import main as agent_main

    if not args.fingerprint:
        print("error: --fingerprint is required (printed by `testbed up` with the join "
              "command; it pins the PS's certificate)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not args.token_file and not os.environ.get("TESTBED_TOKEN", "").strip():
        print("error: no token: give --token-file FILE (or set TESTBED_TOKEN_FILE or "
              "TESTBED_TOKEN)", file=sys.stderr)
        return EXIT_BAD_INPUT
    # OPTION=VALUE: a value starting with '-' is never taken for an option of the agent's
    argv = [f"--ps={args.ps_address}", f"--tls-fingerprint={args.fingerprint}",
            f"--name={args.name}", "--kind=real", f"--max-in-flight={args.max_in_flight}"]
    if args.token_file:
        argv += [f"--token-file={args.token_file}"]
    if args.profile:
        from testbed.perf_model.profiles import ProfileError, load_profile
        try:
            profile = load_profile(args.profile)
        except ProfileError as exc:
            print(f"error: --profile: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        argv += [f"--profile={args.profile}", f"--gflops={profile.sustained_gflops}"]
    return agent_main(argv, stopped_exit=EXIT_INTERRUPTED)
