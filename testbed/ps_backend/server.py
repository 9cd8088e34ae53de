"""The PS's gRPC side: device registry with leases, the Work streams, and the tile executor.

Threads: the gRPC server and all scheduling state live on one asyncio event loop (the "loop
thread"); the training engine runs in another thread and reaches the loop only through
:class:`TileExecutor` (``call_soon_threadsafe``) and ``concurrent.futures`` results. So the
:class:`~testbed.ps_backend.scheduler.Scheduler` needs no locks.

:class:`PsCore` holds the logic and is testable without a socket; :class:`ParameterServerServicer`
is the thin adapter that turns gRPC calls into PsCore calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import logging
import math
import resource
import secrets
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import grpc
import numpy as np
import torch

from testbed.emulator.dilation import tile_error
from testbed.ps_backend.accounting import StepStats
from testbed.ps_backend.executor import DoneHandle, GemmHandle, GemmSpec
from testbed.ps_backend.ledger import Ledger, gemm_digest
from testbed.ps_backend.scheduler import (
    Assignment,
    DeviceSlot,
    GemmJob,
    Outcome,
    Scheduler,
    Verdict,
)
from testbed.ps_backend.step_plan import StepPlanner, StepRecord
from testbed.ps_backend.tiler import gemm_flops
from testbed.ps_backend.tls import TlsIdentity
from testbed.ps_backend.validation import (
    MAX_PLATFORM_CHARS,
    MAX_TELEMETRY_KEYS,
    bounded_telemetry,
    clip_text,
    descriptor_problem,
    result_numbers_problem,
)
from testbed.runlog import RunLog
from testbed.topology import WatchdogSpec
from testbed.wire import testbed_pb2 as pb
from testbed.wire import testbed_pb2_grpc as pb_grpc
from testbed.wire.tensors import TensorError, from_tensor, to_tensor

log = logging.getLogger(__name__)

# -- limits against hostile or broken clients (docs/fault-tolerance.md, "Limits") -------------
FD_RESERVE = 256  # file descriptors kept back from gRPC for the PS's own files (checkpoints,
# ledger segments, run logs, torch): connections beyond the rest are closed as they arrive
MIN_CONNECTIONS = 64
HANDSHAKE_TIMEOUT_MS = 10_000  # a TCP connection that does not finish HTTP/2 setup is closed
CONNECTION_IDLE_MS = 60_000  # a connection with no RPC for this long is closed (GOAWAY)
MAX_STREAMS_PER_CONNECTION = 16  # an agent needs one Work stream plus a Join or Leave
JOINS_PER_S_PER_PEER = 100.0  # refill rate of each peer address's join bucket
JOIN_BURST_PER_PEER = 500.0  # bucket size: a loopback run's agents all join from 127.0.0.1
PEER_BUCKETS_MAX = 4096  # addresses remembered; beyond, one shared bucket for the rest
REFUSAL_EVENT_PERIOD_S = 1.0  # at most one join_refused event per reason in this period
DEPARTED_SHOWN = 10  # departed devices listed in status.json (the rest are counted)
DEPARTED_KEPT = 1000  # departed devices remembered for ps_summary.json
NO_PROGRESS_S = WatchdogSpec().no_progress_s  # no tile accepted / no device attached
ALL_QUARANTINED_GRACE_S = 10.0  # every attached device quarantined this long: the run fails


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    elif hard == resource.RLIM_INFINITY and soft != hard:
        soft = max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        except (ValueError, OSError):
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return int(soft)


def connection_cap(fd_limit: int) -> int:
    """Most TCP connections the PS accepts at once for a soft fd limit."""
    return max(MIN_CONNECTIONS, fd_limit - FD_RESERVE)


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string ("ipv4:127.0.0.1:5555" -> "ipv4:127.0.0.1")."""
    if peer.startswith("ipv6:["):
        return peer.split("]", 1)[0] + "]"
    head, sep, _ = peer.rpartition(":")
    return head if sep and head else peer


class JoinLimiter:
    """Token buckets per peer address, consulted before the token is even checked."""

    def __init__(self, rate_per_s: float = JOINS_PER_S_PER_PEER,
                 burst: float = JOIN_BURST_PER_PEER, max_peers: int = PEER_BUCKETS_MAX):
        self.rate_per_s, self.burst, self.max_peers = rate_per_s, burst, max_peers
        self._buckets: dict[str, tuple[float, float]] = {}  # peer -> (tokens, last time)

    def allow(self, peer: str, now_s: float | None = None) -> bool:
        """Whether a join from this peer address may proceed now (takes one token)."""
        now_s = time.monotonic() if now_s is None else now_s
        if peer not in self._buckets and len(self._buckets) >= self.max_peers:
            self._prune(now_s)
            if len(self._buckets) >= self.max_peers:
                peer = "*"  # too many addresses: the rest share one bucket
        tokens, last = self._buckets.get(peer, (self.burst, now_s))
        tokens = min(self.burst, tokens + (now_s - last) * self.rate_per_s)
        allowed = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if allowed else tokens, now_s)
        return allowed

    def _prune(self, now_s: float) -> None:
        full_after_s = self.burst / self.rate_per_s
        self._buckets = {p: (t, last) for p, (t, last) in self._buckets.items()
                         if now_s - last < full_after_s}


