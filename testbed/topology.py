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
    devices:
      - group: phones               # [a-z0-9-]; device names are <group>-<index>
        profile: snapdragon888      # a profile name (testbed/perf_model/profiles) or a YAML path
        count: 6
        switch: ap0
        link: {down: 100Mbit, up: 20Mbit, delay: 10ms, loss: 0.5%, queue: 100}
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
      parallelism: {strategy: tile-tp, tile: 128, min_offload_flops: 1e6}
      validation: {enabled: true, freivalds_vectors: 1, quarantine_after: 3}
    churn: traces/flaky-phones.csv  # optional, relative to the topology file
    time_dilation: auto             # auto | a number >= 1

Link directions: ``down`` is PS -> device (the device's downlink), ``up`` is device -> PS. A link's
``queue`` is in packets. Rates of behaviours are a share of tiles: a number in [0, 1] or a
percentage (``20%``); ``byzantine.noise`` is the noise's standard deviation relative to the tile's
RMS, ``byzantine.scale`` the factor a scaled tile is multiplied by. ``validation.quarantine_after``
counts failed checks (0: never quarantine). Relative paths (profiles, data files, churn) are
resolved against the directory of the topology file and stored absolute.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml

from testbed import units
from testbed.errors import InputError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,23}$")
BACKENDS = ("auto", "loopback", "mininet")
DTYPES = ("float32", "float64")
T = TypeVar("T")


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


@dataclass(frozen=True)
class ValidationSpec:
    enabled: bool = True  # Freivalds' check on every returned tile
    freivalds_vectors: int = 1  # random ±1 vectors per check (error escapes with prob. 2^-k)
    quarantine_after: int = 3  # failed checks before a device is quarantined; 0 = never


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


@dataclass(frozen=True)
class Topology:
    name: str
    source: Path | None
    seed: int
    network: NetworkSpec
    groups: tuple[DeviceGroup, ...]
    job: JobSpec
    churn: Path | None = None
    time_dilation: float | None = None  # None = auto
    extra: dict[str, Any] = field(default_factory=dict)  # top-level sections of other parts (adb)

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
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


# ----------------------------------------------------------------------------------------------
# Validation: a checker walks the raw YAML, records every problem with its path, returns defaults
# where a value is bad so that the walk can go on and report the rest.

