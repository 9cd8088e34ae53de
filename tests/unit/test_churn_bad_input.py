"""Bad input to `testbed trace gen|import` and the churn readers that an audit found accepted or
blamed on the wrong file: each is refused up front with exit 2, naming the option or client and
what was expected, and nothing is written (an existing output is left as it was)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from testbed.churn.fedscale import FedScaleError, import_events, parse_behave_trace
from testbed.churn.schedule import build_schedule
from testbed.churn.sessions import load_sessions, parse_sessions
from testbed.churn.trace import (
    ChurnEvent,
    TraceError,
    TraceEvent,
    format_trace,
    load_trace,
    parse_trace,
)
from testbed.cli import main
from tests.conftest import TINY

GEN = ["trace", "gen", "--topology", str(TINY), "--duration", "10min", "--session-mean", "1min",
       "--absence-mean", "30s"]
# FedScale's shape: windows [0, 50] and [100, 200] repeating every 300 s, and [10, 60]
WINDOWS = {"a": {"active": [0, 100], "inactive": [50, 200], "finish_time": 300},
           "b": {"active": [10], "inactive": [60], "finish_time": 300}}
BOM = "\ufeff"


def _sessions(text: str) -> dict[str, list[tuple[float, float]]]:
    return parse_sessions(text, ["phones-0"], "s.csv")


# 1. a group named twice -------------------------------------------------------------------------

@pytest.mark.parametrize("groups, twice", [("phones,phones", "phones"),
                                           ("phones, laptops ,phones,laptops", "phones, laptops")])
def test_gen_refuses_a_group_named_twice(groups: str, twice: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "trace.csv"
    assert main([*GEN, "--groups", groups, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --groups: {twice} named twice"), err
    assert "line " not in err and "Traceback" not in err
    assert not out.parent.exists()


def test_a_trace_made_that_fails_its_check_is_not_blamed_on_the_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import testbed.churn.generate

    def twice(*_: object) -> list[TraceEvent]:
        return [TraceEvent(1.0, "phones-0", ChurnEvent.LEAVE)] * 2

    monkeypatch.setattr(testbed.churn.generate, "generate_events", twice)
    out = tmp_path / "trace.csv"
    out.write_text("kept\n")
    assert main([*GEN, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"the trace made for {out} (not written)" in err and f"error: {out}:" not in err, err
    assert out.read_text() == "kept\n"


# 2. a --time-scale that makes sessions last nothing ---------------------------------------------

@pytest.mark.parametrize("scale", ["2e5", "1e6"])
def test_fedscale_refuses_a_time_scale_that_collapses_sessions(
        scale: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "client_behave_trace"
    source.write_bytes(pickle.dumps(WINDOWS))
    out = tmp_path / "fedscale.csv"
    out.write_text("kept\n")
    assert main(["trace", "import", "fedscale", str(source), "--topology", str(TINY),
                 "--time-scale", scale, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {source}: 2 client(s)"), err
    assert f"--time-scale {float(scale):g}" in err and "Traceback" not in err
    assert "client 'a': the window 0 .. 50 s" in err and "client 'b': the window 10 .. 60 s" in err
    assert "shorter than the millisecond a trace row resolves" in err  # as a session list says
    assert out.read_text() == "kept\n"


def test_fedscale_and_session_lists_round_and_refuse_alike() -> None:
    clients = parse_behave_trace({"c": {"active": [0, 1.0004], "inactive": [1.0001, 2],
                                        "finish_time": 10}})
    # apart by 0.3 ms, touching once rounded: one session, as in a session list
    assert [(e.time_s, e.event.value) for e in import_events(clients, ["phones-0"], 0.0, 5.0)] \
        == [(2.0, "leave")]
    assert _sessions("device,start_s,end_s\nphones-0,0,1.0001\nphones-0,1.0004,2\n") == \
        {"phones-0": [(0.0, 2.0)]}
    with pytest.raises(FedScaleError) as fed:
        import_events(clients, ["phones-0"], 0.0, 5.0, time_scale=5000.0)
    with pytest.raises(TraceError) as listed:
        _sessions("device,start_s,end_s\nphones-0,0,0.0004\n")
    shared = "shorter than the millisecond a trace row resolves: its join and leave would fall"
    assert shared in str(fed.value) and shared in str(listed.value)


def test_fedscale_leaves_instants_out_rather_than_refusing_them() -> None:
    # --start on a window's end gives an instant of presence, as does active == inactive: no
    # time to replay, so neither a refusal nor a join and a leave at 80 s
    clients = parse_behave_trace({"a": WINDOWS["a"], "p": {"active": [80], "inactive": [80],
                                                           "finish_time": 300}})
    devices = ["phones-0", "phones-1"]
    events = import_events(clients, devices, start_s=50.0, duration_s=200.0)
    schedule = build_schedule(parse_trace(format_trace(events)), {"phones": devices}, 0)
    assert schedule.initially_present == set()
    assert [(a.time_s, a.device, a.event.value) for a in schedule.actions] == [
        (50.0, "phones-0", "join"), (150.0, "phones-0", "leave")]


# 3. a byte order mark -------------------------------------------------------------------------

def test_churn_files_may_start_with_a_byte_order_mark(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(f"{BOM}time_ms,device,event,arg\n0,phones-0,leave,\n1500,phones-0,join,\n",
                     encoding="utf-8")
    events = load_trace(trace).events
    assert [(e.time_s, e.event.value) for e in events] == [(0.0, "leave"), (1.5, "join")]
    assert main(["trace", "show", str(trace), "--topology", str(TINY)]) == 0
    sessions = tmp_path / "sessions.csv"
    sessions.write_text(f"{BOM}device,start_s,end_s\nphones-0,10,20\n", encoding="utf-8")
    assert [(e.time_s, e.event.value) for e in load_sessions(sessions, ["phones-0"])] == [
        (10.0, "join"), (20.0, "leave")]
    # only a leading one: a BOM inside a cell is still a bad name
    inside = tmp_path / "inside.csv"
    inside.write_text(f"time_s,device,event,arg\n0,{BOM}phones-0,leave,\n", encoding="utf-8")
    with pytest.raises(TraceError, match="line 2"):
        load_trace(inside)


def test_a_utf16_trace_is_named_as_text_of_another_encoding(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # "not a text file: invalid start byte" for a spreadsheet's UTF-16 export, which is text
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,device,event,arg\n1,phones-0,leave,\n", encoding="utf-16")
    assert main(["trace", "show", str(trace)]) == 2
    assert f"{trace}: 1 problem(s):\n  - not UTF-8 text (byte 0: invalid start byte); save it " \
        "as UTF-8 (a trace and a session list are CSV text)" in capsys.readouterr().err


# a trace whose group rows expand past what a run can hold ----------------------------------------

def test_rows_that_act_on_too_many_devices_are_refused_before_any_is_expanded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """300 rows (8 KB) naming a group of 10,000 took 1.8 GB before the run started; the cap is
    counted on the rows, before expanding (here at 1,000 for a small group of 100)."""
    from testbed.churn import schedule as schedule_module

    monkeypatch.setattr(schedule_module, "MAX_ACTIONS", 1_000)
    groups = {"phones": [f"phones-{i}" for i in range(100)], "laptops": ["laptops-0"]}
    rows = "".join(f"{i},phones,slow,2\n" for i in range(11))
    text = "time_s,device,event,arg\n" + rows
    with pytest.raises(TraceError) as raised:
        build_schedule(parse_trace(text, "flood.csv"), groups)
    assert "line 12: the rows up to here act on more than 1,000 devices" in str(raised.value)
    ten = "time_s,device,event,arg\n" + "".join(f"{i},phones,slow,2\n" for i in range(10))
    assert len(build_schedule(parse_trace(ten, "ten.csv"), groups).actions) == 1_000
    # a selector acts on as many devices as it picks, not on its whole group
    picks = "time_s,device,event,arg\n" + "".join(f"{i},phones:1,slow,2\n" for i in range(900))
    assert len(build_schedule(parse_trace(picks, "picks.csv"), groups).actions) == 900
    picks += "".join(f"{900 + i},phones:5%,slow,2\n" for i in range(21))
    with pytest.raises(TraceError, match="line 922: the rows up to here act on more than 1,000"):
        build_schedule(parse_trace(picks, "picks.csv"), groups)


def test_show_of_ten_thousand_devices_prints_bounded_lines(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A bar a character per device, a line per device touched: lines 10,000 characters wide,
    10,000 lines. Now a bar is at most BAR_WIDTH characters, and devices are counted per
    group past NAMES_LISTED."""
    import yaml

    from testbed.churn.show import BAR_WIDTH

    raw = yaml.safe_load(TINY.read_text())
    raw["devices"] = [dict(raw["devices"][0], group="phones", count=10_000)]
    topology = tmp_path / "many.yaml"
    topology.write_text(yaml.safe_dump(raw))
    trace = tmp_path / "t.csv"
    trace.write_text("time_s,device,event,arg\n5,phones:25%,leave,\n9,phones:10%,partition,\n")
    assert main(["trace", "show", str(trace), "--topology", str(topology)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) < BAR_WIDTH + 80, out
    assert len(out.splitlines()) < 40
    assert " of 10,000 devices: leave 2,500 partition 1,000" in out, out
    last = out.splitlines()[-1].split()  # t= 9.0 s present reachable bar
    present, reachable, bar = int(last[3]), int(last[4]), last[5]
    assert present == 7_500 and 6_500 <= reachable < 7_500  # some picked were gone already
    assert bar == "#" * round(reachable * BAR_WIDTH / 10_000) + "+" * (
        48 - round(reachable * BAR_WIDTH / 10_000)) + "." * 16, bar


def test_digit_separators_empty_group_names_and_an_empty_plot_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`1_0` was read as the time 10 (where `0x10` was refused), `--groups ,phones` as phones
    (where `--groups ,` was refused), and `--plot ''` drew nothing and exited 0."""
    with pytest.raises(TraceError, match="time '1_0' is not a number"):
        parse_trace("time_s,device,event,arg\n1_0,phones-0,leave,\n", "t.csv")
    with pytest.raises(TraceError, match="'slow' needs a factor"):
        parse_trace("time_s,device,event,arg\n1,phones-0,slow,1_5\n", "t.csv")
    assert main([*GEN, "--groups", ",phones"]) == 2
    assert "--groups: ',phones' has an empty name" in capsys.readouterr().err
    trace = tmp_path / "t.csv"
    trace.write_text("time_s,device,event,arg\n1,phones-0,leave,\n")
    assert main(["trace", "show", str(trace), "--topology", str(TINY), "--plot", ""]) == 2
    assert "argument --plot: expected a path" in capsys.readouterr().err
