"""The replay plan: group expansion, starting state, ordering, consistency, seeded selectors."""

from __future__ import annotations

import pytest

from testbed.churn.schedule import ChurnAction, build_schedule
from testbed.churn.trace import ChurnEvent, TraceError, parse_trace

GROUPS = {"phones": [f"phones-{i}" for i in range(4)], "laptops": ["laptops-0", "laptops-1"]}
HEADER = "time_s,device,event,arg\n"


def _schedule(rows: str, seed: int = 0, groups: dict[str, list[str]] | None = None):
    return build_schedule(parse_trace(HEADER + rows, "t.csv"), groups or GROUPS, seed)


def _plan(schedule) -> list[tuple[float, str, str]]:
    return [(a.time_s, a.device, a.event.value) for a in schedule.actions]


def test_group_events_expand_to_members_in_topology_order() -> None:
    schedule = _schedule("10,laptops,partition,\n10,phones-2,leave,\n20,laptops,heal,\n"
                         "30,phones,slow,2\n")
    assert _plan(schedule) == [
        (10.0, "laptops-0", "partition"), (10.0, "laptops-1", "partition"),
        (10.0, "phones-2", "leave"),
        (20.0, "laptops-0", "heal"), (20.0, "laptops-1", "heal"),
        (30.0, "phones-0", "slow"), (30.0, "phones-1", "slow"), (30.0, "phones-2", "slow"),
        (30.0, "phones-3", "slow"),
    ]
    assert all(a.factor == 2.0 for a in schedule.actions if a.event is ChurnEvent.SLOW)
    assert schedule.actions[0] == ChurnAction(10.0, "laptops-0", ChurnEvent.PARTITION, None, 2,
                                              "laptops")
    assert schedule.devices == ("phones-0", "phones-1", "phones-2", "phones-3", "laptops-0",
                                "laptops-1")


def test_a_device_whose_first_event_is_join_starts_absent() -> None:
    schedule = _schedule("5,phones-1,join,\n6,phones,leave,\n8,laptops-0,crash,\n"
                         "9,laptops-0,join,\n")
    assert schedule.initially_present == {"phones-0", "phones-2", "phones-3", "laptops-0",
                                          "laptops-1"}
    assert _plan(schedule)[0] == (5.0, "phones-1", "join")
    # after the group leave at 6 s every phone is gone
    assert schedule.availability([0, 5, 6, 8, 9]) == [(5, 5), (6, 6), (2, 2), (1, 1), (2, 2)]


def test_presence_events_at_time_zero_set_the_starting_state() -> None:
    schedule = _schedule("0,phones-3,leave,\n0,phones-0,crash,\n0,laptops-1,partition,\n"
                         "4,phones-3,join,\n")
    assert "phones-3" not in schedule.initially_present
    assert "phones-0" not in schedule.initially_present
    # partition at 0 stays an action (testbed up applies it when the run starts)
    assert _plan(schedule) == [(0.0, "laptops-1", "partition"), (4.0, "phones-3", "join")]


@pytest.mark.parametrize("rows, expected", [
    ("5,phones-0,leave,\n6,phones-0,crash,\n",
     "line 3: crash phones-0: phones-0 is already absent (since line 2)"),
    ("5,phones-0,join,\n",
     None),  # first event join: absent at start, so the join is fine
    ("5,phones-0,leave,\n6,phones,leave,\n",
     "line 3: leave phones: phones-0 is already absent (since line 2)"),
    ("5,phones-1,heal,\n", "line 2: heal phones-1: phones-1 is not partitioned"),
    ("5,laptops,partition,\n6,laptops-1,partition,\n",
     "line 3: partition laptops-1: laptops-1 is already partitioned"),
    ("5,phones-0,crash,\n6,phones-0,join,\n7,phones-0,join,\n",
     "line 4: join phones-0: phones-0 is already present (since line 3)"),
])
def test_inconsistent_events_are_errors_with_line_numbers(rows: str, expected: str | None
                                                          ) -> None:
    if expected is None:
        _schedule(rows)
        return
    with pytest.raises(TraceError) as info:
        _schedule(rows)
    assert info.value.problems == [expected]