class _Checker:
    def __init__(self, base_dir: Path):
        self.base_dir = base_dir
        self.problems: list[str] = []

    def error(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}")

    def mapping(self, raw: Any, path: str, allowed: dict[str, bool]) -> dict[str, Any]:
        """Check that raw is a mapping with only allowed keys; required ones are True."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            self.error(path or "<top>", f"expected a mapping, got {type(raw).__name__}")
            return {}
        for key in raw:
            if key not in allowed:
                near = ", ".join(sorted(allowed))
                self.error(_join(path, str(key)), f"unknown key (expected one of: {near})")
        for key, required in allowed.items():
            if required and key not in raw:
                self.error(_join(path, key), "required key is missing")
        return raw

    def typed(self, raw: dict[str, Any], key: str, path: str, kind: type[T] | tuple[type, ...],
              default: T, check: Callable[[Any], str | None] | None = None) -> T:
        if key not in raw:
            return default
        value = raw[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if isinstance(value, str) and float in kinds and not ok:
            try:  # YAML reads 3e-4 as a string (YAML 1.1); accept numeric strings for floats
                value, ok = float(value), True
            except ValueError:
                pass
        if not ok:
            names = " or ".join(k.__name__ for k in kinds)
            self.error(_join(path, key), f"expected {names}, got {type(raw[key]).__name__} "
                                         f"{raw[key]!r}")
            return default
        if check is not None:
            message = check(value)
            if message:
                self.error(_join(path, key), message)
                return default
        return value  # type: ignore[return-value]

    def unit(self, raw: dict[str, Any], key: str, path: str, parse: Callable[[object], T],
             default: T) -> T:
        if key not in raw:
            return default
        try:
            return parse(raw[key])
        except units.UnitError as exc:
            self.error(_join(path, key), str(exc))
            return default

    def name(self, raw: dict[str, Any], key: str, path: str, default: str) -> str:
        return self.typed(raw, key, path, str, default,
                          lambda v: None if NAME_RE.match(v) else
                          f"{v!r} is not a valid name (lower-case letters, digits and '-', "
                          f"at most 24 characters, starting with a letter or digit)")

    def path(self, value: Any, path: str) -> Path | None:
        if not isinstance(value, str) or not value:
            self.error(path, f"expected a file path, got {value!r}")
            return None
        p = Path(value).expanduser()
        p = p if p.is_absolute() else (self.base_dir / p)
        if not p.is_file():
            self.error(path, f"no such file: {p}")
            return None
        return p.resolve()


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _positive(v: Any) -> str | None:
    return None if v > 0 else f"must be positive, got {v}"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else f"must not be negative, got {v}"


def _link(c: _Checker, raw: Any, path: str) -> LinkSpec:
    m = c.mapping(raw, path, {"down": True, "up": True, "delay": False, "loss": False,
                              "queue": False})
    return LinkSpec(
        down_bps=c.unit(m, "down", path, units.parse_rate_bps, 1e6),
        up_bps=c.unit(m, "up", path, units.parse_rate_bps, 1e6),
        delay_s=c.unit(m, "delay", path, units.parse_duration_s, 0.0),
        loss_fraction=c.unit(m, "loss", path, units.parse_fraction, 0.0),
        queue_packets=c.typed(m, "queue", path, int, None, _positive),  # type: ignore[arg-type]
    )


def _network(c: _Checker, raw: Any) -> NetworkSpec:
    p = "network"
    m = c.mapping(raw, p, {"backend": False, "switches": False, "links": False, "ps": False})
    backend = c.typed(m, "backend", p, str, "auto",
                      lambda v: None if v in BACKENDS else f"expected one of {BACKENDS}, got {v!r}")
    switches: list[str] = []
    for i, s in enumerate(m.get("switches") or []):
        if not isinstance(s, str) or not NAME_RE.match(s):
            c.error(f"{p}.switches[{i}]", f"expected a switch name like 'ap0', got {s!r}")
        elif s in switches:
            c.error(f"{p}.switches[{i}]", f"switch {s!r} is listed twice")
        else:
            switches.append(s)
    if "switches" in m and not isinstance(m["switches"], list):
        c.error(f"{p}.switches", "expected a list of switch names")
        switches = []
    links: list[SwitchLink] = []
    raw_links = m.get("links") or []
    if not isinstance(raw_links, list):
        c.error(f"{p}.links", "expected a list of links")
        raw_links = []
    for i, raw_link in enumerate(raw_links):
        lp = f"{p}.links[{i}]"
        lm = c.mapping(raw_link, lp, {"switches": True, "down": True, "up": True, "delay": False,
                                      "loss": False, "queue": False})
        ends = lm.get("switches")
        if not (isinstance(ends, list) and len(ends) == 2 and all(e in switches for e in ends)):
            c.error(f"{lp}.switches", f"expected two declared switch names, got {ends!r}")
            continue
        spec = _link(c, {k: v for k, v in lm.items() if k != "switches"}, lp)
        links.append(SwitchLink(ends[0], ends[1], spec))
    ps_raw = c.mapping(m.get("ps"), f"{p}.ps", {"switch": False, "link": False})
    ps_switch = _switch_ref(c, ps_raw, f"{p}.ps", switches)
    ps_link = _link(c, ps_raw["link"], f"{p}.ps.link") if "link" in ps_raw else LinkSpec(1e9, 1e9)
    _check_tree(c, switches, links, ps_switch)
    return NetworkSpec(backend, tuple(switches), tuple(links), PsSpec(ps_switch, ps_link))


def _switch_ref(c: _Checker, raw: dict[str, Any], path: str, switches: list[str]) -> str | None:
    name = raw.get("switch")
    if name is None:
        if switches:
            c.error(f"{path}.switch", f"required when switches are declared ({switches})")
        return None
    if name not in switches:
        c.error(f"{path}.switch", f"unknown switch {name!r}; declared: {switches or 'none'}")
        return None
    return str(name)


def _check_tree(c: _Checker, switches: list[str], links: list[SwitchLink],
                root: str | None) -> None:
    """Switches must form a tree rooted at the PS's switch (one path from any device to the PS)."""
    if not switches:
        return
    parents: dict[str, str] = {}
    for i, link in enumerate(links):
        if link.lower in parents or link.lower == root:
            c.error(f"network.links[{i}]", f"switch {link.lower!r} already has a path to the PS; "
                                            f"the switches must form a tree")
        parents[link.lower] = link.upper
    for s in switches:
        seen, cur = {s}, s
        while cur in parents:
            cur = parents[cur]
            if cur in seen:
                c.error("network.links", f"switch {s!r} is on a loop")
                return
            seen.add(cur)
        if root is not None and cur != root:
            c.error("network.links", f"switch {s!r} has no path to the PS's switch {root!r}")


