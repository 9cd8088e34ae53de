"""`testbed trace` as a new user meets it: options that were silently ignored are refused
(exit 2, nothing written), an empty session list is not an empty trace, and the messages
and help say what the command does."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from testbed.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = str(ROOT / "topologies" / "default.yaml")
SESSIONS = str(ROOT / "tests" / "data" / "churn" / "sessions.csv")


@pytest.mark.parametrize("options", [["--time-scale", "60"], ["--start", "10s"],
                                     ["--duration", "1h"]])
def test_import_sessions_refuses_the_fedscale_options(tmp_path: Path, capsys,
                                                      options: list[str]) -> None:
    """They were ignored: `--time-scale 60` wrote the same trace as without it, exit 0."""
    out = tmp_path / "t.csv"
    assert main(["trace", "import", "sessions", SESSIONS, "--topology", TOPOLOGY, *options,
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: {options[0]}: fedscale only" in err, err
    assert not out.exists()


def test_import_of_a_session_list_without_rows_is_refused(tmp_path: Path, capsys) -> None:
    """A header alone made an empty trace (a run without churn) and exit 0."""
    src = tmp_path / "s.csv"
    src.write_text("# nothing yet\ndevice,start_s,end_s\n")
    out = tmp_path / "t.csv"
    assert main(["trace", "import", "sessions", str(src), "--topology", TOPOLOGY,
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{src}: 1 problem(s):\n  - line 2: no session rows after the header" in err, err
    assert not out.exists()


def test_a_session_list_of_present_devices_makes_no_trace(tmp_path: Path, capsys) -> None:
    """Present all along: a valid list, but a trace of no event, which every run refuses
    (churn.trace.NO_EVENTS). It was written, a header alone, exit 0."""
    src = tmp_path / "s.csv"
    src.write_text("device,start_s,end_s\nphones-0,0,\n")
    out = tmp_path / "t.csv"
    assert main(["trace", "import", "sessions", str(src), "--topology", TOPOLOGY,
                 "-o", str(out)]) == 2
    assert f"error: the trace made for {out} has no events (not written)" in \
        capsys.readouterr().err
    assert not out.exists()


def _pickle(tmp_path: Path) -> str:
    path = tmp_path / "behave.pkl"
    path.write_bytes(pickle.dumps({f"c{i}": {"active": [10 * i], "inactive": [100 + 10 * i],
                                             "finish_time": 1000} for i in range(5)}))
    return str(path)


def test_fedscale_start_past_the_end_says_so(tmp_path: Path, capsys) -> None:
    """It said 'start 2000 s, duration -1000 s', a duration the user never gave."""
    assert main(["trace", "import", "fedscale", _pickle(tmp_path), "--topology", TOPOLOGY,
                 "--start", "2000s"]) == 2
    err = capsys.readouterr().err
    assert "--start 2000 s is at or past the end of the trace" in err, err
    assert "1000 s" in err and "-1000" not in err
    # with a --duration the windows repeat every finish_time (FedScale's rule): accepted
    assert main(["trace", "import", "fedscale", _pickle(tmp_path), "--topology", TOPOLOGY,
                 "--start", "2000s", "--duration", "100s"]) == 0


def test_fedscale_infinite_time_scale_is_not_called_not_positive(tmp_path: Path,
                                                                 capsys) -> None:
    assert main(["trace", "import", "fedscale", _pickle(tmp_path), "--topology", TOPOLOGY,
                 "--time-scale", "inf"]) == 2
    assert "--time-scale must be a finite number > 0, got inf" in capsys.readouterr().err


def test_fedscale_defaults_still_apply(tmp_path: Path, capsys) -> None:
    assert main(["trace", "import", "fedscale", _pickle(tmp_path), "--topology",
                 TOPOLOGY]) == 0
    assert "trace time from 0 s, times divided by 1" in capsys.readouterr().out


def test_show_refuses_a_seed_without_a_topology(capsys) -> None:
    """--seed was ignored without --topology (nothing is picked without the groups)."""
    trace = str(ROOT / "traces" / "mass-departure.csv")
    assert main(["trace", "show", trace, "--seed", "3"]) == 2
    captured = capsys.readouterr()
    assert "--seed needs --topology" in captured.err and captured.out == ""


def test_show_bins_help_matches_the_rows_printed(capsys) -> None:
    """--bins 4 prints 5 rows (0 and the end included); the help said 'availability rows'."""
    trace = str(ROOT / "traces" / "mass-departure.csv")
    assert main(["trace", "show", trace, "--topology", TOPOLOGY, "--bins", "4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.lstrip().startswith("t=")]
    assert len(rows) == 5
    parser = build_parser()
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        trace_parser = action.choices["trace"]
    for action in trace_parser._subparsers._group_actions:  # type: ignore[union-attr]
        text = " ".join(action.choices["show"].format_help().split())
    assert "BINS + 1 evenly spaced times" in text


def test_a_wrong_file_given_as_churn_names_the_option_and_lists_twenty_problems(
        tmp_path: Path, capsys) -> None:
    """`--churn /etc/passwd` printed a problem per line of the file under its resolved path
    alone, not saying it came from --churn."""
    wrong = tmp_path / "passwd"
    wrong.write_text("".join(f"user{i}:x:{i}:{i}::/home/u:/bin/sh\n" for i in range(30)))
    out = tmp_path / "runs"
    assert main(["simulate", TOPOLOGY, "--churn", str(wrong), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --churn {wrong}: 30 problem(s):\n"), err
    lines = err.splitlines()
    assert lines[1].startswith("  - line 1: expected the header") and len(lines) == 22, lines
    assert lines[-1] == "  - ... and 10 more"
    assert not out.exists()  # nothing started
