"""The GEMM measurement format: one CSV row per timed GEMM shape on one device.

Columns (header required, order free; ``*`` marks optional columns)::

    device      free text naming the device ("host-xeon", "M2 Pro (4E+6P+16GPU)")
    backend     what computed it ("numpy-openblas", "torch-cpu", "mlx_cpu", "gemmlowp")
    dtype       float32 | float64 | float16 | int8
    threads     compute threads used; 0 means "not recorded by the source"
    op          forward | input_grad | weight_grad | gemm  (gemm: the source did not say)
    m, k, n     C[m x n] = A[m x k] @ B[k x n]; positive integers
    batch*      number of such GEMMs the time covers (batched matmul); default 1
    time        the measured time of the whole row (all ``batch`` GEMMs), >= 0
    time_unit   s | ms | us | ns
    repeats*    timed calls the figure summarizes (median or mean, see provenance)
    joules*     energy of the row, if measured
    provenance  where the row came from (tool, command, source file and its licence)

In code every time is in seconds (``seconds`` = ``time`` converted, per batch). Reading a file
checks every row and raises one :class:`MeasurementError` that lists each bad row with its line
number, column and what was expected.
"""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

REQUIRED = ("device", "backend", "dtype", "threads", "op", "m", "k", "n", "time", "time_unit",
            "provenance")
OPTIONAL = ("batch", "repeats", "joules")
COLUMNS = ("device", "backend", "dtype", "threads", "op", "m", "k", "n", "batch", "time",
           "time_unit", "repeats", "joules", "provenance")
OPS = ("forward", "input_grad", "weight_grad", "gemm")
DTYPES = ("float32", "float64", "float16", "int8")
DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "int8": 1}
TIME_UNITS_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
MAX_LINE_CHARS = 8192  # far above any real row; csv itself fails at 128 KiB with a traceback


class MeasurementError(ValueError):
    """A measurement file with bad rows; the message names the file, line and column of each."""


@dataclass(frozen=True)
class Measurement:
    """One timed GEMM shape; ``seconds`` is the time of ONE of the ``batch`` GEMMs."""

    device: str
    backend: str
    dtype: str
    threads: int
    op: str
    m: int
    k: int
    n: int
    seconds: float
    provenance: str
    batch: int = 1
    repeats: int = 0
    joules: float | None = None

    @property
    def flops(self) -> float:
        """Floating-point (or integer) operations of one GEMM: 2*m*k*n."""
        return 2.0 * self.m * self.k * self.n


def _parse_row(row: dict[str, str], problems: list[str], where: str) -> Measurement | None:
    def bad(column: str, expected: str) -> None:
        problems.append(f"{where}: column {column!r}: expected {expected}, got {row.get(column)!r}")

    def integer(column: str, minimum: int, default: int | None = None) -> int:
        text = (row.get(column) or "").strip()
        if not text and default is not None:
            return default
        try:
            value = int(text)
        except ValueError:
            bad(column, f"an integer >= {minimum}")
            return minimum
        if value < minimum:
            bad(column, f"an integer >= {minimum}")
        return value

    def number(column: str, optional: bool = False) -> float | None:
        text = (row.get(column) or "").strip()
        if not text and optional:
            return None
        try:
            value = float(text)
        except ValueError:
            bad(column, "a number >= 0")
            return None
        if not math.isfinite(value) or value < 0:
            bad(column, "a finite number >= 0 (a negative or infinite time is a broken "
                        "measurement)")
            return None
        return value

    before = len(problems)
    for column in ("device", "backend", "provenance"):
        if not (row.get(column) or "").strip():
            bad(column, "a non-empty text")
    dtype = (row.get("dtype") or "").strip()
    if dtype not in DTYPES:
        bad("dtype", f"one of {', '.join(DTYPES)}")
    op = (row.get("op") or "").strip()
    if op not in OPS:
        bad("op", f"an op kind, one of {', '.join(OPS)}")
    unit = (row.get("time_unit") or "").strip()
    if unit not in TIME_UNITS_S:
        bad("time_unit", f"a time unit, one of {', '.join(TIME_UNITS_S)}")
    threads = integer("threads", 0)
    m, k, n = integer("m", 1), integer("k", 1), integer("n", 1)
    batch = integer("batch", 1, default=1)
    repeats = integer("repeats", 0, default=0)
    time = number("time")
    joules = number("joules", optional=True)
    if len(problems) > before or time is None:
        return None
    return Measurement(device=row["device"].strip(), backend=row["backend"].strip(), dtype=dtype,
                       threads=threads, op=op, m=m, k=k, n=n,
                       seconds=time * TIME_UNITS_S[unit] / batch,
                       provenance=row["provenance"].strip(), batch=batch, repeats=repeats,
                       joules=None if joules is None else joules / batch)


