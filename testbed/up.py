"""``testbed up``: realize a topology, train, and leave a run directory; ``testbed clean``.

A :class:`Run` turns a validated :class:`~testbed.topology.Topology` into running parts, in this
order, and removes them in reverse order on ``stop()`` (after success, an error, Ctrl-C or
SIGTERM):

1. the network backend (:mod:`testbed.emulator.network`): loopback or Mininet;
2. the PS process (``python -m testbed.ps_backend``) on the PS's node; it writes ``ps.json`` once
   it listens;
3. one agent process (``python -m testbed.agent --kind emulated``) per device present at start,
   on the device's node, with the link shaping the backend leaves to the application;
4. the churn replay (if the topology or ``--churn`` names a trace): join starts an agent, leave
   sends SIGTERM, crash SIGKILL, partition takes the link down (Mininet) or blackholes the agent
   (SIGUSR1; heal is SIGUSR2), slow restarts nothing but tells the agent a compute factor.
   Trace time 0 is the moment training starts (status.json says ``training``), so a trace means
   the same thing however long the devices take to join.

``testbed up --resume RUN_DIR`` brings a run whose PS died back up in the same directory: the PS
restores the newest checkpoint and reuses the ledger's tiles (docs/fault-tolerance.md); the
devices present at the start are started again; the churn trace is not replayed a second time.

Every child process gets the join token through its environment, one BLAS thread, and
``PR_SET_PDEATHSIG`` so that it dies with ``testbed up`` even on a SIGKILL; the pids are recorded
in ``pids.json`` so that ``testbed clean RUN_DIR`` can find what a killed run left.

Exit codes: 0 the job finished; 1 the run failed; 2 bad input (nothing started); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from testbed.emulator.network.base import Network
from testbed.runlog import RunLog, read_jsonl, write_json_atomic
from testbed.topology import DeviceSpec, Topology, TopologyError, load_topology

log = logging.getLogger("testbed.up")

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
PS_START_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def child_env(token: str) -> dict[str, str]:
    """Environment of every process a run starts."""
    env = dict(os.environ)
    env.update(TESTBED_TOKEN=token, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


class Run:
    """One run of a topology: start() brings it up, stop() removes exactly what it started."""

    def __init__(self, topology: Topology, run_dir: Path, network: Network, dilation: float,
                 join_timeout_s: float = 60.0, churn: Path | None = None, resume: bool = False):
        self.topology = topology
        self.run_dir = run_dir
        self.network = network
        self.dilation = dilation
        self.join_timeout_s = join_timeout_s
        self.churn_path = churn
        self.resume = resume
        self.token = secrets.token_hex(16)
        self.env = child_env(self.token)
        self.ps: subprocess.Popen | None = None
        self.ps_port = 0
        self.agents: dict[str, subprocess.Popen] = {}
        self.devices = {d.name: d for d in topology.devices}
        self.runlog: RunLog | None = None
        self.schedule: Any = None
        self.notes: list[str] = []
        self.adb: Any = None  # the ADB bridge (testbed.adb_bridge.run_hook), when enabled
        self._stopped = False
        self._churn_thread: threading.Thread | None = None
        self._stop_churn = threading.Event()
        (run_dir / "agents").mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- bring-up ------------------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] = lambda s: None) -> None:
        """Network, PS, agents, churn; raise RuntimeError with the reason if a part fails."""
        self.runlog = RunLog(self.run_dir)
        present = list(self.devices)
        if self.churn_path is not None:
            from testbed.churn import load_schedule

            self.schedule = load_schedule(self.churn_path, self.topology)
            present = list(self.schedule.initially_present)
        progress(f"network: starting the {self.network.kind} backend")
        self.network.start()
        write_json_atomic(self.run_dir / "network.json", self.network.describe())
        self.runlog.event("network_up", **self.network.describe())
        phones = self._adb_phones_at_start()
        progress("PS: starting")
        self._start_ps(expected=len(present) + len(phones))
        progress(f"devices: starting {len(present)} agent(s)")
        for name in present:
            self.start_agent(self.devices[name])
        self._write_pids()
        if self.adb is not None:
            progress(f"adb: bridge on {self.adb.server}, {len(phones)} phone(s) plugged")
            self.adb.start(self.network.ps_listen_host(), self.ps_port)
        if self.schedule is not None and self.schedule.actions and not self.resume:
            self._churn_thread = threading.Thread(target=self._replay, name="churn", daemon=True)
            self._churn_thread.start()

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

    def _popen(self, node: str | None, argv: list[str], log_path: Path) -> subprocess.Popen:
        out = open(log_path, "ab")
        try:
            return self.network.popen(node, argv, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=self.env,
                                      preexec_fn=_die_with_parent)
        finally:
            out.close()

    def _start_ps(self, expected: int) -> None:
        argv = [sys.executable, "-m", "testbed.ps_backend",
                "--topology", str(self.run_dir / "topology.input.yaml"),
                "--run-dir", str(self.run_dir), "--listen", f"{self.network.ps_listen_host()}:0",
                "--steps", str(self.topology.job.steps), "--expect-devices", str(expected),
                "--join-timeout-s", str(self.join_timeout_s), "--dilation", str(self.dilation)]
        ps_json = self.run_dir / "ps.json"
        if self.resume:
            argv.append("--resume")
            ps_json.unlink(missing_ok=True)  # the dead PS's address
        self.ps = self._popen(None, argv, self.run_dir / "ps.log")
        deadline = time.monotonic() + PS_START_TIMEOUT_S
        while not ps_json.exists():
            if self.ps.poll() is not None:
                raise RuntimeError(f"the PS exited with code {self.ps.returncode} before "
                                   f"listening:\n{_tail(self.run_dir / 'ps.log')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the PS did not listen within {PS_START_TIMEOUT_S:g} s")
            time.sleep(0.05)
        self.ps_port = int(json.loads(ps_json.read_text())["port"])

    def start_agent(self, device: DeviceSpec) -> None:
        """Start (or restart) a device's agent process."""
        old = self.agents.get(device.name)
        if old is not None and old.poll() is None:
            return
        shaping = self.network.app_shaping(device)
        argv = [sys.executable, "-m", "testbed.agent",
                "--ps", f"{self.network.ps_address_for(device)}:{self.ps_port}",
                "--name", device.name, "--group", device.group.group, "--kind", "emulated",
                "--profile", str(device.group.profile_path),
                "--seed", str(self.topology.seed * 1000 + device.index),
                "--max-in-flight", "8",
                "--control-file", str(self.run_dir / "agents" / f"{device.name}.slow"),
                *behaviour_argv(device, self.run_dir / "agents"), *shaping.argv()]
        self.agents[device.name] = self._popen(device.name, argv,
                                               self.run_dir / "agents" / f"{device.name}.log")

    def signal_agent(self, name: str, sig: int) -> bool:
        """Send a signal to a device's agent; False if it is not running."""
        proc = self.agents.get(name)
        if proc is None or proc.poll() is not None:
            return False
        proc.send_signal(sig)
        return True

    def _write_pids(self) -> None:
        pids = {"testbed_up": os.getpid(), "ps": self.ps.pid if self.ps else None,
                "agents": {n: p.pid for n, p in self.agents.items()}}
        write_json_atomic(self.run_dir / "pids.json", pids)

    # -- churn replay --------------------------------------------------------------------------
    def _replay(self) -> None:
        """Apply the schedule's actions at their times (device seconds x dilation)."""
        from testbed.churn.trace import ChurnEvent

        if not self._wait_for_training():
            return
        start = time.monotonic()
        if self.runlog is not None:
            self.runlog.event("churn_clock_start", actions=len(self.schedule.actions))
        for action in self.schedule.actions:
            if self._stop_churn.wait(max(0.0, start + action.time_s * self.dilation
                                         - time.monotonic())):
                return
            device = self.devices[action.device]
            event = action.event
            effect = "applied"
            if event is ChurnEvent.JOIN:
                self.start_agent(device)
            elif event is ChurnEvent.LEAVE:
                effect = "SIGTERM" if self.signal_agent(device.name, signal.SIGTERM) else "absent"
            elif event is ChurnEvent.CRASH:
                effect = "SIGKILL" if self.signal_agent(device.name, signal.SIGKILL) else "absent"
            elif event in (ChurnEvent.PARTITION, ChurnEvent.HEAL):
                down = event is ChurnEvent.PARTITION
                if self.network.set_partitioned(device, down):
                    effect = "link " + ("down" if down else "up")
                else:
                    sig = signal.SIGUSR1 if down else signal.SIGUSR2
                    effect = ("agent blackholed" if down else "agent healed") \
                        if self.signal_agent(device.name, sig) else "absent"
            elif event is ChurnEvent.SLOW:  # the agent polls this file (--control-file)
                write_json_atomic(self.run_dir / "agents" / f"{device.name}.slow",
                                  {"slow": action.factor})
                effect = f"compute x{action.factor}"
            if self.runlog is not None:
                record = action.to_dict()  # its "event" would shadow the record's kind
                self.runlog.event("churn", **{k: v for k, v in record.items() if k != "event"},
                                  action=record["event"], effect=effect)
            self.notes.append(f"churn t={action.time_s:g}s {event.value} {device.name}: {effect}")
            self._write_pids()

    def _wait_for_training(self) -> bool:
        """Block until the PS reports training (True), or the run ends first (False)."""
        status = self.run_dir / "status.json"
        while not self._stop_churn.wait(0.05):
            if self.ps is not None and self.ps.poll() is not None:
                return False
            try:
                if json.loads(status.read_text()).get("state") not in (
                        None, "starting", "waiting for devices"):
                    return True
            except (OSError, json.JSONDecodeError):
                continue
        return False

    # -- teardown ------------------------------------------------------------------------------
    def poll(self) -> int | None:
        """The PS's exit code once it has ended, else None."""
        return self.ps.poll() if self.ps is not None else EXIT_FAILURE

    def stop(self) -> None:
        """Stop churn, the PS, every agent, the network; safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_churn.set()
        if self.adb is not None:  # first: phones' agents leave while the PS is still there
            self.adb.stop()
        procs = ([self.ps] if self.ps is not None else []) + list(self.agents.values())
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        try:
            self.network.stop()
        finally:
            if self.runlog is not None:
                self.runlog.event("run_stop")
                self.runlog.close()


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


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def make_run_dir(out: Path, name: str) -> Path:
    """A new, empty run directory ``<out>/<YYYYmmdd-HHMMSS>-<name>``."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for i in range(100):
        run_dir = out / (f"{stamp}-{name}" if i == 0 else f"{stamp}-{name}-{i}")
        try:
            run_dir.mkdir(parents=True)
            return run_dir
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a run directory under {out}")


