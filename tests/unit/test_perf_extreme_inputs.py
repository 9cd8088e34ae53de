"""A fuzz pass over testbed/perf_model: absurd but finite numbers in profiles and measurements.

Each is refused with exit 2 (or a ProfileError), the message naming the file and the field or
line, and nothing is written; profiles at the edges of the ranges still predict finite times.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from testbed.cli import main as run_cli
from testbed.perf_model.features import MAX_DIMENSION
from testbed.perf_model.profiles import PROFILE_DIR, ProfileError, list_profiles, load_profile

DATA = Path(__file__).resolve().parents[1] / "data"
HEADER = "device,backend,dtype,threads,op,m,k,n,time,time_unit,provenance\n"
SIZES = (64, 128, 256, 512, 1024, 96, 192, 384)


def shipped(name: str) -> dict[str, Any]:
    return yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())


def write_profile(path: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> Path:
    raw = shipped(name)
    edit(raw)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def rows(times: list[str], sizes: tuple[int, ...] = SIZES) -> str:
    return HEADER + "".join(f"phone,lib,float32,4,gemm,{s},{s},{s},{t},s,fuzz\n"
                            for s, t in zip(sizes, times))


# -- 1. every numeric field of a profile has a range ------------------------------------------

def _set(section: str | None, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        target = raw
        for part in (section or "").split("."):
            if part:
                target = target[part]
        target[key] = value
    return edit


OUT_OF_RANGE = [  # (profile, section, key, value, the path the message names)
    ("host", "model.blas", "k_block", 1e-300, "model.blas.k_block"),
    ("host", "model.blas", "k_block", 448.5, "model.blas.k_block"),
    ("host", "model.blas", "unroll_m", 0.5, "model.blas.unroll_m"),
    ("host", "model.blas", "cache_bytes", 1e300, "model.blas.cache_bytes"),
    ("host", "model", "coef", [1e300] + [0.0] * 23, "model.coef[0]"),
    ("host", "model", "coef", [-1e-9] + [0.0] * 23, "model.coef[0]"),
    ("snapdragon888", "model", "peak_flops", 1e-300, "model.peak_flops"),
    ("snapdragon888", "model", "peak_flops", 1e300, "model.peak_flops"),
    ("snapdragon888", "model", "bandwidth_bytes_s", 1e-300, "model.bandwidth_bytes_s"),
    ("snapdragon888", "model", "overhead_s", 1e300, "model.overhead_s"),
    ("snapdragon888", "model", "intercept", 1e300, "model.intercept"),
    ("snapdragon888", "model", "coef", [0.0, 1e300, 0.0], "model.coef[1]"),
    ("snapdragon888", None, "sustained_gflops", 1e-300, "sustained_gflops"),
    ("snapdragon888", None, "tile_overhead_s", 1e300, "tile_overhead_s"),
    ("snapdragon888", "thermal", "capacity_j_per_k", 1e-300, "thermal.capacity_j_per_k"),
    ("snapdragon888", "thermal", "conductance_w_per_k", 1e300, "thermal.conductance_w_per_k"),
    ("snapdragon888", "thermal", "ambient_c", -1e300, "thermal.ambient_c"),
    ("snapdragon888", "thermal", "throttle_full_c", 1e300, "thermal.throttle_full_c"),
    ("snapdragon888", "thermal", "min_speed", 1e-300, "thermal.min_speed"),
    ("snapdragon888", "power", "active_w", 1e300, "power.active_w"),
    ("snapdragon888", "power", "radio_w", 1e300, "power.radio_w"),
]


@pytest.mark.parametrize("name, section, key, value, where", OUT_OF_RANGE,
                         ids=[f"{c[0]}-{c[4]}-{c[3]!r}" for c in OUT_OF_RANGE])
def test_a_profile_number_out_of_its_range_is_refused_naming_the_field(
        tmp_path: Path, name: str, section: str | None, key: str, value: Any, where: str) -> None:
    bad = write_profile(tmp_path / "bad.yaml", name, _set(section, key, value))
    with pytest.raises(ProfileError) as info:
        load_profile(str(bad))
    assert str(bad) in str(info.value)
    assert any(p.startswith(f"{where}:") for p in info.value.problems), info.value.problems


def test_validate_refuses_a_topology_whose_profile_has_a_tiny_k_block(tmp_path: Path,
                                                                      capsys) -> None:
    write_profile(tmp_path / "kb.yaml", "host", _set("model.blas", "k_block", 1e-300))
    topology = (DATA / "tiny.yaml").read_text().replace("profile: snapdragon888",
                                                        "profile: kb.yaml")
    (tmp_path / "topo.yaml").write_text(topology)
    assert run_cli(["validate", str(tmp_path / "topo.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'kb.yaml'} does not load: model.blas.k_block: expected" in err, err


def test_every_shipped_profile_is_within_the_ranges() -> None:
    for name in list_profiles():
        assert load_profile(name).name == name


# -- 2. noise quantiles ------------------------------------------------------------------------

def test_a_noise_quantile_of_800_is_refused_by_show_and_predict(tmp_path: Path, capsys) -> None:
    bad = write_profile(tmp_path / "noise.yaml", "snapdragon888", _set(
        "model", "noise", {"levels": [0, 1], "log_quantiles": [0, 800]}))
    for argv in (["perf", "show", str(bad)], ["perf", "predict", str(bad), "8", "8", "8"]):
        assert run_cli(argv) == 2
        err = capsys.readouterr().err
        assert f"{bad}: 1 problem(s)" in err and "model.noise.log_quantiles[1]: expected" in err


# -- 3. times too short to fit a model on ------------------------------------------------------

def test_calibrate_refuses_subnormal_times_naming_the_file_and_row(tmp_path: Path,
                                                                    capsys) -> None:
    src = tmp_path / "M.csv"
    src.write_text(rows(["1e-320"] * 8))
    out = tmp_path / "o.yaml"
    assert run_cli(["perf", "calibrate", "snapdragon888", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{src}: 2 problem(s)" in err and "line 2: column 'time': " in err, err
    assert "7 more row(s) below 1e-09 s: line(s) 3, 4, 5, 6, 7, 8, 9" in err, err
    assert not out.exists()


@pytest.mark.parametrize("command", ["fit", "eval", "eval-sets", "calibrate"])
def test_a_zero_time_is_refused_naming_the_file_and_first_bad_row(tmp_path: Path, capsys,
                                                                  command: str) -> None:
    src = tmp_path / "zero.csv"
    src.write_text(rows(["0.001", "0.002", "0.004", "0", "0.01", "0.003", "0", "0.005"]))
    out = tmp_path / "out.yaml"
    argv = {"fit": ["perf", "fit", str(src), "--out", str(out), "--model", "rate"],
            "eval": ["perf", "eval", str(src)],
            "eval-sets": ["perf", "eval", str(src), "--leave-one-set-out"],
            "calibrate": ["perf", "calibrate", "snapdragon888", str(src), "--out", str(out)]}
    assert run_cli(argv[command]) == 2
    err = capsys.readouterr().err
    assert f"{src}: 2 problem(s)" in err, err
    assert "line 5: column 'time': 0 s per GEMM is below 1e-09 s" in err, err
    assert "1 more row(s) below 1e-09 s: line(s) 8" in err, err
    assert not out.exists()


def test_calibrate_refuses_times_that_imply_an_impossible_peak(tmp_path: Path, capsys) -> None:
    src = tmp_path / "fast.csv"  # above the floor, but 1024^3 in 2 ns is 1e18 FLOP/s
    src.write_text(rows(["2e-9"] * 8, sizes=(640, 1280, 2560, 5120, 10240, 960, 1920, 3840)))
    out = tmp_path / "fast.yaml"
    assert run_cli(["perf", "calibrate", "snapdragon888", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{src}: " in err and "would be refused: model.peak_flops: expected FLOP/s" in err
    assert not out.exists()


def test_a_dimension_beyond_blas_integers_is_refused(tmp_path: Path, capsys) -> None:
    src = tmp_path / "big.csv"
    src.write_text(HEADER + "d,b,float32,1,gemm,99999999999,1,1,1,s,fuzz\n")
    assert run_cli(["perf", "eval", str(src)]) == 2
    assert f"{src}: 1 problem(s):\n  - line 2: column 'm': expected an integer <= 2147483647" \
        in capsys.readouterr().err


# -- 4. predict never asserts on a profile that loads ------------------------------------------

def test_predict_refuses_a_tiny_peak(tmp_path: Path, capsys) -> None:
    bad = write_profile(tmp_path / "p.yaml", "snapdragon888", _set("model", "peak_flops", 1e-300))
    big = str(MAX_DIMENSION)
    assert run_cli(["perf", "predict", str(bad), big, big, big]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: 1 problem(s)" in err and "model.peak_flops: expected FLOP/s in [1e+06" in err


def _slowest_cost(raw: dict[str, Any]) -> None:
    raw["sustained_gflops"], raw["tile_overhead_s"] = 1e-3, 1.0
    raw["model"].update(coef=[1.0] * len(raw["model"]["coef"]), peak_flops=1e6,
                        blas={"unroll_n": 1, "unroll_m": 1, "k_block": 1, "small_mnk": 1e18,
                              "cache_bytes": 1024})


def _slowest_rate(raw: dict[str, Any]) -> None:
    raw["model"].update(coef=[65536.0] * 3, peak_flops=1e6, overhead_s=1.0)
    raw["thermal"].update(min_speed=0.01)


def _steepest_log_linear(raw: dict[str, Any]) -> None:
    raw["model"].update(form="log-linear", features=["log2_flops"], coef=[9.0], intercept=10.0)


@pytest.mark.parametrize("name, edit", [("host", _slowest_cost), ("snapdragon888", _slowest_rate),
                                        ("snapdragon888", _steepest_log_linear)])
def test_predict_is_finite_at_the_edges_of_the_ranges(tmp_path: Path, capsys, name: str,
                                                      edit: Callable[[dict[str, Any]], None]
                                                      ) -> None:
    edge = write_profile(tmp_path / "edge.yaml", name, edit)
    big = str(MAX_DIMENSION)
    for shape in (["1", "1", "1"], [big, big, big], ["1", big, "1"]):
        assert run_cli(["perf", "predict", str(edge), *shape]) == 0
        seconds = float(capsys.readouterr().out.splitlines()[-1].split(",")[-1])
        assert math.isfinite(seconds) and seconds > 0


def test_a_log_linear_model_that_could_overflow_is_refused(tmp_path: Path) -> None:
    def steep(raw: dict[str, Any]) -> None:
        _steepest_log_linear(raw)
        raw["model"]["coef"] = [100.0]  # within +-100 alone, but e^(100 * 61) overflows
    bad = write_profile(tmp_path / "steep.yaml", "snapdragon888", steep)
    with pytest.raises(ProfileError) as info:
        load_profile(str(bad))
    assert str(bad) in str(info.value) and "model.coef: |intercept|" in str(info.value)


# -- 5. an import with nothing to import -------------------------------------------------------

def test_vfpbench_import_of_a_directory_without_logs_exits_2(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "logs"
    empty.mkdir()
    (empty / "notes.md").write_text("not a log\n")
    out = tmp_path / "peaks.csv"
    assert run_cli(["perf", "import", "vfpbench", str(empty), "--out", str(out)]) == 2
    assert f"{empty}: 1 problem(s):\n  - no *.txt files in {empty}" in capsys.readouterr().err
    assert not out.exists()


# -- 6. a calibrated profile's name ------------------------------------------------------------

def test_calibrate_refuses_a_name_a_profile_cannot_have(tmp_path: Path, capsys) -> None:
    src = tmp_path / "m.csv"
    src.write_text(rows(["1e-4", "4e-4", "2e-3", "1e-2", "6e-2", "2e-4", "1e-3", "5e-3"]))
    out = tmp_path / "mine.yaml"
    argv = ["perf", "calibrate", "snapdragon888", str(src), "--out", str(out)]
    assert run_cli([*argv, "--name", "Bad Name!"]) == 2
    assert "--name: 1 problem(s):\n  - 'Bad Name!' is not a valid profile name" \
        in capsys.readouterr().err
    assert not out.exists()
    stem = tmp_path / "Bad_Name.yaml"  # no --name: the --out file's stem is the name
    assert run_cli(argv[:-1] + [str(stem)]) == 2
    assert f"--out {stem}: 1 problem(s):\n  - its stem 'Bad_Name' is not a valid profile" \
        in capsys.readouterr().err
    assert not stem.exists()
    assert run_cli([*argv, "--name", "my-phone"]) == 0
    assert load_profile(str(out)).name == "my-phone"


def test_a_profile_file_with_a_bad_name_is_refused(tmp_path: Path) -> None:
    bad = write_profile(tmp_path / "p.yaml", "snapdragon888", _set(None, "name", "Bad Name!"))
    with pytest.raises(ProfileError) as info:
        load_profile(str(bad))
    assert str(bad) in str(info.value) and "name: 'Bad Name!' is not a valid profile name" \
        in str(info.value)
