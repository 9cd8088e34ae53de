"""Find and remove what one Mininet run left behind, by the run's own name prefix. Never more.

A run's prefix is ``tb`` + three characters from ``[a-z0-9]`` (``tbk3x``); every host, switch and
interface name of that run starts with it (naming plan: :mod:`testbed.emulator.network.mininet`).
What belongs to run ``P``:

* processes: the Mininet node shells (``bash ... mininet:P...`` on their command line), every
  process the backend started (environment variable ``TESTBED_NET_PREFIX=P``), and any other
  process living in the network namespace of one of those node shells (not the root namespace);
* interfaces and bridges of the root namespace whose name starts with ``P`` (a host's own
  interfaces live in its namespace and vanish with it);
* the run record ``<state dir>/P.json`` (owner pid and start time, used by ``testbed clean``
  without a prefix to tell a crashed run from a live one).

Removal order: processes (SIGTERM, then SIGKILL after a grace period), so that the namespaces die
and take their veth pairs with them; then the root-namespace interfaces that remain; then the
record. Nothing is matched by a bare program name, and ``mn -c`` is never used.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

PREFIX_RE = re.compile(r"^tb[a-z0-9]{3}$")
ENV_MARKER = "TESTBED_NET_PREFIX"
SHELL_TAG = "mininet:"


def state_dir() -> Path:
    """Where run records live: /run/testbed-net when writable, else the temp directory."""
    for base in (Path("/run"), Path(tempfile.gettempdir())):
        d = base / "testbed-net"
        try:
            d.mkdir(mode=0o755, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            return d
    raise RuntimeError("no writable directory for network run records (/run or $TMPDIR)")


PREFIX_FORM = "'tb' and three characters from a-z0-9, like 'tbk3x'"  # PREFIX_RE, said


def check_prefix(prefix: str) -> str:
    """Return prefix if it is a run prefix like 'tbk3x'; else raise ValueError."""
    if not PREFIX_RE.match(prefix):
        raise ValueError(f"{prefix!r} is not a run prefix (expected {PREFIX_FORM})")
    return prefix


@dataclass
class Leftovers:
    """What of one run still exists: process ids and root-namespace interface names."""

    prefix: str
    pids: list[int] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.pids and not self.links


def _netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _protected_pids() -> set[int]:
    """This process and its ancestors: never ours to kill."""
    out = {os.getpid()}
    try:
        out |= {p.pid for p in psutil.Process().parents()}
    except psutil.Error:
        pass
    return out


def find_processes(prefix: str) -> list[int]:
    """Pids that belong to run `prefix` (see the module docstring)."""
    check_prefix(prefix)
    tag = SHELL_TAG + prefix
    marker = f"{ENV_MARKER}={prefix}".encode()
    # The namespace this process runs in is the root one (cleanup runs there; /proc/1 may not be
    # readable in a container). Without it, skip the namespace sweep rather than risk the root.
    root_ns = _netns_inode(os.getpid())
    protected = _protected_pids()
    pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    ours: set[int] = set()
    node_ns: set[int] = set()
    for pid in pids:
        if pid in protected:
            continue
        if any(a.startswith(tag) for a in _cmdline(pid)):
            ours.add(pid)
            ns = _netns_inode(pid)
            if ns is not None and root_ns is not None and ns != root_ns:
                node_ns.add(ns)
        elif _environ_has(pid, marker):
            ours.add(pid)
    if node_ns:
        for pid in pids:
            if pid not in protected and pid not in ours and _netns_inode(pid) in node_ns:
                ours.add(pid)
    return sorted(ours)


def find_links(prefix: str) -> list[str]:
    """Root-namespace interface names (bridges included) that start with `prefix`."""
    check_prefix(prefix)
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                         check=True).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@", 1)[0]
            if name.startswith(prefix):
                names.append(name)
    return names


def find_leftovers(prefix: str) -> Leftovers:
    """Everything of run `prefix` that still exists."""
    return Leftovers(prefix, find_processes(prefix), find_links(prefix))


def kill_pids(pids: list[int], grace_s: float = 2.0) -> None:
    """SIGTERM the pids, wait up to grace_s, then SIGKILL the survivors and reap what is ours."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def delete_links(names: list[str]) -> None:
    """Delete root-namespace interfaces by name (a veth's peer goes with it)."""
    if not names:
        return
    batch = "".join(f"link del dev {n}\n" for n in names)
    # -force: go on after an error (a veth whose peer was deleted first is already gone)
    subprocess.run(["ip", "-force", "-batch", "-"], input=batch, capture_output=True, text=True)


