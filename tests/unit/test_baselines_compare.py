"""`testbed compare`: one run per strategy, a table with a GPU row, churn counted per strategy."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.baselines.compare import largest_model, with_strategy
from testbed.baselines.gpu import gpu_step, load_gpu
from testbed.cli import main
from testbed.topology import load_topology

GPU = load_gpu("a5000")


def write_topology(tmp_path: Path, count: int = 4, **job: Any) -> Path:
    raw = {"name": "cmp", "seed": 3,
           "network": {"switches": ["ap0"], "ps": {"switch": "ap0",
                                                   "link": {"down": "1Gbit", "up": "1Gbit"}}},
           "devices": [{"group": "phones", "profile": "snapdragon888", "count": count,
                        "switch": "ap0", "link": {"down": "100Mbit", "up": "20Mbit",
                                                  "delay": "10ms"}}],
           "job": {"model": {"hidden": 64, "layers": 4, "heads": 4, "ffn": 256,
                             "seq_len": 32},
                   "batch_size": 8, "steps": 8,
                   "parallelism": {"tile": 32, "checkpoint_every": 3, "micro_batches": 4},
                   **job}}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_gpu_reference_is_the_roofline_of_its_datasheet() -> None:
    assert (GPU.peak_fp32_flops, GPU.board_power_w, GPU.memory_bytes) == \
        (27.8e12, 230.0, 24 * 2**30)
    topo = load_topology(Path(__file__).parents[2] / "topologies" / "hotcarbon.yaml")
    g = gpu_step(topo.job, GPU)
    assert g.energy_j == pytest.approx(230 * g.step_s)
    assert gpu_step(topo.job, GPU, pue=1.5).energy_j == pytest.approx(1.5 * g.energy_j)
    # OPT-125m shape, batch 16 x 512: ~6 x 124M x 8192 tokens of GEMM FLOPs at 13.9 TFLOP/s
    assert 0.2 < g.step_s < 1.0


def test_largest_model_per_strategy_on_fifteen_phones() -> None:
    topo = load_topology(Path(__file__).parents[2] / "topologies" / "hotcarbon.yaml")
    assert largest_model(with_strategy(topo, "data-parallel"), "data-parallel",
                         64 * 2**30) == "OPT-125m"
    # a pipeline spreads layers over phones: larger than one phone's replica
    assert largest_model(with_strategy(topo, "pipeline"), "pipeline", 64 * 2**30) == "OPT-350m"
    assert largest_model(topo, "tile-tp", 64 * 2**30) == "OPT-350m"
    # 1 TiB: OPT-30B (16 B/param is 480 GB, plus the batch's activations), not OPT-66B
    assert largest_model(topo, "tile-tp", 2**40) == "OPT-30B"
    assert largest_model(topo, "gpu", 0, GPU) == "OPT-125m"


def test_compare_under_churn_counts_restarts_and_lost_tiles(tmp_path: Path) -> None:
    path = write_topology(tmp_path)
    trace = tmp_path / "crash.csv"
    # phones-0 holds the first pipeline stage (fastest-first order, equal phones: by index)
    trace.write_text("time_s,device,event,arg\n0.8,phones-0,crash,\n")
    out = tmp_path / "out"
    assert main(["compare", str(path), "--simulate", "--churn", str(trace), "--out", str(out),
                 "--no-report"]) == 0
    (cmp_dir,) = out.iterdir()
    for name in ("comparison.md", "comparison.csv", "comparison.png", "comparison.json"):
        assert (cmp_dir / name).is_file()
    rows = {r["strategy"]: r for r in csv.DictReader((cmp_dir / "comparison.csv").open())}
    assert set(rows) == {"tile-tp", "pipeline", "data-parallel", "gpu:a5000"}
    for s in ("tile-tp", "pipeline", "data-parallel"):
        assert rows[s]["state"] == "done" and int(rows[s]["steps_done"]) == 8
        assert (cmp_dir / s / "summary.json").is_file()
    pipe = json.loads((cmp_dir / "pipeline" / "summary.json").read_text())
    events = [json.loads(x) for x in (cmp_dir / "pipeline" / "events.jsonl").read_text()
              .splitlines()]
    placements = [e["devices"] for e in events if e["event"] == "placement"]
    assert placements[0] == ["phones-0"] and "phones-0" not in placements[1]
    (restart,) = [e for e in events if e["event"] == "restart"]
    assert restart["steps_redone"] == restart["failed_step"] - restart["resume_step"] + 1 >= 1
    assert pipe["restarts"] == 1 and pipe["steps_redone"] == restart["steps_redone"]
    assert int(rows["pipeline"]["steps_redone"]) == pipe["steps_redone"]
    steps = [json.loads(x) for x in (cmp_dir / "pipeline" / "steps.jsonl").read_text()
             .splitlines()]
    assert sum(s["redo"] for s in steps) == restart["steps_redone"] - 1  # + the aborted one
    tile = json.loads((cmp_dir / "tile-tp" / "summary.json").read_text())
    assert int(rows["tile-tp"]["steps_redone"]) == 0  # tile-tp loses in-flight tiles only
    assert "tiles re-queued" in rows["tile-tp"]["lost_work"]
    assert tile["steps_done"] == 8
    md = (cmp_dir / "comparison.md").read_text()
    assert "gpu:a5000" in md and "x the GPU's energy" in md
    # tile-tp's lower bound: the median of its steps' bound_s, only on its row, and every
    # strategy's time set against it
    tile_steps = [json.loads(x) for x in (cmp_dir / "tile-tp" / "steps.jsonl").read_text()
                  .splitlines()]
    bounds = sorted(s["bound_s"] for s in tile_steps)
    assert len(bounds) == 8 and all(b > 0 for b in bounds)
    assert float(rows["tile-tp"]["bound_s"]) == pytest.approx((bounds[3] + bounds[4]) / 2,
                                                              rel=1e-3)
    assert all(rows[s]["bound_s"] == "" for s in ("pipeline", "data-parallel", "gpu:a5000"))
    bound = float(rows["tile-tp"]["bound_s"])
    assert f"tile-tp's lower bound: {bound:.4g} s a step" in md
    pipe_s = float(rows["pipeline"]["step_s"])
    assert f"pipeline: {pipe_s / float(rows['tile-tp']['step_s']):.3g}x tile-tp's time per " \
           f"step and {pipe_s / bound:.3g}x its lower bound" in md


def test_compare_refuses_bad_input_before_running(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = write_topology(tmp_path)
    out = tmp_path / "out"
    # a missing trace is refused before anything runs, emulated or simulated
    assert main(["compare", str(path), "--churn", str(tmp_path / "none.csv"),
                 "--out", str(out)]) == 2
    assert main(["compare", str(path), "--simulate", "--strategies", "zero",
                 "--out", str(out)]) == 2
    assert main(["compare", str(path), "--simulate", "--pue", "0.5", "--out", str(out)]) == 2
    assert main(["compare", str(path), "--simulate", "--gpu", "h100", "--out", str(out)]) == 2
    assert not out.exists()
    assert "none.csv" in capsys.readouterr().err


def test_a_strategy_that_does_not_fit_is_a_row_not_a_crash(tmp_path: Path) -> None:
    path = write_topology(tmp_path, count=2)
    raw = yaml.safe_load(path.read_text())
    raw["job"]["model"] = {"hidden": 2048, "layers": 4, "heads": 16, "ffn": 8192,
                           "seq_len": 512, "vocab": 50272}
    raw["job"]["batch_size"] = 16
    raw["job"]["steps"] = 1
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    assert main(["compare", str(path), "--simulate", "--strategies", "data-parallel",
                 "--out", str(out), "--no-report"]) == 0
    (cmp_dir,) = out.iterdir()
    rows = list(csv.DictReader((cmp_dir / "comparison.csv").open()))
    assert rows[0]["state"] == "does not fit" and "no device holds a replica" in rows[0]["note"]


def test_a_device_no_strategy_used_is_not_charged() -> None:
    """tile-tp's run charges idle power to the devices its plans left out; the comparison
    charged them to tile-tp while the pipeline and data parallelism paid nothing for theirs."""
    from testbed.baselines.compare import _row

    energy = {"devices": {"laptops-0": {"total_j": 30.0}, "phones-0": {"total_j": 12.0},
                          "phones-1": {"total_j": 7.0}},
              "total": {"total_j": 49.0}}
    summary = {"state": "done", "steps_done": 2, "wall_s": 4.0, "energy": energy,
               "devices": [{"device": "laptops-0", "compute_s": 3.0, "bytes_down": 10},
                           {"device": "phones-0", "compute_s": 0.0, "bytes_up": 5},
                           {"device": "phones-1", "compute_s": 0.0}]}  # sat out the whole run
    steps = [{"device_time_s": 2.0}, {"device_time_s": 2.0}]
    row = _row("tile-tp", summary, steps, 475.0)
    assert row["devices_used"] == 2
    assert row["energy_j_per_step"] == pytest.approx((30.0 + 12.0) / 2)
