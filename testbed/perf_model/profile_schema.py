"""The device profile file as a :mod:`testbed.schema` model: every problem with its YAML path.

:func:`testbed.perf_model.profiles.load_profile` checks a file with :func:`check_profile`
before it builds the plain dataclasses the emulator reads; pydantic stays out of agents (see
``load_profile``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from testbed.perf_model.features import COST_FEATURES, DEFAULT_BLAS, FEATURES, RATE_FEATURES
from testbed.perf_model.profiles import ProfileError
from testbed.schema import Schema, finite, parse

Finite = float


class NoiseSchema(Schema):
    levels: list[float] = []
    log_quantiles: list[float] = []

    @model_validator(mode="after")
    def _paired(self) -> "NoiseSchema":
        if len(self.levels) != len(self.log_quantiles):
            raise ValueError("levels and log_quantiles must be as many")
        if self.levels != sorted(self.levels) or any(not 0 <= x <= 1 for x in self.levels):
            raise ValueError("levels must be sorted probabilities in [0, 1]")
        if self.log_quantiles != sorted(self.log_quantiles):
            raise ValueError("log_quantiles must be sorted (they are quantiles)")
        for x in self.log_quantiles:
            finite(x, "log_quantiles")
        return self


class ModelSchema(Schema):
    form: str = "log-linear"
    formula: str = ""
    features: list[str]
    coef: list[float]
    intercept: float = 0.0
    overhead_s: float = Field(ge=0)
    peak_flops: float = Field(gt=0)
    bandwidth_bytes_s: float = Field(gt=0)
    dtype_bytes: int = Field(default=4, ge=1, le=8)
    noise: NoiseSchema = NoiseSchema()
    blas: dict[str, float] | None = None

    @field_validator("intercept", "overhead_s", "peak_flops", "bandwidth_bytes_s")
    @classmethod
    def _finite(cls, v: float) -> float:
        return finite(v)

    @field_validator("coef")
    @classmethod
    def _finite_coef(cls, v: list[float]) -> list[float]:
        for c in v:
            finite(c, "every coefficient")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "ModelSchema":
        form = self.form
        if form not in ("log-linear", "cost", "rate"):
            if not form.startswith("t = overhead_s"):  # profiles before the cost form
                raise ValueError(f"form: expected 'log-linear', 'cost' or 'rate', got {form!r}")
            form = "log-linear"
        known = {"cost": COST_FEATURES, "rate": RATE_FEATURES}.get(form, FEATURES)
        unknown = [f for f in self.features if f not in known]
        if unknown:
            raise ValueError(f"features: unknown {form} feature(s) {', '.join(unknown)}")
        if len(self.coef) != len(self.features):
            raise ValueError(f"coef: expected {len(self.features)} numbers (one per feature), "
                             f"got {len(self.coef)}")
        if form == "rate":
            if tuple(self.features) != RATE_FEATURES:
                raise ValueError(f"features: the rate form needs {', '.join(RATE_FEATURES)}")
            if any(c < 0 for c in self.coef):
                raise ValueError("coef: half-rate lengths must be >= 0 (a negative one lets the "
                                 "rate exceed peak_flops)")
        if form == "cost" and (self.blas is None or set(self.blas) != set(DEFAULT_BLAS)
                               or any(v <= 0 for v in self.blas.values())):
            raise ValueError(f"blas: expected positive numbers for exactly "
                             f"{', '.join(DEFAULT_BLAS)}")
        return self


class ThermalSchema(Schema):
    ambient_c: float = 25.0
    capacity_j_per_k: float = Field(default=20.0, gt=0)
    conductance_w_per_k: float = Field(default=0.135, gt=0)
    throttle_start_c: float = 45.0
    throttle_full_c: float = 70.0
    min_speed: float = Field(default=0.5, gt=0, le=1)
    expected_sustained_slowdown: float | None = None  # documentation of the calibration
    provenance: str | None = None

    @model_validator(mode="after")
    def _order(self) -> "ThermalSchema":
        for name in ("ambient_c", "capacity_j_per_k", "conductance_w_per_k", "throttle_start_c",
                     "throttle_full_c"):
            finite(getattr(self, name), name)
        if self.throttle_full_c <= self.throttle_start_c:
            raise ValueError("throttle_full_c: must be above throttle_start_c")
        return self


class PowerSchema(Schema):
    active_w: float = Field(ge=0)
    idle_w: float = Field(ge=0)
    radio_w: float = Field(default=0.5, ge=0)
    provenance: str | None = None

    @model_validator(mode="after")
    def _order(self) -> "PowerSchema":
        for name in ("active_w", "idle_w", "radio_w"):
            finite(getattr(self, name), name)
        if self.active_w < self.idle_w:
            raise ValueError("active_w: must be at least idle_w")
        return self


class ProfileSchema(Schema):
    name: str | None = None
    kind: Literal["phone", "laptop", "desktop", "host", ""] = ""
    description: str = ""
    sustained_gflops: float = Field(gt=0)
    tile_overhead_s: float = Field(default=0.0, ge=0)
    model: ModelSchema | None = None
    thermal: ThermalSchema | None = None
    power: PowerSchema | None = None
    evaluation: dict[str, Any] = {}
    provenance: dict[str, Any] = {}
    assumes: dict[str, Any] = {}  # precision, library, threads the figures assume

    @field_validator("sustained_gflops", "tile_overhead_s")
    @classmethod
    def _finite(cls, v: float) -> float:
        return finite(v)


def check_profile(raw: Any, source: str) -> ProfileSchema:
    """Validate a profile's plain data; ProfileError listing every problem with its path."""
    return parse(ProfileSchema, raw, source, error=ProfileError)