def remove_leftovers(prefix: str, grace_s: float = 2.0) -> Leftovers:
    """Remove every process and interface of run `prefix`; return what was found first."""
    found = find_leftovers(prefix)
    if found.pids:
        log.debug("%s: stopping %d leftover process(es)", prefix, len(found.pids))
        kill_pids(found.pids, grace_s)
    links = find_links(prefix)  # namespaces that died took their veth pairs with them
    if links:
        log.debug("%s: deleting %d leftover interface(s)", prefix, len(links))
        delete_links(links)
    forget_run(prefix)
    return found


# ----------------------------------------------------------------------------------------------
# Run records: who owns a prefix.

def record_path(prefix: str) -> Path:
    return state_dir() / f"{check_prefix(prefix)}.json"


def claim_run(prefix: str, info: dict[str, Any]) -> bool:
    """Create the record of run `prefix` owned by this process; False if the prefix is taken."""
    me = psutil.Process()
    data = {"prefix": prefix, "owner_pid": me.pid, "owner_create_time": me.create_time(),
            "created_unix_s": time.time(), **info}
    try:
        fd = os.open(record_path(prefix), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    return True


def forget_run(prefix: str) -> None:
    """Delete the record of run `prefix` if there is one."""
    try:
        record_path(prefix).unlink()
    except FileNotFoundError:
        pass


def run_records() -> list[dict[str, Any]]:
    """Every run record, each with an added 'alive' (is its owner still running?)."""
    out = []
    for path in sorted(state_dir().glob("tb*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        data["alive"] = _owner_alive(data)
        out.append(data)
    return out


def _owner_alive(record: dict[str, Any]) -> bool:
    try:
        p = psutil.Process(int(record["owner_pid"]))
        return abs(p.create_time() - float(record["owner_create_time"])) < 0.5
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def clean(prefix: str | None = None) -> list[Leftovers]:
    """Clean one run by prefix, or (None) every recorded run whose owner process is gone.
    Raises RunStillRunning (nothing touched) when the prefix's recorded owner is alive: its
    hosts and links are not left over, they are its run's network."""
    if prefix is not None:
        prefix = check_prefix(prefix)
        record = _read_json(record_path(prefix))
        if record and _owner_alive(record):
            raise RunStillRunning(
                f"{prefix}: its run's owner (pid {record['owner_pid']}) is still running: its "
                "network is not left over; nothing was cleaned (stop that run, or kill it, then "
                "clean what a killed run left)")
        return [remove_leftovers(prefix)]
    removed = []
    for record in run_records():
        if record["alive"]:
            log.info("%s: owner pid %s is still running; left alone", record["prefix"],
                     record["owner_pid"])
            continue
        removed.append(remove_leftovers(record["prefix"]))
    return removed


# ----------------------------------------------------------------------------------------------
# Cleaning after a run directory: `testbed clean RUN_DIR`.
#
# A pid in pids.json is this run's only while the process is a testbed process (PS, fork server,
# agent) *and* it names this run directory: on its command line (the PS's ``--run-dir RUN_DIR``)
# or by a file of the directory it holds open (the fork server's stderr is
# RUN_DIR/agents/forkserver.log, an agent's stdout and stderr RUN_DIR/agents/<name>.log, the PS's
# RUN_DIR/ps.log). The command line alone is not enough: an agent, a fork of the fork server, has
# the server's (``python -m testbed.emulator.agent_forkserver``, no run directory), and a pid
# reused by another run's PS is a testbed process too (killing it failed that run). And a run
# whose `testbed up` still runs is not cleaned at all (RunStillRunning): its processes are not
# left over, they are running it.

RUN_DIR_MARKERS = ("up.json", "topology.input.yaml", "pids.json", "network.json")


class RunStillRunning(ValueError):
    """The run directory's `testbed up` is alive: there is nothing left over to clean."""


def is_testbed_process(pid: int) -> bool:
    """Whether pid is still a testbed PS or agent process (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    # an agent the fork server forked has the server's command line
    return any(name in cmdline for name in (b"testbed.agent", b"testbed.ps_backend",
                                            b"testbed.emulator.agent_forkserver"))


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def names_run_dir(pid: int, run_dir: Path) -> bool:
    """Whether process ``pid`` names ``run_dir``: an argument of its command line is the
    directory or an existing path in it (relative ones from the process's working directory;
    an option such as ``-m`` is no path), or it holds a file in it open (a log as its stdout
    or stderr, the run's records). False when /proc does not say (the process is gone, or
    another user's)."""
    directory = os.path.realpath(run_dir)
    try:
        cwd: str | None = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        cwd = None
    for arg in _cmdline(pid):
        value = arg.partition("=")[2] if arg.startswith("-") else arg  # --run-dir=DIR too
        if not value or (cwd is None and not os.path.isabs(value)):
            continue
        try:
            path = os.path.join(cwd or "/", value)
            if os.path.exists(path) and _within(os.path.realpath(path), directory):
                return True
        except (OSError, ValueError):  # a NUL byte, a name too long
            continue
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if _within(target.removesuffix(" (deleted)"), directory):
            return True
    return False


def _is_up_command(pid: int) -> bool:
    """Whether pid runs `testbed up` (``testbed up ...``, ``python -m testbed.cli up ...``)."""
    args = _cmdline(pid)
    return "up" in args and any("testbed" in a for a in args[:3])


def running_up(run_dir: Path, pids: dict[str, Any]) -> str | None:
    """Who runs ``run_dir`` now, or None: its `testbed up` holds the directory's lock
    (:mod:`testbed.run_lock`: no pid to go stale), or, for a run made before there was one,
    pids.json's ``testbed_up`` is a live `testbed up` that names the directory."""
    from testbed.run_lock import holder

    try:
        pid = holder(run_dir)
    except OSError:  # a lock file we may not open: the pid below may still say
        pid = None
    if pid is not None:
        return f"pid {pid}" if pid else "a process"
    up = pids.get("testbed_up")
    if isinstance(up, int) and not isinstance(up, bool) and up > 0 and _is_up_command(up) \
            and names_run_dir(up, run_dir):
        return f"pid {up}"
    return None


def run_pids(run_dir: Path, pids: dict[str, Any]) -> list[int]:
    """The pids of pids.json that are still this run's processes (the rule above)."""
    agents = pids.get("agents")
    listed = [pids.get("ps"), pids.get("agent_forkserver"),
              *(agents.values() if isinstance(agents, dict) else ())]
    protected = _protected_pids()
    return [p for p in listed if isinstance(p, int) and not isinstance(p, bool) and p > 0
            and p not in protected and is_testbed_process(p) and names_run_dir(p, run_dir)]


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when it is missing or torn (a run killed while writing it).
    ValueError naming it when it is no file a run writes: a FIFO hung `testbed clean`, a link
    to /dev/zero filled its memory."""
    from testbed.runlog import RUN_JSON_MAX_BYTES
    from testbed.user_paths import read_user_text

    try:
        data = json.loads(read_user_text(path, RUN_JSON_MAX_BYTES))
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}; expected the record a run writes "
                         f"(or none)") from None
    except ValueError:  # torn (json's error, or UnicodeDecodeError)
        return {}
    return data if isinstance(data, dict) else {}


def clean_run_dir(run_dir: Path) -> list[str]:
    """Remove what a run directory's run left, from whatever it recorded; lines to print.

    ``pids.json`` (written as processes start) names the PS and agents; ``network.json``
    (written with the prefix before Mininet bring-up starts) names the network. Either may be
    missing when the run was killed early; then there is less to do, not an error. Raises
    ValueError when the directory is not a run directory at all, RunStillRunning (a ValueError)
    when its `testbed up` still runs; either way nothing is touched.
    """
    if not any((run_dir / m).exists() for m in RUN_DIR_MARKERS):
        raise ValueError(f"{run_dir} is not a run directory (none of "
                         f"{', '.join(RUN_DIR_MARKERS)} in it)")
    pids = _read_json(run_dir / "pids.json")
    network = _read_json(run_dir / "network.json")  # both read before anything is touched
    owner = running_up(run_dir, pids)
    if owner is not None:
        raise RunStillRunning(
            f"{run_dir}: its `testbed up` ({owner}) is still running: its processes are not "
            "left over; nothing was cleaned (stop it with Ctrl-C where it runs, or kill it, "
            "then clean what a killed run left)")
    lines = []
    ours = run_pids(run_dir, pids)
    kill_pids(ours)
    lines.append(f"{run_dir}: stopped {len(ours)} leftover process(es)")
    prefix = network.get("prefix")
    if isinstance(prefix, str) and PREFIX_RE.match(prefix):
        record = _read_json(record_path(prefix))
        if record and _owner_alive(record):
            # three random characters: a later run may have drawn this run's prefix, and its
            # hosts and links are that live run's network, not this dead run's leftovers
            lines.append(f"{prefix}: now the network of another run, which is running (owner "
                         f"pid {record['owner_pid']}); left alone")
            return lines
        left = remove_leftovers(prefix)
        lines.append(f"{prefix}: removed {len(left.pids)} process(es), {len(left.links)} "
                     f"interface(s)" if not left.empty else f"{prefix}: nothing left")
    return lines
