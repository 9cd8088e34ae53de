"""A second audit of ``testbed perf``: what an importer or reader read that it should have refused
(a FIFO, /dev/zero, a doubled column, a GEMM beyond BLAS's limit, a 1e308 s time, a NaN peak),
and what it refused that it should have read (a byte order mark). Each refusal exits 2 at once,
names the file and the line or column, and writes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testbed.cli import main as run_cli
from testbed.perf_model import importers
from testbed.perf_model.measurements import (
    MeasurementError,
    read_measurements,
    written_row_problems,
)

HEADER = "device,backend,dtype,threads,op,m,k,n,time,time_unit,provenance\n"
MLX_HEADER = "device,op,operand_shapes,backend,ms_mean_of_9\n"
DEEPBENCH_HEADER = "device,precision,M,N,K,transA,transB,time_ms,GOPS\n"
INT8 = "int8in_int32acc_gemmlowp"
MNN_HEADER = "device,backend,precision_flag,threads,kind,M,K,N,time_ms,gflops\n"
MMPERF_HEADER = "platform,run,library,M,N,K,gflops,raw,chip,threads\n"
MMPERF_ROW = "apple-a13,r1,ruy,64,64,64,10.0,10.0 GFLOPS,Apple M1,1\n"
VFP_LOG = """CPU: test chip
Total:
SingleThread HP max:  106.839 GFLOPS
SingleThread SP max:   {sp} GFLOPS
MultiThread  SP max:  227.490 GFLOPS

Group 0:  Thread=4
"""
HUGE = "99999999999999999999999"


def measurements(count: int, time: str = "1e-4", unit: str = "s") -> str:
    return HEADER + "".join(f"phone,lib,float32,4,gemm,{64 + i},{64 + i},{64 + i},{time},"
                            f"{unit},audit\n" for i in range(count))


def import_fails(tmp_path: Path, capsys: pytest.CaptureFixture, source: str, src: Path | str
                 ) -> str:
    """perf import's error text, once it has exited 2 and written nothing."""
    out = tmp_path / "out.csv"
    assert run_cli(["perf", "import", source, str(src), "--out", str(out)]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert str(src) in err and "Traceback" not in err, err
    return err


# -- 1. a source that is not a regular file, or far too large ---------------------------------

@pytest.mark.timeout(10)  # before the fix a FIFO blocked for ever
def test_import_refuses_a_fifo_at_once(tmp_path: Path, capsys) -> None:
    fifo = tmp_path / "f.csv"
    os.mkfifo(fifo)
    assert "not a regular file" in import_fails(tmp_path, capsys, "mlx", fifo)


@pytest.mark.timeout(10)  # before the fix /dev/zero was read until the memory ran out
@pytest.mark.parametrize("source", ["xnnpack", "vfpbench", "tf-sd835", "deepbench"])
def test_import_refuses_a_device_at_once(tmp_path: Path, capsys, source: str) -> None:
    assert "not a regular file" in import_fails(tmp_path, capsys, source, "/dev/zero")


@pytest.mark.timeout(10)
def test_vfpbench_refuses_a_fifo_in_its_log_directory(tmp_path: Path, capsys) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "b.txt").write_text(VFP_LOG.format(sp="48.807"))
    os.mkfifo(logs / "a.txt")
    err = import_fails(tmp_path, capsys, "vfpbench", logs)
    assert f"{logs / 'a.txt'}: cannot read: not a regular file" in err, err


@pytest.mark.parametrize("source", ["mlx", "xnnpack"])
def test_import_refuses_a_file_larger_than_the_limit(tmp_path: Path, capsys, source: str) -> None:
    big = tmp_path / "big.csv"
    with big.open("wb") as handle:  # sparse: no disk, and no read when the size is checked first
        handle.truncate(importers.MAX_SOURCE_BYTES + 1)
    err = import_fails(tmp_path, capsys, source, big)
    assert f"larger than the {importers.MAX_SOURCE_BYTES:,} bytes" in err, err


# -- 2. an imported row is checked as perf fit will read it ------------------------------------

