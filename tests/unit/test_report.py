"""The run report is made from a run directory's files alone."""

from __future__ import annotations

from pathlib import Path

from testbed.cli import main
from testbed.runlog import RunLog, write_json_atomic


def test_report_from_run_files(tmp_path: Path) -> None:
    log = RunLog(tmp_path)
    for step, loss in enumerate([5.5, 5.0, 4.6]):
        log.step(step=step, loss=loss, wall_s=1.0, device_time_s=0.5, bytes_down=2e6,
                 bytes_up=1e6, tiles=10)
    log.event("join", device="phones-0")
    log.event("disconnect", device="phones-0", requeued_tiles=2)
    log.close()
    write_json_atomic(tmp_path / "summary.json", {
        "state": "done", "exit_code": 0, "steps_done": 3, "steps": 3, "final_loss": 4.6,
        "tiles": 30, "recomputed_tiles": 2, "requeued_tiles": 2, "bytes_down": 6e6,
        "bytes_up": 3e6, "wall_s": 3.0, "time_dilation": 2.0,
        "network": {"backend": "loopback", "rate": "application"},
        "devices": [{"device": "phones-0", "tiles_done": 12}, {"device": "phones-1",
                                                                "tiles_done": 18}]})
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.png").stat().st_size > 10_000
    text = (tmp_path / "report.md").read_text()
    for needle in ("final loss 4.6000", "recomputed 2", "disconnect: 1", "down 6.0 MB",
                   "loopback", "time dilation D 2.00"):
        assert needle in text, needle


def test_report_says_why_a_run_failed_and_what_its_devices_spent(tmp_path: Path) -> None:
    """summary.json had both, and report.md said only 'state: failed' and no energy."""
    log = RunLog(tmp_path)
    log.step(step=0, loss=None, wall_s=1.0, device_time_s=1.0, bytes_down=1, bytes_up=1)
    log.close()
    reason = "simulation stalled at t=5.000000 s:\n12 tiles outstanding, " + "x" * 2000
    write_json_atomic(tmp_path / "summary.json", {
        "state": "failed", "exit_code": 1, "error": reason, "steps_done": 1, "steps": 4,
        "wall_s": 5.0, "devices": [],
        "energy": {"total": {"total_j": 107.6, "compute_j": 4.4, "idle_j": 100.0,
                             "radio_j": 3.2, "carbon_g": 0.0142}}})
    assert main(["report", str(tmp_path)]) == 0
    lines = (tmp_path / "report.md").read_text().splitlines()
    [error] = [line for line in lines if line.startswith("- error: ")]
    assert error.startswith("- error: simulation stalled at t=5.000000 s: 12 tiles outstanding")
    assert len(error) <= len("- error: ") + 500 and error.endswith("...")
    assert "- device energy 107.6 J (compute 4.4 J, idle 100.0 J, radio 3.2 J), carbon 0.0142 " \
        "gCO2e" in lines
    # a damaged energy block costs only its line
    write_json_atomic(tmp_path / "summary.json", {"state": "done", "steps_done": 1,
                                                  "energy": {"total": {"total_j": "x"}}})
    assert main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "device energy" not in text and "- error" not in text


def test_report_refuses_a_non_run_directory(tmp_path: Path) -> None:
    assert main(["report", str(tmp_path)]) == 2


def test_fidelity_line_gives_the_verdict_and_what_late_tiles_can_account_for() -> None:
    from testbed.report import fidelity_line

    fields = {"tile_error_p50": 0.001, "tile_error_p95": 1.5, "lag_p95_s": 0.0004,
              "dilation_min": 3.4, "dilation_max": 3.4, "dilation_target_p95": 0.1}
    met = fidelity_line({**fields, "lateness_share_max": 0.012, "fidelity_ok": True})
    assert "(target: the lateness at most 10%: met)" in met and "p95 150.0%" in met
    assert "up to 1.2% of a step's device time" in met
    missed = fidelity_line({**fields, "lateness_share_max": 0.3, "fidelity_ok": False})
    assert "**MISSED**" in missed and "up to 30.0%" in missed
    assert fidelity_line({}) == "- emulation fidelity: no emulated tiles"


