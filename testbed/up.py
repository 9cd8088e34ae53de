"""``testbed up``: realize a topology, train, and leave a run directory; ``testbed clean``.

Before anything starts: the topology, the churn trace and the network backend are checked (bad
input exits 2), and so is the machine (:mod:`testbed.capacity`: memory, tasks and file
descriptors for one PS and an agent per device; a run that cannot fit exits 2, naming the limit).

A :class:`Run` turns a validated :class:`~testbed.topology.Topology` into running parts, in this
order, and removes them on ``stop()`` (after success, an error, Ctrl-C or SIGTERM) in reverse
order but for the PS, stopped before the agents (it tells them the run is over; an agent's own
SIGTERM would reach it as a departure):

1. the network backend (:mod:`testbed.emulator.network`): loopback or Mininet; a Mininet run's
   prefix is in ``network.json`` before its first host exists;
2. the PS process (``python -m testbed.ps_backend``) on the PS's node; it writes ``ps.json`` once
   it listens;
3. one agent process (what ``python -m testbed.agent --kind emulated`` runs) per device present
   at start, on the device's node, with the link shaping the backend leaves to the application.
   The agents are forks of one process that imported the agent while the PS started
   (:mod:`testbed.emulator.agent_forkserver`): a fresh interpreter spent ~0.5 CPU-s importing.
4. the churn replay (:mod:`testbed.churn.replay`), if the topology or ``--churn`` names a trace.

SIGINT or SIGTERM at any point, start-up included, stops starting things at once and tears down
what exists (exit 130); the signals after the first are ignored (:mod:`testbed.interrupts`).

``testbed up --resume RUN_DIR`` brings a run whose PS died back up in the same directory: the PS
restores the newest checkpoint and reuses the ledger's tiles (docs/fault-tolerance.md); the
devices present when the run stopped are started again and the churn trace goes on from where the
run was. Before anything starts or any file of it is touched, every file the resumed run will
read, write or delete is checked (:func:`resume_problems`); a damaged or finished run exits 2.

Every child process gets the join token through its environment, one BLAS thread (the PS sets
its own torch threads, ``--threads``), and ``PR_SET_PDEATHSIG`` so that it dies with ``testbed
up`` even on a SIGKILL (an agent dies with the fork server, which dies with ``testbed up``).
Children are forked by one thread that lives as long as the run (:class:`Spawner`), because that
signal follows the forking *thread*. The pids go to ``pids.json`` as each process starts, so that
``testbed clean RUN_DIR`` (:func:`testbed.emulator.network.cleanup.clean_run_dir`) finds what a
killed run left.

Exit codes: 0 the job finished; 1 the run failed; 2 bad input (nothing started); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import math
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import yaml

from testbed import interrupts
from testbed.capacity import device_cache_bytes
from testbed.churn.schedule import NEVER_REACHABLE, ChurnSchedule
from testbed.emulator.agent_forkserver import AgentForkServer, ForkedAgent, server_argv
from testbed.emulator.network.base import Network
from testbed.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, InputError
from testbed.pdeathsig import die_with_parent
from testbed.ps_backend.tls import listen_problem, resumed_listen
from testbed.run_lock import RunLock, RunLocked
from testbed.runlog import (
    RUN_JSON_MAX_BYTES,
    RunFileError,
    RunLog,
    read_jsonl,
    read_jsonl_checked,
    read_origin,
    write_json_atomic,
)
from testbed.topology import (
    DeviceSpec,
    Topology,
    TopologyError,
    load_topology,
    steps_problem,
)
from testbed.units import number_arg
from testbed.user_paths import (
    input_problem,
    load_user_json,
    load_user_yaml,
    path_arg,
    read_user_text,
)

log = logging.getLogger("testbed.up")
# tiles an emulated agent may ask to hold at once (the PS sizes its window to its speed);
# `testbed simulate` gives its devices the same
EMULATED_MAX_IN_FLIGHT = 8

PS_START_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0
REAP_S = 5.0  # after SIGKILL, the most a child's exit is waited for
AGENTS_GONE_S = 3.0  # every agent dead this long (and none can come back): the run fails
# what stops a run (a closed terminal's SIGHUP too): tear down, summary, report, exit 130
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DILATION_MODES = ("fixed", "auto", "adaptive")  # choose_dilation's dilation_info["mode"]
MAX_CHOSEN_DILATION = 1e6  # an auto or adaptive D: the largest factor report.md takes
# what a resumed run writes, appends to or deletes in its directory (the PS's, testbed up's,
# the summary's and the report's files): each must be a regular file, or absent
RESUME_WRITES = ("ps.json", "status.json", "steps.jsonl", "events.jsonl", "devices.jsonl",
                 "stages.jsonl", "tiles.jsonl", "summary.json", "ps_summary.json", "report.md",
                 "report.png", "pids.json", "network.json", "ps.log", "clock.json",
                 "join-token", "dilation.request.json", "dilation.applied.json")


def child_env(token: str) -> dict[str, str]:
    """Environment of every process a run starts."""
    env = dict(os.environ)
    env.update(TESTBED_TOKEN=token, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM arrived while the run was coming up."""


