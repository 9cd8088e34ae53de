"""`testbed compare`'s table says what its rows did not share (churn met, sequences trained,
steps), labels the GPU row as an estimate, and keeps a partial comparison when interrupted."""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import pytest

from testbed.baselines import compare as cmp
from testbed.baselines.gpu import load_gpu
from testbed.cli import main
from testbed.topology import load_topology
from tests.unit.test_baselines_compare import write_topology

GPU = load_gpu("a5000")


def _inputs(steps: int = 4, churn: str = "") -> dict[str, Any]:
    return {"topology": "t", "steps": steps, "churn": churn, "grid_g_per_kwh": 475.0,
            "gpu_grid_g_per_kwh": 475.0, "pue": 1.0, "ps_memory_bytes": 2**36,
            "gpu": dataclasses.asdict(GPU), "mode": "simulated"}


def _summary(devices: list[str], steps_done: int = 4, **extra: Any) -> dict[str, Any]:
    return {"state": "done", "steps_done": steps_done, "wall_s": 8.0,
            "energy": {"devices": {d: {"total_j": 10.0} for d in devices}},
            "devices": [{"device": d, "compute_s": 1.0, "bytes_down": 100, "bytes_up": 100}
                        for d in devices], **extra}


def _gpu_row(tmp_path: Path) -> dict[str, Any]:
    topo = load_topology(write_topology(tmp_path))
    return cmp._gpu_row(topo, GPU, 475.0, 1.0, 2**36)


def test_each_row_says_how_much_of_the_churn_trace_its_run_met(tmp_path: Path) -> None:
    """A fast strategy ends before the trace's later events: under one trace the rows met
    different churn, and the table said only the trace's name."""
    steps = [{"device_time_s": 2.0}] * 4
    slow = cmp._row("tile-tp", _summary(["a", "b"], churn_events=5), steps, 475.0, 8, 10)
    fast = cmp._row("pipeline", _summary(["a"], churn_events=0), steps, 475.0, 8, 10)
    assert (slow["churn_events"], slow["churn_events_total"]) == (5, 10)
    assert (fast["churn_events"], fast["churn_events_total"]) == (0, 10)
    rows = [slow, fast, _gpu_row(tmp_path)]
    cmp.write_comparison(tmp_path, rows, _inputs(churn="trace.csv"))
    md = (tmp_path / "comparison.md").read_text()
    assert "churn events met" in md and "| 5 of 10 |" in md and "| 0 of 10 |" in md
    assert "not the same churn" in md and "tile-tp 5 of 10, pipeline 0 of 10" in md
    csv_rows = {r["strategy"]: r for r in csv.DictReader((tmp_path / "comparison.csv").open())}
    assert csv_rows["pipeline"]["churn_events"] == "0"
    assert csv_rows["tile-tp"]["churn_events_total"] == "10"


def test_the_same_churn_met_by_every_row_gets_no_warning(tmp_path: Path) -> None:
    steps = [{"device_time_s": 2.0}] * 4
    rows = [cmp._row(s, _summary(["a"], churn_events=3), steps, 475.0, 8, 3)
            for s in ("tile-tp", "pipeline")] + [_gpu_row(tmp_path)]
    cmp.write_comparison(tmp_path, rows, _inputs(churn="trace.csv"))
    assert "not the same churn" not in (tmp_path / "comparison.md").read_text()


def test_dropped_replicas_untrained_sequences_are_counted_and_said() -> None:
    """Data parallelism's dropped replicas leave their rows untrained: its steps held fewer
    sequences than the others', and only "N replica-steps dropped" said so."""
    placement = {"replicas": ["a", "b", "c"], "rows": [3, 3, 2]}
    steps = [{"device_time_s": 1.0, "took_part": ["a", "b", "c"]},
             {"device_time_s": 1.0, "took_part": ["a", "c"]},
             {"device_time_s": 1.0, "took_part": ["a"]}]
    summary = _summary(["a", "b", "c"], steps_done=3, placement=placement,
                       dropped_replica_steps=3)
    row = cmp._row("data-parallel", summary, steps, 475.0, 8)
    assert (row["sequences_trained"], row["sequences_asked"]) == (8 + 5 + 3, 24)
    assert row["lost_work"] == "3 replica-steps dropped (8 of 24 sequences untrained)"
    notes = cmp._fairness_notes([row], 3)
    assert any("trained 16 of the 24 sequences" in n for n in notes)
    # every step whole: no note
    whole = cmp._row("data-parallel", _summary(["a", "b", "c"], steps_done=1,
                                               placement=placement),
                     steps[:1], 475.0, 8)
    assert whole["sequences_trained"] == whole["sequences_asked"] == 8
    assert cmp._fairness_notes([whole], 1) == []