class RefusalLog:
    """Refused joins, counted by reason; an event at most once a period per reason.

    The client chooses what a refused join says about itself, so its name is cut short and
    logged only in these periodic summaries: events.jsonl grows by at most one line per reason
    per period, whatever the rate of refusals.
    """

    def __init__(self, emit: Callable[..., None], period_s: float = REFUSAL_EVENT_PERIOD_S):
        self.emit = emit
        self.period_s = period_s
        self.totals: dict[str, int] = {}
        self._unlogged: dict[str, int] = {}
        self._last_s: dict[str, float] = {}

    def note(self, reason: str, name: str, peer: str, now_s: float | None = None) -> None:
        """Count one refusal; emit an event if this reason's period has passed."""
        now_s = time.monotonic() if now_s is None else now_s
        self.totals[reason] = self.totals.get(reason, 0) + 1
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        if now_s - self._last_s.get(reason, -math.inf) >= self.period_s:
            self._last_s[reason] = now_s
            count = self._unlogged.pop(reason)
            self.emit("join_refused", reason=reason, device=clip_text(name, 64),
                      peer=clip_text(peer, 64), refusals=count)
            if count > 1 or self.totals[reason] == 1:
                log.warning("refused %d join(s): %s (last from %s)", count, reason,
                            clip_text(peer, 64))


@dataclass
class PsConfig:
    token: str
    run_name: str
    dtype: np.dtype
    tile_m: int
    tile_n: int
    min_offload_flops: float
    lease_s: float = 5.0
    heartbeat_s: float = 1.0
    max_message_bytes: int = 64 * 1024 * 1024
    time_dilation: float = 1.0
    check_values: bool = True  # Freivalds' check on every tile (job.validation.enabled)
    freivalds_vectors: int = 1  # random vectors per check (job.validation.freivalds_vectors)
    quarantine_after: int = 3  # failed checks before a device is quarantined; 0 = never
    speculate: bool = True  # backup copies of straggling tiles when devices sit idle
    planner: str = "auto"  # job.parallelism.planner: auto (tile planner) | fifo (fixed tiles)
    # per device group: (down_Bps, up_Bps, rtt_s) in device time, from the topology
    group_links: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    ps_link_Bps: tuple[float, float] = (float("inf"), float("inf"))  # PS (down, up)
    # the devices the topology names, as (group, count, gflops): plans are made for these so
    # a restarted PS cuts every GEMM the same way
    planned_groups: tuple[tuple[str, int, float], ...] = ()
    no_progress_s: float = NO_PROGRESS_S  # watchdog: 0 = off (job.watchdog.no_progress_s)
    fd_limit: int = 0  # soft RLIMIT_NOFILE the server runs with (0: read it at start)


@dataclass(eq=False)
class DeviceConn:
    """A joined device: its registry entry and, while attached, its outbound queue."""

    slot: DeviceSlot
    session_key: str
    descriptor: dict[str, Any]
    joined_s: float
    last_seen_s: float
    outbox: asyncio.Queue | None = None
    telemetry: dict[str, Any] = field(default_factory=dict)
    telemetry_dropped: int = 0  # telemetry entries refused (limits, non-finite values)
    end_reason: str = "stream broken"  # why its Work stream ended, for the departure event

    @property
    def device_id(self) -> str:
        return self.slot.device_id


@dataclass
class Recovery:
    """A departure (or quarantine) whose re-queued tiles are not all handed out again yet."""

    device: str
    kind: str
    started_s: float
    waiting: set[int]  # task ids not yet reassigned
    tiles: int