class Spawner:
    """Starts every child process of a run from one thread that lives as long as the run.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not when the
    process does (prctl(2)). Agents forked by a short-lived thread (the churn replay) were
    killed the moment it ended; forking on this thread only, which ends after the children are
    stopped, keeps the signal for what it is for: ``testbed up`` itself dying.
    """

    def __init__(self) -> None:
        self._calls: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="spawner", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, future = item
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the spawner thread; return its result (or raise its exception)."""
        future: Future = Future()
        self._calls.put((fn, future))
        return future.result()

    def close(self) -> None:
        """End the thread (after every child it started has been stopped)."""
        self._calls.put(None)
        self._thread.join(5)


class Run:
    """One run of a topology: start() brings it up, stop() removes exactly what it started."""

    def __init__(self, topology: Topology, run_dir: Path, network: Network, dilation: float,
                 join_timeout_s: float = 60.0, schedule: ChurnSchedule | None = None,
                 resume: bool = False, stop: threading.Event | None = None,
                 trace_tiles: bool = False):
        self.topology = topology
        self.trace_tiles = trace_tiles
        self.run_dir = run_dir
        self.network = network
        self.dilation = dilation
        self.join_timeout_s = join_timeout_s
        self.resume = resume
        self.stop_requested = stop or threading.Event()
        # a resumed run keeps the token its devices on other machines were given
        self.token = (saved_token(run_dir) if resume else None) or secrets.token_hex(16)
        self.join_command = ""  # printed when the topology opts into LAN devices
        self.env = child_env(self.token)
        self.ps: subprocess.Popen | None = None
        self.ps_port = 0
        self.agents: dict[str, ForkedAgent] = {}
        self._instances: dict[str, str] = {}  # device name -> its agent's --instance
        self.forkserver: AgentForkServer | None = None
        self.devices = {d.name: d for d in topology.devices}
        self.runlog: RunLog | None = None
        self.schedule = schedule  # the churn trace, parsed and checked before the run
        self.replay: Any = None  # testbed.churn.replay.Replay, when a trace is replayed
        self.notes: list[str] = []
        self.adb: Any = None  # the ADB bridge (testbed.adb_bridge.run_hook), when enabled
        self._stopped = False
        self._started = False  # every process of start-up is running
        # an adaptive D moves in the PS; the kernel's links and the churn clock follow it here
        self.adaptive = topology.time_dilation is None and topology.dilation_adaptive
        self._follower: threading.Thread | None = None
        self._follower_stop = threading.Event()
        self._spawner = Spawner()
        self._lock = threading.Lock()  # agents and pids.json: the replay thread changes them
        self._agents_crashed_since: float | None = None  # every agent gone (failures())
        self._agents_crashed: str | None = None  # ... and the verdict, kept past stop()
        # pids whose exit needs no word: the churn trace signalled them, or it was said once
        self._exits_told: set[int] = set()
        self._trace_exits: set[int] = set()  # agents the trace's leave or crash signalled
        self.agent_deaths: list[dict[str, Any]] = []  # agents that died unasked (summary)
        (run_dir / "agents").mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- bring-up ------------------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] = lambda s: None) -> None:
        """Network, PS, agents, churn; RuntimeError with the reason if a part fails,
        Interrupted when a stop was requested on the way."""
        # not strict: its writers are threads (the churn replay, the dilation follower, adb's)
        # that must not die of a full disk; the run fails on it at the end (failures())
        self.runlog = RunLog(self.run_dir, strict=False)
        present = list(self.devices)
        replay_from = None
        if self.schedule is not None:
            from testbed.churn.replay import last_record_t, resume_point

            if self.resume:
                replay_from = resume_point(
                    self.schedule, read_jsonl(self.run_dir / "events.jsonl"), self.dilation,
                    max(last_record_t(self.run_dir / name)
                        for name in ("steps.jsonl", "devices.jsonl")))
                present = [d for d in self.devices if d in replay_from.present]
            else:
                present = [d for d in self.devices if d in self.schedule.initially_present]
        self._check_stop()
        progress(f"network: starting the {self.network.kind} backend")
        self._start_network()
        phones = self._adb_phones_at_start()
        self._check_stop()
        progress("PS: starting")
        self._start_forkserver()  # it imports the agent while the PS starts
        self._start_ps(expected=len(present) + len(phones))
        if self.adaptive:
            self._follower = threading.Thread(target=self._follow_dilation, name="dilation",
                                              daemon=True)
            self._follower.start()
        if self.join_command:
            progress("devices on other machines join with (the token file is readable only "
                     f"by its owner; copy it over):\n  {self.join_command}")
        progress(f"devices: starting {len(present)} agent(s)")
        for name in present:
            self._check_stop()
            self.start_agent(name)
        if self.adb is not None:
            progress(f"adb: bridge on {self.adb.server}, {len(phones)} phone(s) plugged")
            self.adb.start(self.network.ps_listen_host(), self.ps_port, network=self.network,
                           spawn=self._popen)
        if self.schedule is not None and self.schedule.actions:
            from testbed.churn.replay import Replay

            with self._lock:  # the dilation follower reads both
                self.replay = Replay(self.schedule, self, self.run_dir, self.dilation,
                                     self.runlog.event, self.notes.append, start=replay_from)
            self.replay.start()
        with self._lock:
            self._started = True
            self._write_pids()

    def failures(self) -> list[str]:
        """What went wrong on this side of the run while the PS trained: a churn trace that
        stopped replaying, records that could not be written. Each fails the run."""
        out = []
        if self.replay is not None and self.replay.failure:
            out.append(self.replay.failure)
        records = self.runlog.write_failure() if self.runlog is not None else None
        if records is not None:
            out.append(records)
        if self._agents_crashed is None:
            self._agents_crashed = self._every_agent_crashed()
        if self._agents_crashed is not None:
            out.append(self._agents_crashed)
        return out

    def _every_agent_crashed(self) -> str | None:
        """Why no step can finish, once every agent this run started has been gone for
        ``AGENTS_GONE_S`` (killed, crashed: an exit the PS did not ask for, not 0; or left as
        the churn trace said), or none was started (a resume with every device away), and
        nothing can bring a device back: no churn trace still replaying (or the agents' fork
        server gone, so its joins cannot start an agent), no phones over adb, no devices
        joining over the LAN. The PS would wait for its watchdog (minutes) and then
        blame the devices; the exit codes say more."""
        server = self.forkserver
        # agents start from the fork server: once it is gone, a join of the trace cannot
        # bring a device back (it would fail the run at its time, or the PS's watchdog first)
        died = server.died if server is not None else None
        if (self._stopped or not self._started or self.adb is not None
                or self.topology.network.ps.listen
                or (self.replay is not None and self.replay.running() and died is None)):
            return None
        with self._lock:
            codes = {name: proc.poll() for name, proc in self.agents.items()}
            told = {name for name, proc in self.agents.items() if proc.pid in self._trace_exits}
        # gone: died, or left as the trace said (exit 0 after its SIGTERM); an agent that exits
        # 0 unasked is one the PS let go at the run's end
        if any(code is None or (code == 0 and name not in told) for name, code in codes.items()):
            self._agents_crashed_since = None
            return None
        now = time.monotonic()
        if self._agents_crashed_since is None:
            self._agents_crashed_since = now
        if now - self._agents_crashed_since < AGENTS_GONE_S:
            return None
        if died is not None:
            return (f"{died}: every agent it forked died with it, and no agent can start any "
                    f"more (the churn trace's joins neither), so no step can finish")
        if not codes:  # a resume: the trace had taken every device away before the stop
            return ("no device is left: the churn trace had taken every one away by the time "
                    "the run stopped, and brings none back, so no step can finish")
        if all(name in told for name in codes):  # the trace's own doing
            return (f"no device is left: the churn trace took every one away "
                    f"({len(codes)} of {len(self.devices)} started) and brings none back, "
                    f"so no step can finish")
        first = min(name for name in codes if name not in told)
        signals = sorted({f"{_exit_text(c)}" for c in codes.values() if c is not None})
        return (f"every device's agent has died ({len(codes)} of them: {', '.join(signals)}), "
                f"so no step can finish; the end of {first}'s log "
                f"({self.run_dir / 'agents' / f'{first}.log'}):\n"
                f"{_tail(self.run_dir / 'agents' / f'{first}.log', 5)}")

    def _check_stop(self) -> None:
        if self.stop_requested.is_set():
            raise Interrupted("stopped while starting")

    def _start_network(self) -> None:
        """Start the network; its prefix is in network.json before anything of it exists."""
        assert self.runlog is not None
        net_json = self.run_dir / "network.json"

        def on_progress(phase: str, done: int, total: int) -> None:
            # Mininet has claimed its prefix and reports before it creates the first host
            if done == 0 and phase == "hosts":
                write_json_atomic(net_json, {"backend": self.network.kind,
                                             "prefix": getattr(self.network, "prefix", None),
                                             "state": "starting"})
            self._check_stop()
        if hasattr(self.network, "progress"):
            self.network.progress = on_progress
        self.network.start()
        write_json_atomic(net_json, self.network.describe())
        self.runlog.event("network_up", **self.network.describe())

    def _adb_phones_at_start(self) -> list[str]:
        """With an enabled adb: section, set up the bridge hook; the phones the PS waits for."""
        if self.topology.extra.get("adb") is None or self.runlog is None:
            return []
        from testbed.adb_bridge.run_hook import AdbRunHook, adb_spec_of

        spec = adb_spec_of(self.topology)
        if spec is None:  # adb: {enabled: false}
            return []
        self.adb = AdbRunHook(spec, self.run_dir, self.token, self.runlog, self.notes)
        return self.adb.phones_at_start()

    def _popen(self, node: str | None, argv: list[str], log_path: Path,
               pipes: bool = False) -> subprocess.Popen:
        """Start a child on the spawner thread, its output appended to log_path; ``pipes``:
        its stdin and stdout are pipes to this process (only stderr goes to the log)."""
        def spawn() -> subprocess.Popen:
            with open(log_path, "ab") as out:
                if pipes:
                    streams = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": out}
                else:
                    streams = {"stdin": subprocess.DEVNULL, "stdout": out,
                               "stderr": subprocess.STDOUT}
                return self.network.popen(node, argv, env=self.env, preexec_fn=die_with_parent,
                                          **streams)
        return self._spawner.call(spawn)

    def _start_ps(self, expected: int) -> None:
        argv = [sys.executable, "-m", "testbed.ps_backend",
                "--topology", str(self.run_dir / "topology.input.yaml"),
                "--run-dir", str(self.run_dir), "--listen", f"{self.network.ps_listen_host()}:0",
                "--steps", str(self.topology.job.steps), "--expect-devices", str(expected),
                "--join-timeout-s", str(self.join_timeout_s), "--dilation", str(self.dilation)]
        if self.trace_tiles:
            argv.append("--trace-tiles")
        if self.adaptive:
            argv.append("--links-follow-dilation")
        ps_json = self.run_dir / "ps.json"
        if self.resume:
            argv.append("--resume")
            if self.topology.network.ps.listen:  # its TLS port again, where the devices look
                try:
                    earlier = json.loads(ps_json.read_text()).get("lan_address")
                except (OSError, ValueError, AttributeError):  # none, or torn: any free port
                    earlier = None
                argv += ["--lan-listen",
                         resumed_listen(self.topology.network.ps.listen, earlier)]
            ps_json.unlink(missing_ok=True)  # the dead PS's address
            (self.run_dir / "status.json").unlink(missing_ok=True)  # and its last state
            # and its summary: a resumed PS that dies leaves none, and the run's summary then
            # counts steps.jsonl (testbed.summary), not the session before's figures
            (self.run_dir / "ps_summary.json").unlink(missing_ok=True)
        self.ps = self._popen(None, argv, self.run_dir / "ps.log")
        self._write_pids()
        deadline = time.monotonic() + PS_START_TIMEOUT_S
        while not ps_json.exists():
            self._check_stop()
            if self.ps.poll() is not None:
                raise RuntimeError(f"the PS exited with code {self.ps.returncode} before "
                                   f"listening:\n{_tail(self.run_dir / 'ps.log')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the PS did not listen within {PS_START_TIMEOUT_S:g} s")
            time.sleep(0.05)
        ps_info = json.loads(ps_json.read_text())
        self.ps_port = int(ps_info["port"])
        if ps_info.get("lan_address"):  # network.ps.listen: LAN devices join over TLS
            token_file = self.run_dir / "join-token"
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.token + "\n")
            self.join_command = (f"testbed join {ps_info['lan_address']} --fingerprint "
                                 f"{ps_info['fingerprint']} --token-file {token_file}")
            others = [a for a in ps_info.get("lan_addresses", []) if a != ps_info["lan_address"]]
            if others:  # listen on 0.0.0.0 or [::]: the device picks the one it reaches
                self.join_command += ("\n  (or in place of the address, another of this "
                                      f"host's: {', '.join(others)})")

    def _start_forkserver(self) -> None:
        """The process every agent is forked from (:mod:`testbed.emulator.agent_forkserver`),
        on the PS's node with the run's environment; it imports the agent while the PS starts."""
        log_path = self.run_dir / "agents" / "forkserver.log"
        self.forkserver = AgentForkServer(self._popen(None, server_argv(), log_path, pipes=True),
                                          log_path)
        self._write_pids()

    def start_agent(self, name: str, cut_off: bool = False) -> None:
        """Start (or restart) a device's agent process (``cut_off``: blackholed from its
        start, :meth:`testbed.churn.replay.RunControl.start_agent`)."""
        device = self.devices[name]
        old = self.agents.get(name)
        if old is not None and old.poll() is None and old.pid in self._trace_exits:
            # the trace's leave or crash of it still on its way out (a join 5 ms after a leave
            # was dropped): the device leaves first, then joins again
            try:
                old.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                old.kill()
                try:
                    old.wait(REAP_S)
                except subprocess.TimeoutExpired:
                    log.warning("agent %s (pid %d) did not exit within %g s of SIGKILL; not "
                                "started again", name, old.pid, REAP_S)
        with self._lock:
            old = self.agents.get(name)
            if (old is not None and old.poll() is None) or self._stopped:
                return
            assert self.forkserver is not None, "start() starts the fork server first"
            # its block cache: the simulator gives its devices the same
            # a crash and a join of the trace restart the agent: the same device to the PS
            instance = self._instances.setdefault(name, secrets.token_hex(8))
            args = agent_argv(self.network, self.topology, device, self.ps_port,
                              device_cache_bytes(self.topology.job, device.group),
                              self.run_dir / "agents", instance)
            if cut_off:
                args.append("--partitioned")
            self.agents[name] = self.forkserver.start(
                args, self.run_dir / "agents" / f"{name}.log", self.network.node_pid(name))
            self._write_pids()

    def _follow_dilation(self) -> None:
        """Move the links and the churn clock to each D the PS asks for (link_dilation)."""
        from testbed.emulator.link_dilation import POLL_S, DilationFollower

        def apply(dilation: float) -> None:
            started = time.monotonic()
            self.network.set_dilation(dilation)
            with self._lock:  # a replay made meanwhile starts at the new D
                if self.replay is not None:
                    self.replay.set_dilation(dilation)
                old, self.dilation = self.dilation, dilation
            if self.runlog is not None:
                self.runlog.event("links_dilation", old=round(old, 4), new=round(dilation, 4),
                                  backend=self.network.kind,
                                  seconds=round(time.monotonic() - started, 3))

        follower = DilationFollower(self.run_dir, apply)
        while not self._follower_stop.wait(POLL_S):
            follower.poll()

    def signal_agent(self, name: str, sig: int) -> bool:
        """Send a signal to a device's agent; False if it is not running."""
        proc = self.agents.get(name)
        if proc is None or proc.poll() is not None:
            return False
        if sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGQUIT):
            # its exit is the trace's doing (leave, crash; SIGQUIT: a crash held by the cut)
            self._exits_told.add(proc.pid)
            self._trace_exits.add(proc.pid)
        proc.send_signal(sig)
        return True

    def died_unasked(self) -> list[str]:
        """The agents that died since the last call with no signal from this run (the OOM
        killer, a bug, a refused join), each said once: an event, a note for the live view and
        a line returned for the plain output; summary.json lists them (``agent_deaths``). The
        PS re-queues their tiles and trains on without them, so the run has fewer devices than
        its topology, and only this says so."""
        if self._stopped:
            return []
        lines = []
        server = self.forkserver
        if server is not None and server.died and server.pid not in self._exits_told:
            self._exits_told.add(server.pid)  # said once: the cause of the deaths below
            if self.runlog is not None:
                self.runlog.event("agent_forkserver_died", reason=server.died)
            line = f"{server.died}: every agent it forked died with it"
            self.notes.append(line)
            lines.append(line)
        with self._lock:
            agents = list(self.agents.items())
        for name, proc in agents:
            code = proc.poll()
            if code in (None, 0) or proc.pid in self._exits_told:
                continue
            self._exits_told.add(proc.pid)  # said once
            log_path = self.run_dir / "agents" / f"{name}.log"
            death: dict[str, Any] = {"device": name, "exit": _exit_text(code),
                                     "log": str(log_path)}
            self.agent_deaths.append(death)
            if self.runlog is not None:
                self.runlog.event("agent_died", **death)
            line = (f"{name}'s agent died ({death['exit']}) and no churn event asked it to; "
                    f"the PS re-queues its tiles in flight (its log: {log_path})")
            self.notes.append(line)
            lines.append(line)
        return lines

    def set_partitioned(self, name: str, partitioned: bool) -> bool:
        """Take a device's link down or up in the network; False when the network cannot."""
        return self.network.set_partitioned(self.devices[name], partitioned)

    def ps_alive(self) -> bool:
        """Whether the PS process is running."""
        return self.ps is not None and self.ps.poll() is None

    def _write_pids(self) -> None:
        """pids.json: rewritten as each process starts, so a killed run leaves them named."""
        pids = {"testbed_up": os.getpid(), "ps": self.ps.pid if self.ps else None,
                "agent_forkserver": self.forkserver.pid if self.forkserver else None,
                "agents": {n: p.pid for n, p in self.agents.items()},
                "starting": not self._started}  # false once start-up has started everyone
        write_json_atomic(self.run_dir / "pids.json", pids)

    # -- teardown ------------------------------------------------------------------------------
    def poll(self) -> int | None:
        """The PS's exit code once it has ended, else None."""
        return self.ps.poll() if self.ps is not None else EXIT_FAILURE

    def stop(self) -> None:
        """Stop churn, the PS, every agent, the network; safe to call twice."""
        if self._stopped:
            return
        self.died_unasked()  # before its own SIGTERMs: a death of the last moments is said too
        with self._lock:
            self._stopped = True  # no agent starts after this
        if self.replay is not None:
            self.replay.stop()
        self._follower_stop.set()
        if self._follower is not None:
            self._follower.join(5)
        # the PS first: stopped, it writes its summary and tells every device the run is over,
        # phones through the bridge's relays too. Signalled together (or the bridge first, which
        # SIGTERMs each phone's agent), each agent's own SIGTERM reached the PS as a leave (that
        # is how churn's leave works): a Ctrl-C counted every device as departed, its tiles
        # re-queued
        killed = _terminate([self.ps] if self.ps is not None else [])
        if self.adb is not None:  # then the phones' agents, told by the PS, are gone or going
            self.adb.stop()
        killed += _terminate(list(self.agents.values()))
        # one reaping deadline for all of them: with the agents' fork server stopped, no
        # agent's exit reaches us, and a wait each made the teardown REAP_S times the agents
        deadline = time.monotonic() + REAP_S
        for proc in killed:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # its exit reaches us through a process that
                # is itself stopped (the agents' fork server): tear down the rest
                log.warning("process %d did not exit within %g s of SIGKILL; going on "
                            "with the teardown", proc.pid, REAP_S)
        if self.forkserver is not None:  # after its agents: any left die with it
            self.forkserver.close()
        self._spawner.close()
        try:
            self.network.stop()
        finally:
            if self.runlog is not None:
                self.runlog.event("run_stop")
                self.runlog.close()


