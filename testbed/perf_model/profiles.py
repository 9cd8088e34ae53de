"""Device profiles: what an emulated device is, with where every figure came from.

A profile is a YAML file in ``testbed/perf_model/profiles/`` (or any path a topology names)::

    name: snapdragon888
    kind: phone                  # phone | laptop | desktop | host
    description: Snapdragon 888 class phone, CPU
    sustained_gflops: 20.0       # float32 GEMM throughput a training workload sustains
    tile_overhead_s: 0.002       # fixed cost per tile (dispatch, memory traffic not in FLOPs)
    provenance:                  # one line per figure, with its source
      sustained_gflops: "15-30 GFLOPS sustained training on Snapdragon 8-series CPUs
        (Das et al., arXiv 2202.10100)"

The performance model adds optional sections (all checked on load; errors name file and field)::

    model:        # the exported time model, see testbed.perf_model.features.ExportedTimeModel
      features: [log2_m, ...]
      coef: [...]
      intercept: -20.1
      overhead_s: 2.0e-6
      peak_flops: 1.2e11
      bandwidth_bytes_s: 2.0e10
      noise: {levels: [0.01, ...], log_quantiles: [-0.1, ...]}
    thermal:      # testbed.emulator.thermal.ThermalParams (degrees C, J/K, W/K)
      ambient_c: 25
      capacity_j_per_k: 20
      conductance_w_per_k: 0.135
      throttle_start_c: 45
      throttle_full_c: 70
      min_speed: 0.5
      expected_sustained_slowdown: 0.2   # what the parameters were calibrated to (documentation)
    power: {active_w: 5.0, idle_w: 0.3, radio_w: 0.5}   # testbed.emulator.energy.PowerParams
    evaluation:   # figures `testbed perf eval` printed when the profile was built
    provenance:   # one entry per figure, with its source

Without ``model`` a device runs at ``sustained_gflops`` plus ``tile_overhead_s`` per tile; without
``thermal`` it never throttles; without ``power`` it reports no energy.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from testbed.errors import InputError
from testbed.names import name_problem
from testbed.perf_model.features import ExportedTimeModel
from testbed.user_paths import input_problem, is_file, load_user_yaml, read_user_text, user_path

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
MAX_PROFILE_BYTES = 16 * 1024**2  # a profile is a few KB; a name of a huge file is a mistake
WIFI_RADIO_W = 0.5  # HotCarbon'25 (arXiv 2507.01803): Wi-Fi radio power


@dataclass(frozen=True)
class ThermalParams:
    """Parameters of the lumped thermal model of one device."""

    ambient_c: float = 25.0
    capacity_j_per_k: float = 20.0
    conductance_w_per_k: float = 0.135
    throttle_start_c: float = 45.0
    throttle_full_c: float = 70.0
    min_speed: float = 0.5

    @property
    def tau_s(self) -> float:
        """Thermal time constant C / G in seconds."""
        return self.capacity_j_per_k / self.conductance_w_per_k

    def speed(self, temperature_c: float) -> float:
        """Speed factor s(T) in [min_speed, 1]."""
        if temperature_c <= self.throttle_start_c:
            return 1.0
        span = self.throttle_full_c - self.throttle_start_c
        x = min(1.0, (temperature_c - self.throttle_start_c) / span)
        return 1.0 - (1.0 - self.min_speed) * x

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "thermal") -> "ThermalParams":
        """Read a profile's thermal section; ValueError naming the field on a problem."""
        known = {f: getattr(cls, f) for f in cls.__dataclass_fields__}
        unknown = [key for key in data if key not in known and key != "provenance"
                   and key != "expected_sustained_slowdown"]
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; expected "
                             f"{', '.join(known)}")
        values = {}
        for key, default in known.items():
            value = data.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}.{key}: expected a number, got {value!r}")
            values[key] = float(value)
        params = cls(**values)
        if params.capacity_j_per_k <= 0 or params.conductance_w_per_k <= 0:
            raise ValueError(f"{where}: capacity_j_per_k and conductance_w_per_k must be > 0")
        if params.throttle_full_c <= params.throttle_start_c:
            raise ValueError(f"{where}.throttle_full_c: must be above throttle_start_c")
        if not 0 < params.min_speed <= 1:
            raise ValueError(f"{where}.min_speed: expected a number in (0, 1]")
        return params



@dataclass(frozen=True)
class PowerParams:
    """A device's power model in watts."""

    active_w: float
    idle_w: float
    radio_w: float = WIFI_RADIO_W

    def busy_w(self, speed: float) -> float:
        """Power while computing at speed factor s."""
        return self.idle_w + (self.active_w - self.idle_w) * speed

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "power") -> "PowerParams":
        """Read a profile's power section; ValueError naming the field on a problem."""
        values = {}
        for key in ("active_w", "idle_w", "radio_w"):
            value = data.get(key, WIFI_RADIO_W if key == "radio_w" else None)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{where}.{key}: expected a number of watts >= 0, got {value!r}")
            values[key] = float(value)
        unknown = [k for k in data if k not in values and k != "provenance"]
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}")
        if values["active_w"] < values["idle_w"]:
            raise ValueError(f"{where}.active_w: must be at least idle_w")
        return cls(**values)