def test_the_gpu_row_is_labelled_an_estimate_not_a_run(tmp_path: Path) -> None:
    gpu = _gpu_row(tmp_path)
    assert gpu["state"] == "estimate, not run"
    steps = [{"device_time_s": 2.0}] * 4
    rows = [cmp._row("tile-tp", _summary(["a"]), steps, 475.0, 8), gpu]
    cmp.write_comparison(tmp_path, rows, _inputs())
    md = (tmp_path / "comparison.md").read_text()
    assert "| gpu:a5000 | estimate, not run |" in md
    assert "gpu:a5000 is not a run: an estimate from the GPU's datasheet" in md
    assert "| reference |" not in md


def test_a_gpu_the_job_does_not_fit_is_said_beside_its_ratios(tmp_path: Path) -> None:
    small = dataclasses.replace(GPU, memory_bytes=2**20)
    topo = load_topology(write_topology(tmp_path))
    gpu = cmp._gpu_row(topo, small, 475.0, 1.0, 2**36)
    assert gpu["fits"] is False
    steps = [{"device_time_s": 2.0}] * 4
    cmp.write_comparison(tmp_path, [cmp._row("tile-tp", _summary(["a"]), steps, 475.0, 8),
                                    gpu], _inputs())
    md = (tmp_path / "comparison.md").read_text()
    assert "the job does not fit its memory" in md


def test_columns_name_their_units_and_steps_done(tmp_path: Path) -> None:
    steps = [{"device_time_s": 2.0}] * 2
    partial = cmp._row("pipeline", _summary(["a"], steps_done=2), steps, 475.0, 8)
    rows = [partial, _gpu_row(tmp_path)]
    cmp.write_comparison(tmp_path, rows, _inputs(steps=4))
    md = (tmp_path / "comparison.md").read_text()
    header = md.splitlines()[2]
    for head in ("steps done", "devices used", "median s/step", "tile-tp bound s/step",
                 "MB down/device/step", "steps redone"):
        assert f"| {head} |" in header
    assert "| 2 of 4 |" in md and "after 2 of 4 steps" in md
    # no tile-tp row: the ratios do not claim to be against it
    assert "time per step against tile-tp" not in md and "no tile-tp row" in md
    cmp.write_comparison(tmp_path, rows, _inputs(steps=1))
    assert "(simulated, 1 step)" in (tmp_path / "comparison.md").read_text()


