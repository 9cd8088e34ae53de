"""Issue 14's perf findings: oversized CSV fields, --out to a directory, wrong mlx columns,
negative sizes and NaN times: each exits 2 naming the file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli import main as run_cli

MLX_HEADER = "device,op,operand_shapes,backend,ms_mean_of_9\n"


@pytest.mark.parametrize("content, needle", [
    ("device,op,shapes,backend,ms\nM1,Linear,8x16 16x4,cpu,1.0\n", "line 1 (header): missing"),
    (MLX_HEADER + "M1,Linear,-8x16 16x4,cpu,1.0\n", "line 2: dimension: expected a positive"),
    (MLX_HEADER + "M1,Linear,8x16 16x4,cpu,nan\n", "line 2: ms_mean_of_9: expected a positive"),
    (MLX_HEADER + "M1,Linear,8x16 16x4,cpu,-3\n", "line 2: ms_mean_of_9"),
    (MLX_HEADER + "M1,Linear,8x16 16x4,cpu," + "1" * 200_000 + "\n", "line 2"),
])
def test_perf_import_mlx_refuses_bad_rows(tmp_path: Path, capsys, content: str, needle: str):
    src = tmp_path / "mlx.csv"
    src.write_text(content)
    out = tmp_path / "out.csv"
    assert run_cli(["perf", "import", "mlx", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(src) in err and needle in err, err
    assert not out.exists()


def test_measurement_file_with_a_huge_field_exits_2(tmp_path: Path, capsys) -> None:
    src = tmp_path / "m.csv"
    src.write_text("device,backend,dtype,threads,op,m,k,n,time,time_unit,provenance\n"
                   "d,b,float32,1,gemm,4,4,4,1e-6,s," + "x" * 200_000 + "\n")
    for cmd in (["perf", "eval", str(src)], ["perf", "fit", str(src), "--out",
                                             str(tmp_path / "f.yaml")]):
        assert run_cli(cmd) == 2
        err = capsys.readouterr().err
        assert f"{src}: 1 problem(s):\n  - line 2: 200032 characters" in err, err


def test_perf_fit_out_to_a_directory_exits_2(tmp_path: Path, capsys) -> None:
    src = Path(__file__).resolve().parents[1] / "data" / "perf_host.csv"
    assert run_cli(["perf", "fit", str(src), "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


MNN_HEADER = "device,backend,precision_flag,threads,kind,M,K,N,time_ms,gflops\n"
NCNN_HEADER = "device,model,num_threads,powersave,gpu_device,loop_count,min_ms,max_ms,avg_ms\n"
MMPERF_HEADER = "platform,run,library,M,N,K,gflops\n"


@pytest.mark.parametrize("source, content, needle", [
    ("mnn", "M,K,N\n1,2,3\n", "line 1 (header): missing column(s) device"),
    ("mnn", MNN_HEADER + "SD,CPU,2,4,float-gemm,8,-2560,4096,1.0,1\n",
     "line 2: K: expected a positive integer, got '-2560'"),
    ("mnn", MNN_HEADER + "SD,CPU,2,4,float-gemm,8,2560,4096,abc,1\n",
     "line 2: time_ms: expected a positive finite time, got 'abc'"),
    ("ncnn", NCNN_HEADER + "dev,vision_transformer,x,2,-1,8,1,2,3\n",
     "line 2: num_threads: expected a positive integer, got 'x'"),
    ("ncnn", NCNN_HEADER + "dev,vision_transformer,4,2,-1,8,1,2,0\n",
     "line 2: avg_ms: expected a positive finite time, got '0'"),
    ("mmperf", MMPERF_HEADER + "apple-a13,1,ruy,8,0,16,10.0\n",
     "line 2: N: expected a positive integer, got '0'"),
])
def test_perf_import_phone_sources_refuse_bad_rows(tmp_path: Path, capsys, source: str,
                                                   content: str, needle: str) -> None:
    src = tmp_path / "src.csv"
    src.write_text(content)
    out = tmp_path / "out.csv"
    assert run_cli(["perf", "import", source, str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(src) in err and needle in err, err
    assert not out.exists()
