"""Where a baseline's pieces go: pipeline stages and data-parallel replicas, within memory.

**Pipeline placement** (a simpler relative of DT-FM's search, Yuan et al. 2022, arXiv
2206.01288): devices are ordered fastest first (profile GFLOPS over the expected straggler
slowdown, then memory); for every stage count ``S`` from 1 to ``min(devices, layers)`` the
first ``S`` devices take contiguous runs of decoder layers (stage 0 adds the embeddings, the
last stage the final norm and LM head, which holds a copy of the tied embedding; a single
stage holds the tied weight once). The cut
minimises the slowest stage's time per micro-batch under each device's memory (bisection on
that time; a greedy fill checks each candidate, which is exact for contiguous cuts in a fixed
device order). Among the stage counts the plan with the smallest GPipe estimate
``(m + S - 1) · max(stage time, boundary transfer)`` wins. A plan is refused (:class:`FitError`)
when no stage count fits: the message names the devices, their usable memory and the bytes a
layer needs.

**Data-parallel replicas**: every device whose memory holds the whole model (weights,
gradients, Adam's moments, the activations of its share of the batch) is a replica, fastest
first, at most one per sequence of the batch. None fits: :class:`FitError`.

Planning uses the profiles' sustained GFLOPS and, when the profile has a model, its memory
bandwidth (else :data:`DEFAULT_MEMORY_BYTES_S`), both over the expected slowdown of the
device's straggling (:func:`straggler_mean`: a group's ``behaviour.straggler`` is part of the
topology, as DT-FM's scheduler profiles the devices it places on, and tile-tp's PS measures
the rate each device delivers); the simulator then times what the plan says with the full
device models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from testbed.baselines import cost
from testbed.baselines.memory import device_memory, gib
from testbed.emulator.network.base import loss_cap_bps
from testbed.errors import InputError
from testbed.perf_model.profiles import DeviceProfile, load_profile
from testbed.topology import DeviceSpec, JobSpec, Topology

DEFAULT_MEMORY_BYTES_S = 10e9  # a profile without a model: LPDDR4-class phone memory (assumed)


class FitError(InputError):
    """A strategy no placement of the model fits on these devices."""


@dataclass(frozen=True)
class DeviceInfo:
    """What placement needs to know about one device."""

    name: str
    group: str
    profile: str
    gflops: float
    memory_bytes_s: float
    usable_bytes: int
    ram_bytes: int
    up_bps: float  # the device's link, capped by its path's loss (loss_cap_bps)
    down_bps: float
    slowdown: float = 1.0  # expected compute factor of its group's straggling (straggler_mean)


@dataclass(frozen=True)
class PipelinePlan:
    devices: tuple[str, ...]  # stage s runs on devices[s]
    bounds: tuple[tuple[int, int], ...]  # decoder layers [first, end) of each stage
    micro_batches: int
    stage_bytes: tuple[int, ...]  # memory each stage needs
    estimate_s: float  # the planner's GPipe estimate of one step


@dataclass(frozen=True)
class DataParallelPlan:
    replicas: tuple[str, ...]
    rows: tuple[int, ...]  # sequences of the batch each replica trains on
    replica_bytes: int  # memory each replica needs (the largest share)
    left_out: tuple[str, ...]  # devices too small for a replica, or beyond one per sequence


def device_infos(topology: Topology, names: set[str] | None = None) -> list[DeviceInfo]:
    """Placement facts of the topology's devices (only ``names`` if given)."""
    profiles: dict[str, DeviceProfile] = {}
    out = []
    for d in topology.devices:
        if names is not None and d.name not in names:
            continue
        g = d.group
        if g.group not in profiles:
            profiles[g.group] = load_profile(str(g.profile_path), check=False)
        p = profiles[g.group]
        mem = device_memory(p)
        bw = p.model.bandwidth_bytes_s if p.model is not None else DEFAULT_MEMORY_BYTES_S
        cap = loss_cap_bps(topology, d)  # what TCP gets through a lossy path, as tile-tp's plans
        out.append(DeviceInfo(d.name, g.group, g.profile, p.sustained_gflops, bw,
                              mem.usable_bytes, mem.ram_bytes, min(d.link.up_bps, cap),
                              min(d.link.down_bps, cap), straggler_mean(d)))
    return out


def straggler_mean(device: DeviceSpec) -> float:
    """The expected factor on a piece's time of its group's ``behaviour.straggler``:
    ``E = 1 + rate · (factor - 1)`` (a share ``rate`` of the pieces takes ``factor`` times as
    long, the device model's draw per piece); 1 without straggling."""
    b = device.group.behaviour
    spec = b.straggler if b is not None else None
    if spec is None or spec.factor <= 1:
        return 1.0
    return 1.0 + spec.rate * (spec.factor - 1.0)