def _devices(c: _Checker, raw: Any, switches: list[str]) -> list[DeviceGroup]:
    from testbed.perf_model.profiles import find_profile

    if not isinstance(raw, list) or not raw:
        c.error("devices", "expected a non-empty list of device groups")
        return []
    groups: list[DeviceGroup] = []
    seen: set[str] = set()
    for i, g in enumerate(raw):
        p = f"devices[{i}]"
        m = c.mapping(g, p, {"group": True, "profile": True, "count": False, "switch": False,
                             "link": True, "behaviour": False})
        name = c.name(m, "group", p, f"group{i}")
        if name in seen:
            c.error(f"{p}.group", f"group {name!r} is defined twice")
        seen.add(name)
        profile = c.typed(m, "profile", p, str, "")
        profile_path = None
        if profile:
            profile_path = find_profile(profile, c.base_dir)
            if profile_path is None:
                c.error(f"{p}.profile", f"no device profile named {profile!r} (see "
                                        f"`testbed perf show --list`) and no such file")
        count = c.typed(m, "count", p, int, 1, _non_negative)
        switch = _switch_ref(c, m, p, switches)
        link = _link(c, m.get("link"), f"{p}.link") if "link" in m else LinkSpec(1e6, 1e6)
        behaviour = _behaviour(c, m["behaviour"], f"{p}.behaviour") if "behaviour" in m else None
        groups.append(DeviceGroup(name, profile, profile_path or Path(), count, switch, link,
                                  {}, behaviour))
    if groups and sum(g.count for g in groups) == 0:
        c.error("devices", "at least one device is needed (every count is 0)")
    return groups


def _share(c: _Checker, raw: dict[str, Any], key: str, path: str, default: float) -> float:
    """A share of tiles: a number in [0, 1] or a percentage string ('20%')."""
    if key not in raw:
        return default
    value = raw[key]
    if isinstance(value, str):
        return c.unit(raw, key, path, units.parse_fraction, default)
    return c.typed(raw, key, path, float, default,
                   lambda v: None if 0 <= v <= 1 else
                   f"expected a share in [0, 1] or a percentage like '20%', got {v}")


