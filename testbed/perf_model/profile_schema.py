"""The device profile file as a :mod:`testbed.schema` model: every problem with its YAML path.

:func:`testbed.perf_model.profiles.load_profile` checks a file with :func:`check_profile`
before it builds the plain dataclasses the emulator reads; pydantic stays out of agents (see
``load_profile``).

Every number has a range, far wider than any shipped profile (their values in brackets below)
and any real device. The ranges exist to turn an absurd value into a refusal that names the
field: a finite but absurd number (``peak_flops: 1e-300``, ``k_block: 1e-300``, a noise
quantile of 800) passed before and made ``testbed simulate`` run forever or overflow ``exp``.
Together they also bound what a model predicts: every shape up to
:data:`~testbed.perf_model.features.MAX_DIMENSION` gets a finite time, noise and throttling
included.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, model_validator

from testbed.perf_model.features import (
    COST_FEATURES,
    DEFAULT_BLAS,
    FEATURES,
    MAX_DIMENSION,
    RATE_FEATURES,
    base_columns,
)
from testbed.perf_model.profiles import ProfileError, profile_name_problem
from testbed.schema import Float, Int, PrintableStr, Schema, Str, parse

# -- ranges: (low, high), inclusive; why, and [the shipped profiles' values] -------------------
# time model
PEAK_FLOPS = (1e6, 1e16)  # FLOP/s: a microcontroller .. 10x a data-centre GPU [6.3e9 .. 1.0e12]
SUSTAINED_GFLOPS = (1e-3, 1e7)  # GFLOP/s: the same range as peak_flops [6.25 .. 738]
BANDWIDTH_BYTES_S = (1e6, 1e14)  # byte/s: 1 MB/s .. 30x an HBM3 GPU's 3 TB/s [2e10 .. 5e10]
OVERHEAD_S = (0.0, 1.0)  # s per GEMM call (or tile): a BLAS call's fixed cost [5.8e-7 .. 5e-5]
# elements, the rate form's half_m/k/n: fits search 0..512 [0 .. 4]; a topology's tile edge is at
# most 65536 (testbed.topology.MAX_TILE), so a longer one means no tile ever nears the peak
HALF_LENGTH = (0.0, 65536.0)
COST_COEF = (0.0, 1.0)  # s per unit of a cost term (call, kernel call, element) [0 .. 1.1e-6]
LOG_COEF = (-100.0, 100.0)  # log-linear: log-seconds per feature unit; ridge fits here: <= 9
LOG_INTERCEPT = (-200.0, 200.0)  # log seconds; ridge fits here -64 .. 4 (0 in cost and rate)
# log-linear: |intercept| + sum_j |coef_j| max|phi_j| over shapes 1..MAX_DIMENSION bounds the
# exponent; e^600 s ~ 1e260 stays a float after noise (e^5) and full throttling (/ 0.01)
LOG_EXPONENT = 600.0
LOG_QUANTILE = (-5.0, 5.0)  # log(measured / predicted): a factor e^5 ~ 148x [-0.14 .. 0.19]
# blocked-BLAS constants of the cost form, whole numbers where they count elements
UNROLL = (1, 1024)  # elements per micro-kernel side: OpenBLAS's are 2..32 [16 x 4]
K_BLOCK = (1, 1_000_000)  # elements of k per block: OpenBLAS's are 64..1024 [448]
SMALL_MNK = (1.0, 1e18)  # m k n where the small-matrix path ends: any is harmless [1e6]
CACHE_BYTES = (1024.0, float(2**40))  # an L2: 1 KiB .. 1 TiB [2 MiB]
# thermal: degrees C, J/K, W/K
AMBIENT_C = (-50.0, 60.0)  # air around a device: a frozen car .. a hot car [25]
THROTTLE_C = (0.0, 150.0)  # chips are specified to ~100-125 C junction [45, 70]
CAPACITY_J_PER_K = (0.01, 1e5)  # a bare chip .. a server with its heat sinks [20.5]
CONDUCTANCE_W_PER_K = (1e-3, 1e3)  # a sealed phone .. water cooling; tau = C/G [0.137]
MIN_SPEED = (0.01, 1.0)  # clock at full throttle / full clock; below 1% a tile never ends [0.5]
SLOWDOWN = (0.0, 1.0)  # expected_sustained_slowdown: a share of throughput [0.2]
# power: W
POWER_W = (0.0, 1e4)  # active_w, idle_w: a phone's 0.5 W .. a multi-GPU server [0.5 .. 30]
RADIO_W = (0.0, 100.0)  # Wi-Fi ~0.5 W, a 5G modem a few W [0.5]


def _within(bounds: tuple[float, float], what: str, whole: bool = False) -> AfterValidator:
    """A field validator refusing a value outside ``bounds`` (inclusive), saying what it is."""
    low, high = bounds

    def check(value: float) -> float:
        if not low <= value <= high:
            raise ValueError(f"expected {what} in [{low:g}, {high:g}], got {value:g}")
        if whole and value != int(value):
            raise ValueError(f"expected a whole number of {what}, got {value:g}")
        return value

    return AfterValidator(check)


def _name(value: str) -> str:
    problem = profile_name_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _in(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= value <= bounds[1]


class NoiseSchema(Schema):
    levels: list[Annotated[Float, _within((0.0, 1.0), "a probability")]] = []
    log_quantiles: list[Annotated[Float, _within(LOG_QUANTILE, "log(measured / predicted)")]] = []

    @model_validator(mode="after")
    def _paired(self) -> "NoiseSchema":
        if len(self.levels) != len(self.log_quantiles):
            raise ValueError("levels and log_quantiles must be as many")
        if self.levels != sorted(self.levels):
            raise ValueError("levels must be sorted probabilities in [0, 1]")
        if self.log_quantiles != sorted(self.log_quantiles):
            raise ValueError("log_quantiles must be sorted (they are quantiles)")
        return self


class BlasSchema(Schema):
    """The cost form's blocked-BLAS constants (testbed.perf_model.features.DEFAULT_BLAS)."""

    unroll_n: Annotated[Float, _within(UNROLL, "elements", whole=True)]
    unroll_m: Annotated[Float, _within(UNROLL, "elements", whole=True)]
    k_block: Annotated[Float, _within(K_BLOCK, "elements", whole=True)]
    small_mnk: Annotated[Float, _within(SMALL_MNK, "m*k*n")]
    cache_bytes: Annotated[Float, _within(CACHE_BYTES, "bytes")]


