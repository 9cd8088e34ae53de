"""Checks on a returned tile, before the PS trusts it.

Boundary checks (cheap, always): the result is 2-D with the tile's shape, has the job's dtype,
and every value is finite.

Value check (Freivalds, 1977): for a random vector r a correct ``C = A·B`` satisfies
``A·(B·r) = C·r``. That costs ``2(mk + kn + mn)`` FLOPs against the tile's ``2mkn`` (under 1% for
tiles of 128 and more). The check is computed in float64 whatever the tile's dtype, so the only
rounding that matters is the device's own in C. Its tolerance is norm-wise: row i passes when

    |(A·(B·r))_i - (C·r)_i|  <=  TAU · u · ||a_i||₂ · max(||B||_F, ||B·r||₂)

with u the unit roundoff of C's dtype (2⁻²⁴ for float32, 2⁻⁵³ for float64).

r's entries are uniform on [-1, 1], not the textbook ±1. With ±1 an error whose entries in a
row cancel under r escapes with probability up to 1/2 per vector, and a constant added to a
whole tile escapes whenever r's entries sum to zero, about ``√(2/(πn))`` of the draws for n
columns (8 % at 96). With a continuous r a fixed nonzero error is orthogonal to r with
probability zero, so an error escapes only by staying within the tolerance.

The device's rounding errors δ_ij in C are about u·||a_i||·||b_j|| each with no sign pattern
tied to r, so, as |r_j| <= 1, ``|Σ_j δ_ij r_j|`` is at most about
u·||a_i||·sqrt(Σ_j ||b_j||²) = u·||a_i||·||B||_F. (An earlier version used ``||B·r||`` alone,
which is the same on average but collapses when B's columns cancel under r, e.g. correlated
activations in a weight gradient, and then refused an honest tile.) On honest tiles (random
operands, both signs and same-sign, scales 0.01–100, k from 8 to 3072) the left side stayed
below 5·u·||a_i||·||B||_F; TAU = 64 leaves more than 10x headroom (tests/unit/test_validation.py
and test_behaviour_validation.py check honest tiles, columns that cancel, and corruptions). A
relative error ε spread over C moves the residual by about ε/(u·√(3k)) units (r's mean square
is 1/3), so errors larger than ~2·TAU·u·√k relative are caught (about 2e-4 for float32 at
k = 1024); bit flips in the sign or exponent always are, flips in the lowest mantissa bits are
below any tolerance.

**Sharing work between the tiles of one GEMM** (:class:`GemmCheck`, what the scheduler uses).
The PS draws the random vectors once per column block j of C (they never leave the PS, so a
device cannot aim at them). At the GEMM's first checked tile it computes, in float64, every
``B_j·r_j`` side by side (a K x J matrix, one pass over B), ``A·[B_1 r_1 ... B_J r_J]`` (one
M x K x J product, one pass over A), the ``||B_j||_F`` and the row norms of A. A tile (i, j) then
costs only ``C_ij·r_j`` (m·n multiply-adds, as much as decoding it) and a comparison. Over a GEMM
that is about 1/tile_n of the GEMM's FLOPs, in a few passes over A and B. A K-split GEMM's
partials are checked the same way per slice ``s`` (vectors per column block and slice, ``A[:,
s]·B[s, j]·r``, the slice's row norms): before, each partial was checked alone
(:func:`freivalds_ok`, converting its A and B blocks to float64), so every A block was converted
and multiplied once per column block and every B block once per row block, and the backward
pairs, all K-split, were most of the PS's checking time. :func:`freivalds_ok` is the one-tile
version.
"""

from __future__ import annotations

import numpy as np

from testbed.wire import MAX_IN_FLIGHT

TAU = 64.0
_RNG = np.random.default_rng(20240601)
_TINY = float(np.finfo(np.float64).tiny)


def _unit_roundoff(dtype: np.dtype) -> float:
    return float(np.finfo(dtype).eps) / 2


