"""The GEMM measurement format: one CSV row per timed GEMM shape on one device.

Columns (header required, order free; ``*`` marks optional columns)::

    device      free text naming the device ("host-xeon", "M2 Pro (4E+6P+16GPU)")
    backend     what computed it ("numpy-openblas", "torch-cpu", "mlx_cpu", "gemmlowp")
    dtype       float32 | float64 | float16 | int8
    threads     compute threads used; 0 means "not recorded by the source"
    op          forward | input_grad | weight_grad | gemm  (gemm: the source did not say)
    m, k, n     C[m x n] = A[m x k] @ B[k x n]; positive integers up to 2^31 - 1
    batch*      number of such GEMMs the time covers (batched matmul); default 1
    time        the measured time of the whole row (all ``batch`` GEMMs), >= 0 and at most an
                hour (MAX_ROW_SECONDS); fitting a model needs >= MIN_MODEL_SECONDS per GEMM
    time_unit   s | ms | us | ns
    repeats*    timed calls the figure summarizes (median or mean, see provenance)
    joules*     energy of the row, if measured
    provenance  where the row came from (tool, command, source file and its licence)

In code every time is in seconds (``seconds`` = ``time`` converted, per batch). Reading a file
checks every row against :class:`MeasurementRow` (a :mod:`testbed.schema` model, the project's
one validation mechanism) and raises one :class:`MeasurementError` (an ``InputError``: the CLI
exits 2) that lists every problem of every row with its line number, column and what was
expected. The file's structure (header, field counts, line length) is checked by
:func:`read_csv_lines`, which ``perf predict --shapes`` and the importers' CSV sources share; an
importer checks each row it makes with :func:`written_row_problems`, the reader's own checks, so
that ``perf import`` never writes what ``perf fit`` would refuse.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Iterable

import numpy as np
from pydantic import (
    AfterValidator,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from testbed.errors import InputError
from testbed.schema import Schema, printable, problem_pairs
from testbed.user_paths import read_user_text, written_whole

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
MAX_CSV_BYTES = 256 * 1024**2  # a file's: millions of rows; more is a wrong file
MAX_BLAS_DIMENSION = 2**31 - 1  # BLAS integers are 32-bit by default: no GEMM call has more
# The shortest time per GEMM a model is fitted on (``perf fit``, ``eval``, ``calibrate``): 1 ns is
# a few clock cycles, less than any call costs (the fastest row in tests/data takes 0.4 us).
# A file may hold shorter times (a 0: "too fast to time"), but a fit cannot use them: the rate
# 2mkn / t of a 0 or a subnormal 1e-320 s is infinite, and of any t below 1 ns absurd.
MIN_MODEL_SECONDS = 1e-9
# The longest time one row may take: an hour. The largest GEMM BLAS takes (2^31 - 1 on a side)
# is beyond any device, and a timed call of an hour is beyond any measurement run; a 1e308 s
# typo would overflow the rate models' arithmetic (perf fit --model rate).
MAX_ROW_SECONDS = 3600.0


class MeasurementError(InputError):
    """A measurement file with bad rows; each problem names its line and column."""


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


def _at_least(minimum: int) -> AfterValidator:
    def check(value: int) -> int:
        if value < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {value}")
        return value

    return AfterValidator(check)


def _at_most(maximum: int) -> AfterValidator:
    def check(value: int) -> int:
        if value > maximum:
            raise ValueError(f"expected an integer <= {maximum} (BLAS's 32-bit limit), got "
                             f"{value}")
        return value

    return AfterValidator(check)


def _one_of(allowed: Iterable[str], what: str) -> AfterValidator:
    allowed = tuple(allowed)

    def check(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"expected {what}, one of {', '.join(allowed)}, got {value!r}")
        return value

    return AfterValidator(check)


def _non_empty(value: str) -> str:
    if not value:
        raise ValueError("expected a non-empty text")
    return printable(value)


Text = Annotated[str, AfterValidator(_non_empty)]


class MeasurementRow(Schema):
    """One CSV row as written (strings from the csv module, converted by pydantic's lax mode)."""

    device: Text
    backend: Text
    dtype: Annotated[str, _one_of(DTYPES, "a dtype")]
    threads: Annotated[int, _at_least(0)]  # 0: the source did not record it
    op: Annotated[str, _one_of(OPS, "an op kind")]
    m: Annotated[int, _at_least(1), _at_most(MAX_BLAS_DIMENSION)]
    k: Annotated[int, _at_least(1), _at_most(MAX_BLAS_DIMENSION)]
    n: Annotated[int, _at_least(1), _at_most(MAX_BLAS_DIMENSION)]
    batch: Annotated[int, _at_least(1)] = 1
    # time_unit before time: time's check reads the unit (validated in this order)
    time_unit: Annotated[str, _one_of(TIME_UNITS_S, "a time unit")]
    time: float
    repeats: Annotated[int, _at_least(0)] = 0
    joules: float | None = None
    provenance: Text

    @model_validator(mode="before")
    @classmethod
    def _empty_optional_is_default(cls, raw: Any) -> Any:
        # an optional column left empty in one row means "not recorded" for that row
        if isinstance(raw, dict):
            return {key: value for key, value in raw.items()
                    if not (key in OPTIONAL and isinstance(value, str) and not value.strip())}
        return raw

    @field_validator("time", "joules")
    @classmethod
    def _finite_non_negative(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"expected a finite number >= 0 (a negative or infinite time or "
                             f"energy is a broken measurement), got {value!r}")
        unit = info.data.get("time_unit")  # absent when the unit was refused: said there
        if info.field_name == "time" and unit in TIME_UNITS_S and value is not None \
                and value * TIME_UNITS_S[unit] > MAX_ROW_SECONDS:
            raise ValueError(f"expected at most {MAX_ROW_SECONDS:g} s (an hour) for one row, got "
                             f"{value!r} {unit}")
        return value

    def measurement(self) -> Measurement:
        """The row in seconds and joules per GEMM (one of ``batch``)."""
        return Measurement(device=self.device, backend=self.backend, dtype=self.dtype,
                           threads=self.threads, op=self.op, m=self.m, k=self.k, n=self.n,
                           seconds=self.time * TIME_UNITS_S[self.time_unit] / self.batch,
                           provenance=self.provenance, batch=self.batch, repeats=self.repeats,
                           joules=None if self.joules is None else self.joules / self.batch)


def read_csv_lines(path: str | Path, required: tuple[str, ...], known: tuple[str, ...] | None,
                   what: str, error: type[InputError] = InputError,
                   max_line_chars: int = MAX_LINE_CHARS,
                   max_bytes: int = MAX_CSV_BYTES) -> list[tuple[int, dict[str, str]]]:
    """(line number, {column: text}) of each data row of a CSV with a header; ``#`` comments.

    Structure only: a file that is not a regular one or holds more than ``max_bytes``, a missing,
    doubled or (when ``known`` is given) unknown header column, a line that is not CSV or too
    long, a row with another number of fields than the header. Raises ``error`` with every such
    problem; the values are the caller's schema's to check. A UTF-8 byte order mark (which
    spreadsheet programs write) is dropped, as the utf-8-sig codec would; text that is not UTF-8
    is refused (a Latin-1 file was read with U+FFFD in place of its accents).
    """
    path = Path(path)
    try:
        text = read_user_text(path, max_bytes)
    except UnicodeDecodeError as exc:  # as topologies and traces: not read with U+FFFD in it
        raise error(str(path), [f"not a UTF-8 text file (byte {exc.start}: {exc.reason}); "
                                f"convert it first (iconv -f latin1 -t utf-8, for one)"]) from exc
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        raise error(str(path), [f"cannot read: {getattr(exc, 'strerror', None) or exc}"]) from exc
    numbered: list[tuple[int, list[str]]] = []
    problems: list[tuple[int, str]] = []  # (line, message), reported in line order
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if len(line) > max_line_chars:
            problems.append((i, f"{len(line)} characters; a {what} row is at most "
                                f"{max_line_chars}"))
            continue
        try:
            numbered.append((i, next(csv.reader([line]))))
        except csv.Error as exc:
            problems.append((i, f"not a CSV line: {exc}"))

    def fail(found: list[tuple[int, str]]) -> InputError:
        return error(str(path), [f"line {i}: {message}" for i, message in sorted(found)])

    if not numbered and not problems:
        raise error(str(path), [f"empty file; expected a header line with the columns "
                                f"{', '.join(required)}"])
    if not numbered or problems[:1] and problems[0][0] < numbered[0][0]:
        raise fail(problems)  # the header itself is unreadable: no row can be checked
    header_line, header_fields = numbered[0]
    header = [h.strip() for h in header_fields]
    # a column named twice would be read from its last copy only, silently
    header_problems = [f"line {header_line}: column {c!r} named "
                       + ("twice" if header.count(c) == 2 else f"{header.count(c)} times")
                       for i, c in enumerate(header) if c in header[:i] and c not in header[i + 1:]]
    missing = [c for c in required if c not in header]
    unknown = [c for c in header if known is not None and c not in known]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing column(s) {', '.join(missing)}")
        if unknown:
            parts.append(f"unknown column(s) {', '.join(unknown)}")
        optional = [c for c in known or () if c not in required]
        header_problems.append(f"line {header_line} (header): {'; '.join(parts)}; expected the "
                               f"columns {', '.join(required)}"
                               + (f" (optional: {', '.join(optional)})" if optional else ""))
    if header_problems:
        raise error(str(path), header_problems)
    rows: list[tuple[int, dict[str, str]]] = []
    for line_no, fields in numbered[1:]:
        if len(fields) != len(header):
            problems.append((line_no, f"expected {len(header)} fields as in the header, "
                                      f"got {len(fields)}"))
            continue
        rows.append((line_no, dict(zip(header, fields))))
    if problems:
        raise fail(problems)
    return rows


def row_problems(exc: ValidationError, line_no: int, model: type[Schema]) -> list[str]:
    """A row's validation errors as ``line N: column 'c': message`` (the CSV's own notation)."""
    return [f"line {line_no}: column {column!r}: {message}" if column != "<top>"
            else f"line {line_no}: {message}"
            for column, message in problem_pairs(exc, model=model)]


def read_measurements(path: str | Path, min_seconds: float = 0.0) -> list[Measurement]:
    """Read and check a measurement CSV; raise MeasurementError listing every bad row.

    ``min_seconds`` > 0 also refuses rows whose time per GEMM is shorter (a model is fitted on
    the file: :data:`MIN_MODEL_SECONDS`), naming the first such row and how many more there are.
    """
    lines = read_csv_lines(path, REQUIRED, COLUMNS, "measurement", error=MeasurementError)
    problems: list[str] = []
    rows: list[Measurement] = []
    too_short: list[tuple[int, float]] = []  # (line, seconds per GEMM)
    for line_no, fields in lines:
        try:
            row = MeasurementRow.model_validate(fields).measurement()
        except ValidationError as exc:
            problems.extend(row_problems(exc, line_no, MeasurementRow))
            continue
        rows.append(row)
        if row.seconds < min_seconds:
            too_short.append((line_no, row.seconds))
    if too_short:
        line_no, seconds = too_short[0]
        problems.append(f"line {line_no}: column 'time': {seconds:g} s per GEMM is below "
                        f"{min_seconds:g} s, the shortest time a model is fitted on (a GEMM call "
                        f"takes at least a few clock cycles)")
        if len(too_short) > 1:
            more = ", ".join(str(line) for line, _ in too_short[1:11])
            problems.append(f"{len(too_short) - 1} more row(s) below {min_seconds:g} s: "
                            f"line(s) {more}{', ...' if len(too_short) > 11 else ''}")
    if problems:
        raise MeasurementError(str(path), problems)
    if not rows:
        raise MeasurementError(str(path), ["no measurement rows after the header"])
    return rows


def _written_fields(r: Measurement) -> list[str]:
    """A row's fields as :func:`write_measurements` writes them (in the order of COLUMNS)."""
    return [r.device, r.backend, r.dtype, str(r.threads), r.op, str(r.m), str(r.k), str(r.n),
            str(r.batch), f"{r.seconds * r.batch:.9g}", "s", str(r.repeats),
            "" if r.joules is None else f"{r.joules * r.batch:.6g}", r.provenance]


def written_row_problems(row: Measurement) -> list[tuple[str, str]]:
    """(column, message) of each check :func:`read_measurements` would fail on ``row`` once
    written: the line's (its length, a ``#`` that makes it a comment), then
    :class:`MeasurementRow`'s. An importer asks it of every row it makes, so that nothing
    ``perf import`` writes is refused, or skipped, by ``perf fit`` later."""
    try:
        fields = _written_fields(row)
    except (OverflowError, ValueError) as exc:  # seconds x batch beyond a float; a huge int
        return [("<top>", f"cannot be written as a measurement row: {exc}")]
    # the reader splits the file into lines first (str.splitlines, which also breaks at \r,
    # \v, \f, \x1c-\x1e, \x85, \u2028, \u2029): a field holding one cuts its row in two
    broken = [(column, value) for column, value in zip(COLUMNS, fields)
              if value.splitlines() not in ([], [value])]
    if broken:
        return [(column, f"expected text without a line break (the row would be read as two "
                         f"lines), got {value[:80]!r}") for column, value in broken]
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="").writerow(fields)
    line = buffer.getvalue()
    if len(line) > MAX_LINE_CHARS:
        return [("<top>", f"{len(line)} characters once written; a measurement row is at most "
                          f"{MAX_LINE_CHARS}")]
    if line.lstrip().startswith("#"):
        return [("device", f"expected a name that does not start with '#' (the line would be "
                           f"read as a comment), got {row.device[:80]!r}")]
    try:
        MeasurementRow.model_validate(dict(zip(COLUMNS, fields)))
    except ValidationError as exc:
        return problem_pairs(exc, model=MeasurementRow)
    return []


def write_measurements(path: str | Path, rows: Iterable[Measurement],
                       comments: Iterable[str] = ()) -> None:
    """Write rows in the CSV format (times in seconds, per row including batch)."""
    with written_whole(Path(path)) as handle:
        for comment in comments:
            handle.write(f"# {comment}\n")
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for r in rows:
            writer.writerow(_written_fields(r))


def as_arrays(rows: Iterable[Measurement]) -> tuple[np.ndarray, np.ndarray]:
    """Shapes as an (N, 3) float array of (m, k, n) and times in seconds as an (N,) array."""
    rows = list(rows)
    shapes = np.array([[r.m, r.k, r.n] for r in rows], dtype=np.float64).reshape(-1, 3)
    seconds = np.array([r.seconds for r in rows], dtype=np.float64)
    return shapes, seconds


def to_dict(row: Measurement) -> dict[str, object]:
    """A row as a plain dict (for JSON)."""
    return asdict(row)
