"""The measurement CSV format: round trip, and bad files named by line and column; importers."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli import main
from testbed.errors import InputError
from testbed.perf_model import importers
from testbed.perf_model.cli import add_parser  # noqa: F401  (the CLI module imports cleanly)
from testbed.perf_model.measurements import (
    Measurement,
    MeasurementError,
    read_measurements,
    write_measurements,
)

HEADER = "device,backend,dtype,threads,op,m,k,n,time,time_unit,provenance\n"
GOOD = "host,numpy,float32,1,forward,128,1024,128,0.5,ms,test\n"
SHARED = importers.shared_data_dir()  # $TESTBED_SHARED_DATA, else the nearest ancestor's


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "m.csv"
    path.write_text(text)
    return path


def test_round_trip(tmp_path: Path) -> None:
    rows = [Measurement("host", "numpy", "float32", 1, "weight_grad", 16, 4096, 512, 1.5e-3,
                        "test", batch=2, repeats=5, joules=0.01)]
    path = tmp_path / "r.csv"
    write_measurements(path, rows, comments=["a comment"])
    assert read_measurements(path) == rows


def test_units_are_converted_to_seconds(tmp_path: Path) -> None:
    text = HEADER + GOOD + "host,numpy,float32,1,gemm,1,2,3,250,us,test\n"
    rows = read_measurements(write(tmp_path, "# comment\n" + text))
    assert [r.seconds for r in rows] == pytest.approx([5e-4, 2.5e-4])


@pytest.mark.parametrize("text, expected", [
    ("device,backend,dtype,threads,op,m,k,n,time_unit,provenance\n" + GOOD,
     "line 1 (header): missing column(s) time"),
    (HEADER + GOOD + "host,numpy,float32,1,forward,128,1024,128,-0.5,ms,test\n",
     "line 3: column 'time': expected a finite number >= 0"),
    (HEADER + "# note\n" + GOOD + "host,numpy,float32,1,forward,128,1024,128,0.5,min,test\n",
     "line 4: column 'time_unit': expected a time unit, one of s, ms, us, ns"),
    (HEADER + "host,numpy,float32,1,backward,128,1024,128,0.5,ms,test\n",
     "line 2: column 'op': expected an op kind, one of forward, input_grad, weight_grad, gemm"),
    (HEADER + "host,numpy,float32,1,forward,128,0,128,0.5,ms,test\n",
     "line 2: column 'k': expected an integer >= 1"),
    (HEADER + "host,numpy,float32,1,forward,128,1024,0.5,ms,test\n",
     "line 2: expected 11 fields as in the header, got 10"),
])
def test_bad_files_name_line_and_column(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(MeasurementError) as info:
        read_measurements(path)
    assert str(path) in str(info.value) and expected in str(info.value)


def test_every_bad_row_is_reported_at_once(tmp_path: Path) -> None:
    bad = "host,numpy,float32,1,forward,128,1024,128,-1,ms,test\n"
    with pytest.raises(MeasurementError) as info:
        read_measurements(write(tmp_path, HEADER + bad + GOOD + bad))
    assert "line 2" in str(info.value) and "line 4" in str(info.value)


def test_every_problem_of_a_row_is_reported_with_its_column(tmp_path: Path) -> None:
    text = (HEADER.replace("provenance", "batch,joules,provenance")
            + "host,numpy,float16x,-1,forward,0.5,1024,128,inf,ms,,-2,test\n"
            + "host,numpy,float32,1,forward,128,1024,128,0.5,ms,2,,\n"
            + "host,numpy,float32,1,forward,128,1024,128,0.5,ms,,,test\n")
    path = write(tmp_path, text)
    with pytest.raises(MeasurementError) as info:
        read_measurements(path)
    assert isinstance(info.value, InputError) and info.value.source == str(path)
    assert info.value.problems == [
        "line 2: column 'dtype': expected a dtype, one of float32, float64, float16, int8, "
        "got 'float16x'",
        "line 2: column 'threads': expected an integer >= 0, got -1",
        "line 2: column 'm': expected int, got str '0.5'",
        "line 2: column 'time': expected a finite number >= 0 (a negative or infinite time or "
        "energy is a broken measurement), got inf",
        "line 2: column 'joules': expected a finite number >= 0 (a negative or infinite time or "
        "energy is a broken measurement), got -2.0",
        "line 3: column 'provenance': expected a non-empty text",
    ]


def test_cli_eval_exits_2_on_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path, HEADER + "host,numpy,float32,1,forward,128,1024,128,1,parsec,test\n")
    assert main(["perf", "eval", str(path)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_shared_data_is_found_by_one_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "shared" / "data"
    data.mkdir(parents=True)
    deep = tmp_path / "wt" / "name" / "tests" / "unit"  # a worktree two levels below shared/
    deep.mkdir(parents=True)
    monkeypatch.delenv(importers.SHARED_DATA_ENV, raising=False)
    assert importers.shared_data_dir(deep / "t.py") == data
    nearer = tmp_path / "wt" / "shared" / "data"  # the nearest ancestor's wins
    nearer.mkdir(parents=True)
    assert importers.shared_data_dir(deep / "t.py") == nearer
    monkeypatch.setenv(importers.SHARED_DATA_ENV, str(tmp_path / "elsewhere"))
    assert importers.shared_data_dir(deep / "t.py") == tmp_path / "elsewhere"


def test_cli_show_and_list(capsys: pytest.CaptureFixture) -> None:
    assert main(["perf", "show", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "snapdragon888" in listed and "m2pro" in listed and "host" in listed
    assert main(["perf", "show", "snapdragon888"]) == 0
    out = capsys.readouterr().out
    assert "provenance:" in out and "Das et al." in out and "20.0% slowdown" in out
    assert main(["perf", "show", "no-such-phone"]) == 2


def test_mlx_shapes_become_gemms() -> None:
    assert importers.mlx_gemm("100x1024x32 32x1024 1024") == (1, 102400, 32, 1024)
    assert importers.mlx_gemm("1000x1024x64 1000x64x256") == (1000, 1024, 64, 256)
    assert importers.mlx_gemm("1000x64x256 256x32") == (1, 64000, 256, 32)
    assert importers.mlx_gemm("32x1x1000 32x1000x128") == (32, 1, 1000, 128)


@pytest.mark.skipif(SHARED is None, reason="no shared/data above the checkout and "
                    "TESTBED_SHARED_DATA is not set")
def test_importers_keep_attribution() -> None:
    assert SHARED is not None and SHARED.is_dir(), f"{SHARED}: no such directory"
    mlx = importers.import_mlx(SHARED / "mlx-benchmark" / "linear_matmul_ms.csv")
    assert mlx and all("Tristan Bilot" in r.provenance and r.dtype == "float32" for r in mlx)
    deep = importers.import_deepbench(SHARED / "deepbench" / "device_gemm.csv")
    assert len(deep) == 39 and all(r.dtype == "int8" for r in deep)
    peak = importers.vfpbench_peak(SHARED / "vfpbench" / "log" / "Google Tensor G2 Pixel 7a.txt")
    assert peak == pytest.approx(227.49)


def test_control_characters_and_text_not_utf8_are_refused(tmp_path: Path) -> None:
    """An escape sequence in the device column passed `perf fit` into a profile's description,
    and `perf show` then sent it to the terminal; a Latin-1 file was read with U+FFFD in place of
    its accents, where topologies and traces are refused."""
    from testbed.perf_model.profile_schema import check_profile
    from testbed.perf_model.profiles import PROFILE_DIR
    from testbed.user_paths import load_user_yaml

    for name in ("ph\x1b[31mone", "host\x00", "tab\there"):
        with pytest.raises(MeasurementError) as info:
            read_measurements(write(tmp_path, HEADER + GOOD.replace("host", name, 1)))
        assert "line 2: column 'device': expected text without control characters" in \
            str(info.value), info.value
    path = tmp_path / "latin.csv"
    path.write_bytes((HEADER + GOOD.replace("host", "caf\xe9", 1)).encode("latin-1"))
    with pytest.raises(MeasurementError) as info:
        read_measurements(path)
    assert f"not a UTF-8 text file (byte {len(HEADER) + 3}: invalid continuation byte)" in \
        str(info.value), info.value
    assert len(read_measurements(write(tmp_path, HEADER + GOOD.replace("host", "café", 1)))) == 1
    raw = load_user_yaml((PROFILE_DIR / "snapdragon888.yaml").read_text())
    raw["description"] = "Snapdragon\x1b[2J"
    with pytest.raises(InputError, match="description: expected text without control"):
        check_profile(raw, "edited.yaml")
