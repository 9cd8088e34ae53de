"""The PS process: ``python -m testbed.ps_backend --topology T --run-dir D``.

Starts the gRPC server, writes ``ps.json`` (address, pid) once it listens, waits for the
expected devices (until ``--join-timeout-s`` passes with no new one), trains the job's steps
through the tile executor, writes ``steps.jsonl``, ``devices.jsonl``, ``status.json`` and
``summary.json``, tells every device to stop and exits 0. SIGTERM or SIGINT ends it between (or
inside) steps with exit code 1 and a summary marked ``interrupted``. The join token comes from the
environment (``TESTBED_TOKEN``), not the command line, so that process listings do not show it.

Crash safety: every accepted tile is journaled in ``ledger/`` (:mod:`testbed.ps_backend.ledger`)
and a checkpoint (model, optimizer, RNG, losses so far) is written atomically to ``checkpoints/``
every ``--checkpoint-every`` steps (default 1; the two newest are kept). With ``--resume`` the PS
restores the newest checkpoint, drops ``steps.jsonl`` lines of steps it will run again (the
kept ones go to a new file renamed over the old: a kill leaves one or the other,
:func:`rewrite_durably`), and serves the journaled tiles of those steps instead of sending them
to devices. An unexpected exception fails the run with its type and message as ``error`` (an
OSError's file included).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from testbed.agent.tls import parse_address
from testbed.emulator.dilation import (
    LATENESS_KINDS,
    DilationController,
    error_quantiles,
    fidelity_ok,
    lateness_shares,
    probe_dilation,
)
from testbed.emulator.link_dilation import DilationRequester
from testbed.errors import EXIT_BAD_INPUT
from testbed.ps_backend.admission import raise_fd_limit
from testbed.ps_backend.bound import BoundTotals, efficiency
from testbed.ps_backend.config import ps_config
from testbed.ps_backend.core import DEPARTED_SHOWN, NO_PROGRESS_S
from testbed.ps_backend.executor import DivergedError, TileExecutor
from testbed.ps_backend.host import PsServer
from testbed.ps_backend.ledger import Ledger
from testbed.ps_backend.scheduler import GemmSpec
from testbed.ps_backend.step_plan import planning_workers
from testbed.ps_backend.tls import host_port, join_hosts, make_identity, saved_identity
from testbed.ps_backend.watchdog import WatchdogError
from testbed.runlog import RunLog, read_jsonl, write_json_atomic
from testbed.summary import run_warnings
from testbed.topology import JobSpec, Topology, TopologyError, load_topology, steps_problem
from testbed.user_paths import written_whole

log = logging.getLogger("testbed.ps")

STATUS_PERIOD_S = 0.5
DEVICE_SAMPLE_PERIOD_S = 2.0
CHECKPOINTS_KEPT = 2


class RecordsError(RuntimeError):
    """The run's records could not be written (a full disk): the run stops rather than go on
    with work nobody would see."""


def records_written(runlog: RunLog, when: str) -> None:
    """Raise RecordsError if a record of the run failed to be written (RunLog.write_error)."""
    failure = runlog.write_failure()
    if failure is not None:
        raise RecordsError(f"{failure}; stopped {when}")


class StatusWriter:
    """Writes status.json (for the live view) and periodic devices.jsonl samples."""

    def __init__(self, run_dir: Path, server: PsServer, runlog: RunLog, steps: int):
        self.path = run_dir / "status.json"
        self.server = server
        self.runlog = runlog
        self.fields: dict[str, Any] = {"state": "starting", "step": 0, "steps": steps,
                                       "loss": None, "losses": []}
        self._last_write = self._last_sample = 0.0
        self._last_tiles = 0
        self._last_tiles_s = time.monotonic()
        self.tiles_per_s = 0.0
        self.cpu = CpuClock()

    def tick(self, force: bool = False) -> None:
        """On the loop thread: refresh the snapshot when due."""
        now = time.monotonic()
        if not force and now - self._last_write < STATUS_PERIOD_S:
            return
        core = self.server.core
        assert core is not None
        totals = core.totals
        dt = now - self._last_tiles_s
        if dt > 0:
            self.tiles_per_s = (totals.tiles - self._last_tiles) / dt
        self._last_tiles, self._last_tiles_s, self._last_write = totals.tiles, now, now
        # departed devices: the newest few and a count (a long churn run has thousands)
        devices = core.device_records() + core.departed_records(DEPARTED_SHOWN)
        self._write({
            **self.fields, "tiles": totals.tiles, "tiles_per_s": round(self.tiles_per_s, 2),
            "bytes_down": totals.bytes_down, "bytes_up": totals.bytes_up,
            "requeued": totals.requeued, "rejected": totals.rejected,
            "pending": len(core.scheduler.pending), **fault_metrics(core, self.cpu),
            "devices_departed": core.departed_total, "devices": devices})
        if force or now - self._last_sample >= DEVICE_SAMPLE_PERIOD_S:
            self._last_sample = now
            for record in core.device_records():
                self.runlog.device(**record)

    def _write(self, status: dict[str, Any]) -> None:
        """status.json, on the loop's tick: a failed write (a full disk) must not stop the
        lease watcher that runs it; the run fails on the records (``RunLog.write_error``)."""
        try:
            write_json_atomic(self.path, status)
        except OSError as exc:
            if self.runlog.write_error is None:
                log.error("could not write %s: %s", self.path, exc)
            self.runlog.note_write_error(exc)


class CpuClock:
    """CPU and wall time of this process since it was made (for the validation overhead)."""

    def __init__(self) -> None:
        self.cpu0_s = time.process_time()
        self.wall0_s = time.monotonic()

    def cpu_s(self) -> float:
        return time.process_time() - self.cpu0_s

    def wall_s(self) -> float:
        return time.monotonic() - self.wall0_s


def fault_metrics(core: Any, cpu: CpuClock) -> dict[str, Any]:
    """The PS's fault-tolerance metrics plus validation overhead against its CPU and wall time."""
    out = core.metrics()
    ps_cpu_s, wall_s = cpu.cpu_s(), cpu.wall_s()
    out["ps_cpu_s"] = round(ps_cpu_s, 3)
    out["validation_overhead_cpu"] = round(out["validation_cpu_s"] / ps_cpu_s, 6) \
        if ps_cpu_s > 0 else None
    out["validation_overhead_wall"] = round(out["validation_cpu_s"] / wall_s, 6) \
        if wall_s > 0 else None
    useful = out.pop("useful_gflop")
    out["goodput_gflops"] = round(useful / wall_s, 6) if wall_s > 0 else None
    return out


