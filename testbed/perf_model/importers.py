"""Importers from the public data in ../shared/data into the measurement format, with attribution.

* mlx-benchmark (MIT, Copyright (c) 2023 Tristan Bilot; github.com/TristanBilot/mlx-benchmark,
  ``benchmarks/detailed_benchmark.md``): Apple M1-M4 ``Linear`` and ``MatMul`` times, mean of 9
  calls after one warm-up, float32. Operand shapes become GEMMs: A's last two dimensions are
  (m, k) and B's are (k, n); when B is 2-D, A's leading dimensions fold into m (one GEMM);
  when B is batched, A's leading dimensions are the ``batch`` count. ``Linear`` rows are the
  ``forward`` op, ``MatMul`` rows ``gemm``.
* DeepBench (Apache-2.0, Baidu Research; github.com/baidu-research/DeepBench ``results/``):
  int8 GEMMs (int32 accumulation, gemmlowp) on iPhone 6 (A8), iPhone 7 (A10), Raspberry Pi 3.
  Its M, N, K name C[M x N] = A[M x K] B[K x N], as ours do. Its ``precision`` column says so
  (``int8in_int32acc_gemmlowp``); a row of another precision is refused, not imported as int8.
* vfpbench (MIT, Copyright (c) 2019 Hiroyuki Ogasawara; github.com/hiroog/vfpbench ``log/``):
  measured peak GFLOPS per device; not GEMMs, so they import into :class:`PeakRecord`.
* MNN (Apache-2.0, Alibaba; ``docs/perf/gemm_speed_benchmark.md`` @4d40bdb): Snapdragon 8 Gen 5
  CPU ``float-gemm`` rows, 4 threads, precision flag 2 = **fp16** arithmetic (not fp32).
* mmperf (Apache-2.0; ``official_results/apple-*`` @9e6e4f0): Apple M1 (upstream folder
  ``apple-a13``) and M1 Max single-core SGEMM in GFLOPS per library; times are 2mkn / rate.
  ``accelerate`` rows run on Apple's matrix unit (AMX), not the NEON cores.
* TensorFlow OpenCL fork (Apache-2.0; ``tensorflow/opencl-matmul/README.md`` @8d443c9):
  Snapdragon 835 square MatMul, CPU Eigen fp32, in us; includes TensorFlow's op overhead;
  thread count not stated (TF's default pool).
* ncnn (BSD-3-Clause, Tencent; ``benchmark/README.md`` and ``*.param`` @a4d2ea1): whole-model
  times (min/max/avg ms) per device, threads and core set; fp16 by default on Armv8.2+ CPUs.
  :func:`ncnn_gemms` derives a model's GEMM shapes from its layer file.
* Paddle-Lite (Apache-2.0; ``docs/performance/benchmark.md`` @3d329c9) and XNNPACK
  (BSD-3-Clause; ``README.md`` @75db3c0): whole-model phone times (:class:`ModelTiming`).

Every importer checks what it converts: a size that is not a positive integer or a time that is
not a positive finite number is a :class:`SourceFormatError` naming the file and line. Each
measurement row made is checked as ``perf fit`` would read it once written
(:func:`~testbed.perf_model.measurements.written_row_problems`): a size above BLAS's 32-bit limit
or a time above an hour is refused here, naming the source's line and column, not in a later
command. A source is read with :func:`~testbed.user_paths.read_user_text`, as every user file is:
a FIFO, a device or a directory is refused at once, and so is a file of more than
MAX_SOURCE_BYTES; CSV sources go through the measurement reader's
:func:`~testbed.perf_model.measurements.read_csv_lines` (a byte order mark dropped, a column named
twice or a row of another field count than the header refused).
"""

from __future__ import annotations

import csv
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from testbed.errors import InputError
from testbed.perf_model.measurements import (
    MIN_MODEL_SECONDS,
    Measurement,
    read_csv_lines,
    written_row_problems,
)
from testbed.user_paths import read_user_text, written_whole