def choose_dilation(topology: Topology) -> tuple[float, dict[str, Any]]:
    """The topology's time dilation, or the auto one from a host calibration."""
    if topology.time_dilation is not None:
        return topology.time_dilation, {"mode": "fixed"}
    from testbed.emulator.dilation import auto_dilation, calibrate_host_gflops
    from testbed.perf_model.profiles import load_profile

    tile = topology.job.parallelism
    k = topology.job.model.hidden
    total = 0.0
    for group in topology.groups:
        profile = load_profile(str(group.profile_path))
        model = profile.model  # the fitted time model, when the profile has one
        seconds = model.predict_one(tile.tile_m, k, tile.tile_n) if model is not None else None
        rate = (2.0 * tile.tile_m * k * tile.tile_n / seconds / 1e9) if seconds else \
            profile.sustained_gflops
        total += rate * group.count
    host = calibrate_host_gflops()
    dilation = auto_dilation(total, host["host_gflops"])
    return dilation, {"mode": "auto", "emulated_gflops": round(total, 2),
                      "host_gflops": round(host["host_gflops"], 2)}


def write_summary(run: Run, exit_code: int, extra: dict[str, Any]) -> dict[str, Any]:
    """summary.json: the PS's totals, the network, dilation, energy, churn."""
    ps_summary_path = run.run_dir / "ps_summary.json"
    summary: dict[str, Any] = json.loads(ps_summary_path.read_text()) \
        if ps_summary_path.exists() else {"state": "failed"}
    summary.update(extra)
    summary["exit_code"] = exit_code
    summary["network"] = run.network.describe()
    events = read_jsonl(run.run_dir / "events.jsonl")
    summary["departures"] = sum(e.get("event") in ("leave", "disconnect", "lease_expired")
                                for e in events)
    summary["churn_events"] = sum(e.get("event") == "churn" for e in events)
    departures = [e for e in events if e.get("event") in ("leave", "disconnect",
                                                          "lease_expired", "quarantine")]
    summary["tiles_in_flight_at_departures"] = sum(int(e.get("in_flight", 0) or 0)
                                                   for e in departures)
    summary["quarantines"] = sum(e.get("event") == "quarantine" for e in events)
    summary["resumes"] = sum(e.get("event") == "ps_resume" for e in events)
    if run.adb is not None:
        summary["adb"] = run.adb.summary()
    from testbed.emulator.energy import topology_energy

    summary["energy"] = topology_energy(run.topology, summary.get("devices") or [], events,
                                        float(summary.get("time_dilation") or run.dilation))
    write_json_atomic(run.run_dir / "summary.json", summary)
    return summary