class ModelSchema(Schema):
    form: str = "log-linear"
    formula: str = ""
    features: list[str]
    coef: list[Float]  # range by form: see _consistent
    intercept: Annotated[Float, _within(LOG_INTERCEPT, "log seconds")] = 0.0
    overhead_s: Annotated[Float, _within(OVERHEAD_S, "seconds")]
    peak_flops: Annotated[Float, _within(PEAK_FLOPS, "FLOP/s")]
    bandwidth_bytes_s: Annotated[Float, _within(BANDWIDTH_BYTES_S, "byte/s")]
    dtype_bytes: Annotated[Int, _within((1, 8), "bytes per element")] = 4
    noise: NoiseSchema = NoiseSchema()
    blas: BlasSchema | None = None

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
            _coef_within(self.coef, HALF_LENGTH, "a half-rate length in elements")
        elif form == "cost":
            if self.blas is None:
                raise ValueError(f"blas: expected positive numbers for exactly "
                                 f"{', '.join(DEFAULT_BLAS)}")
            _coef_within(self.coef, COST_COEF, "seconds per unit of its term")
        else:
            _coef_within(self.coef, LOG_COEF, "log seconds per unit of its feature")
            self._exponent_bounded()
        return self

    def _exponent_bounded(self) -> None:
        """Refuse a log-linear model whose exp() could overflow at some shape predict accepts."""
        ends = (1, MAX_DIMENSION)
        corners = np.array([[m, k, n] for m in ends for k in ends for n in ends])
        # every feature is monotone in each dimension or (pad_x) largest at x = 1: its largest
        # magnitude over the box of shapes is at a corner
        columns = base_columns(corners, self.peak_flops, self.bandwidth_bytes_s, self.dtype_bytes)
        bound = abs(self.intercept) + sum(abs(c) * float(abs(columns[f]).max())
                                          for f, c in zip(self.features, self.coef))
        if not bound <= LOG_EXPONENT:
            raise ValueError(f"coef: |intercept| + sum(|coef| * largest |feature|) over shapes "
                             f"up to {MAX_DIMENSION} is {bound:.4g}; at most {LOG_EXPONENT:g} "
                             f"keeps exp() of it a time in seconds a float can hold")


