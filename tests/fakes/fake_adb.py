"""A fake adb server that speaks the real ADB host protocol over TCP, with scripted phones.

It stands where ``adb start-server`` would listen (default 127.0.0.1:<ephemeral>), so adbutils and
the real ``adb`` client (``adb -H 127.0.0.1 -P PORT ...``) both talk to it. The wire format is the
one AOSP documents in ``adb/OVERVIEW.TXT``, ``SERVICES.TXT`` and ``SYNC.TXT``:

* a request is 4 hex digits of length, then the service name (``000chost:version``);
* a reply starts with ``OKAY`` or ``FAIL`` + a length-prefixed message;
* ``host:version`` answers 41 (``0029``): the protocol version of adb 1.0.41, so the real client
  accepts the server instead of killing and restarting it;
* ``host:transport:SERIAL``, ``host:tport:serial:SERIAL`` (+ 8-byte transport id),
  ``host:transport-any``, ``host:tport:any`` switch the socket to a phone; after that the socket
  carries one device service: ``shell:``, ``shell,v2[,...]:`` (packets: 1 id byte, 4 bytes length,
  ids 1 stdout, 2 stderr, 3 exit), ``sync:`` (``SEND``/``DATA``/``DONE``, ``STAT``, ``RECV``,
  ``QUIT``), ``reverse:forward``, ``reverse:list-forward``, ``reverse:killforward``,
  ``reverse:killforward-all``.

Phones are :class:`FakePhone` objects scripted by the test: :meth:`FakeAdbServer.plug`,
``set_state`` (``unauthorized`` -> ``device``, ``offline``), ``unplug``, ``drop_reverse``,
``hold_uplink``/``release_uplink`` (the phone's bytes towards the host stop moving, as on a
stalled link), ``unplug_on_download`` (once the host has sent the phone N more bytes, hold its
uplink and pull the cable right after they are delivered), ``drop_connections`` (a USB hiccup:
connections break, rules and processes stay) and ``restart`` (the adb server goes away and
comes back on the same port). Shell commands answer from recorded outputs (``phone.commands``),
from a few built-ins (``getprop``, ``echo``, ``kill``, ``true``), or from ``phone.exec_hook``,
which may really start a local process: that is how a test runs the real device agent as the
"phone" (see :class:`LocalProcessCommand`).

A reverse rule ``tcp:D -> tcp:H`` is real: the fake opens a listener on 127.0.0.1:<L> standing for
the phone's port D and relays every connection to 127.0.0.1:H on the host, as adbd and the adb
server do together. ``phone.reverse_ports[D] == L``.
With ``phone.same_ports`` L is D itself, so a process "on the phone" can dial a phone port
before the rule exists (refused until then), as Termux's listener does.

Termux (:class:`FakeTermux`) answers the RUN_COMMAND intent; :meth:`FakeAdbServer.termux_serve`
is the user typing ``sh /data/local/tmp/testbed/termux-agent.sh serve`` in it (the pushed script
runs, as Termux), and :meth:`FakeAdbServer.run_app` runs another app. ``pm list packages -U
com.termux`` and ``cat /proc/net/tcp /proc/net/tcp6`` answer from this host's socket tables,
restricted to the phone's reverse ports, with each socket's uid found from its owner: Termux's
uid for what Termux runs, the shell's (2000) for adbd and what the adb shell started,
``OTHER_APP_UID`` for anything else (see :func:`phone_proc_net_tcp`).

Simplifications (documented, deliberate): one process plays both adb server and adbd; unplug,
offline and restart end the phone's local processes (a real phone's agent would only lose its
connection); ``host:kill`` is acknowledged but does not stop the fake.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import select
import shlex
import signal
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tests.fakes.ports import free_ports

log = logging.getLogger(__name__)

ADB_SERVER_VERSION = 41
DEVICE_FEATURES = "shell_v2,cmd,fixed_push_mkdir,apex,abb,abb_exec"
_STATES = ("device", "unauthorized", "offline")


@dataclass
class ShellResult:
    """What a shell command printed and its exit code, and how the answer travels:
    ``trickle_s`` sends stdout one byte at a time that many seconds apart (a command that keeps
    printing), ``cut`` ends the answer after stdout with no exit status (adbd gone mid-answer)."""

    stdout: bytes = b""
    stderr: bytes = b""
    exit_code: int = 0
    trickle_s: float = 0.0
    cut: bool = False


ExecHook = Callable[["FakePhone", str], "ShellResult | None"]
TERMUX_PREFIX = "/data/data/com.termux/files/usr"
TERMUX_TOOLS = ("sh", "mkdir", "cat", "kill", "rm", "dirname", "sleep", "nohup")
SHELL_UID = 2000  # adbd and the adb shell on a phone that is not rooted
TERMUX_UID = 10234
OTHER_APP_UID = 10999  # the owner of a socket that is neither Termux's nor the shell's


@dataclass
class FakeTermux:
    """Termux installed on a fake phone, answering the RUN_COMMAND intent as Termux does.

    ``shell_may_send``: whether the adb shell may send the intent (False: ``am`` answers
    "Error: Requires permission com.termux.permission.RUN_COMMAND", as Android does to a caller
    without the permission). ``allow_external_apps``: False makes Termux ignore the intent (it
    only logs; ``am`` still says "Starting service"). ``modules``: what Termux's python can
    import, among ``numpy`` and ``grpc`` (``python=False``: no python at all). The command runs
    as a real local process: ``$PREFIX/bin/sh`` is /bin/sh, ``python`` a wrapper around this
    interpreter that hides the modules Termux lacks, ``$HOME`` a directory of its own; phone
    paths under /data/local/tmp in its arguments map to the phone's ``root_dir``, and
    ``127.0.0.1:D`` to the local port standing for reverse rule ``tcp:D``."""

    work_dir: Path
    shell_may_send: bool = True
    allow_external_apps: bool = True
    python: bool = True
    modules: tuple[str, ...] = ("numpy", "grpc")
    env: dict[str, str] = field(default_factory=dict)
    intents: list[list[str]] = field(default_factory=list)  # arguments of every intent received
    uid: int = TERMUX_UID
    # every process Termux runs (intents, the listener): its sessions are Termux's uid
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def home(self) -> Path:
        return self.work_dir / "home"

    def prepare(self) -> tuple[Path, dict[str, str]]:
        """Make $PREFIX/bin and $HOME; return the bin directory and the environment."""
        import shutil as _shutil
        import sys as _sys
        bin_dir = self.work_dir / "usr" / "bin"
        hide = self.work_dir / "hide"
        bin_dir.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        for tool in TERMUX_TOOLS:
            found = _shutil.which(tool)
            link = bin_dir / tool
            if found and not link.exists():
                link.symlink_to(found)
        for module in ("numpy", "grpc"):
            blocker = hide / module / "__init__.py"
            if module not in self.modules:
                blocker.parent.mkdir(parents=True, exist_ok=True)
                blocker.write_text(f"raise ImportError(\"No module named '{module}'\")\n")
            elif blocker.exists():
                blocker.unlink()
        for name in ("python", "python3"):
            wrapper = bin_dir / name
            if self.python:
                # quoted: a checkout (so its venv's python) may sit in a path with spaces
                wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(hide))} exec "
                                   f"{shlex.quote(_sys.executable)} \"$@\"\n")
                wrapper.chmod(0o755)
            elif wrapper.exists():
                wrapper.unlink()
        env = {"PATH": str(bin_dir), "HOME": str(self.home),
               "PREFIX": str(self.work_dir / "usr"), **self.env}
        return bin_dir, env


@dataclass
class FakePhone:
    """A scripted phone: identity, state, recorded shell outputs, files, reverse rules."""

    serial: str
    state: str = "device"
    props: dict[str, str] = field(default_factory=dict)
    commands: dict[str, ShellResult | str] = field(default_factory=dict)
    product: str = "fakeproduct"
    model: str = "Fake_Phone"
    device: str = "fakedevice"
    exec_hook: ExecHook | None = None
    termux: FakeTermux | None = None
    root_dir: Path | None = None  # when set, pushed files are also written under it
    files: dict[str, tuple[int, bytes, int]] = field(default_factory=dict)  # mode, data, mtime
    pushes: list[tuple[str, bytes]] = field(default_factory=list)  # every sync SEND, in order
    push_modes: list[tuple[str, int]] = field(default_factory=list)  # (path, mode) of each
    reverses: dict[str, str] = field(default_factory=dict)  # phone side -> host side
    reverse_ports: dict[int, int] = field(default_factory=dict)  # phone tcp port -> local port
    processes: list[subprocess.Popen] = field(default_factory=list)
    apps: list[subprocess.Popen] = field(default_factory=list)  # other apps (OTHER_APP_UID)
    shell_log: list[str] = field(default_factory=list)
    transport_id: int = 0
    # what `host-serial:SERIAL:features` answers; without shell_v2 (adbd of Android 6 and
    # older) a host must use shell v1, which merges stderr into stdout and has no exit status
    features: str = DEVICE_FEATURES
    # True: the phone's loopback port D is the host's 127.0.0.1:D (a reverse rule tcp:D listens
    # there), so a process "on the phone" can dial a phone port before the rule exists, as the
    # Termux listener does. One such phone per host port, of course.
    same_ports: bool = False
    _listeners: dict[str, socket.socket] = field(default_factory=dict, repr=False)
    _relays: list[socket.socket] = field(default_factory=list, repr=False)
    _uplink_open: threading.Event = field(default_factory=threading.Event, repr=False)
    _download_trigger: _DownloadTrigger | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._uplink_open.set()

    @classmethod
    def from_getprop(cls, serial: str, getprop_text: str, **kwargs: object) -> FakePhone:
        """A phone whose properties come from a recorded ``getprop`` output."""
        props = {m.group(1): m.group(2) for m in
                 re.finditer(r"^\[([^\]]+)\]: \[([^\]]*)\]$", getprop_text, re.MULTILINE)}
        phone = cls(serial=serial, props=props, **kwargs)  # type: ignore[arg-type]
        phone.commands.setdefault("getprop", getprop_text)
        return phone

    def local_path(self, phone_path: str) -> Path | None:
        """Where a phone path lives on this machine (None without a root_dir)."""
        if self.root_dir is None:
            return None
        return self.root_dir / phone_path.lstrip("/")


class LocalProcessCommand:
    """An exec hook that runs a real local process for shell commands matching a pattern.

    ``argv_for(phone, match)`` builds the local argv; ``{reverse:D}`` in any argument becomes
    ``127.0.0.1:L`` where L is the local port standing for the phone's reverse port D. The shell
    answer is the process id (like ``cmd & echo $!``), or with ``wait=True`` the process's own
    output and exit code. ``kill [-SIG] PID`` and ``kill -0 PID``
    reach only processes this hook started.
    """

    def __init__(self, pattern: str, argv_for: Callable[[FakePhone, re.Match[str]], list[str]],
                 env: dict[str, str] | None = None, log_dir: Path | None = None,
                 wait: bool = False):
        self.wait = wait  # True: run to the end and answer its output and exit code
        self.pattern = re.compile(pattern)
        self.argv_for = argv_for
        self.env = env
        self.log_dir = log_dir

    def __call__(self, phone: FakePhone, command: str) -> ShellResult | None:
        match = self.pattern.search(command)
        if not match:
            return None
        argv = [self._resolve(phone, a) for a in self.argv_for(phone, match)]
        if self.wait:
            done = subprocess.run(argv, capture_output=True, timeout=300,
                                  env=dict(os.environ, **(self.env or {})))
            return ShellResult(done.stdout, done.stderr, done.returncode)
        out = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{phone.serial}-{len(phone.processes)}.log", "wb")
        env = dict(os.environ, **(self.env or {}))
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        if out is not subprocess.DEVNULL:
            out.close()
        phone.processes.append(proc)
        log.info("fake phone %s: started local process %d: %s", phone.serial, proc.pid, argv)
        return ShellResult(stdout=f"{proc.pid}\n".encode())

    @staticmethod
    def _resolve(phone: FakePhone, arg: str) -> str:
        def port(m: re.Match[str]) -> str:
            local = phone.reverse_ports.get(int(m.group(1)))
            if local is None:
                raise RuntimeError(f"phone {phone.serial}: no reverse rule for tcp:{m.group(1)}")
            return f"127.0.0.1:{local}"
        return re.sub(r"\{reverse:(\d+)\}", port, arg)


def free_port_base() -> int:
    """A phone port D with D, D+1 and D+2 free on this host, for a phone with ``same_ports``
    (the doctor's probe is D+1, the Termux listener's control port D+2), outside the ephemeral
    range (:func:`tests.fakes.ports.free_ports`)."""
    return free_ports(3)


def phone_pids(phone: FakePhone, everyone: bool = True) -> dict[int, str]:
    """Live local processes in the sessions of the phone's processes: pid -> command line.
    ``everyone``: also those of Termux's listener and of other apps, which survive an unplug."""
    # A session outlives its leader: Termux's start script exits once the agent runs.
    leaders = list(phone.processes)
    if everyone:
        leaders += phone.apps + (phone.termux.processes if phone.termux else [])
    sessions = {p.pid for p in leaders}
    for p in leaders:
        p.poll()  # reap an ended leader, so that it is not listed as a zombie
    out: dict[int, str] = {}
    if not sessions:
        return out
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] == "Z" or int(fields[3]) not in sessions:
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        out[int(entry.name)] = cmd.strip()
    return out