@pytest.mark.parametrize("source, content, needle", [
    ("deepbench", DEEPBENCH_HEADER + f"x,{INT8},3000000000,700,2048,N,N,212.8,1\n",
     "line 2: column 'M' (m once imported): expected an integer <= 2147483647"),
    ("deepbench", DEEPBENCH_HEADER + f"x,{INT8},64,{HUGE},64,N,N,212.8,1\n",
     "line 2: column 'N' (n once imported): expected an integer <= 2147483647"),
    ("deepbench", DEEPBENCH_HEADER + f"x,{INT8},64,64,64,N,N,1e308,1\n",
     "line 2: column 'time_ms' (time once imported): expected at most 3600 s"),
    ("deepbench", DEEPBENCH_HEADER + f" ,{INT8},64,64,64,N,N,2,1\n",
     "line 2: column 'device': expected a non-empty text"),
    ("mnn", MNN_HEADER + f"SD,CPU,2,4,float-gemm,8,{HUGE},4096,1.0,1\n",
     "line 2: column 'K' (k once imported): expected an integer <= 2147483647"),
    ("mmperf", MMPERF_HEADER + f"apple-a13,r1,ruy,{HUGE},64,64,10.0,x,Apple M1,1\n",
     "line 2: column 'M' (m once imported): expected an integer <= 2147483647"),
    ("mlx", MLX_HEADER + "M1,Linear,100000x100000x32 32x16,cpu,1.0\n",
     "line 2: column 'operand_shapes' (m once imported): expected an integer <= 2147483647"),
    ("deepbench", DEEPBENCH_HEADER + "d" * 8100 + f",{INT8},64,64,64,N,N,2,1\n",
     "characters once written; a measurement row is at most 8192"),
    ("deepbench", DEEPBENCH_HEADER + f'"#x",{INT8},64,64,64,N,N,2,1\n',
     "line 2: column 'device': expected a name that does not start with '#'"),
])
def test_import_refuses_what_the_measurement_reader_would(tmp_path: Path, capsys, source: str,
                                                          content: str, needle: str) -> None:
    src = tmp_path / "src.csv"
    src.write_text(content)
    assert needle in import_fails(tmp_path, capsys, source, src)


def test_written_row_problems_are_the_readers(tmp_path: Path) -> None:
    [row] = read_measurements(_write(tmp_path, measurements(1)))
    assert written_row_problems(row) == []
    wide = row.__class__(**{**row.__dict__, "m": 2**31})
    [(column, message)] = written_row_problems(wide)
    assert column == "m" and "expected an integer <= 2147483647" in message


def test_deepbench_imports_the_precision_it_names_and_refuses_another(tmp_path: Path,
                                                                     capsys) -> None:
    src = tmp_path / "db.csv"
    src.write_text(DEEPBENCH_HEADER + f"x,{INT8},64,32,16,N,N,2.0,1\n")
    [row] = importers.import_deepbench(src)
    assert (row.dtype, row.backend, row.m, row.n, row.k) == ("int8", "gemmlowp", 64, 32, 16)
    src.write_text(DEEPBENCH_HEADER + f"x,{INT8},64,32,16,N,N,2.0,1\n"
                   "x,float32,64,32,16,N,N,2.0,1\n")
    err = import_fails(tmp_path, capsys, "deepbench", src)
    assert f"line 3: column 'precision': expected {INT8}" in err and "'float32'" in err, err


# -- 3, 4. the header: a column named twice, a byte order mark ---------------------------------

def test_a_column_named_twice_is_refused(tmp_path: Path, capsys) -> None:
    src = _write(tmp_path, HEADER.replace("device,", "device,device,", 1)
                 + "a,b,lib,float32,4,gemm,64,64,64,1e-4,s,audit\n")
    assert run_cli(["perf", "eval", str(src)]) == 2
    assert f"{src}: 1 problem(s):\n  - line 1: column 'device' named twice" \
        in capsys.readouterr().err
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("m,k,n,m\n1,2,3,4\n")
    assert run_cli(["perf", "predict", "snapdragon888", "--shapes", str(shapes)]) == 2
    assert "line 1: column 'm' named twice" in capsys.readouterr().err
    mlx = tmp_path / "mlx.csv"
    mlx.write_text("device," + MLX_HEADER + "x,M1,Linear,8x16 16x4,cpu,1.0\n")
    assert "line 1: column 'device' named twice" in import_fails(tmp_path, capsys, "mlx", mlx)


def test_a_byte_order_mark_is_read_as_utf_8_sig(tmp_path: Path, capsys) -> None:
    src = tmp_path / "bom.csv"
    src.write_text("\ufeff" + measurements(2), encoding="utf-8")
    assert [r.m for r in read_measurements(src)] == [64, 65]
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("\ufeffm,k,n\n1,2,3\n", encoding="utf-8")
    assert run_cli(["perf", "predict", "snapdragon888", "--shapes", str(shapes)]) == 0
    mlx = tmp_path / "mlx.csv"
    mlx.write_text("\ufeff" + MLX_HEADER + "M1,Linear,8x16 16x4,cpu,1.0\n", encoding="utf-8")
    assert [r.device for r in importers.import_mlx(mlx)] == ["M1"]


