"""report.md and report.png say what each figure is, in its unit, and nothing the run does not
know: a running run is not "failed", an unknown time is not 0.0, a simulated run's time is not
wall time."""

from __future__ import annotations

from pathlib import Path

from testbed.report import _load, draw, fidelity_line, markdown
from testbed.run_lock import RunLock
from testbed.runlog import RunLog, write_json_atomic
from testbed.summary import ps_summary_or_steps


def _steps(run_dir: Path, n: int, **fields: object) -> None:
    log = RunLog(run_dir)
    for step in range(n):
        log.step(step=step, loss=5.0 - step, wall_s=2.8, device_time_s=1.2, bytes_down=4.5e7,
                 bytes_up=1.1e7, tiles=452, **fields)
    log.close()


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


def test_a_run_that_is_still_running_is_not_called_failed(tmp_path: Path) -> None:
    """`testbed report` on campus during its first step: "state: failed (exit code ?)",
    "wall time 0.0 s, time dilation 1.00" (it ran at 12.30) and "network: ? (rate: ?...)"."""
    _steps(tmp_path, 0)
    write_json_atomic(tmp_path / "up.json", {"steps": 1, "dilation": 12.3039})
    write_json_atomic(tmp_path / "network.json", {"backend": "mininet", "rate": "htb",
                                                  "delay": "application", "loss": "application"})
    lock = RunLock(tmp_path)  # as `testbed up` holds it while it runs
    try:
        text = markdown(tmp_path).read_text()
        title = draw(tmp_path)._suptitle.get_text()
    finally:
        lock.release()
    assert _line(text, "- state: ").startswith("- state: running")
    assert "failed" not in text and "exit code ?" not in text
    assert "running, 0 steps so far" in title
    time_line = _line(text, "- wall time")
    assert "0.0 s" not in time_line and "not recorded" in time_line
    assert "time dilation D 12.30" in time_line and "1.00" not in time_line
    assert "- network: mininet (rate: htb, delay: application" in text
    assert "- emulation fidelity: unknown (no step finished)" in text  # not "no tiles"
    # once nothing holds it, a run without a summary is one that died: failed
    assert _line(markdown(tmp_path).read_text(), "- state: ") == "- state: failed"


def test_a_failed_runs_summary_counts_its_steps_device_time(tmp_path: Path) -> None:
    _steps(tmp_path, 3)
    summary = ps_summary_or_steps(tmp_path)
    assert abs(summary["device_time_s"] - 3.6) < 1e-9 and summary["state"] == "failed"
    text = markdown(tmp_path).read_text()
    assert "its steps' device time 3.60 s" in _line(text, "- wall time")
    # three steps, no PS summary: the per-step figures are there, the run-wide ones are not
    assert "- emulation fidelity: unknown (the PS wrote no run-wide figures, " \
        "ps_summary.json; steps.jsonl has each step's" in text, text


def test_a_simulated_runs_time_is_device_time_not_wall_time(tmp_path: Path) -> None:
    """simulate printed "2.318 s device time" and report.md "wall time 2.3 s, time dilation
    1.00" for the same figure, and nowhere that the run was simulated."""
    _steps(tmp_path, 2)
    write_json_atomic(tmp_path / "summary.json", {
        "state": "done", "exit_code": 0, "simulated": True, "steps_done": 2, "steps": 2,
        "wall_s": 2.317927, "sim_wall_s": 3.33, "device_time_s": 2.317927,
        "time_dilation": 1.0, "devices": []})
    text = markdown(tmp_path).read_text()
    assert "- simulated device time 2.3 s (simulating took 3.3 s of wall time" in text
    assert "wall time 2.3" not in text and "time dilation 1.00" not in text
    assert "final loss: none (a simulation computes no tensors)" in text


def test_an_emulated_runs_times_say_what_they_cover(tmp_path: Path) -> None:
    """"wall time 7.5 s" beside steps of 2.8 s and 2.5 s: of what? And no device time."""
    _steps(tmp_path, 2)
    write_json_atomic(tmp_path / "summary.json", {
        "state": "done", "exit_code": 0, "steps_done": 2, "steps": 2, "wall_s": 7.507,
        "device_time_s": 2.288589, "time_dilation": 2.309466, "dilation_min": 2.3095,
        "dilation_max": 2.3095, "final_loss": 4.8448, "devices": []})
    text = markdown(tmp_path).read_text()
    assert _line(text, "- wall time") == (
        "- wall time 7.5 s (the PS's: from waiting for its devices to its end); its steps' "
        "device time 2.29 s (their wall time / D); time dilation D 2.31")
    assert "final loss 4.8448 (cross-entropy, nats)" in text
    assert "2.3095" not in text  # one D, said once, as the plot's title says it


def test_an_adaptive_runs_dilation_is_its_range() -> None:
    from testbed.report import dilation_text

    assert dilation_text({"dilation_min": 2.3095, "dilation_max": 4.8, "time_dilation": 4.8}) \
        == "2.31-4.80"
    assert dilation_text({"time_dilation": 1.97}) == "1.97" and dilation_text({}) is None


