"""`testbed report` refuses a damaged run file with exit 2, naming the file, the line and the
field, and writes neither report file (cases a fuzz pass found: each once ended in a traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.runlog import RunLog, write_json_atomic

HUGE = "1" + "0" * 400  # an integer of 401 digits: finite as JSON, past a float's range
TOO_LONG = "1" + "0" * 5000  # past Python's 4300-digit limit on converting an int
DEEP = "[" * 100_000 + "]" * 100_000


def _run_files(run_dir: Path) -> None:
    log = RunLog(run_dir)
    for step in range(3):
        log.step(step=step, loss=5.0 - step, wall_s=1.0, device_time_s=0.5, bytes_down=2e6,
                 bytes_up=1e6, tiles=10, tile_error_p95=0.05)
    log.event("join", device="phones-0")
    log.close()
    write_json_atomic(run_dir / "summary.json", {
        "state": "done", "steps_done": 3, "wall_s": 3.0,
        "devices": [{"device": "phones-0", "group": "phones", "tiles_done": 30}]})


def _replace_line(path: Path, number: int, text: str) -> None:
    lines = path.read_text().splitlines()
    lines[number - 1] = text
    path.write_text("\n".join(lines) + "\n")


def _refused(run_dir: Path, capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """Run the report; assert exit 2, every needle in the message, and no report file."""
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, (needle, err[:2000])
    assert "Traceback" not in err
    assert not (run_dir / "report.png").exists() and not (run_dir / "report.md").exists()
    return err


def test_an_undamaged_run_still_reports(tmp_path: Path) -> None:
    _run_files(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.png").stat().st_size > 10_000
    assert "# Run" in (tmp_path / "report.md").read_text()


def test_an_integer_past_a_float_in_a_step_is_named_with_its_digits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run_files(tmp_path)
    steps = tmp_path / "steps.jsonl"
    _replace_line(steps, 2, f'{{"step": 1, "wall_s": {HUGE}, "device_time_s": 0.5, '
                            f'"bytes_down": 1, "bytes_up": 1}}')
    _refused(tmp_path, capsys, f"{steps}: 1 problem(s)",
             "line 2: wall_s: expected a finite number, got an integer of 401 digits")


def test_an_integer_past_a_float_in_the_summary_is_named_with_its_digits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run_files(tmp_path)
    summary = tmp_path / "summary.json"
    summary.write_text(f'{{"state": "done", "wall_s": {HUGE}}}')
    _refused(tmp_path, capsys, f"{summary}: 1 problem(s)",
             "wall_s: expected a finite number, got an integer of 401 digits")


def test_an_integer_of_too_many_digits_to_convert_is_refused_not_skipped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The decoder refuses it before any field exists: the message names the file and the line.
    _run_files(tmp_path)
    steps = tmp_path / "steps.jsonl"
    _replace_line(steps, 2, f'{{"step": 1, "wall_s": {TOO_LONG}}}')
    _refused(tmp_path, capsys, f"{steps}: 1 problem(s)", "line 2: not valid JSON",
             "4300 digits")
    _run_files(tmp_path)
    summary = tmp_path / "summary.json"
    summary.write_text(f'{{"state": "done", "wall_s": {TOO_LONG}}}')
    _refused(tmp_path, capsys, f"{summary}: 1 problem(s)", "not valid JSON", "4300 digits")


def test_nesting_too_deep_is_refused_in_either_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run_files(tmp_path)
    steps = tmp_path / "steps.jsonl"
    _replace_line(steps, 3, DEEP)
    _refused(tmp_path, capsys, f"{steps}: 1 problem(s)",
             "line 3: not valid JSON: nested too deeply")
    _run_files(tmp_path)
    summary = tmp_path / "summary.json"
    summary.write_text(DEEP)
    _refused(tmp_path, capsys, f"{summary}: 1 problem(s)", "not valid JSON: nested too deeply")


@pytest.mark.parametrize(("device", "needle"), [
    ({"device": "a", "tiles_done": None}, "devices[0].tiles_done: expected a finite number, "
                                          "got null"),  # JSON's word, not Python's None
    ({"device": "a", "tiles_done": "7"}, "devices[0].tiles_done: expected a finite number, "
                                         "got '7'"),
    ({"device": "a", "tiles_done": 1e300}, "devices[0].tiles_done: expected a number of "
                                           "magnitude at most 1e+15"),
    ({"device": ["a"], "tiles_done": 1}, "devices[0]: expected an object with a device name"),
    ({"device": "a", "group": {"g": 1}}, "devices[0].group: expected a string, got {'g': 1}"),
])
def test_every_field_of_a_device_record_is_checked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], device: dict[str, object],
        needle: str) -> None:
    _run_files(tmp_path)
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"state": "done", "devices": [device]}))
    _refused(tmp_path, capsys, f"{summary}: 1 problem(s)", needle)


def test_an_event_that_cannot_be_counted_is_refused_before_report_png_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run_files(tmp_path)
    events = tmp_path / "events.jsonl"
    with events.open("a") as f:
        f.write('{"event": [1]}\n{"event": "leave", "device": {"name": "x"}}\n')
    _refused(tmp_path, capsys, f"{events}: 2 problem(s)",
             "line 2: event: expected a string, got [1]",
             "line 3: device: expected a string, got {'name': 'x'}")


def test_a_finite_value_too_large_to_plot_is_refused_with_its_bound(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run_files(tmp_path)
    steps = tmp_path / "steps.jsonl"
    record = json.loads(steps.read_text().splitlines()[0])
    _replace_line(steps, 1, json.dumps({**record, "tile_error_p95": 1e308}))
    _refused(tmp_path, capsys, f"{steps}: 1 problem(s)",
             "line 1: tile_error_p95: expected a number of magnitude at most 1e+06 "
             "(a fraction: 1 is 100%), got 1e+308")


def test_a_negative_count_bytes_or_factor_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A summary whose figures were negated printed "time dilation -1.00" (a hostile-input
    audit); seconds and fractions may be negative (a lag, a signed tile error)."""
    _run_files(tmp_path)
    steps = tmp_path / "steps.jsonl"
    record = json.loads(steps.read_text().splitlines()[0])
    _replace_line(steps, 1, json.dumps({**record, "bytes_down": -2e6}))
    _refused(tmp_path, capsys, "line 1: bytes_down: expected a number at least 0 (bytes")
    _replace_line(steps, 1, json.dumps(record))
    summary = tmp_path / "summary.json"
    write_json_atomic(summary, {**json.loads(summary.read_text()), "time_dilation": -1.0})
    _refused(tmp_path, capsys, "time_dilation: expected a number at least 0 (a factor), got -1.0")
    write_json_atomic(summary, {**json.loads(summary.read_text()), "time_dilation": 1.0,
                                "lag_p95_s": -0.5})  # a lag may be negative: still reports
    assert main(["report", str(tmp_path)]) == 0


