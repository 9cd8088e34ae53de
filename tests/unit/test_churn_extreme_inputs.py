"""Churn inputs a fuzz pass found accepted (and then hanging, crashing or printing ``inf``):
each is refused with exit 2 (or its InputError), naming the file and line, the client and field,
or the option, before anything is drawn, imported or written."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest

from testbed.churn.generate import MAX_SHAPE, MIN_SHAPE, SessionModel, generate_events
from testbed.churn.sessions import parse_sessions, session_events
from testbed.churn.trace import MAX_SLOW_FACTOR, MAX_TIME_S, TraceError, parse_trace
from testbed.cli import main
from testbed.topology import MAX_STRAGGLER_FACTOR
from tests.conftest import REPO

HOME = str(REPO / "topologies" / "home-wifi.yaml")
GEN = ["trace", "gen", "--topology", HOME, "--duration", "10min", "--session-mean", "90s",
       "--absence-mean", "40s"]


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().err


# 1. slow factor ---------------------------------------------------------------------------------

def test_a_slow_factor_over_the_straggler_cap_is_refused_with_its_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert MAX_SLOW_FACTOR == MAX_STRAGGLER_FACTOR  # one cap, not a second number
    trace = tmp_path / "slow.csv"
    trace.write_text("time_s,device,event,arg\n0.1,phones,slow,1e12\n")
    assert main(["trace", "show", str(trace), "--topology", HOME]) == 2
    err = _error(capsys)
    assert str(trace) in err and "line 2: the slow factor" in err and "from 0.001 to 1000" in err
    # the cap itself is a valid factor
    parse_trace(f"time_s,device,event,arg\n0,phones,slow,{MAX_STRAGGLER_FACTOR:g}\n")


# 2. times past a year or infinite once in seconds ----------------------------------------------

@pytest.mark.parametrize("header, cell", [("time_h", "1e308"),  # inf once in seconds
                                          ("time_s", f"{MAX_TIME_S * 1.01:g}"),
                                          ("time_us", "1e300")])
def test_a_trace_time_past_a_year_is_refused_with_its_line(
        header: str, cell: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "late.csv"
    trace.write_text(f"# comment\n{header},device,event,arg\n{cell},phones-0,leave,\n")
    assert main(["trace", "show", str(trace)]) == 2
    err = _error(capsys)
    assert str(trace) in err and "line 3: time" in err and "a year" in err, err
    assert "inf" not in err.replace("infinite", "")


# 3. Weibull shape ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["0.001", "0.02", "0.05", "21", "nan"])
def test_gen_refuses_a_weibull_shape_out_of_range(shape: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    assert main([*GEN, "--dist", "weibull", "--shape", shape]) == 2
    assert time.monotonic() - started < 5
    err = _error(capsys)
    assert "--shape: must be from 0.1 to 20" in err and "OverflowError" not in err, err


@pytest.mark.parametrize("shape", [MIN_SHAPE, MAX_SHAPE])
def test_the_shape_limits_themselves_generate_quickly(shape: float) -> None:
    started = time.monotonic()
    generate_events([f"phones-{i}" for i in range(8)],
                    SessionModel(90.0, 40.0, "weibull", shape), 600.0, seed=7)
    assert time.monotonic() - started < 5


# 4. FedScale: ints too large for a float -------------------------------------------------------

@pytest.mark.parametrize("client, field", [
    ({"active": [0], "inactive": [10], "finish_time": 10**400}, "finish_time"),
    ({"active": [10**400], "inactive": [10], "finish_time": 10}, "active"),
    ({"active": [0], "inactive": [10**5000], "finish_time": 10}, "inactive"),
])
def test_fedscale_refuses_an_int_too_large_for_a_float(
        client: dict[str, object], field: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "huge.pkl"
    source.write_bytes(pickle.dumps({"c0": client}))
    assert main(["trace", "import", "fedscale", str(source), "--topology", HOME]) == 2
    err = _error(capsys)
    assert str(source) in err and f"client 'c0'.{field}: expected" in err, err
    assert "too large for a float" in err and len(err) < 1000


def test_fedscale_refuses_a_span_that_replays_past_a_year(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "ok.pkl"
    source.write_bytes(pickle.dumps({"c0": {"active": [0], "inactive": [10],
                                            "finish_time": 100}}))
    assert main(["trace", "import", "fedscale", str(source), "--topology", HOME,
                 "--duration", "1h", "--time-scale", "1e-9"]) == 2
    err = _error(capsys)
    assert "--time-scale" in err and "a year" in err and "<output>" not in err, err


# 5. --groups naming no group --------------------------------------------------------------------

@pytest.mark.parametrize("groups", [",", "", " , ,"])
def test_gen_refuses_groups_that_name_no_group(groups: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "empty.csv"
    assert main([*GEN, "--groups", groups, "-o", str(out)]) == 2
    assert "--groups:" in _error(capsys) and not out.exists()


# 6. session lists -------------------------------------------------------------------------------

def test_a_session_shorter_than_a_millisecond_is_refused_with_its_line() -> None:
    text = "device,start_s,end_s\nphones-0,0,0.0004\nphones-0,10,20\nphones-1,1,1.0004\n"
    with pytest.raises(TraceError) as info:
        parse_sessions(text, ["phones-0", "phones-1"], "s.csv")
    assert [p.split(":")[0] for p in info.value.problems] == ["line 2", "line 4"]
    assert "shorter than the millisecond" in str(info.value) and "s.csv" in str(info.value)


def test_sessions_are_rounded_to_milliseconds_before_they_merge() -> None:
    # apart by 0.3 ms, touching once rounded: one session, never a leave and a join at 1.0 s
    sessions = parse_sessions("device,start_s,end_s\nphones-0,0,1.0001\nphones-0,1.0004,2\n",
                              ["phones-0"], "s.csv")
    assert sessions == {"phones-0": [(0.0, 2.0)]}
    assert [(e.time_s, e.event.value) for e in session_events(sessions, ["phones-0"])] == \
        [(2.0, "leave")]


def test_a_session_end_that_overflows_is_refused_not_read_as_open() -> None:
    with pytest.raises(TraceError) as info:
        parse_sessions("device,start_h,end_h\nphones-0,0,1e308\n", ["phones-0"], "s.csv")
    assert info.value.problems[0].startswith("line 2: end 1e+308 h is past"), info.value


def test_a_session_start_past_a_year_names_the_input_file_and_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "sessions.csv"
    source.write_text("device,start_h,end_h\nphones-0,0,1\nphones-1,1e308,\n")
    assert main(["trace", "import", "sessions", str(source), "--topology", HOME]) == 2
    err = _error(capsys)
    assert f"{source}: 1 problem(s)" in err and "line 3: start 1e+308 h" in err, err
    assert "<output>" not in err


# 7. other trace gen options without a practical upper limit -------------------------------------

@pytest.mark.parametrize("change, option", [
    (["--duration", "600000min"], "--duration"),  # past a year
    (["--session-mean", "1e9h"], "--session-mean"),
    (["--absence-mean", "1e-300s"], "--absence-mean"),  # below the trace's millisecond
    (["--diurnal-period", "1e-300s"], "--diurnal-period"),  # cos(inf): math domain error
    (["--diurnal-peak", "1e300s"], "--diurnal-peak"),
])
def test_gen_refuses_durations_and_means_out_of_range(
        change: list[str], option: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = list(GEN)
    if change[0] in argv:
        argv[argv.index(change[0]) + 1] = change[1]
    else:
        argv.extend(change)
    assert main(argv) == 2
    err = _error(capsys)
    assert f"{option}: must be from" in err
    assert "3.1536e+07" not in err, err  # a year is 31,536,000 s


def test_gen_counts_events_with_the_shortest_absences_of_the_daily_cycle(
        capsys: pytest.CaptureFixture[str]) -> None:
    # 1 ms sessions and 1 h absences: 48 events estimated from the means; the daily cycle clips
    # availability at 1 %, absences at 99 ms, and the trace would hold some 1,100,000 events
    started = time.monotonic()
    assert main(["trace", "gen", "--topology", HOME, "--duration", "3h", "--session-mean",
                 "1ms", "--absence-mean", "1h", "--diurnal-amplitude", "0.5"]) == 2
    assert time.monotonic() - started < 5
    err = _error(capsys)
    # the span in plain digits: "over 1.08e+04 s" for the 3h given
    assert "--duration: 8 device(s) over 10,800 s with a session and an absence every 0.1 s" \
        in err, err