MLX_ATTRIBUTION = ("mlx-benchmark detailed_benchmark.md @85c5376 (MIT, (c) 2023 Tristan Bilot), "
                   "mean of 9 calls after 1 warm-up")
DEEPBENCH_ATTRIBUTION = "DeepBench results @da81ba7 (Apache-2.0, Baidu Research), gemmlowp int8"
VFPBENCH_ATTRIBUTION = "vfpbench log @19d3b70 (MIT, (c) 2019 Hiroyuki Ogasawara)"


MNN_ATTRIBUTION = ("MNN docs/perf/gemm_speed_benchmark.md @4d40bdb (Apache-2.0, Alibaba), "
                   "Snapdragon 8 Gen 5 CPU, 4 threads, precision 2 = fp16 arithmetic")
MMPERF_ATTRIBUTION = ("mmperf official_results @9e6e4f0 (Apache-2.0), single-core SGEMM; "
                      "upstream folder apple-a13 is an Apple M1")
TF835_ATTRIBUTION = ("TensorflowOpenCL-GPU tensorflow/opencl-matmul/README.md @8d443c9 "
                     "(Apache-2.0), Snapdragon 835 CPU Eigen fp32 square MatMul, mean of 10 "
                     "TF runs incl. TF op overhead, threads not stated")
NCNN_ATTRIBUTION = ("ncnn benchmark/README.md @a4d2ea1 (BSD-3-Clause, Tencent); fp16 storage and "
                    "arithmetic by default on Armv8.2+ CPUs")
PADDLE_ATTRIBUTION = ("Paddle-Lite docs/performance/benchmark.md @3d329c9 (Apache-2.0), 1 thread "
                      "on a big core, warmup 20, mean of 600")
XNNPACK_ATTRIBUTION = "XNNPACK README.md performance section @75db3c0 (BSD-3-Clause)"

# The most a source file may hold. The largest in ../shared/data is under 1 MB (ncnn's parsed
# benchmark table); 64 MiB is seventy times that, and still read whole in a moment. A file
# beyond it is a wrong one (a disk image, /dev/zero), which would otherwise fill the memory.
MAX_SOURCE_BYTES = 64 * 1024**2


class SourceFormatError(ValueError):
    """A source file that does not look as expected; names the file and line."""


class SourceStructureError(SourceFormatError, InputError):
    """A CSV source's header, field counts or lines refused by ``read_csv_lines``: every
    problem, each with its line."""


def _source_text(path: Path) -> str:
    """A source file's text, a byte order mark dropped; SourceFormatError naming the file when
    it cannot be read, is not a regular file or holds more than MAX_SOURCE_BYTES."""
    try:
        return read_user_text(path, MAX_SOURCE_BYTES, errors="replace")
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        raise SourceFormatError(f"{path}: cannot read: "
                                f"{getattr(exc, 'strerror', None) or exc}") from exc


