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

And a third: every shell command on a phone goes through :class:`PhoneShell`, which reads the
answer itself instead of with adbutils' ``shell2``. adbutils' timeout is per read (a command
that prints a byte every few seconds never times out) and its fallback for a phone without
shell protocol v2 (every adbd of Android 6 and older) leaves ``stdout`` empty; here a command has
one deadline, a size limit, and the same (exit code, stdout, stderr) on either protocol, and
every failure is a :class:`PhoneCommandError` that names the phone and the command.

A device state is kept as the adb server prints it (``no permissions (...); see [...]``);
:func:`split_state` gives adb's name for it (:data:`ADB_STATES`) and the detail. What a phone
says is printed through :func:`printable`.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

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


MAX_SHELL_OUTPUT_BYTES = 16 * 2**20  # getprop is ~50 KB, dumpsys battery 1 KB: more is a fault
V1_EXIT_MARK = b"X4EXIT:"  # shell v1 has no exit status: `; echo X4EXIT:$?` (adbutils' own)


class PhoneCommandError(AdbError):
    """A shell command on a phone did not give a usable answer (too slow, cut, too large)."""

    def __init__(self, serial: str, command: str, reason: str):
        self.serial, self.command, self.reason = serial, command, reason
        super().__init__(f"phone {serial}: `{command_label(command)}` {reason}")


def command_label(command: str, most: int = 60) -> str:
    """A command as a message quotes it: one line, at most ``most`` characters."""
    one_line = " ".join(command.split())
    return one_line if len(one_line) <= most else one_line[:most - 3] + "..."


@dataclass(frozen=True)
class ShellOutput:
    """What a phone's shell command printed (``stderr`` is empty on shell v1, which merges
    both into ``stdout``) and its exit code."""

    code: int
    stdout: str
    stderr: str = ""


class PhoneShell:
    """Shell commands on one phone, each with one deadline for the whole answer."""

    def __init__(self, device: Any, timeout_s: float = 10.0,
                 max_bytes: int = MAX_SHELL_OUTPUT_BYTES):
        self.device = device  # an adbutils AdbDevice
        self.serial = str(device.serial)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._v2: bool | None = None  # known after the first command

    def run(self, command: str, timeout_s: float | None = None) -> ShellOutput:
        """Run ``command``; its answer must be complete within ``timeout_s`` (default: the
        shell's). Raises PhoneCommandError, or AdbError when the phone cannot be reached."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        if self._v2 is None:
            self._v2 = "shell_v2" in str(self.device.get_features()).split(",")
        service = (f"shell,v2:{command}" if self._v2
                   else f"shell:{command}; echo {V1_EXIT_MARK.decode()}$?")
        conn = self.device.open_transport(timeout=max(0.1, deadline - time.monotonic()))
        try:
            conn.send_command(service)
            conn.check_okay()
            return (self._read_v2 if self._v2 else self._read_v1)(conn.conn, command, deadline)
        except (socket.timeout, TimeoutError, AdbTimeout):
            raise PhoneCommandError(self.serial, command, "did not finish in "
                                    f"{self.timeout_s if timeout_s is None else timeout_s:g} s")\
                from None
        except (OSError, EOFError) as exc:
            raise PhoneCommandError(self.serial, command,
                                    f"failed: the connection broke ({exc})") from None
        finally:
            conn.close()

    def _recv(self, sock: socket.socket, deadline: float, command: str, got: int) -> bytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout()
        sock.settimeout(left)
        chunk = sock.recv(65536)
        if got + len(chunk) > self.max_bytes:
            raise PhoneCommandError(self.serial, command, f"printed more than "
                                    f"{self.max_bytes // 2**20} MiB; expected far less")
        return chunk

    def _read_v2(self, sock: socket.socket, command: str, deadline: float) -> ShellOutput:
        # packets: 1 id byte (1 stdout, 2 stderr, 3 exit), 4 bytes little-endian length, data
        streams = {1: bytearray(), 2: bytearray()}
        buffer = bytearray()
        got = 0
        while True:
            while len(buffer) >= 5:
                kind, size = struct.unpack("<BI", bytes(buffer[:5]))
                if len(buffer) < 5 + size:
                    break
                data, buffer = bytes(buffer[5:5 + size]), buffer[5 + size:]
                if kind == 3:
                    return ShellOutput(data[0] if data else 255, _text(streams[1]),
                                       _text(streams[2]))
                if kind in streams:
                    streams[kind] += data
            chunk = self._recv(sock, deadline, command, got)
            if not chunk:
                raise PhoneCommandError(self.serial, command, "ended without an exit status "
                                        "(the connection closed mid-answer)")
            got += len(chunk)
            buffer += chunk

    def _read_v1(self, sock: socket.socket, command: str, deadline: float) -> ShellOutput:
        out = bytearray()
        while chunk := self._recv(sock, deadline, command, len(out)):
            out += chunk
        at = out.rfind(V1_EXIT_MARK)
        status = bytes(out[at + len(V1_EXIT_MARK):]).strip() if at >= 0 else b""
        if not (status.isdigit() and len(status) <= 3):
            raise PhoneCommandError(self.serial, command, "ended without an exit status "
                                    "(the connection closed mid-answer)")
        # an old adbd runs v1 commands on a pty: its line ends are CRLF
        return ShellOutput(int(status), _text(out[:at]).replace("\r\n", "\n"))


def _text(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", errors="replace")


# adb's connection states as the adb server prints them (AOSP packages/modules/adb,
# ``to_string(ConnectionState)`` in transport.cpp). Only "no permissions" carries more text: the
# reason and a link, "no permissions (user in plugdev group; are your udev rules wrong?); see
# [http://developer.android.com/tools/device.html]" (``UsbNoPermissionsShortHelpText``).
ADB_STATES = ("device", "unauthorized", "authorizing", "connecting", "offline",
              "no permissions", "bootloader", "recovery", "rescue", "sideload", "host",
              "detached")


def parse_device_list(text: str) -> dict[str, str]:
    """Parse ``serial<TAB>state`` lines (``host:devices``, ``host:track-devices``) into
    ``{serial: state}``, the state whole (with the detail some states carry: split_state)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        serial, sep, state = line.strip().partition("\t")
        if sep and serial:
            out[serial] = " ".join(state.split())
    return out


def split_state(state: str) -> tuple[str, str]:
    """A state as ``(adb's name of it, the detail after the name)``: ``("no permissions",
    "(user in plugdev group; ...); see [...]")``; an unknown state is all name."""
    for name in ADB_STATES:  # without a udev problem to name: "no permissions; see [...]"
        if state.startswith(name) and not state[len(name):len(name) + 1].isalnum():
            return name, state[len(name):].lstrip(" ;").strip()
    return state, ""


def printable(text: str, most: int = 80) -> str:
    """Text from a phone as one terminal-safe line: every character that is not printable
    (newlines, escape sequences, bidi controls, ...) as its Python escape, at most ``most``
    characters (then cut, ending in "...")."""
    head = text[: most + 1]  # an escape only lengthens what it replaces
    pieces = [ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
              for ch in head]
    if len(head) == len(text) and sum(map(len, pieces)) <= most:
        return "".join(pieces)
    kept, length = [], 0
    for piece in pieces:  # cut between escapes, never inside one
        if length + len(piece) > most - 3:
            break
        kept.append(piece)
        length += len(piece)
    return "".join(kept) + "..."


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
