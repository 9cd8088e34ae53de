"""The topology file: schema, validation, and the frozen objects the rest of testbed reads.

A topology is plain data. ``load_topology`` reads a YAML file, checks *all* of it, and either
returns a :class:`Topology` or raises one :class:`TopologyError` that lists every problem with its
YAML path (``devices[1].link.up: unknown rate unit 'Mbits' ...``). Nothing is started here; the
network backends and ``testbed up`` realize a Topology.

Schema (units are always written out, see :mod:`testbed.units`)::

    name: home-wifi                 # [a-z0-9-], at most 24 characters; names the run directory
    seed: 7                         # seeds model init, data order, churn generators, noise
    network:
      backend: auto                 # auto | loopback | mininet (auto: mininet if root and present)
      switches: [core, ap0]         # switch names; each device group and the PS attach to one
      links:                        # switch-to-switch links; the first switch is nearer the PS
        - {switches: [core, ap0], down: 1Gbit, up: 1Gbit, delay: 1ms}
      ps: {switch: core, link: {down: 1Gbit, up: 1Gbit, delay: 1ms}}
      # ps: {listen: 0.0.0.0:50051}  # opt-in: devices on other machines join over TLS
    devices:
      - group: phones               # [a-z0-9-]; device names are <group>-<index>
        profile: snapdragon888      # a profile name (testbed/perf_model/profiles) or a YAML path
        count: 6
        switch: ap0
        link: {down: 100Mbit, up: 20Mbit, delay: 10ms, loss: 0.5%, queue: 100}
        cache: 256MiB               # optional, emulated devices: each one's operand-block cache
                                    # (default: a step's operands, 64-768 MiB; 1MiB-64GiB)
        behaviour:                  # optional, emulated devices only: how they misbehave
          byzantine: {rate: 20%, modes: [noise, bitflip, stale, scale], noise: 0.01, scale: 1.5}
          straggler: {factor: 3.0, rate: 100%}   # compute time x factor on a share of tiles
    job:
      model: {family: opt, hidden: 256, layers: 4, heads: 4, ffn: 1024, seq_len: 128}
      data: builtin                 # builtin (Python's own sources) or {files: [paths]}
      batch_size: 8
      steps: 20
      dtype: float32                # float32 | float64 (parity tests use float64)
      optimizer: {name: adamw, lr: 3e-4, weight_decay: 0.0}
      parallelism: {strategy: tile-tp, tile: 128, min_offload_flops: 1e6, planner: auto}
        # strategy: tile-tp | pipeline | data-parallel (docs/baselines.md); the baselines add
        # micro_batches (GPipe, default min(4, batch_size)), local_steps (data-parallel: 1 =
        # average every step, H > 1 = DiLoCo) and checkpoint_every (pipeline, steps)
      validation: {enabled: true, freivalds_vectors: 1, quarantine_after: 3}
      watchdog: {no_progress_s: 120}  # fail the run after this long without progress; 0 = off
    churn: traces/flaky-phones.csv  # optional, relative to the topology file
    time_dilation: auto             # auto | {target_p95: 10%} (adaptive) | a number >= 1 (fixed)

Link directions: ``down`` is PS -> device (the device's downlink), ``up`` is device -> PS. A rate is
what the application's bytes get (TCP payload, as a speed test reports it), on both network
backends, in the simulator and in the bound (docs/network.md, "A rate is the payload's"). A link's
``queue`` is in packets. Rates of behaviours are a share of tiles: a number in [0, 1] or a
percentage (``20%``); ``byzantine.noise`` is the noise's standard deviation relative to the tile's
RMS, ``byzantine.scale`` the factor a scaled tile is multiplied by. ``validation.quarantine_after``
counts failed checks (0: never quarantine). Relative paths (profiles, data files, churn) are
resolved against the directory of the topology file and stored absolute.

How it is checked: pydantic models (``TopologyFile`` and its parts, on :mod:`testbed.schema`)
describe the file; each has ``spec()`` that builds the frozen dataclass below, which is all the
rest of testbed reads (pydantic stays inside loading). Limits (``MAX_*`` below, each with its
reason) refuse absurd values: rates under 1 kbit/s or over 1 Tbit/s, delays over 60 s, a loss
of 100%, more than 10,000 devices, models beyond ~3x the largest published ones or 2^34
parameters, NaN or infinite floats. The YAML itself may not write a key twice in one mapping
(PyYAML would keep the last) or nest more than 100 levels (:func:`~testbed.user_paths.
load_user_yaml`).

Adding a key:

* a section owned by another part (``simulation:``, ``planner:``): one line in :data:`SECTIONS`,
  ``"simulation": "testbed.simulate.config:SimulationSection"``, naming the owner's
  :class:`~testbed.schema.Schema` model. It is imported only when a file has the key; its
  ``spec()`` (or the model itself) is ``topology.extra["simulation"]``, absent when the file
  leaves the key out (``simulation:`` with nothing under it gives the model's defaults).
* a key of a section read here (``job.parallelism.k_split``): the field on the ``...File``
  model, the field on its dataclass, and the value passed in the model's ``spec()``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from testbed import units
from testbed.agent.tls import parse_address
from testbed.emulator.dilation import DEFAULT_TARGET_P95
from testbed.errors import InputError
from testbed.names import is_name, name_problem
from testbed.schema import Bool, Float, Int, Schema, Str, parse, scratch, unique
from testbed.user_paths import input_problem, load_user_yaml, read_user_text, user_path

BACKENDS = ("auto", "loopback", "mininet")
DTYPES = ("float32", "float64")


class TopologyError(InputError):
    """Every problem found in one topology file, each with its YAML path."""


@dataclass(frozen=True)
class LinkSpec:
    """One bidirectional link. ``down`` = towards the devices, ``up`` = towards the PS."""

    down_bps: float
    up_bps: float
    delay_s: float = 0.0  # one-way, applied in each direction
    loss_fraction: float = 0.0  # per packet, each direction
    queue_packets: int | None = None

    def to_yaml(self) -> dict[str, Any]:
        out: dict[str, Any] = {"down": units.format_rate(self.down_bps),
                               "up": units.format_rate(self.up_bps),
                               "delay": f"{self.delay_s * 1e3:g}ms"}
        if self.loss_fraction:
            out["loss"] = f"{self.loss_fraction * 100:g}%"
        if self.queue_packets is not None:
            out["queue"] = self.queue_packets
        return out


@dataclass(frozen=True)
class SwitchLink:
    """A switch-to-switch link; ``upper`` is the switch nearer the PS."""

    upper: str
    lower: str
    link: LinkSpec


@dataclass(frozen=True)
class PsSpec:
    switch: str | None
    link: LinkSpec
    listen: str | None = None  # HOST:PORT for devices beyond this host (TLS); None: loopback


@dataclass(frozen=True)
class NetworkSpec:
    backend: str = "auto"
    switches: tuple[str, ...] = ()
    links: tuple[SwitchLink, ...] = ()
    ps: PsSpec = PsSpec(None, LinkSpec(1e9, 1e9))


BYZANTINE_MODES = ("noise", "bitflip", "stale", "scale")


@dataclass(frozen=True)
class ByzantineSpec:
    """Wrong results on a share of tiles (see testbed/agent/behaviour.py)."""

    rate: float  # share of tiles corrupted, [0, 1]
    modes: tuple[str, ...] = BYZANTINE_MODES  # drawn uniformly per corrupted tile
    noise_rel: float = 0.01  # noise std / tile RMS
    scale_factor: float = 1.5  # a scaled tile is C x this


@dataclass(frozen=True)
class StragglerSpec:
    """Slow compute on a share of tiles."""

    factor: float  # compute time multiplier, >= 1
    rate: float = 1.0  # share of tiles slowed, [0, 1]


@dataclass(frozen=True)
class BehaviourSpec:
    byzantine: ByzantineSpec | None = None
    straggler: StragglerSpec | None = None


@dataclass(frozen=True)
class DeviceGroup:
    group: str
    profile: str  # the name as written
    profile_path: Path  # resolved profile file
    count: int
    switch: str | None
    link: LinkSpec
    extra: dict[str, Any] = field(default_factory=dict)  # keys owned by other parts
    behaviour: BehaviourSpec | None = None
    # each device's operand-block cache, bytes; None: capacity.agent_cache_bytes(job)
    cache_bytes: int | None = None


@dataclass(frozen=True)
class DeviceSpec:
    """One device, expanded from its group."""

    name: str  # <group>-<index>
    index: int  # position among all devices, 0-based
    group: DeviceGroup

    @property
    def link(self) -> LinkSpec:
        return self.group.link


@dataclass(frozen=True)
class ModelSpec:
    family: str = "opt"
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    ffn: int = 1024
    seq_len: int = 128
    vocab: int = 256  # byte-level tokens

    @property
    def parameters(self) -> int:
        """Parameters of the decoder this shape builds (the tied head counts once).

        Per layer: 4 attention projections ``4·(h² + h)``, two layer norms ``4·h``, the
        feed-forward ``2·h·f + f + h``; plus embeddings ``(vocab + seq_len)·h`` and the final
        layer norm ``2·h`` (``tests/unit/test_engine.py`` counts a built model's)."""
        h, f = self.hidden, self.ffn
        per_layer = 4 * (h * h + h) + 4 * h + 2 * h * f + f + h
        return self.layers * per_layer + (self.vocab + self.seq_len) * h + 2 * h


@dataclass(frozen=True)
class DataSpec:
    kind: str = "builtin"  # builtin | files
    files: tuple[Path, ...] = ()


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)


