"""Churn traces every run would refuse, or run as no churn without a word, are refused by each
command that reads them: a trace with a header and no row (validate and simulate ran without
churn and said nothing, while a session list with no row was refused), and, in `trace show`,
a trace under which no device is ever present and reachable."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from testbed.churn.trace import TraceError, parse_trace
from testbed.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"
TOPOLOGY = str(ROOT / "topologies" / "default.yaml")
NO_ROWS = "no event rows after the header; expected one row per event"


def _header_only(tmp_path: Path) -> Path:
    trace = tmp_path / "empty.csv"
    trace.write_text("# nothing happens\ntime_s,device,event,arg\n\n# the end\n")
    return trace


@pytest.mark.parametrize("text, line", [("time_s,device,event,arg\n", 1),
                                        ("# c\n\ntime_ms,device,event,arg\n# more\n\n", 3)])
def test_a_trace_of_a_header_alone_is_refused_with_its_file(text: str, line: int) -> None:
    with pytest.raises(TraceError) as caught:
        parse_trace(text, "quiet.csv")
    assert str(caught.value).startswith(f"quiet.csv: 1 problem(s):\n  - line {line}: {NO_ROWS}")


def test_one_row_is_a_trace() -> None:
    assert len(parse_trace("time_s,device,event,arg\n5,phones-0,slow,2\n").events) == 1


def test_validate_refuses_a_topology_whose_trace_has_no_row(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = yaml.safe_load(TINY.read_text())
    raw["churn"] = str(_header_only(tmp_path))
    topology = tmp_path / "t.yaml"
    topology.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(topology)]) == 2
    err = capsys.readouterr().err
    assert f"the topology's churn: {tmp_path / 'empty.csv'}: 1 problem(s):" in err, err
    assert f"line 2: {NO_ROWS}" in err


def test_simulate_refuses_a_churn_trace_with_no_row_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs"
    assert main(["simulate", str(TINY), "--churn", str(_header_only(tmp_path)), "--steps", "1",
                 "--out", str(out)]) == 2
    assert f"line 2: {NO_ROWS}" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("topology", [[], ["--topology", TOPOLOGY]])
def test_trace_show_refuses_a_trace_with_no_row(tmp_path: Path, topology: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "show", str(_header_only(tmp_path)), *topology]) == 2
    captured = capsys.readouterr()
    assert f"{tmp_path / 'empty.csv'}: 1 problem(s):\n  - line 2: {NO_ROWS}" in captured.err
    assert captured.out == ""


def test_trace_gen_writes_no_trace_without_events(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Sessions of a year and absences of a millisecond, over a millisecond: every device
    starts present and stays."""
    out = tmp_path / "t.csv"
    assert main(["trace", "gen", "--topology", str(TINY), "--duration", "1ms",
                 "--session-mean", "8760h", "--absence-mean", "1ms", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"the trace made for {out} has no events (not written)" in err, err
    assert not out.exists()


ALL_LEAVE = "time_s,device,event,arg\n0,phones,leave,\n0,laptops,leave,\n"


def test_trace_show_refuses_a_trace_no_run_can_make_progress_under(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It printed "starts present: 0 of 8", exit 0, for a trace validate, simulate and up
    refuse; it says what they say, and draws nothing."""
    trace = tmp_path / "allleave.csv"
    trace.write_text(ALL_LEAVE)
    png = tmp_path / "t.png"
    assert main(["trace", "show", str(trace), "--topology", TOPOLOGY, "--plot", str(png)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not png.exists()
    said = captured.err.removeprefix(f"error: {trace}: ")
    assert said.startswith("no device is ever present and reachable"), captured.err
    assert main(["simulate", TOPOLOGY, "--churn", str(trace), "--out",
                 str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err == f"error: --churn {trace}: {said}"  # the same words


def test_trace_show_still_shows_a_trace_a_device_is_reachable_under(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "phones.csv"
    trace.write_text("time_s,device,event,arg\n0,phones,leave,\n")
    assert main(["trace", "show", str(trace), "--topology", TOPOLOGY]) == 0
    out = capsys.readouterr().out
    assert "starts present: 2 of 8" in out


def _times(out: str) -> list[str]:
    """The times of the availability rows, as printed: ``t=0.5``."""
    return ["t=" + line.split("t=", 1)[1].split()[0] for line in out.splitlines()
            if line.lstrip().startswith("t=")]


@pytest.mark.parametrize("rows, span, times", [
    ("0,phones,leave,\n", "0 .. 0 s", ["t=0.0"]),  # ran to t=1.0 s
    ("0,phones-0,leave,\n0.5,phones-0,join,\n", "0 .. 0.5 s",
     ["t=0.0", "t=0.1", "t=0.2", "t=0.3", "t=0.4", "t=0.5"]),  # ran to t=1.0 s
    ("0.002,phones-0,leave,\n0.004,phones-0,join,\n", "0 .. 0.004 s",
     ["t=0.000", "t=0.001", "t=0.002", "t=0.003", "t=0.004"]),  # all t=0.0
    ("60,phones-0,leave,\n120,phones-0,join,\n", "0 .. 120 s",
     ["t=0.0", "t=24.0", "t=48.0", "t=72.0", "t=96.0", "t=120.0"]),
    # to the millisecond the rows hold: `:g` said "0 .. 172300 s" above a last row of 172299.9
    ("100000,phones-0,leave,\n172299.919,phones-0,join,\n", "0 .. 172,299.919 s",
     ["t=0.0", "t=172299.9"]),
])
def test_the_availability_rows_span_what_the_header_says(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: str, span: str,
        times: list[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("time_s,device,event,arg\n" + rows)
    bins = str(max(len(times) - 1, 1))
    assert main(["trace", "show", str(trace), "--topology", TOPOLOGY, "--bins", bins]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(f", {span}"), out
    assert _times(out) == times, out


def test_trace_gen_writes_no_trace_under_which_no_device_is_ever_reachable(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Absences of a year: every device leaves within milliseconds and never comes back."""
    out = tmp_path / "t.csv"
    assert main(["trace", "gen", "--topology", str(TINY), "--duration", "1s",
                 "--session-mean", "1ms", "--absence-mean", "8760h", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"the trace made for {out} (not written): no device is ever present and reachable" \
        in err, err
    assert not out.exists()
