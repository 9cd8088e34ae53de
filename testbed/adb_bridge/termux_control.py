"""The bridge's side of the Termux listener (``termux-agent.sh serve``, ``phone/termux_serve.py``).

On a stock phone the adb shell may not send Termux's RUN_COMMAND intent, so the user starts a
listener in Termux once; it dials ``127.0.0.1:<control_port>`` on the phone (``phone_port + 2``),
which ``adb reverse tcp:<control_port> tcp:<port>`` carries to :class:`TermuxControl` on this
host. Names and numbers, written down once:

* the control port on the phone is ``phone_port + 2`` (``+ 1`` is the doctor's probe port);
* Termux's uid is read with ``pm list packages -U com.termux`` (``package:com.termux
  uid:10234``), or ``dumpsys package com.termux`` (``userId=10234``) where ``-U`` is unknown;
* the sockets on the phone come from ``cat /proc/net/tcp /proc/net/tcp6`` (addresses and ports
  in hex, state ``01`` ESTABLISHED, ``06`` TIME_WAIT, ``0A`` LISTEN; the uid is the socket
  owner's).

**Authentication (the decision; docs/adb-bridge.md has the reasoning).** Any app on the phone
may connect to the control port, so a connection is trusted only after the phone's own socket
table says that *every* live socket connected to the control port belongs to Termux's uid. If
that holds, the host end of this connection is one of Termux's sockets or a socket that no longer
exists (data sent to it is dropped), so what the bridge sends next (the join token) reaches
Termux or nobody; a socket never changes owner, so the connection stays trusted. If any other
uid holds a socket to the control port, every connection is refused (closed, nothing sent) and
the refusal names that uid. A secret pushed over adb cannot replace this check: anything the adb
shell can write that Termux can read, every app can read.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from testbed.adb_bridge import agent_package
from testbed.adb_bridge.parsers import parse_int
from testbed.user_paths import load_user_json

log = logging.getLogger(__name__)

CONTROL_PORT_OFFSET = 2  # phone_port + 2
PROTOCOL = 1
HELLO_TIMEOUT_S = 10.0
TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
              "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
              "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}
DEAD_STATES = ("TIME_WAIT", "CLOSE", "LISTEN")  # no owner that could read what we send
SOCKETS_COMMAND = "cat /proc/net/tcp /proc/net/tcp6"
UID_COMMAND = "pm list packages -U com.termux"
UID_FALLBACK_COMMAND = "dumpsys package com.termux"
SERVE_SCRIPT = agent_package.PHONE_DIR + "/termux-agent.sh"
SERVE_PY = "termux_serve.py"


def serve_command(control_port: int) -> str:
    """What the user types in Termux (the default port needs no argument)."""
    if control_port == 7700 + CONTROL_PORT_OFFSET:
        return f"sh {SERVE_SCRIPT} serve"
    return f"sh {SERVE_SCRIPT} serve 127.0.0.1:{control_port}"


@dataclass(frozen=True)
class PhoneSocket:
    """One line of the phone's /proc/net/tcp or tcp6."""

    local_ip: str
    local_port: int
    remote_ip: str
    remote_port: int
    state: str  # TCP_STATES value
    uid: int
    inode: int  # 0: an orphan, closed by its owner, which no process can read any more

    @property
    def live(self) -> bool:
        """Whether a process may still read what arrives on this socket."""
        return self.inode != 0 and self.state not in DEAD_STATES


def _ip(hex_text: str) -> str:
    """An address of /proc/net/tcp[6] (32-bit words in host byte order: little endian on ARM
    and x86) as text; an IPv4-mapped IPv6 address becomes its IPv4 form."""
    words = [bytes.fromhex(hex_text[i:i + 8])[::-1] for i in range(0, len(hex_text), 8)]
    raw = b"".join(words)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw)
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return socket.inet_ntop(socket.AF_INET, raw[12:])
    return socket.inet_ntop(socket.AF_INET6, raw)