def describe_devices(devices: list[DeviceInfo]) -> str:
    """'phones: 15 x 4.00 GiB usable (of 8.00 GiB, snapdragon888)' per group."""
    groups: dict[str, list[DeviceInfo]] = {}
    for d in devices:
        groups.setdefault(d.group, []).append(d)
    return "; ".join(f"{g}: {len(ds)} x {gib(ds[0].usable_bytes)} usable (of "
                     f"{gib(ds[0].ram_bytes)}, {ds[0].profile})" for g, ds in groups.items())


def _order(devices: list[DeviceInfo]) -> list[DeviceInfo]:
    return sorted(devices, key=lambda d: (-d.gflops / d.slowdown, -d.usable_bytes))


@dataclass(frozen=True)
class _Needs:
    layer_s: float  # per device GFLOP/s = 1: the layer's (fwd + bwd) FLOPs
    layer_mem_bytes: float  # per layer, all micro-batches' activations included
    layer_el_bytes: float
    embed_mem_bytes: float
    head_flops: float
    head_el_bytes: float
    head_mem_bytes: float
    tied_mem_bytes: float  # the head's tied weight: held once by a stage that is first and last
    boundary_bytes: float


def _needs(job: JobSpec, micro_batches: int) -> _Needs:
    spec, b = job.model, cost.DTYPE_BYTES[job.dtype]
    rows = math.ceil(job.batch_size / micro_batches)
    lf, lb = cost.layer_gemms(spec, rows)
    hf, hb = cost.head_gemms(spec, rows)
    le = sum(cost.layer_elementwise_bytes(spec, rows, b))
    he = sum(cost.head_elementwise_bytes(spec, rows, b))
    return _Needs(
        layer_s=sum(g.flops for g in lf + lb),
        layer_mem_bytes=cost.state_bytes(cost.layer_params(spec), b)
        + micro_batches * cost.layer_activation_bytes(spec, rows, b),
        layer_el_bytes=le,
        embed_mem_bytes=cost.state_bytes(cost.embed_params(spec), b),
        head_flops=sum(g.flops for g in hf + hb), head_el_bytes=he,
        head_mem_bytes=cost.state_bytes(cost.head_params(spec), b)
        + micro_batches * cost.head_activation_bytes(spec, rows, b),
        tied_mem_bytes=cost.state_bytes(cost.tied_params(spec), b),
        boundary_bytes=cost.boundary_bytes(spec, rows, b))


def _layer_time(n: _Needs, d: DeviceInfo) -> float:
    return (n.layer_s / (d.gflops * 1e9) + n.layer_el_bytes / d.memory_bytes_s) * d.slowdown


def _head_time(n: _Needs, d: DeviceInfo) -> float:
    return (n.head_flops / (d.gflops * 1e9) + n.head_el_bytes / d.memory_bytes_s) * d.slowdown


def _fixed_mem(n: _Needs, first: bool, last: bool) -> float:
    """Memory of a stage's embeddings (first stage) and head (last stage), as
    :func:`~testbed.baselines.cost.stage_params` counts them."""
    mem = n.embed_mem_bytes if first else 0.0
    if last:
        mem += n.head_mem_bytes - (n.tied_mem_bytes if first else 0.0)
    return mem


def _fill(n: _Needs, devs: list[DeviceInfo], layers: int, limit_s: float
          ) -> list[tuple[int, int]] | None:
    """Greedy contiguous cut with every stage within limit_s and its device's memory."""
    bounds, i = [], 0
    last = len(devs) - 1
    for s, d in enumerate(devs):
        fixed_mem = _fixed_mem(n, s == 0, s == last)
        fixed_s = _head_time(n, d) if s == last else 0.0
        lt = _layer_time(n, d)
        take = layers - i - (last - s)  # leave one layer for each later stage
        if s == last:
            if layers - i < 1:
                return None
            take = layers - i
            ok = fixed_mem + take * n.layer_mem_bytes <= d.usable_bytes and \
                fixed_s + take * lt <= limit_s
            if not ok:
                return None
        else:
            by_mem = math.floor((d.usable_bytes - fixed_mem) / n.layer_mem_bytes)
            by_time = (math.floor((limit_s - fixed_s) / lt * (1 + 1e-12))
                       if lt > 0 and math.isfinite(limit_s) else take)
            take = min(take, by_mem, by_time)
            if take < 1:
                return None
        bounds.append((i, i + take))
        i += take
    return bounds if i == layers else None