def run_up(args: argparse.Namespace) -> int:
    """The `testbed up` command."""
    from rich.console import Console

    console = Console(stderr=False)
    resume_dir, saved = _resume_target(args)
    if isinstance(saved, int):
        return saved
    try:
        topology = load_topology(args.topology)
    except TopologyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.steps is not None:
        if args.steps <= 0:
            print("error: --steps must be positive", file=sys.stderr)
            return EXIT_BAD_INPUT
        topology = topology.with_overrides(steps=args.steps)
    churn = Path(args.churn).resolve() if args.churn else topology.churn
    if churn is not None:
        from testbed.churn import TraceError, load_schedule
        try:
            load_schedule(churn, topology)  # validate before anything starts
        except TraceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except OSError as exc:
            print(f"error: --churn {churn}: {exc.strerror}", file=sys.stderr)
            return EXIT_BAD_INPUT
    from testbed.emulator.network.select import NetworkUnavailable, make_network

    dilation, dilation_info = (saved["dilation"], saved["dilation_info"]) if saved else \
        choose_dilation(topology)
    try:
        network = make_network(topology, dilation=dilation)
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
        stop.set()
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = EXIT_FAILURE
    run = Run(topology, run_dir, network, dilation, args.join_timeout, churn,
              resume=resume_dir is not None)
    try:
        run.start(progress=lambda s: console.print(s, style="dim"))
        code = _watch(run, stop, console, live=not args.no_live)
        if interrupted:
            code = EXIT_INTERRUPTED
    except RuntimeError as exc:
        console.print(f"[red]error:[/red] {exc}")
        code = EXIT_FAILURE
    finally:
        run.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    summary = write_summary(run, code, {"time_dilation_mode": dilation_info,
                                        "interrupted_by": interrupted or None})
    from testbed.report import make_report

    make_report(run_dir)
    loss = summary.get("final_loss")
    console.print(f"{summary.get('state', 'failed')}: {summary.get('steps_done', 0)} steps, "
                  f"final loss {loss if loss is None else f'{loss:.4f}'}, "
                  f"{summary.get('tiles', 0)} tiles; run directory {run_dir}")
    return code


