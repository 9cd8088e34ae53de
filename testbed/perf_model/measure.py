"""Measuring GEMM tile times: shape sweeps, and runners that time one shape somewhere.

What is timed is exactly what a device agent does with a tile: ``C = A @ B`` with numpy, A an
m x k and B a k x n C-contiguous array of the given dtype, C freshly allocated. A runner times one
shape (warm-up calls, then ``repeats`` samples; a sample loops the call until it lasts at least
``min_sample_s`` so that microsecond tiles are not lost in timer noise) and returns the seconds
of one call per sample. The sweep records the **minimum** over all samples of a shape by default:
on a shared machine interference (preemption, a busy sibling hyper-thread, cache eviction) only
ever adds time, so the fastest of many short samples is the stable figure (the advice of
Python's ``timeit`` documentation). The median of a few repeats moved by 10-17% at p90 between
runs here; the min of 60 passes x 3 moved by 1.6% (docs/perf-models.md).

The seam for other machines is :class:`GemmRunner`: :class:`LocalNumpyRunner` times on this
host; a runner that pushes a script to a phone over ADB and reads its timings back implements
the same two methods, and :func:`measure` works unchanged.

Shapes follow a training step's GEMMs cut into tiles (rows of C, columns of C, shared dimension):
``forward`` Y = X W^T (k = input features), ``input_grad`` dX = dY W (k = output features),
``weight_grad`` dW = dY^T X (k = tokens of the batch, larger). For a tile the op kind is only its
shape; it is recorded so that the data says where each shape came from.
"""

from __future__ import annotations

import logging
import math
import numbers
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import numpy as np

from testbed.perf_model.measurements import MIN_MODEL_SECONDS, Measurement

log = logging.getLogger(__name__)

SWEEPS = {"quick": 150, "full": 600}  # number of shapes; quick takes well under a minute here
K_RANGE = {"forward": (64, 2048), "input_grad": (64, 4096), "weight_grad": (256, 4096)}
MN_RANGE = (16, 512)
# plain Python: typed, and the same figures as numpy on a list of floats
STATISTICS: dict[str, Callable[[list[float]], float]] = {"min": min, "median": statistics.median}


@dataclass(frozen=True)
class Shape:
    """One tile shape to time: C[m x n] = A[m x k] @ B[k x n], from a GEMM of kind op."""

    op: str
    m: int
    k: int
    n: int


class GemmRunner(Protocol):
    """Times GEMMs on some device (this host, a phone over ADB, ...)."""

    def describe(self) -> dict[str, str | int]:
        """device, backend, threads and cpu_model of what this runner measures."""
        ...

    def time_gemm(self, m: int, k: int, n: int, dtype: str, warmup: int,
                  repeats: int) -> list[float]:
        """Seconds of one ``A @ B`` call, one figure per repeat (after ``warmup`` calls)."""
        ...


def cpu_model() -> str:
    """The CPU model name of this host (from /proc/cpuinfo, else platform)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_name() -> str:
    """The BLAS numpy uses here ("openblas", "mkl", ...)."""
    try:
        from threadpoolctl import threadpool_info
        for pool in threadpool_info():
            if pool.get("user_api") == "blas":
                return str(pool.get("internal_api", "blas"))
    except ImportError:  # threadpoolctl comes with scikit-learn; absent on a phone
        pass
    return "blas"


class LocalNumpyRunner:
    """Times numpy ``A @ B`` in this process with ``threads`` BLAS threads."""

    def __init__(self, device: str = "host", threads: int = 1, min_sample_s: float = 2e-4,
                 seed: int = 0) -> None:
        self.device = device
        self.threads = threads
        self.min_sample_s = min_sample_s
        self._rng = np.random.default_rng(seed)

    def describe(self) -> dict[str, str | int]:
        """device, backend, threads and cpu_model of this host."""
        return {"device": self.device, "backend": f"numpy-{blas_name()}",
                "threads": self.threads, "cpu_model": cpu_model()}

    def time_gemm(self, m: int, k: int, n: int, dtype: str, warmup: int,
                  repeats: int) -> list[float]:
        """Seconds of one ``A @ B`` call, one figure per repeat."""
        a = self._rng.standard_normal((m, k)).astype(dtype)
        b = self._rng.standard_normal((k, n)).astype(dtype)
        with _blas_threads(self.threads):
            for _ in range(max(warmup, 1)):
                start = time.perf_counter()
                a @ b
                one_s = time.perf_counter() - start
            inner = max(1, int(self.min_sample_s / max(one_s, 1e-7)))
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(inner):
                    a @ b
                samples.append((time.perf_counter() - start) / inner)
        return samples


class _blas_threads:
    """Context manager limiting BLAS threads (threadpoolctl when present)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._ctx = None

    def __enter__(self) -> None:
        try:
            from threadpoolctl import threadpool_limits
            self._ctx = threadpool_limits(limits=self.threads, user_api="blas")
        except ImportError:
            self._ctx = None

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.unregister()  # type: ignore[attr-defined]


def _log_uniform_int(rng: np.random.Generator, low: int, high: int, align: int) -> int:
    value = float(np.exp(rng.uniform(np.log(low), np.log(high))))
    if align > 1:
        value = max(align, round(value / align) * align)
    return int(min(max(value, low), high))