def read_measurements(path: str | Path) -> list[Measurement]:
    """Read and check a measurement CSV; raise MeasurementError listing every bad row."""
    path = Path(path)
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise MeasurementError(f"{path}: cannot read: {exc.strerror}") from exc
    # (line number, fields) of every line that is not blank and not a '#' comment
    numbered = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if len(line) > MAX_LINE_CHARS:
            raise MeasurementError(f"{path}: line {i}: {len(line)} characters; a measurement "
                                   f"row is at most {MAX_LINE_CHARS}")
        try:
            numbered.append((i, next(csv.reader([line]))))
        except csv.Error as exc:
            raise MeasurementError(f"{path}: line {i}: not a CSV line: {exc}") from exc
    if not numbered:
        raise MeasurementError(f"{path}: empty file; expected a header line with the columns "
                               f"{', '.join(REQUIRED)}")
    header_line, header_fields = numbered[0]
    header = [h.strip() for h in header_fields]
    missing = [c for c in REQUIRED if c not in header]
    unknown = [c for c in header if c not in COLUMNS]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing column(s) {', '.join(missing)}")
        if unknown:
            parts.append(f"unknown column(s) {', '.join(unknown)}")
        raise MeasurementError(f"{path}: line {header_line} (header): {'; '.join(parts)}; "
                               f"expected the columns {', '.join(REQUIRED)} "
                               f"(optional: {', '.join(OPTIONAL)})")
    problems: list[str] = []
    rows: list[Measurement] = []
    for line_no, fields in numbered[1:]:
        where = f"{path}: line {line_no}"
        if len(fields) != len(header):
            problems.append(f"{where}: expected {len(header)} fields as in the header, "
                            f"got {len(fields)}")
            continue
        parsed = _parse_row(dict(zip(header, fields)), problems, where)
        if parsed is not None:
            rows.append(parsed)
    if problems:
        raise MeasurementError("\n".join(problems))
    if not rows:
        raise MeasurementError(f"{path}: no measurement rows after the header")
    return rows


def write_measurements(path: str | Path, rows: Iterable[Measurement],
                       comments: Iterable[str] = ()) -> None:
    """Write rows in the CSV format (times in seconds, per row including batch)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        for comment in comments:
            handle.write(f"# {comment}\n")
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for r in rows:
            writer.writerow([r.device, r.backend, r.dtype, r.threads, r.op, r.m, r.k, r.n,
                             r.batch, f"{r.seconds * r.batch:.9g}", "s", r.repeats,
                             "" if r.joules is None else f"{r.joules * r.batch:.6g}",
                             r.provenance])


def as_arrays(rows: Iterable[Measurement]) -> tuple[np.ndarray, np.ndarray]:
    """Shapes as an (N, 3) float array of (m, k, n) and times in seconds as an (N,) array."""
    rows = list(rows)
    shapes = np.array([[r.m, r.k, r.n] for r in rows], dtype=np.float64).reshape(-1, 3)
    seconds = np.array([r.seconds for r in rows], dtype=np.float64)
    return shapes, seconds


def to_dict(row: Measurement) -> dict[str, object]:
    """A row as a plain dict (for JSON)."""
    return asdict(row)