@dataclass(frozen=True)
class ParallelismSpec:
    strategy: str = "tile-tp"
    tile_m: int = 128
    tile_n: int = 128
    min_offload_flops: float = 1e6  # GEMMs with fewer FLOPs (2*M*N*K) run on the PS
    planner: str = "auto"  # auto: the tile planner (docs/planning.md); fifo: fixed tiles, FIFO
    # pipeline and data-parallel (docs/baselines.md): GPipe micro-batches per step; local steps
    # between data-parallel averages (1: every step; H > 1: DiLoCo); pipeline checkpoint period
    micro_batches: int = 4
    local_steps: int = 1
    checkpoint_every: int = 10


@dataclass(frozen=True)
class ValidationSpec:
    enabled: bool = True  # Freivalds' check on every returned tile
    freivalds_vectors: int = 1  # random vectors per check (validation.py: what escapes)
    quarantine_after: int = 3  # failed checks before a device is quarantined; 0 = never


@dataclass(frozen=True)
class WatchdogSpec:
    no_progress_s: float = 120.0  # wall seconds with no device or no accepted tile; 0 = off


@dataclass(frozen=True)
class JobSpec:
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    batch_size: int = 8
    steps: int = 20
    dtype: str = "float32"
    optimizer: OptimizerSpec = OptimizerSpec()
    parallelism: ParallelismSpec = ParallelismSpec()
    validation: ValidationSpec = ValidationSpec()
    watchdog: WatchdogSpec = WatchdogSpec()