def test_tiles_panel_has_a_bar_per_device_up_to_a_readable_count_then_per_group() -> None:
    from testbed.report import DEVICE_BARS, TileBar, tile_bars

    few = [{"device": f"phones-{i}", "group": "phones", "tiles_done": i} for i in range(3)]
    assert tile_bars(few, {"phones-1"}) == ([TileBar("phones-0", 0, 0, 0, 0),
                                             TileBar("phones-1", 1, 1, 1, 1),
                                             TileBar("phones-2", 2, 2, 2, 0)], False)
    # in the devices' order: hotcarbon's 15 phones read phones-0, -1, -10, -11, ..., -2
    fifteen = [{"device": f"phones-{i}", "group": "phones", "tiles_done": i} for i in range(15)]
    assert [b.label for b in tile_bars(fifteen, set())[0]] == [d["device"] for d in fifteen]
    # large.yaml has 240 devices: one bar each would be unreadable, so groups with their range
    many = [{"device": f"phones-{i}", "group": "phones", "tiles_done": i}
            for i in range(DEVICE_BARS)]
    many += [{"device": f"laptops-{i}", "group": "laptops", "tiles_done": 50} for i in range(4)]
    many.append({"device": "adb-x1", "tiles_done": 9})  # a record without a group: its own
    bars, grouped = tile_bars(many, {"phones-3", "phones-7", "gone-0"})
    assert grouped and bars == [TileBar("adb-x1 (1)", 9, 9, 9, 0),
                                TileBar("laptops (4)", 50, 50, 50, 0),
                                TileBar(f"phones ({DEVICE_BARS})", (DEVICE_BARS - 1) / 2, 0,
                                        DEVICE_BARS - 1, 2)]


def test_report_of_a_simulated_run_keeps_its_step_count_and_plots_without_a_loss(
        tmp_path: Path) -> None:
    log = RunLog(tmp_path)
    log.step(step=0, loss=None, wall_s=2.0, device_time_s=2.0, bound_s=0.8, bytes_down=3e8,
             bytes_up=1e8, tiles=1644)
    log.close()
    write_json_atomic(tmp_path / "summary.json", {
        "state": "done", "exit_code": 0, "steps_done": 1, "steps": 1, "final_loss": None,
        "simulated": True, "wall_s": 2.0, "time_dilation": 1.0,
        "devices": [{"device": f"phones-{i}", "group": "phones", "tiles_done": i % 7}
                    for i in range(240)]})
    assert main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "- steps: 1 of 1; final loss: none" in text
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_report_of_an_adaptive_run_marks_where_d_changed(tmp_path: Path) -> None:
    log = RunLog(tmp_path)
    for step, d in enumerate([2.0, 2.0, 8.0, 8.0]):
        log.step(step=step, loss=5.0 - step / 10, wall_s=d * 0.5, device_time_s=0.5,
                 bound_s=0.4, bytes_down=2e6, bytes_up=1e6, tiles=10, time_dilation=d,
                 tile_error_p95=0.05)
    log.close()
    write_json_atomic(tmp_path / "summary.json", {"state": "done", "steps_done": 4,
                                                  "devices": [{"device": "phones-0"}]})
    import matplotlib.pyplot as plt

    from testbed.report import draw

    fig = draw(tmp_path)
    ax_time = fig.axes[1]
    plt.close(fig)
    assert ax_time.get_title() == "step time at time dilation D 2.00-8.00"
    assert [t.get_text() for t in ax_time.texts] == ["D 2.00", "D 8.00"]