def _save(trainer: Any, run_dir: Path, losses: list[float]) -> Path:
    """Checkpoint the trainer atomically with the losses so far; keep the newest few."""
    from testbed.ps_backend.engine.checkpoint import (
        FORMAT,
        checkpoint_name,
        remove_stale_temporaries,
        save_atomic,
    )

    directory = run_dir / "checkpoints"
    path = save_atomic({"format": FORMAT, **trainer.state_dict(), "ps": {"losses": losses}},
                       directory / checkpoint_name(trainer.next_step))
    for old in sorted(directory.glob("step-*.pt"))[:-CHECKPOINTS_KEPT]:
        old.unlink(missing_ok=True)
    remove_stale_temporaries(directory)  # of a save killed before its rename
    return path


def _restore(trainer: Any, run_dir: Path,
             ledger: Ledger) -> tuple[list[float], int, Path | None]:
    """Load the newest checkpoint (if any) and the ledger's tiles of the steps from it; then,
    with both read, drop the ``steps.jsonl`` lines of steps that will run again. Returns the
    losses of the steps the checkpoint covers, the tiles loaded for reuse and the checkpoint
    (None: the run starts at step 0).

    ``testbed up --resume`` has read and checked the same files (``load_resume_point``,
    ``journal_problems``, ``read_jsonl_checked``) before it started this process; reading them
    all before the first write keeps the run directory as it was if one fails anyway. Called
    before the PS's :class:`RunLog` opens ``steps.jsonl`` (:func:`rewrite_durably` replaces the
    file: a handle opened before would go on appending to the old one)."""
    from testbed.ps_backend.engine.checkpoint import load_resume_point

    path, losses = load_resume_point(trainer, run_dir / "checkpoints")
    log.info("resumed from %s at step %d", path or "the start", trainer.next_step)
    reusable = ledger.load(from_step=trainer.next_step)
    steps_path = run_dir / "steps.jsonl"
    kept = [json.dumps(r) for r in read_jsonl(steps_path)
            if isinstance(r.get("step"), int) and r["step"] < trainer.next_step]
    rewrite_durably(steps_path, "".join(line + "\n" for line in kept).encode())
    return losses, reusable, path