class PsCore:
    """Registry, leases and the scheduler, driven from the event loop thread only."""

    def __init__(self, config: PsConfig, runlog: RunLog | None = None,
                 ledger: Ledger | None = None):
        self.config = config
        self.runlog = runlog
        self.ledger = ledger
        self.scheduler = Scheduler(check_values=config.check_values,
                                   freivalds_vectors=config.freivalds_vectors,
                                   quarantine_after=config.quarantine_after,
                                   dilation=config.time_dilation, speculate=config.speculate)
        # quarantine is per session (device id), never per name: a name is only a label the
        # device chose, so anyone with the token could claim an honest device's (see docs)
        self.quarantined: dict[str, str] = {}  # device id -> name, every session quarantined
        self.recovering: list[Recovery] = []
        self.recovery_s: list[float] = []  # departure -> every re-queued tile handed out again
        self.conns: dict[str, DeviceConn] = {}
        # final records of devices that left: the newest DEPARTED_KEPT, the rest only counted
        self.departed: deque[dict[str, Any]] = deque(maxlen=DEPARTED_KEPT)
        self.departed_total = 0
        self.join_limiter = JoinLimiter()
        self.refusals = RefusalLog(self._event)
        self.telemetry_dropped = 0
        self.results_refused = 0  # results whose timing or energy was not a finite number
        # progress watchdog (docs/fault-tolerance.md): set once, read by the engine's thread
        now = time.monotonic()
        self.last_attached_s = now  # last moment some device had a Work stream open
        self.last_progress_s = now  # last accepted tile, or the moment work became outstanding
        self.all_quarantined_since: float | None = None
        self.watchdog_reason: str | None = None
        self.stats = StepStats()  # the step under way; finished steps are summed in _finished
        self._finished = StepStats()
        self._ids = itertools.count()
        self.stopping = False
        self.version = 0  # newest weight version seen; older cached blocks are invalid
        self.joined = asyncio.Event()  # set whenever a device joins
        self.planner = StepPlanner(config)  # plans GEMMs, records the step for its bound
        self._pump_due = False

    def _event(self, kind: str, /, **fields: Any) -> None:
        if self.runlog is not None:
            self.runlog.event(kind, **fields)

    # -- membership ----------------------------------------------------------------------------
    def check_token(self, token: str) -> bool:
        return hmac.compare_digest(token.encode(), self.config.token.encode())

    @staticmethod
    def descriptor_problem(device: pb.DeviceDescriptor) -> str | None:
        """None if a Join's descriptor is acceptable (every field bounded and finite)."""
        return descriptor_problem(device.name, device.group, device.kind, device.profile,
                                  device.predicted_gflops, device.max_in_flight,
                                  device.cache_bytes)

    def join(self, device: pb.DeviceDescriptor) -> DeviceConn:
        """Register a device (token and descriptor already checked)."""
        device_id = f"d{next(self._ids)}"
        slot = DeviceSlot(device_id=device_id, name=device.name or device_id,
                          predicted_gflops=device.predicted_gflops or 1.0,
                          max_in_flight=max(1, device.max_in_flight or 2),
                          cache_bytes=max(0, device.cache_bytes), group=device.group,
                          kind=device.kind or "real", profile=device.profile)
        now = time.monotonic()
        conn = DeviceConn(slot, secrets.token_hex(16),
                          {"name": slot.name, "group": device.group, "kind": slot.kind,
                           "profile": device.profile,
                           "platform": clip_text(device.platform, MAX_PLATFORM_CHARS),
                           "predicted_gflops": slot.predicted_gflops}, now, now)
        self.conns[device_id] = conn
        self.scheduler.add_device(slot)
        self.planner.saw(slot)
        self._event("join", device=slot.name, device_id=device_id, **conn.descriptor)
        self.joined.set()
        return conn

    def attach(self, device_id: str, session_key: str) -> DeviceConn | None:
        conn = self.conns.get(device_id)
        if conn is None or not hmac.compare_digest(conn.session_key, session_key):
            return None
        if conn.outbox is not None:
            return None  # one stream per device
        conn.outbox = asyncio.Queue()
        conn.last_seen_s = time.monotonic()
        self.pump()
        return conn

    def drop(self, device_id: str, kind: str, reason: str) -> int:
        """A device is gone (leave, broken stream, lease expiry): re-queue its tiles at once."""
        conn = self.conns.pop(device_id, None)
        if conn is None:
            return 0
        held = [c.task for c in conn.slot.in_flight.values()]
        cancelled = len(conn.slot.cancelled)  # losing copies it still held (nothing waits)
        requeued = self.scheduler.remove_device(device_id)
        backed_up = [t.task_id for t in held if not t.done and t.holders]
        done_elsewhere = [t.task_id for t in held if t.done]
        self.stats.requeued += len(requeued)
        if conn.outbox is not None:
            conn.outbox.put_nowait(None)
        self.departed.append(self._device_record(
            conn, state="quarantined" if conn.slot.quarantined else "left"))
        self.departed_total += 1
        self._event(kind, device=conn.slot.name, device_id=device_id, reason=reason,
                    in_flight=len(held), in_flight_tasks=[t.task_id for t in held],
                    done_elsewhere=len(done_elsewhere), backed_up=len(backed_up),
                    cancelled=cancelled,
                    requeued_tiles=len(requeued),
                    requeued=[{"task": t.task_id, "gemm": t.job.uid, "attempt": t.attempt}
                              for t in requeued])
        self._track_recovery(conn.slot.name, kind, [t.task_id for t in requeued])
        self.pump()
        return len(requeued)

    def _track_recovery(self, device: str, kind: str, task_ids: list[int]) -> None:
        if task_ids:
            self.recovering.append(Recovery(device, kind, time.monotonic(), set(task_ids),
                                            len(task_ids)))

    def _reassigned(self, task_ids: list[int]) -> None:
        """Tasks were handed out: close the recoveries they complete."""
        if not self.recovering:
            return
        now = time.monotonic()
        still = []
        for r in self.recovering:
            r.waiting.difference_update(task_ids)
            r.waiting = {t for t in r.waiting if t in self.scheduler.tasks}  # done elsewhere
            if r.waiting:
                still.append(r)
                continue
            seconds = now - r.started_s
            self.recovery_s.append(seconds)
            self._event("recovered", device=r.device, cause=r.kind, tiles=r.tiles,
                        recovery_s=round(seconds, 6))
        self.recovering = still

    def expire_leases(self, now_s: float | None = None) -> list[str]:
        """Drop every device not heard from within its lease."""
        now_s = time.monotonic() if now_s is None else now_s
        expired = [d for d, c in self.conns.items()
                   if now_s - c.last_seen_s > self.config.lease_s]
        for device_id in expired:
            self.drop(device_id, "lease_expired",
                      f"no message for more than {self.config.lease_s:g} s")
        return expired

    # -- work ----------------------------------------------------------------------------------
    def submit(self, job: GemmJob) -> None:
        """Queue a GEMM's tiles (called on the loop thread by the executor).

        Tiles the ledger recorded before a restart (same GEMM uid and operand digest) are placed
        at once and never sent to a device.
        """
        if job.version > self.version:
            self.invalidate(job.version)
        prefilled = self.ledger.take(job.uid, job.digest) if self.ledger is not None else {}
        tile_m, tile_n, k_parts, owners = self.planner.plan(job, self.scheduler.devices.values())
        served = self.scheduler.submit(job, tile_m, tile_n, prefilled, k_parts, owners)
        if served:
            self.stats.from_ledger += served
            self._event("ledger_reuse", gemm=job.uid, step=job.spec.step, tiles=served,
                        boxes=sorted(prefilled))
        self.pump()

    def tick(self) -> None:
        """Periodic work on the loop thread: leases, backups as time passes, ledger fsync."""
        self.expire_leases()
        self.pump()
        self.check_progress()
        if self.ledger is not None:
            self.ledger.maybe_sync()

    def check_progress(self, now_s: float | None = None) -> str | None:
        """The progress watchdog: set and return why the run cannot go on, else None.

        Fails when no device has been attached for ``no_progress_s``, when work is outstanding
        and no tile was accepted for ``no_progress_s``, or when every attached device has been
        quarantined for ``ALL_QUARANTINED_GRACE_S`` (while work is outstanding).
        """
        limit_s = self.config.no_progress_s
        if self.watchdog_reason is not None or limit_s <= 0 or self.stopping:
            return self.watchdog_reason
        now_s = time.monotonic() if now_s is None else now_s
        attached = [c for c in self.conns.values() if c.outbox is not None]
        if attached:
            self.last_attached_s = now_s
        outstanding = bool(self.scheduler.tasks)
        if not outstanding:
            self.last_progress_s = now_s
        trusted = [c for c in attached if not c.slot.quarantined]
        if attached and not trusted and outstanding:
            if self.all_quarantined_since is None:
                self.all_quarantined_since = now_s
        else:
            self.all_quarantined_since = None
        reason = None
        if not attached and now_s - self.last_attached_s > limit_s:
            reason = (f"no device attached for {now_s - self.last_attached_s:.0f} s "
                      f"(watchdog no_progress_s = {limit_s:g})")
        elif self.all_quarantined_since is not None and (
                now_s - self.all_quarantined_since > min(limit_s, ALL_QUARANTINED_GRACE_S)
                or now_s - self.last_progress_s > limit_s):
            reason = (f"every attached device is quarantined ({len(attached)}: "
                      f"{', '.join(sorted({c.slot.name for c in attached})[:5])}); "
                      f"no device may compute the {len(self.scheduler.tasks)} tiles left")
        elif outstanding and now_s - self.last_progress_s > limit_s:
            in_flight = sum(len(c.slot.in_flight) for c in attached)
            reason = (f"no tile accepted for {now_s - self.last_progress_s:.0f} s with "
                      f"{len(self.scheduler.tasks)} tiles outstanding ({in_flight} in flight on "
                      f"{len(attached)} attached devices; watchdog no_progress_s = {limit_s:g})")
        if reason is not None:
            self.watchdog_reason = reason
            self._event("watchdog", reason=reason)
            log.error("watchdog: %s", reason)
        return reason

    def invalidate(self, before_version: int) -> None:
        """Weights advanced: drop older cached blocks on every device and in the mirrors."""
        self.version = before_version
        self.scheduler.invalidate(before_version)
        message = pb.ServerMessage(invalidate=pb.Invalidate(before_version=before_version))
        for conn in self.conns.values():
            if conn.outbox is not None:
                conn.outbox.put_nowait(message)

    def pump(self) -> None:
        """Hand tiles to every attached device with room in its window, fastest first."""
        if self.stopping or not (self.scheduler.pending or self.scheduler.tasks):
            return
        ready = [c for c in self.conns.values() if c.outbox is not None and c.slot.free > 0]
        ready.sort(key=lambda c: -c.slot.rate_flops)
        for conn in ready:
            assignments = self.scheduler.assign(conn.device_id)
            if assignments and conn.outbox is not None:
                conn.outbox.put_nowait(self._tiles_message(conn, assignments))
                backups = sum(a.backup for a in assignments)
                self.stats.backups += backups
                self._reassigned([a.task.task_id for a in assignments])

    def pump_soon(self) -> None:
        """Pump once the messages already received have been handled, not after each one.

        Results that arrive together (from many devices, or a batch from one) free window
        slots together; one pump then fills each device's free slots in one message, and
        the device answers with one batch. Under load this is what makes messages carry
        several tiles: the PS's cost is mostly per message (bench/ps_throughput.py). Without
        a running event loop (unit tests drive the core directly) it pumps at once.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.pump()
            return
        if not self._pump_due:
            self._pump_due = True
            loop.call_soon(self._deferred_pump)

    def _deferred_pump(self) -> None:
        self._pump_due = False
        self.pump()

    def _tiles_message(self, conn: DeviceConn, assignments: list[Assignment]) -> pb.ServerMessage:
        message = pb.ServerMessage()
        sent = 0
        for a in assignments:
            task, job = a.task, a.task.job
            m, n = task.box.shape
            k0, k1 = task.k_range
            k = k1 - k0
            tile = message.tiles.add(task_id=task.task_id, attempt=task.attempt,
                                     step=job.spec.step, gemm=job.uid, op=job.spec.op,
                                     row=task.box.row, col=task.box.col, m=m, k=k, n=n,
                                     deadline_s=self.config.lease_s)
            for operand, key, block, send, keep in (
                    (tile.a, task.a_block_key, task.a_block, a.send_a, a.cache_a),
                    (tile.b, task.b_block_key, task.b_block, a.send_b, a.cache_b)):
                operand.key = key if keep else ""
                operand.version = job.version
                if send:
                    to_tensor(block(), operand.tensor)
                    sent += len(operand.tensor.data)
        self.stats.bytes_down += sent
        return message

    def on_message(self, conn: DeviceConn, msg: pb.DeviceMessage) -> None:
        """Handle one message from an attached device."""
        conn.last_seen_s = time.monotonic()
        body = msg.WhichOneof("body")
        if body == "result":
            self._on_result(conn, msg.result)
            self.pump_soon()
        elif body == "results":
            for result in msg.results.results:
                self._on_result(conn, result)
            self.pump_soon()
        elif body == "credit":
            self.scheduler.set_max_in_flight(conn.device_id, msg.credit.tiles)
            self.pump_soon()
        elif body == "telemetry":
            t = msg.telemetry
            if len(t.values) + len(t.labels) > 4 * MAX_TELEMETRY_KEYS:  # not worth reading
                dropped = len(t.values) + len(t.labels)
            else:
                dropped = bounded_telemetry(conn.telemetry, dict(t.values), dict(t.labels))
            conn.telemetry_dropped += dropped
            self.telemetry_dropped += dropped
        elif body == "attach":
            self._reject(conn, -1, "already attached: Attach is only the first message")

    def _reject(self, conn: DeviceConn, task_id: int, reason: str, attempt: int = -1,
                failed_check: bool = False) -> None:
        self.stats.rejected += 1
        self._event("reject", device=conn.slot.name, device_id=conn.device_id, task=task_id,
                    attempt=attempt, failed_check=failed_check, reason=reason)
        if conn.outbox is not None:
            conn.outbox.put_nowait(pb.ServerMessage(reject=pb.Reject(task_id=task_id,
                                                                     reason=reason)))

    def _on_result(self, conn: DeviceConn, result: pb.TileResult) -> None:
        size = len(result.c.data)
        self.stats.bytes_up += size
        problem = result_numbers_problem(result.compute_s, result.energy_j, result.lag_s,
                                         result.received_s, result.started_s, result.done_s)
        try:
            c = from_tensor(result.c)
        except TensorError as exc:
            problem = problem or f"bad tensor: {exc}"
        if problem is not None:
            self.results_refused += 1
            outcome = self.scheduler.refuse(conn.device_id, result.task_id, result.attempt,
                                            problem)
        else:
            outcome = self.scheduler.accept(conn.device_id, result.task_id, result.attempt, c,
                                            result.compute_s, result.energy_j)
        if outcome.verdict is Verdict.REJECTED:
            self._reject(conn, result.task_id, outcome.reason, result.attempt,
                         outcome.failed_check)
            self.stats.requeued += outcome.requeued
            self.stats.failed_checks += outcome.failed_check
            if outcome.quarantined is not None:
                self._quarantined(conn, outcome)
        elif outcome.verdict is Verdict.LATE:
            self.stats.late += 1
            if outcome.task is not None and outcome.task.done and outcome.checked:
                self.stats.wasted += 1
        else:
            self._accepted(conn, result, outcome, c)

    def _accepted(self, conn: DeviceConn, result: pb.TileResult, outcome: Outcome,
                  c: np.ndarray) -> None:
        task = outcome.task
        assert task is not None
        self.last_progress_s = time.monotonic()
        self.stats.tiles += 1
        self.stats.recomputed += result.attempt > 0
        self.stats.backup_wins += outcome.backup_won
        self.stats.lag_s_max = max(self.stats.lag_s_max, result.lag_s)
        self.stats.device_compute_s += result.compute_s
        self.stats.energy_j += result.energy_j
        if conn.slot.kind == "emulated" and result.compute_s > 0:
            dilation = self.config.time_dilation
            self.stats.tile_errors.append(tile_error(result.started_s, result.done_s,
                                                     result.compute_s, dilation))
            self.stats.tile_lags_s.append(result.done_s - result.started_s
                                          - result.compute_s * dilation)
        if self.ledger is not None:
            self.ledger.append(task.job.spec.step, task.job.uid, task.job.digest,
                               task.box.key, c, task.task_id,
                               result.attempt, conn.slot.name)
        if outcome.completed_job is not None:
            outcome.completed_job.done.set_result(outcome.completed_job.c)

    def _quarantined(self, conn: DeviceConn, outcome: Outcome) -> None:
        requeued = outcome.quarantined or []
        self.quarantined[conn.device_id] = conn.slot.name
        self.stats.requeued += len(requeued)
        self._event("quarantine", device=conn.slot.name, device_id=conn.device_id,
                    failed_checks=conn.slot.failed_checks, reason=outcome.reason,
                    requeued_tiles=len(requeued),
                    requeued=[{"task": t.task_id, "gemm": t.job.uid, "attempt": t.attempt}
                              for t in requeued])
        self._track_recovery(conn.slot.name, "quarantine", [t.task_id for t in requeued])

    # -- views ---------------------------------------------------------------------------------
    def _device_record(self, conn: DeviceConn, state: str) -> dict[str, Any]:
        s = conn.slot
        return {"device": s.name, "device_id": s.device_id, "group": s.group, "kind": s.kind,
                "profile": s.profile, "state": state, "tiles_done": s.tiles_done,
                "tiles_rejected": s.tiles_rejected, "failed_checks": s.failed_checks,
                "tiles_late": s.tiles_late, "backups_won": s.backups_won,
                "in_flight": sum(s.device_id in c.task.holders and not c.task.done
                                 for c in s.in_flight.values()),
                # every copy still on the device, losing copies too (their results get checked)
                "outstanding": [[c.task.task_id, c.attempt] for c in
                                itertools.chain(s.in_flight.values(), s.cancelled.values())],
                "window": s.window, "bytes_down": s.bytes_down, "bytes_up": s.bytes_up,
                "compute_s": round(s.compute_s, 6), "energy_j": round(s.energy_j, 6),
                "observed_gflops": round(s.rate_flops / 1e9, 3), "telemetry": dict(conn.telemetry),
                "telemetry_dropped": conn.telemetry_dropped}

    def device_records(self) -> list[dict[str, Any]]:
        """Current state of every joined device."""
        return [self._device_record(c, "quarantined" if c.slot.quarantined else
                                    "busy" if c.slot.in_flight else "idle")
                for c in self.conns.values()]

    def departed_records(self, last: int | None = None) -> list[dict[str, Any]]:
        """Final records of departed devices, the newest `last` (None: all that are kept)."""
        kept = list(self.departed)
        return kept if last is None else kept[-last:] if last > 0 else []

    def metrics(self) -> dict[str, Any]:
        """Fault-tolerance figures for status.json and summary.json (see docs)."""
        k = self.scheduler.counters
        rec = sorted(self.recovery_s)
        totals = self.totals
        return {
            "recovery_s": [round(x, 6) for x in self.recovery_s[-50:]],
            "recovery_p50_s": _quantile(rec, 0.5), "recovery_p95_s": _quantile(rec, 0.95),
            "recoveries": len(rec), "recovering": len(self.recovering),
            "recomputed_tiles": totals.recomputed, "backups": k.backups,
            "backup_wins": k.backup_wins, "wasted_tiles": k.wasted,
            "cancelled_copies": k.cancelled,
            "failed_checks": k.failed_checks, "checks": k.checks,
            "quarantined": sorted(set(self.quarantined.values())),
            "quarantined_sessions": sorted(self.quarantined),
            "departed_devices": self.departed_total,
            "join_refusals": dict(self.refusals.totals),
            "telemetry_dropped": self.telemetry_dropped,
            "results_refused": self.results_refused,
            "watchdog": self.watchdog_reason,
            "goodput": round(k.flops_accepted / k.flops_returned, 6) if k.flops_returned
            else None,
            "useful_gflop": round(k.flops_accepted / 1e9, 6),
            "validation_cpu_s": round(k.validation_cpu_s, 6),
            "validation_us_per_tile": round(1e6 * k.validation_cpu_s / k.checks, 3)
            if k.checks else None,
            "tiles_from_ledger": totals.from_ledger}

    def take_step_plan(self) -> StepRecord:
        """The step's bound, minimal traffic and sat-out groups; the next step starts."""
        return self.planner.take_step(self.scheduler.devices.values())

    def take_step_stats(self, count: bool = True) -> StepStats:
        """The figures of the step just finished; the next one starts. ``count=False``: they
        are not the run's (the dilation probe's GEMMs are no training)."""
        stats, self.stats = self.stats, StepStats()
        if count:
            self._finished.add(stats)
        return stats

    @property
    def totals(self) -> StepStats:
        """The run's figures so far: the finished steps and the one under way."""
        out = dataclasses.replace(self._finished, tile_errors=[], tile_lags_s=[])
        out.add(self.stats)
        return out

    def set_dilation(self, dilation: float) -> None:
        """Change D (between steps only): scheduler estimates, new joins, every attached device."""
        self.config.time_dilation = dilation
        self.scheduler.dilation = dilation
        for conn in self.conns.values():
            if conn.outbox is not None:
                conn.outbox.put_nowait(pb.ServerMessage(time_dilation=dilation))

    def stop_all(self, reason: str) -> None:
        """Tell every device to stop and close the streams."""
        self.stopping = True
        for conn in self.conns.values():
            if conn.outbox is not None:
                conn.outbox.put_nowait(pb.ServerMessage(stop=pb.Stop(reason=reason)))
                conn.outbox.put_nowait(None)


