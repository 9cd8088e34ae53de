"""Importers: FedScale's client_behave_trace (restricted unpickling) and plain session lists."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from testbed.churn.fedscale import (
    FedScaleError,
    import_events,
    load_behave_trace,
    parse_behave_trace,
    restricted_loads,
)
from testbed.churn.schedule import build_schedule
from testbed.churn.sessions import load_sessions, parse_sessions
from testbed.churn.trace import TraceError, format_trace, parse_trace

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "churn"
DEVICES = ["phones-0", "phones-1", "phones-2"]
# Two FedScale clients in FedScale's shape (extra keys 'duration' and 'model' are ignored).
BEHAVE = {
    11: {"duration": 211, "inactive": [50, 150], "finish_time": 200, "active": [0, 100],
         "model": "SM-G9"},
    42: {"duration": 40, "inactive": [60], "finish_time": 100, "active": [20], "model": "x"},
}


def _rows(events) -> list[tuple[float, str, str]]:
    return [(e.time_s, e.target, e.event.value) for e in events]


@pytest.fixture
def behave_pickle(tmp_path: Path) -> Path:
    """A tiny client_behave_trace pickle written the way FedScale's file is (a plain dict)."""
    path = tmp_path / "client_behave_trace"
    path.write_bytes(pickle.dumps(BEHAVE))
    return path


def test_fedscale_import_gives_the_expected_events(behave_pickle: Path) -> None:
    clients = load_behave_trace(behave_pickle)
    assert [c.key for c in clients] == ["11", "42"]
    events = import_events(clients, DEVICES, start_s=0.0, duration_s=300.0)
    # device i takes client i mod 2: phones-0 and phones-2 -> 11, phones-1 -> 42
    assert _rows(events) == [
        (20.0, "phones-1", "join"),
        (50.0, "phones-0", "leave"), (50.0, "phones-2", "leave"),
        (60.0, "phones-1", "leave"),
        (100.0, "phones-0", "join"), (100.0, "phones-2", "join"),
        (120.0, "phones-1", "join"),
        (150.0, "phones-0", "leave"), (150.0, "phones-2", "leave"),
        (160.0, "phones-1", "leave"),
        (200.0, "phones-0", "join"), (200.0, "phones-2", "join"),
        (220.0, "phones-1", "join"),
        (250.0, "phones-0", "leave"), (250.0, "phones-2", "leave"),
        (260.0, "phones-1", "leave"),
    ]
    schedule = build_schedule(parse_trace(format_trace(events)), {"phones": DEVICES}, 0)
    assert schedule.initially_present == {"phones-0", "phones-2"}  # client 11 active at 0


def test_fedscale_import_matches_fedscales_activity_rule(behave_pickle: Path) -> None:
    clients = load_behave_trace(behave_pickle)
    events = import_events(clients, DEVICES, start_s=0.0, duration_s=1000.0)
    schedule = build_schedule(parse_trace(format_trace(events)), {"phones": DEVICES}, 0)
    for t in [0.5 + 7.3 * i for i in range(130)]:
        states = schedule.states_at(t)
        for i, device in enumerate(DEVICES):
            assert states[device][0] == clients[i % 2].is_active(t), (device, t)


def test_fedscale_start_and_time_scale(behave_pickle: Path) -> None:
    clients = load_behave_trace(behave_pickle)
    events = import_events(clients, DEVICES[:1], start_s=100.0, duration_s=200.0,
                           time_scale=10.0)
    assert _rows(events) == [(5.0, "phones-0", "leave"), (10.0, "phones-0", "join"),
                             (15.0, "phones-0", "leave")]
    # default span: up to the longest finish_time among the clients used
    events = import_events(clients, DEVICES[:2])  # 200 s: client 11's finish_time
    assert [r for r in _rows(events) if r[1] == "phones-1"] == [
        (20.0, "phones-1", "join"), (60.0, "phones-1", "leave"),
        (120.0, "phones-1", "join"), (160.0, "phones-1", "leave")]