def _vectors(rng: np.random.Generator, n: int, vectors: int) -> np.ndarray:
    """An n x vectors matrix of random entries, uniform on [-1, 1] (float64)."""
    return rng.uniform(-1.0, 1.0, size=(n, vectors))


def _column_bound(b64: np.ndarray, br: np.ndarray) -> np.ndarray:
    """max(||B||_F, ||B·r||) per vector."""
    frobenius = np.sqrt(np.einsum("ij,ij->", b64, b64))
    return np.maximum(np.sqrt(np.einsum("ij,ij->j", br, br)), frobenius)


def freivalds_ok(a: np.ndarray, b: np.ndarray, c: np.ndarray, vectors: int = 1,
                 rng: np.random.Generator | None = None, tau: float = TAU) -> bool:
    """Whether C passes Freivalds' check against A·B with `vectors` random vectors."""
    rng = rng or _RNG
    a64, b64, c64 = (x.astype(np.float64, copy=False) for x in (a, b, c))
    scale = tau * _unit_roundoff(c.dtype) * np.sqrt(np.einsum("ij,ij->i", a64, a64))
    r = _vectors(rng, c.shape[1], vectors)
    br = b64 @ r
    residual = np.abs(a64 @ br - c64 @ r)
    bound = scale[:, None] * _column_bound(b64, br)[None, :] + _TINY
    return bool((residual <= bound).all())


class GemmCheck:
    """Freivalds' check for the tiles of one GEMM C = A·B, sharing work between tiles.

    ``columns`` names the GEMM's column blocks ``(c0, c1)``, or for a K-split GEMM its blocks
    ``(c0, c1, k0, k1)``: a partial ``A[:, k0:k1]·B[k0:k1, c0:c1]`` is checked like a tile of
    the GEMM of that slice, with the slice's own vectors, products and row norms.
    """

    def __init__(self, a: np.ndarray, b: np.ndarray, columns: list[tuple[int, ...]],
                 vectors: int = 1, rng: np.random.Generator | None = None, tau: float = TAU):
        self.a = a
        self.b = b
        k = b.shape[0]
        blocks = {(x[0], x[1], *(x[2:4] if len(x) == 4 else (0, k))) for x in columns}
        self.columns = {box: j for j, box in enumerate(sorted(blocks))}
        self.vectors = vectors
        self.rng = rng or _RNG
        self.tau = tau
        self._ready = False

    def _prepare(self) -> None:
        v = self.vectors
        self.r: dict[int, np.ndarray] = {}
        self.column_bound = np.empty(len(self.columns) * v)
        self.abr: dict[tuple[int, int], np.ndarray] = {}  # per K slice
        self.row_scale: dict[tuple[int, int], np.ndarray] = {}
        self._where: dict[int, tuple[tuple[int, int], int]] = {}  # block -> (slice, column)
        slices: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for (c0, c1, k0, k1), j in self.columns.items():
            slices.setdefault((k0, k1), []).append((c0, c1, j))
        for (k0, k1), blocks in slices.items():
            br = np.empty((k1 - k0, len(blocks) * v))
            for at, (c0, c1, j) in enumerate(blocks):
                b64 = np.asarray(self.b[k0:k1, c0:c1], dtype=np.float64)
                r = self.r[j] = _vectors(self.rng, c1 - c0, v)
                br[:, at * v:(at + 1) * v] = b64 @ r
                self.column_bound[j * v:(j + 1) * v] = _column_bound(
                    b64, br[:, at * v:(at + 1) * v])
                self._where[j] = ((k0, k1), at)
            a64 = np.asarray(self.a[:, k0:k1], dtype=np.float64)
            self.abr[(k0, k1)] = a64 @ br
            self.row_scale[(k0, k1)] = self.tau * _unit_roundoff(self.a.dtype) * np.sqrt(
                np.einsum("ij,ij->i", a64, a64))
        self._ready = True

    def tile_ok(self, r0: int, r1: int, c0: int, c1: int, c: np.ndarray, k0: int = 0,
                k1: int = -1) -> bool:
        """Whether C's tile [r0:r1, c0:c1] (a partial over [k0:k1] when ``k1 >= 0``) passes
        (shape and dtype already checked)."""
        if not self._ready:
            self._prepare()
        j = self.columns[(c0, c1, k0, k1 if k1 >= 0 else self.b.shape[0])]
        v = self.vectors
        piece, at = self._where[j]
        residual = np.abs(self.abr[piece][r0:r1, at * v:(at + 1) * v] - c @ self.r[j])
        bound = np.multiply.outer(self.row_scale[piece][r0:r1],
                                  self.column_bound[j * v:(j + 1) * v])
        return bool((residual <= bound + _TINY).all())


