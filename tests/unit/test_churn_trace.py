"""The churn trace format: parsing, units, validation with line numbers, shipped traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.churn.schedule import build_schedule, groups_of
from testbed.churn.trace import (
    ChurnEvent,
    TraceError,
    TraceEvent,
    format_trace,
    load_trace,
    parse_trace,
)
from testbed.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "churn"
GROUPS = {"phones": [f"phones-{i}" for i in range(6)], "laptops": ["laptops-0", "laptops-1"]}


def _problems(text: str, groups: dict[str, list[str]] | None = None) -> list[str]:
    with pytest.raises(TraceError) as info:
        parse_trace(text, "t.csv", groups)
    assert str(info.value).startswith("t.csv: ")
    return info.value.problems


def test_parses_rows_comments_units_and_slow_factor() -> None:
    trace = parse_trace("# a comment\n\ntime_min,device,event,arg\n"
                        "0.5,phones-0,leave,\n1,phones,slow,2.5\n1,laptops-1,partition\n")
    assert [(e.time_s, e.target, e.event, e.factor, e.line) for e in trace.events] == [
        (30.0, "phones-0", ChurnEvent.LEAVE, None, 4),
        (60.0, "phones", ChurnEvent.SLOW, 2.5, 5),
        (60.0, "laptops-1", ChurnEvent.PARTITION, None, 6),
    ]
    assert trace.duration_s == 60.0


@pytest.mark.parametrize("header, unit_s", [("time_s", 1.0), ("time_ms", 1e-3), ("time_h", 3600.0)])
def test_time_unit_comes_from_the_header(header: str, unit_s: float) -> None:
    trace = parse_trace(f"{header},device,event,arg\n2,phones-0,crash,\n")
    assert trace.events[0].time_s == pytest.approx(2 * unit_s)


@pytest.mark.parametrize("header, expected", [
    ("time,device,event,arg", "line 1: the time column 'time' does not name its unit"),
    ("time_sec,device,event,arg", "line 1: unknown time unit 'sec'"),
    ("time_s,device,event", "line 1: expected the header 'time_s,device,event,arg'"),
    ("seconds,device,event,arg", "line 1: the time column 'seconds' does not name its unit"),
])
def test_bad_units_in_the_header_are_refused(header: str, expected: str) -> None:
    problems = _problems(f"{header}\n1,phones-0,leave,\n")
    assert problems[0].startswith(expected), problems


def test_a_unit_in_a_time_cell_is_refused_with_its_line() -> None:
    problems = _problems("time_s,device,event,arg\n10ms,phones-0,leave,\n")
    assert problems == ["line 2: time '10ms' is not a number (write a bare number; the header "
                        "names the unit, s)"]


def test_unknown_event_names_the_line_and_the_choices() -> None:
    problems = _problems("time_s,device,event,arg\n1,phones-0,reboot,\n")
    assert problems == ["line 2: unknown event 'reboot'; expected one of join, leave, crash, "
                        "partition, heal, slow"]


def test_time_going_backwards_names_both_lines() -> None:
    problems = _problems("time_s,device,event,arg\n5,phones-0,leave,\n# gap\n4,phones-1,leave,\n")
    assert problems == ["line 4: time goes backwards: 4 is before the time of line 2 (5)"]


def test_unknown_device_against_a_topology() -> None:
    problems = _problems("time_s,device,event,arg\n1,tablets-0,leave,\n2,phones:9,leave,\n"
                         "3,tablets:1,leave,\n4,phones,leave,\n", GROUPS)
    assert problems[0].startswith("line 2: unknown device 'tablets-0'")
    assert problems[1] == ("line 3: selector 'phones:9' asks for 9 devices but group 'phones' "
                           "has 6")
    assert problems[2].startswith("line 4: unknown group 'tablets' in selector 'tablets:1'")
    assert len(problems) == 3  # a group name is a valid target


def test_an_unknown_device_of_a_known_group_names_the_devices_the_group_has() -> None:
    # flaky-phones.csv (six phones) against tiny's three said "groups: phones, laptops" alone
    groups = {"phones": ["phones-0", "phones-1", "phones-2"], "laptops": ["laptops-0"],
              "phones-a": ["phones-a-0"]}
    problems = _problems("time_s,device,event,arg\n1,phones-4,leave,\n2,laptops-1,leave,\n"
                         "3,phones-a-7,leave,\n4,tablets-0,leave,\n", groups)
    assert problems == [
        "line 2: unknown device 'phones-4' (not a device or group of the topology; group "
        "'phones' has 3: phones-0 .. phones-2)",
        "line 3: unknown device 'laptops-1' (not a device or group of the topology; group "
        "'laptops' has 1: laptops-0)",
        "line 4: unknown device 'phones-a-7' (not a device or group of the topology; group "
        "'phones-a' has 1: phones-a-0)",
        "line 5: unknown device 'tablets-0' (not a device or group of the topology; groups: "
        "phones, laptops, phones-a)"]


def test_every_problem_of_a_malformed_file_is_reported_at_once() -> None:
    with pytest.raises(TraceError) as info:
        load_trace(DATA / "malformed.csv", GROUPS)
    lines = [p.split(":", 1)[0] for p in info.value.problems]
    assert lines == [f"line {n}" for n in (4, 5, 6, 7, 8, 9, 10)]
    assert "slow,2.0" in info.value.problems[4]  # the hint for slow(2.0)
    assert str(DATA / "malformed.csv") in str(info.value)


@pytest.mark.parametrize("row, expected", [
    ("1,phones-0,slow,", "'slow' needs a factor"),
    ("1,phones-0,slow,0", "the slow factor must be a finite number from 0.001 to 1000"),
    ("1,phones-0,slow,-2", "the slow factor must be a finite number from 0.001 to 1000"),
    # a device sped up a millionfold: its tiles' time errors broke a finished run's records
    ("1,phones-0,slow,0.000001", "the slow factor must be a finite number from 0.001 to 1000"),
    ("1,phones-0,slow,5e-324", "the slow factor must be a finite number from 0.001 to 1000"),
    ("1,phones-0,leave,2", "'leave' takes no argument"),
    ("-1,phones-0,leave,", "time must be a finite number >= 0"),
    ("inf,phones-0,leave,", "time must be a finite number >= 0"),
    ("1,Phones_0,leave,", "'Phones_0' is not a device name"),
    ("1,,leave,", "the device cell is empty"),
    ("1,phones:0,leave,", "picks no device"),
    ("1,phones:150%,leave,", "the percentage must be in (0, 100]"),
    ("1,phones-0,leave,,extra", "expected 4 cells"),
])
def test_bad_rows(row: str, expected: str) -> None:
    problems = _problems(f"time_s,device,event,arg\n{row}\n")
    assert len(problems) == 1 and problems[0].startswith("line 2: ")
    assert expected in problems[0], problems


def test_empty_file_is_refused() -> None:
    assert _problems("# only a comment\n") == [
        "line 1: the trace is empty; expected the header 'time_s,device,event,arg'"]


def test_format_round_trips() -> None:
    events = [TraceEvent(0.0, "phones-0", ChurnEvent.LEAVE), TraceEvent(1.25, "phones",
                                                                       ChurnEvent.SLOW, 2.0),
              TraceEvent(7.0, "phones:50%", ChurnEvent.CRASH)]
    text = format_trace(events, ["made in a test"])
    assert text.splitlines()[:3] == ["# made in a test", "time_s,device,event,arg",
                                     "0,phones-0,leave,"]
    back = parse_trace(text)
    assert [(e.time_s, e.target, e.event, e.factor) for e in back.events] == \
        [(e.time_s, e.target, e.event, e.factor) for e in events]


@pytest.mark.parametrize("name", ["flaky-phones", "overnight-charging", "mass-departure",
                                  "partition-heal"])
def test_shipped_traces_validate_against_the_default_topology(name: str) -> None:
    topology = load_topology(ROOT / "topologies" / "default.yaml")
    groups = groups_of(topology)
    trace = load_trace(ROOT / "traces" / f"{name}.csv", groups)
    schedule = build_schedule(trace, groups, topology.seed)
    assert schedule.actions, name
    assert set(a.device for a in schedule.actions) <= set(schedule.devices)


def test_a_cell_over_the_csv_limit_is_a_problem_with_its_line(tmp_path: Path) -> None:
    # 200 KB in one quoted cell: the csv module itself refuses cells over 128 KiB
    path = tmp_path / "big.csv"
    path.write_text(f"time_s,device,event,arg\n0,phones-0,leave,\n1,\"{'x' * 200_000}\",crash,\n"
                    f"2,phones-1,crash,\n")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert info.value.problems == [
        "line 3: 200,011 characters is longer than the 1,024 a row may have"]
    assert str(path) in str(info.value)