def _terminate(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        pass


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _socket_owners(pids: list[int]) -> dict[int, int]:
    """Socket inode -> pid, for the sockets these processes hold open."""
    out: dict[int, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                out[int(target[8:-1])] = pid
    return out


def phone_proc_net_tcp(phone: FakePhone) -> str:
    """The phone's ``cat /proc/net/tcp /proc/net/tcp6``, made from this host's tables: the
    sockets on the fake's listeners standing for the phone's reverse ports (adbd's side: the
    shell uid) and the sockets connected to them (the phone's apps: Termux's uid for the
    processes Termux runs, OTHER_APP_UID for any other, the shell uid for what the adb shell
    started), with the local ports written as the phone's."""
    to_phone = {lst.getsockname()[1]: int(remote[4:]) for remote, lst in phone._listeners.items()
                if remote.startswith("tcp:")}
    termux = set(phone_pids_of(phone.termux.processes if phone.termux else []))
    shell = set(phone_pids_of(phone.processes)) - termux
    owners = _socket_owners(sorted(termux | shell))
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        lines = Path(table).read_text().splitlines()
        out.append(lines[0])
        for line in lines[1:]:
            f = line.split()
            lip, lport_hex = f[1].split(":")
            rip, rport_hex = f[2].split(":")
            lport, rport, inode = int(lport_hex, 16), int(rport_hex, 16), int(f[9])
            if lport in to_phone:
                uid, lport = SHELL_UID, to_phone[lport]
            elif rport in to_phone:
                owner = owners.get(inode)
                uid = (int(f[7]) if inode == 0 else
                       phone.termux.uid if phone.termux and owner in termux else
                       SHELL_UID if owner in shell else OTHER_APP_UID)
                rport = to_phone[rport]
            else:
                continue
            f[1], f[2], f[7] = f"{lip}:{lport:04X}", f"{rip}:{rport:04X}", str(uid)
            out.append(" ".join(f))
    return "\n".join(out) + "\n"


def phone_pids_of(leaders: list[subprocess.Popen]) -> list[int]:
    """Live processes in the sessions these processes lead."""
    sessions = {p.pid for p in leaders}
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[3]) in sessions:
                out.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _block(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return f"{len(data):04x}".encode() + data


class _Closed(Exception):
    pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise _Closed()
        buf += chunk
    return buf


class FakeAdbServer:
    """The fake server: ``start()``/``stop()`` or a context manager; ``port`` once started."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self.port = port
        self.phones: dict[str, FakePhone] = {}
        self.requests: list[str] = []  # every service name received, in order
        self.track_blocks_sent = 0  # device lists written to track-devices clients
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._generation = 0  # bumps on every device-list change
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._running = False
        self._next_transport = 1
        self._gone: list[FakePhone] = []  # unplugged phones, whose Termux may still run

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> FakeAdbServer:
        """Listen and serve in background threads."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(64)
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._running = True
        self._spawn(self._accept_loop, sock)
        return self

    def stop(self) -> None:
        """Close every socket, end the phones' processes (Termux's and apps' too), join threads."""
        self._shutdown_sockets()
        with self._lock:
            phones = list(self.phones.values()) + self._gone
        for phone in phones:
            self._reset_transport(phone, kill=True)
            leaders = phone.apps + (phone.termux.processes if phone.termux else [])
            for pid in phone_pids(phone):
                if pid not in {p.pid for p in leaders}:
                    _terminate(pid)
            for proc in leaders:
                _end(proc)
        for t in self._threads:
            t.join(timeout=2)

    def __enter__(self) -> FakeAdbServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def restart(self, down_s: float = 0.3) -> None:
        """The adb server dies (every connection drops, reverse rules go) and comes back."""
        self._shutdown_sockets()
        with self._lock:
            for phone in self.phones.values():
                self._reset_transport(phone, kill=True)
        time.sleep(down_s)
        self.start()

    def _shutdown_sockets(self) -> None:
        with self._lock:
            self._running = False
            listener, self._listener = self._listener, None
            conns = list(self._conns)
            self._conns.clear()
            self._changed.notify_all()
        if listener is not None:
            _close_listener(listener)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]

    # -- scripting phones ------------------------------------------------------------------------

    def plug(self, phone: FakePhone) -> FakePhone:
        """A phone appears (in ``phone.state``)."""
        with self._lock:
            phone.transport_id = self._next_transport
            self._next_transport += 1
            self.phones[phone.serial] = phone
            self._bump()
        return phone

    def set_state(self, serial: str, state: str) -> None:
        """Change a phone's state: ``unauthorized`` -> ``device``, or ``offline``."""
        if state not in _STATES:
            raise ValueError(f"state must be one of {_STATES}")
        with self._lock:
            phone = self.phones[serial]
            phone.state = state
            if state != "device":
                self._reset_transport(phone, kill=True)
            self._bump()

    def unplug(self, serial: str) -> None:
        """The phone's cable is pulled."""
        with self._lock:
            phone = self.phones.pop(serial)
            self._gone.append(phone)
            self._bump()
        self._reset_transport(phone, kill=True)

    def drop_reverse(self, serial: str) -> None:
        """The phone forgets its reverse rules; open connections stay (like ``--remove``)."""
        with self._lock:
            phone = self.phones[serial]
            for remote in list(phone.reverses):
                self._remove_reverse(phone, remote)

    def hold_uplink(self, serial: str) -> None:
        """Bytes from the phone stop moving towards the host (a stalled USB link or a hung
        phone) on every reverse connection, until :meth:`release_uplink` or the transport ends.
        What the host sends still arrives, so the phone keeps taking work it cannot return."""
        with self._lock:
            self.phones[serial]._uplink_open.clear()

    def unplug_on_download(self, serial: str, min_bytes: int = 1) -> threading.Event:
        """Script "the cable is pulled while the phone holds work". From now on count the bytes
        the host sends the phone; the chunk that brings the count to ``min_bytes`` is delivered
        with the phone's uplink already held (nothing the phone answers gets out), and right
        after it is delivered the cable is pulled. Returns an event set once unplugged."""
        with self._lock:
            trigger = _DownloadTrigger(self, serial, min_bytes)
            self.phones[serial]._download_trigger = trigger
        return trigger.unplugged

    def drop_connections(self, serial: str) -> None:
        """Every connection through the phone's reverse rules breaks (a USB hiccup); the rules
        and the phone's processes stay, so its apps can connect again."""
        with self._lock:
            phone = self.phones[serial]
            relays, phone._relays = phone._relays, []
        for s in relays:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def termux_serve(self, serial: str, control: str = "127.0.0.1:7702",
                     wait_push_s: float = 60.0) -> subprocess.Popen:
        """The user types ``sh /data/local/tmp/testbed/termux-agent.sh serve [CONTROL]`` in
        Termux: run the pushed script (waiting up to wait_push_s for the bridge or the doctor to
        push it) as Termux, in Termux's environment. Needs ``same_ports`` (the listener dials
        the phone port before any rule exists). Unplugging does not end it; ``stop()`` does."""
        with self._lock:
            phone = self.phones[serial]
        assert phone.termux is not None and phone.same_ports and phone.root_dir is not None
        script = phone.root_dir / "data/local/tmp/testbed/termux-agent.sh"
        serve_py = script.with_name("termux_serve.py")
        deadline = time.monotonic() + wait_push_s
        while not (script.exists() and serve_py.exists()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"phone {serial}: nothing pushed {script.name} and "
                                   f"{serve_py.name} within {wait_push_s} s")
            time.sleep(0.1)
        _, env = phone.termux.prepare()
        log_path = phone.termux.work_dir / f"serve-{len(phone.termux.processes)}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(["/bin/sh", str(script), "serve", control], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(os.environ, **env), cwd=str(phone.termux.home),
                                    start_new_session=True)
        phone.termux.processes.append(proc)
        return proc

    def run_app(self, serial: str, argv: list[str]) -> subprocess.Popen:
        """Another app on the phone runs argv (its sockets belong to OTHER_APP_UID)."""
        with self._lock:
            phone = self.phones[serial]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
        phone.apps.append(proc)
        return proc

    def release_uplink(self, serial: str) -> None:
        """End :meth:`hold_uplink`: the held bytes go on, in order."""
        with self._lock:
            self.phones[serial]._uplink_open.set()

    def _bump(self) -> None:
        self._generation += 1
        self._changed.notify_all()

    def _reset_transport(self, phone: FakePhone, kill: bool) -> None:
        for listener in phone._listeners.values():
            _close_listener(listener)
        phone._listeners.clear()
        phone.reverses.clear()
        phone.reverse_ports.clear()
        for s in phone._relays:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        phone._relays.clear()
        phone._uplink_open.set()  # a held pump wakes, finds its sockets closed and ends
        if kill:
            for pid in phone_pids(phone, everyone=False):  # what its commands started
                if pid not in {p.pid for p in phone.processes}:
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except OSError:
                        pass
            for proc in phone.processes:
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()

    def device_list(self, long: bool = False) -> str:
        """The text ``host:devices`` (or ``-l``) answers."""
        lines = []
        with self._lock:
            for p in self.phones.values():
                if long:
                    extra = (f" usb:1-{p.transport_id} product:{p.product} model:{p.model} "
                             f"device:{p.device}" if p.state == "device" else
                             f" usb:1-{p.transport_id}")
                    lines.append(f"{p.serial:<22} {p.state}{extra} transport_id:{p.transport_id}")
                else:
                    lines.append(f"{p.serial}\t{p.state}")
        return "".join(line + "\n" for line in lines)

    # -- connections ----------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                if not self._running or listener is not self._listener:
                    conn.close()
                    return
                self._conns.add(conn)
            self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                length = int(_recv_exact(conn, 4), 16)
                service = _recv_exact(conn, length).decode()
                with self._lock:
                    self.requests.append(service)
                if not self._host_service(conn, service):
                    return
        except (_Closed, OSError, ValueError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    @staticmethod
    def _okay(conn: socket.socket, payload: bytes = b"") -> None:
        conn.sendall(b"OKAY" + payload)

    @staticmethod
    def _fail(conn: socket.socket, message: str) -> None:
        conn.sendall(b"FAIL" + _block(message))

    def _find(self, conn: socket.socket, selector: str) -> FakePhone | None:
        """Resolve a transport selector; answer FAIL (and return None) like the real server."""
        with self._lock:
            if selector == "any":
                candidates = list(self.phones.values())
                if not candidates:
                    self._fail(conn, "no devices/emulators found")
                    return None
                if len(candidates) > 1:
                    self._fail(conn, "more than one device/emulator")
                    return None
                phone = candidates[0]
            elif selector.startswith("id:"):
                phone = next((p for p in self.phones.values()
                              if str(p.transport_id) == selector[3:]), None)
            else:
                phone = self.phones.get(selector)
        if phone is None:
            self._fail(conn, f"device '{selector}' not found")
            return None
        if phone.state == "unauthorized":
            self._fail(conn, "device unauthorized.\nThis adb server's $ADB_VENDOR_KEYS is not "
                             "set\nTry 'adb kill-server' if that seems wrong.\nOtherwise check "
                             "for a confirmation dialog on your device.")
            return None
        if phone.state == "offline":
            self._fail(conn, "device offline")
            return None
        return phone

    def _host_service(self, conn: socket.socket, service: str) -> bool:
        """Answer one host request; False when the connection is done."""
        prefix, selector, command = "host", "any", service
        m = re.match(r"^host-serial:(.+):([a-z-]+(?::.*)?)$", service)
        if service.startswith("host-serial:") and m:
            prefix, selector, command = "host-serial", m.group(1), m.group(2)
        elif service.startswith("host-transport-id:"):
            tid, _, command = service[len("host-transport-id:"):].partition(":")
            prefix, selector = "host-serial", f"id:{tid}"
        elif service.startswith(("host-usb:", "host-local:", "host:")):
            command = service.split(":", 1)[1]
        else:
            self._fail(conn, f"unknown host service {service!r}")
            return False
        if prefix == "host":
            if command == "version":
                self._okay(conn, _block(f"{ADB_SERVER_VERSION:04x}"))
                return False
            if command in ("devices", "devices-l"):
                self._okay(conn, _block(self.device_list(command == "devices-l")))
                return False
            if command == "track-devices":
                self._track(conn)
                return False
            if command == "host-features":
                self._okay(conn, _block("shell_v2,cmd"))
                return False
            if command == "kill":
                self._okay(conn)
                return False
            if command == "list-forward":
                self._okay(conn, _block(""))
                return False
            transport = self._transport_selector(command)
            if transport is not None:
                kind, sel = transport
                phone = self._find(conn, sel)
                if phone is None:
                    return False
                if kind == "tport":
                    self._okay(conn, struct.pack("<Q", phone.transport_id))
                else:
                    self._okay(conn)
                return self._device_service(conn, phone)
        # host-serial:SERIAL:cmd, or host:cmd that needs one device.
        phone = self._find(conn, selector)
        if phone is None:
            return False
        if command == "features":
            self._okay(conn, _block(phone.features))
        elif command == "get-state":
            self._okay(conn, _block(phone.state))
        elif command == "get-serialno":
            self._okay(conn, _block(phone.serial))
        elif command == "get-devpath":
            self._okay(conn, _block(f"usb:1-{phone.transport_id}"))
        elif command == "list-forward":
            self._okay(conn, _block(""))
        else:
            self._fail(conn, f"unknown host service {service!r}")
        return False

    @staticmethod
    def _transport_selector(command: str) -> tuple[str, str] | None:
        for prefix, kind, sel in (("transport:", "transport", None),
                                  ("tport:serial:", "tport", None),
                                  ("transport-id:", "transport", "id:"),
                                  ("tport:id:", "tport", "id:")):
            if command.startswith(prefix):
                return kind, (sel or "") + command[len(prefix):]
        if command in ("transport-any", "transport-usb", "transport-local"):
            return "transport", "any"
        if command in ("tport:any", "tport:usb", "tport:local"):
            return "tport", "any"
        return None

    def _track(self, conn: socket.socket) -> None:
        self._okay(conn)
        last_sent = None
        while True:
            with self._lock:
                while self._running and self._generation == last_sent:
                    self._changed.wait(timeout=0.2)
                    readable, _, _ = select.select([conn], [], [], 0)
                    if readable and not conn.recv(1, socket.MSG_PEEK):
                        return  # the client went away
                if not self._running:
                    return
                last_sent = self._generation
                text = self.device_list()
            conn.sendall(_block(text))
            with self._lock:
                self.track_blocks_sent += 1

    # -- device services ------------------------------------------------------------------------

    def _device_service(self, conn: socket.socket, phone: FakePhone) -> bool:
        length = int(_recv_exact(conn, 4), 16)
        service = _recv_exact(conn, length).decode()
        with self._lock:
            self.requests.append(service)
        if service.startswith("shell"):
            head, sep, cmd = service.partition(":")
            options = head.split(",")[1:]
            if not sep or not all(o in ("v2", "raw", "pty") or o.startswith("TERM=")
                                  for o in options):
                self._fail(conn, f"unsupported shell service {service!r}")
                return False
            if not cmd:
                self._fail(conn, "the fake adb server has no interactive shell")
                return False
            self._shell(conn, phone, cmd, v2="v2" in options)
        elif service == "sync:":
            self._okay(conn)
            self._sync(conn, phone)
        elif service.startswith("reverse:"):
            self._reverse(conn, phone, service[len("reverse:"):])
        else:
            self._fail(conn, f"unknown device service {service!r}")
        return False

    def run_shell(self, phone: FakePhone, command: str) -> ShellResult:
        """What the phone's shell answers for a command line."""
        phone.shell_log.append(command)
        if phone.exec_hook is not None:
            result = phone.exec_hook(phone, command)
            if result is not None:
                return result
        recorded = phone.commands.get(command)
        if recorded is not None:
            return ShellResult(stdout=recorded.encode()) if isinstance(recorded, str) else recorded
        return self._builtin(phone, command)

    def _builtin(self, phone: FakePhone, command: str) -> ShellResult:
        try:
            argv = shlex.split(command)
        except ValueError:
            return ShellResult(stderr=b"/system/bin/sh: syntax error\n", exit_code=2)
        if not argv:
            return ShellResult()
        name = argv[0]
        if name == "getprop" and len(argv) == 2:
            return ShellResult(stdout=(phone.props.get(argv[1], "") + "\n").encode())
        if name == "echo":
            return ShellResult(stdout=(" ".join(argv[1:]) + "\n").encode())
        if name == "true":
            return ShellResult()
        if name == "false":
            return ShellResult(exit_code=1)
        if name == "kill" and len(argv) >= 2:
            return self._kill(phone, argv[1:])
        if name in ("mkdir", "chmod"):
            return ShellResult()
        if name == "rm":
            for path in (a for a in argv[1:] if not a.startswith("-")):
                phone.files.pop(path, None)
                local = phone.local_path(path)
                if local is not None and local.is_file():
                    local.unlink()
            return ShellResult()
        if name == "pm" and argv[1:] == ["list", "packages", "-U", "com.termux"]:
            if phone.termux is None:
                return ShellResult()
            return ShellResult(stdout=f"package:com.termux uid:{phone.termux.uid}\n".encode())
        if name == "cat" and argv[1:] == ["/proc/net/tcp", "/proc/net/tcp6"]:
            return ShellResult(stdout=phone_proc_net_tcp(phone).encode())
        if name == "pm" and argv[1:3] == ["path", "com.termux"]:
            if phone.termux is None:
                return ShellResult(exit_code=1)
            return ShellResult(stdout=b"package:/data/app/com.termux-1/base.apk\n")
        if name == "pgrep" and len(argv) == 3 and argv[1] == "-f":
            pids = [pid for pid, cmd in phone_pids(phone).items() if re.search(argv[2], cmd)]
            return ShellResult(stdout="".join(f"{p}\n" for p in pids).encode(),
                               exit_code=0 if pids else 1)
        if name == "test" and len(argv) == 3 and argv[1] == "-d" and argv[2].startswith("/proc/"):
            pid_text = argv[2][len("/proc/"):]
            alive = pid_text.isdigit() and int(pid_text) in phone_pids(phone)
            return ShellResult(exit_code=0 if alive else 1)
        if name == "sha256sum" and len(argv) == 2:
            if argv[1] not in phone.files:
                return ShellResult(stderr=f"sha256sum: {argv[1]}: No such file or "
                                          f"directory\n".encode(), exit_code=1)
            digest = hashlib.sha256(phone.files[argv[1]][1]).hexdigest()
            return ShellResult(stdout=f"{digest}  {argv[1]}\n".encode())
        if name == "am" and len(argv) >= 2 and argv[1] in ("startservice",
                                                          "start-foreground-service"):
            return self._am_startservice(phone, argv)
        return ShellResult(stderr=f"/system/bin/sh: {name}: inaccessible or not found\n".encode(),
                           exit_code=127)

    def _am_startservice(self, phone: FakePhone, argv: list[str]) -> ShellResult:
        """``am startservice ...``: Android's answer, then Termux's RunCommandService."""
        extras: dict[str, str] = {}
        component = ""
        i = 2
        while i < len(argv):
            if argv[i] in ("--es", "--esa", "--ez") and i + 2 < len(argv):
                extras[argv[i + 1]] = argv[i + 2]
                i += 3
            elif argv[i] in ("-n", "-a", "--user") and i + 1 < len(argv):
                if argv[i] == "-n":
                    component = argv[i + 1]
                i += 2
            else:
                i += 1
        if phone.termux is None or component != "com.termux/.app.RunCommandService":
            return ShellResult(stderr=b"Error: Not found; no service started.\n", exit_code=255)
        if not phone.termux.shell_may_send:
            return ShellResult(stderr=b"Error: Requires permission "
                                      b"com.termux.permission.RUN_COMMAND\n", exit_code=255)
        started = (b"Starting service: Intent { act=com.termux.RUN_COMMAND "
                   b"cmp=com.termux/.app.RunCommandService (has extras) }\n")
        arguments = [a.replace("\\,", ",") for a in
                     re.split(r"(?<!\\),", extras.get("com.termux.RUN_COMMAND_ARGUMENTS", ""))]
        phone.termux.intents.append(arguments)
        if not phone.termux.allow_external_apps:  # Termux only logs its refusal
            log.info("fake phone %s: Termux ignores the intent (allow-external-apps)", phone.serial)
            return ShellResult(stdout=started)
        _, env = phone.termux.prepare()
        local_args = [self._phone_arg(phone, a) for a in arguments]
        program = extras.get("com.termux.RUN_COMMAND_PATH", "")
        if program != f"{TERMUX_PREFIX}/bin/sh":
            raise RuntimeError(f"the fake Termux runs only $PREFIX/bin/sh, not {program!r}")
        log_path = phone.termux.work_dir / f"intent-{len(phone.termux.intents)}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(["/bin/sh", *local_args], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=dict(os.environ, **env),
                                    cwd=str(phone.termux.home), start_new_session=True)
        phone.processes.append(proc)
        phone.termux.processes.append(proc)
        return ShellResult(stdout=started)

    @staticmethod
    def _phone_arg(phone: FakePhone, arg: str) -> str:
        if arg.startswith("/data/local/tmp/"):
            local = phone.local_path(arg)
            return str(local) if local is not None else arg
        m = re.fullmatch(r"127\.0\.0\.1:(\d+)", arg)
        if m and int(m.group(1)) in phone.reverse_ports:
            return f"127.0.0.1:{phone.reverse_ports[int(m.group(1))]}"
        return arg

    @staticmethod
    def _kill(phone: FakePhone, args: list[str]) -> ShellResult:
        sig = signal.SIGTERM
        if args[0].startswith("-"):
            spec = args.pop(0)[1:]
            sig = signal.Signals(int(spec)) if spec.isdigit() and spec != "0" else (
                0 if spec == "0" else getattr(signal, "SIG" + spec.upper().removeprefix("SIG")))
        code = 0
        for pid_text in args:
            proc = next((p for p in phone.processes if str(p.pid) == pid_text), None)
            if proc is None or proc.poll() is not None:
                code = 1
                continue
            if sig != 0:
                proc.send_signal(sig)
        err = b"" if code == 0 else b"kill: No such process\n"
        return ShellResult(stderr=err, exit_code=code)

    def _shell(self, conn: socket.socket, phone: FakePhone, cmd: str, v2: bool) -> None:
        marker = "; echo X4EXIT:$?"  # adbutils' shell-v1 exit-code trick
        with_marker = cmd.endswith(marker)
        result = self.run_shell(phone, cmd[: -len(marker)] if with_marker else cmd)
        self._okay(conn)

        def send(kind: int, data: bytes) -> None:
            if not data:
                return
            pieces = [data[i:i + 1] for i in range(len(data))] if result.trickle_s else [data]
            for piece in pieces:
                conn.sendall(struct.pack("<BI", kind, len(piece)) + piece if v2 else piece)
                time.sleep(result.trickle_s)

        try:
            send(1, result.stdout)
            if not result.cut:
                if v2:
                    send(2, result.stderr)
                    conn.sendall(struct.pack("<BI", 3, 1) + bytes([result.exit_code & 0xFF]))
                else:
                    send(1, result.stderr + (f"X4EXIT:{result.exit_code}\n".encode()
                                             if with_marker else b""))
        except OSError:  # the host gave up on a slow answer
            return
        conn.shutdown(socket.SHUT_WR)
        # Let the client read to the end before the socket closes.
        conn.settimeout(5)
        try:
            while conn.recv(4096):
                pass
        except OSError:
            pass

    # -- sync --------------------------------------------------------------------------------------

    def _sync(self, conn: socket.socket, phone: FakePhone) -> None:
        while True:
            head = _recv_exact(conn, 8)
            cmd, length = head[:4], struct.unpack("<I", head[4:])[0]
            if cmd == b"QUIT":
                return
            arg = _recv_exact(conn, length).decode()
            if cmd == b"SEND":
                path, _, mode_text = arg.rpartition(",")
                self._recv_file(conn, phone, path, int(mode_text or "420"))
            elif cmd == b"STAT":
                mode, data, mtime = phone.files.get(arg, (0, b"", 0))
                conn.sendall(b"STAT" + struct.pack("<III", mode, len(data), mtime))
            elif cmd == b"RECV":
                if arg not in phone.files:
                    conn.sendall(b"FAIL" + struct.pack("<I", 25) + b"No such file or directory")
                    continue
                data = phone.files[arg][1]
                for i in range(0, len(data), 65536):
                    chunk = data[i:i + 65536]
                    conn.sendall(b"DATA" + struct.pack("<I", len(chunk)) + chunk)
                conn.sendall(b"DONE" + struct.pack("<I", 0))
            elif cmd == b"LIST":
                conn.sendall(b"DONE" + struct.pack("<IIII", 0, 0, 0, 0))
            else:
                msg = f"unknown sync command {cmd!r}".encode()
                conn.sendall(b"FAIL" + struct.pack("<I", len(msg)) + msg)
                return

    def _recv_file(self, conn: socket.socket, phone: FakePhone, path: str, mode: int) -> None:
        chunks: list[bytes] = []
        while True:
            head = _recv_exact(conn, 8)
            cmd, value = head[:4], struct.unpack("<I", head[4:])[0]
            if cmd == b"DATA":
                if value > 65536:
                    msg = b"DATA chunk larger than 64 KiB"
                    conn.sendall(b"FAIL" + struct.pack("<I", len(msg)) + msg)
                    raise _Closed()
                chunks.append(_recv_exact(conn, value))
            elif cmd == b"DONE":
                data = b"".join(chunks)
                phone.files[path] = (0o100000 | (mode & 0o7777), data, value)
                phone.pushes.append((path, data))
                phone.push_modes.append((path, mode & 0o7777))
                local = phone.local_path(path)
                if local is not None:
                    local.parent.mkdir(parents=True, exist_ok=True)
                    local.write_bytes(data)
                    local.chmod(mode & 0o777)
                conn.sendall(b"OKAY" + struct.pack("<I", 0))
                return
            else:
                msg = f"expected DATA or DONE, got {cmd!r}".encode()
                conn.sendall(b"FAIL" + struct.pack("<I", len(msg)) + msg)
                raise _Closed()

    # -- reverse -----------------------------------------------------------------------------------

    def _reverse(self, conn: socket.socket, phone: FakePhone, request: str) -> None:
        if request == "list-forward":
            with self._lock:
                text = "".join(f"{phone.serial} {r} {h}\n" for r, h in phone.reverses.items())
            self._okay(conn, _block(text))
            return
        self._okay(conn)  # the stream to adbd is open; the second reply is the result
        if request == "killforward-all":
            with self._lock:
                for remote in list(phone.reverses):
                    self._remove_reverse(phone, remote)
            self._okay(conn)
        elif request.startswith("killforward:"):
            remote = request[len("killforward:"):]
            with self._lock:
                if remote not in phone.reverses:
                    self._fail(conn, f"listener '{remote}' not found")
                    return
                self._remove_reverse(phone, remote)
            self._okay(conn)
        elif request.startswith("forward:"):
            spec = request[len("forward:"):]
            norebind = spec.startswith("norebind:")
            if norebind:
                spec = spec[len("norebind:"):]
            remote, sep, local = spec.partition(";")
            if not sep or not remote or not local:
                self._fail(conn, f"bad forward: {spec!r}")
                return
            with self._lock:
                if norebind and remote in phone.reverses:
                    self._fail(conn, f"cannot rebind existing socket: {remote}")
                    return
                error = self._add_reverse(phone, remote, local)
            if error:
                self._fail(conn, error)
            else:
                self._okay(conn)
        else:
            self._fail(conn, f"unknown reverse request {request!r}")

    def _add_reverse(self, phone: FakePhone, remote: str, local: str) -> str | None:
        if not re.fullmatch(r"(tcp:\d+|local[a-z]*:.+)", remote):
            return f"cannot bind listener: bad address {remote!r}"
        if not re.fullmatch(r"(tcp:\d+|local[a-z]*:.+)", local):
            return f"bad local address {local!r}"
        if remote in phone.reverses:
            self._remove_reverse(phone, remote)
        phone.reverses[remote] = local
        if remote.startswith("tcp:") and local.startswith("tcp:"):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind(("127.0.0.1", int(remote[4:]) if phone.same_ports else 0))
            except OSError as exc:  # adbd's answer when an app already holds the port
                listener.close()
                phone.reverses.pop(remote, None)
                return f"cannot bind listener: {exc.strerror}"
            listener.listen(16)
            phone._listeners[remote] = listener
            phone.reverse_ports[int(remote[4:])] = listener.getsockname()[1]
            self._spawn(self._reverse_accept, phone, listener, int(local[4:]))
        return None

    def _remove_reverse(self, phone: FakePhone, remote: str) -> None:
        phone.reverses.pop(remote, None)
        listener = phone._listeners.pop(remote, None)
        if listener is not None:
            _close_listener(listener)
        if remote.startswith("tcp:"):
            phone.reverse_ports.pop(int(remote[4:]), None)

    def _reverse_accept(self, phone: FakePhone, listener: socket.socket, host_port: int) -> None:
        while True:
            try:
                inner, _ = listener.accept()
            except OSError:
                return
            try:
                outer = socket.create_connection(("127.0.0.1", host_port), timeout=5)
                outer.settimeout(None)
            except OSError:
                inner.close()  # nothing listens on the host side: the phone's connect fails
                continue
            with self._lock:
                phone._relays += [inner, outer]
            self._spawn(_pump, inner, outer, phone._uplink_open)
            self._spawn(_pump, outer, inner, None, phone)


