"""The overhead-plus-rate family: monotone, capped, calibrated from a few shapes; predict and
calibrate on the command line with their bad inputs; the profile file schema."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from testbed.cli import main as run_cli
from testbed.emulator.device_model import device_model_for
from testbed.perf_model.estimators import OverheadRateRegressor, _export_rate, calibrate
from testbed.perf_model.features import RATE_FEATURES, ExportedTimeModel, rate_flops
from testbed.perf_model.measurements import Measurement, write_measurements
from testbed.perf_model.profiles import ProfileError, list_profiles, load_profile

REPO = Path(__file__).resolve().parents[2]
GRID = np.array([(m, k, n) for m in (1, 8, 32, 128, 512, 2048) for k in (16, 64, 256, 1024, 4096)
                 for n in (1, 8, 32, 128, 512, 2048)], dtype=np.float64)


def synthetic_device(peak_flops: float, overhead_s: float, halves=(4.0, 16.0, 8.0)):
    return ExportedTimeModel(features=RATE_FEATURES, coef=halves, intercept=0.0,
                             overhead_s=overhead_s, peak_flops=peak_flops,
                             bandwidth_bytes_s=1e10, form="rate")


def rows_of(model: ExportedTimeModel, shapes, device="phone-x", noise=None):
    rng = np.random.default_rng(0)
    out = []
    for m, k, n in shapes:
        jitter = 1.0 if noise is None else float(np.exp(rng.normal(0, noise)))
        t = model.predict_one(m, k, n) * jitter
        out.append(Measurement(device=device, backend="numpy", dtype="float32", threads=4,
                               op="gemm", m=int(m), k=int(k), n=int(n), seconds=t,
                               provenance="synthetic"))
    return out


@pytest.mark.parametrize("name", [n for n in list_profiles() if n != "host"])
def test_shipped_rate_is_monotone_in_every_dimension_and_capped(name: str) -> None:
    model = load_profile(name).model
    assert model is not None and model.form == "rate"
    t = model.predict_seconds(GRID)
    rate = 2.0 * GRID.prod(axis=1) / (t - model.overhead_s)
    assert np.all(rate <= model.peak_flops * (1 + 1e-12))
    cube = rate.reshape(6, 5, 6)
    for axis in range(3):
        assert np.all(np.diff(cube, axis=axis) >= -1e-9 * model.peak_flops), (name, axis)


def test_fitted_rate_is_monotone_and_capped_by_the_given_peak() -> None:
    truth = synthetic_device(40e9, 2e-5)
    shapes = GRID[::7]
    X = shapes
    y = truth.predict_seconds(X) * np.exp(np.random.default_rng(1).normal(0, 0.05, len(X)))
    fitted = OverheadRateRegressor(peak_flops=35e9).fit(X, y)
    assert fitted.peak_flops_ <= 35e9 * (1 + 1e-9)
    rate = rate_flops(GRID, fitted.peak_flops_, fitted.halves_).reshape(6, 5, 6)
    for axis in range(3):
        assert np.all(np.diff(rate, axis=axis) >= 0)


def test_calibrate_on_five_shapes_recovers_level_and_overhead_within_5_percent() -> None:
    base = synthetic_device(100e9, 1e-5)  # the family: same curve, another level
    truth = synthetic_device(23e9, 4e-4)
    shapes = np.array([(16, 64, 16), (32, 256, 32), (64, 512, 64), (128, 1024, 128),
                       (256, 2048, 256)], dtype=np.float64)
    y = truth.predict_seconds(shapes) * np.array([1.01, 0.99, 1.02, 0.985, 1.0])  # 1-2% jitter
    fitted = calibrate(base, shapes, y)
    assert fitted.peak_flops_ == pytest.approx(23e9, rel=0.05)
    assert fitted.overhead_s_ == pytest.approx(4e-4, rel=0.05)


def test_perf_predict_matches_the_emulated_agents_tile_time(capsys) -> None:
    profile = load_profile("snapdragon888")
    device = device_model_for(profile, seed=3, noise=False)  # what the agent builds, noise off
    expected = device.tile_cost(96, 768, 160, "forward", 0.0).seconds  # cold: no throttling
    assert run_cli(["perf", "predict", "snapdragon888", "96", "768", "160"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "m,k,n,seconds"
    m, k, n, seconds = lines[1].split(",")
    assert (m, k, n) == ("96", "768", "160")
    assert float(seconds) == pytest.approx(expected, rel=1e-5)


def test_perf_predict_shapes_file(tmp_path: Path, capsys) -> None:
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("m,k,n\n8,16,32\n128,1024,128\n")
    assert run_cli(["perf", "predict", "m2pro", "--shapes", str(shapes)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 3 and out[2].startswith("128,1024,128,")


@pytest.mark.parametrize("argv, content, needle", [
    (["perf", "predict", "no-such-profile", "1", "2", "3"], None, "no device profile named"),
    # a directory where a profile file was meant: said, not only "no device profile named"
    (["perf", "predict", "{d}", "1", "2", "3"], None, "is a directory; expected a file"),
    (["perf", "predict", "snapdragon888", "0", "2", "3"], None, "- M: expected a positive"),
    (["perf", "predict", "snapdragon888", "4", "-2", "3"], None, "- K: expected a positive"),
    # several shapes on the command line: one shape there, several in a --shapes file
    (["perf", "predict", "m2pro", "8192", "96", "384", "512", "512", "512"], None,
     "expected one shape, M K N (three positive integers), or --shapes FILE.csv for several; "
     "got 6 value(s)"),
    (["perf", "predict", "snapdragon888", "--shapes", "{f}"], "m,k\n1,2\n", "line 1 (header)"),
    (["perf", "predict", "snapdragon888", "--shapes", "{f}"], "m,k,n\n1,2,3\n4,0,6\n",
     "line 3: column 'k': expected a positive integer up to 1048576, got 0"),
    (["perf", "predict", "snapdragon888", "--shapes", "{f}"], "m,k,n\n1,2," + "9" * 200_000,
     "line 2"),
])
def test_perf_predict_rejects_bad_input_with_exit_2(tmp_path, capsys, argv, content, needle):
    f = tmp_path / "in.csv"
    if content is not None:
        f.write_text(content)
    assert run_cli([a.replace("{f}", str(f)).replace("{d}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_perf_predict_help_shows_the_one_shape_it_accepts(capsys) -> None:
    # argparse's own usage said [M K N ...], which promised several shapes
    assert run_cli(["perf", "predict", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: testbed perf predict [-h] profile (M K N | --shapes FILE.csv)" in out, out
    assert "..." not in out


def test_perf_calibrate_writes_a_profile_that_predicts_the_device(tmp_path, capsys) -> None:
    truth = synthetic_device(31e9, 3e-4, halves=tuple(load_profile("snapdragon888").model.coef))
    shapes = [(16, 128, 16), (64, 512, 64), (128, 1024, 128), (256, 1024, 256), (512, 2048, 64)]
    csv_path = tmp_path / "phone.csv"
    write_measurements(csv_path, rows_of(truth, shapes))
    out = tmp_path / "phone.yaml"
    assert run_cli(["perf", "calibrate", "snapdragon888", str(csv_path), "--out",
                         str(out)]) == 0
    assert "leave-one-out over 5 shapes" in capsys.readouterr().out
    profile = load_profile(str(out))
    assert profile.model.peak_flops == pytest.approx(31e9, rel=0.01)
    assert profile.thermal == load_profile("snapdragon888").thermal
    assert profile.evaluation["calibration"]["leave_one_out"]["within_10"] == 100.0
    predicted = profile.model.predict_one(200, 700, 300)
    assert predicted == pytest.approx(truth.predict_one(200, 700, 300), rel=0.01)
    # the per-tile noise is the base's call-to-call spread, not the five shapes' misfit
    base = load_profile("snapdragon888").model
    assert profile.model.noise_levels == pytest.approx(base.noise_levels)
    assert profile.model.noise_log_quantiles == pytest.approx(base.noise_log_quantiles)


@pytest.mark.parametrize("content, needle", [
    ("m,k,n\n1,2,3\n", "missing column(s) device"),
    (None, "line 2: column 'm': expected an integer >= 1"),
    (None, "calibration needs at least 3"),
])
def test_perf_calibrate_rejects_bad_input_with_exit_2(tmp_path, capsys, content, needle):
    csv_path = tmp_path / "m.csv"
    if content is not None:
        csv_path.write_text(content)
    elif "integer" in needle:
        write_measurements(csv_path, rows_of(synthetic_device(1e10, 0.0), [(4, 4, 4)] * 3))
        text = csv_path.read_text().splitlines()
        text[1] = text[1].replace(",gemm,4,", ",gemm,-4,")
        csv_path.write_text("\n".join(text) + "\n")
    else:
        write_measurements(csv_path, rows_of(synthetic_device(1e10, 0.0), [(4, 4, 4), (8, 8, 8)]))
    out = tmp_path / "p.yaml"
    assert run_cli(["perf", "calibrate", "snapdragon888", str(csv_path), "--out",
                         str(out)]) == 2
    assert needle in capsys.readouterr().err
    assert not out.exists(), "nothing half-written"
    assert run_cli(["perf", "calibrate", "nope", str(csv_path), "--out", str(out)]) == 2


@pytest.mark.parametrize("agent_loaded_first", [False, True])
def test_profile_schema_lists_every_problem_with_its_path(tmp_path: Path,
                                                          agent_loaded_first: bool) -> None:
    if agent_loaded_first:
        # other tests import the agent module; loading must not depend on that (it once did)
        import testbed.agent.agent  # noqa: F401
    raw = yaml.safe_load((REPO / "testbed/perf_model/profiles/snapdragon888.yaml").read_text())
    raw["sustained_gflops"] = -1
    raw["model"]["coef"] = [1.0, -2.0, 3.0]
    raw["power"]["idle_w"] = "lots"
    raw["bogus"] = 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ProfileError) as info:
        load_profile(str(bad))
    text = "\n".join(info.value.problems)
    for path in ("sustained_gflops:", "model.coef:", "power.idle_w:", "bogus: unknown key"):
        assert path in text, text


def test_energy_and_profiles_import_each_way_without_a_circle() -> None:
    for first in ("testbed.emulator.energy", "testbed.perf_model.profiles",
                  "testbed.emulator.thermal"):
        subprocess.run([sys.executable, "-c", f"import {first}"], check=True, cwd=REPO)


def test_agent_process_reads_profiles_without_pydantic() -> None:
    # the agent's own entry point, stopped where it would start serving
    code = ("import sys, testbed.agent.__main__ as agent_main\n"
            "class Made(Exception):\n"
            "    pass\n"
            "def stop(options, model):\n"
            "    assert model.tile_cost(64, 64, 64, 'forward', 0.0).seconds > 0\n"
            "    raise Made\n"
            "agent_main.Agent = stop\n"
            "try:\n"
            "    agent_main.main(['--ps', '127.0.0.1:1', '--name', 'p-0', '--kind', 'emulated',\n"
            "                     '--profile', 'snapdragon888'])\n"
            "    raise SystemExit('the agent did not build its device model')\n"
            "except Made:\n"
            "    pass\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('pydantic', 'sklearn')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_calibrate_keeps_the_constant_rate_when_the_base_curve_is_wrong_for_the_device() -> None:
    # the base curve says small m is slow; this device (like MNN's 4-thread fp16 rows) is flat
    base = _export_rate((64.0, 0.0, 0.0), 0.0, 1.0, np.zeros(0))
    shapes = np.array([(8, 2560, 1024), (32, 2560, 4096), (128, 4096, 2560),
                       (512, 2560, 1024), (16, 1024, 1024)], dtype=np.float64)
    flat = 2.0 * shapes.prod(axis=1) / 300e9 * np.array([1.02, 0.98, 1.01, 0.99, 1.0])
    chosen = calibrate(base, shapes, flat)
    assert chosen.halves_ == (0.0, 0.0, 0.0)
    assert chosen.selected_.startswith("constant rate")
    assert 2.0 * 128 * 1024 * 128 / chosen.predict(np.array([[128, 1024, 128]]))[0] == \
        pytest.approx(300e9, rel=0.05)
    # on data that follows the curve, the curve is kept
    curved = base.predict_seconds(shapes) / 300e9 * 1.0
    kept = calibrate(base, shapes, curved)
    assert kept.halves_ == (64.0, 0.0, 0.0) and kept.selected_ == "base curve"


@pytest.mark.parametrize("name", ["sd8gen5-mnn", "sd835-eigen", "snapdragon888"])
def test_perf_show_prints_the_phone_profiles_held_out_accuracy(name: str, capsys) -> None:
    assert run_cli(["perf", "show", name]) == 0
    out = capsys.readouterr().out
    section = out.split("accuracy on data it was not fitted on:")[1].split("provenance:")[0]
    assert "none measured" not in section
    profile = load_profile(name)
    assert {"precision", "library", "threads"} <= set(profile.raw["assumes"])
    if name == "snapdragon888":  # model level: the ViT rows, the SD888's own marked in-sample
        assert "ncnn Snapdragon 888 8 threads (big cores): measured 614.47 ms" in section
        assert "in_sample True" in section and "Snapdragon 855+ 4 threads" in section
    else:
        assert "leave-one-out over its own" in section and "±25%" in section


def test_perf_calibrate_takes_one_library_of_a_device_and_show_prints_its_held_out_figures(
        tmp_path: Path, capsys) -> None:
    truth = synthetic_device(31e9, 3e-4, halves=tuple(load_profile("snapdragon888").model.coef))
    shapes = [(16, 128, 16), (64, 512, 64), (128, 1024, 128), (256, 1024, 256), (512, 2048, 64)]
    slow = synthetic_device(9e9, 3e-4, halves=tuple(load_profile("snapdragon888").model.coef))
    rows = rows_of(truth, shapes) + [
        Measurement(**{**r.__dict__, "backend": "other-lib"}) for r in rows_of(slow, shapes)]
    csv_path = tmp_path / "two_libs.csv"
    write_measurements(csv_path, rows)
    out = tmp_path / "mine.yaml"
    # two libraries of one device: a level across both would fit neither; refused, nothing written
    assert run_cli(["perf", "calibrate", "snapdragon888", str(csv_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "rows of 2 (backend, dtype, threads) sets of phone-x" in err and "--backend" in err
    assert not out.exists()
    assert run_cli(["perf", "calibrate", "snapdragon888", str(csv_path), "--out", str(out),
                    "--backend", "nope"]) == 2
    assert "no rows of backend 'nope'; the file has numpy, other-lib" in capsys.readouterr().err
    assert run_cli(["perf", "calibrate", "snapdragon888", str(csv_path), "--out", str(out),
                    "--backend", "numpy"]) == 0
    capsys.readouterr()
    profile = load_profile(str(out))
    assert profile.name == "mine"  # the --out file's stem, as --help says
    assert profile.model.peak_flops == pytest.approx(31e9, rel=0.01)
    assert run_cli(["perf", "show", str(out)]) == 0
    section = capsys.readouterr().out.split("accuracy on data it was not fitted on:")[1]
    section = section.split("provenance:")[0]
    assert "leave-one-out over the 5 calibration shapes" in section and "±25% 100.0%" in section


def test_perf_eval_leave_one_set_out_prints_every_set_and_the_model_level_check(
        tmp_path: Path, capsys) -> None:
    sets_csv = REPO / "tests" / "data" / "perf_sets.csv"
    assert run_cli(["perf", "eval", str(sets_csv), "--leave-one-set-out"]) == 0
    out = capsys.readouterr().out
    blocks = out.split("held out: ")[1:]
    assert len(blocks) == 9  # MNN, 3 x M1, 3 x M1 Max, SD835, host
    for block in blocks:
        names = [line.split()[0] for line in block.splitlines()[2:6]]
        assert names == ["calibrated-5", "curve-5", "constant-5", "roofline-5"], block
    ruy = next(b for b in blocks if b.startswith("Apple M1 Max/mmperf-ruy"))
    within_25 = float(ruy.splitlines()[2].split()[3])
    assert within_25 >= 80.0, ruy  # where the data are smooth, 5 shapes are enough
    # the model-level check says what the data hold for the SD888 and what stands in for it
    assert "model level, profile snapdragon888" in out
    assert "no SD888 row at 1 or 4 threads" in out
    assert "ncnn Snapdragon 888 8 threads (big cores)" in out and "in-sample" in out
    # a file with a single per-shape set cannot be left out against anything: exit 2
    one = tmp_path / "one.csv"
    lines = sets_csv.read_text().splitlines()
    one.write_text("\n".join([lines[5]] + [x for x in lines if x.startswith("Apple M1,mmperf-ruy")])
                   + "\n")
    assert run_cli(["perf", "eval", str(one), "--leave-one-set-out"]) == 2
    assert "needs at least two per-shape float sets" in capsys.readouterr().err


@pytest.mark.parametrize("name", list_profiles())
def test_every_shipped_profile_shows_accuracy_on_data_it_was_not_fitted_on(name: str,
                                                                            capsys) -> None:
    assert run_cli(["perf", "show", name]) == 0
    section = capsys.readouterr().out.split("accuracy on data it was not fitted on:")[1]
    section = section.split("provenance:")[0]
    assert "none measured" not in section
    assert ("±25%" in section) or ("measured" in section and "ms" in section), section


def test_a_profile_calibrated_on_the_host_says_its_noise_is_the_fit_error_across_shapes(
        tmp_path, capsys) -> None:
    # the host's noise is its fit's out-of-fold residuals; a calibrated copy called it a
    # "per-call spread" (calibrate's default label) and perf show then said it was one
    # shape's call-to-call spread, not the model's error across shapes
    csv_path = tmp_path / "m.csv"
    write_measurements(csv_path, rows_of(synthetic_device(31e9, 3e-4), [
        (16, 128, 16), (64, 512, 64), (128, 1024, 128), (256, 1024, 256)]))
    out = tmp_path / "h.yaml"
    assert run_cli(["perf", "calibrate", "host", str(csv_path), "--out", str(out)]) == 0
    noise = load_profile(str(out)).provenance["noise"]
    assert noise.startswith("the base profile host's: the fit's own error across shapes")
    capsys.readouterr()
    assert run_cli(["perf", "show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "call-to-call spread (provenance: noise)" not in shown, shown
    assert "what it is: provenance, noise" in shown
