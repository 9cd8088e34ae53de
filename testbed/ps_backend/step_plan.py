"""The PS's use of the planner and the bound: plan each GEMM, record the step, bound it.

Runs on the PS's loop thread (no locks). :class:`StepPlanner` turns a submitted
:class:`~testbed.ps_backend.scheduler.GemmJob` into a tiling (``job.parallelism.planner: auto``:
:func:`~testbed.ps_backend.planner.plan_gemm` over the topology's device groups; ``fifo``: the
job's fixed square tiles), deals the tiles to the devices present, and records every offloaded
GEMM so that :meth:`StepPlanner.take_step` can give the step's lower bound
(:mod:`testbed.ps_backend.bound`), its minimal traffic and which groups sat out and why.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from testbed.ps_backend.bound import (
    BoundDevice,
    BoundGemm,
    PsLink,
    SwitchLink,
    comm_min_shares,
    floats,
    lowest_switch_link,
    stage_key,
    step_bound,
)
from testbed.ps_backend.fair_share import group_fair_shares_Bps
from testbed.ps_backend.planner import (
    REGION_GAIN,
    GemmPlan,
    LayerPlan,
    PairPlan,
    PlanDevice,
    RegionPlan,
    deal_boxes,
    deal_layer,
    deal_pair,
    plan_gemm,
    plan_layer,
    plan_pair,
    plan_regions,
    predict_together_s,
)
from testbed.ps_backend.planning_processes import Progress, prepare_together
from testbed.ps_backend.scheduler import DeviceSlot, GemmJob, SharedLink
from testbed.ps_backend.tiler import Region, cut_regions, uniform

INF = float("inf")
# the caches StepPlanner.prepare fills (StepPlanner.prepared, merge_prepared)
PREPARED_CACHES = ("_plans", "_pair_plans", "_pair_split", "_region_plans", "_layer_plans")
# The backward pass submits a linear's input- and weight-gradient GEMMs together: each gets
# half of every group's devices (alternating by name), so the two do not both spread over every
# device and both send every device blocks of their own; and half the PS link, which both cross
# at once.
PAIR_HALF = {"input_grad": 0, "weight_grad": 1}
# ... when that is predicted faster than both spread over every device, each device doing its
# tiles of the two as one stream (planner.predict_together_s). Predicted as the sum of the two
# GEMMs' plans, spreading was charged each GEMM's fill and drain apart, and halves needed a 10 %
# margin to win (home-wifi's step: 1.20 s then, 1.16 s since).
# ... unless planning the pair as one (planner.plan_pair: each device computes both GEMMs'
# partials from the dY blocks it receives, so dY travels once) is predicted faster than both
PAIR_JOINT_GAIN = 1.0
# A linear's forward and backward planned on one grid (planner.plan_layer: the devices keep
# forward's X and W blocks for backward) when predicted at least 5 % faster than forward's own
# plan and the pair's best, and every taking-part device's held blocks of the step fit in this
# share of its cache budget: the LRU cache evicts the oldest blocks first, and backward's dY
# blocks flow through the rest.
LAYER_GAIN = 0.95
HELD_SHARE = 0.5
PASSES = ("forward", "backward")  # a step's GEMMs, as sat_out counts them
# A group is planned for the devices it has present, rounded up to a step of its count: the
# count, then each step about a tenth below the one before (59, 53, 47, 42, ...; 6, 5, 4, ...).
# Plans made for every device of the topology dealt a departed device's share to the others, so
# every later step ran that much longer (default without one of its 6 phones: 5.35 s a step
# simulated, against 4.11 for a topology of 5; now 4.12). A new count is a new plan search on
# the PS (about 10 s for large), so a device or two coming and going in a large group changes
# no plan; a group that lost a tenth of its devices is planned again.
PLAN_COUNT_STEP = 0.9


def planned_count(count: int, present: int) -> int:
    """How many devices of a group of ``count`` the plans count on when ``present`` are: the
    least step of ``count`` (:data:`PLAN_COUNT_STEP`) at or above ``present``; 0 for none."""
    if present <= 0:
        return 0
    level = count
    while level > present:
        lower = min(level - 1, math.floor(level * PLAN_COUNT_STEP))
        if lower < present:
            break
        level = lower
    return level


class Cut(NamedTuple):
    """How the scheduler cuts a GEMM (:meth:`Scheduler.submit`'s arguments)."""

    regions: tuple[Region, ...]  # runs of C's rows, each cut its own way (uniform: one)
    owners: dict[tuple[int, int, int], str] | None  # tile (row, col, slice) -> device
    # the devices keep its blocks for a later GEMM of the step (a linear's forward on its layer
    # grid): their caches evict them last (GemmJob.held)
    held: bool = False


@dataclass
class StepRecord:
    """What the planner saw of one step."""

    bound_s: float
    bytes_min_down: float
    bytes_min_up: float
    gemms: int
    # group -> link | speed, and the GEMMs it sat out when not all (sat_out_scope)
    sat_out: dict[str, str] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)  # stage limit term -> stages
    gemm_wall_s: float = 0.0  # time some offloaded GEMM was out (the simulator: virtual)
    # per stage of the chain, in order: (stage key, seconds some GEMM of it was outstanding,
    # its bound, the bound's limiting term); the run directory's stages.jsonl
    stages: list[tuple[str, float, float, str]] = field(default_factory=list)

    def fields(self) -> dict[str, Any]:
        """The steps.jsonl fields of this record."""
        return {"bound_s": round(self.bound_s, 6) if math.isfinite(self.bound_s) else None,
                "bytes_min_down": int(self.bytes_min_down),
                "bytes_min_up": int(self.bytes_min_up), "sat_out": dict(self.sat_out),
                "bound_limits": dict(self.limits), "gemm_wall_s": round(self.gemm_wall_s, 6)}