def parse_proc_net_tcp(text: str) -> list[PhoneSocket]:
    """Every socket line of /proc/net/tcp and /proc/net/tcp6 (header lines are skipped)."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 10 or parse_int(fields[0].rstrip(":")) is None:
            continue
        uid, inode = parse_int(fields[7]), parse_int(fields[9])
        if uid is None or inode is None:
            continue
        try:
            (lip, lport), (rip, rport) = (f.split(":") for f in fields[1:3])
            out.append(PhoneSocket(_ip(lip), int(lport, 16), _ip(rip), int(rport, 16),
                                   TCP_STATES.get(fields[3].upper(), fields[3]), uid, inode))
        except (ValueError, OSError):
            continue
    return out


def parse_package_uid(text: str) -> int | None:
    """Termux's uid from ``pm list packages -U`` or ``dumpsys package`` output."""
    m = (re.search(r"^package:com\.termux\s+uid:([0-9]+)", text, re.MULTILINE)
         or re.search(r"\buserId=([0-9]+)", text))
    return parse_int(m.group(1)) if m else None


def _loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1"


def foreign_uids(sockets: list[PhoneSocket], control_port: int, termux_uid: int) -> set[int]:
    """Uids other than Termux's that hold a live socket connected to the control port."""
    return {s.uid for s in sockets if s.remote_port == control_port
            and _loopback(s.remote_ip) and s.live and s.uid != termux_uid}


def termux_sockets(sockets: list[PhoneSocket], control_port: int, termux_uid: int) -> int:
    """How many live sockets of Termux's uid are connected to the control port."""
    return sum(1 for s in sockets if s.remote_port == control_port
               and _loopback(s.remote_ip) and s.live and s.uid == termux_uid)


class ControlError(Exception):
    """The listener is not there, refused, or did not answer."""


def reverse_failed(control_port: int, exc: Exception) -> str:
    """Why ``adb reverse tcp:<control_port>`` failed, and what to do."""
    return (f"adb reverse tcp:{control_port} failed ({exc}): something on the phone already "
            f"listens on 127.0.0.1:{control_port} (another app), and whatever listens there "
            f"would talk to the Termux listener; stop that app, or move the ports (the phone "
            f"port, --phone-port or adb.phone_port; the control port is it + 2)")


Shell = Callable[[str], "tuple[int, str]"]