class _RunsCode:
    """An object whose pickle calls os.system when loaded by a plain pickle.load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_a_pickle_that_carries_code_is_refused(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps({1: {"active": [0], "inactive": [5], "finish_time": 10,
                                       "model": _RunsCode(marker)}}, protocol=protocol))
    with pytest.raises(FedScaleError) as info:
        load_behave_trace(path)
    assert "refused" in str(info.value)
    assert "system" in str(info.value)  # names the global it asked for (posix.system)
    assert not marker.exists()


def test_restricted_unpickler_accepts_plain_data_only() -> None:
    plain = {"a": [1, 2.5, None, True], "b": (1, "x"), "c": {3, 4}, 7: {"d": -1e300}}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert restricted_loads(pickle.dumps(plain, protocol=protocol)) == plain
    from collections import OrderedDict

    with pytest.raises(FedScaleError, match="collections.OrderedDict"):
        restricted_loads(pickle.dumps(OrderedDict(a=1)))
    with pytest.raises(FedScaleError, match="not a readable pickle"):
        restricted_loads(b"\x80\x04garbage")


@pytest.mark.parametrize("data, expected", [
    ([], "expected a non-empty dict"),
    ({1: [0, 1]}, "client 1: expected a dict"),
    ({1: {"active": [0]}}, "client 1: missing key 'inactive'"),
    ({1: {"active": [0, 5], "inactive": [3], "finish_time": 10}}, "of equal length"),
    ({1: {"active": [4], "inactive": [3], "finish_time": 10}}, "window 0 ends (3) before"),
    ({1: {"active": ["0"], "inactive": [3], "finish_time": 10}}, "client 1.active: expected"),
    ({1: {"active": [0], "inactive": [3], "finish_time": 0}}, "client 1.finish_time"),
])
def test_fedscale_shape_errors_name_the_client_and_field(data: object, expected: str) -> None:
    with pytest.raises(FedScaleError) as info:
        parse_behave_trace(data, "x.pkl")
    assert expected in str(info.value)


def test_session_list_import() -> None:
    devices = ["phones-0", "phones-1", "phones-2", "laptops-0"]
    events = load_sessions(DATA / "sessions.csv", devices)
    assert _rows(events) == [
        (10.0, "laptops-0", "join"),
        (60.0, "phones-1", "join"),
        (80.0, "laptops-0", "leave"),  # 10..50 and 40..80 merged
        (90.5, "phones-1", "leave"),
        (120.0, "phones-0", "leave"),
        (300.0, "phones-0", "join"),  # open-ended: no leave
    ]
    schedule = build_schedule(parse_trace(format_trace(events)), {"phones": devices[:3],
                                                                 "laptops": devices[3:]}, 0)
    # phones-2 is not listed: present throughout; phones-1, laptops-0 start absent
    assert schedule.initially_present == {"phones-0", "phones-2"}


@pytest.mark.parametrize("text, expected", [
    ("device,start,end\n", "line 1: expected the header 'device,start_s,end_s'"),
    ("device,start_s,end_min\n", "line 1: start and end must use the same unit"),
    ("device,start_s,end_s\nphones-9,0,1\n", "line 2: unknown device 'phones-9' (not a device "
     "of the topology; group 'phones' has 1: phones-0)"),
    ("device,start_s,end_s\ntablets-0,0,1\n", "line 2: unknown device 'tablets-0' (not a device "
     "of the topology; groups: phones)"),
    ("device,start_s,end_s\nphones-0,5,5\n", "line 2: a session must end after it starts"),
    ("device,start_s,end_s\nphones-0,5ms,9\n", "line 2: start '5ms' is not a number"),
])
def test_session_list_errors_have_line_numbers(text: str, expected: str) -> None:
    with pytest.raises(TraceError) as info:
        parse_sessions(text, ["phones-0"], "s.csv")
    assert info.value.problems[0].startswith(expected), info.value.problems


def test_a_tiny_finish_time_is_refused_before_memory_grows(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    from testbed.cli import main

    # 81 bytes: one client whose windows repeat every 1e-300 s (~1e300 periods in any span)
    source = tmp_path / "tiny"
    source.write_bytes(pickle.dumps({0: {"active": [0], "inactive": [1e-300],
                                         "finish_time": 1e-300}}))
    assert source.stat().st_size < 100
    topology = str(Path(__file__).resolve().parents[2] / "topologies" / "default.yaml")
    code = main(["trace", "import", "fedscale", str(source), "--topology", topology,
                 "--duration", "1h"])
    assert code == 2
    assert "client 0.finish_time" in capsys.readouterr().err


def test_an_import_that_would_write_too_many_events_is_refused() -> None:
    from testbed.churn.fedscale import MAX_EVENTS, ClientWindows

    # a legal 1 ms period over a day: 8.64e7 windows per device, far over the bound
    client = ClientWindows("c", (0.0,), (0.0005,), 0.001)
    with pytest.raises(FedScaleError, match="more than the"):
        import_events([client], DEVICES, duration_s=86_400.0)
    # the same client over a short span stays under the bound and gives the windows' events
    # (slowed down tenfold: a 0.5 ms window is shorter than a trace row's millisecond)
    events = import_events([client], DEVICES[:1], duration_s=0.01, time_scale=0.1)
    assert 0 < len(events) <= MAX_EVENTS and events[-1].time_s <= 0.1


def test_an_oversized_cell_in_a_session_list_names_its_line() -> None:
    text = "device,start_s,end_s\n" + f"phones-0,0,{'9' * 200_000}\n"
    with pytest.raises(TraceError) as info:
        parse_sessions(text, DEVICES, "s.csv")
    assert info.value.problems[0].startswith("line 2: 200,011 characters is longer than")
