"""The links the planner weighs (a group's fair share of the switch links it shares with other
devices) and the links the bound counts (what the group's own path carries)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from testbed.ps_backend.bound import SwitchLink
from testbed.ps_backend.config import plan_inputs
from testbed.ps_backend.scheduler import DeviceSlot
from testbed.ps_backend.step_plan import StepPlanner
from testbed.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = REPO / "topologies"


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def test_devices_below_a_shared_uplink_plan_with_their_share_the_bound_with_their_own() -> None:
    inputs = plan_inputs(load_topology(TOPOLOGIES / "large.yaml"))
    own, plan = inputs["group_links"], inputs["plan_links"]
    # 59 phones of 100 Mbit down / 20 up below one 1 Gbit access-point uplink each way
    assert close(own["phones-a"][0], 100e6 / 8) and close(own["phones-a"][1], 20e6 / 8)
    assert close(plan["phones-a"][0], 1e9 / 8 / 59) and close(plan["phones-a"][1], 1e9 / 8 / 59)
    # phones-d's own lossy path (3.2 Mbit/s) is below its share: the share changes nothing
    assert plan["phones-d"][:2] == own["phones-d"][:2]
    # the laptops sit on the core switch, below no switch link; round trips are the paths'
    assert plan["laptops"] == own["laptops"]
    assert all(plan[g][2] == own[g][2] for g in own)


def test_the_bound_gets_every_switch_link_with_the_one_above_it() -> None:
    inputs = plan_inputs(load_topology(TOPOLOGIES / "large.yaml"))
    # four access points, each's uplink straight to the PS's switch (core)
    assert inputs["switch_links"] == {f"ap{i}": (1e9 / 8, 1e9 / 8, "") for i in range(4)}
    inputs = plan_inputs(load_topology(TOPOLOGIES / "campus.yaml"))
    assert inputs["switch_links"]["acc0"] == (10e9 / 8, 10e9 / 8, "core")
    assert inputs["switch_links"]["core"] == (1e9 / 8, 1e9 / 8, "")
    assert inputs["group_paths"]["lab-laptops"][:2] == ("acc0", "core")


def test_a_switch_link_every_device_sits_below_is_left_to_the_ps_link_cap() -> None:
    # campus: all 32 devices below the one 1 Gbit uplink; their plans use the 8 laptops, which
    # then have it to themselves, and the PS link (capped at 1 Gbit) weighs it
    inputs = plan_inputs(load_topology(TOPOLOGIES / "campus.yaml"))
    assert inputs["plan_links"] == inputs["group_links"]
    assert close(inputs["ps_link_Bps"][0], 1e9 / 8)


def test_plans_weigh_the_share_and_the_bound_the_own_link() -> None:
    config = SimpleNamespace(planner="auto", planned_groups=[("p", 2, 10.0)],
                             group_links={"p": (4e6, 2e6, 0.01)},
                             plan_links={"p": (1e6, 0.5e6, 0.01)}, fair_share_paths={},
                             ps_link_Bps=(float("inf"), float("inf")),
                             group_paths={"p": ("ap", "ps")},
                             shared_down_Bps={"ap": 8e6, "ps": float("inf")},
                             switch_links={"ap": (8e6, 3e6, "")},
                             max_message_bytes=64 << 20, tile_m=256, tile_n=256)
    planner = StepPlanner(config)  # type: ignore[arg-type]
    slot = DeviceSlot("d0", "p-0", 10.0, 4, 1 << 20, group="p")
    planner.saw(slot)
    assert slot.down_Bps == 1e6  # stealing and backups weigh the share
    [device] = planner.bound_devices()
    assert (device.down_Bps, device.up_Bps) == (4e6, 2e6)
    # ... and the switch link above it, which the devices below share
    assert device.link == "ap" and planner.bound_links() == {"ap": SwitchLink(8e6, 3e6, "")}
    assert [(c.down_Bps, c.up_Bps) for c in planner._classes([slot])] == [(1e6, 0.5e6)]


def test_a_busy_uplink_is_the_devices_own_or_its_fair_share_of_the_ps_link() -> None:
    # default: the PS link (1 Gbit) carries all 8 uplinks together, so each has its own
    inputs = plan_inputs(load_topology(TOPOLOGIES / "default.yaml"))
    assert inputs["busy_up_Bps"] == {"phones": pytest.approx(2.5e6),
                                     "laptops": pytest.approx(12.5e6)}
    # office: 30 phones of 50 Mbit and 3 laptops of 200 Mbit behind one 1 Gbit PS link, more
    # than it carries: an even 1/33 of it each, below every device's own
    inputs = plan_inputs(load_topology(REPO / "bench" / "topologies" / "office.yaml"))
    assert inputs["busy_up_Bps"] == {"phones": pytest.approx(125e6 / 33),
                                     "laptops": pytest.approx(125e6 / 33)}


def test_fair_shares_of_a_shared_link_follow_the_devices_counted() -> None:
    from testbed.ps_backend.fair_share import group_fair_shares_Bps

    own = {"a": (10.0, 4.0), "b": (1.0, 1.0)}
    paths = {"a": ("ap",), "b": ("ap",)}
    capacity = {"ap": (12.0, 6.0)}
    # down: b's 2 devices keep their own 1 each, a's 4 split the other 10; up: 6 among 6
    shares = group_fair_shares_Bps({"a": 4, "b": 2}, own, paths, capacity)
    assert shares == {"a": pytest.approx((2.5, 1.0)), "b": pytest.approx((1.0, 1.0))}
    # with two of a's gone, each of the rest gets twice as much, capped by its own link up
    shares = group_fair_shares_Bps({"a": 2, "b": 2}, own, paths, capacity)
    assert shares == {"a": pytest.approx((5.0, 2.0)), "b": pytest.approx((1.0, 1.0))}
    # a group none of which is counted gets no share; a link every device shares, the PS's
    shares = group_fair_shares_Bps({"a": 2, "b": 0}, own, paths, capacity, ps_Bps=(4.0, 9.0))
    assert shares == {"a": pytest.approx((2.0, 3.0))}


def test_the_planner_takes_the_share_again_for_the_devices_its_step_counts_on() -> None:
    """large: with phones-a planned for 53 of its 59 phones, each of them plans with a 53rd of
    its access point's uplink, where the topology's every device gives it a 59th; the groups
    below the other access points, and the laptops, keep theirs."""
    from testbed.ps_backend.config import ps_config

    config = ps_config(load_topology(TOPOLOGIES / "large.yaml"))
    planner = StepPlanner(config)
    assert planner._link("phones-a") == config.plan_links["phones-a"]
    planner._step_counts = {**planner._counts(), "phones-a": 53}
    down, up, rtt = planner._link("phones-a")
    assert close(down, 1e9 / 8 / 53) and close(up, 1e9 / 8 / 53)
    assert rtt == config.plan_links["phones-a"][2]
    for group in ("phones-b", "phones-c", "phones-d", "laptops"):
        assert planner._link(group) == pytest.approx(config.plan_links[group])
    slot = DeviceSlot("d0", "phones-a-0", 10.0, 4, 1 << 20, group="phones-a")
    planner.saw(slot)
    assert close(slot.down_Bps, 1e9 / 8 / 53)  # stealing and backups weigh it too


def _shared_ap_planner() -> tuple[StepPlanner, list[DeviceSlot]]:
    """6 phones (100/20 Mbit) below a 300/60 Mbit access point, 2 laptops on the core."""
    config = SimpleNamespace(
        planner="auto", planned_groups=[("phones", 6, 12.0), ("laptops", 2, 150.0)],
        group_links={"phones": (100e6 / 8, 20e6 / 8, 0.02),
                     "laptops": (300e6 / 8, 100e6 / 8, 0.01)},
        plan_links={}, fair_share_paths={"phones": ("ap0",), "laptops": ()},
        ps_link_Bps=(1e9 / 8, 1e9 / 8), group_paths={}, shared_down_Bps={},
        switch_links={"ap0": (300e6 / 8, 60e6 / 8, "")},
        max_message_bytes=64 << 20, tile_m=256, tile_n=256)
    slots = [DeviceSlot(f"d{i}", f"phones-{i}", 12.0, 4, 1 << 20, group="phones")
             for i in range(6)]
    slots += [DeviceSlot(f"l{i}", f"laptops-{i}", 150.0, 4, 1 << 20, group="laptops")
              for i in range(2)]
    return StepPlanner(config), slots  # type: ignore[arg-type]


def test_a_half_plan_is_the_same_whatever_counts_came_before() -> None:
    """6 and 5 phones both halve to 3, at different shares of the access point: a pair's half
    plan made for 6 must not serve 5 (a restarted PS with 5 would cut otherwise)."""
    dx = (4096, 1024, 256)
    before, slots = _shared_ap_planner()
    before._step_counts = {"phones": 6, "laptops": 2}
    before._split_pair(dx, 4, slots)
    before._step_counts = {"phones": 5, "laptops": 2}
    fresh, _ = _shared_ap_planner()
    fresh._step_counts = {"phones": 5, "laptops": 2}
    plans = [p._plan_for(4096, 1024, 256, 4, slots, 0) for p in (before, fresh)]
    assert plans[0] == plans[1]


def test_a_device_keeps_its_pair_half_while_others_come_and_go() -> None:
    planner, slots = _shared_ap_planner()
    phones = slots[:6]
    planner._meet(slots)

    def half(h: int, present: list[DeviceSlot]) -> list[str]:
        return [s.name for s in planner.half_of(present, h, planner._in_group)
                if s.group == "phones"]
    assert half(0, phones) == ["phones-0", "phones-2", "phones-4"]
    gone = [s for s in phones if s.name != "phones-1"]  # by name, 3 and 5 would change halves
    assert half(0, gone) == ["phones-0", "phones-2", "phones-4"]
    assert half(1, gone) == ["phones-3", "phones-5"]
    late = DeviceSlot("d9", "phones-00", 12.0, 4, 1 << 20, group="phones")  # joins: place 6
    planner._meet([*gone, late])
    assert half(0, [*gone, late]) == ["phones-0", "phones-00", "phones-2", "phones-4"]
    assert StepPlanner.half_of(gone, 1) == [gone[1], gone[3]]  # no places: by name