@dataclass(frozen=True)
class Topology:
    name: str
    source: Path | None
    seed: int
    network: NetworkSpec
    groups: tuple[DeviceGroup, ...]
    job: JobSpec
    churn: Path | None = None
    time_dilation: float | None = None  # None = chosen at start (auto) or adaptive
    extra: dict[str, Any] = field(default_factory=dict)  # top-level sections of other parts (adb)
    # the device-side p95 tile-time error target (a fraction): adaptive dilation holds it, every
    # run reports against it
    dilation_target_p95: float = DEFAULT_TARGET_P95
    # True for `time_dilation: {target_p95: ...}`: a probe picks D and the PS holds the target
    # between steps (slower runs); `auto` calibrates D once from the host and only reports
    dilation_adaptive: bool = False

    @property
    def devices(self) -> tuple[DeviceSpec, ...]:
        out: list[DeviceSpec] = []
        for group in self.groups:
            for i in range(group.count):
                out.append(DeviceSpec(f"{group.group}-{i}", len(out), group))
        return tuple(out)

    def with_overrides(self, **changes: Any) -> Topology:
        """A copy with top-level fields replaced (``steps=`` is forwarded to the job)."""
        steps = changes.pop("steps", None)
        topo = dataclasses.replace(self, **changes)
        if steps is not None:
            topo = dataclasses.replace(topo, job=dataclasses.replace(topo.job, steps=steps))
        return topo

    def to_yaml(self) -> dict[str, Any]:
        """The resolved topology as plain data (what a run directory records)."""
        out = _plain(dataclasses.asdict(self))
        target = out.pop("dilation_target_p95")
        adaptive = out.pop("dilation_adaptive")
        if out["time_dilation"] is None:  # written as the topology file says it
            out["time_dilation"] = {"target_p95": target} if adaptive else "auto"
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


# ----------------------------------------------------------------------------------------------
# Limits: values beyond these are typos or attacks, never experiments this testbed can run.

MAX_DEVICES = 10_000  # per topology; `testbed up` also checks what this machine can start
MAX_DELAY_S = 60.0  # one way; leases are 5 s, so a longer delay never lets a tile come back
MAX_QUEUE_PACKETS = 1_000_000
# a device's block cache: below 1 MiB a tile's blocks of the smallest job (tiny.yaml: ~100 KB)
# barely fit twice; above 64 GiB no phone or laptop has the memory
MIN_CACHE_BYTES = 1024**2
MAX_CACHE_BYTES = 64 * 1024**3
MAX_TOPOLOGY_BYTES = 16 * 1024**2  # a file's size: the largest valid topology is a few KB
MAX_STRAGGLER_FACTOR = 1_000.0  # a device 1000x slower than its profile is gone, not slow
MAX_DILATION = 10_000.0  # a 1 s step would take almost 3 h of wall-clock time
MAX_SEED = 2**63 - 1  # seeds travel as int64
MAX_STEPS = 10_000_000
MAX_BATCH = 65_536
MAX_TILE = 65_536  # one tile edge; a 65536 x 65536 float32 tile is 16 GiB, more than any phone
# A GEMM that planner fifo would cut at job.parallelism.tile into more tiles than this is
# refused: `tile: 1` on a 4,096-token job made 12.6 million tiles of one GEMM and 5.5 GB in a
# minute. (auto cuts by its plans, up to 16 tiles a device: its fallback to the tile, for a
# GEMM it could not plan, is not checked, as a 10,000-device plan may well pass this.)
MAX_GEMM_TILES = 100_000
MAX_WEIGHT_DECAY = 1.0  # see OptimizerFile.weight_decay
MAX_LR = 1.0  # AdamW moves each weight by about lr per step: above 1 training only diverges
# Model sizes: each bound is ~3x (or more) the largest published transformer's value (GPT-3:
# hidden 12,288, 96 layers, 96 heads; PaLM: ffn 73,728, 118 layers; vocabularies ~256k).
MAX_MODEL = {"hidden": 65_536, "layers": 1_024, "heads": 1_024, "ffn": 262_144,
             "seq_len": 65_536, "vocab": 1_048_576}
