"""Which device groups sat out a step's GEMMs, and of which: a group the planner left out of
every GEMM reads only its reason; one that computed some of them also says which it sat out."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np

from testbed.ps_backend.scheduler import DeviceSlot, GemmJob, GemmSpec
from testbed.ps_backend.step_plan import StepPlanner, sat_out_scope


def test_a_group_out_of_every_gemm_reads_its_reason_alone() -> None:
    assert sat_out_scope("link", {"forward": 9, "backward": 18},
                         {"forward": 9, "backward": 18}) == "link"
    assert sat_out_scope("speed", {"forward": 3}, {"forward": 3}) == "speed"


def test_a_group_out_of_some_gemms_says_of_which() -> None:
    gemms = {"forward": 9, "backward": 18}
    assert sat_out_scope("link", {"forward": 0, "backward": 13}, gemms) == \
        "link in 13 of 18 backward GEMMs"
    assert sat_out_scope("link (7 of 8)", {"forward": 7, "backward": 18}, gemms) == \
        "link (7 of 8) in 7 of 9 forward GEMMs, 18 of 18 backward GEMMs"


def _job(uid: str, op: str, shape: tuple[int, int, int]) -> GemmJob:
    m, k, n = shape
    zeros = np.zeros((), dtype=np.float32)
    return GemmJob(uid=uid, spec=GemmSpec("l.fc1", op, 0), a=np.broadcast_to(zeros, (m, k)),
                   b=np.broadcast_to(zeros, (k, n)), c=np.empty((0, 0)), version=0,
                   a_key=f"{uid}.a", b_key=f"{uid}.b", done=Future())


def test_the_step_record_counts_a_group_out_of_every_gemm_of_both_passes() -> None:
    groups = [("laptops", 2, 100.0), ("modem", 1, 100.0)]
    config = SimpleNamespace(
        planner="auto", planned_groups=groups, plan_links={}, fair_share_paths={}, group_paths={},
        group_links={"laptops": (100e6, 100e6, 0.0), "modem": (10e3, 10e3, 0.0)},
        ps_link_Bps=(float("inf"), float("inf")), shared_down_Bps={}, switch_links={},
        max_message_bytes=64 << 20, tile_m=256, tile_n=256)
    planner = StepPlanner(config)
    slots = [DeviceSlot(f"{g}-{j}", f"{g}-{j}", gflops, 4, 64 << 20, group=g)
             for g, count, gflops in groups for j in range(count)]
    t, o, i = 512, 512, 512
    for uid, op, shape in (("y", "forward", (t, i, o)), ("dx", "input_grad", (t, o, i)),
                           ("dw", "weight_grad", (o, t, i))):
        cut = planner.plan(_job(uid, op, shape), slots)
        assert cut.owners and "modem-0" not in cut.owners.values()
    assert planner.take_step(slots).sat_out == {"modem": "link"}
    assert planner.take_step(slots).sat_out == {}  # a step with no GEMM: nobody sat out
