"""The PS's domain core: registry with leases, outboxes, the result path and the step's accounts.

:class:`PsCore` is plain logic driven from one thread (the server host's event loop, see
:mod:`testbed.ps_backend.host`), with no protobuf types: the gRPC service
(:mod:`testbed.ps_backend.service`) turns each message into the plain dataclasses below at its
edge (:class:`Descriptor`, :class:`ResultIn`) and turns what the core queues for a device
(:class:`Outgoing`) back into messages. So the core is tested without a socket, and the
placement policy stays in the :class:`~testbed.ps_backend.scheduler.Scheduler` and the planner
(:mod:`testbed.ps_backend.step_plan`); the core checks, places and accounts.

The simulator (:mod:`testbed.simulate.sim`) mirrors the core's few lines of glue around the
scheduler (pump, submit, result, drop); a change here that changes what a device is given or
what a result does belongs there too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import logging
import math
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from testbed.agent.link import MESSAGE_OVERHEAD_BYTES
from testbed.emulator.dilation import DeviceTimeline, tile_error
from testbed.ps_backend.accounting import StepStats, after_last_step, run_figures
from testbed.ps_backend.admission import REFUSAL_EVENT_PERIOD_S, JoinLimiter, RefusalLog
from testbed.ps_backend.ledger import Ledger
from testbed.ps_backend.scheduler import (
    PLANNED_WINDOW_SCALE,
    WINDOW_SCALE,
    Assignment,
    DeviceSlot,
    GemmJob,
    Outcome,
    Scheduler,
    Verdict,
    message_runs,
)
from testbed.ps_backend.step_plan import StepPlanner, StepRecord
from testbed.ps_backend.validation import (
    MAX_NAME_CHARS,
    MAX_PLATFORM_CHARS,
    MAX_TELEMETRY_KEYS,
    bounded_telemetry,
    clip_text,
    descriptor_problem,
    result_numbers_problem,
)
from testbed.ps_backend.watchdog import ProgressWatchdog
from testbed.runlog import RunLog
from testbed.topology import WatchdogSpec

log = logging.getLogger(__name__)

REJECT_EVENTS_LOGGED = 100  # a device's rejects other than failed checks logged one by one
MAX_QUEUED_REJECTS = 1024  # no Reject is queued to an outbox holding this many unread
DEPARTED_SHOWN = 10  # departed devices listed in status.json (the rest are counted)
DEPARTED_KEPT = 1000  # departed devices remembered for ps_summary.json
# why a device's Work stream ended when the device closed it without a Leave: a killed agent
# (its kernel closes the socket) or one gone silent that closes it later; testbed simulate
# gives its crashes this reason, as both `testbed up` backends record them
STREAM_CLOSED = "stream closed by the device"
NO_PROGRESS_S = WatchdogSpec().no_progress_s  # no tile accepted / no device attached
PAUSE_TICKS = 8  # a gap of this many ticks between two: the PS was not running (PsConfig.pause_s)


# -- what crosses the service's edge, as plain data (the .proto documents every field) ----------
@dataclass(frozen=True)
class Descriptor:
    """What a joining device says about itself (the Join request's descriptor)."""

    name: str
    group: str
    kind: str
    profile: str
    predicted_gflops: float
    max_in_flight: int
    cache_bytes: int
    platform: str
    keeps_held: bool = False  # its cache evicts held blocks last (testbed/wire/cache.py)
    instance: str = ""  # random per agent process: the same process joining again (PsCore.join)


@dataclass(frozen=True)
class ResultIn:
    """One computed tile from a device; ``c`` is None when its tensor did not decode."""

    task_id: int
    attempt: int
    c: np.ndarray | None
    nbytes: int  # bytes of the result tensor as it travelled
    compute_s: float
    energy_j: float
    lag_s: float
    received_s: float
    started_s: float
    done_s: float
    tensor_problem: str = ""  # why ``c`` is None


@dataclass(frozen=True)
class OperandOut:
    """One operand block of a tile: its data, or None when the device caches ``key``; or, with
    ``parts``, those blocks joined along the tile's contraction."""

    key: str  # "" = the device must not cache it
    version: int
    block: np.ndarray | None  # in the stored orientation (as cached)
    transposed: bool  # the tile uses the block transposed
    parts: tuple["OperandOut", ...] = ()
    held: bool = False  # the device's cache keeps it over blocks not held (Assignment.held)


@dataclass(frozen=True)
class TileOut:
    """A tile handed to a device: compute ``a @ b``."""

    task_id: int
    attempt: int
    step: int
    gemm: str
    op: str
    row: int
    col: int
    m: int
    k: int
    n: int
    a: OperandOut
    b: OperandOut
    deadline_s: float


@dataclass(frozen=True)
class Outgoing:
    """One message the core queues for a device (the service sends it as a ServerMessage)."""

    tiles: list[TileOut] = field(default_factory=list)
    invalidate_before: int | None = None  # drop cached blocks of older versions
    reject: tuple[int, str] | None = None  # (task id or -1, reason)
    stop: str | None = None  # the reason the device must stop
    time_dilation: float = 0.0  # the new D (0: unchanged)


@dataclass
class PsConfig:
    """How the PS runs: the job's facts the core, the service and the host need."""

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
    # per device group: (down_Bps, up_Bps, rtt_s) in device time, from the topology: what its
    # own path carries (the bound's), and that capped at its fair share of the switch links it
    # shares with other devices (the planner's; config.plan_inputs). No plan_links: group_links.
    group_links: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    plan_links: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    # per group, the switch links above it that only some devices sit below (config.shared_paths):
    # the planner takes its share of them again for the devices a step's plans count on
    fair_share_paths: dict[str, tuple[str, ...]] = field(default_factory=dict)
    ps_link_Bps: tuple[float, float] = (float("inf"), float("inf"))  # PS (down, up)
    # per group, the uplink one device gets while every device sends (config.fair_shares_Bps
    # with the PS link): what an emulated device's results are judged against (DeviceTimeline)
    busy_up_Bps: dict[str, float] = field(default_factory=dict)
    # per group, the links it shares with others on the way from the PS (switch links by their
    # lower switch, then "ps"), and each one's down_Bps (config.plan_inputs): stealing and
    # backups count what a block waits behind on them
    group_paths: dict[str, tuple[str, ...]] = field(default_factory=dict)
    shared_down_Bps: dict[str, float] = field(default_factory=dict)
    # switch link (by its lower switch) -> (down_Bps, up_Bps, the next one up or ""): the
    # devices below one move together no more than it carries (the bound's; config.plan_inputs)
    switch_links: dict[str, tuple[float, float, str]] = field(default_factory=dict)
    # the devices the topology names, as (group, count, gflops): plans are made for as many of
    # these as are present (step_plan.planned_count), so a restarted PS with the same devices
    # cuts every GEMM the same way
    planned_groups: tuple[tuple[str, int, float], ...] = ()
    no_progress_s: float = NO_PROGRESS_S  # watchdog: 0 = off (job.watchdog.no_progress_s)
    fd_limit: int = 0  # soft RLIMIT_NOFILE the server runs with (0: read it at start)
    trace_tiles: bool = False  # tiles.jsonl: each accepted tile's times (PsCore._accepted)

    @property
    def window_scale(self) -> float:
        """A median-speed device's window: deeper when the planner's tiles have owners."""
        return PLANNED_WINDOW_SCALE if self.planner == "auto" else WINDOW_SCALE

    @property
    def tick_s(self) -> float:
        """Seconds between two :meth:`PsCore.tick` calls (the host's lease watcher's period)."""
        return min(0.25, self.lease_s / 4)

    @property
    def pause_s(self) -> float:
        """A gap between ticks longer than this means the PS itself did not run (stopped with
        Ctrl-Z or SIGSTOP, a suspended laptop, starved of CPU): :meth:`PsCore.tick` moves the
        clocks it judges devices by forward by the gap. ``PAUSE_TICKS`` ticks, and at most
        half a lease, so that no lease expires for a pause that short."""
        return min(PAUSE_TICKS * self.tick_s, self.lease_s / 2)


@dataclass(eq=False)
class DeviceConn:
    """A joined device: its registry entry and, while attached, its outbound queue."""

    slot: DeviceSlot
    session_key: str
    descriptor: dict[str, Any]
    joined_s: float
    last_seen_s: float
    outbox: asyncio.Queue[Outgoing | None] | None = None
    instance: str = ""  # the agent process's (Descriptor.instance); never logged
    telemetry: dict[str, Any] = field(default_factory=dict)
    telemetry_dropped: int = 0  # telemetry entries refused (limits, non-finite values)
    end_reason: str = "stream broken"  # why its Work stream ended, for the departure event
    # an emulated device of a topology group: its starts and uplink against the model
    timeline: DeviceTimeline | None = None
    # its rejects other than failed checks: logged one by one, then summarised (PsCore._reject)
    rejects_logged: int = 0
    rejects_unlogged: int = 0
    rejects_summarised_s: float = -math.inf

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
                                   dilation=config.time_dilation, speculate=config.speculate,
                                   window_scale=config.window_scale)
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
        # called on the PS's loop thread with each accepted result (conn, result, arrived_s),
        # after the PS has counted it: what benches and tests watch instead of wrapping methods
        self.accepted_observers: list[Callable[[DeviceConn, ResultIn, float], None]] = []
        # progress watchdog (docs/fault-tolerance.md): its reason is set once, read by the
        # engine's thread; a device counts as attached while its Work stream is open
        self.watchdog = ProgressWatchdog.starting(config.no_progress_s, time.monotonic())
        self.last_tick_s: float | None = None  # the previous tick (a pause shows as a gap)
        self.paused_s = 0.0  # seconds the PS was found not running, in total (ps_paused events)
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
    def descriptor_problem(device: Descriptor) -> str | None:
        """None if a Join's descriptor is acceptable (every field bounded and finite)."""
        return descriptor_problem(device.name, device.group, device.kind, device.profile,
                                  device.predicted_gflops, device.max_in_flight,
                                  device.cache_bytes, device.instance)

    def join(self, device: Descriptor) -> DeviceConn:
        """Register a device (token and descriptor already checked)."""
        device_id = f"d{next(self._ids)}"
        name = self._name_for(device.name or device_id, device.instance)
        slot = DeviceSlot(device_id=device_id, name=name,
                          predicted_gflops=device.predicted_gflops or 1.0,
                          max_in_flight=max(1, device.max_in_flight or 2),
                          cache_bytes=max(0, device.cache_bytes), group=device.group,
                          kind=device.kind or "real", profile=device.profile,
                          keeps_held=device.keeps_held)
        now = time.monotonic()
        conn = DeviceConn(slot, secrets.token_hex(16),
                          {"name": slot.name, "group": device.group, "kind": slot.kind,
                           "profile": device.profile,
                           "platform": clip_text(device.platform, MAX_PLATFORM_CHARS),
                           "predicted_gflops": slot.predicted_gflops}, now, now,
                          instance=device.instance)
        conn.timeline = self._timeline(slot)
        self.conns[device_id] = conn
        # the scheduler and the planner count it once it attaches (attach): a token holder's
        # joins that never open a stream were planned tiles, and every one stalled the honest
        # devices until its lease expired
        asked = {} if name == device.name else {"asked_name": device.name}
        self._event("join", device=slot.name, device_id=device_id, **conn.descriptor, **asked)
        self.joined.set()
        return conn

    def _name_for(self, asked: str, instance: str) -> str:
        """The name a joining device goes by: the one it asked for, unless a registered device
        goes by it. Every record of the run is by name, so two devices must not share one.

        The same agent process joining again (same ``instance``) takes its name back: its old
        session is over on its side (the agent joins again only then), so that registration
        is dropped now, its tiles re-queued, instead of at its lease's end. Another device
        asking a taken name (machines that share a host name, `testbed join`'s default) gets
        the lowest free ``asked-N``, N >= 2, cut to :data:`MAX_NAME_CHARS`."""
        holder = next((c for c in self.conns.values() if c.slot.name == asked), None)
        if holder is None:
            return asked
        if instance and hmac.compare_digest(holder.instance, instance):
            self.drop(holder.device_id, "leave", "the same device joined again")
            return asked
        taken = {c.slot.name for c in self.conns.values()}
        numbered = (f"{asked[:MAX_NAME_CHARS - len(str(n)) - 1]}-{n}" for n in itertools.count(2))
        return next(name for name in numbered if name not in taken)

    def _timeline(self, slot: DeviceSlot) -> DeviceTimeline | None:
        """An emulated device's :class:`DeviceTimeline`, or None (a real device, or a group the
        topology does not name): its uplink judged at its share while every device sends
        (``busy_up_Bps``), its path's one-way delay."""
        up_Bps = self.config.busy_up_Bps.get(slot.group, 0.0)
        links = self.config.plan_links or self.config.group_links
        if slot.kind != "emulated" or slot.group not in links or not 0 < up_Bps < math.inf:
            return None
        return DeviceTimeline(up_Bps, links[slot.group][2] / 2)

    def attach(self, device_id: str, session_key: str) -> DeviceConn | None:
        conn = self.conns.get(device_id)
        if conn is None or not hmac.compare_digest(conn.session_key, session_key):
            return None
        if conn.outbox is not None:
            return None  # one stream per device
        conn.outbox = asyncio.Queue()
        conn.last_seen_s = time.monotonic()
        self.scheduler.add_device(conn.slot)
        self.planner.saw(conn.slot)
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
        final = self._device_record(conn,
                                    state="quarantined" if conn.slot.quarantined else "left")
        self.departed.append(final)
        if self.runlog is not None:  # the session's last devices.jsonl record (no sample follows)
            self.runlog.device(**final)
        self.departed_total += 1
        self.watchdog.departed(time.monotonic(), conn.slot.name, kind, reason)
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

    def leave(self, device_id: str, session_key: str, reason: str) -> int | None:
        """A graceful leave: the tiles re-queued, or None for an unknown device or wrong key."""
        conn = self.conns.get(device_id)
        if conn is None or not hmac.compare_digest(conn.session_key, session_key):
            return None
        return self.drop(device_id, "leave", reason or "graceful leave")

    def expire_leases(self, now_s: float | None = None) -> list[str]:
        """Drop every device not heard from within its lease: ``lease_s`` of device time, so
        ``lease_s`` x D of wall time under a time dilation D, as every emulated duration is
        stretched (the churn trace's times too: a 3 s cut at D 4 lasts 12 s of wall time, and
        a wall-clock lease dropped the device 1.25 s of device time into it, where `testbed
        simulate` and the baselines keep it)."""
        now_s = time.monotonic() if now_s is None else now_s
        lease_wall_s = self.config.lease_s * max(1.0, self.config.time_dilation)
        expired = [d for d, c in self.conns.items() if now_s - c.last_seen_s > lease_wall_s]
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
        cut = self.planner.plan(job, self.scheduler.devices.values())
        served = self.scheduler.submit(job, cut.regions, prefilled, cut.owners, cut.held)
        if served:
            self.stats.from_ledger += served
            self._event("ledger_reuse", gemm=job.uid, step=job.spec.step, tiles=served,
                        boxes=sorted(prefilled))
        self.pump()

    def _journal_failed(self, exc: OSError) -> None:
        """The ledger could not be written (a full disk): journal no more (a record after a
        torn one would be lost to the reader anyway) and let the run's records carry the error,
        which the PS's main loop fails the run on between steps."""
        log.error("the tile journal failed (%s); journaling stops", exc)
        self.ledger = None
        if self.runlog is not None:
            self.runlog.note_write_error(exc)

    def tick(self, now_s: float | None = None) -> None:
        """Periodic work on the loop thread: leases, backups as time passes, ledger fsync.
        ``now_s``: monotonic seconds (default: now)."""
        now_s = time.monotonic() if now_s is None else now_s
        self.account_pause(now_s)
        self.expire_leases(now_s)
        self.pump()
        self.check_progress(now_s)
        if self.ledger is not None:
            try:
                self.ledger.maybe_sync()
            except OSError as exc:
                self._journal_failed(exc)

    def account_pause(self, now_s: float) -> float:
        """Before leases and progress are judged: when the previous tick is more than
        ``config.pause_s`` ago, the PS itself was not running (Ctrl-Z, SIGSTOP, a suspended
        host, no CPU for it), and no device could be heard meanwhile. Every device's last-seen
        time and the watchdog's clocks move forward by the time lost (the gap less one tick),
        never past now, as do the copies out (:meth:`Scheduler.account_pause`), and a
        ``ps_paused`` event says how long it was. Return that time (0:
        no pause).

        Without this, a run stopped with Ctrl-Z for longer than a lease dropped every device on
        ``fg`` (lease_expired), and one stopped longer than ``no_progress_s`` then failed with
        "no device attached for 125 s": the PS blamed the devices for its own pause."""
        last, self.last_tick_s = self.last_tick_s, now_s
        if last is None or now_s - last <= self.config.pause_s:
            return 0.0
        lost_s = now_s - last - self.config.tick_s
        for conn in self.conns.values():
            conn.last_seen_s = min(conn.last_seen_s + lost_s, now_s)
        self.watchdog.paused(lost_s, now_s)
        for r in self.recovering:  # recovery_s counts the PS's time, not its pause
            r.started_s = min(r.started_s + lost_s, now_s)
        self.scheduler.account_pause(lost_s, now_s)  # the copies out, their returns and backups
        self.paused_s += lost_s
        self._event("ps_paused", seconds=round(lost_s, 3), devices=len(self.conns))
        log.warning("the PS did not run for %.1f s (stopped, suspended or starved); device "
                    "leases and the progress watchdog do not count it", lost_s)
        return lost_s

    @property
    def watchdog_reason(self) -> str | None:
        """Why the progress watchdog ended the run, once it has (else None)."""
        return self.watchdog.reason

    def check_progress(self, now_s: float | None = None) -> str | None:
        """The progress watchdog (:class:`ProgressWatchdog`): set and return why the run
        cannot go on, else None. Not while the PS stops."""
        if self.watchdog.reason is not None or self.stopping:
            return self.watchdog.reason
        now_s = time.monotonic() if now_s is None else now_s
        attached = [c for c in self.conns.values() if c.outbox is not None]
        reason = self.watchdog.check(
            now_s, len(attached), sum(c.slot.quarantined for c in attached),
            len(self.scheduler.tasks), lambda: [c.slot.name for c in attached],
            lambda: sum(len(c.slot.in_flight) for c in attached))
        if reason is not None:
            self._event("watchdog", reason=reason)
            log.error("watchdog: %s", reason)
        return reason

    def invalidate(self, before_version: int) -> None:
        """Weights advanced: drop older cached blocks on every device and in the mirrors."""
        self.version = before_version
        self.scheduler.invalidate(before_version)
        message = Outgoing(invalidate_before=before_version)
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
                for run in message_runs(assignments, conn.slot.down_Bps):
                    conn.outbox.put_nowait(self._tiles_message(conn, run))
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

    def _tiles_message(self, conn: DeviceConn, assignments: list[Assignment]) -> Outgoing:
        tiles = []
        sent = 0
        for a in assignments:
            task, job = a.task, a.task.job
            m, n = task.box.shape
            k0, k1 = task.k_range
            half = len(task.pieces)  # task.blocks: A's parts, then B's
            operands = []
            for side, transposed, of in ((task.a_piece, job.a_transposed, slice(0, half)),
                                         (task.b_piece, job.b_transposed, slice(half, None))):
                parts = []
                for piece, (key, _), send, keep in zip(task.pieces, task.blocks[of], a.send[of],
                                                        a.keep[of]):
                    data = None
                    if send:  # a block travels as its tensor is stored, as its key names it
                        data = side(piece).T if transposed else side(piece)
                        sent += data.nbytes
                    parts.append(OperandOut(key if keep else "", job.version, data, transposed,
                                            held=a.held and keep))
                operands.append(parts[0] if len(parts) == 1 else
                                OperandOut("", job.version, None, False, tuple(parts)))
            tiles.append(TileOut(task.task_id, task.attempt, job.spec.step, job.uid, job.spec.op,
                                 task.box.row, task.box.col, m, k1 - k0, n, operands[0],
                                 operands[1], self.config.lease_s))
        self.stats.bytes_down += sent
        return Outgoing(tiles=tiles)

    # -- messages from an attached device (each one also counts as a sign of life) ------------
    def seen(self, conn: DeviceConn) -> None:
        """The device sent something (a heartbeat, or any other message): its lease renews."""
        conn.last_seen_s = time.monotonic()

    def on_results(self, conn: DeviceConn, results: Sequence[ResultIn]) -> None:
        """One message's computed tiles, handled in order."""
        if self.conns.get(conn.device_id) is not conn:
            # its session ended (it left, its lease expired) and its tiles went back to the
            # queue; a stream's last results can still follow its Leave: late, not refused
            self.stats.late += len(results)
            return
        arrived_s = time.monotonic()
        silent_s = arrived_s - conn.last_seen_s  # nothing heard from it meanwhile
        self.seen(conn)
        for result in results:
            self._on_result(conn, result, arrived_s, silent_s)
            silent_s = 0.0  # the rest of the message came with the first
        self.pump_soon()

    def on_credit(self, conn: DeviceConn, tiles: int) -> None:
        """The device changed its window."""
        self.seen(conn)
        self.scheduler.set_max_in_flight(conn.device_id, tiles)
        self.pump_soon()

    def on_telemetry(self, conn: DeviceConn, values: Mapping[str, float],
                     labels: Mapping[str, str]) -> None:
        """Device measurements for devices.jsonl and the live view (bounded)."""
        self.seen(conn)
        if len(values) + len(labels) > 4 * MAX_TELEMETRY_KEYS:  # not worth reading
            dropped = len(values) + len(labels)
        else:
            dropped = bounded_telemetry(conn.telemetry, dict(values), dict(labels))
        conn.telemetry_dropped += dropped
        self.telemetry_dropped += dropped

    def on_stray_attach(self, conn: DeviceConn) -> None:
        """An Attach after the first message: refused, the stream stays open."""
        self.seen(conn)
        self._reject(conn, -1, "already attached: Attach is only the first message")

    def _reject(self, conn: DeviceConn, task_id: int, reason: str, attempt: int = -1,
                failed_check: bool = False) -> None:
        """Refuse one result (or message): an event, and a Reject for the device.

        Failed checks are as many as the tiles handed out, and each is logged (a corruption is
        matched to its event). Other rejects answer whatever a device sends (results for tasks
        it never got, a stray Attach), so past ``REJECT_EVENTS_LOGGED`` of a device they are
        summarised once a period; and a device that does not read its stream gets no more
        Rejects queued past ``MAX_QUEUED_REJECTS``: events.jsonl and the PS's memory stay
        bounded whatever it sends."""
        self.stats.rejected += 1
        if failed_check or conn.rejects_logged < REJECT_EVENTS_LOGGED:
            conn.rejects_logged += not failed_check
            self._event("reject", device=conn.slot.name, device_id=conn.device_id,
                        task=task_id, attempt=attempt, failed_check=failed_check,
                        reason=reason)
        else:
            conn.rejects_unlogged += 1
            now = time.monotonic()
            if now - conn.rejects_summarised_s >= REFUSAL_EVENT_PERIOD_S:
                self._event("rejects_summarised", device=conn.slot.name,
                            device_id=conn.device_id, rejects=conn.rejects_unlogged,
                            last_reason=reason)
                conn.rejects_unlogged, conn.rejects_summarised_s = 0, now
        if conn.outbox is not None and conn.outbox.qsize() < MAX_QUEUED_REJECTS:
            conn.outbox.put_nowait(Outgoing(reject=(task_id, reason)))

    def _on_result(self, conn: DeviceConn, result: ResultIn, arrived_s: float,
                   silent_s: float = 0.0) -> None:
        self.stats.bytes_up += result.nbytes
        problem = result_numbers_problem(result.compute_s, result.energy_j, result.lag_s,
                                         result.received_s, result.started_s, result.done_s)
        c = result.c
        if c is None:
            problem = problem or f"bad tensor: {result.tensor_problem}"
        late = (0.0, 0.0)
        if problem is not None:
            self.results_refused += 1
            outcome = self.scheduler.refuse(conn.device_id, result.task_id, result.attempt,
                                            problem)
        else:
            assert c is not None
            if conn.timeline is not None:  # every result the device sent took its uplink
                late = conn.timeline.result(result.received_s, result.started_s,
                                            result.done_s,
                                            result.nbytes + MESSAGE_OVERHEAD_BYTES, arrived_s,
                                            self.config.time_dilation, silent_s,
                                            self.config.heartbeat_s)
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
            assert c is not None  # accepted: it decoded
            self._accepted(conn, result, outcome, c, late)
            for observe in self.accepted_observers:
                observe(conn, result, arrived_s)

    def _accepted(self, conn: DeviceConn, result: ResultIn, outcome: Outcome,
                  c: np.ndarray, late: tuple[float, float]) -> None:
        """``late``: the tile's start lateness and its result's uplink lateness (device seconds,
        :class:`DeviceTimeline`; the uplink's signed, summed per GEMM and device as it is)."""
        task = outcome.task
        assert task is not None
        self.watchdog.progressed(time.monotonic())
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
            lag_s = result.done_s - result.started_s - result.compute_s * dilation
            self.stats.tile_lags_s.append(lag_s)
            key = (task.job.uid, conn.slot.name)
            for late_s, seconds in ((self.stats.tile_late_s, max(0.0, lag_s) / dilation),
                                    (self.stats.start_late_s, late[0]),
                                    (self.stats.uplink_late_s, late[1])):  # signed
                if seconds:  # a tile's lateness delays every later tile of the device
                    late_s[key] = late_s.get(key, 0.0) + seconds
        if self.config.trace_tiles and self.runlog is not None:
            self.runlog.tile(step=task.job.spec.step, gemm=task.job.uid, task=task.task_id,
                             device=conn.slot.name, attempt=result.attempt,
                             backup=outcome.backup_won, bytes_up=result.nbytes,
                             sent_s=outcome.sent_s, arrived_s=result.received_s,
                             started_s=result.started_s, done_s=result.done_s,
                             compute_s=result.compute_s, accepted_s=time.monotonic())
        if self.ledger is not None:
            try:
                self.ledger.append(task.job.spec.step, task.job.uid, task.job.digest,
                                   task.box.key, c, task.task_id,
                                   result.attempt, conn.slot.name)
            except OSError as exc:  # the tile is accepted all the same: the GEMM must finish
                self._journal_failed(exc)
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
            "paused_s": round(self.paused_s, 3),
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
    def finished(self) -> StepStats:
        """The finished steps' figures: their sums, as steps.jsonl has them step by step."""
        return dataclasses.replace(self._finished, tile_errors=[], tile_lags_s=[],
                                   tile_late_s={}, start_late_s={}, uplink_late_s={})

    def summary_figures(self, done: bool) -> dict[str, Any]:
        """The summary's figures that steps.jsonl has per step (``run_figures``). A done run's
        are its finished steps' sums, and what the PS counted since its last step (a losing
        copy's result coming back late) is apart, in ``after_last_step``: summary and steps
        agree. An unfinished run's count the step under way too: it spent them."""
        if not done:
            return run_figures(self.totals)
        return {**run_figures(self.finished), "after_last_step": after_last_step(self.stats)}

    @property
    def totals(self) -> StepStats:
        """The run's figures so far: the finished steps and the one under way."""
        out = self.finished
        out.add(self.stats)
        return out

    def set_dilation(self, dilation: float) -> None:
        """Change D (between steps only): scheduler estimates, new joins, every attached device."""
        self.config.time_dilation = dilation
        self.scheduler.dilation = dilation
        for conn in self.conns.values():
            if conn.outbox is not None:
                conn.outbox.put_nowait(Outgoing(time_dilation=dilation))

    def stop_all(self, reason: str) -> None:
        """Tell every device to stop and close the streams."""
        self.stopping = True
        for conn in self.conns.values():
            if conn.outbox is not None:
                conn.outbox.put_nowait(Outgoing(stop=reason))
                conn.outbox.put_nowait(None)


def _quantile(sorted_values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of sorted values; None when there are none."""
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return round(sorted_values[i], 6)