# The PS holds weights, gradients and AdamW's two moments: 16 bytes per parameter in float32.
# 2^34 parameters (~17 billion) are 256 GiB of training state, more than the machines this
# testbed runs on (the resource check before `testbed up` compares with this machine's memory).
MAX_PARAMETERS = 2**34


def model_parameters(hidden: int, layers: int, ffn: int, seq_len: int, vocab: int) -> int:
    """Parameters of the OPT-style model (testbed/ps_backend/engine/model.py), biases included.

    Embeddings ``(vocab + seq_len) * h``; per layer 4 attention projections ``4 * (h^2 + h)``,
    the feed-forward pair ``2 * h * ffn + ffn + h`` and two layer norms ``4 * h``; a final norm.
    """
    h = hidden
    per_layer = 4 * (h * h + h) + 2 * h * ffn + ffn + h + 4 * h
    return (vocab + seq_len) * h + layers * per_layer + 2 * h


# ----------------------------------------------------------------------------------------------
# The file, described with pydantic models (testbed/schema.py). They say what a user may write;
# each has ``spec()`` that builds the frozen dataclass the rest of testbed reads. Cross references
# (switch names, duplicates) use the parse's scratch dict, filled by TopologyFile's first check.

def _base_dir(info: ValidationInfo) -> Path:
    return Path(scratch(info).get("base_dir") or Path.cwd())


def _name(value: str) -> str:
    problem = name_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _delay(value: float) -> float:
    if value > MAX_DELAY_S:
        raise ValueError(f"a one-way delay must be at most {MAX_DELAY_S:g} s (leases are "
                         f"seconds long), got {value:g} s")
    return value


def _loss(value: float) -> float:
    # TCP's rate under loss (agent.link.mathis_rate_bps) stays positive as loss nears 100 %,
    # where a link that loses every packet carries nothing
    if value >= 1:
        raise ValueError("a link's loss must be below 100% (a link that loses every packet "
                         "carries nothing: leave its devices out instead)")
    return value


def _existing_file(value: Any, info: ValidationInfo) -> Path:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a file path, got {value!r}")
    p = user_path(value, _base_dir(info))
    problem = input_problem(p)
    if problem:
        raise ValueError(problem)
    return p.resolve()


def _switch_ref(value: str | None, info: ValidationInfo) -> str | None:
    switches = scratch(info).get("switches", [])
    if value is None:
        if switches:
            raise ValueError(f"required when switches are declared ({switches})")
        return None
    if value not in switches:
        raise ValueError(f"unknown switch {value!r}; declared: {switches or 'none'}")
    return value


def _share(value: Any) -> float:
    """A share of tiles: a number in [0, 1] or a percentage string ('20%')."""
    if isinstance(value, str) and value.strip().endswith("%"):
        return units.parse_fraction(value)
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number <= 1:
        raise ValueError(f"expected a share in [0, 1] or a percentage like '20%', got {value!r}")
    return float(number)


def _cache(size_bytes: int) -> int:
    if not MIN_CACHE_BYTES <= size_bytes <= MAX_CACHE_BYTES:
        raise ValueError(f"a device's cache must be between 1MiB and 64GiB, got "
                         f"{size_bytes:,} bytes")
    return size_bytes


Name = Annotated[Str, AfterValidator(_name)]
Rate = Annotated[float, BeforeValidator(units.parse_rate_bps)]
Delay = Annotated[float, BeforeValidator(units.parse_duration_s), AfterValidator(_delay)]
Loss = Annotated[float, BeforeValidator(units.parse_fraction), AfterValidator(_loss)]
Share = Annotated[float, BeforeValidator(_share)]
ExistingFile = Annotated[Path, BeforeValidator(_existing_file)]
CacheSize = Annotated[int, BeforeValidator(units.parse_size_bytes), AfterValidator(_cache)]
SwitchRef = Annotated[Str | None, AfterValidator(_switch_ref)]
SwitchName = Annotated[Str, AfterValidator(_name), unique("switches", "switch")]


class LinkFile(Schema):
    down: Rate
    up: Rate
    delay: Delay = 0.0
    loss: Loss = 0.0
    queue: Annotated[Int, Field(gt=0, le=MAX_QUEUE_PACKETS)] | None = None

    def spec(self) -> LinkSpec:
        return LinkSpec(self.down, self.up, self.delay, self.loss, self.queue)


class SwitchLinkFile(LinkFile):
    switches: list[Str]

    @field_validator("switches")
    @classmethod
    def _declared(cls, ends: list[str], info: ValidationInfo) -> list[str]:
        declared = scratch(info).get("switches", [])
        if len(ends) != 2 or not all(e in declared for e in ends):
            raise ValueError(f"expected two declared switch names, got {ends!r}")
        return ends

    @model_validator(mode="after")
    def _one_path_up(self, info: ValidationInfo) -> SwitchLinkFile:
        s = scratch(info)
        parents = s.setdefault("parents", {})
        upper, lower = self.switches
        if lower in parents or lower == s.get("ps_switch"):
            raise ValueError(f"switch {lower!r} already has a path to the PS; the switches "
                             f"must form a tree")
        parents[lower] = upper
        return self