def _coef_within(coef: list[float], bounds: tuple[float, float], what: str) -> None:
    for i, c in enumerate(coef):
        if not _in(c, bounds):
            raise ValueError(f"coef[{i}]: expected {what} in [{bounds[0]:g}, {bounds[1]:g}], "
                             f"got {c:g}")


class ThermalSchema(Schema):
    ambient_c: Annotated[Float, _within(AMBIENT_C, "degrees C")] = 25.0
    capacity_j_per_k: Annotated[Float, _within(CAPACITY_J_PER_K, "J/K")] = 20.0
    conductance_w_per_k: Annotated[Float, _within(CONDUCTANCE_W_PER_K, "W/K")] = 0.135
    throttle_start_c: Annotated[Float, _within(THROTTLE_C, "degrees C")] = 45.0
    throttle_full_c: Annotated[Float, _within(THROTTLE_C, "degrees C")] = 70.0
    min_speed: Annotated[Float, _within(MIN_SPEED, "a share of the full clock")] = 0.5
    # documentation of the calibration
    expected_sustained_slowdown: Annotated[Float, _within(SLOWDOWN, "a share")] | None = None
    provenance: str | None = None

    @model_validator(mode="after")
    def _order(self) -> "ThermalSchema":
        if self.throttle_full_c <= self.throttle_start_c:
            raise ValueError("throttle_full_c: must be above throttle_start_c")
        return self


class PowerSchema(Schema):
    active_w: Annotated[Float, _within(POWER_W, "watts")]
    idle_w: Annotated[Float, _within(POWER_W, "watts")]
    radio_w: Annotated[Float, _within(RADIO_W, "watts")] = 0.5
    provenance: str | None = None

    @model_validator(mode="after")
    def _order(self) -> "PowerSchema":
        if self.active_w < self.idle_w:
            raise ValueError("active_w: must be at least idle_w")
        return self


class ProfileSchema(Schema):
    name: Annotated[Str, AfterValidator(_name)] | None = None
    kind: Literal["phone", "laptop", "desktop", "host", ""] = ""
    description: PrintableStr = ""
    sustained_gflops: Annotated[Float, _within(SUSTAINED_GFLOPS, "GFLOP/s")]
    tile_overhead_s: Annotated[Float, _within(OVERHEAD_S, "seconds")] = 0.0
    model: ModelSchema | None = None
    thermal: ThermalSchema | None = None
    power: PowerSchema | None = None
    evaluation: dict[str, Any] = {}
    provenance: dict[str, Any] = {}
    assumes: dict[str, Any] = {}  # precision, library, threads the figures assume


def check_profile(raw: Any, source: str) -> ProfileSchema:
    """Validate a profile's plain data; ProfileError listing every problem with its path."""
    return parse(ProfileSchema, raw, source, error=ProfileError)


def model_problems(model: dict[str, Any]) -> list[str]:
    """Every problem of a profile's ``model`` section (plain data), as ``model.path: message``."""
    try:
        parse(ModelSchema, model, "model", error=ProfileError, root="model")
    except ProfileError as exc:
        return list(exc.problems)
    return []