def test_the_fidelity_verdict_sits_beside_the_figure_it_judges() -> None:
    """"(target 10%: met): tile-time error p50 0.0%, p95 136.9%" read as a p95 of 137 %
    meeting a 10 % target; the verdict judges the lateness share."""
    line = fidelity_line({"tile_error_p50": 0.0, "tile_error_p95": 1.369, "lag_p95_s": 1.2e-4,
                          "dilation_target_p95": 0.1, "lateness_share_max": 0.012,
                          "fidelity_ok": True})
    assert line.startswith("- emulation fidelity (target: the lateness at most 10%: met): "
                           "late devices can account for up to 1.2% of a step's device time")
    assert "p95 result lag (wall-clock time a result came after its model's time) 0.1 ms" in line
    without_share = fidelity_line({"tile_error_p95": 0.05, "dilation_target_p95": 0.1,
                                   "fidelity_ok": True})
    assert "(target: the p95 tile-time error at most 10%: met)" in without_share


def test_an_interrupted_run_says_which_figures_count_the_step_it_stopped_in(
        tmp_path: Path) -> None:
    """"steps: 1 of 4 ... tiles: 680" with 452 tiles a step, and no word why."""
    _steps(tmp_path, 1)
    write_json_atomic(tmp_path / "summary.json", {
        "state": "interrupted", "exit_code": 130, "interrupted_by": ["SIGINT"],
        "steps_done": 1, "steps": 4, "tiles": 680, "wall_s": 7.1, "devices": []})
    text = markdown(tmp_path).read_text()
    assert "- state: interrupted (exit code 130, by SIGINT)" in text
    assert "- tiles, payload, wall time and energy count the work of the step under way" in text
    done = tmp_path / "done"
    done.mkdir()
    _steps(done, 1)
    write_json_atomic(done / "summary.json", {"state": "done", "exit_code": 0, "steps_done": 1})
    assert "step under way" not in markdown(done).read_text()


def test_the_sat_out_reasons_are_all_explained(tmp_path: Path) -> None:
    """campus: "lab-laptops: link (6 of 8)", and the page explained only `in N of M ... GEMMs`."""
    _steps(tmp_path, 1, sat_out={"lab-laptops": "link (6 of 8)", "phones": "PS link"})
    text = markdown(tmp_path).read_text()
    assert "- lab-laptops: link (6 of 8)" in text
    assert "`(N of M)`: N of the group's M devices sat out" in text
    assert "`PS link`:" in text


def test_a_one_step_runs_tile_error_is_drawn(tmp_path: Path) -> None:
    """The p95 tile error was a dashed line without markers: one step drew nothing."""
    _steps(tmp_path, 1, tile_error_p95=1.27)
    fig = draw(tmp_path)
    [err_line] = [line for ax in fig.axes for line in ax.get_lines()
                  if line.get_label() == "p95 tile error %"]
    assert err_line.get_marker() not in (None, "None", "")
    assert abs(err_line.get_ydata()[0] - 127.0) < 1e-6
    assert fig._suptitle.get_text().endswith(", 1 step")


def test_load_of_a_run_with_summary_json_is_untouched_by_the_lock(tmp_path: Path) -> None:
    """`testbed up` draws its report while it holds the lock: the summary's state stands."""
    _steps(tmp_path, 1)
    write_json_atomic(tmp_path / "summary.json", {"state": "done", "exit_code": 0,
                                                  "steps_done": 1})
    lock = RunLock(tmp_path)
    try:
        assert _load(tmp_path)[2]["state"] == "done"
    finally:
        lock.release()


def test_a_resumed_runs_report_gives_the_whole_runs_totals_beside_the_last_sessions(
        tmp_path: Path) -> None:
    """tiny at 40 steps of 70 tiles, killed after 12 and resumed: "steps: 40 of 40" above
    "tiles: 1905" (the last session's, as summary.json keeps them) and nothing of why."""
    _steps(tmp_path, 4)
    write_json_atomic(tmp_path / "summary.json", {
        "state": "done", "exit_code": 0, "steps_done": 4, "steps": 4, "tiles": 904,
        "bytes_down": 9e7, "bytes_up": 2.2e7, "resumes": 1, "wall_s": 6.0,
        "device_time_s": 2.4, "time_dilation": 1.0})
    text = markdown(tmp_path).read_text()
    assert _line(text, "- tiles: ").startswith("- tiles: 904,")
    assert _line(text, "- resumed ") == (
        "- resumed 1 time(s): the tiles, payload, times and energy above are the last "
        "session's; the run's 4 step(s) in steps.jsonl: 1808 tiles, down 180.0 MB, up 44.0 MB, "
        "device time 4.80 s")
    write_json_atomic(tmp_path / "summary.json", {"state": "done", "exit_code": 0,
                                                  "steps_done": 4, "tiles": 1808, "resumes": 0})
    assert "- resumed" not in markdown(tmp_path).read_text()  # a run never resumed: no line


def test_the_reports_churn_count_says_what_the_actions_were(tmp_path: Path) -> None:
    """A loopback run of tiny under a trace that crashed, slowed, cut off and brought back
    devices: its report said "churn: 6" and nothing of what they were."""
    _steps(tmp_path, 1)
    log = RunLog(tmp_path)
    for action in ("crash", "slow", "partition", "join", "heal", "slow"):
        log.event("churn", device="phones-0", action=action, effect="x")
    log.event("join", device="phones-0")
    log.close()
    text = markdown(tmp_path).read_text()
    assert "\n- churn: 6 (crash 1, heal 1, join 1, partition 1, slow 2)\n" in text, text
    assert "\n- join: 1\n" in text