def _listen_address(value: str) -> str:
    """HOST:PORT with an IP address of this host (``[v6]`` too) and a port in 0..65535."""
    parse_address(value, listen=True)
    return value


class PsFile(Schema):
    switch: SwitchRef = Field(default=None, validate_default=True)
    link: LinkFile | None = None
    # devices on other machines (testbed join): an explicit opt-in, served over TLS only
    listen: Annotated[Str, AfterValidator(_listen_address)] | None = None

    def spec(self) -> PsSpec:
        return PsSpec(self.switch, self.link.spec() if self.link else LinkSpec(1e9, 1e9),
                      self.listen)


def _none_is_empty(value: Any) -> Any:
    return {} if value is None else value


class NetworkFile(Schema):
    backend: Literal["auto", "loopback", "mininet"] = "auto"
    switches: list[SwitchName] = []
    ps: Annotated[PsFile, BeforeValidator(_none_is_empty)] = Field(default_factory=PsFile)
    # validated when left out too: switches with no link at all have no path to the PS
    links: list[SwitchLinkFile] = Field(default=[], validate_default=True)

    @field_validator("links")
    @classmethod
    def _tree(cls, links: list[SwitchLinkFile], info: ValidationInfo) -> list[SwitchLinkFile]:
        """Switches must form a tree rooted at the PS's switch (one path from any device)."""
        s = scratch(info)
        parents: dict[str, str] = s.get("parents", {})
        root = s.get("ps_switch")
        problems = []
        for name in s.get("switches", []):
            seen, cur = {name}, name
            while cur in parents:
                cur = parents[cur]
                if cur in seen:
                    raise ValueError(f"switch {name!r} is on a loop")
                seen.add(cur)
            if root is not None and cur != root:
                problems.append(f"switch {name!r} has no path to the PS's switch {root!r}")
        if problems:
            raise ValueError("; ".join(problems))
        return links

    def spec(self) -> NetworkSpec:
        return NetworkSpec(self.backend, tuple(self.switches),
                           tuple(SwitchLink(lk.switches[0], lk.switches[1], lk.spec())
                                 for lk in self.links), self.ps.spec())


class ByzantineFile(Schema):
    rate: Share
    modes: Annotated[list[Literal["noise", "bitflip", "stale", "scale"]],
                     BeforeValidator(lambda v: [v] if isinstance(v, str) else v),
                     Field(min_length=1)] = ["noise", "bitflip", "stale", "scale"]
    noise: Annotated[Float, Field(gt=0)] = 0.01
    scale: Annotated[Float, Field(gt=0)] = 1.5

    @field_validator("scale")
    @classmethod
    def _not_one(cls, value: float) -> float:
        if value == 1:
            raise ValueError("must not be 1 (a tile scaled by 1 is an honest tile)")
        return value

    def spec(self) -> ByzantineSpec:
        return ByzantineSpec(self.rate, tuple(dict.fromkeys(self.modes)), self.noise, self.scale)


class StragglerFile(Schema):
    factor: Annotated[Float, Field(ge=1, le=MAX_STRAGGLER_FACTOR)]
    rate: Share = 1.0


class BehaviourFile(Schema):
    byzantine: ByzantineFile | None = None
    straggler: StragglerFile | None = None

    def spec(self) -> BehaviourSpec:
        straggler = self.straggler
        return BehaviourSpec(self.byzantine.spec() if self.byzantine else None,
                             StragglerSpec(straggler.factor, straggler.rate) if straggler
                             else None)


def _profile(value: str, info: ValidationInfo) -> str:
    from testbed.perf_model.profiles import find_profile, profile_problems

    path = find_profile(value, _base_dir(info))
    if path is None:
        problem = input_problem(user_path(value, _base_dir(info)))
        raise ValueError(f"no device profile named {value!r} (see `testbed perf show --list`), "
                         f"and {problem}")
    problems = profile_problems(path)
    if problems:
        raise ValueError(f"the profile {path} does not load: {'; '.join(problems)}")
    return value


class GroupFile(Schema):
    group: Annotated[Name, unique("groups", "group")]
    profile: Annotated[Str, AfterValidator(_profile)]
    count: Annotated[Int, Field(ge=0, le=MAX_DEVICES)] = 1
    switch: SwitchRef = Field(default=None, validate_default=True)
    link: LinkFile
    behaviour: BehaviourFile | None = None
    cache: CacheSize | None = None

    def spec(self, base_dir: Path) -> DeviceGroup:
        from testbed.perf_model.profiles import find_profile

        return DeviceGroup(self.group, self.profile, find_profile(self.profile, base_dir) or Path(),
                           self.count, self.switch, self.link.spec(), {},
                           self.behaviour.spec() if self.behaviour else None, self.cache)


