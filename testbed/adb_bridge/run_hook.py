"""The ADB bridge as a part of ``testbed up``: what :class:`testbed.up.Run` calls, and when.

``Run.start()``, when the topology has an enabled ``adb:`` section::

    hook = AdbRunHook(spec, run_dir, token, runlog, notes)
    serials = hook.phones_at_start()      # before the PS starts: they count as expected devices
    ... PS starts, listens on ps_port ...
    hook.start(ps_host, ps_port)          # the bridge follows the adb server

``Run.stop()`` calls ``hook.stop()`` first (each phone's agent gets SIGTERM and leaves while the
PS is still there). ``_watch`` passes each ``status.json`` snapshot through
:func:`merge_status` so the live view shows the phones' telemetry.

Where things go (names written down once):

* bridge events other than ``telemetry`` go to ``events.jsonl`` as ``adb_<kind>`` (``-`` becomes
  ``_``: ``adb_plugged``, ``adb_agent_started``, ``adb_unplugged``...), with ``serial``,
  ``device`` (the run's device name ``adb-<serial>``) and the event's data;
* telemetry samples go to ``devices.jsonl`` as ``kind: adb-telemetry`` lines (same ``t`` and
  ``elapsed_s`` as every run-log line);
* in the live view a joined phone's row (the PS names it ``adb-<serial>``) gets the latest sample
  under ``telemetry``, with ``temperature_c`` = the hottest thermal sensor (else the battery);
  a phone the bridge knows that has not joined the PS gets its own row in state ``adb:<state>``
  (``adb:failed`` when it cannot run the agent, ``adb:waiting`` when the user must start the
  Termux listener; the reason or what to type is also a note under the table).

Expected devices: a phone in state ``device`` on the adb server when the run starts counts as an
expected device, so the PS waits for it before training (until ``--join-timeout`` passes with no
device attaching). A phone that then cannot run the agent delays the start by that timeout after
the last device that did attach; a phone plugged later joins the running job.

Network: the bridge's relays run in this process, in the root network namespace, where the adb
server delivers the phones' reverse connections. On the loopback backend they dial the PS
directly. On the Mininet backend each phone placed in the topology (``adb.serials: {SERIAL:
{switch, link}}``) has a Mininet host of its own, and :meth:`AdbRunHook.start` starts a
:mod:`~testbed.adb_bridge.forwarder` inside it, listening on a Unix socket in a directory the run
owns; the phone's relay dials that socket, and the forwarder dials the PS inside the topology, so
the phone's bytes cross its own shaped link. At stop the hook reads that host's interface
counters into ``summary.json`` (``adb.links``). :func:`network_problem` refuses, before anything
starts, a Mininet run whose phones are not placed, and ``adb.link`` there (the topology's links
shape the phones).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from adbutils.errors import AdbError

from testbed.adb_bridge.bridge import AdbBridge, BridgeEvent, PhoneStatus, device_name
from testbed.adb_bridge.client import AdbServer, split_state
from testbed.adb_bridge.config import AdbSpec
from testbed.runlog import RunLog

log = logging.getLogger(__name__)

GROUP = "adb"  # the topology group phones report to the PS (--group)
MAX_NOTE_CHARS = 160
ENDED_STATES = ("done", "failed", "interrupted")  # status.json states after the last step
FORWARDER_START_TIMEOUT_S = 20.0
UNIX_PATH_MAX = 100  # sun_path holds 108 bytes; keep room
Spawn = Callable[[str, list[str], Path], subprocess.Popen]  # (node, argv, log path)


def adb_spec_of(topology: Any) -> AdbSpec | None:
    """The topology's enabled ``adb:`` spec, or None when the run has no bridge."""
    spec = getattr(topology, "extra", {}).get("adb")
    return spec if isinstance(spec, AdbSpec) and spec.enabled else None


