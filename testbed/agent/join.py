"""``testbed join``: this machine becomes a device of a run on another machine (a LAN device).

The run's topology must opt in with ``network.ps.listen: HOST:PORT``; ``testbed up`` then
prints the exact join command with the PS's certificate fingerprint. The connection is TLS with
that certificate pinned, and the token comes from a file or the environment, never from the
command line (where every user of the machine could read it in the process list).

Every argument is checked here, before the agent starts (exit 2): PS_ADDRESS is ``HOST:PORT``
(an IP address or a host name, port 1-65535, ``[v6]:PORT``), the fingerprint 64 hex digits,
``--name`` a topology name (:data:`testbed.names.NAME_RE`; the default is this host's name
made one: lower-cased, other characters as ``-``, cut to 24). The token file's first line must
be printable text (``testbed.agent.__main__.read_token``). The environment's stand-ins
(``$TESTBED_TLS_FINGERPRINT``, ``$TESTBED_TOKEN_FILE``, ``$TESTBED_TOKEN``) are checked the
same way, and an error names the variable, not an option that was not given. A PS that is
not up yet is then tried again and again, one line each time, as the agent does.

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
from testbed.user_paths import path_arg
from testbed.wire import MAX_IN_FLIGHT

# a joined device says what it has computed this often: from its join to the run's end it said
# nothing, and a run of OPT-125m steps takes hours
PROGRESS_S = 60.0


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
    # the environment's defaults are checked in _join, whose errors name the variable: as
    # argparse defaults they were checked as if given, and a bad $TESTBED_TLS_FINGERPRINT was
    # reported as a bad --fingerprint the user never gave
    p.add_argument("--fingerprint", type=fingerprint_arg, default=None,
                   help="the PS certificate's fingerprint, sha256:... (default: "
                        "$TESTBED_TLS_FINGERPRINT)")
    p.add_argument("--token-file", default=None, type=path_arg,
                   help="file holding the run's join token (default: $TESTBED_TOKEN_FILE, "
                        "else $TESTBED_TOKEN)")
    p.add_argument("--name", type=device_name_arg, default=default_name(socket.gethostname()),
                   help="device name in the run's records: lower-case letters, digits and "
                        "'-', at most 24 (default: this host's name, made one)")
    p.add_argument("--profile", default=None, type=path_arg,
                   help="device profile (name or path) whose sustained GFLOPS the PS starts "
                        "from; the PS then learns the real speed from the tiles (default: "
                        "none, a start from 1 GFLOPS)")
    p.add_argument("--max-in-flight", type=int_arg(1, MAX_IN_FLIGHT), default=2,
                   help=f"tiles outstanding at most (1 to {MAX_IN_FLIGHT}; default 2)")
    p.set_defaults(func=_join)


def _settle_environment(args: argparse.Namespace) -> str | None:
    """Fill ``args.fingerprint`` and ``args.token_file`` from the environment when not given,
    and check what the environment gave; the problem, naming the option or variable it came
    from, or None.

    The token file is only looked at, not read: it may be a pipe (``<(pass show run)``) that
    the agent reads once. ``$TESTBED_TOKEN`` is stripped as a token file's line is (a stray
    space or newline was sent as part of the token and refused by the PS as a wrong token).
    """
    if args.fingerprint is None:
        text = os.environ.get("TESTBED_TLS_FINGERPRINT", "")
        try:
            args.fingerprint = normalize(text) if text.strip() else ""
        except PinError as exc:
            return f"$TESTBED_TLS_FINGERPRINT: {exc}"
    if not args.fingerprint:
        return ("--fingerprint is required (printed by `testbed up` with the join command; it "
                "pins the PS's certificate)")
    source = "--token-file"
    if args.token_file is None:
        args.token_file = os.environ.get("TESTBED_TOKEN_FILE", "")
        source = "$TESTBED_TOKEN_FILE"
    if args.token_file:
        path = args.token_file
        if not os.path.exists(path):
            return f"{source} {path}: no such file; expected the join-token file `testbed up` wrote"
        if os.path.isdir(path):
            return f"{source} {path}: a directory; expected the join-token file `testbed up` wrote"
        # read here, once (it may be a pipe), so that a problem names where the file was given
        # ($TESTBED_TOKEN_FILE was blamed on --token-file); the agent takes it as TESTBED_TOKEN
        from testbed.agent.__main__ import read_token_file
        try:
            token = read_token_file(path)
        except OSError as exc:
            return f"{source} {path}: {exc.strerror or exc}"
        except ValueError as exc:
            return f"{source} {path}: {exc}"
        os.environ["TESTBED_TOKEN"] = token
        args.token_file = ""
        return None
    token = os.environ.get("TESTBED_TOKEN", "").strip()
    if not token:
        return "no token: give --token-file FILE (or set TESTBED_TOKEN_FILE or TESTBED_TOKEN)"
    if not token.isprintable():
        return ("$TESTBED_TOKEN holds control characters (a line break?); expected the token "
                "`testbed up` wrote, one line of printable characters")
    os.environ["TESTBED_TOKEN"] = token  # what the agent sends: as a token file's, stripped
    return None


def _join(args: argparse.Namespace) -> int:
    import sys

    from testbed.agent.__main__ import main as agent_main

    problem = _settle_environment(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # OPTION=VALUE: a value starting with '-' is never taken for an option of the agent's
    argv = [f"--ps={args.ps_address}", f"--tls-fingerprint={args.fingerprint}",
            f"--name={args.name}", "--kind=real", f"--max-in-flight={args.max_in_flight}",
            f"--progress-s={PROGRESS_S:g}"]
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