def _run_files(run_dir: Path) -> None:
    log = RunLog(run_dir)
    for step in range(3):
        log.step(step=step, loss=5.0 - step, wall_s=1.0, device_time_s=0.5, bytes_down=2e6,
                 bytes_up=1e6, tiles=10)
    log.close()
    write_json_atomic(run_dir / "summary.json", {"state": "done", "steps_done": 3,
                                                 "devices": [{"device": "phones-0",
                                                              "tiles_done": 30}]})


def test_a_damaged_run_file_is_named_with_its_line_and_field(tmp_path: Path, capsys) -> None:
    _run_files(tmp_path)
    steps = tmp_path / "steps.jsonl"
    lines = steps.read_text().splitlines()
    lines[1] = lines[1].replace('"wall_s": 1.0', '"wall_s": "soon"')
    steps.write_text("\n".join(lines) + "\n")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{steps}: 1 problem(s)" in err and "line 2: wall_s: expected a finite number, " \
        "got 'soon'" in err, err
    assert not (tmp_path / "report.md").exists()

    lines[1] = "[1, 2]"
    steps.write_text("\n".join(lines) + "\n")
    (tmp_path / "summary.json").write_text('{"state": "done",\n "devices": 7}\n')
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err  # the summary is read first
    assert "summary.json: 1 problem(s)" in err and "devices: expected a list, got int" in err
    (tmp_path / "summary.json").write_text('{"state": "done",\n "wall_s": }\n')
    assert main(["report", str(tmp_path)]) == 2
    assert "line 2, column 12: not valid JSON" in capsys.readouterr().err


def test_a_torn_line_is_left_out_as_a_resumed_run_leaves_it(tmp_path: Path) -> None:
    _run_files(tmp_path)
    steps = tmp_path / "steps.jsonl"
    lines = steps.read_text().splitlines()
    lines[1] = lines[1][: len(lines[1]) // 2]  # killed mid-write, then resumed: appended after
    steps.write_text("\n".join(lines) + "\n")
    assert main(["report", str(tmp_path)]) == 0
    assert "steps: 3 of ?" in (tmp_path / "report.md").read_text()


def test_report_of_a_simulated_run_without_its_summary_says_it_was_simulated(
        tmp_path: Path) -> None:
    """A simulated run killed before its summary: its steps say they were simulated, so the
    page gives their virtual device time, not "wall time: not recorded ... D 1.00", and no
    emulation fidelity to look for in steps.jsonl."""
    log = RunLog(tmp_path)
    for step in range(2):
        log.step(step=step, loss=None, wall_s=2.5, device_time_s=2.5, time_dilation=1.0,
                 bound_s=0.8, bytes_down=3e8, bytes_up=1e8, tiles=100, simulated=True)
    log.close()
    assert main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "- simulated device time 5.0 s" in text, text
    assert "- emulation fidelity: no emulated tiles (a simulation runs in virtual time)" in text
    assert "wall time: not recorded" not in text and "unknown" not in text


def test_a_simulation_holds_its_run_directory_so_its_report_says_running(
        tmp_path: Path, monkeypatch) -> None:
    """While `testbed simulate` runs, its run directory is locked as `testbed up` locks its
    run's: a report of it meanwhile (no summary.json yet) says running, not failed."""
    import testbed.simulate.run as simulate_run
    from testbed.run_lock import holder

    tiny = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"
    out = tmp_path / "runs"
    seen: list[str] = []
    line = simulate_run.step_line

    def step_line(*args):  # type: ignore[no-untyped-def]
        (run_dir,) = out.iterdir()
        assert holder(run_dir) is not None
        assert main(["report", str(run_dir)]) == 0
        seen.append((run_dir / "report.md").read_text())
        return line(*args)
    monkeypatch.setattr(simulate_run, "step_line", step_line)
    assert main(["simulate", str(tiny), "--steps", "1", "--out", str(out)]) == 0
    assert len(seen) == 1 and "- state: running: a `testbed simulate` holds this run directory" \
        in seen[0], seen
    (run_dir,) = out.iterdir()
    assert holder(run_dir) is None  # let go once it ended