def test_an_interrupted_comparison_keeps_what_finished(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """Ctrl-C during the pipeline threw away tile-tp's finished row: no comparison at all."""
    import testbed.baselines.run as baseline_run

    def interrupted(*_a: Any, **_k: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(baseline_run, "simulate_baseline", interrupted)
    path = write_topology(tmp_path)
    out = tmp_path / "out"
    assert main(["compare", str(path), "--simulate", "--steps", "2", "--out", str(out),
                 "--no-report"]) == 130
    (cmp_dir,) = out.iterdir()
    rows = {r["strategy"]: r for r in csv.DictReader((cmp_dir / "comparison.csv").open())}
    assert rows["tile-tp"]["state"] == "done" and rows["tile-tp"]["steps_done"] == "2"
    assert rows["pipeline"]["state"] == "interrupted"
    assert rows["data-parallel"]["state"] == "not run (interrupted before it)"
    md = (cmp_dir / "comparison.md").read_text()
    assert "INTERRUPTED, partial" in md
    data = json.loads((cmp_dir / "comparison.json").read_text())
    assert data["inputs"]["mode"].startswith("simulated; INTERRUPTED")
    err = capsys.readouterr().err
    assert "interrupted during pipeline" in err and "partial comparison" in err


def test_an_interrupted_run_keeps_its_steps_in_the_partial_row(tmp_path: Path) -> None:
    run_dir = tmp_path / "pipeline"
    run_dir.mkdir()
    summary = _summary(["a"], steps_done=1)
    summary["state"] = "interrupted"
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "steps.jsonl").write_text(json.dumps({"device_time_s": 3.0}) + "\n")
    so_far = functools.partial(cmp._simulated_row_so_far, "pipeline", run_dir, 475.0, 8, None)
    rows = cmp._interrupted_rows(
        ["tile-tp", "pipeline", "data-parallel"], [{"strategy": "tile-tp"}],
        {"strategy": "pipeline", "run_dir": run_dir, "largest": "OPT-125m",
         "row_so_far": so_far})
    assert [r["strategy"] for r in rows] == ["pipeline", "data-parallel"]
    assert rows[0]["state"] == "interrupted" and rows[0]["steps_done"] == 1
    assert rows[0]["step_s"] == pytest.approx(3.0)
    assert str(run_dir) in rows[0]["note"]


def _fake_up(step_s: list[float], state: str = "done") -> Any:
    """A stand-in for `testbed up` that writes the run a Mininet run of these steps would."""
    import subprocess

    def fake_up(argv: list[str], line: Any = None) -> subprocess.CompletedProcess[str]:
        run_dir = Path(argv[argv.index("--out") + 1]) / "20260101-000000-cmp"
        run_dir.mkdir(parents=True)
        steps = [{"step": i, "device_time_s": s, "bound_s": 1.0} for i, s in enumerate(step_s)]
        (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
        summary = {**_summary(["phones-0"], steps_done=len(step_s)), "wall_s": 20.0,
                   "time_dilation": 2.5, "losses": [5.0, 4.0][:len(step_s)], "state": state}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        if state == "interrupted":  # as _run_up: the run stopped, and the interrupt goes on
            raise KeyboardInterrupt
        return subprocess.CompletedProcess(argv, 0, "", "")
    return fake_up


def test_emulated_tile_tp_wall_time_is_in_device_seconds(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """`testbed up` runs at its own time dilation (auto) and its wall_s is real seconds from
    the PS's start; the baselines' wall time is device seconds at D = 1, and the title said
    D = 1 for every row."""
    path = write_topology(tmp_path, steps=2)
    step_s = [1.25, 1.5]
    monkeypatch.setattr(cmp, "_run_up", _fake_up(step_s))  # at D = 2.5
    out = tmp_path / "out"
    out.mkdir()
    rows = cmp.compare_emulated(path, load_topology(path), out, ["tile-tp"], GPU)
    tile = rows[0]
    assert tile["state"] == "done"
    assert tile["wall_s"] == pytest.approx(sum(step_s))  # not 20 real seconds at D = 2.5
    assert "D = 2.5" in tile["note"]
    md = (out / "comparison.md").read_text()
    assert "tile-tp at its own" in md


@pytest.mark.parametrize("during", ["pipeline", "tile-tp"])
def test_an_interrupted_mininet_comparison_keeps_what_finished(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, during: str) -> None:
    """On Mininet a Ctrl-C wrote no comparison at all, finished strategies' rows lost; an
    interrupted `testbed up` keeps its steps in its row, as in virtual time."""
    import testbed.baselines.emulate as emulate

    def interrupted(*_a: Any, **_k: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(emulate, "emulate_pipeline", interrupted)
    monkeypatch.setattr(cmp, "_run_up", _fake_up([1.25, 1.5] if during == "pipeline" else [1.25],
                                                 "done" if during == "pipeline"
                                                 else "interrupted"))
    path = write_topology(tmp_path, steps=2)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        cmp.compare_emulated(path, load_topology(path), out,
                             ["tile-tp", "pipeline", "data-parallel"], GPU)
    rows = {r["strategy"]: r for r in csv.DictReader((out / "comparison.csv").open())}
    tile = rows["tile-tp"]
    if during == "pipeline":
        assert tile["state"] == "done" and tile["steps_done"] == "2"
        assert rows["pipeline"]["state"] == "interrupted"
        assert str(out / "pipeline") in rows["pipeline"]["note"]
    else:  # its steps so far, in device seconds as a finished row's
        assert tile["state"] == "interrupted" and tile["steps_done"] == "1"
        assert float(tile["wall_s"]) == pytest.approx(1.25)
        assert rows["pipeline"]["state"] == "not run (interrupted before it)"
    assert rows["data-parallel"]["state"] == "not run (interrupted before it)"
    mode = json.loads((out / "comparison.json").read_text())["inputs"]["mode"]
    assert mode.startswith("emulated on Mininet") and mode.endswith("INTERRUPTED, partial")


def test_a_tile_tp_job_beyond_the_ps_memory_says_so(tmp_path: Path) -> None:
    """The largest-model column said tile-tp holds no OPT shape in --ps-memory, while its row
    ran the bigger job as done, with nothing said."""
    topo = load_topology(Path(__file__).parents[2] / "topologies" / "hotcarbon.yaml")
    note = cmp._ps_memory_note(topo, "tile-tp", 2**30)
    assert "on the PS, more than --ps-memory 1.00 GiB" in note
    assert cmp._ps_memory_note(topo, "tile-tp", 2**40) == ""
    assert cmp._ps_memory_note(topo, "pipeline", 2**30) == ""
    small = load_topology(write_topology(tmp_path, steps=1))
    need = cmp.cost.replica_bytes(small.job, small.job.batch_size)
    out = tmp_path / "out"
    out.mkdir()
    rows = cmp.compare(small, out, ["tile-tp"], lambda _t: None, GPU,
                       ps_memory_bytes=need - 1)
    assert "more than --ps-memory" in rows[0]["note"]


def test_emulated_tile_tp_energy_counts_from_its_training_start(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """The run's own energy charges idle power from each device's join, through the PS's wait
    for devices, its probe and its planning; the baselines' emulated rows count their steps
    only (home-wifi, two steps: 22.9 J a step emulated against 14.9 simulated)."""
    import subprocess

    from testbed.emulator.energy import topology_energy

    path = write_topology(tmp_path, steps=2)
    topo = load_topology(path)
    names = [d.name for d in topo.devices]
    devices = [{"device": n, "compute_s": 0.5, "energy_j": 1.0, "tiles_done": 3,
                "bytes_down": 1000, "bytes_up": 1000} for n in names]
    events = [{"event": "ps_start", "time_dilation": 2.0, "elapsed_s": 0.0},
              *({"event": "join", "device": n, "elapsed_s": 1.0} for n in names),
              {"event": "training_start", "elapsed_s": 11.0},
              {"event": "ps_stop", "elapsed_s": 15.0}]

    def fake_up(argv: list[str], line: Any = None) -> subprocess.CompletedProcess[str]:
        run_dir = Path(argv[argv.index("--out") + 1]) / "20260101-000000-cmp"
        run_dir.mkdir(parents=True)
        steps = [{"step": i, "device_time_s": 1.0, "bound_s": 0.5} for i in range(2)]
        (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        summary = {**_summary(names, steps_done=2), "devices": devices, "wall_s": 15.0,
                   "time_dilation": 2.0, "losses": [5.0, 4.0],
                   "energy": topology_energy(topo, devices, events, 2.0)}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(cmp, "_run_up", fake_up)
    out = tmp_path / "out"
    out.mkdir()
    (tile,) = [r for r in cmp.compare_emulated(path, topo, out, ["tile-tp"], GPU)
               if r["strategy"] == "tile-tp"]
    whole = topology_energy(topo, devices, events, 2.0)["total"]["total_j"]
    trained = topology_energy(topo, devices, events, 2.0,
                              from_event="training_start")["total"]["total_j"]
    assert trained < whole
    assert tile["energy_j"] == pytest.approx(trained, rel=1e-9)
    assert "energy from its training's start" in tile["note"]
