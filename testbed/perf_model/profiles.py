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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from testbed.emulator.energy import PowerParams
from testbed.emulator.thermal import ThermalParams
from testbed.perf_model.features import ExportedTimeModel

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


class ProfileError(ValueError):
    """A profile file that cannot be used, naming the file and field."""


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


def list_profiles() -> list[str]:
    """Names of the profiles that ship with testbed."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def find_profile(name_or_path: str, base_dir: Path | None = None) -> Path | None:
    """Resolve a profile name (shipped) or a path (relative to base_dir); None if neither."""
    shipped = PROFILE_DIR / f"{name_or_path}.yaml"
    if "/" not in name_or_path and shipped.is_file():
        return shipped
    candidate = Path(name_or_path).expanduser()
    if not candidate.is_absolute() and base_dir is not None:
        candidate = base_dir / candidate
    return candidate.resolve() if candidate.is_file() else None


def load_profile(name_or_path: str | Path, base_dir: Path | None = None) -> DeviceProfile:
    """Load and check a profile; raise ProfileError naming the file and the field."""
    path = find_profile(str(name_or_path), base_dir)
    if path is None:
        raise ProfileError(f"no device profile named {str(name_or_path)!r}; shipped profiles: "
                           f"{', '.join(list_profiles())}")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ProfileError(f"{path}: expected a mapping")

    def number(key: str, default: float | None = None) -> float:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ProfileError(f"{path}: {key}: expected a non-negative number, got {value!r}")
        return float(value)

    gflops = number("sustained_gflops")
    if gflops <= 0:
        raise ProfileError(f"{path}: sustained_gflops: must be positive")
    sections: dict[str, Any] = {}
    for key, parse in (("model", ExportedTimeModel.from_dict), ("thermal", ThermalParams.from_dict),
                       ("power", PowerParams.from_dict)):
        if raw.get(key) is None:
            sections[key] = None
            continue
        if not isinstance(raw[key], dict):
            raise ProfileError(f"{path}: {key}: expected a mapping")
        try:
            sections[key] = parse(raw[key], key)
        except ValueError as exc:
            raise ProfileError(f"{path}: {exc}") from exc
    for key in ("provenance", "evaluation"):
        if not isinstance(raw.get(key, {}), dict):
            raise ProfileError(f"{path}: {key}: expected a mapping")
    return DeviceProfile(name=str(raw.get("name", path.stem)), kind=str(raw.get("kind", "")),
                         sustained_gflops=gflops, tile_overhead_s=number("tile_overhead_s", 0.0),
                         description=str(raw.get("description", "")), path=path, raw=raw,
                         model=sections["model"], thermal=sections["thermal"],
                         power=sections["power"], provenance=dict(raw.get("provenance", {})),
                         evaluation=dict(raw.get("evaluation", {})))