def _estimate(n: _Needs, devs: list[DeviceInfo], bounds: list[tuple[int, int]], m: int) -> float:
    stage_s = []
    for s, (d, (a, b)) in enumerate(zip(devs, bounds)):
        t = (b - a) * _layer_time(n, d) + (_head_time(n, d) if s == len(devs) - 1 else 0.0)
        stage_s.append(t)
    hops = [n.boundary_bytes * 8 / min(devs[s].up_bps, devs[s + 1].down_bps)
            for s in range(len(devs) - 1)]
    return (m + len(devs) - 1) * max(stage_s + hops)


def plan_pipeline(job: JobSpec, devices: list[DeviceInfo]) -> PipelinePlan:
    """The fastest-estimated placement of contiguous stages that fits; FitError if none does."""
    m = job.parallelism.micro_batches
    n = _needs(job, m)
    layers = job.model.layers
    ordered = _order(devices)
    best: PipelinePlan | None = None
    for stages in range(1, min(len(ordered), layers) + 1):
        devs = ordered[:stages]
        hi = sum(layers * _layer_time(n, d) + _head_time(n, d) for d in devs)
        if _fill(n, devs, layers, hi) is None:
            continue  # memory: no cut over these devices fits at any speed
        lo = 0.0
        for _ in range(50):
            mid = (lo + hi) / 2
            if _fill(n, devs, layers, mid) is None:
                lo = mid
            else:
                hi = mid
        bounds = _fill(n, devs, layers, hi)
        assert bounds is not None
        est = _estimate(n, devs, bounds, m)
        if best is None or est < best.estimate_s:
            mem = tuple(int(_fixed_mem(n, s == 0, s == stages - 1) + (b - a) * n.layer_mem_bytes)
                        for s, (a, b) in enumerate(bounds))
            best = PipelinePlan(tuple(d.name for d in devs), tuple(bounds), m, mem, est)
    if best is None:
        spec = job.model
        raise FitError("job.parallelism.strategy", [
            f"pipeline: no placement of the model ({spec.layers} layers, hidden {spec.hidden}, "
            f"{cost.model_params(spec):,} parameters) fits these devices' memory. A layer needs "
            f"{gib(n.layer_mem_bytes)} (weights, gradients, Adam's two moments and the "
            f"activations of all {m} micro-batch(es) in flight), the first stage's embeddings "
            f"{gib(n.embed_mem_bytes)} more, the last stage's head {gib(n.head_mem_bytes)} "
            f"more; the devices: {describe_devices(devices)}"])
    return best


def pipeline_fits(job: JobSpec, devices: list[DeviceInfo]) -> bool:
    """Whether any contiguous cut fits the devices' memory (speed aside).

    More stages never need more memory per stage, so the most stages over the devices with the
    most memory decide."""
    ordered = sorted(devices, key=lambda d: -d.usable_bytes)[:job.model.layers]
    return bool(ordered) and _fill(_needs(job, job.parallelism.micro_batches), ordered,
                                   job.model.layers, math.inf) is not None


def plan_data_parallel(job: JobSpec, devices: list[DeviceInfo]) -> DataParallelPlan:
    """Every device that holds a whole replica, at most one per sequence; FitError if none."""
    ordered = _order(devices)
    count = min(len(ordered), job.batch_size)
    while True:
        rows = math.ceil(job.batch_size / max(count, 1))
        need = cost.replica_bytes(job, rows)
        fit = [d for d in ordered if d.usable_bytes >= need][:count]
        if len(fit) == count or not fit:
            break
        count = len(fit)
    if not fit:
        spec, b = job.model, cost.DTYPE_BYTES[job.dtype]
        raise FitError("job.parallelism.strategy", [
            f"data-parallel: no device holds a replica of the model ({cost.model_params(spec):,} "
            f"parameters): {gib(need)} each (weights, gradients and Adam's two moments "
            f"{gib(cost.state_bytes(cost.model_params(spec), b))}, activations of {rows} "
            f"sequences); the devices: {describe_devices(devices)}"])
    shares = cost.split_rows(job.batch_size, len(fit))
    chosen = {d.name for d in fit}
    return DataParallelPlan(tuple(d.name for d in fit), tuple(b - a for a, b in shares), need,
                            tuple(d.name for d in ordered if d.name not in chosen))


def fit_problems(topology: Topology) -> list[str]:
    """The memory-fit problems of the topology's strategy (empty: it fits, or tile-tp)."""
    strategy = topology.job.parallelism.strategy
    if strategy == "tile-tp":
        return []
    devices = device_infos(topology)
    try:
        if strategy == "pipeline":
            plan_pipeline(topology.job, devices)
        else:
            plan_data_parallel(topology.job, devices)
    except FitError as exc:
        return [f"{exc.source}: {p}" for p in exc.problems]
    return []
