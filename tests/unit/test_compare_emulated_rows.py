"""`testbed compare`'s rows say what a reader needs to weigh them: an emulated baseline's host
lateness, its losses in a note one can read, no per-step figure for a run with no step done,
and under churn each strategy's wall time per step done beside its median step."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from testbed.baselines import compare as cmp
from testbed.baselines.gpu import load_gpu
from testbed.topology import load_topology
from tests.unit.test_baselines_compare import write_topology

GPU = load_gpu("a5000")


def _inputs(mode: str = "simulated", churn: str = "", steps: int = 4) -> dict[str, Any]:
    return {"topology": "t", "steps": steps, "churn": churn, "grid_g_per_kwh": 475.0,
            "gpu_grid_g_per_kwh": 475.0, "pue": 1.0, "ps_memory_bytes": 2**36,
            "gpu": dataclasses.asdict(GPU), "mode": mode}


def _summary(steps_done: int, wall_s: float, **extra: Any) -> dict[str, Any]:
    return {"state": "done", "steps_done": steps_done, "wall_s": wall_s,
            "energy": {"devices": {"a": {"total_j": 10.0}}},
            "devices": [{"device": "a", "compute_s": 1.0, "bytes_down": 100, "bytes_up": 100}],
            **extra}


def _pipeline_result(steps: int, step_wall_s: float, lag_total_s: float,
                     losses: list[float]) -> dict[str, Any]:
    """What emulate_pipeline returns for one stage on phones-0 that ran ``steps`` steps."""
    report = {"stage": 0, "device": "phones-0", "device_s": 1.0, "energy_j": 5.0,
              "lag_p95_s": 0.001, "lag_max_s": 0.01, "lag_total_s": lag_total_s}
    return {"stages": [report], "attempt_reports": [report],
            "executed": [{"step": i, "wall_s": step_wall_s} for i in range(steps)],
            "work": [report], "links": {"phones-0": {"rx_bytes": 1000, "tx_bytes": 1000}},
            "losses": losses, "wall_s": steps * step_wall_s, "restarts": 0,
            "steps_redone": 0, "churn_events": 0}


def test_a_long_runs_losses_are_summed_up_in_its_note_and_kept_whole_in_the_json(
        tmp_path: Path) -> None:
    """A 200-step emulated run's note listed its 200 losses: 2,000 characters in the table's
    notes and in what `testbed compare` prints at its end."""
    topo = load_topology(write_topology(tmp_path))
    losses = [5.0 - 0.01 * i for i in range(200)]
    row = cmp._emulated_row("pipeline", topo, _pipeline_result(200, 0.1, 0.0, losses), 1.0,
                            475.0)
    assert len(row["note"]) < 250, row["note"]
    assert "losses 5.000000, 4.990000, 4.980000, ..., 3.020000, 3.010000 (200;" in row["note"]
    assert row["losses"] == pytest.approx(losses, rel=1e-12)
    gpu = cmp._gpu_row(topo, GPU, 475.0, 1.0, 2**36)
    cmp.write_comparison(tmp_path, [row, gpu], _inputs("emulated on Mininet, D = 1"))
    data = json.loads((tmp_path / "comparison.json").read_text())
    assert data["rows"][0]["losses"] == pytest.approx(losses, rel=1e-12)
    # a short run's are all there, as before
    short = cmp._emulated_row("pipeline", topo, _pipeline_result(2, 0.1, 0.0, [5.5, 5.25]),
                              1.0, 475.0)
    assert short["note"].endswith("losses 5.500000, 5.250000")


def test_an_emulated_baseline_that_ran_late_on_this_host_says_so(tmp_path: Path) -> None:
    """On the default topology at D = 1 the emulated pipeline ran 0.21-0.24 s a step against
    0.097 s simulated, its stage's real compute on this host outlasting the laptop model's
    holds (0.41 s late over 3 steps), and its row said nothing of it; tile-tp's run, at its own
    automatic D, warned in its own output only."""
    topo = load_topology(write_topology(tmp_path))
    late = cmp._emulated_row("pipeline", topo, _pipeline_result(3, 0.2, 0.3, [5.0] * 3), 1.0,
                             475.0)
    # 0.3 s of late holds over 3 x 0.2 s of steps
    assert late["late_share"] == pytest.approx(0.5, rel=1e-9)
    assert "the host's lateness up to 50.0% of its steps' device time" in late["note"]
    on_time = cmp._emulated_row("pipeline", topo, _pipeline_result(3, 0.2, 0.006, [5.0] * 3),
                                1.0, 475.0)
    assert on_time["late_share"] == pytest.approx(0.01, rel=1e-9)
    # the holds' lateness is wall seconds, the steps device seconds: at D = 2 half as much
    dilated = cmp._emulated_row("pipeline", topo, _pipeline_result(3, 0.4, 0.3, [5.0] * 3),
                                2.0, 475.0)
    assert dilated["late_share"] == pytest.approx(0.25, rel=1e-9)
    gpu = cmp._gpu_row(topo, GPU, 475.0, 1.0, 2**36)
    cmp.write_comparison(tmp_path, [late, gpu], _inputs("emulated on Mininet, D = 1"))
    md = (tmp_path / "comparison.md").read_text()
    assert "up to 50% of its step time is this host running late" in md
    assert "larger `time_dilation:`" in md and "late_share" in md
    cmp.write_comparison(tmp_path, [on_time, gpu], _inputs("emulated on Mininet, D = 1"))
    assert "running late" not in (tmp_path / "comparison.md").read_text()


def test_the_host_lateness_is_the_most_late_process_over_the_steps() -> None:
    reports = [{"lag_total_s": 0.1}, {"lag_total_s": 0.4}, {"lag_p95_s": 0.5}]
    assert cmp.host_lateness(reports, 1.0, [1.0, 1.0]) == pytest.approx(0.2, rel=1e-9)
    assert cmp.host_lateness([{"lag_p95_s": 0.5}], 1.0, [1.0]) is None  # an older report
    assert cmp.host_lateness(reports, 0.0, [1.0]) is None  # D 0: no holds
    assert cmp.host_lateness(reports, 1.0, []) is None


def test_a_run_with_no_step_done_has_no_per_step_energy(tmp_path: Path) -> None:
    """tile-tp's run under a trace that took every device away failed before its first step,
    and its row gave its whole energy, 0.063 J, as its J/step."""
    row = cmp._row("tile-tp", {**_summary(0, 120.0), "state": "failed"}, [], 475.0, 4)
    assert row["energy_j_per_step"] is None and row["carbon_g_per_step"] is None
    assert row["energy_j"] == pytest.approx(10.0, rel=1e-12)
    topo = load_topology(write_topology(tmp_path))
    steps = [{"device_time_s": 1.0}] * 4
    rows = [row, cmp._row("pipeline", _summary(4, 4.0), steps, 475.0, 4),
            cmp._gpu_row(topo, GPU, 475.0, 1.0, 2**36)]
    cmp.write_comparison(tmp_path, rows, _inputs())
    tile = next(line for line in (tmp_path / "comparison.md").read_text().splitlines()
                if line.startswith("| tile-tp |"))
    cells = [c.strip() for c in tile.split("|")[1:-1]]
    assert cells[1] == "failed" and cells[2] == "0 of 4"
    assert cells[9] == "" and cells[10] == ""  # J/step, gCO2e/step


def test_under_churn_the_ratios_set_wall_time_per_step_done_beside_the_median(
        tmp_path: Path) -> None:
    """hotcarbon under flaky-phones: the pipeline's median step was 0.72x tile-tp's, which
    the ratios gave alone, while its 22 restarts made its run 1.57x as long for the same 6
    steps."""
    topo = load_topology(write_topology(tmp_path))
    gpu = cmp._gpu_row(topo, GPU, 475.0, 1.0, 2**36)
    steps = [{"device_time_s": 1.0}] * 4
    rows = [cmp._row("tile-tp", _summary(4, 8.0), [{"device_time_s": 2.0}] * 4, 475.0, 4, 3),
            cmp._row("pipeline", _summary(4, 20.0, restarts=2), steps, 475.0, 4, 3), gpu]
    cmp.write_comparison(tmp_path, rows, _inputs(churn="trace.csv"))
    md = (tmp_path / "comparison.md").read_text()
    assert "- pipeline: 0.5x tile-tp's time per step, 2.5x tile-tp's wall time per step " \
           "done;" in md
    cmp.write_comparison(tmp_path, rows, _inputs())  # no churn: the median says it
    assert "wall time per step done" not in (tmp_path / "comparison.md").read_text()


def test_the_notes_say_whether_the_runs_losses_agree(tmp_path: Path) -> None:
    same = [{"strategy": s, "state": "done", "step_s": 1.0, "losses": [5.0, 4.5]}
            for s in ("tile-tp", "pipeline", "data-parallel")]
    assert cmp._loss_notes(same) == [
        "- losses: tile-tp, pipeline, data-parallel agree within 1e-6 at each of their 2 steps"]
    other = [*same[:2], {**same[2], "losses": [5.0, 4.6]}]
    (note,) = cmp._loss_notes(other)
    assert note.startswith("- losses: tile-tp, pipeline, data-parallel differ: at most 0.022")
    assert note.endswith("at step 1, data-parallel against tile-tp")
    # a row that dropped replicas trained other rows: said as the reason
    dropped = [*same[:2], {**other[2], "sequences_trained": 10, "sequences_asked": 12}]
    (note,) = cmp._loss_notes(dropped)
    assert note.endswith("(data-parallel dropped replicas: its losses average the rows it "
                         "trained)")
    assert cmp._loss_notes(same[:1]) == []
    assert cmp._loss_notes([{**r, "losses": []} for r in same]) == []  # simulated: no losses


def test_an_emulated_rows_lost_work_is_a_count_as_the_other_rows(tmp_path: Path) -> None:
    """tests/data/tiny.yaml under a crash at 1 s: tile-tp's row said "0 tiles re-queued, 0
    recomputed", the simulated rows "0 steps redone after 0 restart(s)", and the emulated
    pipeline, whose 5 steps ended before the crash, "no churn replayed" under that trace."""
    topo = load_topology(write_topology(tmp_path))
    row = cmp._emulated_row("pipeline", topo, _pipeline_result(5, 0.1, 0.0, [5.0] * 5), 1.0,
                            475.0)
    assert row["lost_work"] == "0 steps redone after 0 restart(s)"


def test_a_churn_event_after_tile_tps_run_ended_is_not_met(tmp_path: Path) -> None:
    """tests/data/tiny.yaml on Mininet under a crash at 1 s: tile-tp's 5 steps ended 0.59 s
    after training started, its replay then applied the crash to stopped agents (effect
    `absent`) and its row said "1 of 1" churn events met, beside the baselines' "0 of 1". The
    run's summary counts no action after its PS's last stop (summary.event_counts), which the
    row gives."""
    from testbed.summary import event_counts

    events = [{"event": "training_start", "elapsed_s": 1.6},
              {"event": "ps_stop", "elapsed_s": 2.19, "state": "done"},
              {"event": "churn", "elapsed_s": 2.68, "device": "phones-0", "action": "crash",
               "effect": "absent"}]
    assert event_counts(events)["churn_events"] == 0
    # one that came while it trained is met, and so are a resumed run's later session's
    during = [*events[:1], {**events[2], "elapsed_s": 2.0, "effect": "SIGKILL"}, events[1]]
    assert event_counts(during)["churn_events"] == 1
    resumed = [*during, {"event": "ps_start", "elapsed_s": 9.0},
               {**events[2], "elapsed_s": 9.5, "effect": "SIGKILL"},
               {"event": "ps_stop", "elapsed_s": 12.0, "state": "done"}]
    assert event_counts(resumed)["churn_events"] == 2
    assert event_counts(events[2:])["churn_events"] == 1  # no stop recorded: every one

    topo = load_topology(write_topology(tmp_path, steps=2))
    run_dir = tmp_path / "tile-tp" / "20260101-000000-cmp"
    run_dir.mkdir(parents=True)
    steps = [{"step": i, "device_time_s": 0.1, "bound_s": 0.05} for i in range(2)]
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = {**_summary(2, 0.8), "time_dilation": 1.0, **event_counts(events),
               "losses": [5.0, 4.9]}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    row = cmp._up_row(topo, topo, tmp_path / "tile-tp", 475.0, 1)
    assert (row["churn_events"], row["churn_events_total"]) == (0, 1)


def test_the_picture_says_what_ran_and_under_churn_the_wall_time_per_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """comparison.png had no title (shared alone, it said neither the mode, the steps nor the
    trace) and showed the median step alone, which leaves a pipeline's restarts out."""
    from matplotlib.figure import Figure

    seen: dict[str, Any] = {}

    def keep(fig: Figure, *_a: Any, **_k: Any) -> None:
        seen["title"] = fig._suptitle.get_text() if fig._suptitle is not None else ""
        seen["labels"] = [t for ax in fig.axes for t in ax.get_legend_handles_labels()[1]]
        seen["ylabel"] = fig.axes[0].get_ylabel()

    monkeypatch.setattr(Figure, "savefig", keep)
    topo = load_topology(write_topology(tmp_path))
    gpu = cmp._gpu_row(topo, GPU, 475.0, 1.0, 2**36)
    rows = [cmp._row("pipeline", _summary(4, 20.0, restarts=2), [{"device_time_s": 1.0}] * 4,
                     475.0, 4, 3), gpu]
    cmp.write_comparison(tmp_path, rows, _inputs(churn="trace.csv"))
    assert seen["title"] == "Comparison: t (simulated, 4 steps, churn trace.csv)"
    assert seen["ylabel"] == "median device seconds per step"
    assert "wall time per step done" in seen["labels"]
    cmp.write_comparison(tmp_path, rows, _inputs())
    assert "wall time per step done" not in seen["labels"]