def _terminate(procs: list[Any]) -> list[Any]:
    """SIGTERM to each process still running (a Popen, or a ForkedAgent: the same calls),
    STOP_GRACE_S for all of them to exit, SIGKILL to the rest; return those killed (their exits
    are reaped later, under one deadline)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    killed = []
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            killed.append(proc)
    return killed


def agent_argv(network: Network, topology: Topology, device: DeviceSpec, ps_port: int,
               cache_bytes: int, log_dir: Path, instance: str = "") -> list[str]:
    """An emulated device's agent flags (``python -m testbed.agent``'s): where the PS is from
    the device's host, who it is (``instance``: kept across its restarts, so that a restarted
    agent takes its name back; "" lets the agent draw one), what it emulates, its cache, the
    file that slows it (``log_dir``/NAME.slow), its behaviour and the link shaping the network
    leaves to it."""
    return ["--ps", f"{network.ps_address_for(device)}:{ps_port}",
            "--name", device.name, *(["--instance", instance] if instance else []),
            "--group", device.group.group, "--kind", "emulated",
            "--profile", str(device.group.profile_path),
            "--seed", str(topology.seed * 1000 + device.index),
            "--max-in-flight", str(EMULATED_MAX_IN_FLIGHT),
            "--cache-mib", repr(cache_bytes / 2**20),
            "--control-file", str(log_dir / f"{device.name}.slow"),
            *behaviour_argv(device, log_dir), *network.app_shaping(device).argv()]


def behaviour_argv(device: DeviceSpec, log_dir: Path) -> list[str]:
    """Agent flags for the device's topology behaviour (byzantine, straggler); [] when honest."""
    spec = device.group.behaviour
    if spec is None:
        return []
    argv: list[str] = []
    if spec.byzantine is not None and spec.byzantine.rate > 0:
        b = spec.byzantine
        argv += ["--byzantine-rate", repr(b.rate), "--byzantine-modes", ",".join(b.modes),
                 "--byzantine-noise", repr(b.noise_rel), "--byzantine-scale",
                 repr(b.scale_factor),
                 "--behaviour-log", str(log_dir / f"{device.name}.behaviour.jsonl")]
    if spec.straggler is not None and spec.straggler.factor > 1:
        argv += ["--straggler-factor", repr(spec.straggler.factor),
                 "--straggler-rate", repr(spec.straggler.rate)]
    return argv


