"""The per-phone TCP relay between a phone's ``adb reverse`` port and the PS.

Path of one phone's connection, and the names used for its ends::

    agent on phone --> 127.0.0.1:phone_port (on the phone) ==adb reverse==>
        127.0.0.1:relay.port (this relay, on the host) --> PS (ps_host:ps_port)

Directions follow the topology: ``down`` = PS -> phone, ``up`` = phone -> PS. Shaping, per
direction: a chunk read at time t leaves at ``max(t, previous_departure) + size_bits / rate_bps
+ delay_s`` (serialization at the link rate, then one-way delay), so a slow link queues and a long
link delays, as a real bottleneck link would. Loss cannot be emulated on a TCP byte stream and is
refused by the ``adb:`` config.

The relay is also where the PS can tell which phone a connection is: ``upstream_addresses()``
lists the local (host, port) of every connection the relay opened to the PS; the PS sees exactly
those as peer addresses.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)
CHUNK_BYTES = 16384


@dataclass(frozen=True)
class RelayShaping:
    """Link of the phone's relay; None = not limited."""

    down_bps: float | None = None  # PS -> phone
    up_bps: float | None = None  # phone -> PS
    delay_s: float = 0.0  # one-way, each direction


class _Direction:
    """One direction of one connection: reader -> timed queue -> writer."""

    def __init__(self, src: socket.socket, dst: socket.socket, rate_bps: float | None,
                 delay_s: float, on_bytes: Callable[[int], None]):
        self.src, self.dst = src, dst
        self.rate_bps, self.delay_s = rate_bps, delay_s
        self.on_bytes = on_bytes
        self.queue: queue.Queue[tuple[float, bytes] | None] = queue.Queue()
        self.link_free_s = 0.0

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._read, daemon=True),
                   threading.Thread(target=self._write, daemon=True)]
        for t in threads:
            t.start()
        return threads

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(CHUNK_BYTES)
                if not data:
                    break
                now = time.monotonic()
                start = max(now, self.link_free_s)
                self.link_free_s = start + (len(data) * 8 / self.rate_bps if self.rate_bps else 0)
                self.queue.put((self.link_free_s + self.delay_s, data))
        except OSError:
            pass
        self.queue.put(None)

    def _write(self) -> None:
        try:
            while True:
                item = self.queue.get()
                if item is None:
                    break
                due_s, data = item
                wait_s = due_s - time.monotonic()
                if wait_s > 0:
                    time.sleep(wait_s)
                self.dst.sendall(data)
                self.on_bytes(len(data))
        except OSError:
            pass
        try:
            self.dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class PhoneRelay:
    """Listens on 127.0.0.1:<port> for one phone and relays each connection to the PS."""

    def __init__(self, serial: str, ps_host: str, ps_port: int,
                 shaping: RelayShaping = RelayShaping(), listen_host: str = "127.0.0.1",
                 upstream_unix: str | None = None):
        self.serial = serial
        # On Mininet: the phone's forwarder (testbed.adb_bridge.forwarder) listens here, inside
        # the phone's host, and opens the PS connection from there; ps_host/ps_port unused.
        self.upstream_unix = upstream_unix
        self.ps_host, self.ps_port = ps_host, ps_port
        self.shaping = shaping
        self.listen_host = listen_host
        self.port = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections_total = 0
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self._upstream: list[tuple[str, int]] = []  # ('unix', n) for a Unix upstream

    def start(self) -> int:
        """Start listening; return the host port the phone's reverse rule must point at."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((self.listen_host, 0))
        sock.listen(16)
        self._listener = sock
        self.port = sock.getsockname()[1]
        threading.Thread(target=self._accept, name=f"relay-{self.serial}", daemon=True).start()
        return self.port

    def upstream_addresses(self) -> list[tuple[str, int]]:
        """Local addresses of the open connections to the PS (what the PS sees as peers)."""
        with self._lock:
            return list(self._upstream)

    def open_connections(self) -> int:
        """How many phone connections are open now."""
        with self._lock:
            return len(self._upstream)

    def stop(self) -> None:
        """Close the listener and every relayed connection (the PS sees the phone go)."""
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() thread
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            sockets, self._sockets, self._upstream = self._sockets, [], []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _count(self, direction: str) -> Callable[[int], None]:
        def add(n: int) -> None:
            with self._lock:
                if direction == "up":
                    self.bytes_up += n
                else:
                    self.bytes_down += n
        return add

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                phone_side, _ = listener.accept()
            except OSError:
                return
            try:
                ps_side = self._connect_upstream()
            except OSError as exc:
                log.warning("relay for %s: cannot reach the PS at %s: %s", self.serial,
                            self.upstream_unix or f"{self.ps_host}:{self.ps_port}", exc)
                phone_side.close()
                continue
            phone_side.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # a Unix socket has no address of its own: a per-connection stand-in keeps the
            # bookkeeping (the PS sees the forwarder's address, in the phone's host)
            local = ps_side.getsockname()[:2] if self.upstream_unix is None else \
                ("unix", self.connections_total)
            with self._lock:
                self._sockets += [phone_side, ps_side]
                self._upstream.append(local)
                self.connections_total += 1
            up = _Direction(phone_side, ps_side, self.shaping.up_bps, self.shaping.delay_s,
                            self._count("up"))
            down = _Direction(ps_side, phone_side, self.shaping.down_bps, self.shaping.delay_s,
                              self._count("down"))
            threads = up.start() + down.start()
            threading.Thread(target=self._reap, args=(threads, phone_side, ps_side, local),
                             daemon=True).start()

    def _connect_upstream(self) -> socket.socket:
        if self.upstream_unix is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            try:
                sock.connect(self.upstream_unix)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection((self.ps_host, self.ps_port), timeout=5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        return sock

    def _reap(self, threads: list[threading.Thread], a: socket.socket, b: socket.socket,
              local: tuple[str, int]) -> None:
        for t in threads:
            t.join()
        with self._lock:
            if local in self._upstream:
                self._upstream.remove(local)
            self._sockets = [s for s in self._sockets if s not in (a, b)]
        a.close()
        b.close()