def _behaviour(c: _Checker, raw: Any, path: str) -> BehaviourSpec:
    m = c.mapping(raw, path, {"byzantine": False, "straggler": False})
    byzantine = straggler = None
    if "byzantine" in m:
        bp = f"{path}.byzantine"
        bm = c.mapping(m["byzantine"], bp, {"rate": True, "modes": False, "noise": False,
                                            "scale": False})
        modes_raw = bm.get("modes", list(BYZANTINE_MODES))
        if isinstance(modes_raw, str):
            modes_raw = [modes_raw]
        if not isinstance(modes_raw, list) or not modes_raw:
            c.error(f"{bp}.modes", f"expected a non-empty list of {BYZANTINE_MODES}, "
                                   f"got {modes_raw!r}")
            modes_raw = list(BYZANTINE_MODES)
        modes = []
        for i, mode in enumerate(modes_raw):
            if mode not in BYZANTINE_MODES:
                c.error(f"{bp}.modes[{i}]", f"unknown mode {mode!r}; expected one of "
                                            f"{', '.join(BYZANTINE_MODES)}")
            elif mode not in modes:
                modes.append(mode)
        byzantine = ByzantineSpec(_share(c, bm, "rate", bp, 0.0),
                                  tuple(modes) or BYZANTINE_MODES,
                                  c.typed(bm, "noise", bp, float, 0.01, _positive),
                                  c.typed(bm, "scale", bp, float, 1.5,
                                          lambda v: None if v > 0 and v != 1 else
                                          f"must be positive and not 1, got {v}"))
    if "straggler" in m:
        sp = f"{path}.straggler"
        sm = c.mapping(m["straggler"], sp, {"factor": True, "rate": False})
        straggler = StragglerSpec(c.typed(sm, "factor", sp, float, 1.0,
                                          lambda v: None if v >= 1 else
                                          f"must be >= 1 (a slow-down), got {v}"),
                                  _share(c, sm, "rate", sp, 1.0))
    return BehaviourSpec(byzantine, straggler)


def _validation(c: _Checker, raw: Any, path: str) -> ValidationSpec:
    m = c.mapping(raw, path, {"enabled": False, "freivalds_vectors": False,
                              "quarantine_after": False})
    return ValidationSpec(
        c.typed(m, "enabled", path, bool, True),
        c.typed(m, "freivalds_vectors", path, int, 1,
                lambda v: None if 1 <= v <= 64 else f"expected 1 to 64 vectors, got {v}"),
        c.typed(m, "quarantine_after", path, int, 3, _non_negative))


def _job(c: _Checker, raw: Any) -> JobSpec:
    p = "job"
    m = c.mapping(raw, p, {"model": True, "data": False, "batch_size": False, "steps": False,
                           "dtype": False, "optimizer": False, "parallelism": False,
                           "validation": False})
    mp = f"{p}.model"
    mm = c.mapping(m.get("model"), mp, {"family": False, "hidden": True, "layers": True,
                                        "heads": True, "ffn": True, "seq_len": True,
                                        "vocab": False})
    family = c.typed(mm, "family", mp, str, "opt",
                     lambda v: None if v == "opt" else f"only 'opt' is supported, got {v!r}")
    model = ModelSpec(family, *(c.typed(mm, k, mp, int, getattr(ModelSpec, k), _positive)
                                for k in ("hidden", "layers", "heads", "ffn", "seq_len")),
                      vocab=c.typed(mm, "vocab", mp, int, 256,
                                    lambda v: None if 256 <= v else "must be >= 256 (byte tokens)"))
    if model.hidden % model.heads:
        c.error(f"{mp}.heads", f"hidden ({model.hidden}) must be divisible by heads "
                               f"({model.heads})")
    data = DataSpec()
    raw_data = m.get("data", "builtin")
    if raw_data != "builtin":
        dm = c.mapping(raw_data, f"{p}.data", {"files": True})
        files = dm.get("files")
        if not isinstance(files, list) or not files:
            if "files" in dm:
                c.error(f"{p}.data.files", "expected a non-empty list of text files")
        else:
            found = [c.path(f, f"{p}.data.files[{i}]") for i, f in enumerate(files)]
            data = DataSpec("files", tuple(f for f in found if f is not None))
    op = f"{p}.optimizer"
    om = c.mapping(m.get("optimizer"), op, {"name": False, "lr": False, "weight_decay": False,
                                            "betas": False})
    betas_raw = om.get("betas", [0.9, 0.999])
    if not (isinstance(betas_raw, list) and len(betas_raw) == 2
            and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas_raw)):
        c.error(f"{op}.betas", f"expected two numbers in [0, 1), got {betas_raw!r}")
        betas_raw = [0.9, 0.999]
    optimizer = OptimizerSpec(
        c.typed(om, "name", op, str, "adamw",
                lambda v: None if v == "adamw" else f"only 'adamw' is supported, got {v!r}"),
        c.typed(om, "lr", op, float, 3e-4, _positive),
        c.typed(om, "weight_decay", op, float, 0.0, _non_negative),
        (float(betas_raw[0]), float(betas_raw[1])))
    pp = f"{p}.parallelism"
    pm = c.mapping(m.get("parallelism"), pp, {"strategy": False, "tile": False,
                                              "min_offload_flops": False, "planner": False})
    c.typed(pm, "strategy", pp, str, "tile-tp",
            lambda v: None if v == "tile-tp" else f"only 'tile-tp' is supported, got {v!r}")
    tile = pm.get("tile", 128)
    if isinstance(tile, int) and not isinstance(tile, bool) and tile > 0:
        tile_m = tile_n = tile
    elif (isinstance(tile, list) and len(tile) == 2
          and all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tile)):
        tile_m, tile_n = tile
    else:
        c.error(f"{pp}.tile", f"expected a positive tile edge or [rows, cols], got {tile!r}")
        tile_m = tile_n = 128
    parallelism = ParallelismSpec("tile-tp", tile_m, tile_n,
                                  c.typed(pm, "min_offload_flops", pp, float, 1e6,
                                          _non_negative),
                                  c.typed(pm, "planner", pp, str, "auto", lambda v: None if v in (
                                      "auto", "fifo") else f"expected auto or fifo, got {v!r}"))
    return JobSpec(
        model=model, data=data,
        batch_size=c.typed(m, "batch_size", p, int, 8, _positive),
        steps=c.typed(m, "steps", p, int, 20, _positive),
        dtype=c.typed(m, "dtype", p, str, "float32",
                      lambda v: None if v in DTYPES else f"expected one of {DTYPES}, got {v!r}"),
        optimizer=optimizer, parallelism=parallelism,
        validation=_validation(c, m.get("validation"), f"{p}.validation"))


