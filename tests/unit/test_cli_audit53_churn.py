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