def _quantile(sorted_values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of sorted values; None when there are none."""
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return round(sorted_values[i], 6)


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    """Thin adapter: gRPC in, PsCore calls, gRPC out."""

    def __init__(self, core: PsCore):
        self.core = core

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext
                   ) -> pb.JoinReply:
        core = self.core
        peer = peer_host(context.peer() or "")
        if not core.join_limiter.allow(peer):  # before the token: costs an attacker the most
            core.refusals.note("too many joins from this address", request.device.name, peer)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many joins from {peer}: at most "
                                f"{JOINS_PER_S_PER_PEER:g} per second; try again later")
        if not core.check_token(request.token):
            core.refusals.note("wrong token", request.device.name, peer)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "wrong join token for this run")
        problem = core.descriptor_problem(request.device)
        if problem is not None:
            core.refusals.note("bad descriptor: " + problem.split(" ", 1)[0],
                               request.device.name, peer)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if core.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the run is ending")
        conn = core.join(request.device)
        cfg = self.core.config
        return pb.JoinReply(device_id=conn.device_id, session_key=conn.session_key,
                            lease_s=cfg.lease_s, heartbeat_s=cfg.heartbeat_s,
                            max_message_bytes=cfg.max_message_bytes,
                            time_dilation=cfg.time_dilation, run_name=cfg.run_name,
                            dtype=pb.FLOAT64 if cfg.dtype == np.float64 else pb.FLOAT32)

    async def Work(self, request_iterator: AsyncIterator[pb.DeviceMessage],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ServerMessage]:
        try:
            first = await request_iterator.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("body") != "attach":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the first message on Work must be Attach")
        conn = self.core.attach(first.attach.device_id, first.attach.session_key)
        if conn is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "unknown device id, wrong session key, or already attached; "
                                "join again")
        assert conn is not None and conn.outbox is not None
        reader = asyncio.ensure_future(self._read(conn, request_iterator))
        try:
            while True:
                message = await conn.outbox.get()
                if message is None:
                    break
                yield message
        finally:
            reader.cancel()
            if conn.device_id in self.core.conns and not self.core.stopping:
                self.core.drop(conn.device_id, "disconnect", conn.end_reason)

    async def _read(self, conn: DeviceConn, requests: AsyncIterator[pb.DeviceMessage]) -> None:
        try:
            async for message in requests:
                self.core.on_message(conn, message)
            conn.end_reason = "stream closed by the device"
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # a broken or oversized stream ends here
            conn.end_reason = f"stream broken: {exc}"
            log.info("stream of %s ended: %s", conn.slot.name, exc)
        finally:
            if conn.outbox is not None:
                conn.outbox.put_nowait(None)

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext
                    ) -> pb.LeaveReply:
        conn = self.core.conns.get(request.device_id)
        if conn is None or not hmac.compare_digest(conn.session_key, request.session_key):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "unknown device or key")
        n = self.core.drop(request.device_id, "leave", request.reason or "graceful leave")
        return pb.LeaveReply(requeued_tiles=n)


class PsServer:
    """The gRPC server on its own event-loop thread; start() returns once it listens."""

    def __init__(self, config: PsConfig, runlog: RunLog | None = None,
                 listen: str = "127.0.0.1:0", ledger: Ledger | None = None,
                 tls_listen: str | None = None, tls: TlsIdentity | None = None):
        self.config = config
        self.runlog = runlog
        self.ledger = ledger
        self.listen = listen
        # devices beyond loopback (network.ps.listen): a second port, TLS only
        self.tls_listen, self.tls = tls_listen, tls
        self.tls_port = 0
        self.loop = asyncio.new_event_loop()
        self.core: PsCore | None = None
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._thread = threading.Thread(target=self._run, name="ps-loop", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._periodic: list[Callable[[], None]] = []
        self.max_connections = 0

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._ready.set()
        if self._error is None:
            self.loop.run_forever()

    async def _start(self) -> None:
        try:
            self.core = PsCore(self.config, self.runlog, self.ledger)
            limit = self.config.max_message_bytes
            fd_limit = self.config.fd_limit or resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            self.max_connections = connection_cap(fd_limit)
            self._server = grpc.aio.server(options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", 1 << 30),
                ("grpc.so_reuseport", 0),
                # hostile clients (docs/fault-tolerance.md, "Limits"): connections beyond the
                # cap are closed as they arrive, so they never take the fds the PS's own files
                # need; a connection that never speaks HTTP/2, or sits without an RPC, is closed
                ("grpc.max_allowed_incoming_connections", self.max_connections),
                ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
                ("grpc.max_connection_idle_ms", CONNECTION_IDLE_MS),
                ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION)])
            pb_grpc.add_ParameterServerServicer_to_server(ParameterServerServicer(self.core),
                                                          self._server)
            self.port = self._server.add_insecure_port(self.listen)
            if self.port == 0:
                raise RuntimeError(f"cannot listen on {self.listen}")
            if self.tls_listen is not None and self.tls is not None:
                credentials = grpc.ssl_server_credentials([(self.tls.key_pem, self.tls.cert_pem)])
                self.tls_port = self._server.add_secure_port(self.tls_listen, credentials)
                if self.tls_port == 0:
                    raise RuntimeError(f"cannot listen on {self.tls_listen} "
                                       "(network.ps.listen): address not on this host, or port "
                                       "taken")
            await self._server.start()
            self.loop.create_task(self._watch_leases())
        except BaseException as exc:
            self._error = exc

    async def _watch_leases(self) -> None:
        assert self.core is not None
        while True:
            await asyncio.sleep(min(0.25, self.config.lease_s / 4))
            self.core.tick()
            for fn in self._periodic:
                fn()

    def every_tick(self, fn: Callable[[], None]) -> None:
        """Run fn on the loop thread about every 0.25 s (status snapshots)."""
        self.loop.call_soon_threadsafe(self._periodic.append, fn)

    def start(self) -> PsServer:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the loop thread and return its result (from any other thread)."""
        async def wrapper() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result()

    def stop(self, reason: str = "run finished", grace_s: float = 2.0) -> None:
        """Tell devices to stop, then shut the server down with a grace period."""
        if not self._thread.is_alive():
            return
        core = self.core
        if core is not None:
            self.call(lambda: core.stop_all(reason))
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=grace_s + 5)