def sweep_shapes(size: str = "quick", seed: int = 0) -> list[Shape]:
    """Training-GEMM tile shapes: m, n in 16..512, k in 64..4096, for the three op kinds.

    Log-uniform draws; two in three shapes are aligned to 16 (the tilers' usual sizes), the rest
    are arbitrary integers so that the data sees tile-edge effects.
    """
    if size not in SWEEPS:
        raise ValueError(f"unknown sweep size {size!r}; expected one of {', '.join(SWEEPS)}")
    rng = np.random.default_rng(seed)
    shapes = []
    ops = list(K_RANGE)
    for i in range(SWEEPS[size]):
        op = ops[i % len(ops)]
        align = 16 if rng.uniform() < 2 / 3 else 1
        m = _log_uniform_int(rng, *MN_RANGE, align)
        n = _log_uniform_int(rng, *MN_RANGE, align)
        k = _log_uniform_int(rng, *K_RANGE[op], 16 if align > 1 else 1)
        shapes.append(Shape(op, m, k, n))
    return shapes


class SweepProgress:
    """A sweep's progress (``perf measure``'s and ``adb measure``'s): the caller's line as it
    starts (:meth:`start`), one after the first timing (which tells how long one takes), then
    at most one every ``every_s`` seconds, and one at the end of each pass. Called once per
    shape timed (``measure(on_timed=...)``); each line goes to ``say`` (the log by default)."""

    def __init__(self, shapes: int, passes: int, every_s: float = 10.0,
                 say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.shapes, self.passes = shapes, passes
        self.every_s = every_s
        self.say = say
        self.clock = clock
        self.done = 0
        self._start_s = clock()
        self._last_s: float | None = None

    def _print(self, text: str) -> None:
        if self.say is not None:
            self.say(text)
        else:
            log.info("%s", text)

    def start(self, headline: str) -> None:
        """Say what the sweep is about to do (``headline``); its clock starts now."""
        self._start_s = self.clock()
        self._print(headline)

    def __call__(self) -> None:
        """One shape timed: print a line if one is due."""
        self.done += 1
        now = self.clock()
        elapsed_s = now - self._start_s
        total = self.shapes * self.passes
        end_of_pass = self.shapes > 0 and self.done % self.shapes == 0
        if not (self._last_s is None or end_of_pass or now - self._last_s >= self.every_s):
            return
        self._last_s = now
        left_s = elapsed_s / self.done * (total - self.done)
        pass_no = min((self.done - 1) // max(self.shapes, 1) + 1, self.passes)
        self._print(f"{self.done}/{total} timed (pass {pass_no}/{self.passes}), "
                    f"{elapsed_s:.0f} s" + (f", about {left_s:.0f} s left"
                                              if self.done < total else ""))


def threads_text(threads: int | str) -> str:
    """A runner's thread count (``describe()``'s) as a row's provenance says it: 0 is a phone's
    numpy, whose BLAS picks its own (it read '0 thread(s)')."""
    return f"{threads} thread(s)" if str(threads) != "0" else "its BLAS's own thread count"


def measure(shapes: Iterable[Shape], runner: GemmRunner, dtype: str = "float32",
            warmup: int = 1, repeats: int = 3, passes: int = 1, statistic: str = "min",
            progress: Callable[[int, Shape, float], None] | None = None,
            on_timed: Callable[[], None] | None = None) -> list[Measurement]:
    """Time every shape with the runner; one Measurement per shape (``statistic`` of samples).

    ``progress(i, shape, seconds)`` is called per shape once its figure is known (after the last
    pass); ``on_timed()`` after each timing (a :class:`SweepProgress`, so that a sweep of
    minutes, on this host or a phone, can say how far it is).

    With ``passes`` > 1 the whole sweep is timed that many times, round-robin, so that a slow
    phase of the machine hits every shape a little rather than some shapes entirely. A shape's
    figure is ``statistic`` over all its ``passes x repeats`` samples: ``min`` (default: noise on
    a shared host is additive and positive) or ``median``.
    """
    if statistic not in STATISTICS:
        raise ValueError(f"statistic: expected one of {', '.join(STATISTICS)}, got {statistic!r}")
    shapes = list(shapes)
    info = runner.describe()
    provenance = (f"testbed perf measure on {info['cpu_model']}, {threads_text(info['threads'])}"
                  f", {statistic} of {passes}x{repeats} samples after {warmup} warm-up calls")
    samples: list[list[float]] = [[] for _ in shapes]
    for _ in range(passes):
        for i, shape in enumerate(shapes):
            got = runner.time_gemm(shape.m, shape.k, shape.n, dtype, warmup, repeats)
            # what read_measurements and a fit take: finite, and no call is faster than 1 ns;
            # written as "all good" rather than "any bad": NaN fails every comparison
            if not got or not all(isinstance(s, numbers.Real) and not isinstance(s, bool)
                                  and MIN_MODEL_SECONDS <= s < math.inf for s in got):
                raise RuntimeError(f"runner {info['device']} returned bad timings "
                                   f"{repr(got)[:200]} for {shape}; expected finite numbers of "
                                   f"seconds >= {MIN_MODEL_SECONDS:g}")
            samples[i].extend(got)
            if on_timed is not None:
                on_timed()
    rows = []
    for i, shape in enumerate(shapes):
        seconds = float(STATISTICS[statistic](samples[i]))
        rows.append(Measurement(device=str(info["device"]), backend=str(info["backend"]),
                                dtype=dtype, threads=int(info["threads"]), op=shape.op,
                                m=shape.m, k=shape.k, n=shape.n, seconds=seconds,
                                provenance=provenance, repeats=len(samples[i])))
        if progress is not None:
            progress(i, shape, seconds)
    log.info("measured %d shapes on %s", len(rows), info["device"])
    return rows