def _close_listener(listener: socket.socket) -> None:
    """Close a listening socket so that a thread blocked in accept() wakes up (Linux)."""
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    listener.close()


class _DownloadTrigger:
    """See :meth:`FakeAdbServer.unplug_on_download`."""

    def __init__(self, server: FakeAdbServer, serial: str, min_bytes: int):
        self.server, self.serial, self.min_bytes = server, serial, min_bytes
        self.seen_bytes = 0
        self.fired = False
        self.unplugged = threading.Event()
        self._lock = threading.Lock()

    def before(self, phone: FakePhone, nbytes: int) -> bool:
        """Count a chunk about to be delivered; True (uplink now held) when it is the one."""
        with self._lock:
            if self.fired:
                return False
            self.seen_bytes += nbytes
            if self.seen_bytes < self.min_bytes:
                return False
            self.fired = True
        phone._uplink_open.clear()
        return True

    def undo(self, phone: FakePhone, nbytes: int) -> None:
        """The chunk could not be delivered: forget it and open the uplink again."""
        with self._lock:
            self.fired = False
            self.seen_bytes -= nbytes
        phone._uplink_open.set()

    def after(self, nbytes: int) -> None:
        """The chunk was delivered: pull the cable (in a thread: the pump must not wait)."""
        def pull() -> None:
            log.info("fake phone %s: %d bytes delivered with the uplink held; pulling the cable",
                     self.serial, nbytes)
            self.server.unplug(self.serial)
            self.unplugged.set()
        threading.Thread(target=pull, daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket, gate: threading.Event | None = None,
          downloads_of: FakePhone | None = None) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            if gate is not None:
                gate.wait()  # held (FakeAdbServer.hold_uplink): wait before passing it on
            trigger = downloads_of._download_trigger if downloads_of is not None else None
            fire = trigger is not None and trigger.before(downloads_of, len(data))  # type: ignore
            try:
                dst.sendall(data)
            except OSError:
                if fire:  # not delivered (the connection was going away): not the one
                    trigger.undo(downloads_of, len(data))  # type: ignore[union-attr]
                raise
            if fire:
                trigger.after(len(data))  # type: ignore[union-attr]
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
