"""``testbed join``: this machine becomes a device of a run on another machine (a LAN device).

The run's topology must opt in with ``network.ps.listen: HOST:PORT``; ``testbed up`` then
prints the exact join command with the PS's certificate fingerprint. The connection is TLS with
that certificate pinned, and the token comes from a file or the environment, never from the
command line (where every user of the machine could read it in the process list).
"""

from __future__ import annotations

import argparse
import os
import socket

from testbed.errors import EXIT_BAD_INPUT
from testbed.wire import MAX_IN_FLIGHT


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``testbed join``."""
    p = sub.add_parser(
        "join", help="make this machine a device of a run on another machine (TLS)",
        description="Join a run whose topology sets network.ps.listen, as a real device: "
                    "connect over TLS, trust only the PS certificate with the given "
                    "fingerprint, compute tiles until the run ends. `testbed up` prints this "
                    "command with the address and fingerprint filled in.")
    p.add_argument("ps_address", metavar="PS_ADDRESS", help="HOST:PORT the run printed")
    p.add_argument("--fingerprint", default=os.environ.get("TESTBED_TLS_FINGERPRINT", ""),
                   help="the PS certificate's fingerprint, sha256:... (default: "
                        "$TESTBED_TLS_FINGERPRINT)")
    p.add_argument("--token-file", default=os.environ.get("TESTBED_TOKEN_FILE", ""),
                   help="file holding the run's join token (default: $TESTBED_TOKEN_FILE, "
                        "else $TESTBED_TOKEN)")
    p.add_argument("--name", default=socket.gethostname(),
                   help="device name in the run's records (default: this host's name)")
    p.add_argument("--profile", default="",
                   help="device profile (name or path) whose sustained GFLOPS the PS starts "
                        "from; the PS then learns the real speed from the tiles")
    p.add_argument("--max-in-flight", type=int, default=2,
                   help=f"tiles outstanding at most (1 to {MAX_IN_FLIGHT}; default 2)")
    p.set_defaults(func=_join)


def _join(args: argparse.Namespace) -> int:
    import sys

    from testbed.agent.__main__ import main as agent_main

    if not args.fingerprint:
        print("error: --fingerprint is required (printed by `testbed up` with the join "
              "command; it pins the PS's certificate)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not args.token_file and not os.environ.get("TESTBED_TOKEN"):
        print("error: no token: give --token-file FILE (or set TESTBED_TOKEN_FILE or "
              "TESTBED_TOKEN)", file=sys.stderr)
        return EXIT_BAD_INPUT
    argv = ["--ps", args.ps_address, "--tls-fingerprint", args.fingerprint,
            "--name", args.name, "--kind", "real",
            "--max-in-flight", str(args.max_in_flight)]
    if args.token_file:
        argv += ["--token-file", args.token_file]
    if args.profile:
        from testbed.perf_model.profiles import ProfileError, load_profile
        try:
            profile = load_profile(args.profile)
        except ProfileError as exc:
            print(f"error: --profile: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        argv += ["--profile", args.profile, "--gflops", str(profile.sustained_gflops)]
    return agent_main(argv)
