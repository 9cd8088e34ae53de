"""Importers from the public data in ../shared/data into the measurement format, with attribution.

* mlx-benchmark (MIT, Copyright (c) 2023 Tristan Bilot; github.com/TristanBilot/mlx-benchmark,
  ``benchmarks/detailed_benchmark.md``): Apple M1-M4 ``Linear`` and ``MatMul`` times, mean of 9
  calls after one warm-up, float32. Operand shapes become GEMMs: A's last two dimensions are
  (m, k) and B's are (k, n); when B is 2-D, A's leading dimensions fold into m (one GEMM);
  when B is batched, A's leading dimensions are the ``batch`` count. ``Linear`` rows are the
  ``forward`` op, ``MatMul`` rows ``gemm``.
* DeepBench (Apache-2.0, Baidu Research; github.com/baidu-research/DeepBench ``results/``):
  int8 GEMMs (int32 accumulation, gemmlowp) on iPhone 6 (A8), iPhone 7 (A10), Raspberry Pi 3.
  Its M, N, K name C[M x N] = A[M x K] B[K x N], as ours do.
* vfpbench (MIT, Copyright (c) 2019 Hiroyuki Ogasawara; github.com/hiroog/vfpbench ``log/``):
  measured peak GFLOPS per device; not GEMMs, so they import into :class:`PeakRecord`.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path

from testbed.perf_model.measurements import Measurement

MLX_ATTRIBUTION = ("mlx-benchmark detailed_benchmark.md @85c5376 (MIT, (c) 2023 Tristan Bilot), "
                   "mean of 9 calls after 1 warm-up")
DEEPBENCH_ATTRIBUTION = "DeepBench results @da81ba7 (Apache-2.0, Baidu Research), gemmlowp int8"
VFPBENCH_ATTRIBUTION = "vfpbench log @19d3b70 (MIT, (c) 2019 Hiroyuki Ogasawara)"


class SourceFormatError(ValueError):
    """A source file that does not look as expected; names the file and line."""


def _shape(text: str) -> list[int]:
    return [int(x) for x in text.split("x")]


def mlx_gemm(operand_shapes: str) -> tuple[int, int, int, int]:
    """(batch, m, k, n) of an mlx-benchmark operand-shape string (bias, if any, ignored)."""
    parts = operand_shapes.split()
    a, b = _shape(parts[0]), _shape(parts[1])
    if len(b) == 1:  # a vector
        b = [b[0], 1]
    if a[-1] != b[-2]:
        raise ValueError(f"inner dimensions differ in {operand_shapes!r}")
    if len(b) == 2:
        return 1, math.prod(a[:-1]), a[-1], b[-1]
    return math.prod(a[:-2]), a[-2], a[-1], b[-1]


def import_mlx(path: str | Path, backend: str | None = "cpu") -> list[Measurement]:
    """mlx-benchmark rows (of one backend, or all with None) as measurements."""
    path = Path(path)
    rows = []
    with path.open(newline="") as handle:
        for line_no, rec in enumerate(csv.DictReader(handle), start=2):
            if backend is not None and rec["backend"] != backend:
                continue
            try:
                batch, m, k, n = mlx_gemm(rec["operand_shapes"])
                ms = float(rec["ms_mean_of_9"])
            except (ValueError, KeyError) as exc:
                raise SourceFormatError(f"{path}: line {line_no}: {exc}") from exc
            rows.append(Measurement(device=rec["device"].strip(), backend=rec["backend"],
                                    dtype="float32", threads=0,
                                    op="forward" if rec["op"] == "Linear" else "gemm",
                                    m=m, k=k, n=n, batch=batch, seconds=ms / 1e3 / batch,
                                    repeats=9, provenance=MLX_ATTRIBUTION))
    return rows


def import_deepbench(path: str | Path) -> list[Measurement]:
    """DeepBench device GEMM rows as measurements (dtype int8)."""
    path = Path(path)
    rows = []
    with path.open(newline="") as handle:
        for line_no, rec in enumerate(csv.DictReader(handle), start=2):
            try:
                m, n, k = int(rec["M"]), int(rec["N"]), int(rec["K"])
                ms = float(rec["time_ms"])
            except (ValueError, KeyError) as exc:
                raise SourceFormatError(f"{path}: line {line_no}: {exc}") from exc
            rows.append(Measurement(device=rec["device"], backend="gemmlowp", dtype="int8",
                                    threads=0, op="gemm", m=m, k=k, n=n, seconds=ms / 1e3,
                                    provenance=DEEPBENCH_ATTRIBUTION))
    return rows


@dataclass(frozen=True)
class PeakRecord:
    """A measured peak rate: device, precision (HP/SP/DP), scope (single/multi), GFLOPS."""

    device: str
    precision: str
    scope: str
    gflops: float
    provenance: str


_PEAK = re.compile(r"^\s*(SingleThread|MultiThread)\s+(HP|SP|DP)\s+max:\s+([0-9.]+)\s+GFLOPS")


def import_vfpbench(path: str | Path) -> list[PeakRecord]:
    """The whole-chip ("Total:") peak figures of one vfpbench log."""
    path = Path(path)
    records = []
    in_total = False
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("Total:"):
            in_total = True
            continue
        if in_total and not line.strip():
            break
        match = _PEAK.match(line) if in_total else None
        if match:
            scope = "single" if match.group(1) == "SingleThread" else "multi"
            records.append(PeakRecord(device=path.stem, precision=match.group(2), scope=scope,
                                      gflops=float(match.group(3)),
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
    with Path(path).open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["device", "precision", "scope", "gflops", "provenance"])
        for r in records:
            writer.writerow([r.device, r.precision, r.scope, r.gflops, r.provenance])