def parse_topology(raw: Any, source: str = "<topology>", base_dir: Path | None = None) -> Topology:
    """Validate already-loaded YAML data; raise TopologyError listing every problem."""
    c = _Checker(base_dir or Path.cwd())
    top = c.mapping(raw, "", {"name": True, "seed": False, "network": False, "devices": True,
                              "job": True, "churn": False, "time_dilation": False, "adb": False})
    name = c.name(top, "name", "", "run")
    seed = c.typed(top, "seed", "", int, 0, _non_negative)
    network = _network(c, top.get("network"))
    groups = _devices(c, top.get("devices"), list(network.switches))
    job = _job(c, top.get("job"))
    churn = c.path(top["churn"], "churn") if top.get("churn") is not None else None
    dilation: float | None = None
    raw_d = top.get("time_dilation", "auto")
    if raw_d != "auto":
        if isinstance(raw_d, (int, float)) and not isinstance(raw_d, bool) and raw_d >= 1:
            dilation = float(raw_d)
        else:
            c.error("time_dilation", f"expected 'auto' or a number >= 1, got {raw_d!r}")
    extra: dict[str, Any] = {}
    if "adb" in top:
        from testbed.adb_bridge.config import validate_adb_section

        adb_spec, adb_problems = validate_adb_section(top["adb"], "adb")
        for path, message in adb_problems:
            c.error(path, message)
        extra["adb"] = adb_spec
    if c.problems:
        raise TopologyError(source, c.problems)
    return Topology(name, Path(source).resolve() if base_dir else None, seed, network,
                    tuple(groups), job, churn, dilation, extra)


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file; raise TopologyError with every problem found."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TopologyError(str(path), [f"cannot read the file: {exc.strerror}"]) from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        raise TopologyError(str(path), [f"{where}: not valid YAML: "
                                        f"{getattr(exc, 'problem', exc)}"]) from exc
    return parse_topology(raw, str(path), path.resolve().parent)