def test_values_at_their_bounds_still_plot(tmp_path: Path) -> None:
    from testbed.report import BOUNDS, MAX_STEP

    log = RunLog(tmp_path)
    for step in (0, MAX_STEP):
        log.step(step=step, loss=BOUNDS["loss"][0], wall_s=BOUNDS["s"][0],
                 device_time_s=BOUNDS["s"][0], bound_s=BOUNDS["s"][0],
                 bytes_down=BOUNDS["bytes"][0], bytes_up=BOUNDS["bytes"][0],
                 time_dilation=BOUNDS["factor"][0] / (step + 1),
                 tile_error_p95=BOUNDS["fraction"][0])
    log.close()
    write_json_atomic(tmp_path / "summary.json", {
        "state": "done", "wall_s": BOUNDS["s"][0], "tile_error_p95": BOUNDS["fraction"][0],
        "tile_error_p50": BOUNDS["fraction"][0], "lag_p95_s": BOUNDS["s"][0],
        "lateness_share_max": BOUNDS["fraction"][0],
        "lateness_shares_worst": {"compute": BOUNDS["fraction"][0]},
        "devices": [{"device": "a", "tiles_done": BOUNDS["count"][0]}]})
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.png").exists() and (tmp_path / "report.md").exists()


@pytest.mark.parametrize("name", ["report.png", "report.md"])
def test_a_directory_in_place_of_a_report_file_is_refused_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    _run_files(tmp_path)
    (tmp_path / name).mkdir()
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: 1 problem(s)" in err and \
        f"{name}: is a directory; expected a file name" in err, err
    other = {"report.png", "report.md"} - {name}
    assert (tmp_path / name).is_dir() and not (tmp_path / other.pop()).exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".report")]


def test_a_step_line_missing_keys_says_missing_not_none(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a hand-edited line: "wall_s: expected a finite number, got None" for a key not there
    _run_files(tmp_path)
    steps = tmp_path / "steps.jsonl"
    _replace_line(steps, 2, '{"loss": 1.0, "wall_s": null, "device_time_s": 1.0, '
                            '"bytes_down": 1, "bytes_up": 1}')
    _replace_line(steps, 3, '{"step": null, "wall_s": 1.0, "bytes_down": 1, "bytes_up": 1}')
    err = _refused(tmp_path, capsys, f"{steps}: 4 problem(s)",
                   "line 2: step: missing (expected an integer from 0 to ",
                   "line 2: wall_s: expected a finite number, got null",
                   "line 3: step: expected an integer from 0 to 1,000,000,000,000, got null",
                   "line 3: device_time_s: missing (expected a finite number)")
    assert "None" not in err, err


def test_report_of_a_path_that_is_no_run_directory_says_what_it_is(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # each said "no steps.jsonl here; is this a run directory?": a path that does not exist, a
    # file (a topology given by mistake), and a comparison's directory, whose runs are inside
    cases = {tmp_path / "nope": "no such directory; expected a run directory",
             tmp_path / "t.yaml": "not a directory; expected a run directory"}
    (tmp_path / "t.yaml").write_text("name: t\n")
    compare = tmp_path / "20261201-053321-tiny-compare"
    for strategy in ("tile-tp", "pipeline"):
        (compare / strategy).mkdir(parents=True)
        _run_files(compare / strategy)
    cases[compare] = (f"no steps.jsonl here, but in pipeline, tile-tp inside it: run "
                      f"directories; report one of them, e.g. {compare / 'pipeline'}")
    baseline = tmp_path / "20261201-055056-tiny"  # `testbed up` of a pipeline on Mininet
    (baseline / "pipeline").mkdir(parents=True)
    (baseline / "summary.json").write_text('{"strategy": "pipeline", "state": "done"}')
    cases[baseline] = ("a pipeline run: report.md and report.png are tile-tp's only; its "
                       "summary.json and pipeline/ hold its figures (docs/baselines.md)")
    for path, said in cases.items():
        assert main(["report", str(path)]) == 2
        assert f"error: {path}: {said}" in capsys.readouterr().err