def _records(path: Path, required: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV source with a header, read and checked as a measurement file
    is (:func:`read_csv_lines`): SourceStructureError for what is not a regular file or too
    large, a missing or doubled column, a line too long or not CSV, a row of another field
    count than the header."""
    return read_csv_lines(path, required, None, "source", error=SourceStructureError,
                          max_bytes=MAX_SOURCE_BYTES)


def _checked(path: Path, line_no: int, row: Measurement, columns: dict[str, str]) -> Measurement:
    """``row`` if ``perf fit`` would read it once written, else SourceFormatError naming the
    source's line and the source column (``columns``: measurement column -> source column) each
    refused value came from."""
    problems = written_row_problems(row)
    if row.seconds < MIN_MODEL_SECONDS and not problems:  # read back, but perf fit refuses it
        problems = [("time", f"{row.seconds:.3g} s a GEMM, below the "
                             f"{MIN_MODEL_SECONDS:g} s perf fit accepts (a few clock cycles)")]
    if not problems:
        return row
    said = []
    for column, message in problems:
        if column == "<top>":
            said.append(message)
        else:
            source = columns.get(column, column)
            said.append(f"column {source!r}" + (f" ({column} once imported)"
                                                 if source != column else "") + f": {message}")
    raise SourceFormatError(f"{path}: line {line_no}: {'; '.join(said)}")


def _positive_int(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0  # reported below with the column and what was expected
    if value < 1:
        shown = text if len(text) <= 80 else f"{text[:80]}... ({len(text):,} characters)"
        raise ValueError(f"{what}: expected a positive integer, got {shown!r}")
    return value


def _positive_figure(text: str, what: str, noun: str = "time") -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # reported below with the column and what was expected
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what}: expected a positive finite {noun}, got {text!r}")
    return value


def _shape(text: str) -> list[int]:
    return [_positive_int(x, "dimension") for x in text.split("x")]


def mlx_gemm(operand_shapes: str) -> tuple[int, int, int, int]:
    """(batch, m, k, n) of an mlx-benchmark operand-shape string (bias, if any, ignored)."""
    parts = operand_shapes.split()
    if len(parts) < 2:  # was 'list index out of range'
        raise ValueError(f"column 'operand_shapes': expected two operand shapes such as "
                         f"'1024x1024 1024x1024', got {operand_shapes[:80]!r}")
    a, b = _shape(parts[0]), _shape(parts[1])
    if len(b) == 1:  # a vector
        b = [b[0], 1]
    if a[-1] != b[-2]:
        raise ValueError(f"inner dimensions differ in {operand_shapes!r}")
    if len(b) == 2:
        return 1, math.prod(a[:-1]), a[-1], b[-1]
    return math.prod(a[:-2]), a[-2], a[-1], b[-1]


# measurement column -> the source column it is made from, to name it in an error (_checked)
MLX_COLUMNS = {"m": "operand_shapes", "k": "operand_shapes", "n": "operand_shapes",
               "batch": "operand_shapes", "time": "ms_mean_of_9"}
MNK_MS_COLUMNS = {"m": "M", "k": "K", "n": "N", "time": "time_ms"}  # DeepBench's and MNN's
MMPERF_COLUMNS = {"device": "platform", "backend": "library", "m": "M", "k": "K", "n": "N",
                  "time": "gflops"}
# DeepBench's device results are all of one precision; what it names, as (dtype, backend)
DEEPBENCH_PRECISIONS = {"int8in_int32acc_gemmlowp": ("int8", "gemmlowp")}


def import_mlx(path: str | Path, backend: str | None = "cpu") -> list[Measurement]:
    """mlx-benchmark rows (of one backend, or all with None) as measurements."""
    path = Path(path)
    rows = []
    for line_no, rec in _records(path, ("device", "op", "operand_shapes", "backend",
                                        "ms_mean_of_9")):
        if backend is not None and rec["backend"] != backend:
            continue
        try:
            batch, m, k, n = mlx_gemm(rec["operand_shapes"])
            ms = _positive_figure(rec["ms_mean_of_9"], "ms_mean_of_9")
            seconds = ms / 1e3 / batch
        except (ValueError, IndexError) as exc:
            raise SourceFormatError(f"{path}: line {line_no}: {exc}") from exc
        except OverflowError:  # a batch beyond a float's range (int / float converts it)
            raise SourceFormatError(f"{path}: line {line_no}: operand_shapes: a batch of more "
                                    f"than 1e308 GEMMs in {rec['operand_shapes'][:80]!r}") from None
        rows.append(_checked(path, line_no, Measurement(
            device=rec["device"].strip(), backend=rec["backend"], dtype="float32", threads=0,
            op="forward" if rec["op"] == "Linear" else "gemm", m=m, k=k, n=n, batch=batch,
            seconds=seconds, repeats=9, provenance=MLX_ATTRIBUTION), MLX_COLUMNS))
    return rows


def import_deepbench(path: str | Path) -> list[Measurement]:
    """DeepBench device GEMM rows as measurements, of the precision their ``precision`` column
    names (all int8 with int32 accumulation on gemmlowp); a row of another is refused."""
    path = Path(path)
    rows = []
    for line_no, rec in _records(path, ("device", "precision", "M", "N", "K", "time_ms")):
        try:
            m, n, k = (_positive_int(rec[c], c) for c in ("M", "N", "K"))
            ms = _positive_figure(rec["time_ms"], "time_ms")
            precision = rec["precision"].strip()
            if precision not in DEEPBENCH_PRECISIONS:
                raise ValueError(f"column 'precision': expected "
                                 f"{', '.join(DEEPBENCH_PRECISIONS)} (the precision of DeepBench's "
                                 f"device results, the one this importer knows), got "
                                 f"{precision[:80]!r}")
        except ValueError as exc:
            raise SourceFormatError(f"{path}: line {line_no}: {exc}") from exc
        dtype, backend = DEEPBENCH_PRECISIONS[precision]
        rows.append(_checked(path, line_no, Measurement(
            device=rec["device"], backend=backend, dtype=dtype, threads=0, op="gemm", m=m, k=k,
            n=n, seconds=ms / 1e3, provenance=DEEPBENCH_ATTRIBUTION), MNK_MS_COLUMNS))
    return rows


SHARED_DATA_ENV = "TESTBED_SHARED_DATA"


def shared_data_dir(start: Path | None = None) -> Path | None:
    """Where ``shared/data`` is: ``$TESTBED_SHARED_DATA`` if set, else the nearest ancestor's.

    One rule for build.py and the tests: the variable wins (an explicit choice, used as given
    even when it does not exist, so that a wrong path fails loudly); otherwise walk up from
    ``start`` (default: this checkout) and take the first ``<ancestor>/shared/data`` directory.
    CI clones the repository with ``shared/`` beside it (one level up); a worktree under
    ``/work/wt/NAME`` finds ``/work/shared/data`` two levels up. None when there is none.
    """
    explicit = os.environ.get(SHARED_DATA_ENV)
    if explicit:
        return Path(explicit)
    here = (start or Path(__file__)).resolve()
    for ancestor in here.parents:
        candidate = ancestor / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return None


@dataclass(frozen=True)
class PeakRecord:
    """A measured peak rate: device, precision (HP/SP/DP), scope (single/multi), GFLOPS."""

    device: str
    precision: str
    scope: str
    gflops: float
    provenance: str


# the figure is any word: one that is not a positive finite number is refused, not skipped
_PEAK = re.compile(r"^\s*(SingleThread|MultiThread)\s+(HP|SP|DP)\s+max:\s+(\S+)\s+GFLOPS")


def import_vfpbench(path: str | Path) -> list[PeakRecord]:
    """The whole-chip ("Total:") peak figures of one vfpbench log."""
    path = Path(path)
    records = []
    in_total = False
    for line_no, line in enumerate(_source_text(path).splitlines(), 1):
        if line.startswith("Total:"):
            in_total = True
            continue
        if in_total and not line.strip():
            break
        match = _PEAK.match(line) if in_total else None
        if match:
            thread, precision = match.group(1), match.group(2)
            try:
                gflops = _positive_figure(match.group(3)[:80], f"{thread} {precision} max",
                                        "GFLOPS figure")
            except ValueError as exc:
                raise SourceFormatError(f"{path}: line {line_no}: {exc}") from exc
            records.append(PeakRecord(device=path.stem, precision=precision,
                                      scope="single" if thread == "SingleThread" else "multi",
                                      gflops=gflops,
                                      provenance=f"{VFPBENCH_ATTRIBUTION}, log/{path.name}"))
    if not records:
        raise SourceFormatError(f"{path}: no 'Total:' block with '... max: N GFLOPS' lines")
    return records


def vfpbench_peak(path: str | Path, precision: str = "SP", scope: str = "multi") -> float:
    """One peak figure (GFLOPS) of a vfpbench log."""
    for rec in import_vfpbench(path):
        if rec.precision == precision and rec.scope == scope:
            return rec.gflops
    raise SourceFormatError(f"{path}: no {scope}-thread {precision} peak")


def write_peaks(path: str | Path, records: list[PeakRecord]) -> None:
    """Write peak records as CSV (device, precision, scope, gflops, provenance)."""
    with written_whole(Path(path)) as handle:
        writer = csv.writer(handle)
        writer.writerow(["device", "precision", "scope", "gflops", "provenance"])
        for r in records:
            writer.writerow([r.device, r.precision, r.scope, r.gflops, r.provenance])


def import_mnn(path: str | Path) -> list[Measurement]:
    """MNN's Snapdragon 8 Gen 5 CPU float GEMMs (fp16 arithmetic, 4 threads)."""
    path = Path(path)
    rows = []
    for line_no, rec in _records(path, ("device", "backend", "precision_flag", "threads", "kind",
                                        "M", "K", "N", "time_ms")):
        if rec["backend"] != "CPU" or rec["kind"] != "float-gemm":
            continue
        try:
            m, k, n = (_positive_int(rec[c], c) for c in ("M", "K", "N"))
            ms = _positive_figure(rec["time_ms"], "time_ms")
            threads = _positive_int(rec["threads"], "threads")
        except ValueError as exc:
            raise SourceFormatError(f"{path}: line {line_no}: {exc}") from exc
        dtype = "float16" if rec["precision_flag"].strip() == "2" else "float32"
        rows.append(_checked(path, line_no, Measurement(
            device=rec["device"].strip(), backend="mnn-cpu", dtype=dtype, threads=threads,
            op="gemm", m=m, k=k, n=n, seconds=ms / 1e3, provenance=MNN_ATTRIBUTION),
            MNK_MS_COLUMNS))
    return rows


MMPERF_CHIPS = {"apple-a13": "Apple M1", "apple-m1max": "Apple M1 Max"}


def import_mmperf(path: str | Path) -> list[Measurement]:
    """mmperf single-core SGEMM rows (GFLOPS) as times; one set per chip and library."""
    path = Path(path)
    rows = []
    for line_no, rec in _records(path, ("platform", "library", "M", "N", "K", "gflops")):
        try:
            m, n, k = (_positive_int(rec[c], c) for c in ("M", "N", "K"))
            gflops = _positive_figure(rec["gflops"], "gflops", "rate")
        except ValueError as exc:
            raise SourceFormatError(f"{path}: line {line_no}: {exc}") from exc
        try:
            seconds = 2.0 * m * k * n / (gflops * 1e9)
        except OverflowError:  # a size of hundreds of digits: refused by name below
            seconds = math.inf
        chip = MMPERF_CHIPS.get(rec["platform"].strip(), rec["platform"].strip())
        library = rec["library"].strip()
        note = "; Apple AMX matrix unit, not NEON" if library == "accelerate" else ""
        rows.append(_checked(path, line_no, Measurement(
            device=chip, backend=f"mmperf-{library}", dtype="float32", threads=1, op="gemm",
            m=m, k=k, n=n, seconds=seconds, provenance=MMPERF_ATTRIBUTION + note),
            MMPERF_COLUMNS))
    return rows


def import_tf_sd835(path: str | Path) -> list[Measurement]:
    """The Snapdragon 835 CPU (Eigen fp32) row of the TensorFlow MatMul table (square N)."""
    path = Path(path)
    text = _source_text(path)
    sizes: list[int] = []
    for line_no, line in enumerate(text.splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0].startswith("Library"):
            try:
                sizes = [_positive_int(c.split("=")[1], "N") for c in cells[2:] if "=" in c]
            except ValueError as exc:
                raise SourceFormatError(f"{path}: line {line_no}: {exc}") from exc
        elif cells and cells[0] == "cpu-Eigen-fp32":
            if not sizes:
                raise SourceFormatError(f"{path}: line {line_no}: no 'Library\\Size' header "
                                        f"before the cpu-Eigen-fp32 row")
            try:
                us = [_positive_figure(c, f"N={n}") for c, n in zip(cells[2:], sizes)]
            except ValueError as exc:
                raise SourceFormatError(f"{path}: line {line_no}: {exc}") from exc
            return [_checked(path, line_no, Measurement(
                        device="Snapdragon 835", backend="tf-eigen-cpu", dtype="float32",
                        threads=0, op="gemm", m=n, k=n, n=n, seconds=t / 1e6, repeats=10,
                        provenance=TF835_ATTRIBUTION),
                        dict.fromkeys(("m", "k", "n", "time"), f"N={n}"))
                    for n, t in zip(sizes, us)]
    raise SourceFormatError(f"{path}: no 'cpu-Eigen-fp32' row in a MatMul table")


@dataclass(frozen=True)
class ModelTiming:
    """One whole-model time: device, model, threads (0 = not stated), cores, precision, ms."""

    device: str
    model: str
    threads: int
    cores: str  # "all" | "little" | "big" | "gpu" | "not stated"
    precision: str
    avg_ms: float
    min_ms: float
    max_ms: float
    provenance: str
    loops: int = 0  # calls min, mean and max were taken over (0 = not stated)


_POWERSAVE = {"0": "all", "1": "little", "2": "big"}


def import_ncnn(path: str | Path) -> list[ModelTiming]:
    """ncnn benchmark rows (CPU and GPU) as whole-model timings."""
    path = Path(path)
    out = []
    for line_no, rec in _records(path, ("device", "model", "num_threads", "powersave",
                                        "gpu_device", "min_ms", "max_ms", "avg_ms")):
        try:
            threads = _positive_int(rec["num_threads"], "num_threads")
            times = [_positive_figure(rec[c], c) for c in ("min_ms", "max_ms", "avg_ms")]
            loops = _positive_int(rec["loop_count"], "loop_count") \
                if (rec.get("loop_count") or "").strip() else 0
        except ValueError as exc:
            raise SourceFormatError(f"{path}: line {line_no}: {exc}") from exc
        gpu = rec["gpu_device"].strip() != "-1"
        model = rec["model"].strip()
        out.append(ModelTiming(device=rec["device"].strip(), model=model, threads=threads,
                               cores="gpu" if gpu else _POWERSAVE.get(rec["powersave"].strip(),
                                                                      "not stated"),
                               precision="int8" if model.endswith("_int8") else
                               "fp16 where the CPU has it (ncnn default)",
                               min_ms=times[0], max_ms=times[1], avg_ms=times[2],
                               provenance=NCNN_ATTRIBUTION, loops=loops))
    return out


def _param_fields(tokens: list[str]) -> dict[str, str]:
    return dict(t.split("=", 1) for t in tokens if "=" in t)


def ncnn_gemms(path: str | Path, tokens: int | None = None) -> list[tuple[str, int, int, int]]:
    """(layer, m, k, n) of every GEMM of an ncnn ViT-style layer file, batch 1.

    ``Convolution`` with kernel = stride (a patch embedding) is one GEMM of (patches x
    c*kh*kw) by (c*kh*kw x out); ``MultiHeadAttention`` (0 = embed dim, 1 = heads) is the Q, K,
    V and output projections plus, per head, Q K^T and A V; ``Gemm`` (8 = out, 9 = in) on the
    tokens, except one after a ``Crop`` (the class token alone, m = 1). ``tokens`` defaults
    to the patch count + 1 (the class token), read from the patch convolution and the input.
    """
    path = Path(path)
    lines = _source_text(path).splitlines()
    gemms: list[tuple[str, int, int, int]] = []
    seq = tokens
    after_crop = False
    for line_no, line in enumerate(lines, 1):
        parts = line.split()
        if len(parts) < 4 or not parts[0][0].isalpha():
            continue
        kind, name, fields = parts[0], parts[1], _param_fields(parts[4:])
        try:
            if kind == "MemoryData" and name.endswith("pos_embed") and seq is None:
                seq = _positive_int(fields.get("1", ""), "pos_embed 1 (tokens)")
            elif kind == "Convolution":
                out_c = _positive_int(fields["0"], "0 (outputs)")
                kw = _positive_int(fields["1"], "1 (kernel w)")
                kh = int(fields.get("11", kw))
                weights = _positive_int(fields["6"], "6 (weight count)")
                in_c = weights // (out_c * kw * kh)
                patches = (seq - 1) if seq else 0
                if patches < 1:
                    raise ValueError("patch count unknown (no pos_embed before the "
                                     "convolution); pass tokens")
                gemms.append((name, patches, in_c * kw * kh, out_c))
            elif kind == "MultiHeadAttention":
                d = _positive_int(fields["0"], "0 (embed dim)")
                heads = _positive_int(fields.get("1", "1"), "1 (heads)")
                assert seq is not None
                gemms += [(f"{name}.{p}", seq, d, d) for p in ("q", "k", "v")]
                for h in range(heads):
                    gemms.append((f"{name}.qk{h}", seq, d // heads, seq))
                    gemms.append((f"{name}.av{h}", seq, seq, d // heads))
                gemms.append((f"{name}.out", seq, d, d))
            elif kind == "Gemm":
                out_n = _positive_int(fields["8"], "8 (outputs)")
                in_k = _positive_int(fields["9"], "9 (inputs)")
                assert seq is not None
                gemms.append((name, 1 if after_crop else seq, in_k, out_n))
        except (KeyError, ValueError, AssertionError) as exc:
            raise SourceFormatError(f"{path}: line {line_no}: {kind} {name}: {exc}") from exc
        after_crop = kind == "Crop" or (after_crop and kind != "Gemm")
    if not gemms:
        raise SourceFormatError(f"{path}: no Convolution, MultiHeadAttention or Gemm layers")
    return gemms


def _md_tables(text: str) -> Iterator[tuple[int, list[str], list[list[str]]]]:
    """(line of the header, header cells, body rows) of every markdown table."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and \
                set(lines[i + 1].replace("|", "").strip()) <= set(":- "):
            header = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            body, j = [], i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                body.append([c.strip() for c in lines[j].strip().strip("|").split("|")])
                j += 1
            yield i + 1, header, body
            i = j
        else:
            i += 1


def import_paddle_lite(path: str | Path) -> list[ModelTiming]:
    """The fp32 ARMv8 CPU table of Paddle-Lite's benchmark page (1 thread, big core)."""
    path = Path(path)
    text = _source_text(path)
    out = []
    for line_no, header, body in _md_tables(text):
        if header[0] != "模型" or not any("骁龙" in h for h in header):
            continue
        for row in body:
            if not row[0].startswith("MobileNet") and not row[0].startswith("ResNet"):
                continue
            for soc, cell in zip(header[1:], row[1:]):
                try:
                    ms = _positive_figure(cell, soc)
                except ValueError:
                    continue  # "-" cells: not measured
                device = soc.replace("骁龙", "Snapdragon").replace("麒麟", "Kirin")
                out.append(ModelTiming(device=device, model=row[0], threads=1, cores="big",
                                       precision="fp32", avg_ms=ms, min_ms=ms, max_ms=ms,
                                       provenance=f"{PADDLE_ATTRIBUTION}, table at line "
                                                  f"{line_no}"))
        break  # the first such table is the fp32 dense one
    if not out:
        raise SourceFormatError(f"{path}: no fp32 model table with Snapdragon columns")
    return out


def import_xnnpack(path: str | Path) -> list[ModelTiming]:
    """XNNPACK's phone and Raspberry Pi MobileNet tables (single- and multi-threaded)."""
    path = Path(path)
    text = _source_text(path)
    out = []
    lines = text.splitlines()
    for line_no, header, body in _md_tables(text):
        before = " ".join(lines[max(0, line_no - 4):line_no - 1])
        single = "single-threaded" in before
        for row in body:
            precision = "fp32" if row[0].startswith("FP32") else "int8"
            for column, cell in zip(header[1:], row[1:]):
                try:
                    ms = _positive_figure(cell, column)
                except ValueError:
                    continue
                out.append(ModelTiming(device=column.replace(", ms", ""), model=row[0],
                                       threads=1 if single else 0,
                                       cores="big" if single else "all big cores",
                                       precision=precision, avg_ms=ms, min_ms=ms, max_ms=ms,
                                       provenance=f"{XNNPACK_ATTRIBUTION}, table at line "
                                                  f"{line_no}"))
    if not out:
        raise SourceFormatError(f"{path}: no model tables")
    return out
