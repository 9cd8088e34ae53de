"""On a real loopback run every step's device time is at least its analytic lower bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from testbed.ps_backend.bound import stage_key
from testbed.runlog import read_jsonl
from testbed.simulate.chain import linears, step_chain
from testbed.topology import load_topology
from tests.conftest import TINY, reference_losses, run_dir_of, start_up

pytestmark = pytest.mark.integration


def _topology(tmp_path: Path) -> Path:
    """The tiny float64 job on 20 Mbit links with 2 ms delay: link terms in the bound matter."""
    raw = yaml.safe_load(TINY.read_text())
    raw["job"].update(steps=3, dtype="float64")
    raw["job"]["model"].update(hidden=64, ffn=128, seq_len=32)
    for group in raw["devices"]:
        group["link"] = {"down": "20Mbit", "up": "20Mbit", "delay": "2ms"}
    path = tmp_path / "bound.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
def test_device_time_is_at_least_the_bound_on_a_real_run(tmp_path: Path) -> None:
    topology = _topology(tmp_path)
    proc = start_up(topology, tmp_path / "runs", "--trace-tiles")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    run_dir = run_dir_of(tmp_path / "runs")
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert len(steps) == 3
    # the step's offloaded GEMMs (the simulator's chain is the engine's, tile for tile)
    job = load_topology(topology).job
    gemms = [g for group in step_chain(job) for g in group
             if g.flops >= job.parallelism.min_offload_flops]
    once_down = sum(g.m * g.k + g.k * g.n for g in gemms) * 8  # float64
    once_up = sum(g.m * g.n for g in gemms) * 8
    for s in steps:
        assert s["bound_s"] > 0 and s["bytes_min_down"] > 0 and s["bytes_min_up"] > 0
        assert s["device_time_s"] >= s["bound_s"], s
        assert 0 < s["efficiency"] <= 1
        # the optimal schedule for the plan's devices sends each operand and result at least
        # once; every result entry does come back at least once
        assert s["bytes_min_down"] >= once_down * (1 - 1e-9)
        assert s["bytes_min_up"] >= once_up * (1 - 1e-9)
        assert s["bytes_up"] >= once_up
    # each step's stages (stages.jsonl): one line per stage of the chain, their bounds summing
    # to the step's, each stage within the step's device time (they follow one another)
    stages = read_jsonl(run_dir / "stages.jsonl")
    for s in steps:
        mine = [r for r in stages if r["step"] == s["step"]]
        assert len(mine) == len({stage_key(g.layer, g.op) for g in gemms}) >= 2
        assert sum(r["bound_s"] for r in mine) == pytest.approx(s["bound_s"], rel=1e-4,
                                                                 abs=1e-5)
        assert all(0 < r["device_s"] <= s["device_time_s"] for r in mine)
        assert sum(r["device_s"] for r in mine) <= s["device_time_s"] * (1 + 1e-6)
    # --trace-tiles: every accepted tile once, its legs in order (one clock on this host)
    tiles = read_jsonl(run_dir / "tiles.jsonl")
    for s in steps:
        mine = [t for t in tiles if t["step"] == s["step"]]
        assert len(mine) == s["tiles"] == len({(t["gemm"], t["task"]) for t in mine})
        assert sum(t["bytes_up"] for t in mine) <= s["bytes_up"]
        for t in mine:
            legs = [t["sent_s"], t["arrived_s"], t["started_s"], t["done_s"], t["accepted_s"]]
            assert all(b >= a - 1e-6 for a, b in zip(legs, legs[1:])), t
    # the plans were made before training started, one per distinct linear shape
    events = [e["event"] for e in read_jsonl(run_dir / "events.jsonl")]
    planned = next(e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "planned")
    tokens = job.batch_size * job.model.seq_len
    assert planned["shapes"] == len({(tokens, lin.d_out, lin.d_in) for lin in linears(job)})
    assert events.index("planned") < events.index("training_start")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["planner"] == "auto"
    assert 0 < summary["planner_cpu_s"] < summary["wall_s"]  # planning ran, on the PS
    assert summary["bound_s"] == pytest.approx(sum(s["bound_s"] for s in steps), rel=1e-5)
    assert 0 < summary["efficiency"] <= 1
    want, _ = reference_losses(topology, 3)
    for got, ref in zip([s["loss"] for s in steps], want):
        assert abs(got - ref) <= 1e-8 * abs(ref)
