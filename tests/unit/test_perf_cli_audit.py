"""`testbed perf` as a new user meets it: help that says what a command does, progress on a
sweep of minutes, and options that are refused (exit 2, nothing written) where they were
ignored or where they made a file that a later command refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli import build_parser
from testbed.cli import main as run_cli
from testbed.perf_model.measurements import Measurement, written_row_problems

ROOT = Path(__file__).resolve().parents[2]
HOST = ROOT / "tests" / "data" / "perf_host.csv"
SETS = ROOT / "tests" / "data" / "perf_sets.csv"


def _help(*argv: str) -> str:
    parser = build_parser()
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        perf = action.choices["perf"]
    text = perf.format_help()
    for name in argv:
        for action in perf._subparsers._group_actions:  # type: ignore[union-attr]
            text = action.choices[name].format_help()
    return " ".join(text.split())


def test_fit_and_eval_help_name_the_models_they_use() -> None:
    text = _help()
    # the default model of `perf fit` is the cost model, not the GemmTimeRegressor (ridge)
    assert "GemmTimeRegressor" not in text
    assert "--model cost, rate or ridge" in text
    # eval prints five model families, not only "fitted vs roofline"
    assert "cost model as 'fitted', rate, constant, ridge, roofline" in text


def test_measure_help_gives_the_default_output_and_the_seed() -> None:
    text = _help("measure")
    assert "default: perf_measurements.csv" in text
    assert "seed of the --quick/--full shape draw" in text


@pytest.mark.parametrize("device, needle", [
    ("", "expected a non-empty text"),
    ("#lab", "does not start with '#'"),
    ("a\nb", "without a line break"),
])
def test_measure_refuses_a_device_name_its_rows_cannot_hold(tmp_path: Path, capsys,
                                                            device: str, needle: str) -> None:
    """It measured for a minute and wrote rows that perf fit refused ('' ), read as comments
    ('#lab': "no measurement rows") or as broken lines ('a\\nb')."""
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("m,k,n\n16,64,16\n")
    out = tmp_path / "m.csv"
    assert run_cli(["perf", "measure", "--shapes", str(shapes), "--passes", "1",
                    "--device", device, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: --device: 1 problem(s)" in err and needle in err, err
    assert "measuring" not in err  # refused before any timing
    assert not out.exists()


def test_a_line_break_in_any_written_field_is_a_problem() -> None:
    row = Measurement(device="d", backend="b\u2028x", dtype="float32", threads=1, op="gemm",
                      m=1, k=1, n=1, seconds=1e-6, provenance="p\r")
    columns = [column for column, _ in written_row_problems(row)]
    assert columns == ["backend", "provenance"]


def test_measure_reports_progress_per_pass_and_its_file_reads_back(tmp_path: Path,
                                                                   capsys) -> None:
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("m,k,n\n16,64,16\n32,64,32\n")
    out = tmp_path / "m.csv"
    assert run_cli(["perf", "measure", "--shapes", str(shapes), "--passes", "2",
                    "--repeats", "1", "--device", "my-laptop", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "measuring 2 shape(s) x 2 pass(es) x 1 sample(s)" in err, err
    assert "1/4 timed (pass 1/2)" in err and "4/4 timed (pass 2/2)" in err, err
    assert out.exists()


@pytest.mark.parametrize("command", ["fit", "eval"])
def test_fit_and_eval_refuse_a_file_of_several_sets(tmp_path: Path, capsys,
                                                    command: str) -> None:
    """perf_sets.csv holds 9 (device, backend, dtype, threads) sets: eval printed figures of
    one model across all of them (median p/t 0.16), which describe no device."""
    out = tmp_path / "model.yaml"
    argv = ["perf", command, str(SETS)] + (["--out", str(out)] if command == "fit" else [])
    assert run_cli(argv) == 2
    captured = capsys.readouterr()
    assert "rows of 9 (device, backend, dtype, threads) sets" in captured.err, captured.err
    assert "choose one with --device and --backend" in captured.err
    assert captured.out == "" and not out.exists()
    # a device of three libraries still is three sets
    assert run_cli(argv + ["--device", "Apple M1"]) == 2
    assert "rows of 3 (device, backend, dtype, threads) sets" in capsys.readouterr().err


def test_fit_picks_one_set_with_device_and_backend(tmp_path: Path, capsys) -> None:
    out = tmp_path / "model.yaml"
    assert run_cli(["perf", "fit", str(SETS), "--device", "host-xeon", "--backend",
                    "numpy-openblas", "--out", str(out)]) == 0
    assert "model fitted on 150 shapes" in capsys.readouterr().out
    assert out.exists()


def test_an_unknown_device_or_backend_names_what_the_file_has(capsys) -> None:
    assert run_cli(["perf", "eval", str(SETS), "--device", "nosuch"]) == 2
    assert "no rows of device 'nosuch'; the file has Apple M1, Apple M1 Max" \
        in capsys.readouterr().err
    assert run_cli(["perf", "eval", str(SETS), "--device", "Apple M1", "--backend", "x"]) == 2
    assert ("no rows of backend 'x'; the rows of device 'Apple M1' have mmperf-accelerate, "
            "mmperf-mlir, mmperf-ruy") in capsys.readouterr().err


def test_eval_of_one_set_is_unchanged(capsys) -> None:
    assert run_cli(["perf", "eval", str(HOST)]) == 0
    out = capsys.readouterr().out
    # the committed set's figures (docs/perf-models.md: 38 held-out rows; within 5 % 52.6 %,
    # 10 % 92.1 %, 25 and 50 % all; median p/t 1.01; MAPE 5.1 %), with room for another
    # machine's BLAS and fit: a row or two across a band edge, a few hundredths elsewhere
    row = next(line.split() for line in out.splitlines() if line.startswith("random ")
               and line.split()[1] == "fitted")
    n, within_5, within_10, within_25, within_50, p_over_t, mape = map(float, row[2:])
    assert n == 38
    two_rows = 2 * 100 / 38 + 0.1  # percentage points
    assert abs(within_5 - 52.6) <= two_rows and abs(within_10 - 92.1) <= two_rows
    assert within_25 >= 97 and within_50 == 100.0
    assert abs(p_over_t - 1.01) <= 0.02 and abs(mape - 5.1) <= 0.5


def test_import_refuses_backend_for_a_source_that_keeps_every_row(tmp_path: Path,
                                                                  capsys) -> None:
    """`--backend mmperf-ruy` was silently ignored: every backend was written."""
    src = tmp_path / "mmperf.csv"
    src.write_text("anything\n")
    out = tmp_path / "out.csv"
    assert run_cli(["perf", "import", "mmperf", str(src), "--backend", "mmperf-ruy",
                    "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: --backend: 1 problem(s)" in err and "only an mlx import" in err, err
    assert not out.exists()


def test_show_refuses_a_profile_and_list_together(capsys) -> None:
    assert run_cli(["perf", "show", "--list", "host"]) == 2
    captured = capsys.readouterr()
    assert "give a profile or --list, not both" in captured.err and captured.out == ""


def test_a_missing_profile_path_says_no_such_file(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "mine.yaml"
    for argv in (["perf", "show", str(missing)], ["perf", "predict", str(missing), "1", "2",
                                                   "3"]):
        assert run_cli(argv) == 2
        err = capsys.readouterr().err
        assert f"(no such file: {missing})" in err, err
    assert run_cli(["perf", "show", "nosuch"]) == 2  # a name: the shipped list, no file talk
    assert "no such file" not in capsys.readouterr().err


def test_calibrating_on_a_base_without_a_curve_says_constant_rate(tmp_path: Path,
                                                                  capsys) -> None:
    """The host's cost model has no half lengths: the result is a constant rate, which the
    summary and evaluation.calibration.shape_curve called 'base curve'."""
    src = tmp_path / "five.csv"
    src.write_text("device,backend,dtype,threads,op,m,k,n,time,time_unit,provenance\n"
                   + "".join(f"d,b,float32,1,gemm,{s},{4 * s},{s},{2 * s * 4 * s * s / 5e10:.6g},"
                             f"s,p\n" for s in (16, 32, 64, 128, 256)))
    out = tmp_path / "mine.yaml"
    assert run_cli(["perf", "calibrate", "host", str(src), "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "mine: constant rate (the base host has no rate-form shape curve)" in summary
    assert "base curve" not in out.read_text()


def test_measure_refuses_shapes_that_do_not_fit_in_memory_before_timing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 100,000-cube shape (within the reader's limits) ended in numpy's MemoryError, a
    traceback, after the shapes before it were timed."""
    shapes = tmp_path / "big.csv"
    shapes.write_text("m,k,n\n64,64,64\n1000000,1000000,1000000\n")
    out = tmp_path / "out.csv"
    assert run_cli(["perf", "measure", "--shapes", str(shapes), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--shapes {shapes}" in err and "1000000 x 1000000 x 1000000: its operands and " \
        "result need" in err, err
    assert not out.exists()