def rewrite_durably(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` so that a kill or a power cut at any moment leaves the old
    file or the new one (``written_whole(durable=True)``). Truncating and rewriting in place,
    as ``--resume`` once did with ``steps.jsonl``, left an empty file to a kill in between:
    every step before the checkpoint was lost from the records."""
    with written_whole(path, binary=True, durable=True) as f:
        f.write(data)


def failure_text(exc: BaseException) -> str:
    """An unexpected exception as the run's ``error``: its type and message, an OSError's file
    names included (``FileNotFoundError: [Errno 2] No such file or directory: '/run/ledger'``;
    ``repr`` gave ``FileNotFoundError(2, 'No such file or directory')``, without the file)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def no_progress_s(job: JobSpec, override: float | None) -> float:
    """The watchdog's time limit: --no-progress-s, else job.watchdog.no_progress_s."""
    return override if override is not None else job.watchdog.no_progress_s


PROBE_STEP = -1  # the probe's GEMMs are named as step -1: never a training step's
PROBE_TILES_PER_DEVICE = 4


def run_probe(server: PsServer, executor: TileExecutor, job: Any, devices: int, start: float,
              target: float, seed: int, rounds: int = 3) -> tuple[float, list[dict[str, Any]]]:
    """Before training: a few tiles per device at the job's tile shape, at D = start and then
    as :func:`probe_dilation` asks; returns the D that met the target and the rounds."""
    core = server.core
    assert core is not None
    tile = job.parallelism
    m, k, n = tile.tile_m * PROBE_TILES_PER_DEVICE, job.model.hidden, tile.tile_n * max(1, devices)
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if job.dtype == "float64" else torch.float32
    round_ids = itertools.count()

    def measure(dilation: float) -> tuple[list[float], float | None]:
        server.call(lambda: core.set_dilation(dilation))
        r = next(round_ids)
        started = time.monotonic()
        b = torch.randn(k, n, generator=gen, dtype=dtype)
        handles = [executor.submit(torch.randn(m, k, generator=gen, dtype=dtype), b,
                                   GemmSpec(f"probe{r}", "forward", PROBE_STEP)) for _ in range(2)]
        for h in handles:
            h.result()
        # the probe is no training: its tiles stay out of the run's totals
        device_s = (time.monotonic() - started) / dilation
        stats = server.call(lambda: core.take_step_stats(count=False))
        shares = lateness_shares(stats.late_s, device_s) if device_s > 0 else None
        return stats.tile_errors, shares["all"] if shares is not None else None

    try:
        return probe_dilation(measure, start, target, rounds=rounds)
    finally:
        server.call(core.take_step_plan)  # ... and out of the first step's plan and bound
        executor.local_gemms = 0


class Fidelity:
    """The run's tile errors and lags, for summary.json (one float32 per emulated tile), and
    how much of each step's device time their lateness can account for, by kind."""

    def __init__(self, target: float | None):
        self.target = target
        self.errors: list[np.ndarray] = []
        self.lags: list[np.ndarray] = []
        self.dilations: list[float] = []
        self.late_shares: list[dict[str, float]] = []  # per step: lateness_shares

    def add(self, errors: list[float], lags_s: list[float], dilation: float,
            late_s: Mapping[str, Mapping[tuple[str, str], float]],
            device_time_s: float) -> dict[str, Any]:
        """Record one step (``late_s``: its lateness by kind, ``StepStats.late_s``); return its
        fields for steps.jsonl."""
        self.errors.append(np.asarray(errors, dtype=np.float32))
        self.lags.append(np.asarray(lags_s, dtype=np.float32))
        self.dilations.append(dilation)
        out = fidelity_fields(errors, lags_s)
        shares = lateness_shares(late_s, device_time_s) \
            if device_time_s > 0 and len(errors) else None
        if shares is not None:
            self.late_shares.append(shares)
        out["lateness_share"] = None if shares is None else round(shares["all"], 6)
        out["lateness_shares"] = _by_kind(shares)
        return out

    def fields(self) -> dict[str, Any]:
        """The run's figures: p50/p95 error and lag over every tile, the largest step share of
        lateness (and that step's shares by kind), the D range, the verdict."""
        errors = np.concatenate(self.errors) if self.errors else np.zeros(0)
        lags = np.concatenate(self.lags) if self.lags else np.zeros(0)
        out = fidelity_fields(errors, lags)  # arrays: a list of 10^7 floats is gigabytes
        worst = max(self.late_shares, key=lambda shares: shares["all"]) \
            if self.late_shares else None
        out["lateness_share_max"] = round(worst["all"], 6) if worst is not None else None
        out["lateness_shares_worst"] = _by_kind(worst)
        out["dilation_target_p95"] = self.target
        out["dilation_min"] = round(min(self.dilations), 4) if self.dilations else None
        out["dilation_max"] = round(max(self.dilations), 4) if self.dilations else None
        out["fidelity_ok"] = fidelity_ok(out["tile_error_p95"], out["lateness_share_max"],
                                         self.target)
        return out


def _by_kind(shares: dict[str, float] | None) -> dict[str, float] | None:
    """A step's lateness shares by kind (``lateness_shares`` less "all"), rounded for JSON."""
    return None if shares is None else {kind: round(shares[kind], 6) for kind in LATENESS_KINDS}


def fidelity_fields(errors: Any, lags_s: Any) -> dict[str, Any]:
    """p50/p95 of tile errors (fractions) and p95 lateness (wall s) of a set of tiles."""
    q = error_quantiles(errors)
    lag_p95 = float(np.quantile(np.asarray(lags_s, dtype=float), 0.95)) if len(lags_s) else None
    return {"tile_error_p50": None if q["p50"] is None else round(q["p50"], 6),
            "tile_error_p95": None if q["p95"] is None else round(q["p95"], 6),
            "lag_p95_s": None if lag_p95 is None else round(lag_p95, 6),
            "emulated_tiles": len(errors)}


def _wait_for_devices(server: PsServer, expected: int, timeout_s: float,
                      stop: threading.Event) -> int:
    """Wait until `expected` distinct devices are attached, or until `timeout_s` passed with
    no new one (from the start, then from the last to attach); return how many are.

    Counted from the last arrival, not from the start: `testbed up` starts its agents one
    after another, and the last of the 240 of topologies/large.yaml attached 78-95 s after the
    PS started on 2 cores, so a 60 s wait from the start ended with 149-155 of them (training
    then waited for the planner, and they all came in time; a quicker plan would have started
    step 0 without a third of its devices)."""
    deadline = time.monotonic() + timeout_s
    most = 0
    core = server.core
    assert core is not None
    while not stop.is_set() and time.monotonic() < deadline:
        if core.watchdog_reason is not None:
            raise WatchdogError(core.watchdog_reason)
        joined = _attached(server)
        if joined >= expected:
            return joined
        if joined > most:  # a new arrival: more may be on their way
            most, deadline = joined, time.monotonic() + timeout_s
        time.sleep(0.05)
    return _attached(server)


def _attached(server: PsServer) -> int:
    """Devices attached now: registrations with an open Work stream (a join whose caller gave
    up and joined again never attached, and the second join dropped it: PsCore._name_for)."""
    core = server.core
    assert core is not None
    return server.call(lambda: sum(c.outbox is not None for c in core.conns.values()))


def _plan_ahead(server: PsServer, trainer: Any, runlog: RunLog, before_step: int = 0
                ) -> None:
    """Make the plans of every offloaded linear for the devices present (StepPlanner.prepare):
    before the first step, and between steps when the devices present moved a group's count;
    in this thread and a planning process a further core: the loop thread keeps serving the
    devices meanwhile (nothing else plans between steps); a line every 10 s says how many
    shapes are planned. The ``planned`` event says before which step (``before_step``)."""
    from testbed.ps_backend.planning_processes import progress_line

    core = server.core
    assert core is not None
    started = time.monotonic()
    slots = server.call(lambda: list(core.scheduler.devices.values()))
    job = trainer.job
    tokens = job.batch_size * job.model.seq_len
    shapes = [(tokens, g.out_features, g.in_features) for g in trainer.model.gemm_layers()]
    cpu0 = core.planner.cpu_s

    def planning(done: int, total: int, wall_s: float) -> None:
        log.info("%s", progress_line(done, total, wall_s))
    planned = core.planner.prepare(shapes, trainer.dtype.itemsize, slots,
                                   workers=planning_workers(), progress=planning)
    wall_s = time.monotonic() - started
    cpu_s = core.planner.cpu_s - cpu0
    processes = core.planner.processes
    runlog.event("planned", before_step=before_step, shapes=planned,
                 wall_s=round(wall_s, 3), processes=processes,
                 cpu_s=round(cpu_s, 3), regions=core.planner.region_shapes())
    log.info("planned %d GEMM shape(s) in %.1f s (%.1f CPU s in %d process(es))", planned,
             wall_s, cpu_s, processes)


def run_ps(topology: Topology, run_dir: Path, listen: str, token: str, expected_devices: int,
           join_timeout_s: float, dilation: float, stop: threading.Event, resume: bool = False,
           checkpoint_every: int = 1, watchdog_s: float | None = None,
           trace_tiles: bool = False,
           links_follow: Callable[[float], None] | None = None,
           lan_listen: str | None = None) -> int:
    """Train the topology's job with devices; return the process exit code.

    With adaptive dilation (``time_dilation: {target_p95: ...}``) D = ``dilation`` is only
    where the probe starts; the probe's choice holds from the first step and the controller may
    change it between steps. Otherwise D holds for the whole run and fidelity is only reported.
    ``links_follow(D)``, when given, returns once what the PS does not shape itself (the
    kernel's links, the churn replay's clock) has moved to a new D (``link_dilation``).
    ``lan_listen``: where devices beyond loopback join, in place of ``network.ps.listen``.
    """
    job = topology.job
    adaptive = topology.time_dilation is None and topology.dilation_adaptive
    target = topology.dilation_target_p95
    fidelity = Fidelity(target)
    from testbed.ps_backend.engine.trainer import Trainer  # torch-heavy: import after args

    config = ps_config(topology, token=token, run_name=run_dir.name, time_dilation=dilation,
                       trace_tiles=trace_tiles,
                       no_progress_s=no_progress_s(job, watchdog_s), fd_limit=raise_fd_limit())
    trainer = Trainer(job, topology.seed, None)
    ledger = Ledger(run_dir / "ledger")
    losses: list[float] = []
    reusable, checkpoint = 0, None
    if resume:  # before the run log opens steps.jsonl, which this replaces
        losses, reusable, checkpoint = _restore(trainer, run_dir, ledger)
    runlog = RunLog(run_dir, strict=False)  # a full disk fails the run between steps
    if resume:
        runlog.event("ps_resume", checkpoint=str(checkpoint) if checkpoint else None,
                     next_step=trainer.next_step)
        runlog.event("ledger_load", from_step=trainer.next_step, tiles=reusable)
        log.info("resuming at step %d with %d journaled tile(s)", trainer.next_step, reusable)
    lan = lan_listen or topology.network.ps.listen  # devices beyond loopback: TLS, opted in
    # a resumed run keeps its certificate: the devices that joined it pin it
    tls = ((saved_identity(run_dir) if resume else None) or make_identity(run_dir, lan)) \
        if lan else None
    server = PsServer(config, runlog, listen, ledger=ledger, tls_listen=lan, tls=tls).start()
    executor = TileExecutor(server, interrupted=stop)  # a signal also ends a GEMM's wait
    status = StatusWriter(run_dir, server, runlog, job.steps)
    server.every_tick(status.tick)
    host = listen.rsplit(":", 1)[0]
    ps_json: dict[str, Any] = {"host": host, "port": server.port, "pid": os.getpid()}
    if lan and tls is not None:
        # the port bound; for 0.0.0.0 or [::], this machine's addresses (a device cannot dial
        # those: to it, they are itself)
        lan_addresses = [host_port(h, server.tls_port)
                         for h in join_hosts(parse_address(lan, listen=True)[0])]
        lan_address = lan_addresses[0]
        ps_json.update(lan_address=lan_address, lan_addresses=lan_addresses,
                       fingerprint=tls.fingerprint)
        log.info("devices beyond this host join over TLS at %s, certificate %s", lan_address,
                 tls.fingerprint)
    write_json_atomic(run_dir / "ps.json", ps_json)
    log.info("PS listening on %s:%d; waiting for %d device(s)", host, server.port,
             expected_devices)
    runlog.event("ps_start", address=f"{host}:{server.port}", expected_devices=expected_devices,
                 time_dilation=dilation, fd_limit=config.fd_limit,
                 max_connections=server.max_connections, no_progress_s=config.no_progress_s,
                 lan_address=ps_json.get("lan_address"), fingerprint=ps_json.get("fingerprint"))
    trainer.executor = executor

    def set_dilation(new: float) -> None:  # between steps: the devices, then the links
        server.call(functools.partial(server.core.set_dilation, new))  # type: ignore[union-attr]
        if links_follow is not None:
            links_follow(new)
    bound = BoundTotals()
    started = time.monotonic()
    state, code = "done", 0
    failure: str | None = None
    try:
        status.fields["state"] = "waiting for devices"
        joined = _wait_for_devices(server, expected_devices, join_timeout_s, stop)
        if adaptive and joined > 0 and not stop.is_set():
            status.fields["state"] = "probing time dilation"
            dilation, probe = run_probe(server, executor, job, joined, dilation, target,
                                        topology.seed)
            set_dilation(dilation)
            runlog.event("dilation_probe", chosen=round(dilation, 4), target_p95=target,
                         rounds=probe)
            log.info("probe: time dilation %.2f for a p95 tile error <= %.0f%% (%s)", dilation,
                     100 * target, probe)
        controller = DilationController(dilation, target) if adaptive else None
        if joined > 0 and not stop.is_set():
            status.fields["state"] = "planning"
            _plan_ahead(server, trainer, runlog)
        # counted again: devices may attach while the probe and the planner run
        runlog.event("training_start", devices=_attached(server),
                     expected_devices=expected_devices)
        status.fields["state"] = "training"
        records_written(runlog, "before training")
        stop.wait(0)  # a SIGTERM during the wait ends here
        if stop.is_set():
            raise InterruptedError
        while trainer.next_step < job.steps:
            step_start = time.monotonic()
            result = trainer.step()
            wall_s = time.monotonic() - step_start
            stats = server.call(server.core.take_step_stats)  # type: ignore[union-attr]
            planned_step = server.call(server.core.take_step_plan)  # type: ignore[union-attr]
            if not np.isfinite(result.loss):
                raise DivergedError(f"the loss of step {result.step} is {result.loss!r}: the "
                                    f"model diverged (check job.optimizer.lr)")
            losses.append(result.loss)
            device_time_s = wall_s / dilation  # D was constant during the step
            step_fidelity = fidelity.add(stats.tile_errors, stats.tile_lags_s, dilation,
                                         stats.late_s, device_time_s)
            bound.add(planned_step, device_time_s, stats.from_ledger)
            runlog.step(step=result.step, loss=result.loss, wall_s=round(wall_s, 6),
                        device_time_s=round(device_time_s, 6), **planned_step.fields(),
                        efficiency=efficiency(planned_step.bound_s, device_time_s),
                        tiles=stats.tiles,
                        recomputed_tiles=stats.recomputed, requeued_tiles=stats.requeued,
                        rejected=stats.rejected, late=stats.late, bytes_down=stats.bytes_down,
                        bytes_up=stats.bytes_up, gemms=result.gemms,
                        gemms_local=executor.local_gemms, max_lag_s=round(stats.lag_s_max, 6),
                        device_compute_s=round(stats.device_compute_s, 6),
                        energy_j=round(stats.energy_j, 6), failed_checks=stats.failed_checks,
                        backups=stats.backups, backup_wins=stats.backup_wins,
                        wasted=stats.wasted, tiles_from_ledger=stats.from_ledger,
                        time_dilation=round(dilation, 6), **step_fidelity)
            runlog.stages(result.step, planned_step.stages, dilation)
            records_written(runlog, f"after step {result.step}")
            if controller is not None:  # between steps: the only place D may change
                controller.observe(stats.tile_errors, step_fidelity["lateness_share"])
                # (after the last step a new D would only move the links for nothing)
                new = controller.between_steps() if trainer.next_step < job.steps else dilation
                if new != dilation:
                    runlog.event("dilation_change", step=result.step + 1, old=round(dilation, 4),
                                 new=round(new, 4), target_p95=target)
                    log.info("time dilation %.2f -> %.2f after step %d", dilation, new,
                             result.step)
                    dilation = new
                    set_dilation(new)
            server.call(ledger.sync)
            if trainer.next_step % checkpoint_every == 0 or trainer.next_step == job.steps:
                _save(trainer, run_dir, losses)
                server.call(lambda: ledger.compact(trainer.next_step))
            executor.local_gemms = 0
            status.fields.update(step=result.step + 1, loss=result.loss, losses=losses[-200:],
                                 time_dilation=round(dilation, 4), **step_fidelity,
                                 efficiency=efficiency(planned_step.bound_s, device_time_s),
                                 sat_out=planned_step.sat_out)
            log.info("step %d loss %.4f (%.2f s, %d tiles)", result.step, result.loss, wall_s,
                     stats.tiles)
            if stop.is_set():
                raise InterruptedError
            planner = server.core.planner  # type: ignore[union-attr]
            if trainer.next_step < job.steps and server.call(planner.needs_prepare):
                # the devices present moved a group's count (docs/planning.md, "Counts"): its
                # plans are made here, between steps and off the loop that serves the devices,
                # not at the next step's first GEMMs
                _plan_ahead(server, trainer, runlog, trainer.next_step)
    except InterruptedError:
        state, code = "interrupted", 1
        log.warning("interrupted; stopping devices")
    except (WatchdogError, DivergedError, RecordsError) as exc:
        state, code, failure = "failed", 1, str(exc)
        log.error("run failed: %s", exc)
        print(f"error: {exc}", file=sys.stderr)
        runlog.event("ps_failed", error=failure)
    except Exception as exc:
        state, code, failure = "failed", 1, failure_text(exc)
        log.exception("training failed")
        runlog.event("ps_failed", error=failure)
    finally:
        status.fields["state"] = state
        core = server.core
        assert core is not None
        try:
            server.call(lambda: status.tick(force=True))
        except OSError as exc:  # the summary below matters more than the live view
            log.error("could not write status.json: %s", exc)
        # the metrics and the step figures at one moment of the loop thread
        metrics, figures = server.call(lambda: (fault_metrics(core, status.cpu),
                                                core.summary_figures(state == "done")))
        summary = {
            "run": run_dir.name, "state": state, "error": failure, "steps_done": len(losses),
            "steps": job.steps, "final_loss": losses[-1] if losses else None,
            "losses": losses, "wall_s": round(time.monotonic() - started, 3),
            "time_dilation": dilation, **figures, **metrics, **bound.fields(),
            **fidelity.fields(),
            "planner": job.parallelism.planner,
            "planner_cpu_s": round(core.planner.cpu_s, 3),
            "devices": server.call(core.device_records) + core.departed_records()}
        # the step figures win over the metrics' run-wide counters of the same name (those
        # count the dilation probe's tiles and the results after the last step too)
        summary.update(figures)
        try:
            write_json_atomic(run_dir / "ps_summary.json", summary)
        except OSError as exc:
            # out of file descriptors or disk: close every connection, then try once more, so
            # that the steps really done are never lost from the record
            log.error("could not write ps_summary.json (%s); retrying after closing the server",
                      exc)
            server.stop("run " + state)
            write_json_atomic(run_dir / "ps_summary.json", summary)
        for warning in run_warnings(summary):
            log.warning(warning)
        runlog.event("ps_stop", state=state)
        server.stop("run " + state)
        ledger.close()
        runlog.close()
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.ps_backend",
                                description="The testbed parameter server process.")
    p.add_argument("--topology", required=True, help="topology YAML")
    p.add_argument("--run-dir", required=True, type=Path, help="existing run directory")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to bind (port 0: any)")
    p.add_argument("--steps", type=int, default=None, help="override job.steps")
    p.add_argument("--expect-devices", type=int, default=None,
                   help="devices to wait for before training (default: the topology's count)")
    p.add_argument("--join-timeout-s", type=float, default=60.0,
                   help="start training with the devices present once this long passed "
                   "with no new one attaching (from the start, then from the last arrival)")
    p.add_argument("--dilation", type=float, default=1.0, help="time dilation factor D >= 1")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for the PS's own work between GEMMs (attention, norms, "
                        "the loss, the optimizer), when no device has work; default 0: one per "
                        "core this process may run on")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its newest checkpoint and ledger")
    p.add_argument("--lan-listen", metavar="HOST:PORT",
                   help="where devices beyond loopback join over TLS, in place of the "
                        "topology's network.ps.listen (testbed up --resume gives the port the "
                        "run had, when the topology's is 0 and that port is free)")
    p.add_argument("--links-follow-dilation", action="store_true",
                   help="when D changes (adaptive dilation), ask the run's owner (testbed up) "
                        "to move the kernel's links and the churn clock to it, through "
                        "RUN_DIR/dilation.request.json, and wait for its answer")
    p.add_argument("--trace-tiles", action="store_true",
                   help="write RUN_DIR/tiles.jsonl: each accepted tile's times and bytes")
    p.add_argument("--checkpoint-every", type=int, default=1,
                   help="write a checkpoint every N steps (and after the last)")
    p.add_argument("--no-progress-s", type=float, default=None,
                   help="progress watchdog: fail the run (exit 1) when no device is attached, "
                        "or no tile is accepted, for this many seconds (default: "
                        f"job.watchdog.no_progress_s, else {NO_PROGRESS_S:g}; 0 = off)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ps %(levelname)s: %(message)s")
    try:
        topology = load_topology(args.topology)
    except TopologyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.steps is not None:
        problem = steps_problem(args.steps)
        if problem:
            print(f"error: --steps: {problem}", file=sys.stderr)
            return EXIT_BAD_INPUT
        topology = topology.with_overrides(steps=args.steps)
    token = os.environ.get("TESTBED_TOKEN", "")
    if not token:
        print("error: TESTBED_TOKEN is not set", file=sys.stderr)
        return EXIT_BAD_INPUT
    torch.set_num_threads(args.threads if args.threads > 0 else len(os.sched_getaffinity(0)))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(sig, lambda *_: stop.set())
    expected = args.expect_devices if args.expect_devices is not None else len(topology.devices)
    if args.checkpoint_every < 1:
        print("error: --checkpoint-every must be >= 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.no_progress_s is not None and not (0 <= args.no_progress_s < float("inf")):
        print("error: --no-progress-s must be a finite number >= 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.lan_listen is not None:
        try:
            parse_address(args.lan_listen, listen=True)
        except ValueError as exc:
            print(f"error: --lan-listen: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    return run_ps(topology, args.run_dir, args.listen, token, expected, args.join_timeout_s,
                  args.dilation, stop, resume=args.resume, checkpoint_every=args.checkpoint_every,
                  watchdog_s=args.no_progress_s, trace_tiles=args.trace_tiles,
                  links_follow=DilationRequester(args.run_dir) if args.links_follow_dilation
                  else None, lan_listen=args.lan_listen)