def tensor_name(t: torch.Tensor) -> str:
    """A name for a tensor's storage within a step (a transpose or a reshape keeps it)."""
    return f"{t.untyped_storage().data_ptr()}:{t.untyped_storage().nbytes()}"


class WatchdogError(RuntimeError):
    """The progress watchdog ended the run; the message says which condition."""


class DivergedError(RuntimeError):
    """The model's tensors are no longer finite (for example ``lr: .inf``)."""


class TileHandle:
    """A GEMM in flight on devices; result() blocks until every tile is placed."""

    def __init__(self, job: GemmJob, interrupted: threading.Event,
                 core: PsCore | None = None):
        self.job = job
        self.interrupted = interrupted
        self.core = core

    def result(self) -> torch.Tensor:
        while True:
            if self.interrupted.is_set():
                raise InterruptedError("the run was stopped")
            if self.core is not None and self.core.watchdog_reason is not None:
                raise WatchdogError(self.core.watchdog_reason)
            try:
                c = self.job.done.result(timeout=0.2)
                return torch.from_numpy(c)
            except TimeoutError:
                continue


class OperandKeys:
    """Cache keys and PS copies of GEMM operands by tensor identity within a step.

    Two GEMMs whose operand is the same tensor (X of the q/k/v projections, X in forward and in
    the weight gradient) get the same key, so a block a device received for one is a cache hit
    for the other, and they share the PS's copy. A tensor is identified by its storage address,
    offset, shape and strides (a transpose is another view, so another key: the device uses the
    block as it arrives) and its version counter (an in-place change makes a new key). An
    address is reused only after its tensor is freed, so the key stays only while a weak
    reference to the tensor's root (the base of a view) is alive; a freed root's address gets a
    fresh key. Keys end with the step (the weights' version), and the table is emptied when the
    step changes.

    Each fresh copy is checked for finiteness once (shared copies are not checked again): a
    non-finite operand raises :class:`DivergedError`, since every honest device's result would
    be refused for the PS's own divergence and the GEMM would never finish.
    """

    def __init__(self) -> None:
        self._keys: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], str,
                                                  weakref.ref[np.ndarray]]] = {}
        self._serial = itertools.count()
        self._step = -1

    def get(self, t: torch.Tensor, step: int) -> tuple[str, np.ndarray]:
        """(key, the PS's own C-ordered copy) of an operand of a GEMM of this step."""
        if step != self._step:
            self._keys.clear()
            self._step = step
        root = t._base if t._base is not None else t
        ident = (t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
                 t._version)
        entry = self._keys.get(ident)
        if entry is not None and entry[0]() is root:
            copy = entry[2]()
            if copy is not None:
                return entry[1], copy
            key = entry[1]
        else:
            key = f"t{next(self._serial)}@{step}"
        # Own copies: the engine may change its tensors in place once the GEMM is done (the
        # optimizer steps the weights), and late copies of tiles are still checked against them.
        copy = np.array(t.detach().numpy(), order="C", copy=True)
        if not np.isfinite(copy).all():
            raise DivergedError(f"an operand of a step-{step} GEMM ({tuple(t.shape)}) has "
                                f"non-finite values (NaN or Inf): the model diverged (check "
                                f"job.optimizer.lr)")
        self._keys[ident] = (weakref.ref(root), key, weakref.ref(copy))
        return key, copy


