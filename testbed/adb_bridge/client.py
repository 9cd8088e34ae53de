"""The adb server, reached with adbutils, and the device tracker that follows it.

Two decisions live here:

* :class:`AdbServer` wraps ``adbutils.AdbClient`` so that a connection failure is an error and
  never a side effect. (adbutils' own connection runs ``adb start-server`` when it cannot
  connect; a bridge that spawns an adb daemon on its own, on a port a test or the user chose for
  something else, is a surprise nobody asked for.)
* :class:`DeviceTracker` follows ``host:track-devices``. The server pushes the whole device list
  (``serial<TAB>state`` lines, 4-hex-digit length prefix) on every change. When the server closes
  the tracker (it died, or was restarted) the tracker reports an empty list (every phone is now
  unreachable: the adb server also carried their reverse connections) and reconnects with
  exponential backoff ``backoff_initial_s * 2**k`` capped at ``backoff_max_s``. Every
  ``crosscheck_s`` it also asks ``host:devices`` and, if the answers differ, trusts the fresh one
  and says so in the log (a tracker that missed an update must not keep a phone forever).
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from typing import Callable

import adbutils
from adbutils._adb import AdbConnection
from adbutils.errors import AdbConnectionError, AdbError, AdbTimeout

log = logging.getLogger(__name__)


class _NoSpawnConnection(AdbConnection):
    """An adbutils connection that fails instead of starting an adb server, to an IPv4 or
    IPv6 server (adbutils' own socket is IPv4 only: ``--adb [::1]:5037`` could not connect)."""

    CONNECT_TIMEOUT_S = 3.0  # as adbutils' own connect

    def __init__(self, host: str, port: int):
        self._address = (host, port)  # before the base class connects
        super().__init__(host, port)

    def _safe_connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self._address, timeout=self.CONNECT_TIMEOUT_S)
        except socket.timeout:
            raise AdbTimeout("connect to adb server timeout") from None
        except OSError as exc:
            raise AdbConnectionError(f"connect to adb server failed: {exc}") from None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.settimeout(None)
        return sock


class AdbServer(adbutils.AdbClient):
    """adbutils' client for one adb server (host, port) that never starts a server itself."""

    def __init__(self, host: str = "127.0.0.1", port: int = 5037, timeout_s: float = 10.0):
        super().__init__(host=host, port=port, socket_timeout=timeout_s)

    def make_connection(self, timeout: float | None = None) -> AdbConnection:  # noqa: D102
        conn = _NoSpawnConnection(self.host, self.port)
        conn.conn.settimeout(timeout or 10.0)
        return conn

    def states(self) -> dict[str, str]:
        """``host:devices`` as ``{serial: state}``."""
        with self.make_connection() as c:
            c.send_command("host:devices")
            c.check_okay()
            return parse_device_list(c.read_string_block())


def parse_device_list(text: str) -> dict[str, str]:
    """Parse ``serial<TAB>state`` lines (``host:devices``, ``host:track-devices``)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        serial, sep, state = line.strip().partition("\t")
        if sep and serial:
            out[serial] = state.strip().split()[0] if state.strip() else ""
    return out


def diff_states(old: dict[str, str], new: dict[str, str]
                ) -> list[tuple[str, str | None, str | None]]:
    """Changes between two device lists as ``(serial, old_state, new_state)``; None = absent."""
    changes = []
    for serial in sorted(set(old) | set(new)):
        if old.get(serial) != new.get(serial):
            changes.append((serial, old.get(serial), new.get(serial)))
    return changes


class DeviceTracker:
    """Follows ``host:track-devices`` in a thread; calls ``on_states`` with every full list."""

    def __init__(self, server: AdbServer, on_states: Callable[[dict[str, str], str], None],
                 backoff_initial_s: float = 0.1, backoff_max_s: float = 5.0,
                 crosscheck_s: float = 5.0):
        self.server = server
        self.on_states = on_states  # (states, cause) with cause "track" | "crosscheck" | "lost"
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.crosscheck_s = crosscheck_s
        self.connected = threading.Event()
        self.reconnects = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: dict[str, str] = {}

    def start(self) -> None:
        """Start following in a daemon thread."""
        self._thread = threading.Thread(target=self._run, name="adb-tracker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop following and join the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _emit(self, states: dict[str, str], cause: str) -> None:
        self._last = dict(states)
        self.on_states(dict(states), cause)

    def _run(self) -> None:
        backoff_s = self.backoff_initial_s
        while not self._stop.is_set():
            try:
                self._follow()
                backoff_s = self.backoff_initial_s  # a session that worked resets the backoff
            except (OSError, AdbError, AdbConnectionError, EOFError, ValueError) as exc:
                if self.connected.is_set():
                    log.warning("adb server %s:%s closed the device tracker (%s); phones are "
                                "unreachable until it is back", self.server.host,
                                self.server.port, exc)
                else:
                    log.debug("adb server %s:%s not reachable: %s", self.server.host,
                              self.server.port, exc)
            if self.connected.is_set():
                self.connected.clear()
                if self._last and not self._stop.is_set():
                    self._emit({}, "lost")
            if self._stop.wait(backoff_s):
                return
            backoff_s = min(self.backoff_max_s, backoff_s * 2)
            self.reconnects += 1

    def _follow(self) -> None:
        with self.server.make_connection(timeout=5.0) as c:
            c.send_command("host:track-devices")
            c.check_okay()
            self.connected.set()
            sock = c.conn
            buffer = b""
            next_check = time.monotonic() + self.crosscheck_s
            while not self._stop.is_set():
                readable, _, _ = select.select([sock], [], [], 0.2)
                if readable:
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise EOFError("the adb server closed the tracker")
                    buffer += chunk
                    while len(buffer) >= 4 and len(buffer) >= 4 + int(buffer[:4], 16):
                        size = int(buffer[:4], 16)
                        text = buffer[4:4 + size].decode(errors="replace")
                        buffer = buffer[4 + size:]
                        self._emit(parse_device_list(text), "track")
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + self.crosscheck_s
                    fresh = self.server.states()
                    if fresh != self._last:
                        log.warning("host:devices disagrees with the tracker (%s vs %s); "
                                    "using host:devices", fresh, self._last)
                        self._emit(fresh, "crosscheck")