class ModelFile(Schema):
    family: Literal["opt"] = "opt"
    hidden: Annotated[Int, Field(ge=1, le=MAX_MODEL["hidden"])]
    layers: Annotated[Int, Field(ge=1, le=MAX_MODEL["layers"])]
    heads: Annotated[Int, Field(ge=1, le=MAX_MODEL["heads"])]
    ffn: Annotated[Int, Field(ge=1, le=MAX_MODEL["ffn"])]
    seq_len: Annotated[Int, Field(ge=1, le=MAX_MODEL["seq_len"])]
    vocab: Annotated[Int, Field(ge=256, le=MAX_MODEL["vocab"])] = 256  # byte tokens need 256

    @field_validator("heads")
    @classmethod
    def _divides(cls, heads: int, info: ValidationInfo) -> int:
        hidden = info.data.get("hidden")
        if hidden is not None and hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        return heads

    @model_validator(mode="after")
    def _fits(self) -> ModelFile:
        n = model_parameters(self.hidden, self.layers, self.ffn, self.seq_len, self.vocab)
        if n > MAX_PARAMETERS:
            raise ValueError(f"{n:,} parameters are more than the {MAX_PARAMETERS:,} a PS can "
                             f"train (16 bytes each in float32: weights, gradients, two AdamW "
                             f"moments)")
        return self

    def spec(self) -> ModelSpec:
        return ModelSpec(self.family, self.hidden, self.layers, self.heads, self.ffn,
                         self.seq_len, self.vocab)


class DataFile(Schema):
    files: Annotated[list[ExistingFile], Field(min_length=1)] | None

    @model_validator(mode="before")
    @classmethod
    def _builtin(cls, raw: Any) -> Any:
        if raw is None or raw == "builtin":
            return {"files": None}
        if isinstance(raw, str):
            raise ValueError(f"expected 'builtin' or {{files: [paths]}}, got {raw!r}")
        return raw

    def spec(self) -> DataSpec:
        return DataSpec("files", tuple(self.files)) if self.files else DataSpec()


class OptimizerFile(Schema):
    name: Literal["adamw"] = "adamw"
    lr: Annotated[Float, Field(gt=0, le=MAX_LR)] = 3e-4
    # AdamW multiplies every weight by 1 - lr x weight_decay each step: with both at most 1
    # that stays in [0, 1]; a larger decay flips the weights' signs, no regularizer
    weight_decay: Annotated[Float, Field(ge=0, le=MAX_WEIGHT_DECAY)] = 0.0
    betas: tuple[float, float] = (0.9, 0.999)

    @field_validator("betas", mode="before")
    @classmethod
    def _betas(cls, raw: Any) -> tuple[float, float]:
        if not (isinstance(raw, (list, tuple)) and len(raw) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                        for b in raw)):
            raise ValueError(f"expected two numbers in [0, 1), got {raw!r}")
        return float(raw[0]), float(raw[1])

    def spec(self) -> OptimizerSpec:
        return OptimizerSpec(self.name, self.lr, self.weight_decay, self.betas)


class ParallelismFile(Schema):
    strategy: Literal["tile-tp", "pipeline", "data-parallel"] = "tile-tp"
    tile: tuple[int, int] = (128, 128)
    min_offload_flops: Annotated[Float, Field(ge=0)] = 1e6
    planner: Literal["auto", "fifo"] = "auto"
    micro_batches: Annotated[Int, Field(ge=1, le=MAX_BATCH)] | None = None  # None: min(4, batch)
    local_steps: Annotated[Int, Field(ge=1, le=MAX_STEPS)] = 1
    checkpoint_every: Annotated[Int, Field(ge=1, le=MAX_STEPS)] = 10

    @field_validator("tile", mode="before")
    @classmethod
    def _tile(cls, raw: Any) -> tuple[int, int]:
        def edge(t: Any) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and 0 < t <= MAX_TILE

        if edge(raw):
            return raw, raw
        if isinstance(raw, list) and len(raw) == 2 and all(edge(t) for t in raw):
            return raw[0], raw[1]
        raise ValueError(f"expected a tile edge in 1..{MAX_TILE} or [rows, cols], got {raw!r}")

    def spec(self, batch_size: int = 8) -> ParallelismSpec:
        micro = self.micro_batches if self.micro_batches is not None else min(4, batch_size)
        return ParallelismSpec(self.strategy, self.tile[0], self.tile[1], self.min_offload_flops,
                               self.planner, micro, self.local_steps, self.checkpoint_every)


class ValidationFile(Schema):
    enabled: Bool = True
    freivalds_vectors: Annotated[Int, Field(ge=1, le=64)] = 1
    quarantine_after: Annotated[Int, Field(ge=0, le=1_000_000)] = 3

    def spec(self) -> ValidationSpec:
        return ValidationSpec(self.enabled, self.freivalds_vectors, self.quarantine_after)


class WatchdogFile(Schema):
    no_progress_s: Annotated[Float, Field(ge=0, le=86_400)] = 120.0

    def spec(self) -> WatchdogSpec:
        return WatchdogSpec(self.no_progress_s)


