"""``python -m testbed.agent``: run one device agent (emulated or real)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from testbed.agent.agent import Agent, AgentOptions
from testbed.agent.behaviour import MODES, Behaviour, BehaviourError
from testbed.agent.link import LinkDirection
from testbed.agent.tls import PinError, normalize, ps_address_arg
from testbed.errors import EXIT_BAD_INPUT, EXIT_OK
from testbed.units import int_arg, number_arg
from testbed.wire import MAX_IN_FLIGHT
from testbed.wire.cache import DEFAULT_CACHE_BYTES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m testbed.agent",
        description="A testbed device: joins the parameter server, computes GEMM tiles, returns "
                    "them. Emulated devices (--kind emulated --profile P) hold each result for "
                    "the time their device profile predicts; real devices just compute.")
    p.add_argument("--ps", required=True, type=ps_address_arg,
                   help="PS address HOST:PORT ([v6]:PORT for IPv6)")
    p.add_argument("--token", default=os.environ.get("TESTBED_TOKEN", ""),
                   help="join token (default: $TESTBED_TOKEN). Visible in the process list: "
                        "prefer $TESTBED_TOKEN or --token-file")
    p.add_argument("--token-file", default=None,
                   help="read the join token from this file (default: $TESTBED_TOKEN_FILE); "
                        "it wins over --token")
    p.add_argument("--tls-fingerprint", default=os.environ.get("TESTBED_TLS_FINGERPRINT", ""),
                   help="the PS's certificate fingerprint (sha256:...), printed by `testbed up` "
                        "when the topology sets network.ps.listen: connect over TLS and trust "
                        "only that certificate (default: $TESTBED_TLS_FINGERPRINT; empty: plain "
                        "gRPC, for loopback and emulated networks)")
    p.add_argument("--name", required=True, help="device name, e.g. phones-3")
    p.add_argument("--instance", default="",
                   help="who this device is to the PS, kept by a launcher across restarts of "
                        "the device's agent: a join with the same name and instance takes the "
                        "name back from a registration the PS still holds (default: random, "
                        "this process; a join under a name another device holds gets NAME-2)")
    p.add_argument("--group", default="", help="topology group")
    p.add_argument("--kind", choices=("emulated", "real"), default="real")
    p.add_argument("--profile", default="", help="device profile name or path (emulated)")
    # a run's seed (at most 2^63 - 1) x 1000 + the device's index (testbed up)
    p.add_argument("--seed", type=int_arg(0, 2**128), default=0,
                   help="seed of the device model's noise")
    p.add_argument("--max-in-flight", type=int, default=2,
                   help=f"tiles outstanding at most (1 to {MAX_IN_FLIGHT}; default 2)")
    # the numbers are checked as a topology's are (testbed/topology.py's limits, not imported:
    # its pydantic models would load in every agent): `--cache-mib inf` was a traceback, 1e30 a
    # join retried for ever, -5 and nan ran
    p.add_argument("--cache-mib", type=number_arg(1, 64 * 1024),
                   default=DEFAULT_CACHE_BYTES / 2**20,
                   help="operand cache budget, MiB (default %(default)g: a step's blocks of "
                        "every layer kept from forward to backward; docs/planning.md)")
    p.add_argument("--gflops", type=number_arg(0, sys.float_info.max), default=0.0,
                   help="predicted GFLOPS (default: the profile's, or 1)")
    p.add_argument("--down-bps", type=number_arg(0, 1e12, above_low=True), default=None,
                   help="emulated downlink, bit/s")
    p.add_argument("--up-bps", type=number_arg(0, 1e12, above_low=True), default=None,
                   help="emulated uplink, bit/s")
    # a topology's delay, at most 60 s, times the run's dilation, at most 10,000
    p.add_argument("--delay-s", type=number_arg(0, 600_000), default=0.0,
                   help="emulated one-way delay, wall s")
    # as a topology's: a link that loses every packet carries nothing
    p.add_argument("--loss", type=number_arg(0, 1, below_high=True), default=0.0,
                   help="emulated loss probability, below 1")
    p.add_argument("--partitioned", action="store_true",
                   help="start cut off, as after SIGUSR1 (nothing in or out until SIGUSR2): "
                        "a churn trace's device that joins while its link is down, on "
                        "loopback")
    p.add_argument("--control-file", default="",
                   help='JSON file {"slow": factor} polled for a compute slow-down (churn)')
    b = p.add_argument_group("emulated misbehaviour (testbed/agent/behaviour.py)")
    b.add_argument("--byzantine-rate", type=number_arg(0, 1), default=0.0,
                   help="share of tiles returned wrong, [0, 1] (default 0: honest)")
    b.add_argument("--byzantine-modes", default=",".join(MODES),
                   help=f"comma-separated corruption modes among {','.join(MODES)}")
    b.add_argument("--byzantine-noise", type=number_arg(0, sys.float_info.max, above_low=True),
                   default=0.01,
                   help="noise standard deviation relative to the tile's RMS")
    b.add_argument("--byzantine-scale", type=number_arg(0, sys.float_info.max, above_low=True),
                   default=1.5,
                   help="factor of a scaled tile")
    b.add_argument("--straggler-factor", type=number_arg(1, 1000), default=1.0,
                   help="compute time multiplier of a straggling tile, >= 1")
    b.add_argument("--straggler-rate", type=number_arg(0, 1), default=1.0,
                   help="share of tiles that straggle, [0, 1]")
    b.add_argument("--behaviour-log", default="",
                   help="append every corruption made to this JSON-lines file")
    p.add_argument("--progress-s", type=number_arg(0, 86_400), default=0.0,
                   help="log a line on the tiles computed every this many seconds (default 0: "
                        "none; testbed join sets 60)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def behaviour_from_args(args: argparse.Namespace) -> Behaviour | None:
    """The Behaviour the flags ask for (None: an honest, normal device)."""
    behaviour = Behaviour(
        byzantine_rate=args.byzantine_rate,
        byzantine_modes=tuple(m.strip() for m in args.byzantine_modes.split(",") if m.strip()),
        noise_rel=args.byzantine_noise, scale_factor=args.byzantine_scale,
        straggler_factor=args.straggler_factor, straggler_rate=args.straggler_rate,
        seed=args.seed, log_path=args.behaviour_log)
    return behaviour if behaviour.active else None


MAX_TOKEN_BYTES = 4096  # `testbed up` makes 32 hex digits; the file's first line, at most
TOKEN_WAIT_NOTE_S = 2.0  # a token file not read by then is said to be waited for


def read_token(args: argparse.Namespace) -> str:
    """The join token: from --token-file when given (first line, stripped), else --token.
    The file may be a pipe (``--token-file <(pass show run)``), so it is read, not checked,
    and only so far. Refused with ValueError: a first line longer than MAX_TOKEN_BYTES
    (/dev/zero has none), an empty or blank one, one that is not printable UTF-8 text (a
    binary file named by mistake): each would be sent and refused by the PS, again and again.
    """
    if not args.token_file:
        return str(args.token)
    return read_token_file(args.token_file)


def read_token_file(path: str) -> str:
    """A token file's first line, stripped; ValueError or OSError as :func:`read_token` says
    (``testbed join`` reads it itself, to name where the file was given)."""
    # a FIFO nobody writes to holds the open (or the read) for ever: said once, after a while
    waiting = threading.Timer(TOKEN_WAIT_NOTE_S, lambda: print(
        f"waiting for the token's line from {path} (a pipe or FIFO nothing has written to "
        f"yet?)", file=sys.stderr, flush=True))
    waiting.daemon = True
    waiting.start()
    try:
        with open(path, "rb") as f:
            head = f.read(MAX_TOKEN_BYTES + 1)
    finally:
        waiting.cancel()
    line = head.split(b"\n", 1)[0]
    if len(line) > MAX_TOKEN_BYTES:
        raise ValueError(f"its first line is longer than {MAX_TOKEN_BYTES:,} bytes; a token "
                         f"is one short line")
    try:  # utf-8-sig: a BOM (a Windows editor's save) was called a control character
        token = line.decode("utf-8-sig").strip()
    except UnicodeDecodeError:
        raise ValueError("its first line is not text (a binary file?); expected the token "
                         "`testbed up` wrote, one line of printable characters") from None
    if not token:
        raise ValueError("its first line is empty; expected the token `testbed up` wrote, "
                         "one line of printable characters")
    if not token.isprintable():
        raise ValueError("its first line holds control characters (a binary file?); expected "
                         "the token `testbed up` wrote, one line of printable characters")
    return token


def main(argv: list[str] | None = None, *, stopped_exit: int = EXIT_OK,
         supervised: bool = False) -> int:
    """Run one agent until the PS ends the run (0), refuses it (3), or a signal stops it
    (SIGINT, SIGTERM, SIGHUP: it leaves, says so in one line, and exits ``stopped_exit``: 0 for
    the agents a run starts, whose SIGTERM is a churn trace's graceful leave; 130 for
    ``testbed join``, interrupted as every testbed command). SIGQUIT is a crash: it dies as by
    SIGKILL, at once, or, cut off by SIGUSR1, once healed or dropped by the PS
    (:meth:`~testbed.agent.agent.Agent.request_crash`).

    ``supervised``: an agent ``testbed up`` started (its fork server). It ignores SIGINT and
    SIGHUP, which a Ctrl-C or a closed terminal sends the whole process group: the run stops it
    after its PS, which tells every device the run is over. Leaving on them itself, every agent
    reached the PS as a departure, its tiles re-queued, and the report drew every device
    departed."""
    args = build_parser().parse_args(argv)
    source = "--token-file"  # what a problem with the file is blamed on
    if args.token_file is None:
        args.token_file, source = os.environ.get("TESTBED_TOKEN_FILE", ""), "$TESTBED_TOKEN_FILE"
    try:
        token = read_token(args)
    except OSError as exc:
        print(f"error: {source} {args.token_file}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValueError as exc:
        print(f"error: {source} {args.token_file}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not 1 <= args.max_in_flight <= MAX_IN_FLIGHT:
        print(f"error: --max-in-flight: expected 1 to {MAX_IN_FLIGHT}, got {args.max_in_flight}",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format=f"%(asctime)s {args.name} %(levelname)s: %(message)s")
    try:
        behaviour = behaviour_from_args(args)
    except BehaviourError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.tls_fingerprint:
        try:
            args.tls_fingerprint = normalize(args.tls_fingerprint)
        except PinError as exc:
            print(f"error: --tls-fingerprint: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    model = None
    gflops = args.gflops
    if args.kind == "emulated":
        if not args.profile:
            print("error: --kind emulated needs --profile", file=sys.stderr)
            return EXIT_BAD_INPUT
        from testbed.emulator.device_model import device_model_for
        from testbed.perf_model.profiles import ProfileError, load_profile
        try:
            # checked by the supervisor already; the check would import pydantic here
            profile = load_profile(args.profile, check=False)
        except ProfileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        model = device_model_for(profile, seed=args.seed)
        gflops = gflops or profile.sustained_gflops
    options = AgentOptions(
        ps_address=args.ps, token=token, name=args.name, instance=args.instance,
        group=args.group, kind=args.kind,
        profile=args.profile, predicted_gflops=gflops or 1.0, max_in_flight=args.max_in_flight,
        cache_bytes=int(args.cache_mib * 1024 * 1024), control_file=args.control_file,
        behaviour=behaviour, tls_fingerprint=args.tls_fingerprint,
        progress_s=args.progress_s,
        down=LinkDirection(args.down_bps, args.delay_s, args.loss),
        up=LinkDirection(args.up_bps, args.delay_s, args.loss))
    agent = Agent(options, model)
    signal.signal(signal.SIGTERM, lambda *_: agent.request_stop("SIGTERM"))
    for sig in (signal.SIGINT, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(sig, signal.SIG_IGN if supervised else
                      lambda s, _f: agent.request_stop(signal.Signals(s).name))
    agent.set_partitioned(args.partitioned)
    # a crash that a cut of the agent's own (SIGUSR1) holds: testbed up's SIGKILL on loopback
    signal.signal(signal.SIGQUIT, lambda *_: agent.request_crash())
    signal.signal(signal.SIGUSR1, lambda *_: agent.set_partitioned(True))
    signal.signal(signal.SIGUSR2, lambda *_: agent.set_partitioned(False))
    code = agent.run()
    return stopped_exit if code == EXIT_OK and agent.stopped_by else code


if __name__ == "__main__":
    sys.exit(main())