class ProfileError(InputError):
    """A profile file that cannot be used: every problem with its field path."""


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    kind: str
    sustained_gflops: float
    tile_overhead_s: float
    description: str = ""
    path: Path | None = None
    raw: dict[str, Any] = field(default_factory=dict)  # every field, for the parts that add more
    model: ExportedTimeModel | None = None  # per-shape time model (None: sustained rate only)
    thermal: ThermalParams | None = None  # None: never throttles
    power: PowerParams | None = None  # None: no energy figures
    provenance: dict[str, Any] = field(default_factory=dict)
    evaluation: dict[str, Any] = field(default_factory=dict)


def profile_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a profile's name; None when it can. A name find_profile resolves
    is the file NAME.yaml in PROFILE_DIR and a topology's ``profile:`` writes it, so it follows
    the rule of every name (:mod:`testbed.names`)."""
    return name_problem(name, "profile name")


def list_profiles() -> list[str]:
    """Names of the profiles that ship with testbed."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def find_profile(name_or_path: str, base_dir: Path | None = None) -> Path | None:
    """Resolve a profile name (shipped) or a path (relative to base_dir); None if neither."""
    shipped = PROFILE_DIR / f"{name_or_path}.yaml"
    if "/" not in name_or_path and is_file(shipped):
        return shipped
    candidate = user_path(name_or_path, base_dir)
    return candidate.resolve() if is_file(candidate) else None


def profile_problems(path: Path) -> list[str]:
    """Every problem of the profile file at ``path`` (none: it loads), for a topology that names
    it: `testbed validate` then says what `testbed up` would stop on."""
    try:
        stat = path.stat()
    except OSError as exc:
        return [f"cannot read the file: {exc.strerror}"]
    return list(_problems_of_version(str(path), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=256)
def _problems_of_version(path: str, _mtime_ns: int, _size: int) -> tuple[str, ...]:
    # keyed on the file's version: a topology is loaded many times in one process (the PS, the
    # tests), and a profile edited in between is read again
    try:
        load_profile(path)
    except ProfileError as exc:
        return tuple(exc.problems)
    return ()


def load_profile(name_or_path: str | Path, base_dir: Path | None = None,
                 check: bool = True) -> DeviceProfile:
    """Load a profile; raise ProfileError listing every problem with its field path.

    ``check`` validates the whole file with the :mod:`testbed.perf_model.profile_schema` model
    first. A device agent passes ``check=False``: it reads a profile the supervisor (``testbed
    up``) or its operator has already checked, and must not import pydantic (hundreds of agents,
    phones without it). Unchecked, the sections are still read through their own constructors,
    which refuse what they cannot use (the first problem only). The choice is the caller's, never
    inferred from what the process has imported: that made the result depend on test order.
    """
    path = find_profile(str(name_or_path), base_dir)
    if path is None:
        candidate = user_path(str(name_or_path), base_dir)
        there = input_problem(candidate) if os.path.lexists(candidate) else None
        # a path (a '/' or a .yaml name) that is not there: said, not only "no profile named"
        missing = (not os.path.lexists(candidate)
                   and ("/" in str(name_or_path) or str(name_or_path).endswith((".yaml", ".yml"))))
        raise ProfileError(str(name_or_path), [
            f"no device profile named {str(name_or_path)!r}"
            + (f", and {there}" if there else "")
            + (f" (no such file: {candidate})" if missing else "")
            + f"; shipped profiles: {', '.join(list_profiles())}"])
    try:
        raw = load_user_yaml(read_user_text(path, MAX_PROFILE_BYTES, errors="replace")) or {}
    except OSError as exc:
        raise ProfileError(str(path), [f"cannot read the file: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ProfileError(str(path), [f"not readable YAML: {exc}"]) from None
    if not isinstance(raw, dict):
        raise ProfileError(str(path), ["<top>: expected a mapping"])
    if check:
        from testbed.perf_model.profile_schema import check_profile
        check_profile(raw, str(path))
    sections: dict[str, Any] = {}
    for key, parse in (("model", ExportedTimeModel.from_dict), ("thermal", ThermalParams.from_dict),
                       ("power", PowerParams.from_dict)):
        if raw.get(key) is None:
            sections[key] = None
            continue
        try:
            if not isinstance(raw[key], dict):
                raise ValueError(f"{key}: expected a mapping")
            sections[key] = parse(raw[key], key)
        except (ValueError, TypeError) as exc:
            raise ProfileError(str(path), [str(exc)]) from None
    try:
        gflops = float(raw["sustained_gflops"])
        overhead_s = float(raw.get("tile_overhead_s", 0.0))
        if not (gflops > 0 and math.isfinite(gflops) and overhead_s >= 0):
            raise ValueError("sustained_gflops must be > 0 and tile_overhead_s >= 0")
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(str(path), [f"sustained_gflops/tile_overhead_s: {exc}"]) from None
    return DeviceProfile(name=str(raw.get("name") or path.stem), kind=str(raw.get("kind", "")),
                         sustained_gflops=gflops, tile_overhead_s=overhead_s,
                         description=str(raw.get("description", "")), path=path, raw=raw,
                         model=sections["model"], thermal=sections["thermal"],
                         power=sections["power"],
                         provenance=dict(raw.get("provenance") or {}),
                         evaluation=dict(raw.get("evaluation") or {}))