def check_result(a: np.ndarray, b: np.ndarray, c: np.ndarray, check_values: bool = True,
                 vectors: int = 1, gemm: GemmCheck | None = None,
                 box: tuple[int, ...] | None = None) -> str | None:
    """None if C is an acceptable result for A·B, else why not.

    With ``gemm`` and ``box`` (r0, r1, c0, c1, and k0, k1 for a partial) the value check uses
    the GEMM's shared work;
    ``a`` and ``b`` are then the tile's blocks (for the shape and dtype checks).
    """
    expected = (a.shape[0], b.shape[1])
    if c.shape != expected:
        return f"wrong shape {tuple(c.shape)}, expected {expected}"
    if c.dtype != a.dtype:
        return f"wrong dtype {c.dtype}, expected {a.dtype}"
    if not np.isfinite(c).all():
        return "result has non-finite values (NaN or Inf)"
    if check_values:
        if gemm is not None and box is not None:
            k0, k1 = (box[4], box[5]) if len(box) == 6 else (0, -1)
            ok = gemm.tile_ok(box[0], box[1], box[2], box[3], c, k0, k1)
        else:
            ok = freivalds_ok(a, b, c, vectors)
        if not ok:
            return "result fails the Freivalds check (C·r differs from A·(B·r))"
    return None


# -- what a device says about itself and its work ----------------------------------------------
# Every number a device sends is untrusted: a NaN in a speed poisons every division that uses it,
# an Inf in a joule count makes the run's records unreadable JSON. The bounds below are far beyond
# any real device (a data-center GPU does ~1e3 GFLOP/s in float64, a tile takes well under an
# hour) and only exist to turn absurd values into a clear refusal.
MAX_NAME_CHARS = 128  # device name, group, kind
MAX_PROFILE_CHARS = 4096  # a profile name or the path of a profile file (PATH_MAX)
MAX_INSTANCE_CHARS = 64  # an agent process's random instance (16 hex digits from ours)
MAX_PLATFORM_CHARS = 256  # free text, truncated rather than refused
MAX_PREDICTED_GFLOPS = 1e6
# MAX_IN_FLIGHT (the largest window a device may ask for) is testbed.wire's: the agent checks it too
MAX_CACHE_BYTES = 1 << 40
MAX_TILE_SECONDS = 1e6  # compute_s and lag_s of one tile
MAX_TILE_JOULES = 1e9  # energy_j of one tile
MAX_CLOCK_S = 1e12  # a device's own monotonic clock readings (received_s, started_s, done_s)
MAX_TELEMETRY_KEYS = 32  # distinct telemetry keys kept per device (values and labels together)
MAX_TELEMETRY_KEY_CHARS = 64
MAX_TELEMETRY_LABEL_CHARS = 128
MAX_TELEMETRY_ABS = 1e12


def finite_in(value: float, low: float, high: float) -> bool:
    """Whether value is a finite number in [low, high]."""
    return bool(np.isfinite(value)) and low <= value <= high