class JobFile(Schema):
    model: ModelFile
    data: DataFile = DataFile(files=None)
    batch_size: Annotated[Int, Field(gt=0, le=MAX_BATCH)] = 8
    steps: Annotated[Int, Field(gt=0, le=MAX_STEPS)] = 20
    dtype: Literal["float32", "float64"] = "float32"
    optimizer: Annotated[OptimizerFile, BeforeValidator(_none_is_empty)] = OptimizerFile()
    parallelism: Annotated[ParallelismFile, BeforeValidator(_none_is_empty)] = ParallelismFile()
    validation: Annotated[ValidationFile, BeforeValidator(_none_is_empty)] = ValidationFile()
    watchdog: Annotated[WatchdogFile, BeforeValidator(_none_is_empty)] = WatchdogFile()

    @model_validator(mode="after")
    def _micro_batches(self) -> JobFile:
        micro = self.parallelism.micro_batches
        if micro is not None and micro > self.batch_size:
            raise ValueError(f"parallelism.micro_batches: {micro} micro-batches need at least "
                             f"as many sequences, batch_size is {self.batch_size}")
        return self

    @model_validator(mode="after")
    def _data_holds_a_window(self) -> JobFile:
        # the PS's BatchSampler needs one window of seq_len + 1 bytes: refused here, a short
        # file would stop a run after its network and PS had started
        files = self.data.files or []
        need = self.model.seq_len + 1
        held = sum(f.stat().st_size for f in files)
        if files and held < need:
            raise ValueError(f"data.files: {len(files)} file(s) hold {held} bytes together; "
                             f"a window of model.seq_len + 1 = {need} bytes is needed (longer "
                             f"files or a shorter seq_len)")
        return self

    def spec(self) -> JobSpec:
        return JobSpec(self.model.spec(), self.data.spec(), self.batch_size, self.steps,
                       self.dtype, self.optimizer.spec(), self.parallelism.spec(self.batch_size),
                       self.validation.spec(), self.watchdog.spec())


# Top-level sections owned by other parts of testbed: key -> "module:Model" (a Schema subclass;
# when it has ``spec()``, that is what lands in ``Topology.extra[key]``). Imported only when a
# file has the key, so the topology loads without, say, adbutils.
SECTIONS: dict[str, str] = {
    "adb": "testbed.adb_bridge.config:AdbSection",
}


class TopologyFile(Schema):
    name: Name
    seed: Annotated[Int, Field(ge=0, le=MAX_SEED)] = 0
    network: Annotated[NetworkFile, BeforeValidator(_none_is_empty)] = NetworkFile()
    devices: Annotated[list[GroupFile], Field(min_length=1)]
    job: JobFile
    churn: ExistingFile | None = None
    time_dilation: float | dict[str, float] | None = None  # None = auto

    @model_validator(mode="before")
    @classmethod
    def _declared(cls, raw: Any, info: ValidationInfo) -> Any:
        """Note the declared switches and the PS's switch before any reference is checked."""
        s = scratch(info)
        network = raw.get("network") if isinstance(raw, dict) else None
        network = network if isinstance(network, dict) else {}
        names = network.get("switches")
        s["switches"] = (list(dict.fromkeys(n for n in names if is_name(n)))
                         if isinstance(names, list) else [])
        ps = network.get("ps")
        ps_switch = ps.get("switch") if isinstance(ps, dict) else None
        s["ps_switch"] = ps_switch if ps_switch in s["switches"] else None
        if isinstance(raw, dict):  # `adb:` with nothing under it is the section's defaults
            raw = {k: ({} if k in SECTIONS and v is None else v) for k, v in raw.items()}
        return raw

    @field_validator("devices")
    @classmethod
    def _total(cls, groups: list[GroupFile]) -> list[GroupFile]:
        total = sum(g.count for g in groups)
        if total == 0:
            raise ValueError("at least one device is needed (every count is 0)")
        if total > MAX_DEVICES:
            raise ValueError(f"{total:,} devices are more than the {MAX_DEVICES:,} one topology "
                             f"may hold")
        # a churn trace names a group or one device (`<group>-<i>`): a group named as another
        # group's device would leave that device no name of its own
        devices = {f"{g.group}-{i}": g.group for g in groups for i in range(g.count)}
        for g in groups:
            if g.group in devices:
                raise ValueError(f"group {g.group!r} is named as a device of group "
                                 f"{devices[g.group]!r} (its devices are "
                                 f"{devices[g.group]}-0 ...): a churn trace could not tell "
                                 f"them apart; rename the group")
        return groups

    @field_validator("time_dilation", mode="before")
    @classmethod
    def _dilation(cls, raw: Any) -> float | dict[str, float] | None:
        if raw == "auto" or raw is None:
            return None
        if isinstance(raw, dict):
            unknown = sorted(set(map(str, raw)) - {"target_p95"})
            if unknown or "target_p95" not in raw:
                raise ValueError(f"expected {{target_p95: <share, e.g. 10%>}}, got {raw!r}")
            target = _share(raw["target_p95"])
            if not target > 0:
                raise ValueError(f"target_p95 must be above 0, got {raw['target_p95']!r}")
            return {"target_p95": target}
        if isinstance(raw, (int, float)) and not isinstance(raw, bool) and \
                1 <= raw <= MAX_DILATION:
            return float(raw)
        raise ValueError(f"expected 'auto', {{target_p95: 10%}} or a number in "
                         f"[1, {MAX_DILATION:g}], got {raw!r}")

    def spec(self, source: Path | None, base_dir: Path) -> Topology:
        dilation = self.time_dilation if not isinstance(self.time_dilation, dict) else None
        target = self.time_dilation.get("target_p95") if isinstance(self.time_dilation, dict) \
            else None
        extra: dict[str, Any] = {}
        for key in SECTIONS:
            if key in self.model_fields_set:
                value = getattr(self, key)
                extra[key] = value.spec() if hasattr(value, "spec") else value
        return Topology(self.name, source, self.seed, self.network.spec(),
                        tuple(g.spec(base_dir) for g in self.devices), self.job.spec(),
                        self.churn, dilation, extra,
                        target if target is not None else DEFAULT_TARGET_P95,
                        dilation_adaptive=target is not None)


