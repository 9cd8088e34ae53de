"""An attacker process without a token: hold N idle TCP connections to a port, re-opening each
one the server closes, until told to stop (SIGTERM) or for a given time.

Run as ``python -m tests.adversarial.idle_flood HOST PORT N SECONDS``. It raises its own file
limit to N + 256 (root may raise the hard limit too) and prints one JSON line at the end:
connections opened in all, the most held at once, and how many the server closed.
"""

from __future__ import annotations

import errno
import json
import resource
import selectors
import signal
import socket
import sys
import time


def raise_fd_limit(need: int) -> None:
    """Soft (and, where allowed, hard) file limit at least `need`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, max(hard, need)))
    except (ValueError, OSError):
        raise SystemExit(f"idle_flood: needs {need} file descriptors; the hard limit is {hard} "
                         "and this process may not raise it") from None


def hold(host: str, port: int, count: int, seconds: float) -> dict[str, int]:
    """Keep `count` connections open (say nothing on any) for `seconds`."""
    sel = selectors.DefaultSelector()
    stats = {"opened": 0, "held_max": 0, "closed_by_server": 0, "refused": 0}
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))

    def open_one() -> bool:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        code = s.connect_ex((host, port))
        if code not in (0, errno.EINPROGRESS):
            s.close()
            stats["refused"] += 1
            return False
        sel.register(s, selectors.EVENT_READ)
        stats["opened"] += 1
        return True

    end = time.monotonic() + seconds
    while not stop[0] and time.monotonic() < end:
        while len(sel.get_map()) < count and open_one():
            pass
        stats["held_max"] = max(stats["held_max"], len(sel.get_map()))
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if not data:  # the server closed it: open another in its place
                sel.unregister(s)
                s.close()
                stats["closed_by_server"] += 1
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    return stats


def main(argv: list[str] | None = None) -> int:
    """Hold the connections and print what happened as one JSON line."""
    host, port, count, seconds = (argv or sys.argv[1:])[:4]
    raise_fd_limit(int(count) + 256)
    print(json.dumps(hold(host, int(port), int(count), float(seconds))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