def saved_token(run_dir: Path) -> str | None:
    """The join token an earlier start of this run wrote for devices on other machines
    (``RUN_DIR/join-token``), when it reads as one this module makes; else None."""
    try:
        token = read_user_text(run_dir / "join-token", 4096).strip()
    except (OSError, ValueError):
        return None
    return token if re.fullmatch(r"[0-9a-f]{32}", token) else None


def _exit_text(code: int) -> str:
    """An exit code as Popen gives it, in words: "exit 1", "SIGKILL"."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def make_run_dir(out: Path, name: str) -> Path:
    """A new, empty run directory ``<out>/<YYYYmmdd-HHMMSS>-<name>``. An ``out`` where none can
    be made (not a directory, not writable) is the user's input: InputError, which the command
    line turns into exit 2 (each command makes its run directory before it starts anything)."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for i in range(100):
        run_dir = out / (f"{stamp}-{name}" if i == 0 else f"{stamp}-{name}-{i}")
        try:
            run_dir.mkdir(parents=True)
            return run_dir
        except FileExistsError:
            continue
        except OSError as exc:
            raise InputError(f"--out {out}", [
                f"cannot create a run directory in it: {exc.strerror}"]) from exc
    raise InputError(f"--out {out}", [f"{stamp}-{name} and 99 more names are taken"])