class TermuxControl:
    """Accepts the Termux listener's connections on 127.0.0.1:<port>, verifies each against the
    phone's socket table, and sends it requests.

    ``shell`` runs an adb shell command on the phone and returns (exit code, output).
    ``on_event`` gets ``("listener-connected", hello)``, ``("listener-refused", {"reason",
    "uids"})``, ``("listener-lost", {})`` and the listener's own events (``agent-exited``)."""

    def __init__(self, shell: Shell, control_port: int,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None):
        self.shell = shell
        self.control_port = control_port
        self.on_event = on_event
        self.hello: dict[str, Any] = {}
        self.termux_uid: int | None = None
        self.last_refusal = ""
        self.refused_uids: set[int] = set()
        self._listener: socket.socket | None = None
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()
        self._connected = threading.Condition(self._lock)
        self._replies: dict[int, dict[str, Any]] = {}
        self._next_id = 1
        self._closed = False

    @property
    def port(self) -> int:
        """The host port the reverse rule points at."""
        assert self._listener is not None
        return int(self._listener.getsockname()[1])

    def start(self) -> int:
        """Listen on an ephemeral loopback port; return it."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        self._listener = sock
        threading.Thread(target=self._accept_loop, name=f"termux-control-{self.port}",
                         daemon=True).start()
        return self.port

    def stop(self) -> None:
        """Close the listening socket and the connection (the listener dials again later)."""
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
            self._connected.notify_all()
        for s in (self._listener, conn):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def connected(self) -> bool:
        """Whether a verified listener is connected now."""
        with self._lock:
            return self._conn is not None

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for a verified listener."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._conn is None and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._connected.wait(left)
            return self._conn is not None

    def request(self, cmd: str, timeout_s: float = 15.0, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its answer; ControlError when there is none."""
        with self._lock:
            conn = self._conn
            if conn is None:
                raise ControlError("no Termux listener is connected")
            rid = self._next_id
            self._next_id += 1
        try:
            conn.sendall((json.dumps({"id": rid, "cmd": cmd, **fields}) + "\n").encode())
        except OSError as exc:
            raise ControlError(f"the Termux listener's connection broke: {exc}") from exc
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while rid not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self._conn is not conn:
                    raise ControlError(f"the Termux listener did not answer {cmd!r}")
                self._connected.wait(min(left, 0.5))
            return self._replies.pop(rid)

    # -- internals ------------------------------------------------------------------------------

    def _emit(self, kind: str, data: dict[str, Any]) -> None:
        if self.on_event is not None:
            try:
                self.on_event(kind, data)
            except Exception:  # a broken callback must not stop the control thread
                log.exception("termux control event callback failed")

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(conn,), daemon=True).start()

    def _read_line(self, conn: socket.socket, buf: bytearray) -> bytes | None:
        while b"\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            buf += chunk
            if len(buf) > 1 << 20:
                return None
        line, _, rest = bytes(buf).partition(b"\n")
        buf[:] = rest
        return line

    def verify(self) -> str | None:
        """Why the phone's socket table does not let this connection be trusted, or None."""
        if self.termux_uid is None:
            code, out = self.shell(UID_COMMAND)
            uid = parse_package_uid(out) if code == 0 else None
            if uid is None:
                uid = parse_package_uid(self.shell(UID_FALLBACK_COMMAND)[1])
            if uid is None:
                return "cannot find Termux's uid (`pm list packages -U com.termux` and " \
                       "`dumpsys package com.termux` name none): is Termux installed?"
            self.termux_uid = uid
        code, out = self.shell(SOCKETS_COMMAND)
        sockets = parse_proc_net_tcp(out)
        if not sockets:
            return ("the adb shell cannot read the phone's /proc/net/tcp, so the bridge cannot "
                    "tell Termux's connection from another app's")
        others = foreign_uids(sockets, self.control_port, self.termux_uid)
        self.refused_uids = others
        if others:
            return (f"uid {', '.join(map(str, sorted(others)))} (not Termux, uid "
                    f"{self.termux_uid}) is connected to the control port "
                    f"127.0.0.1:{self.control_port} on the phone")
        if termux_sockets(sockets, self.control_port, self.termux_uid) == 0:
            return ("the connection is gone from the phone's socket table (no socket of Termux "
                    f"uid {self.termux_uid} to 127.0.0.1:{self.control_port})")
        return None

    def _admit(self, conn: socket.socket) -> None:
        buf = bytearray()
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            line = self._read_line(conn, buf)
            hello = load_user_json(line.decode()) if line else None
            if not isinstance(hello, dict) or hello.get("hello") != "testbed-termux":
                raise ControlError("the peer did not say hello as the Termux listener does")
            if hello.get("protocol") != PROTOCOL:
                raise ControlError(f"the Termux listener speaks protocol "
                                   f"{hello.get('protocol')}, the bridge {PROTOCOL}: it pushes "
                                   f"the new script; end the listener (Ctrl-C) and start it again")
            try:
                problem = self.verify()
            except (ControlError, OSError, ValueError):
                raise
            except Exception as exc:  # the adb client's errors: the phone went away meanwhile
                problem = f"cannot read the phone's socket table over adb: {exc}"
            if problem is not None:
                raise ControlError(problem)
        except (ControlError, OSError, ValueError) as exc:
            self.last_refusal = str(exc)
            log.warning("refused a connection to the Termux control port: %s", exc)
            self._emit("listener-refused", {"reason": str(exc),
                                            "uids": sorted(self.refused_uids)})
            conn.close()
            return
        conn.settimeout(None)
        with self._lock:
            if self._closed:
                conn.close()
                return
            old, self._conn = self._conn, conn
            self.hello = hello
            self.last_refusal = ""
            self._connected.notify_all()
        if old is not None:
            old.close()
        self._emit("listener-connected", hello)
        self._read_loop(conn, buf)

    def _read_loop(self, conn: socket.socket, buf: bytearray) -> None:
        try:
            while True:
                line = self._read_line(conn, buf)
                if line is None:
                    break
                message = load_user_json(line.decode())  # (bad UTF-8: a ValueError)
                if not isinstance(message, dict):
                    continue
                if "event" in message:
                    self._emit(str(message["event"]), message)
                elif isinstance(message.get("id"), int):
                    with self._lock:
                        self._replies[message["id"]] = message
                        self._connected.notify_all()
        except (OSError, ValueError):
            pass
        with self._lock:
            lost = self._conn is conn
            if lost:
                self._conn = None
                self._connected.notify_all()
        conn.close()
        if lost:
            self._emit("listener-lost", {})
