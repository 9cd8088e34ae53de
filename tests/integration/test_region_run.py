"""GEMMs cut in regions of rows on a real loopback run, while devices come and go.

tests/data/regions.yaml mixes one laptop on a fast link with three phones on slow ones, so the
PS plans its forward GEMMs in two runs of rows, the laptop's whole and the phones' K-split
(planner.plan_regions). tests/data/regions-backward.yaml widens the layers and slows the
phones' uplinks, so that out_proj's backward pair is spread over every device and both of its
GEMMs are cut in regions too. Real PS and agent processes over gRPC: the PS says so in its
`planned` event, and with a phone crashing and another leaving mid-step the losses and final
weights still equal the single-process run's (float64).
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from testbed.ps_backend.config import ps_config
from testbed.ps_backend.scheduler import DeviceSlot, GemmJob, GemmSpec
from testbed.ps_backend.step_plan import Cut, StepPlanner
from testbed.ps_backend.tiler import cut_regions
from testbed.runlog import read_jsonl
from testbed.simulate.chain import linears
from testbed.topology import load_topology
from tests.conftest import REPO, reference_losses, run_dir_of, start_up

pytestmark = pytest.mark.integration

REGIONS = REPO / "tests" / "data" / "regions.yaml"
BACKWARD = REPO / "tests" / "data" / "regions-backward.yaml"
# a step takes about a second: both departures land inside steps
TRACE = """time_s,device,event,arg
1.2,phones-0,crash,
2.5,phones-1,leave,
"""


def _planned(path: Path) -> tuple[StepPlanner, list[DeviceSlot], list[tuple[int, int, int]]]:
    """A StepPlanner over the topology's devices, every linear (tokens, out, in) planned ahead
    as the PS's prepare does before the first step."""
    topo = load_topology(path)
    planner = StepPlanner(ps_config(topo))
    slots = [DeviceSlot(device_id=d.name, name=d.name, predicted_gflops=10.0, max_in_flight=8,
                        cache_bytes=1 << 26, group=d.group.group) for d in topo.devices]
    tokens = topo.job.batch_size * topo.job.model.seq_len
    shapes = sorted({(tokens, lin.d_out, lin.d_in) for lin in linears(topo.job)})
    planner.prepare(shapes, 8, slots)
    return planner, slots, shapes


def _cut(planner: StepPlanner, slots: list[DeviceSlot], op: str, m: int, k: int, n: int
         ) -> Cut:
    """How the PS cuts an m x k x n GEMM of this op in a step (plan()), each region's tiles
    checked to go to its own side: the laptop's rows first, then the phones'."""
    zeros = np.zeros((), dtype=np.float64)
    job = GemmJob(uid=f"{op}{m}x{k}x{n}", spec=GemmSpec("l", op, 0),
                  a=np.broadcast_to(zeros, (m, k)), b=np.broadcast_to(zeros, (k, n)),
                  c=np.empty((0, 0)), version=0, a_key="a", b_key="b", done=Future())
    cut = planner.plan(job, slots)
    if len(cut.regions) > 1:
        assert len(cut.regions) == 2 and cut.owners, cut
        group = {s.name: s.group for s in slots}
        first = cut.regions[0]
        for box in cut_regions(n, k, cut.regions):
            owner = group[cut.owners[(box.row, box.col, box.part)]]
            assert owner == ("laptops" if box.r1 <= first.r1 else "phones"), (op, box)
    return cut


def test_the_plan_cuts_this_mix_in_regions_with_a_k_split_run() -> None:
    planner, slots, _ = _planned(REGIONS)
    assert planner.region_shapes(), "no forward GEMM of this mix was cut in regions"
    split = 0
    for shape in planner.region_shapes():
        m, k, n = (int(x) for x in shape.split("x"))
        cut = _cut(planner, slots, "forward", m, k, n)
        assert len(cut.regions) == 2, (shape, cut)
        split += cut.regions[1].k_parts > 1
    assert split, "no region was K-split"


def test_a_spread_backward_pair_is_cut_in_regions_too() -> None:
    planner, slots, shapes = _planned(BACKWARD)
    in_regions = []
    for t, o, i in shapes:  # each linear's dX = dY·W and dW = dYᵀ·X, as the PS submits them
        for op, (m, k, n) in (("input_grad", (t, o, i)), ("weight_grad", (o, t, i))):
            if len(_cut(planner, slots, op, m, k, n).regions) > 1:
                in_regions.append(op)
    assert {"input_grad", "weight_grad"} <= set(in_regions), in_regions


@pytest.mark.slow
@pytest.mark.parametrize("mix", [REGIONS, BACKWARD], ids=["forward", "backward"])
def test_regions_keep_the_single_process_result_while_phones_go(mix: Path, tmp_path: Path
                                                                 ) -> None:
    raw = yaml.safe_load(mix.read_text())
    raw["job"]["steps"] = steps = 4
    trace = tmp_path / "two-go.csv"
    trace.write_text(TRACE)
    raw["churn"] = str(trace)
    topology = tmp_path / "regions.yaml"
    topology.write_text(yaml.safe_dump(raw))

    proc = start_up(topology, tmp_path / "runs")
    output, _ = proc.communicate(timeout=300)
    run_dir = run_dir_of(tmp_path / "runs")
    assert proc.returncode == 0, output
    events = read_jsonl(run_dir / "events.jsonl")
    # the plans before the first step, then those made between steps for the phones left
    planned = [e for e in events if e["event"] == "planned"]
    assert planned[0]["before_step"] == 0 and planned[0]["regions"], planned
    assert all(e["before_step"] > 0 for e in planned[1:]), planned
    departed = [e for e in events if e["event"] in ("leave", "disconnect", "lease_expired")]
    assert {e["device"] for e in departed} == {"phones-0", "phones-1"}
    last_step_t = read_jsonl(run_dir / "steps.jsonl")[-1]["elapsed_s"]
    assert all(e["elapsed_s"] < last_step_t for e in departed), "a departure after the last step"

    steps_done = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps_done] == list(range(steps))
    want_losses, want_weights = reference_losses(topology, steps)
    for s, want in zip(steps_done, want_losses):
        assert abs(s["loss"] - want) <= 1e-8 * abs(want), (s["step"], s["loss"], want)
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    got = torch.load(checkpoints[-1], weights_only=True)["model"]
    scale = max(w.abs().max().item() for w in want_weights.values())
    for name, want in want_weights.items():
        assert (got[name] - want).abs().max().item() <= 1e-8 * scale, name