def load_run_inputs(topology_path: str | Path, *, steps: int | None = None,
                    churn_path: str | Path | None = None, trace_tiles: bool = False
                    ) -> tuple[Topology, Path | None, Any] | int:
    """The topology (with ``--steps``) and churn schedule a run reads, all checked before
    anything starts: (topology, trace path, schedule), or exit 2 with the problems printed.

    `testbed up`, `simulate`, `compare` and `validate` all start here, so they accept and refuse
    the same. ``churn_path`` (``--churn``) replaces the topology's own trace, in the topology
    returned too (its ``churn``), so the run directory's ``topology.yaml`` names the trace.
    """
    try:
        topology = load_topology(topology_path)
    except TopologyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if steps is not None:
        problem = steps_problem(steps)
        if problem:
            print(f"error: --steps: {problem}", file=sys.stderr)
            return EXIT_BAD_INPUT
        topology = topology.with_overrides(steps=steps)
    strategy = topology.job.parallelism.strategy
    if trace_tiles and strategy != "tile-tp":
        print(f"error: --trace-tiles: the {strategy} baseline hands out no tiles "
              "(job.parallelism.strategy)", file=sys.stderr)
        return EXIT_BAD_INPUT
    churn = topology.churn
    if churn_path:
        # checked before resolve(), which raises RuntimeError on a symlink loop
        problem = input_problem(Path(churn_path))
        if problem:
            print(f"error: --churn: {problem}", file=sys.stderr)
            return EXIT_BAD_INPUT
        churn = Path(churn_path).resolve()
    # the run directory's topology.yaml names the trace replayed, --churn's too
    topology = dataclasses.replace(topology, churn=churn)
    schedule = None
    if churn is not None:
        from testbed.churn import TraceError, load_schedule
        # where the trace was named: a problem of `--churn x.csv` said only the resolved path
        given = "--churn " if churn_path else "the topology's churn: "
        try:
            schedule = load_schedule(churn, topology)
        except TraceError as exc:
            print(f"error: {given}{exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except OSError as exc:
            print(f"error: {given}{churn}: {exc.strerror}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if not schedule.ever_reachable():  # a partition at 0 with no heal ran to a stall
            print(f"error: {given}{churn}: {NEVER_REACHABLE}", file=sys.stderr)
            return EXIT_BAD_INPUT
    from testbed.emulator.network.base import loss_without_delay
    for note in loss_without_delay(topology):  # valid, but likely not what was meant
        print(note, file=sys.stderr)
    return topology, churn, schedule


def backend_problems(topology: Topology, backend: str) -> list[str]:
    """What ``testbed up`` refuses of a file on a network backend ('loopback' or 'mininet'):
    parts that work on the other one only. ``testbed validate`` names them as notes (``testbed
    simulate`` runs such a file)."""
    problems = []
    strategy = topology.job.parallelism.strategy
    if topology.network.ps.listen and strategy == "tile-tp" and backend != "loopback":
        problems.append(f"network.ps.listen (devices on other machines) works with the loopback "
                        f"backend only; this run would use {backend} (set network.backend: "
                        "loopback)")
    if strategy != "tile-tp" and backend != "mininet":
        problems.append(f"job.parallelism.strategy: {strategy} runs on the Mininet backend "
                        f"only (its stages and replicas talk device to device over the "
                        f"emulated links); this run would use {backend} (set network.backend: "
                        "mininet, or use `testbed simulate`)")
    return problems


def run_up(args: argparse.Namespace) -> int:
    """The `testbed up` command: the run directory is locked (:mod:`testbed.run_lock`) from
    before ``--resume`` reads it, or from when it is made, until this returns."""
    locks: list[RunLock] = []
    try:
        return _run_up(args, locks)
    finally:
        for lock in locks:
            lock.release()


def _run_up(args: argparse.Namespace, locks: list[RunLock]) -> int:
    from rich.console import Console

    # lines as they are: a pipe or a log file got them cut at 80 columns, a run directory's
    # path in two (a terminal wraps what is too long for it on its own)
    console = Console(stderr=False, soft_wrap=True)
    resume_dir, saved = _resume_target(args)
    if isinstance(saved, int):
        return saved
    if resume_dir is not None:
        try:
            locks.append(RunLock(resume_dir))
        except RunLocked as exc:
            print(f"error: --resume {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except OSError as exc:
            print(f"error: --resume {resume_dir}: cannot lock it ({exc.strerror}): a run "
                  "directory testbed up cannot write cannot be resumed", file=sys.stderr)
            return EXIT_BAD_INPUT
    inputs = load_run_inputs(args.topology, steps=args.steps, churn_path=args.churn,
                             trace_tiles=args.trace_tiles)
    if isinstance(inputs, int):
        return inputs
    topology, churn, schedule = inputs
    if topology.job.parallelism.strategy != "tile-tp":  # the baselines' own processes
        from testbed.baselines.up_baseline import run_baseline_up
        return run_baseline_up(args, topology, schedule)
    if resume_dir is not None:
        problems = resume_problems(resume_dir, topology, schedule)
        if problems:
            for problem in problems:
                print(f"error: {problem}", file=sys.stderr)
            print(f"error: --resume {resume_dir}: nothing was started and no file of it was "
                  "changed", file=sys.stderr)
            return EXIT_BAD_INPUT
    from testbed import capacity
    from testbed.emulator.dilation import choose_dilation
    from testbed.emulator.network.select import NetworkUnavailable, make_network, resolve_backend

    # a declared backend's refusals first: the same on every machine, Mininet or not; those
    # of `auto` once this machine has chosen (resolve_backend returns a declared one as it is)
    declared = topology.network.backend
    for problem in backend_problems(topology, declared) if declared != "auto" else ():
        print(f"error: {args.topology}: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        backend = resolve_backend(topology)
    except NetworkUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for problem in backend_problems(topology, backend) if declared == "auto" else ():
        print(f"error: {args.topology}: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    lan_problem = topology.network.ps.listen and listen_problem(topology.network.ps.listen)
    if lan_problem:
        print(f"error: {args.topology}: network.ps.listen: {lan_problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    needs, problems = capacity.check(topology, backend)
    if problems:
        print(f"error: {args.topology}: this machine cannot hold the run "
              f"({len(topology.devices)} devices, {backend} backend):", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        print("  (the rules and measured figures: testbed/capacity.py, docs/architecture.md)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    capacity.raise_fd_limit(needs)
    dilation, dilation_info = (saved["dilation"], saved["dilation_info"]) if saved else \
        choose_dilation(topology)
    try:
        network = make_network(topology, dilation=dilation, backend=backend)
    except NetworkUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if topology.extra.get("adb") is not None:
        from testbed.adb_bridge.run_hook import network_problem

        adb_problem = network_problem(topology, network.kind)
        if adb_problem is not None:
            print(f"error: {adb_problem}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if resume_dir is not None:
        run_dir = resume_dir
    else:
        run_dir = make_run_dir(Path(args.out), topology.name)
        locks.append(RunLock(run_dir))  # new, so free: a --resume of it must wait for this
        (run_dir / "topology.input.yaml").write_text(portable_input(Path(args.topology)))
        (run_dir / "topology.yaml").write_text(yaml.safe_dump(topology.to_yaml(),
                                                             sort_keys=False))
        write_json_atomic(run_dir / "up.json", {
            "steps": topology.job.steps, "churn": str(churn) if churn else None,
            "dilation": dilation, "dilation_info": dilation_info})
    console.print(f"run directory: {run_dir}" + (" (resumed)" if resume_dir else ""))
    console.print(f"network: {network.kind}; time dilation {dilation:.2f} "
                  f"({dilation_info['mode']})")
    stop = threading.Event()
    interrupted: list[str] = []

    def on_signal(signum: int, _frame: Any) -> None:
        interrupted.append(signal.Signals(signum).name)
        interrupts.disarm()  # the command line's handler, back after this, ignores the rest
        stop.set()
    # SIGHUP (the terminal closed) stops the run as SIGTERM does; the handlers stay until the
    # summary and the report are written, so a second Ctrl-C cannot cut them off half-way
    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    run = Run(topology, run_dir, network, dilation, args.join_timeout, schedule,
              resume=resume_dir is not None, stop=stop, trace_tiles=args.trace_tiles)
    try:
        return _run_to_end(args, run, console, dilation_info, stop, interrupted)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run_to_end(args: argparse.Namespace, run: Run, console: Any,
                dilation_info: dict[str, Any], stop: threading.Event,
                interrupted: list[str]) -> int:
    """Start the run and follow it until the PS ends or a signal stops it, then tear it down,
    write the summary and the report, and print how it ended; the exit code."""
    run_dir, topology = run.run_dir, run.topology
    code = EXIT_FAILURE
    explained = False  # an error line already says why the run ended
    try:
        run.start(progress=lambda s: console.print(s, style="dim", soft_wrap=True))
        code = _watch(run, stop, console, live=not args.no_live)
        if interrupted:
            code = EXIT_INTERRUPTED
    except Interrupted:
        console.print(f"interrupted ({', '.join(interrupted)}) while starting: stopping")
        code = EXIT_INTERRUPTED
    except RuntimeError as exc:
        console.print(f"[red]error:[/red] {exc}")
        code = EXIT_INTERRUPTED if interrupted else EXIT_FAILURE
        explained = True
    finally:
        run.stop()
    failures = run.failures()
    for failure in failures:
        console.print(f"[red]error:[/red] {failure}", soft_wrap=True)
        code = EXIT_FAILURE if code == EXIT_OK else code
        explained = True
    from testbed.summary import run_warnings, write_summary

    extra: dict[str, Any] = {"time_dilation_mode": dilation_info,
                             "interrupted_by": interrupted or None,
                             "agent_deaths": run.agent_deaths}
    if failures and not interrupted:  # this side stopped the PS, which saw only that
        extra.update(state="failed", error="; ".join(failures))
    summary = write_summary(run_dir, topology, run.network.describe(), run.dilation, code,
                            extra, adb=run.adb.summary() if run.adb is not None else None)
    from testbed.report import make_report

    make_report(run_dir)
    console.print(final_line(summary, run_dir))
    if summary.get("state") == "failed":  # why, here: not only in summary.json and ps.log
        reason = None if failures else summary.get("error") or (
            None if explained or interrupted or (run_dir / "ps_summary.json").exists() else
            f"the PS ended without its summary; the end of {run_dir / 'ps.log'}:\n"
            f"{_tail(run_dir / 'ps.log')}")
        if reason:
            console.print(f"error: {reason}", style="red", markup=False, soft_wrap=True)
    for warning in run_warnings(summary):
        console.print(warning, style="bold red", markup=False)
    return code


def final_line(summary: dict[str, Any], run_dir: Path) -> str:
    """`testbed up`'s last line but the error and warnings: the state, the steps, the final loss
    (none when no step finished: it said "final loss None"), the tiles (a resumed run's: its last
    session's, said so) and the run directory."""
    loss = summary.get("final_loss")
    done = summary.get("steps_done", 0)
    # a resumed run's totals are its last session's (docs/fault-tolerance.md, "Resume")
    session = " (this session's)" if summary.get("resumes") else ""
    return (f"{summary.get('state', 'failed')}: {done} step{'' if done == 1 else 's'}, "
            + (f"final loss {loss:.4f}, " if loss is not None else "")
            + f"{summary.get('tiles', 0)} tiles{session}{_outcome_figures(summary)}; run "
            f"directory {run_dir}")


def _outcome_figures(summary: dict[str, Any]) -> str:
    """The end line's device time, efficiency and energy, those the summary has (as `testbed
    simulate`'s end line gives them)."""
    from testbed.summary import is_number

    device, eff = summary.get("device_time_s"), summary.get("efficiency")
    total = ((summary.get("energy") or {}).get("total") or {}).get("total_j")
    parts = [f"{device:.3f} s device time" if is_number(device) else "",
             f"efficiency {eff:.2f}" if is_number(eff) else "",
             f"energy {total:.1f} J" if is_number(total) else ""]
    return "".join(f", {p}" for p in parts if p)


def portable_input(path: Path) -> str:
    """The topology file as written, with relative churn, data and profile paths made absolute.

    The PS (and ``--resume``) read the copy in the run directory, where the original relative
    paths would not resolve.
    """
    text = path.read_text()
    raw = load_user_yaml(text)
    if not isinstance(raw, dict):
        return text
    base = path.resolve().parent

    def absolute(value: Any) -> Any:
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute() \
                and (base / value).exists():
            return str((base / value).resolve())
        return value
    if "churn" in raw:
        raw["churn"] = absolute(raw["churn"])
    job = raw.get("job")
    data = job.get("data") if isinstance(job, dict) else None
    if isinstance(data, dict) and isinstance(data.get("files"), list):
        data["files"] = [absolute(f) for f in data["files"]]
    for group in raw.get("devices") or []:
        if isinstance(group, dict) and isinstance(group.get("profile"), str) \
                and group["profile"].endswith((".yaml", ".yml")):
            group["profile"] = absolute(group["profile"])
    return yaml.safe_dump(raw, sort_keys=False)


def _run_json(path: Path, problems: list[str], fields: dict[str, tuple[type, ...]],
              required: bool) -> dict[str, Any] | None:
    """A JSON object a run wrote (``up.json``, ``pids.json``) whose ``fields`` have those types
    (and are all there, if ``required``); None, and a problem naming the file, when it is
    damaged (edited, or a full disk)."""
    try:
        obj = load_user_json(read_user_text(path, RUN_JSON_MAX_BYTES))
    except OSError as exc:
        problems.append(f"--resume: {path}: cannot be read ({exc.strerror})")
        return None
    except ValueError as exc:  # JSONDecodeError (nesting too deep included), not UTF-8
        problems.append(f"--resume: {path}: not readable JSON ({exc})")
        return None
    if not isinstance(obj, dict):
        problems.append(f"--resume: {path}: not as testbed up writes it (not a JSON object)")
        return None
    bad = [f"{k} ({v!r})" for k, v in obj.items()
           if k in fields and (isinstance(v, bool) or not isinstance(v, fields[k]))]
    missing = [k for k in fields if k not in obj] if required else []
    if bad or missing:
        problems.append(f"--resume: {path}: not as testbed up writes it" +
                        (f"; wrong type: {', '.join(bad)}" if bad else "") +
                        (f"; missing: {', '.join(missing)}" if missing else ""))
        return None
    return obj


def _resume_target(args: argparse.Namespace) -> tuple[Path | None, dict[str, Any] | int | None]:
    """For --resume: check the run directory and fill args from it; (run_dir, saved settings).

    Returns (None, None) for a new run and (None, exit code) for bad input.
    """
    if not getattr(args, "resume", None):
        if args.topology is None:
            print("error: a topology file is needed (or --resume RUN_DIR)", file=sys.stderr)
            return None, EXIT_BAD_INPUT
        return None, None
    run_dir = Path(args.resume)
    problems = []
    if args.topology is not None:
        problems.append("give either a topology or --resume RUN_DIR, not both")
    if not run_dir.is_dir():  # one line, where it said each file it lacks was not found
        problems.append(f"--resume {run_dir}: " + ("not a directory" if run_dir.exists() else
                                                    "no such directory")
                        + "; expected a run directory made by testbed up (runs/<time>-<name>/)")
    for name in ("topology.input.yaml", "up.json") if run_dir.is_dir() else ():
        if not (run_dir / name).is_file():
            problems.append(f"--resume {run_dir}: {name} not found (not a run directory "
                            f"made by testbed up)")
    saved: Any = None
    if not problems:  # (a live run is refused by its lock, run_up)
        saved = _run_json(run_dir / "up.json", problems, {
            "steps": (int,), "churn": (str, type(None)), "dilation": (int, float),
            "dilation_info": (dict,)}, required=True)
        if saved is not None:
            problems += [f"--resume: {run_dir / 'up.json'}: {p}" for p in _saved_problems(saved)]
    if problems or saved is None:  # (saved is None only with a problem said)
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return None, EXIT_BAD_INPUT
    args.topology = str(run_dir / "topology.input.yaml")
    if args.steps is None:  # --steps 0 is the user's, and refused as theirs
        args.steps = saved["steps"]
    if args.churn is None:
        args.churn = saved["churn"]
    return run_dir, saved


def _saved_problems(saved: dict[str, Any]) -> list[str]:
    """What is wrong with the values of up.json (its types are checked): each names its field."""
    from testbed.topology import MAX_DILATION

    problems = []
    steps_wrong = steps_problem(saved["steps"])
    if steps_wrong:
        problems.append(f"steps: {steps_wrong}")
    mode = saved["dilation_info"].get("mode")
    if mode not in DILATION_MODES:
        problems.append(f"dilation_info.mode: expected one of {', '.join(DILATION_MODES)}, "
                        f"found {mode!r}")
    # fixed: the topology's own bound; auto and adaptive (choose_dilation: no upper bound)
    # the largest factor the run's report takes
    most = MAX_DILATION if mode == "fixed" else MAX_CHOSEN_DILATION
    dilation = saved["dilation"]
    if not (math.isfinite(dilation) and 1 <= dilation <= most):
        problems.append(f"dilation: expected a time dilation from 1 to {most:g}, "
                        f"found {dilation!r}")
    if saved["churn"] == "":
        problems.append("churn: expected a trace file's path or null, found an empty string")
    return problems


def resume_problems(run_dir: Path, topology: Topology,
                    schedule: ChurnSchedule | None) -> list[str]:
    """The pre-flight check of ``--resume RUN_DIR``, after up.json and pids.json
    (:func:`_resume_target`) and the topology and trace (:func:`load_run_inputs`) were read: every
    other file the resumed run will read, and every file it will write or delete, is read and
    checked now, before anything starts and before any file is touched. Returns the problems,
    each naming its file (and line or field); [] when the run can be resumed.

    * the newest checkpoint loads into this job's model and names its own step (the PS's own
      :func:`~testbed.ps_backend.engine.checkpoint.load_resume_point`, on a trainer made here),
      and steps are left to run: a finished run is refused;
    * ``steps.jsonl``: every line a record with its ``step`` (the PS keeps those before the
      checkpoint and drops the rest), and the kept ones as the report reads them;
    * ``events.jsonl``: as the summary and the report read it, and with a churn trace as
      :func:`~testbed.churn.replay.resume_point` reads it; ``clock.json``: the run's origin;
    * the ledger's journals (:func:`~testbed.ps_backend.ledger.journal_problems`);
    * the files the run writes, appends to or deletes (``RESUME_WRITES``): regular files or
      absent; ``agents/`` a directory or absent, and the agents' files in it the same.
    """
    from testbed.churn.replay import resume_record_problem
    from testbed.ps_backend.engine.checkpoint import CheckpointError, load_resume_point
    from testbed.ps_backend.engine.trainer import Trainer  # torch: only for a resume
    from testbed.ps_backend.ledger import journal_problems
    from testbed.report import event_problems, step_problems

    problems = [f"{run_dir / name}: expected a file, found "
                f"{'a directory' if (run_dir / name).is_dir() else 'no regular file'}"
                for name in RESUME_WRITES
                if (run_dir / name).exists() and not (run_dir / name).is_file()]
    agents = run_dir / "agents"
    if agents.exists() and not agents.is_dir():
        problems.append(f"{agents}: expected the agents' directory, found a file")
    elif agents.is_dir():
        names = ["forkserver.log"] + [f"{d.name}{suffix}" for d in topology.devices
                                      for suffix in (".log", ".slow", ".behaviour.jsonl")]
        problems += [f"{agents / n}: expected a file, found a directory" for n in names
                     if (agents / n).is_dir()]
    if problems:  # the readers below would only say the same of these files
        return problems
    try:
        read_origin(run_dir / "clock.json")
    except FileNotFoundError:
        pass
    except RunFileError as exc:
        problems.append(str(exc))
    trainer = Trainer(topology.job, topology.seed, None)
    next_step: int | None = None
    try:
        load_resume_point(trainer, run_dir / "checkpoints")
        next_step = trainer.next_step
    except CheckpointError as exc:
        problems.append(f"{exc} (the newest checkpoint, which the PS would continue from)")
    steps = topology.job.steps
    if next_step is not None and next_step >= steps:
        done = f"{next_step} of {steps} steps" if next_step == steps else \
            f"{next_step} steps, more than the {steps} asked for"
        problems.append(f"{run_dir}: run already finished: {done} (its newest checkpoint); "
                        f"nothing to resume; use --steps M with M > {next_step} to train "
                        "further")
    problems += journal_problems(run_dir / "ledger")
    problems += _records_problems(run_dir / "steps.jsonl", lambda r: _kept_step_problems(
        r, next_step, step_problems))
    problems += _records_problems(run_dir / "events.jsonl", lambda r: event_problems(r) or (
        [p] if schedule is not None and (p := resume_record_problem(r)) else []))
    return problems


def _kept_step_problems(record: dict[str, Any], next_step: int | None,
                        report_problems: Callable[[Any], list[str]]) -> list[str]:
    """A steps.jsonl record on resume: it has its step (the PS keeps the records of steps
    before ``next_step`` and drops the rest), and a kept one is as the report reads it."""
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return [f"step: expected an integer >= 0, found {step!r}"]
    return report_problems(record) if next_step is not None and step < next_step else []


def _records_problems(path: Path, problems_of: Callable[[dict[str, Any]], list[str]],
                      shown: int = 10) -> list[str]:
    """A JSON-lines file's damaged lines (read_jsonl_checked) and records ``problems_of``
    refuses, each naming the file and line; the first ``shown`` of them."""
    try:
        records = read_jsonl_checked(path)
    except RunFileError as exc:
        return [str(exc)]
    found = [f"{path}: line {number}: {p}" for number, record in records
             for p in problems_of(record)]
    more = len(found) - shown
    return found[:shown] + ([f"{path}: ... and {more} more problem(s)"] if more > 0 else [])


def _watch(run: Run, stop: threading.Event, console: Any, live: bool) -> int:
    """Show progress until the PS ends (or we are stopped); return the exit code."""
    from rich.live import Live

    from testbed.dashboard import device_rows_for, render

    status_path = run.run_dir / "status.json"

    def snapshot() -> dict[str, Any]:
        try:
            snap = json.loads(status_path.read_text())
            return run.adb.merge_status(snap) if run.adb is not None else snap
        except (OSError, json.JSONDecodeError):
            return {"state": "starting"}

    printed = 0
    noted = 0  # run.notes the plain output has printed
    state = "starting"  # the PS's, as the plain output last said it
    with Live(render(snapshot(), run.topology.name), console=console, refresh_per_second=4,
              transient=False) if live else contextlib.nullcontext() as view:
        while not stop.wait(0.25):
            code = run.poll()
            if view is not None:
                view.update(render(snapshot(), run.topology.name, run.notes,
                                   device_rows_for(console.size.height)))
            else:
                # the PS's phases before training (waiting for devices, probing the time
                # dilation, planning) take minutes on large topologies: say which one runs
                # (not training, whose steps have their lines, nor how the run ended, which
                # run_up's last line says; a short run goes from starting to done between polls)
                now = snapshot().get("state", state)
                if now != state and now not in ("training", "done", "failed", "interrupted"):
                    console.print(f"PS: {now}")
                state = now
                steps = read_jsonl(run.run_dir / "steps.jsonl")
                for s in steps[printed:]:
                    console.print(step_line(s))
                printed = len(steps)
            died = run.died_unasked()  # (each also a note, which the live view shows)
            if view is None:  # the notes the live view shows: churn actions, deaths, phones
                notes = run.notes[noted:]
                noted += len(notes)
                for line in notes:
                    console.print(line, style="red" if line in died else None, markup=False,
                                  soft_wrap=True)
            if code is not None:
                from testbed.summary import ps_summary_or_steps  # (a PS stopped by a signal
                # of its own says "interrupted": the run was, not failed)
                return EXIT_OK if code == 0 else EXIT_INTERRUPTED if \
                    ps_summary_or_steps(run.run_dir).get("state") == "interrupted" \
                    else EXIT_FAILURE
            if run.failures():  # the churn replay stopped, or our records cannot be written:
                return EXIT_FAILURE  # not the run asked for; run_up says why and stops it
    return EXIT_INTERRUPTED


def step_line(step: dict[str, Any]) -> str:
    """A step's plain progress line: loss, tiles, wall time, and where known its device time
    and how much of it the emulated devices' lateness can account for (the verdict's figure,
    docs/architecture.md): a run whose steps say 40 % need not be watched to the end."""
    line = f"step {step['step']}: loss {step['loss']:.4f}, {step['tiles']} tiles, " \
        f"{step['wall_s']:.2f} s"
    device_s, late = step.get("device_time_s"), step.get("lateness_share")
    if isinstance(device_s, (int, float)):
        line += f" ({device_s:.2f} s of device time"
        if isinstance(late, (int, float)):
            line += f"; devices late <= {100 * late:.1f}% of it"
        line += ")"
    return line


def run_clean(args: argparse.Namespace) -> int:
    """`testbed clean [RUN_DIR | PREFIX]`: remove what killed runs left, and nothing else."""
    from testbed.emulator.network import cleanup

    target = args.target
    if args.list:
        if target is not None:
            print(f"error: --list lists every recorded network and takes no run directory or "
                  f"prefix (got {target!r}); without --list, {target!r} would be cleaned",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        records = cleanup.run_records()
        for r in records:
            print(f"{r['prefix']}  owner pid {r['owner_pid']}  "
                  f"{'running' if r['alive'] else 'gone'}  topology {r.get('topology', '?')}")
        if not records:  # a silent --list read as a broken one
            print(f"no recorded networks (none in {cleanup.state_dir()})")
        return EXIT_OK
    prefix: str | None = None
    if target is not None and not Path(target).is_dir() and (
            os.sep in target or Path(target).exists()):
        what = "not a directory" if Path(target).exists() else "no such directory"
        print(f"error: {target}: {what}; expected a run directory (RUN_DIR, made by testbed "
              f"up) or a network prefix ({cleanup.PREFIX_FORM})", file=sys.stderr)
        return EXIT_BAD_INPUT
    if target is not None and Path(target).is_dir():
        try:
            lines = cleanup.clean_run_dir(Path(target))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print("\n".join(lines))
        return EXIT_OK
    if target is not None:
        try:
            prefix = cleanup.check_prefix(target)
        except ValueError:
            print(f"error: {target!r} is neither a run directory nor a network prefix (expected "
                  f"a directory made by testbed up, or {cleanup.PREFIX_FORM})", file=sys.stderr)
            return EXIT_BAD_INPUT
    try:
        cleaned = cleanup.clean(prefix)
    except cleanup.RunStillRunning as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for left in cleaned:
        print(f"{left.prefix}: removed {len(left.pids)} process(es), "
              f"{len(left.links)} interface(s)" if not left.empty else
              f"{left.prefix}: nothing left")
    if not cleaned:  # nothing recorded, or only live runs (each said above, in the log)
        print("nothing to clean: no recorded network whose owner is gone "
              "(testbed clean --list shows them all)")
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `testbed up` and `testbed clean`."""
    p = sub.add_parser(
        "up", help="run a topology: PS, devices, network, churn; live view; run directory",
        description="Bring up a topology: the network, the parameter server and one emulated "
                    "device per topology device; train the job; write runs/<time>-<name>/. "
                    "job.parallelism.strategy pipeline or data-parallel: stage or replica "
                    "processes on Mininet (docs/baselines.md). "
                    "Ctrl-C stops everything cleanly. Exit: 0 done, 1 failed, 2 bad input, "
                    "130 interrupted.")
    p.add_argument("topology", nargs="?", default=None, type=path_arg,
                   help="topology YAML file (not with --resume)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", type=path_arg,
                   help="continue a run that stopped (killed, interrupted, its PS died) from its "
                        "newest checkpoint and ledger; refused while a testbed up runs it")
    p.add_argument("--steps", type=int, default=None, help="override job.steps")
    p.add_argument("--out", type=path_arg, default="runs",
                   help="directory for run directories (default: runs)")
    p.add_argument("--no-live", action="store_true",
                   help="plain lines instead of the live view: the PS's phases before "
                   "training (waiting for devices, probing, planning) as they change, then "
                   "one line per step")
    p.add_argument("--churn", type=path_arg, default=None,
                   help="churn trace CSV (overrides the topology's)")
    p.add_argument("--join-timeout", type=number_arg(0, 86_400), default=60.0, metavar="S",
                   help="seconds without a new device attaching (from the PS's start, then "
                   "from the last arrival) before training starts with those present, 0 to "
                   "86400 (default 60)")
    p.add_argument("--trace-tiles", action="store_true",
                   help="write RUN_DIR/tiles.jsonl: every accepted tile's times (handed out, "
                        "arrived, started, done, accepted), its modelled compute_s and result "
                        "bytes, to see where a step's time goes (bench/stage_profile.py --run "
                        "RUN_DIR --tiles); ~300 bytes a tile")
    p.set_defaults(func=run_up)
    c = sub.add_parser(
        "clean", help="remove what killed runs left behind (processes, namespaces, interfaces)",
        description="With a run directory: stop the processes its pids.json names (if they are "
                    "still testbed processes of that run) and remove its network by the run's "
                    "own prefix; a run that a testbed up is still running is refused (exit 2). "
                    "With a prefix (tb + 3 characters): remove that network's leftovers. With "
                    "nothing: the leftovers of every recorded network whose owner is gone. "
                    "Never anything else.")
    c.add_argument("target", nargs="?", type=path_arg,
                   help="a run directory or a network prefix")
    c.add_argument("--list", action="store_true", help="only list recorded networks")
    c.set_defaults(func=run_clean)