def portable_input(path: Path) -> str:
    """The topology file as written, with relative churn, data and profile paths made absolute.

    The PS (and ``--resume``) read the copy in the run directory, where the original relative
    paths would not resolve.
    """
    text = path.read_text()
    raw = yaml.safe_load(text)
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
    for name in ("topology.input.yaml", "up.json"):
        if not (run_dir / name).is_file():
            problems.append(f"--resume {run_dir}: {name} not found (not a run directory "
                            f"made by testbed up)")
    pids_path = run_dir / "pids.json"
    if not problems and pids_path.exists():
        ps_pid = json.loads(pids_path.read_text()).get("ps")
        if ps_pid and _is_ours(int(ps_pid)):
            problems.append(f"--resume {run_dir}: its PS (pid {ps_pid}) is still running")
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return None, EXIT_BAD_INPUT
    saved = json.loads((run_dir / "up.json").read_text())
    args.topology = str(run_dir / "topology.input.yaml")
    args.steps = args.steps or saved.get("steps")
    args.churn = args.churn or saved.get("churn")
    return run_dir, saved


def _watch(run: Run, stop: threading.Event, console: Any, live: bool) -> int:
    """Show progress until the PS ends (or we are stopped); return the exit code."""
    from rich.live import Live

    from testbed.dashboard import render

    status_path = run.run_dir / "status.json"

    def snapshot() -> dict[str, Any]:
        try:
            snap = json.loads(status_path.read_text())
            return run.adb.merge_status(snap) if run.adb is not None else snap
        except (OSError, json.JSONDecodeError):
            return {"state": "starting"}

    printed = 0
    with Live(render(snapshot(), run.topology.name), console=console, refresh_per_second=4,
              transient=False) if live else contextlib.nullcontext() as view:
        while not stop.wait(0.25):
            code = run.poll()
            if live:
                view.update(render(snapshot(), run.topology.name, run.notes))
            else:
                steps = read_jsonl(run.run_dir / "steps.jsonl")
                for s in steps[printed:]:
                    console.print(f"step {s['step']}: loss {s['loss']:.4f}, {s['tiles']} tiles, "
                                  f"{s['wall_s']:.2f} s")
                printed = len(steps)
            if code is not None:
                return EXIT_OK if code == 0 else EXIT_FAILURE
    return EXIT_INTERRUPTED