def printable_label(text: str, limit: int) -> bool:
    """A name the PS will write into its logs: short, printable, no control characters."""
    return len(text) <= limit and text.isprintable()


def clip_text(text: str, limit: int) -> str:
    """Text cut to `limit` characters (marked with "..."), control characters replaced."""
    text = "".join(ch if ch.isprintable() else "?" for ch in text[:limit + 1])
    return text if len(text) <= limit else text[:limit] + "..."


def descriptor_problem(name: str, group: str, kind: str, profile: str, predicted_gflops: float,
                       max_in_flight: int, cache_bytes: int, instance: str = "") -> str | None:
    """None if a Join's device descriptor is acceptable, else why not (names the field)."""
    for field_name, text, limit in (("name", name, MAX_NAME_CHARS),
                                    ("group", group, MAX_NAME_CHARS),
                                    ("kind", kind, MAX_NAME_CHARS),
                                    ("profile", profile, MAX_PROFILE_CHARS),
                                    ("instance", instance, MAX_INSTANCE_CHARS)):
        if not printable_label(text, limit):
            return (f"device.{field_name} must be printable and at most {limit} "
                    f"characters (got {len(text)})")
    if kind not in ("", "emulated", "real"):
        return f"device.kind must be 'emulated' or 'real', got {clip_text(kind, 16)!r}"
    # 0 means "not given" (proto3 default); anything else must be a real speed
    if predicted_gflops != 0 and not finite_in(predicted_gflops, 1e-6, MAX_PREDICTED_GFLOPS):
        return (f"device.predicted_gflops must be 0 (not given) or a finite number in "
                f"[1e-06, {MAX_PREDICTED_GFLOPS:g}], got {predicted_gflops!r}")
    if not 0 <= max_in_flight <= MAX_IN_FLIGHT:
        return f"device.max_in_flight must be in [1, {MAX_IN_FLIGHT}], got {max_in_flight}"
    if not 0 <= cache_bytes <= MAX_CACHE_BYTES:
        return f"device.cache_bytes must be in [0, {MAX_CACHE_BYTES}], got {cache_bytes}"
    return None


def result_numbers_problem(compute_s: float, energy_j: float, lag_s: float, received_s: float,
                           started_s: float, done_s: float) -> str | None:
    """None if a TileResult's timing and energy are finite and in range, else why not."""
    for field_name, value, high in (("compute_s", compute_s, MAX_TILE_SECONDS),
                                    ("energy_j", energy_j, MAX_TILE_JOULES),
                                    ("lag_s", lag_s, MAX_TILE_SECONDS),
                                    ("received_s", received_s, MAX_CLOCK_S),
                                    ("started_s", started_s, MAX_CLOCK_S),
                                    ("done_s", done_s, MAX_CLOCK_S)):
        if not finite_in(value, 0.0, high):
            return f"{field_name} must be a finite number in [0, {high:g}], got {value!r}"
    return None


def bounded_telemetry(current: dict[str, object], values: dict[str, float],
                      labels: dict[str, str]) -> int:
    """Merge a telemetry message into `current` within the limits; return entries dropped.

    Keys longer than MAX_TELEMETRY_KEY_CHARS, non-finite or huge values, and new keys beyond
    MAX_TELEMETRY_KEYS are dropped; labels are cut to MAX_TELEMETRY_LABEL_CHARS.
    """
    dropped = 0
    items: list[tuple[str, float | str]] = [*values.items(), *labels.items()]
    for key, value in items:
        if not printable_label(key, MAX_TELEMETRY_KEY_CHARS) or \
                (key not in current and len(current) >= MAX_TELEMETRY_KEYS):
            dropped += 1
            continue
        if isinstance(value, str):
            current[key] = clip_text(value, MAX_TELEMETRY_LABEL_CHARS)
        elif finite_in(value, -MAX_TELEMETRY_ABS, MAX_TELEMETRY_ABS):
            current[key] = float(value)
        else:
            dropped += 1
    return dropped
