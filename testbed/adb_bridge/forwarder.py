"""A phone's way into a Mininet topology: a forwarder inside the phone's own Mininet host.

Path of one phone connection on the Mininet backend::

    agent on phone ==adb reverse==> PhoneRelay (testbed up, root namespace)
        --AF_UNIX--> <socket dir>/<host>.sock  (this forwarder, in the phone's host namespace)
        --TCP--> PS at 10.0.0.1:<port>, over the phone host's veth, its switch, the switch links

The adb server delivers reverse connections in the root namespace, which has no route into the
topology. A path-bound Unix socket is reachable from every network namespace (it lives in the
file system), so the relay hands each connection over one, and the forwarder opens the PS
connection from the phone's host: the phone's bytes cross its own shaped link (HTB on the host's
``e0`` and on its switch port, like a device's) and share every bottleneck on the way with the
emulated devices. The PS sees the phone at the host's address.

The forwarder shapes nothing itself except, on a kernel without netem, the path's one-way delay
(``--delay-s``), which is what an emulated device's agent applies itself there too. The socket
directory belongs to the run (mode 0700); the forwarder removes its socket when it exits.

Usage (``testbed up`` starts it in the host; by hand only for debugging)::

    python -m testbed.adb_bridge.forwarder --listen-unix PATH --connect 10.0.0.1:PORT [--delay-s S]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType

from testbed.adb_bridge.relay import _Direction
from testbed.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK


def _pipe(client: socket.socket, host: str, port: int, delay_s: float) -> None:
    try:
        upstream = socket.create_connection((host, port), timeout=10)
        upstream.settimeout(None)
    except OSError as exc:
        print(f"forwarder: cannot reach the PS at {host}:{port}: {exc}", file=sys.stderr,
              flush=True)
        client.close()
        return
    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threads = (_Direction(client, upstream, None, delay_s, lambda n: None).start() +
               _Direction(upstream, client, None, delay_s, lambda n: None).start())
    for t in threads:
        t.join()
    client.close()
    upstream.close()


def serve(path: Path, host: str, port: int, delay_s: float = 0.0,
          ready: threading.Event | None = None) -> None:
    """Accept on the Unix socket at path and relay each connection to host:port, forever."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path.unlink(missing_ok=True)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(16)
    if ready is not None:
        ready.set()
    try:
        while True:
            client, _ = listener.accept()
            threading.Thread(target=_pipe, args=(client, host, port, delay_s),
                             daemon=True).start()
    finally:
        listener.close()
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """Run a forwarder until SIGTERM; exit 2 on bad arguments."""
    ap = argparse.ArgumentParser(prog="python -m testbed.adb_bridge.forwarder",
                                 description="Relay connections from a Unix socket to the PS "
                                             "(runs inside a phone's Mininet host).")
    ap.add_argument("--listen-unix", required=True, type=Path, help="Unix socket path to create")
    ap.add_argument("--connect", required=True, help="the PS as HOST:PORT")
    ap.add_argument("--delay-s", type=float, default=0.0,
                    help="one-way delay applied per direction (kernels without netem)")
    args = ap.parse_args(argv)
    host, _, port = args.connect.rpartition(":")
    if not host or not port.isdigit() or not 0 <= args.delay_s <= 60:
        print(f"error: --connect: expected HOST:PORT, got {args.connect!r} (and --delay-s in "
              f"[0, 60])", file=sys.stderr)
        return EXIT_BAD_INPUT

    def on_term(signum: int, _frame: FrameType | None) -> None:
        args.listen_unix.unlink(missing_ok=True)
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, on_term)
    try:
        serve(args.listen_unix, host, int(port), args.delay_s)
    except OSError as exc:
        print(f"forwarder: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