def test_partition_and_slow_apply_to_absent_devices() -> None:
    schedule = _schedule("1,phones-0,leave,\n2,phones-0,partition,\n3,phones-0,slow,4\n"
                         "4,phones-0,join,\n5,phones-0,heal,\n")
    assert schedule.states_at(4.5)["phones-0"] == (True, True, 4.0)
    assert schedule.states_at(5)["phones-0"] == (True, False, 4.0)
    assert schedule.availability([4.5]) == [(6, 5)]


def test_equal_times_keep_file_order_then_topology_order() -> None:
    schedule = _schedule("3,phones-3,leave,\n3,laptops,slow,2\n3,phones-0,leave,\n")
    assert [(a.device, a.line) for a in schedule.actions] == [
        ("phones-3", 2), ("laptops-0", 3), ("laptops-1", 3), ("phones-0", 4)]


def test_selectors_are_seeded_and_pick_among_eligible_devices() -> None:
    rows = "10,phones:2,leave,\n20,phones:50%,crash,\n30,phones:3,join,\n"
    picks = {}
    for seed in range(6):
        a = _schedule(rows, seed)
        b = _schedule(rows, seed)
        assert a == b  # same seed, same schedule
        left = [x.device for x in a.actions if x.event is ChurnEvent.LEAVE]
        crashed = [x.device for x in a.actions if x.event is ChurnEvent.CRASH]
        joined = [x.device for x in a.actions if x.event is ChurnEvent.JOIN]
        assert len(left) == 2 and len(crashed) == 2 and len(joined) == 3
        assert not set(left) & set(crashed)  # a crash picks among present phones only
        assert set(joined) <= set(left) | set(crashed)  # a join picks among absent phones only
        picks[seed] = tuple(left)
    assert len(set(picks.values())) > 1  # the seed really chooses


def test_a_selector_that_cannot_be_satisfied_is_an_error() -> None:
    with pytest.raises(TraceError) as info:
        _schedule("10,phones:3,leave,\n20,phones:2,leave,\n")
    assert info.value.problems == [
        "line 3: selector 'phones:2' needs 2 device(s) of 'phones' that can leave, only 1 can "
        f"({', '.join(sorted(set(GROUPS['phones']) - set(_left_at_10())))})"]


def _left_at_10() -> list[str]:
    return [a.device for a in _schedule("10,phones:3,leave,\n").actions]


def test_intervals_cover_presence_and_partitions() -> None:
    schedule = _schedule("2,phones-0,leave,\n5,phones-0,join,\n6,laptops-1,partition,\n"
                         "8,laptops-1,heal,\n9,phones-1,crash,\n")
    spans = schedule.intervals(10.0)
    assert spans["phones-0"]["present"] == [(0.0, 2.0), (5.0, 10.0)]
    assert spans["phones-1"]["present"] == [(0.0, 9.0)]
    assert spans["laptops-1"]["partitioned"] == [(6.0, 8.0)]
    assert schedule.counts_by_event() == {"join": 1, "leave": 1, "crash": 1, "partition": 1,
                                          "heal": 1, "slow": 0}


def test_to_dict_is_plain_data_for_the_event_log() -> None:
    action = _schedule("1.5,phones,slow,3\n").actions[0]
    assert action.to_dict() == {"time_s": 1.5, "device": "phones-0", "event": "slow",
                                "trace_line": 2, "trace_target": "phones", "factor": 3.0}


def test_load_schedule_expands_a_shipped_trace_over_the_default_topology() -> None:
    from pathlib import Path

    from testbed.churn.schedule import load_schedule
    from testbed.topology import load_topology

    root = Path(__file__).resolve().parents[2]
    topology = load_topology(root / "topologies" / "default.yaml")
    schedule = load_schedule(root / "traces" / "mass-departure.csv", topology)
    assert schedule.seed == topology.seed
    assert schedule.initially_present == set(schedule.devices)
    left = {a.device for a in schedule.actions if a.time_s == 60 and a.event is ChurnEvent.LEAVE}
    back = {a.device for a in schedule.actions if a.time_s == 150}
    assert len(left) == 4 and left == back and all(d.startswith("phones-") for d in left)
    assert schedule.availability([59, 60, 150, 180]) == [(8, 8), (3, 3), (7, 7), (8, 8)]
    assert load_schedule(root / "traces" / "mass-departure.csv", topology) == schedule