def network_problem(topology: Any, network_kind: str) -> str | None:
    """Why this topology's ``adb:`` section cannot run on this network backend, or None."""
    spec = adb_spec_of(topology)
    if spec is None or network_kind == "loopback":
        return None
    if network_kind != "mininet":
        return f"adb: phones cannot join a run on the {network_kind} backend"
    if not spec.placements:
        return ("adb.serials: on the mininet backend each phone needs a place in the topology, "
                "expected a mapping such as 'serials: {R58M12ABCDE: {switch: ap0, link: "
                "{down: 100Mbit, up: 20Mbit}}}' (got 'all' or a list)")
    if spec.link_given:
        return ("adb.link: on the mininet backend each phone's link is "
                "adb.serials.SERIAL.link (the kernel shapes it); leave adb.link out")
    return None


def live_temperature_c(sample: dict[str, Any]) -> float | None:
    """The temperature the live view shows for a phone: hottest sensor, else the battery."""
    for key in ("thermal_max_c", "battery_temperature_c"):
        value = sample.get(key)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def merge_status(snapshot: dict[str, Any], phones: list[PhoneStatus],
                 telemetry: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A copy of a ``status.json`` snapshot with the phones' telemetry and unjoined phones."""
    out = dict(snapshot)
    rows = [dict(d) for d in snapshot.get("devices") or []]
    by_name: dict[str, dict[str, Any]] = {}
    for d in rows:  # the PS lists joined devices first, then departed ones: keep the live row
        by_name.setdefault(str(d.get("device")), d)
    for phone in phones:
        sample = telemetry.get(phone.name)
        row = by_name.get(phone.name)
        if row is None:
            if phone.agent_pid is not None and not phone.problem:
                continue  # started, not (yet) joined, or already left: the PS's view is enough
            state = ("adb:failed" if phone.problem else
                     "adb:waiting" if phone.waiting else f"adb:{split_state(phone.state)[0]}")
            row = {"device": phone.name, "group": GROUP, "state": state,
                   "problem": phone.problem or phone.waiting}
            rows.append(row)
        if sample is not None:
            merged = {**(row.get("telemetry") or {}), **sample}
            temp = live_temperature_c(sample)
            if temp is not None:
                merged["temperature_c"] = temp
            row["telemetry"] = merged
    out["devices"] = rows
    return out


class AdbRunHook:
    """One run's ADB bridge: counts phones at start, runs the bridge, logs what it says."""

    def __init__(self, spec: AdbSpec, run_dir: Path, token: str, runlog: RunLog,
                 notes: list[str] | None = None, agent_grace_s: float = 5.0):
        self.spec = spec
        self.run_dir = run_dir
        self.token = token
        self.runlog = runlog
        self.notes = notes if notes is not None else []
        self.agent_grace_s = agent_grace_s
        self.bridge: AdbBridge | None = None
        self._lock = threading.Lock()
        self._telemetry: dict[str, dict[str, Any]] = {}  # device name -> latest sample
        self.network: Any = None  # the run's network, when phones have hosts in it
        self.forwarders: dict[str, subprocess.Popen] = {}  # device name -> forwarder
        self.socket_dir: Path | None = None
        self._links: dict[str, dict[str, Any]] = {}  # device name -> link counters at stop

    @property
    def server(self) -> str:
        return f"{self.spec.server_host}:{self.spec.server_port}"

    def phones_at_start(self) -> list[str]:
        """Serials in state ``device`` now (the PS waits for them); RuntimeError if no server."""
        try:
            states = AdbServer(self.spec.server_host, self.spec.server_port,
                               timeout_s=5.0).states()
        except (AdbError, OSError, EOFError) as exc:
            raise RuntimeError(f"adb: cannot reach the adb server at {self.server} ({exc}); "
                               f"start it with 'adb start-server' (or fix adb.server in the "
                               f"topology)") from exc
        wanted = set(self.spec.serials) if self.spec.serials is not None else None
        serials = sorted(s for s, st in states.items()
                         if st == "device" and (wanted is None or s in wanted))
        self.runlog.event("adb_phones_at_start", server=self.server, serials=serials,
                          devices=[device_name(s) for s in serials],
                          other_states={s: st for s, st in states.items() if st != "device"})
        return serials

    def start(self, ps_host: str, ps_port: int, network: Any = None,
              spawn: Spawn | None = None) -> None:
        """Start the bridge: each phone's relay forwards to ps_host:ps_port, or on Mininet to
        its forwarder, which spawn(node, argv, log) starts in the phone's host first."""
        s = self.spec
        upstream: dict[str, str] = {}
        if network is not None and getattr(network, "kind", "") == "mininet" and s.placements:
            assert spawn is not None, "the Mininet backend needs spawn to start forwarders"
            upstream = self._start_forwarders(network, spawn, ps_host, ps_port)
        self.bridge = AdbBridge(
            s.server_host, s.server_port, f"{ps_host}:{ps_port}", self.token,
            serials=s.serials, profile=s.profile, shaping=s.shaping, phone_port=s.phone_port,
            telemetry_interval_s=s.telemetry_interval_s, on_event=self._on_event,
            extra_agent_args=("--group", GROUP), agent_grace_s=self.agent_grace_s,
            may_restart=self.job_running, upstream_unix=upstream)
        self.runlog.event("adb_bridge_start", server=self.server, ps=f"{ps_host}:{ps_port}",
                          phone_port=s.phone_port, profile=s.profile,
                          link={"down_bps": s.shaping.down_bps, "up_bps": s.shaping.up_bps,
                                "delay_s": s.shaping.delay_s})
        self.bridge.start()

    def _socket_dir(self) -> Path:
        """A directory of this run for the forwarders' sockets (mode 0700): in the run
        directory when the path is short enough for a Unix socket, else a fresh temporary one."""
        d = self.run_dir / "adb-fwd"
        if len(str(d.resolve())) + 12 > UNIX_PATH_MAX:
            d = Path(tempfile.mkdtemp(prefix="tb-adbfwd-"))
        d.mkdir(mode=0o700, exist_ok=True)
        d.chmod(0o700)
        return d

    def _start_forwarders(self, network: Any, spawn: Spawn, ps_host: str,
                          ps_port: int) -> dict[str, str]:
        from testbed.emulator.network.base import path_delay_s

        self.network = network
        self.socket_dir = self._socket_dir()
        netem = bool(getattr(getattr(network, "caps", None), "netem", True))
        dilation = float(getattr(network, "dilation", 1.0))
        paths: dict[str, str] = {}
        for j, place in enumerate(self.spec.placements):
            path = self.socket_dir / f"a{j}.sock"
            # without netem the kernel has no delay: the forwarder applies the path's, as an
            # emulated device's agent does (dilated like the kernel's would be)
            like_device: Any = SimpleNamespace(link=place.link,  # what path_delay_s reads
                                               group=SimpleNamespace(switch=place.switch))
            delay_s = 0.0 if netem else dilation * path_delay_s(network.topology, like_device)
            argv = [sys.executable, "-m", "testbed.adb_bridge.forwarder", "--listen-unix",
                    str(path), "--connect", f"{ps_host}:{ps_port}", "--delay-s", f"{delay_s:g}"]
            proc = spawn(place.name, argv, self.run_dir / f"adb-forwarder-{place.name}.log")
            self.forwarders[place.name] = proc
            paths[place.serial] = str(path)
            self.runlog.event("adb_forwarder_started", serial=place.serial, device=place.name,
                              pid=proc.pid, host=network.node_name(place.name),
                              ip=network.host_ip(place.name), socket=str(path),
                              switch=place.switch, delay_s=delay_s,
                              link={"down_bps": place.link.down_bps,
                                    "up_bps": place.link.up_bps,
                                    "delay_s": place.link.delay_s})
        deadline = time.monotonic() + FORWARDER_START_TIMEOUT_S
        for place in self.spec.placements:
            path = Path(paths[place.serial])
            while not path.exists():
                proc = self.forwarders[place.name]
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"adb: the forwarder of {place.name} did not start "
                                       f"(see adb-forwarder-{place.name}.log in the run "
                                       f"directory)")
                time.sleep(0.05)
        return paths

    def _stop_forwarders(self) -> None:
        network, self.network = self.network, None
        for name in list(self.forwarders):
            if network is not None:
                try:
                    counters = network.interface_counters(name)
                    self._links[name] = counters
                    self.runlog.event("adb_link_counters", device=name, **counters)
                except (OSError, KeyError, RuntimeError, ValueError) as exc:
                    log.warning("adb: cannot read %s's interface counters: %s", name, exc)
        forwarders, self.forwarders = self.forwarders, {}
        for proc in forwarders.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in forwarders.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.socket_dir = None

    def job_running(self) -> bool:
        """Whether the PS has not ended the job yet (its status.json says so before it tells
        the devices to stop; an agent that exits after that is not restarted)."""
        try:
            state = json.loads((self.run_dir / "status.json").read_text()).get("state")
        except (OSError, ValueError):
            return True  # not written yet: the PS is starting
        return state not in ENDED_STATES

    def stop(self) -> None:
        """Stop the bridge (phones' agents leave gracefully); safe to call twice."""
        bridge, self.bridge = self.bridge, None
        if bridge is not None:
            bridge.stop()
        self._stop_forwarders()

    def phones(self) -> list[PhoneStatus]:
        """The bridge's snapshot of every phone (empty before start and after stop)."""
        bridge = self.bridge
        return bridge.phones() if bridge is not None else []

    def merge_status(self, snapshot: dict[str, Any]) -> dict[str, Any]:
        """The live view's snapshot with this run's phones merged in."""
        with self._lock:
            telemetry = dict(self._telemetry)
        return merge_status(snapshot, self.phones(), telemetry)

    def summary(self) -> dict[str, Any]:
        """For summary.json: the server and the latest known sample per phone."""
        with self._lock:
            out: dict[str, Any] = {"server": self.server, "telemetry": dict(self._telemetry)}
        if self._links:  # Mininet: each phone's host interface, read at stop
            out["links"] = dict(self._links)
        return out

    # -- events (called from the bridge's threads) ------------------------------------------------

    def _on_event(self, event: BridgeEvent) -> None:
        name = device_name(event.serial) if event.serial else ""
        if event.kind == "telemetry":
            with self._lock:
                self._telemetry[name] = dict(event.data)
            self.runlog.device(device=name, serial=event.serial, kind="adb-telemetry",
                               **event.data)
            return
        self.runlog.event("adb_" + event.kind.replace("-", "_"), serial=event.serial,
                          device=name, **event.data)
        if event.kind == "agent-failed":
            note = f"adb {event.serial}: cannot run the agent: {event.data.get('reason', '?')}"
            self.notes.append(note[:MAX_NOTE_CHARS])
        elif event.kind == "poll-failed":  # (at most one a minute per phone: bridge.py)
            note = f"{event.data.get('reason', '?')}; a poll of adb {event.serial} was lost"
            self.notes.append(note[:MAX_NOTE_CHARS])
        elif event.kind in ("agent-waiting", "listener-refused"):
            note = f"adb {event.serial}: {event.data.get('reason', '?')}"
            self.notes.append(note[:MAX_NOTE_CHARS])
        elif event.kind in ("agent-started", "unplugged", "offline", "tracker-lost"):
            what = {"agent-started": "agent started, joining",
                    "tracker-lost": "adb server lost; every phone left"}.get(event.kind,
                                                                               event.kind)
            self.notes.append(f"adb {event.serial or self.server}: {what}")