class TileExecutor:
    """The executor the engine uses in a real run: big GEMMs become tiles, small ones stay here."""

    def __init__(self, server: PsServer, interrupted: threading.Event | None = None):
        self.server = server
        self.config = server.config
        self._uids = itertools.count()
        self.interrupted = interrupted or threading.Event()
        self.local_gemms = 0
        self.offloaded_gemms = 0
        self._step = -1  # GEMM uids count from 0 in every step, so a restart names them alike
        self._operands = OperandKeys()

    def submit(self, a: torch.Tensor, b: torch.Tensor, spec: GemmSpec) -> GemmHandle:
        m, k = a.shape
        n = b.shape[1]
        if spec.step != self._step:
            self._step, self._uids = spec.step, itertools.count()
        seq = next(self._uids)
        if gemm_flops(m, k, n) < self.config.min_offload_flops:
            self.local_gemms += 1
            return DoneHandle(a @ b)
        self.offloaded_gemms += 1
        a_key, a_np = self._operands.get(a, spec.step)
        b_ident_key, b_np = self._operands.get(b, spec.step)
        uid = f"s{spec.step}/{spec.layer}/{spec.op}#{seq}"
        job = GemmJob(uid=uid, spec=spec, a=a_np, b=b_np,
                      a_name=tensor_name(a), b_name=tensor_name(b),
                      c=np.empty((m, n), dtype=a_np.dtype), version=spec.step,
                      a_key=a_key, b_key=spec.b_key or b_ident_key, done=Future(),
                      digest=gemm_digest(a_np, b_np) if self.server.ledger is not None else "")
        core = self.server.core
        assert core is not None
        self.server.loop.call_soon_threadsafe(core.submit, job)
        return TileHandle(job, self.interrupted, core)