def run_clean(args: argparse.Namespace) -> int:
    """`testbed clean [RUN_DIR | PREFIX]`: remove what killed runs left, and nothing else."""
    from testbed.emulator.network import cleanup

    target = args.target
    if args.list:
        for r in cleanup.run_records():
            print(f"{r['prefix']}  owner pid {r['owner_pid']}  "
                  f"{'running' if r['alive'] else 'gone'}  topology {r.get('topology', '?')}")
        return EXIT_OK
    prefix: str | None = None
    if target is not None and Path(target).is_dir():
        run_dir = Path(target)
        pids_path = run_dir / "pids.json"
        if not pids_path.exists():
            print(f"error: {pids_path} not found: {run_dir} is not a run directory",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        pids = json.loads(pids_path.read_text())
        ours = [p for p in [pids.get("ps"), *(pids.get("agents") or {}).values()]
                if p and _is_ours(p)]
        cleanup.kill_pids(ours)
        print(f"{run_dir}: stopped {len(ours)} leftover process(es)")
        net_path = run_dir / "network.json"
        prefix = json.loads(net_path.read_text()).get("prefix") if net_path.exists() else None
        if prefix is None:
            return EXIT_OK
    elif target is not None:
        try:
            prefix = cleanup.check_prefix(target)
        except ValueError as exc:
            print(f"error: {target!r} is neither a run directory nor a network prefix: {exc}",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
    for left in cleanup.clean(prefix):
        print(f"{left.prefix}: removed {len(left.pids)} process(es), "
              f"{len(left.links)} interface(s)" if not left.empty else
              f"{left.prefix}: nothing left")
    return EXIT_OK


def _is_ours(pid: int) -> bool:
    """Whether pid is still a testbed PS or agent process (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"testbed.agent" in cmdline or b"testbed.ps_backend" in cmdline


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `testbed up` and `testbed clean`."""
    p = sub.add_parser(
        "up", help="run a topology: PS, devices, network, churn; live view; run directory",
        description="Bring up a topology: the network, the parameter server and one emulated "
                    "device per topology device; train the job; write runs/<time>-<name>/. "
                    "Ctrl-C stops everything cleanly. Exit: 0 done, 1 failed, 2 bad input, "
                    "130 interrupted.")
    p.add_argument("topology", nargs="?", default=None,
                   help="topology YAML file (not with --resume)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue a run whose PS died, from its newest checkpoint and ledger")
    p.add_argument("--steps", type=int, default=None, help="override job.steps")
    p.add_argument("--out", default="runs", help="directory for run directories (default: runs)")
    p.add_argument("--no-live", action="store_true",
                   help="print one line per step instead of the live view")
    p.add_argument("--churn", default=None, help="churn trace CSV (overrides the topology's)")
    p.add_argument("--join-timeout", type=float, default=60.0,
                   help="seconds to wait for the devices before training starts anyway")
    p.set_defaults(func=run_up)
    c = sub.add_parser(
        "clean", help="remove what killed runs left behind (processes, namespaces, interfaces)",
        description="With a run directory: stop the processes its pids.json names (if they are "
                    "still testbed processes) and remove its network by the run's own prefix. "
                    "With a prefix (tb + 3 characters): remove that network's leftovers. With "
                    "nothing: the leftovers of every recorded network whose owner is gone. "
                    "Never anything else.")
    c.add_argument("target", nargs="?", help="a run directory or a network prefix")
    c.add_argument("--list", action="store_true", help="only list recorded networks")
    c.set_defaults(func=run_clean)
