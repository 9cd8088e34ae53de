"""Discrete-event simulation: the PS's scheduler and planner, device models, virtual time.

One implementation, two clocks. The simulation drives the very objects the PS drives
(:class:`~testbed.ps_backend.scheduler.Scheduler` for placement, windows, owners, stealing,
backups, re-queues and quarantine; :class:`~testbed.ps_backend.step_plan.StepPlanner` for tile
plans and the step's bound), passing virtual time as ``now_s`` where the PS passes its monotonic
clock. What it replaces is only what has no tensors: GEMM operands are zero-stride numpy views
(shape and itemsize, no memory), and results carry no values (:class:`ValuelessScheduler`: the
value check and the placement into C are the only two methods it overrides).

What stands in for the other processes (the same rules as the emulated agent,
``testbed/agent/agent.py``): the tiles one pump hands a device travel PS -> device in the messages
``scheduler.message_runs`` cuts them into, each
one flow over the path's links (:mod:`testbed.simulate.network`), the device computes its tiles
one after another in arrival order for the device model's time (``device_model_for``:
regression, noise, thermal state, energy) times its churn slow factor and, for a topology's
straggler, the factor the agent's own :class:`~testbed.agent.behaviour.Behaviour` draws for the
tile (seeded as ``testbed up`` seeds the agent), and each result travels
back as a message of its own. A device's messages go one after another in each direction (its
one gRPC stream), sharing the links max-min with other devices' messages, and a message arrives
the path's one-way delay after its last byte left. Churn
actions apply at their trace times from the start of training (time 0), as ``testbed up``'s
replay applies them: join adds a device, leave and crash drop it (its tiles are re-queued), a
partition stalls its links and its lease expires after ``lease_s``; heal lets it join again. A
leave or a crash of a cut-off device drops it at that lease, or at a heal that comes first
(docs/churn.md). A churn action's event comes before the join or departure it causes.
As the PS's host ticks its core (``PsCore.tick``, every ``min(0.25, lease_s / 4)`` s), the
simulation pumps at that period while anything is under way, so copies that become overdue
with no result coming (a partitioned device's) get their backups as time passes.

The chain goes as the engine submits it: each submission once the one before is done, except
the weight gradients (``bound.floats``), which the step waits for at its end.

Time is device seconds (dilation 1): the scheduler's ``dilation`` is 1, and ``device_time_s`` of
a step is the virtual time it took. The PS's own work (layer norms, attention, the optimizer, the
GEMMs below ``min_offload_flops``, its software per GEMM) takes no virtual time unless
``ps_gemm_s`` is set: then every offloaded GEMM waits that long of PS time before it goes out
(a flat per-GEMM cost; ``bench/sim_vs_emu.py`` measures what the emulation host's PS costs).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np

from testbed.agent.behaviour import Behaviour, straggler_for
from testbed.agent.link import MESSAGE_OVERHEAD_BYTES
from testbed.capacity import device_cache_bytes
from testbed.churn.schedule import ChurnAction, ChurnSchedule
from testbed.churn.trace import ChurnEvent
from testbed.emulator.device_model import DeviceModel, device_model_for
from testbed.emulator.network.base import loss_cap_bps, path_delay_s, switch_path
from testbed.perf_model.profiles import load_profile
from testbed.ps_backend.accounting import StepStats
from testbed.ps_backend.bound import floats, pass_of
from testbed.ps_backend.config import ps_config
from testbed.ps_backend.core import STREAM_CLOSED
from testbed.ps_backend.scheduler import (
    Assignment,
    DeviceSlot,
    GemmJob,
    GemmSpec,
    ReadyIndex,
    Scheduler,
    Task,
    Verdict,
    message_runs,
)
from testbed.ps_backend.step_plan import StepPlanner, StepRecord
from testbed.ps_backend.tiler import TileBox, gemm_flops
from testbed.ps_backend.watchdog import ProgressWatchdog, WatchdogError
from testbed.simulate.chain import ChainGemm, linears, step_chain
from testbed.simulate.events import EventLoop
from testbed.simulate.lease import set_partitioned
from testbed.simulate.network import FlowNetwork
from testbed.topology import DeviceSpec, Topology
from testbed.up import EMULATED_MAX_IN_FLIGHT


def _zero(counter: list[int]) -> bool:
    return counter[0] == 0


def _nothing() -> None:
    pass


def _no_event(_kind: str, /, **fields: Any) -> None:
    return None


class ValuelessScheduler(Scheduler):
    """The PS's scheduler for results without values: every result passes the value check
    (the simulation has no Byzantine devices) and nothing is placed into C."""

    def _check(self, task: Task, c: np.ndarray) -> str | None:
        self.counters.checks += 1
        return None

    @staticmethod
    def _store(job: GemmJob, box: TileBox, c: np.ndarray) -> None:
        return None


@functools.lru_cache(maxsize=4096)
def shape_only(m: int, n: int, dtype: np.dtype) -> np.ndarray:
    """An m x n array of dtype that holds no memory (zero strides): shapes and sizes only.

    Read-only and shared: a step has a few dozen distinct shapes and one result per tile.
    """
    return np.broadcast_to(np.zeros((), dtype=dtype), (m, n))


@dataclass(eq=False)
class SimDevice:
    """One device of the topology as the simulation sees it."""

    spec: DeviceSpec
    model: DeviceModel
    gflops: float
    down_path: tuple[int, ...]
    up_path: tuple[int, ...]
    own_links: tuple[int, int]  # its down and up device links (partition sets them to 0)
    link_Bps: tuple[float, float]
    delay_s: float
    present: bool = False
    partitioned: bool = False
    # its agent left or crashed while cut off: nothing told the PS, which keeps the session
    # until the lease runs out or the heal brings the connection's end (docs/churn.md)
    gone: bool = False
    slow: float = 1.0
    straggler: Behaviour | None = None  # the topology's straggler behaviour, as its agent's
    session: int = 0  # bumps on every departure: events of an older session are dropped
    cuts: int = 0  # bumps on every partition: a lease timer is its own cut's only
    slot: DeviceSlot | None = None
    # tiles whose operands are on it, first come first computed: (task, attempt, session,
    # arrived_s); each is costed as it starts, with the slow factor and thermal state then,
    # as its agent costs a tile; a tile of an older session runs on until its end (the
    # process computed it until it died), and those waiting behind it are dropped
    waiting: deque[tuple[Task, int, int, float]] = field(default_factory=deque)
    computing: bool = False
    flows: set[int] = field(default_factory=set)
    # its stream, per direction (0 down, 1 up): a message in flight, then those queued behind
    sending: list[bool] = field(default_factory=lambda: [False, False])
    queued: tuple[deque[Callable[[], None]], deque[Callable[[], None]]] = field(
        default_factory=lambda: (deque(), deque()))
    sessions: int = 0
    # bytes it received and sent, per pass ("fwd", "bwd"): which link a pass is bound by
    moved: dict[str, list[int]] = field(
        default_factory=lambda: {"fwd": [0, 0], "bwd": [0, 0]})


class Planned(NamedTuple):
    """What planning every linear before the first step took (:meth:`Simulation.start`)."""

    shapes: int
    processes: int
    wall_s: float
    cpu_s: float


class Simulation(EventLoop):
    """Runs a topology's job in virtual time; reports through ``emit`` callbacks."""

    def __init__(self, topology: Topology, schedule: ChurnSchedule | None = None,
                 event: Callable[..., None] | None = None, noise: bool = True,
                 ps_gemm_s: float = 0.0, tile: Callable[..., None] | None = None,
                 during: Callable[[float, StepStats], None] | None = None,
                 during_every_s: float = 10.0,
                 device: Callable[..., None] | None = None):
        self.topology = topology
        job = topology.job
        self.job = job
        self.dtype = np.dtype(job.dtype)
        self.schedule = schedule
        if not ps_gemm_s >= 0:
            raise ValueError(f"ps_gemm_s must be >= 0 seconds, got {ps_gemm_s}")
        self.ps_gemm_s = ps_gemm_s  # the PS's own time per offloaded GEMM (see run_step)
        self.emit = event or _no_event
        self.trace_tile = tile  # each accepted tile's times, as the PS's trace_tiles records
        # a departed session's final record as it departs, as PsCore.drop writes devices.jsonl's
        self.record_device = device
        # a long step's progress: every during_every_s of wall time, the step's device seconds
        # and its totals so far (a 1,000-device step takes minutes to simulate)
        self.during, self.during_every_s = during, during_every_s
        self._step_start_s = 0.0
        self._next_during = 0.0
        self.config = ps_config(topology, run_name="simulated", check_values=False)
        c = self.config
        self.scheduler = ValuelessScheduler(check_values=False,
                                            freivalds_vectors=c.freivalds_vectors,
                                            quarantine_after=c.quarantine_after, dilation=1.0,
                                            window_scale=c.window_scale)
        self.planner = StepPlanner(self.config, clock=lambda: self.now_s)
        # the pump's ready list, filed as devices change instead of sorted at every result
        self.ready = ReadyIndex(self.scheduler)
        self._ready_stale = True  # windows were resized (a join or a departure): file all
        self.now_s = 0.0
        self.net = FlowNetwork()
        self._start_events()
        self._ids = itertools.count()
        self.version = 0
        self.stats = StepStats()
        self.totals = StepStats()
        self.by_id: dict[str, SimDevice] = {}
        self.devices = self._build_devices(noise)
        self.departed: list[dict[str, Any]] = []
        self._partitioned: set[str] = set()  # names of devices whose links are down
        self.tiles_per_gemm: dict[str, int] = {}
        # a step's GEMMs, offloaded or not (a long step's progress says how many are submitted)
        self.step_gemms = sum(len(group) for group in step_chain(job))
        self.planned: Planned | None = None  # set by start() when it plans ahead
        self.tick_s = min(0.25, self.config.lease_s / 4)  # PsServer._watch_leases' period
        self._ticking = False
        # the PS's progress watchdog, checked at every tick as PsCore.tick checks it
        self.watchdog = ProgressWatchdog.starting(job.watchdog.no_progress_s, 0.0)

    # -- set-up --------------------------------------------------------------------------------
    def _build_devices(self, noise: bool) -> dict[str, SimDevice]:
        topo = self.topology
        net = self.net
        ps = topo.network.ps.link
        ps_down = net.add_link(ps.down_bps / 8, "ps:down")
        ps_up = net.add_link(ps.up_bps / 8, "ps:up")
        switch_links: dict[str, tuple[int, int]] = {}
        for sl in topo.network.links:
            switch_links[sl.lower] = (net.add_link(sl.link.down_bps / 8, f"{sl.lower}:down"),
                                      net.add_link(sl.link.up_bps / 8, f"{sl.lower}:up"))
        profiles = {g.group: load_profile(str(g.profile_path)) for g in topo.groups}
        out: dict[str, SimDevice] = {}
        for d in topo.devices:
            delay = path_delay_s(topo, d)
            cap = loss_cap_bps(topo, d)  # the emulator's loss cap
            down_Bps = min(d.link.down_bps, cap) / 8
            up_Bps = min(d.link.up_bps, cap) / 8
            own_down = net.add_link(down_Bps, f"{d.name}:down")
            own_up = net.add_link(up_Bps, f"{d.name}:up")
            mid_down, mid_up = [], []
            for sl in switch_path(topo, d.group.switch):
                down, up = switch_links[sl.lower]
                mid_down.append(down)
                mid_up.append(up)
            profile = profiles[d.group.group]
            seed = topo.seed * 1000 + d.index  # as testbed up seeds the device's agent
            model = device_model_for(profile, seed=seed, noise=noise)
            out[d.name] = SimDevice(d, model, float(profile.sustained_gflops),
                                    (ps_down, *reversed(mid_down), own_down),
                                    (own_up, *mid_up, ps_up), (own_down, own_up),
                                    (down_Bps, up_Bps), delay, straggler=straggler_for(d, seed))
        return out

    # -- the event queue -----------------------------------------------------------------------
    def _run_until(self, done: Callable[[], bool]) -> None:
        check = done
        if self.during is not None:
            report, every = self.during, self.during_every_s

            def check() -> bool:  # after every event: a clock read, a report now and then
                wall = time.monotonic()
                if wall >= self._next_during:
                    self._next_during = wall + every
                    report(self.now_s - self._step_start_s, self.stats)
                return done()
        if not self.run_until(check):
            # why: with none present the time said is only when the queue ran dry (a
            # run whose devices all crashed at 0.005 s said 0.25), not when progress stopped
            why = ("no device is present (each has left, crashed or stayed cut off past its "
                   "lease, and the churn trace brings none back)" if not self.by_id else
                   f"none of the {len(self.by_id)} devices present can make progress")
            raise RuntimeError(f"simulation stalled: {len(self.scheduler.tasks)} tiles "
                               f"outstanding and {why} (simulated time "
                               f"{self.now_s:.6f} s)")

    # -- membership ----------------------------------------------------------------------------
    def join(self, dev: SimDevice) -> None:
        """A device joins (the PS registers it as PsCore.join does)."""
        self.join_all([dev])

    def join_all(self, devs: list[SimDevice]) -> None:
        """Devices join at the same moment, one after another: as many joins, with the
        scheduler's windows sized once (Scheduler.add_devices) instead of after each."""
        slots = []
        for dev in devs:
            dev.present = True
            dev.gone = False
            dev.session += 1
            dev.sessions += 1
            slot = DeviceSlot(device_id=f"d{next(self._ids)}", name=dev.spec.name,
                              predicted_gflops=dev.gflops or 1.0,
                              max_in_flight=EMULATED_MAX_IN_FLIGHT,
                              # its block cache, as testbed up gives its emulated agent
                              cache_bytes=device_cache_bytes(self.job, dev.spec.group),
                              group=dev.spec.group.group,
                              kind="emulated", profile=dev.spec.group.profile,
                              keeps_held=True)
            dev.slot = slot
            self.by_id[slot.device_id] = dev
            slots.append(slot)
        self.scheduler.add_devices(slots)
        self._ready_stale = True
        for slot in slots:  # none is cut off: a device joins once its link is up (_apply)
            self.planner.saw(slot)
            self.emit("join", device=slot.name, device_id=slot.device_id, group=slot.group,
                      kind="emulated", profile=slot.profile,
                      predicted_gflops=slot.predicted_gflops)
        self.pump()

    def drop(self, dev: SimDevice, kind: str, reason: str) -> None:
        """A device is gone: cancel its transfers, re-queue its tiles (PsCore.drop)."""
        slot = dev.slot
        dev.present = False
        dev.session += 1
        for fid in dev.flows:
            self.net.cancel(fid)
        dev.flows.clear()
        dev.sending = [False, False]
        for q in dev.queued:
            q.clear()
        if slot is None:
            return
        held = [c.task for c in slot.in_flight.values()]
        requeued = self.scheduler.remove_device(slot.device_id)
        self._ready_stale = True
        self.stats.requeued += len(requeued)
        final = self.device_record(dev, "left")
        self.departed.append(final)
        if self.record_device is not None:
            self.record_device(**final)
        dev.slot = None
        self.by_id.pop(slot.device_id, None)
        self.watchdog.departed(self.now_s, slot.name, kind, reason)
        self.emit(kind, device=slot.name, device_id=slot.device_id, reason=reason,
                  in_flight=len(held), requeued_tiles=len(requeued))
        self.pump()

    # -- work ----------------------------------------------------------------------------------
    def submit(self, step: int, seq: int, g: ChainGemm, done: Callable[[], None]) -> None:
        """Plan and queue one GEMM, as PsCore.submit does."""
        if step > self.version:
            self.version = step
            self.scheduler.invalidate(step)
        uid = f"s{step}/{g.layer}/{g.op}#{seq}"
        # Operands keyed by tensor, as TileExecutor keys them (OperandKeys, the weights by
        # their GemmSpec b_key at the version: one optimizer step per training step), so a
        # block sent for one GEMM is a cache hit for another: Wᵀ of forward is W of input_grad,
        # X of forward is B of the weight gradient, dY of dX is dYᵀ of dW.
        a_key, b_key = g.keys(step)
        spec = GemmSpec(g.layer, g.op, step, b_key if g.b_name == g.weight_key else None)
        job = GemmJob(uid=uid, spec=spec, a=shape_only(g.m, g.k, self.dtype),
                      b=shape_only(g.k, g.n, self.dtype), c=shape_only(g.m, g.n, self.dtype),
                      version=step, a_key=a_key, b_key=b_key, done=Future(),
                      a_transposed=g.a_transposed,
                      b_transposed=g.b_transposed, submitted_s=self.now_s)
        job.done.add_done_callback(lambda _f: done())
        slots = [d.slot for d in self.devices.values() if d.slot is not None]
        cut = self.planner.plan(job, slots)
        self.scheduler.submit(job, cut.regions, None, cut.owners, cut.held)
        self.tiles_per_gemm[uid] = job.remaining
        self.pump()
        if not self._ticking:
            self._ticking = True
            self.at(self.now_s + self.tick_s, self._tick)

    def _tick(self) -> None:
        """PsCore.tick's pump ("backups as time passes"; the leases have their own events) and
        its progress watchdog. With the watchdog on, it ticks while tiles are outstanding, so a
        run that cannot go on fails when `testbed up`'s would; with it off (``no_progress_s``
        0), it stops while nothing else is under way, so a stalled run still ends."""
        self.pump()
        present = self.by_id.values()  # the devices with a session (each has its slot)
        # none is quarantined: the simulator's results fail no check (ValuelessScheduler)
        reason = self.watchdog.check(
            self.now_s, len(self.by_id), 0, len(self.scheduler.tasks),
            lambda: [d.spec.name for d in present],
            lambda: sum(len(d.slot.in_flight) for d in present if d.slot is not None))
        if reason is not None:
            self.emit("watchdog", reason=reason)
            raise WatchdogError(reason)
        if self.busy() or (self.watchdog.limit_s > 0 and self.scheduler.tasks):
            self.at(self.now_s + self.tick_s, self._tick)
        else:
            self._ticking = False

    def pump(self) -> None:
        """Hand tiles to every device with room in its window, fastest first (PsCore.pump).

        The ready devices (room in the window, link not partitioned) in the devices' join
        order, then fastest first, as PsCore sorts them: here a ReadyIndex filed as devices
        change, and Scheduler.assign_ready, which makes assign_each's choices on it.
        """
        sched = self.scheduler
        if not (sched.pending or sched.tasks):
            return
        ready = self.ready
        if self._ready_stale:
            self._ready_stale = False
            ready.rebuild()
        for slot, assignments in sched.assign_ready(ready, now_s=self.now_s):
            for run in message_runs(assignments, slot.down_Bps):
                self._send(self.by_id[slot.device_id], run)
            ready.touch(slot)

    def _send(self, dev: SimDevice, assignments: list[Assignment]) -> None:
        """One message of tiles for a device (PsCore._tiles_message; scheduler.message_runs
        cuts a pump's tiles into messages): they arrive together, once the whole message is
        on the device."""
        nbytes = 0
        copies = []
        for a in assignments:
            nbytes += a.nbytes
            dev.moved[pass_of(a.task.job.spec.op)][0] += a.nbytes
            self.stats.backups += a.backup
            copies.append((a.task, a.task.attempt))  # the attempt this copy was given as
        self.stats.bytes_down += nbytes
        session = dev.session

        def arrived() -> None:
            if dev.session == session:  # _arrived never ends a session
                for task, attempt in copies:
                    self._arrived(dev, task, attempt, session)
        self._transfer(dev, 0, nbytes + MESSAGE_OVERHEAD_BYTES * len(copies), arrived)

    def _transfer(self, dev: SimDevice, direction: int, nbytes: int,
                  arrived: Callable[[], None]) -> None:
        """A message on the device's stream (0: PS -> device, 1: back): after the messages
        before it in that direction; ``arrived`` runs the path's delay after its last byte."""
        session = dev.session
        path = dev.up_path if direction else dev.down_path

        def go() -> None:
            dev.sending[direction] = True
            holder: list[int] = []

            def drained() -> None:
                dev.flows.discard(holder[0])
                if dev.session != session:
                    return
                dev.sending[direction] = False
                self.at(self.now_s + dev.delay_s,
                        lambda: arrived() if dev.session == session else None)
                if dev.queued[direction]:
                    dev.queued[direction].popleft()()
            flow = self.net.start(nbytes, path, 0.0, drained)
            holder.append(flow.flow_id)
            dev.flows.add(flow.flow_id)
        if dev.sending[direction]:
            dev.queued[direction].append(go)
        else:
            go()

    def _arrived(self, dev: SimDevice, task: Task, attempt: int, session: int) -> None:
        """A tile's operands are on the device: it computes after the tiles before it."""
        dev.waiting.append((task, attempt, session, self.now_s))
        if not dev.computing:
            self._compute_next(dev)

    def _compute_next(self, dev: SimDevice) -> None:
        """The device starts its next waiting tile of its present session, if any."""
        while dev.waiting:
            task, attempt, session, arrived_s = dev.waiting.popleft()
            if session == dev.session:
                break
        else:
            dev.computing = False
            return
        start = self.now_s
        m, n = task.box.shape
        k0, k1 = task.k_range
        factor = dev.slow * (dev.straggler.compute_factor() if dev.straggler else 1.0)
        cost = dev.model.tile_cost(m, k1 - k0, n, task.job.spec.op, start, slowdown=factor)
        seconds, joules = cost.seconds, cost.joules
        dev.computing = True

        def computed() -> None:
            if dev.session == session:
                def back() -> None:
                    if dev.session == session:
                        self._result(dev, task, attempt, seconds, joules,
                                     (arrived_s, start, start + seconds))
                nbytes = m * n * self.dtype.itemsize
                dev.moved[pass_of(task.job.spec.op)][1] += nbytes
                self._transfer(dev, 1, nbytes + MESSAGE_OVERHEAD_BYTES, back)
            self._compute_next(dev)
        self.at(start + seconds, computed)

    def _result(self, dev: SimDevice, task: Task, attempt: int, compute_s: float,
                energy_j: float, times: tuple[float, float, float]) -> None:
        """A result is back on the PS: the scheduler decides (PsCore._on_result). ``times``:
        when its operands arrived on the device, and when it started and finished it."""
        assert dev.slot is not None
        m, n = task.box.shape
        nbytes = m * n * self.dtype.itemsize
        self.stats.bytes_up += nbytes
        outcome = self.scheduler.accept(dev.slot.device_id, task.task_id, attempt,
                                        shape_only(m, n, self.dtype), compute_s, energy_j,
                                        now_s=self.now_s)
        self.ready.touch(dev.slot)  # its rate, overhead and window room changed
        if outcome.verdict is Verdict.REJECTED:
            self.stats.rejected += 1
            self.stats.requeued += outcome.requeued
        elif outcome.verdict is Verdict.LATE:
            self.stats.late += 1
            if outcome.task is not None and outcome.task.done and outcome.checked:
                self.stats.wasted += 1
        else:
            self.watchdog.progressed(self.now_s)
            self.stats.tiles += 1
            self.stats.recomputed += attempt > 0
            self.stats.backup_wins += outcome.backup_won
            self.stats.device_compute_s += compute_s
            self.stats.energy_j += energy_j
            if self.trace_tile is not None:  # RunLog.tile, as PsCore records a tile
                arrived_s, started_s, done_s = times
                self.trace_tile(step=task.job.spec.step, gemm=task.job.uid, task=task.task_id,
                                device=dev.spec.name, attempt=attempt,
                                backup=outcome.backup_won, bytes_up=nbytes,
                                sent_s=outcome.sent_s, arrived_s=arrived_s, started_s=started_s,
                                done_s=done_s, compute_s=compute_s, accepted_s=self.now_s)
            if outcome.completed_job is not None:
                outcome.completed_job.done.set_result(None)
        self.pump()

    # -- churn ---------------------------------------------------------------------------------
    def _apply(self, action: ChurnAction) -> None:
        """One churn action: its ``churn`` event, then what it does, so that the join or the
        departure it causes is recorded after it, as ``testbed up`` records it (its replay
        stamps the action as it begins, before the PS hears of it)."""
        dev = self.devices[action.device]
        effect, act = self._action(dev, action)
        self.emit("churn", **action.churn_event(effect))
        act()

    def _action(self, dev: SimDevice, action: ChurnAction) -> tuple[str, Callable[[], None]]:
        """What a churn action does to ``dev``: its effect as the ``churn`` event says it, and
        the doing."""
        event = action.event
        if event is ChurnEvent.JOIN:
            def join() -> None:
                if dev.gone and dev.present:  # testbed up kills the old agent before the new
                    self.drop(dev, "disconnect", STREAM_CLOSED)
                if not dev.partitioned:  # its agent reaches the PS once its link is up
                    self.join(dev)
            return ("applied", join) if dev.gone or not dev.present else ("absent", _nothing)
        if event in (ChurnEvent.LEAVE, ChurnEvent.CRASH):
            if not dev.present or dev.gone:
                return "absent", _nothing
            leave = event is ChurnEvent.LEAVE
            effect = "SIGTERM" if leave else "SIGKILL"
            if dev.partitioned:
                # cut off, neither the Leave nor the end of the connection (a closed channel,
                # a killed process's socket) crosses the cut: the PS's lease for it runs out
                # (the partition's timer), or the heal brings the end first (_heal)
                def cut_off() -> None:
                    dev.gone = True
                return effect, cut_off
            # the reasons `testbed up` records: the agent's Leave names its signal, and a
            # killed agent's kernel closes its stream
            return effect, functools.partial(self.drop, dev, "leave" if leave else "disconnect",
                                             effect if leave else STREAM_CLOSED)
        if event is ChurnEvent.PARTITION:
            return "link down", functools.partial(self._partition, dev, True)
        if event is ChurnEvent.HEAL:
            return "link up", functools.partial(self._heal, dev)

        def slow() -> None:
            dev.slow = float(action.factor or 1.0)
        return f"compute x{action.factor}", slow

    def _heal(self, dev: SimDevice) -> None:
        if dev.gone and dev.present:  # the end its agent made while cut off reaches the PS now
            self.drop(dev, "disconnect", STREAM_CLOSED)
        self._partition(dev, False)

    def _partition(self, dev: SimDevice, down: bool) -> None:
        session = dev.session

        def lost() -> None:  # the lease ended (testbed.simulate.lease): unless it left since
            if dev.session == session:
                self.drop(dev, "lease_expired",
                          f"no message for more than {self.config.lease_s:g} s")
        set_partitioned(self, dev, down, self.config.lease_s, lost if dev.present else None)
        if down:
            self._partitioned.add(dev.spec.name)
        else:
            self._partitioned.discard(dev.spec.name)
        if dev.slot is not None:
            self.ready.block(dev.slot, down)
        for link, rate in zip(dev.own_links, dev.link_Bps):
            self.net.set_capacity(link, 0.0 if down else rate)
        if not down and not dev.present and dev.spec.name in self._wanted:
            self.join(dev)  # the agent reconnects once its link is back
        if not down:
            self.pump()

    # -- the run -------------------------------------------------------------------------------
    def start(self, plan_workers: int = 0,
              planning: Callable[[int, int, float], None] | None = None) -> None:
        """Devices present at the start join; with ``plan_workers``, every linear is planned
        in that many processes before training starts, as the PS plans (:meth:`plan_ahead`,
        the ``planned`` event and :attr:`planned`; ``planning(shapes planned, shapes, wall s
        so far)`` every ``during_every_s`` meanwhile); churn actions are queued at their
        times."""
        present = self.schedule.initially_present if self.schedule is not None else \
            frozenset(self.devices)
        self._wanted = set(present)
        self.join_all([dev for name, dev in self.devices.items() if name in present])
        if plan_workers:
            started, cpu0 = time.monotonic(), self.planner.cpu_s
            shapes = self.plan_ahead(plan_workers, planning)
            self.planned = Planned(shapes, self.planner.processes, time.monotonic() - started,
                                   self.planner.cpu_s - cpu0)
            self.emit("planned", shapes=shapes, wall_s=round(self.planned.wall_s, 3),
                      processes=self.planned.processes, cpu_s=round(self.planned.cpu_s, 3),
                      regions=self.planner.region_shapes())
        self.emit("training_start", devices=len(present), expected_devices=len(present))
        if self.schedule is not None:
            self.emit("churn_clock_start", actions=len(self.schedule.actions),
                      already_applied=0, offset_s=0.0)
            for action in self.schedule.actions:
                self.at(action.time_s, functools.partial(self._track, action))

    def plan_ahead(self, workers: int = 1,
                   progress: Callable[[int, int, float], None] | None = None) -> int:
        """Every linear's plans before the first step, with the devices present, as the PS
        makes them (``ps_backend.main._plan_ahead``, :meth:`StepPlanner.prepare`, which calls
        ``progress`` every ``during_every_s`` of wall time); the number of shapes planned."""
        tokens = self.job.batch_size * self.job.model.seq_len
        slots = [d.slot for d in self.devices.values() if d.slot is not None]
        return self.planner.prepare([(tokens, lin.d_out, lin.d_in) for lin in linears(self.job)],
                                    self.dtype.itemsize, slots, workers=workers,
                                    progress=progress, progress_every_s=self.during_every_s)

    def _track(self, action: ChurnAction) -> None:
        if action.event is ChurnEvent.JOIN:
            self._wanted.add(action.device)
        elif action.event in (ChurnEvent.LEAVE, ChurnEvent.CRASH):
            self._wanted.discard(action.device)
        self._apply(action)

    def run_step(self, step: int) -> tuple[float, StepStats, StepRecord]:
        """Run one training step's GEMM chain; (device time, totals, the planner's record)."""
        start_s = self._step_start_s = self.now_s
        self._next_during = time.monotonic() + self.during_every_s
        seq = itertools.count()
        floating = [0]  # weight gradients still running: the step waits for them at its end

        def one_done(left: list[int]) -> None:
            left[0] -= 1
        for group in step_chain(self.job):
            left = [0]  # GEMMs of this submission the next one waits for, still running
            for g in group:
                if gemm_flops(g.m, g.k, g.n) < self.job.parallelism.min_offload_flops:
                    next(seq)
                    self.stats.gemms_local += 1
                    continue  # the PS computes it (no virtual time: see the module docstring)
                self.stats.gemms_offloaded += 1
                if self.ps_gemm_s > 0:  # the PS's own work before this GEMM goes out
                    self.pass_time(self.now_s + self.ps_gemm_s)
                waited = floating if floats(g.op) else left  # as the engine (GemmContext.defer)
                waited[0] += 1
                self.submit(step, next(seq), g, functools.partial(one_done, waited))
            self._run_until(functools.partial(_zero, left))
        self._run_until(functools.partial(_zero, floating))
        record = self.planner.take_step([d.slot for d in self.devices.values()
                                         if d.slot is not None])
        stats, self.stats = self.stats, StepStats()
        self.totals.add(stats)
        return self.now_s - start_s, stats, record

    def run_totals(self) -> StepStats:
        """The run's figures so far: the finished steps and the one under way (an interrupted
        or failed run's summary counts what it spent, as the PS's ``PsCore.totals``)."""
        out = dataclasses.replace(self.totals)
        out.add(self.stats)
        return out

    def device_record(self, dev: SimDevice, state: str | None = None) -> dict[str, Any]:
        """The PS's device record for devices.jsonl and summary.json (PsCore._device_record)."""
        s = dev.slot
        telemetry = dev.model.telemetry(self.now_s)
        base = {"device": dev.spec.name, "group": dev.spec.group.group, "kind": "emulated",
                "profile": dev.spec.group.profile, "telemetry": telemetry}
        if s is None:
            return {**base, "state": state or "absent", "tiles_done": 0, "bytes_down": 0,
                    "bytes_up": 0, "compute_s": 0.0, "energy_j": 0.0}
        return {**base, "device_id": s.device_id,
                "state": state or ("quarantined" if s.quarantined else
                                   "busy" if s.in_flight else "idle"),
                "tiles_done": s.tiles_done, "tiles_rejected": s.tiles_rejected,
                "failed_checks": s.failed_checks, "tiles_late": s.tiles_late,
                "backups_won": s.backups_won, "window": s.window, "bytes_down": s.bytes_down,
                "bytes_up": s.bytes_up, "compute_s": round(s.compute_s, 6),
                "energy_j": round(s.energy_j, 6),
                "observed_gflops": round(s.rate_flops / 1e9, 3)}

    def present_records(self) -> list[dict[str, Any]]:
        """Every present device's record."""
        return [self.device_record(d) for d in self.devices.values() if d.slot is not None]

    def device_records(self) -> list[dict[str, Any]]:
        """Every present device's record, then the departed ones'."""
        return self.present_records() + self.departed