@pytest.mark.parametrize("seed", range(20))
def test_the_timeline_walk_agrees_with_the_intervals(seed: int) -> None:
    """availability, states_at and ever_reachable (one walk, ``_Replay``) against what
    ``intervals`` (a walk of its own) says at every action's time and between."""
    import random
    rng = random.Random(seed)
    devices = [d for members in GROUPS.values() for d in members]
    present = {d: rng.random() < 0.5 for d in devices}
    cut = dict.fromkeys(devices, False)
    seen: dict[str, bool] = {}
    rows, time_s = [], 0
    for _ in range(rng.randrange(1, 30)):
        time_s += rng.choice((0, 0, 1, 3))
        d = rng.choice(devices)
        event = rng.choice(("join" if not present[d] else rng.choice(("leave", "crash")),
                            "heal" if cut[d] else "partition"))
        if not present[d] and not seen.get(d):  # one that starts absent joins first
            event = "join"
        seen[d] = True
        present[d] = event == "join" if event in ("join", "leave", "crash") else present[d]
        cut[d] = event == "partition" if event in ("partition", "heal") else cut[d]
        rows.append(f"{time_s},{d},{event},\n")
    schedule = _schedule("".join(rows))
    times = sorted({0.0, *(a.time_s for a in schedule.actions),
                    *(a.time_s + 0.5 for a in schedule.actions)})
    spans = schedule.intervals(end_s=times[-1] + 1)

    def inside(t: float, d: str, kind: str) -> bool:
        return any(start <= t < end for start, end in spans[d][kind])

    expected = [(sum(inside(t, d, "present") for d in devices),
                 sum(inside(t, d, "present") and not inside(t, d, "partitioned")
                     for d in devices)) for t in times]
    assert schedule.availability(times) == expected
    for t in times:
        assert {d: s[:2] for d, s in schedule.states_at(t).items()} == {
            d: (inside(t, d, "present"), inside(t, d, "partitioned")) for d in devices}
    assert schedule.ever_reachable() == any(reachable for _, reachable in expected)


@pytest.mark.parametrize("members, wanted", [(1, 1), (3, 2), (4, 2), (5, 3), (7, 4), (9, 5)])
def test_a_share_of_a_group_is_rounded_half_up(members: int, wanted: int) -> None:
    """`phones:50%` takes half the group rounded as docs/churn.md says: half up (round() took
    2 of 5 and 4 of 9, half to even), and at least one."""
    groups = {"phones": [f"phones-{i}" for i in range(members)]}
    schedule = _schedule("10,phones:50%,leave,\n", groups=groups)
    assert len(schedule.actions) == wanted


@pytest.mark.parametrize("rows, since", [
    ("10,phones,leave,\n10,laptops,crash,\n", 10.0),  # everyone gone at 10 s, none back
    ("10,phones,leave,\n10,laptops,partition,\n", 10.0),  # the laptops present, cut off
    ("5,phones,leave,\n10,laptops,leave,\n20,phones-1,join,\n", None),  # one comes back
    ("5,phones,leave,\n10,laptops,leave,\n20,phones-1,join,\n30,phones-1,crash,\n", 30.0),
    ("10,laptops,partition,\n20,laptops,heal,\n", None),
    ("5,phones-0,leave,\n", None),
])
def test_when_a_schedule_leaves_no_device_for_good(rows: str, since: float | None) -> None:
    # allgo.csv (every device leaves at 10 s) passed validate and `testbed simulate` stalled
    # after its second step
    assert _schedule(rows).unreachable_for_good_s() == since