@functools.cache
def _file_model(present: frozenset[str]) -> type[TopologyFile]:
    """TopologyFile with the sections a file has, typed by their owners' models."""
    fields: dict[str, Any] = {}
    for key, where in SECTIONS.items():
        if key in present:
            module, name = where.split(":")
            fields[key] = (getattr(importlib.import_module(module), name) | None, None)
        else:
            fields[key] = (Any, None)  # absent: listed as a known key, never validated
    return cast("type[TopologyFile]", create_model("TopologyFile", __base__=TopologyFile,
                                                   **fields))


def parse_topology(raw: Any, source: str = "<topology>", base_dir: Path | None = None) -> Topology:
    """Validate already-loaded YAML data; raise TopologyError listing every problem."""
    base = base_dir or Path.cwd()
    present = frozenset(k for k in raw if k in SECTIONS) if isinstance(raw, dict) else frozenset()
    file = parse(_file_model(present), raw, source, error=TopologyError,
                 context={"base_dir": base})
    topology = file.spec(Path(source).resolve() if base_dir else None, base)
    if topology.job.parallelism.strategy != "tile-tp":  # a stage or replica must fit in memory
        from testbed.baselines.placement import fit_problems

        problems = fit_problems(topology)
    elif topology.job.parallelism.planner == "fifo":  # auto cuts by its plans, rarely so
        problems = _tile_count_problems(topology.job)
    else:
        problems = []
    if problems:
        raise TopologyError(source, problems)
    return topology


def _tile_count_problems(job: JobSpec) -> list[str]:
    """A GEMM of the step that job.parallelism.tile cuts into more than MAX_GEMM_TILES tiles
    (of those offloaded: the PS computes those below min_offload_flops itself)."""
    from testbed.ps_backend.tiler import gemm_flops
    from testbed.simulate.chain import step_chain

    par = job.parallelism
    tile_m, tile_n = par.tile_m, par.tile_n
    count, gemm = max(((-(-g.m // tile_m) * -(-g.n // tile_n), g)
                       for stage in step_chain(job) for g in stage
                       if gemm_flops(g.m, g.k, g.n) >= par.min_offload_flops),
                      key=lambda c: c[0], default=(0, None))
    if gemm is None or count <= MAX_GEMM_TILES:
        return []
    return [f"job.parallelism.tile: [{tile_m}, {tile_n}] cuts {gemm.layer} ({gemm.op}, "
            f"{gemm.m:,} x {gemm.n:,} results) into {count:,} tiles; expected at most "
            f"{MAX_GEMM_TILES:,} a GEMM (a larger tile)"]


def steps_problem(steps: int) -> str | None:
    """What is wrong with a ``--steps`` that overrides ``job.steps`` (the file's own bounds)."""
    if not 0 < steps <= MAX_STEPS:
        return f"expected 1 to {MAX_STEPS:,} steps, as job.steps, got {steps:,}"
    return None


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file; raise TopologyError with every problem found."""
    path = Path(path)
    try:
        text = read_user_text(path, MAX_TOPOLOGY_BYTES)
    except OSError as exc:
        raise TopologyError(str(path), [f"cannot read the file: {exc.strerror}"]) from exc
    except UnicodeDecodeError as exc:
        raise TopologyError(str(path), [f"not a UTF-8 text file (byte {exc.start}: "
                                        f"{exc.reason}); a topology is YAML text"]) from exc
    try:
        raw = load_user_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise TopologyError(str(path), [f"{where}not valid YAML: "
                                        f"{getattr(exc, 'problem', exc)}"]) from exc
    if raw is None:  # said "<top>: expected a mapping, got null"
        raise TopologyError(str(path), ["the file holds nothing (empty, comments only or null); "
                                        "a topology is a mapping with name:, devices: "
                                        "and job: (topologies/default.yaml)"])
    if isinstance(raw, dict) and {"groups", "source"} <= raw.keys() and "devices" not in raw:
        # a run directory's topology.yaml: 15 problems (unknown key 'groups', 'down_bps', ...)
        # said nothing of what the file was
        raise TopologyError(str(path), [
            "this is a run's resolved topology.yaml (testbed's own keys: groups, down_bps, "
            "delay_s, ...), not a topology file; topology.input.yaml beside it is the file the "
            "run was given"])
    return parse_topology(raw, str(path), path.resolve().parent)