# -- 5. a vfpbench peak that is not a positive finite figure -----------------------------------

@pytest.mark.parametrize("figure", ["nan", "-5", "1e400", "0", "1.2.3"])
def test_vfpbench_refuses_a_peak_that_is_not_a_positive_figure(tmp_path: Path, capsys,
                                                               figure: str) -> None:
    log = tmp_path / "chip.txt"
    log.write_text(VFP_LOG.format(sp=figure))
    err = import_fails(tmp_path, capsys, "vfpbench", log)
    assert f"line 4: SingleThread SP max: expected a positive finite GFLOPS figure, got " \
           f"{figure!r}" in err, err


def test_vfpbench_reads_a_good_log(tmp_path: Path) -> None:
    log = tmp_path / "chip.txt"
    log.write_text(VFP_LOG.format(sp="48.807"))
    assert importers.vfpbench_peak(log, "SP", "single") == 48.807


# -- 6. a row with another field count than the header -----------------------------------------

@pytest.mark.parametrize("fields", [7, 9, 11])
def test_mmperf_refuses_a_row_of_another_field_count(tmp_path: Path, capsys, fields: int) -> None:
    cells = MMPERF_ROW.strip().split(",")
    row = ",".join((cells + ["x"])[:fields])
    src = tmp_path / "mm.csv"
    src.write_text(MMPERF_HEADER + MMPERF_ROW + row + "\n")
    err = import_fails(tmp_path, capsys, "mmperf", src)
    assert f"line 3: expected 10 fields as in the header, got {fields}" in err, err


# -- 7. a time beyond an hour --------------------------------------------------------------------

@pytest.mark.parametrize("time, unit", [("1e308", "s"), ("3601", "s"), ("7.2e6", "ms"),
                                        ("1e300", "ns")])
def test_a_time_beyond_an_hour_is_refused(tmp_path: Path, time: str, unit: str) -> None:
    src = _write(tmp_path, measurements(1) + f"phone,lib,float32,4,gemm,8,8,8,{time},{unit},a\n")
    with pytest.raises(MeasurementError) as info:
        read_measurements(src)
    assert f"line 3: column 'time': expected at most 3600 s (an hour) for one row, got " \
           f"{float(time)!r} {unit}" in str(info.value)


def test_a_time_of_an_hour_is_read(tmp_path: Path) -> None:
    src = _write(tmp_path, measurements(1, time="3600") + measurements(1, "3.6e6", "ms")[
        len(HEADER):])
    assert [r.seconds for r in read_measurements(src)] == [3600.0, 3600.0]


# -- 8. too few rows to fit: the file is named -------------------------------------------------

@pytest.mark.parametrize("command", ["fit", "eval"])
def test_too_few_rows_to_fit_names_the_file(tmp_path: Path, capsys, command: str) -> None:
    src = _write(tmp_path, measurements(5))
    model = tmp_path / "model.yaml"
    assert run_cli(["perf", command, str(src)] + (["--out", str(model)] if command == "fit"
                                                  else [])) == 2
    err = capsys.readouterr().err
    assert f"error: {src}: 1 problem(s):\n  - need at least 10 measurements to fit the cost " \
           f"model" in err, err
    assert not model.exists()


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "m.csv"
    path.write_text(text)
    return path


def test_importers_refuse_what_perf_fit_would_and_say_what_they_expected(tmp_path: Path) -> None:
    """mmperf at 1e6 GFLOPS on a 10^3 GEMM wrote a 2e-12 s row that `perf fit` then refused;
    mlx's 'operand_shapes' with one shape said 'list index out of range'; a 4,400-digit M was
    echoed whole."""
    source = tmp_path / "mm.csv"
    source.write_text(MMPERF_HEADER + "apple-a13,r1,ruy,10,10,10,1e6,x,Apple M1,1\n")
    with pytest.raises(importers.SourceFormatError, match="line 2: column 'gflops' .*2e-12 s a "
                       "GEMM, below the 1e-09 s perf fit accepts"):
        importers.import_mmperf(source)
    source.write_text(MMPERF_HEADER + MMPERF_ROW.replace("64,64,64", "9" * 4400 + ",64,64"))
    with pytest.raises(importers.SourceFormatError) as info:
        importers.import_mmperf(source)
    assert "... (4,400 characters)" in str(info.value) and len(str(info.value)) < 400
    mlx = tmp_path / "mlx.csv"
    mlx.write_text(MLX_HEADER + "M1,Linear,100x1024,cpu,1.5\n")
    with pytest.raises(importers.SourceFormatError, match="line 2: column 'operand_shapes': "
                       "expected two operand shapes"):
        importers.import_mlx(mlx)