def sat_out_scope(why: str, out: dict[str, int], gemms: dict[str, int]) -> str:
    """Why a group sat out, and of which GEMMs when not of all the step's: ``out`` and
    ``gemms`` count, per pass (forward, backward), the GEMMs it sat out and all planned. On
    large, phones that compute half of forward but sit most backward pairs out read ``link in
    13 of 18 backward GEMMs``, not ``link`` as a group that never computed does."""
    if all(out.get(p, 0) >= n for p, n in gemms.items()):
        return why
    return why + " in " + ", ".join(f"{out[p]} of {gemms[p]} {p} GEMMs"
                                    for p in PASSES if out.get(p))


def bound_gemm(job: GemmJob) -> BoundGemm:
    """A GEMM as the bound sees it: its operands named by their keys, so a tensor an earlier
    stage sent counts as held (an address the allocator reused for a new tensor does not)."""
    m, k = job.a.shape
    return BoundGemm(m, k, job.b.shape[1], job.a.itemsize,
                     stage_key(job.spec.layer, job.spec.op), job.a_key, job.b_key,
                     floats(job.spec.op))


class StepPlanner:
    """Plans the GEMMs of a run and records each step for its bound."""

    def __init__(self, config: Any, clock: Callable[[], float] = time.monotonic):
        self.mode = config.planner
        self.clock = clock  # the PS's monotonic clock; the simulator's virtual one
        self.config = config
        self._planned = {g for g, _, _ in config.planned_groups}  # the topology's groups
        # the devices of each group this step's plans count on (planned_count), set before its
        # first plan and between steps; the counts prepare() has made plans for; whether the
        # devices present are all of the topology's groups (else plans are keyed by device)
        self._step_counts: dict[str, int] | None = None
        self._prepared_counts: set[tuple[int, ...]] = set()
        self._all_declared = True
        self._plans: dict[tuple[Any, ...], GemmPlan] = {}
        self._gemms: list[BoundGemm] = []
        self._seen: dict[str, DeviceSlot] = {}
        self._fair_links: dict[tuple[int, ...], dict[str, tuple[float, float, float]]] = {}
        # the links of the counts in force (_step_counts, as an object): _plan_links's last
        self._links_of: tuple[dict[str, int] | None, dict[str, tuple[float, float, float]]] \
            | None = None
        # the order this step's plans met its devices in (device id -> place): those present at
        # its first plan by name, a device that joins later after them, so a joiner takes a
        # place a departure left rather than displace a device that holds the step's blocks
        self._order: dict[str, int] = {}
        # ... and each device's place among its group's then (its backward pair half)
        self._places: dict[str, int] = {}
        self._group_met: dict[str, int] = {}  # group -> the last place given
        self._min_down = self._min_up = 0.0
        self._sat_out: dict[str, str] = {}  # group -> the first reason it sat out
        self._sat_count: dict[tuple[str, str], int] = {}  # (group, pass) -> GEMMs sat out
        self._pass_gemms: dict[str, int] = {}  # pass -> GEMMs planned
        self._dealt: dict[tuple[Any, ...], dict[tuple[int, int, int], str]] = {}
        # a backward pair's owners, dX's and dW's (plan_pair), dealt once per step and devices
        self._pair_dealt: dict[tuple[Any, ...], tuple[dict[tuple[int, int, int], str],
                                                      dict[tuple[int, int, int], str]]] = {}
        self._pair_split: dict[tuple[Any, ...], tuple[bool, float]] = {}
        self._pair_plans: dict[tuple[Any, ...], PairPlan | None] = {}
        self._region_plans: dict[tuple[Any, ...], RegionPlan | None] = {}
        self._forward_shapes: set[tuple[int, ...]] = set()  # (m, k, n) of forward GEMMs
        self._layer_plans: dict[tuple[Any, ...], LayerPlan | None] = {}
        # this step's layers planned on one grid: layer -> (its pair, dX's and dW's owners)
        self._layers: dict[str, tuple[PairPlan, dict[tuple[int, int, int], str],
                                      dict[tuple[int, int, int], str]]] = {}
        self._held: dict[str, float] = {}  # device -> bytes its layers hold for backward
        self._layer_dealt: dict[tuple[Any, ...], tuple[dict[tuple[int, int, int], str], ...]] \
            = {}
        # (submitted, done) times of the step's offloaded GEMMs, by stage key: the rest of the
        # step is the PS's own work (non-GEMM ops, small GEMMs, the engine) between them
        self._spans: list[tuple[str, bool, list[float]]] = []  # (stage, floating, span)
        # the links devices share on the way from the PS, one queue each (DeviceSlot.shared)
        self._shared = {name: SharedLink(rate) for name, rate in
                        config.shared_down_Bps.items() if 0 < rate < math.inf}
        # CPU seconds in plan() and prepare() (the calling thread's and its planning
        # processes'): what planning costs
        self.cpu_s = 0.0
        self.processes = 1  # how many processes the last prepare() searched in

    # -- devices ------------------------------------------------------------------------------
    def saw(self, slot: DeviceSlot) -> None:
        """A device took part in this step (joined or present): the bound counts it."""
        self._seen[slot.device_id] = slot
        # the scheduler's stealing and backups weigh what a device must still receive, behind
        # what its links carry (its own, and those it shares with the devices beside it)
        slot.down_Bps, slot.up_Bps = self._link(slot.group)[:2]
        slot.shared = tuple(self._shared[name] for name in
                            self.config.group_paths.get(slot.group, ()) if name in self._shared)

    def _link(self, group: str) -> tuple[float, float, float]:
        """The group's link as plans, stealing and backups weigh it: its fair share while the
        devices this step's plans count on move data (:meth:`_plan_links`)."""
        return self._plan_links().get(group) or self._own_link(group)

    def _plan_links(self) -> dict[str, tuple[float, float, float]]:
        """Per group, its fair share of the switch links it shares with some of the devices
        (``config.plan_links``: while all the topology's move data), taken again for this step's
        counts: with a tenth of large's phones-a gone, each of the rest plans with a tenth more
        of its access point. A group with none counted keeps its share of the topology's."""
        if self._links_of is not None and self._links_of[0] is self._step_counts:
            return self._links_of[1]  # asked per device per GEMM: once per set of counts
        counts = self._counts()
        key = tuple(counts.values())
        links = self._fair_links.get(key)
        if links is None:
            links = dict(self.config.plan_links)
            paths = self.config.fair_share_paths
            if any(paths.get(g) for g, n in counts.items() if n):
                own = {g: (down, up) for g, (down, up, _) in self.config.group_links.items()}
                capacity = {s: (down, up) for s, (down, up, _) in
                            self.config.switch_links.items()}
                shares = group_fair_shares_Bps(counts, own, paths, capacity)
                links.update({g: (*shares[g], self.config.group_links[g][2]) for g in shares})
            self._fair_links[key] = links
        self._links_of = (self._step_counts, links)
        return links

    def _own_link(self, group: str) -> tuple[float, float, float]:
        """The group's link as the bound counts it: what its own path carries."""
        return self.config.group_links.get(group, (INF, INF, 0.0))

    def _meet(self, slots: list[DeviceSlot]) -> None:
        """Devices a GEMM of this step sees: each new one takes the next place of the step
        (:attr:`_order`) and of its group (:attr:`_places`), by name among those met together;
        the bound counts each (:meth:`saw`)."""
        for s in sorted(slots, key=lambda s: (s.name, s.device_id)):
            if s.device_id not in self._order:
                self._order[s.device_id] = len(self._order)
                self._places[s.device_id] = self._group_met[s.group] = \
                    self._group_met.get(s.group, -1) + 1
            self.saw(s)

    def _in_order(self, slot: DeviceSlot) -> tuple[int, str, str]:
        """A device's place in this step (:attr:`_order`), then its name."""
        return (self._order.get(slot.device_id, len(self._order)), slot.name, slot.device_id)

    def _in_group(self, slot: DeviceSlot) -> int | None:
        """A device's place among its group's in this step (:attr:`_places`; None before the
        step's first GEMM met it, as when plans are prepared between steps): its pair half."""
        return self._places.get(slot.device_id)

    @staticmethod
    def half_of(slots: list[DeviceSlot], half: int | None,
                place: Callable[[DeviceSlot], int | None] = lambda _s: None
                ) -> list[DeviceSlot]:
        """The devices of one GEMM of a backward pair: every other device of each group, a
        device's half its place in its group mod 2 (``half`` 0 takes the even places); all of
        them when ``half`` is None or the half is empty. The places are ``place``'s (the
        planner's: where its step met the device, :meth:`_in_group`, so a device keeps its half
        while others come and go), where it gives none by name among ``slots``."""
        if half is None:
            return slots
        present = sorted((s for s in slots if not s.quarantined),
                         key=lambda s: (s.group, s.name, s.device_id))
        seen: dict[str, int] = {}
        out = []
        for s in present:
            by_name = seen.get(s.group, 0)
            seen[s.group] = by_name + 1
            met = place(s)
            if (by_name if met is None else met) % 2 == half:
                out.append(s)
        return out or slots

    @staticmethod
    def _halved(count: int, half: int | None) -> int:
        return count if half is None else (count + 1 - half) // 2

    def _classes(self, slots: Iterable[DeviceSlot], half: int | None = None
                 ) -> list[PlanDevice]:
        """The topology's groups, plus any group of devices present that it does not name.

        Devices the topology does not declare (phones brought in by the ADB bridge, machines
        that join over the LAN) are classes of their own, counted as they are present, so the
        plan deals them tiles like any group.
        """
        slots = list(slots)
        planned = self._counts(half)
        out = [PlanDevice(g, gflops * 1e9, *self._link(g), count=planned[g])
               for g, _, gflops in self.config.planned_groups if planned[g] > 0]
        counts: dict[tuple[str, str, float], int] = {}
        for s in slots:
            if not s.quarantined and s.group not in self._planned:
                key = (self._class_name(s), s.group, s.predicted_gflops)
                counts[key] = counts.get(key, 0) + 1
        return out + [PlanDevice(name, gflops * 1e9, *self._link(group), count=n)
                      for (name, group, gflops), n in sorted(counts.items())]

    def counts_for(self, slots: Iterable[Any]) -> dict[str, int]:
        """The devices of each topology group that plans count on with ``slots`` present
        (:func:`planned_count`)."""
        present = dict.fromkeys(self._planned, 0)
        for s in slots:
            if not s.quarantined and s.group in self._planned:
                present[s.group] += 1
        return {g: planned_count(n, present[g]) for g, n, _ in self.config.planned_groups}

    def _counts(self, half: int | None = None) -> dict[str, int]:
        """This step's counts (:attr:`_step_counts`; the topology's until some are set), of
        one half of the devices with ``half``."""
        whole = self._step_counts if self._step_counts is not None else {
            g: n for g, n, _ in self.config.planned_groups}
        return {g: self._halved(c, half) for g, c in whole.items()}

    def _adopt(self, slots: Iterable[Any]) -> None:
        """Take the counts of ``slots`` for this step when none are in force."""
        if self._step_counts is None:
            self._step_counts = self.counts_for(slots)

    def needs_prepare(self) -> bool:
        """Whether the counts the next step plans for (set by :meth:`take_step`) have no
        plans made ahead (:meth:`prepare`): the PS then prepares them between steps, off the
        loop that serves the devices, rather than search at the step's first GEMMs."""
        return (self.mode == "auto" and self._step_counts is not None and self._all_declared
                and tuple(self._step_counts.values()) not in self._prepared_counts)

    def _class_name(self, slot: DeviceSlot) -> str:
        """The plan's name for a device's class: its group, or for a device the topology does
        not declare, its group and claimed rate (two such devices of one group, or of none,
        with different rates are different classes, and each must be dealt its own count)."""
        if slot.group in self._planned:
            return slot.group
        return f"{slot.group or 'undeclared'}@{slot.predicted_gflops:g}"

    def _plan_key(self, shape: tuple[Any, ...], slots: list[DeviceSlot]) -> tuple[Any, ...]:
        """A search's cache key: the shape and the devices each group is planned for when the
        plan depends only on the topology (:meth:`_static`), else the devices present."""
        if self._static(slots):
            return (*shape, tuple(self._counts().values()))
        return (*shape, tuple(self._counts().values()),  # the links follow the counts
                tuple(sorted(s.device_id for s in slots if not s.quarantined)))

    def _static(self, slots: list[DeviceSlot]) -> bool:
        """Whether the plan depends only on the topology and the step's counts of its groups
        (then a restarted PS with as many devices of each group cuts the same)."""
        return bool(self._planned) and all(s.group in self._planned or s.quarantined
                                           for s in slots)

    # -- planning -----------------------------------------------------------------------------
    def prepare(self, linears: Iterable[tuple[int, int, int]], item: int,
                slots: Iterable[DeviceSlot], workers: int = 1,
                progress: Callable[[int, int, float], None] | None = None,
                progress_every_s: float = 10.0) -> int:
        """Plan every linear's GEMMs ahead (``linears``: (tokens, out, in) each); return how
        many shapes were planned. With ``workers`` > 1, this process and ``workers - 1``
        others search the linears side by side
        (:func:`~testbed.ps_backend.planning_processes.prepare_together`,
        :func:`planning_workers`). While they run, ``progress(shapes planned, shapes, wall s
        so far)`` is called every ``progress_every_s``, from a thread of its own
        (:class:`~testbed.ps_backend.planning_processes.Progress`).

        The searches (a linear's forward, its backward pair, both on one grid, the pair on two
        halves, the forward in regions of rows, and the pair spread with its GEMMs in regions
        where the forward takes them) are what :meth:`plan` would run at a shape's
        first GEMM, with the same inputs (the topology's groups and the devices present), and
        it then finds them made. The PS runs this before its first step, off the loop thread:
        searched at first use, they ran on the loop that serves the devices' streams, inside
        the step (seconds a shape on campus, with every device idle and its lease running), and
        the step's device time counted them. The PS runs it again between steps when the devices
        present move a group's count (:meth:`needs_prepare`). Plans that depend on the topology
        and its groups' counts alone are kept across steps; with devices the topology does not
        declare, a later change of devices plans again.
        """
        if self.mode != "auto":
            return 0
        started = time.thread_time()
        slots = list(slots)
        self._step_counts = self.counts_for(slots)
        self._all_declared = self._static(slots)
        self._prepared_counts.add(tuple(self._step_counts.values()))
        # the longest searches first (a linear's multiply-adds standing for their length), so
        # that no stream is left with a long one at the end
        shapes = sorted(set(linears), key=lambda dx: (-math.prod(dx), dx))
        self.processes = 1
        with Progress(len(shapes), progress, progress_every_s) as counted:
            if workers > 1 and len(shapes) > 1:
                self.processes = prepare_together(self, shapes, item, slots,
                                                  min(workers, len(shapes)), counted)
            else:
                for dx in shapes:
                    self.prepare_shape(dx, item, slots)
                    counted.one_done()
        self.cpu_s += time.thread_time() - started
        return len(shapes)

    def prepare_shape(self, dx: tuple[int, int, int], item: int, slots: list[Any]) -> None:
        """:meth:`prepare`'s searches for one linear (``slots``: device slots, or what a
        planning process gets of them, ``planning_processes.SlotView``)."""
        self._adopt(slots)
        self.layer_or_apart(dx, item, slots)
        t, o, i = dx
        forward = self._plan_for(t, i, o, item, slots)
        if forward is not None:  # its forward planned apart may take regions
            self._forward_regions(t, i, o, item, slots, forward)

    def prepared(self) -> tuple[dict[str, dict[Any, Any]], set[tuple[int, ...]]]:
        """What :meth:`prepare_shape` made: the search caches and the forward shapes (a
        planning process sends them to the planner that started it)."""
        return {name: getattr(self, name) for name in PREPARED_CACHES}, self._forward_shapes

    def merge_prepared(self, caches: dict[str, dict[Any, Any]],
                       forward_shapes: set[tuple[int, ...]], cpu_s: float) -> None:
        """Take another planner's :meth:`prepared` and the CPU seconds it took. Its plans are
        the ones this planner would make (the same pure searches of the same inputs), so a
        search both made is kept as it is here."""
        for name in PREPARED_CACHES:
            mine = getattr(self, name)
            for key, value in caches[name].items():
                mine.setdefault(key, value)
        self._forward_shapes |= forward_shapes
        self.cpu_s += cpu_s

    def plan(self, job: GemmJob, slots: Iterable[DeviceSlot]) -> Cut:
        """How to cut a GEMM and who owns its tiles; records it for the step's bound."""
        started = time.thread_time()
        try:
            return self._cut(job, slots)
        finally:
            self.cpu_s += time.thread_time() - started

    def _cut(self, job: GemmJob, slots: Iterable[DeviceSlot]) -> Cut:
        """:meth:`plan`'s work."""
        slots = list(slots)
        self._adopt(slots)
        self._meet(slots)
        gemm = bound_gemm(job)
        self._gemms.append(gemm)
        m, k, n, item = gemm.m, gemm.k, gemm.n, gemm.itemsize
        span = [self.clock(), math.nan]
        self._spans.append((gemm.stage, gemm.floating, span))
        def ended(_done: object, span: list[float] = span) -> None:
            span[1] = self.clock()

        job.done.add_done_callback(ended)
        pass_ = "forward" if job.spec.op == "forward" else "backward"
        self._pass_gemms[pass_] = self._pass_gemms.get(pass_, 0) + 1
        if self.mode != "auto":
            return self._fifo_cut(m, k, n, item, slots)
        half = PAIR_HALF.get(job.spec.op)
        plan: GemmPlan | None = None
        owners: dict[tuple[int, int, int], str] | None = None
        spread: tuple[int, int, int] | None = None  # the pair (T, out, in), when spread
        held = False  # its blocks are kept for backward
        if job.spec.op == "forward":
            layer = self._layer(job.spec.layer, (m, n, k), item, slots)
            if layer is not None:
                plan, owners = layer
                held = True
        elif half is not None and job.spec.layer in self._layers:
            pair, dx_owners, dw_owners = self._layers[job.spec.layer]
            plan, owners = (pair.dx, dx_owners) if half == 0 else (pair.dw, dw_owners)
        elif half is not None:
            dx = (m, k, n) if half == 0 else (k, m, n)
            joint = self._joint(dx, item, slots)
            if joint is not None:  # the pair planned as one: this GEMM's half of it
                pair, dx_owners, dw_owners = joint
                plan, owners = (pair.dx, dx_owners) if half == 0 else (pair.dw, dw_owners)
            elif not self._split_pair(dx, item, slots)[0]:
                half, spread = None, dx
        if plan is None:
            mine = self.half_of(slots, half, self._in_group)
            if mine is slots:
                half = None
            plan = self._plan_for(m, k, n, item, mine, half)
            if plan is None:
                return self._fifo_cut(m, k, n, item, slots)
            regions = self._forward_regions(m, k, n, item, mine, plan) \
                if job.spec.op == "forward" else None
            if spread is not None:  # a GEMM of a backward pair spread over every device
                regions = self._spread_regions(m, k, n, item, mine, plan, spread)
            if regions is not None:
                self._note_sat_out(pass_, *(p.sat_out for p in regions.plans))
                return self._region_cut(regions, m, k, n, item, mine)
            owners = self._owners(plan, m, k, n, item, mine)
        self._note_sat_out(pass_, plan.sat_out)
        cut = uniform(m, plan.tile_m, plan.tile_n, plan.k_parts, plan.k_block)
        self._count_shares(m, k, n, item, cut, owners, slots)
        return Cut(cut, owners, held)

    def _note_sat_out(self, pass_: str, *sat_outs: dict[str, str]) -> None:
        """Record the groups one GEMM's plans (its regions') left out, with why."""
        for group in dict.fromkeys(g for sat in sat_outs for g in sat):  # in plan order
            self._sat_out.setdefault(group, next(s[group] for s in sat_outs if group in s))
            self._sat_count[(group, pass_)] = self._sat_count.get((group, pass_), 0) + 1

    def _fifo_cut(self, m: int, k: int, n: int, item: int, slots: list[DeviceSlot]) -> Cut:
        """The configured square tiles, anyone's (``fifo``, or no plan)."""
        self._count_shares(m, k, n, item, (), None, slots)
        return Cut(uniform(m, self.config.tile_m, self.config.tile_n), None)

    def region_shapes(self) -> list[str]:
        """The forward GEMM shapes (``m x k x n``) planned in regions of rows so far (a
        backward pair spread over every device may cut its GEMMs so too where its forward is
        one of them, :meth:`_spread_regions`)."""
        return sorted({f"{key[0]}x{key[1]}x{key[2]}" for key, found in
                       self._region_plans.items()
                       if found is not None and tuple(key[:3]) in self._forward_shapes})

    def _forward_regions(self, m: int, k: int, n: int, item: int, slots: list[DeviceSlot],
                         plan: GemmPlan) -> RegionPlan | None:
        """:meth:`_regions_for` of a forward GEMM (:meth:`region_shapes` lists those)."""
        self._forward_shapes.add((m, k, n))
        return self._regions_for(m, k, n, item, slots, plan)

    def _regions_for(self, m: int, k: int, n: int, item: int, slots: list[DeviceSlot],
                     plan: GemmPlan) -> RegionPlan | None:
        """A GEMM's rows in two runs, each planned on one side of the classes, when that is
        predicted faster (``REGION_GAIN``) than ``plan``, its one grid; else None. Asked of
        forward GEMMs and of the GEMMs of a backward pair spread over every device (a pair's
        other ways of sharing the devices, halves, one grid or the joint pair, cut no regions)."""
        key = self._plan_key((m, k, n, item), slots)
        if key not in self._region_plans:
            ps_down_Bps, ps_up_Bps = self.config.ps_link_Bps
            found = plan_regions(m, k, n, item, self._classes(slots), ps_down_Bps, ps_up_Bps,
                                 max_tile_elems=self._max_tile_elems(item),
                                 beat_s=REGION_GAIN * plan.predicted_s)
            self._region_plans[key] = found if found is not None and \
                found.predicted_s < REGION_GAIN * plan.predicted_s else None
        return self._region_plans[key]

    def _region_cut(self, regions: RegionPlan, m: int, k: int, n: int, item: int,
                    slots: list[DeviceSlot]) -> Cut:
        """The cut of a region plan: each run's tiles, their rows numbered through the runs,
        dealt to the devices of its own plan."""
        cuts, owners = [], {}
        rows = 0
        for r0, r1, plan in zip(regions.bounds, regions.bounds[1:], regions.plans):
            cuts.append(Region(r0, r1, plan.tile_m, plan.tile_n, plan.k_parts, plan.k_block))
            for (r, c, p), name in (self._owners(plan, r1 - r0, k, n, item, slots) or {}).items():
                owners[(r + rows, c, p)] = name
            rows += cuts[-1].tile_rows  # the tiler's numbering of the runs' tile rows
        self._count_shares(m, k, n, item, tuple(cuts), owners, slots)
        return Cut(tuple(cuts), owners)

    def _count_shares(self, m: int, k: int, n: int, item: int, cut: Sequence[Region],
                      owners: dict[tuple[int, int, int], str] | None,
                      slots: list[DeviceSlot]) -> None:
        """Add the GEMM's minimal traffic for the devices the plan used, with their shares.

        With owners, a device's share is the multiply-adds of the tiles of ``cut`` dealt to
        it; without (``fifo``, or nobody of the plan present), the devices present share
        equally.
        """
        shares: list[float]
        if owners:
            by_device: dict[str, float] = {}
            for b in cut_regions(n, k, cut):
                owner = owners.get((b.row, b.col, b.part))
                k0, k1 = (b.k0, b.k1) if b.split else (0, k)
                by_device[owner or ""] = by_device.get(owner or "", 0.0) + \
                    (b.r1 - b.r0) * (b.c1 - b.c0) * (k1 - k0)
            shares = list(by_device.values())
        else:
            p = max(1, sum(1 for s in slots if not s.quarantined))
            shares = [m * k * n / p] * p
        down, up = comm_min_shares(m, k, n, shares, item)
        self._min_down += down
        self._min_up += up

    def _split_pair(self, dx: tuple[int, int, int], item: int, slots: list[DeviceSlot]
                    ) -> tuple[bool, float]:
        """Whether a backward pair (``dX[T x in] = dY[T x out]·W``, ``dW[out x in] =
        dYᵀ·X``; ``dx`` = (T, out, in)) is faster on two halves of the devices, one GEMM each,
        than with both GEMMs spread over every device (predicted: the slower half against
        the two together, :func:`predict_together_s`, each in regions of rows where
        :meth:`_spread_regions` finds them), and the predicted time of the choice."""
        # by the step's counts when plans depend on them alone: keyed by device, a run under
        # churn searched again (and kept) a choice per set of devices, each rejoin a new id
        key = self._plan_key((dx, item), slots)
        known = self._pair_split.get(key)
        if known is not None:
            return known
        t, o, i = dx
        halves = [self.half_of(slots, h, self._in_group) for h in (0, 1)]
        split, predicted_s = False, INF
        spread = [self._plan_for(t, o, i, item, slots), self._plan_for(o, t, i, item, slots)]
        if spread[0] is not None and spread[1] is not None:
            predicted_s = predict_together_s(
                self._runs(t, o, i, item, slots, spread[0], dx) +
                self._runs(o, t, i, item, slots, spread[1], dx),
                item, self._classes(slots), *self.config.ps_link_Bps)
        if halves[0] is not slots and halves[1] is not slots:
            plans = [self._plan_for(t, o, i, item, halves[0], 0),
                     self._plan_for(o, t, i, item, halves[1], 1)]
            if plans[0] is not None and plans[1] is not None:
                halved_s = max(plans[0].predicted_s, plans[1].predicted_s)
                split = halved_s < predicted_s
                if split:
                    predicted_s = halved_s
        self._pair_split[key] = split, predicted_s
        return split, predicted_s

    def _runs(self, m: int, k: int, n: int, item: int, slots: list[DeviceSlot],
              plan: GemmPlan, dx: tuple[int, int, int]) -> list[tuple[int, int, int, GemmPlan]]:
        """A GEMM of the pair ``dx`` as :func:`predict_together_s` takes it: its runs of rows
        with their plans when it takes regions (:meth:`_spread_regions`), else the whole GEMM
        on ``plan``."""
        regions = self._spread_regions(m, k, n, item, slots, plan, dx)
        if regions is None:
            return [(m, k, n, plan)]
        return [(r1 - r0, k, n, p) for r0, r1, p in
                zip(regions.bounds, regions.bounds[1:], regions.plans)]

    def _spread_regions(self, m: int, k: int, n: int, item: int, slots: list[DeviceSlot],
                        plan: GemmPlan, dx: tuple[int, int, int]) -> RegionPlan | None:
        """A GEMM of the backward pair ``dx`` = (T, out, in), spread over every device, in
        regions of rows (:meth:`_regions_for`). Searched only for a linear whose forward took
        regions: the same devices on the same cube of multiply-adds; elsewhere the searches
        (two a GEMM) doubled campus's planning and found nothing."""
        t, o, i = dx
        forward = self._plan_for(t, i, o, item, slots)
        if forward is None or self._forward_regions(t, i, o, item, slots, forward) is None:
            return None
        return self._regions_for(m, k, n, item, slots, plan)

    def _joint(self, dx: tuple[int, int, int], item: int, slots: list[DeviceSlot]
               ) -> tuple[PairPlan, dict[tuple[int, int, int], str],
                          dict[tuple[int, int, int], str]] | None:
        """The pair planned as one (``dx`` = (T, out, in)) with the owners of both GEMMs'
        tiles, when that is predicted faster (``PAIR_JOINT_GAIN``) than planning them apart;
        else None."""
        pair = self._pair_plan(dx, item, slots)
        if pair is None or pair.predicted_s >= PAIR_JOINT_GAIN * \
                self._split_pair(dx, item, slots)[1]:
            return None
        devices = self._taking_part(pair.used, pair.counts, slots)
        if not devices:
            return None
        t, o, i = dx
        key = (dx, item, pair.grid, tuple(sorted(d.name for d in devices)))
        owners = self._pair_dealt.get(key)
        if owners is None:
            owners = self._pair_dealt[key] = deal_pair(pair, t, o, i, item, devices)
        return pair, *owners

    def layer_or_apart(self, dx: tuple[int, int, int], item: int, slots: list[DeviceSlot]
                       ) -> tuple[LayerPlan | None, float]:
        """A linear's plan on one grid (``dx`` = (T, out, in); None when no grid fits) and
        the predicted time of planning its forward and its backward pair apart (forward's own
        plan and the pair's best)."""
        t, o, i = dx
        key = self._plan_key((dx, item), slots)
        if key not in self._layer_plans:
            classes = self._classes(slots)
            ps_down_Bps, ps_up_Bps = self.config.ps_link_Bps
            self._layer_plans[key] = None if not classes else plan_layer(
                t, o, i, item, classes, ps_down_Bps, ps_up_Bps,
                max_tile_elems=self._max_tile_elems(item))
        forward = self._plan_for(t, i, o, item, slots)
        pair = self._pair_plan(dx, item, slots)
        apart = (forward.predicted_s if forward else INF) + min(
            self._split_pair(dx, item, slots)[1], pair.predicted_s if pair else INF)
        return self._layer_plans[key], apart

    def _layer(self, layer: str, dx: tuple[int, int, int], item: int,
               slots: list[DeviceSlot]) -> tuple[GemmPlan, dict[tuple[int, int, int], str]
                                                 ] | None:
        """A linear's forward plan and owners on its layer grid (``dx`` = (T, out, in)), its
        pair's kept for the backward pass, when that is predicted faster (``LAYER_GAIN``) and
        the blocks the devices must hold fit their caches (``HELD_SHARE``); else None."""
        t, o, i = dx
        plan, apart = self.layer_or_apart(dx, item, slots)
        if plan is None or plan.predicted_s >= LAYER_GAIN * apart:
            return None
        devices = self._taking_part(plan.pair.used, plan.pair.counts, slots)
        if not devices:
            return None
        key = (dx, item, plan.pair.grid, tuple(sorted(d.name for d in devices)))
        if key not in self._layer_dealt:  # the layers of a stack: one shape, the same owners
            self._layer_dealt[key] = deal_layer(plan, t, o, i, item, devices)
        fwd, dx_owners, dw_owners = self._layer_dealt[key]
        tm, to = plan.forward.tile_m, plan.forward.tile_n
        tc = math.ceil(i / plan.pair.grid[2])  # a K slice of forward: a block's columns
        held: dict[str, float] = {}
        blocks: set[tuple[str, str, int, int]] = set()
        for (tb, ob, c), name in fwd.items():  # each device's X[t, c] and W[o, c], once
            for what, row, size in (("x", tb, tm * tc), ("w", ob, to * tc)):
                if (name, what, row, c) not in blocks:
                    blocks.add((name, what, row, c))
                    held[name] = held.get(name, 0.0) + size * item
        budget = {s.device_id: s.cache_bytes for s in slots}
        if any(self._held.get(d, 0.0) + b > HELD_SHARE * budget.get(d, 0)
               for d, b in held.items()):
            return None
        for d, b in held.items():
            self._held[d] = self._held.get(d, 0.0) + b
        self._layers[layer] = (plan.pair, dx_owners, dw_owners)
        return plan.forward, fwd

    def _pair_plan(self, dx: tuple[int, int, int], item: int, slots: list[DeviceSlot]
                   ) -> PairPlan | None:
        key = self._plan_key((dx, item), slots)
        if key in self._pair_plans:
            return self._pair_plans[key]
        classes = self._classes(slots)
        pair = None
        if classes:
            ps_down_Bps, ps_up_Bps = self.config.ps_link_Bps
            pair = plan_pair(*dx, item, classes, ps_down_Bps, ps_up_Bps,
                             max_tile_elems=self._max_tile_elems(item))
        self._pair_plans[key] = pair
        return pair

    def _max_tile_elems(self, item: int) -> int:
        """The most elements a tile's block may have: two blocks go in one message, with 64 KB
        to spare for the rest of it."""
        return max(1, (self.config.max_message_bytes - 65536) // (2 * item))

    def _plan_for(self, m: int, k: int, n: int, item: int, slots: list[DeviceSlot],
                  half: int | None = None) -> GemmPlan | None:
        # the whole counts, not the half's: the links a plan weighs follow them (6 and 5
        # phones both halve to 3, at different shares of a switch link; _plan_links)
        key = (m, k, n, item, half, tuple(self._counts().values()))
        static = self._static(slots)
        plan = self._plans.get(key) if static else None
        if plan is None:
            classes = self._classes(slots, half)
            if not classes:
                return None
            ps_down_Bps, ps_up_Bps = self.config.ps_link_Bps
            if half is not None:  # the other GEMM of the pair crosses the PS link meanwhile
                ps_down_Bps, ps_up_Bps = ps_down_Bps / 2, ps_up_Bps / 2
            plan = plan_gemm(m, k, n, item, classes, ps_down_Bps, ps_up_Bps,
                             max_tile_elems=self._max_tile_elems(item))
            if static:  # the same cut after a restart
                self._plans[key] = plan
        return plan

    def _taking_part(self, used_classes: tuple[str, ...], counts: dict[str, int],
                     slots: list[DeviceSlot]) -> list[PlanDevice]:
        """The devices present that a plan counted on, with their observed rates."""
        used = set(used_classes)
        devices = []
        taken: dict[str, int] = {}
        # a class the plan takes only some devices of: the first that many in this step's
        # order (the same devices for every GEMM of the shape, so they hold its blocks)
        for s in sorted(slots, key=self._in_order):
            name = self._class_name(s)
            if s.quarantined or name not in used:
                continue
            if taken.get(name, 0) >= counts.get(name, len(slots)):
                continue
            taken[name] = taken.get(name, 0) + 1
            devices.append(PlanDevice(s.device_id, max(s.rate_flops, 1.0),
                                      *self._link(s.group)))
        return devices

    def _owners(self, plan: GemmPlan, m: int, k: int, n: int, item: int,
                slots: list[DeviceSlot]) -> dict[tuple[int, int, int], str] | None:
        devices = self._taking_part(plan.used, plan.counts, slots)
        if not devices:
            return None  # nobody the plan counted on is here: anyone takes the tiles
        # The same shape dealt to the same devices again in this step (the layers of a stack,
        # forward and backward) gets the same owners, so a device gets the blocks it may still
        # hold (the operands shared between GEMMs are cached by tensor, not by GEMM); rates
        # observed in between would otherwise shift the boxes' boundaries.
        key = (m, k, n, item, plan.tile_m, plan.tile_n, plan.k_parts,
               tuple(sorted(d.name for d in devices)))
        owners = self._dealt.get(key)
        if owners is None:
            owners = self._dealt[key] = deal_boxes(plan, m, k, n, item, devices)
        return owners

    # -- the step -----------------------------------------------------------------------------
    def bound_devices(self) -> list[BoundDevice]:
        """The devices of this step as the bound sees them (fastest rate seen, topology links)."""
        out = []
        for s in self._seen.values():
            if s.quarantined:
                continue
            down, up, rtt = self._own_link(s.group)
            rate = max(s.predicted_gflops * 1e9, s.peak_rate_flops, s.rate_flops)
            link = lowest_switch_link(self.config.group_paths.get(s.group, ()),
                                      self.config.switch_links)
            out.append(BoundDevice(s.name, rate, down, up, rtt, link))
        return out

    def bound_links(self) -> dict[str, SwitchLink]:
        """The switch links the bound caps the devices below each by."""
        return {name: SwitchLink(*v) for name, v in self.config.switch_links.items()}

    def take_step(self, present: Iterable[DeviceSlot]) -> StepRecord:
        """The step's record; starts the next step with the devices present now."""
        ps_down, ps_up = self.config.ps_link_Bps
        sb = step_bound(self._gemms, self.bound_devices(), PsLink(ps_down, ps_up),
                        self.bound_links())
        limits: dict[str, int] = {}
        for stage in sb.stages:
            term = "gemm" if stage.limit.startswith("gemm") else stage.limit
            limits[term] = limits.get(term, 0) + 1
        now = self.clock()
        # a stage's time is its chained GEMMs' (a floating one runs on into later stages),
        # the last stage's every GEMM's (as its bound counts them)
        last = sb.stages[-1].stage if sb.stages else None
        by_stage: dict[str, list[list[float]]] = {}
        for key, floating, span in self._spans:
            if not floating or key == last:
                by_stage.setdefault(key, []).append(span)
        stages = [(b.stage, busy_s(by_stage.get(b.stage, []), now), b.bound_s, b.limit)
                  for b in sb.stages]
        sat_out = {g: sat_out_scope(why, {p: self._sat_count.get((g, p), 0) for p in PASSES},
                                    self._pass_gemms) for g, why in self._sat_out.items()}
        record = StepRecord(sb.bound_s if self._gemms else 0.0, self._min_down, self._min_up,
                            len(self._gemms), sat_out, limits,
                            busy_s([span for _, _, span in self._spans], now), stages)
        self._gemms, self._sat_out, self._dealt, self._spans = [], {}, {}, []
        self._sat_count, self._pass_gemms = {}, {}
        self._pair_dealt, self._layers, self._held, self._layer_dealt = {}, {}, {}, {}
        self._min_down = self._min_up = 0.0
        self._seen = {s.device_id: s for s in present}
        self._order, self._places, self._group_met = {}, {}, {}
        # the next step plans for the devices present now: counts change between steps only,
        # so a linear's forward and backward are planned for the same devices
        self._step_counts = self.counts_for(self._seen.values())
        self._all_declared = self._static(list(self._seen.values()))
        return record


def planning_workers() -> int:
    """How many processes :meth:`StepPlanner.prepare` should search in: one a core this
    process may run on (``prepare`` takes no more than it has linears)."""
    return max(1, len(os.sched_getaffinity(0)))


def busy_s(spans: list[list[float]], now: float) -> float:
    """Length of the union of (start, end) intervals; an unfinished one ends ``now``."""
    total, reach = 0.0, -math.inf
    for start, end in sorted((a, now if math.isnan(b) else b) for a, b in spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
