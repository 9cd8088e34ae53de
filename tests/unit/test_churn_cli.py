"""`testbed trace gen|show|import` end to end through testbed.cli.main (exit codes, output)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from testbed.churn.trace import load_trace
from testbed.cli import main

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = str(ROOT / "topologies" / "default.yaml")
DATA = ROOT / "tests" / "data" / "churn"
FLAKY_ARGS = ["--groups", "phones", "--duration", "10min", "--session-mean", "90s",
              "--absence-mean", "40s", "--crash-fraction", "0.3", "--seed", "7"]


def _rows(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not line.startswith("#")]


def test_gen_is_reproducible_and_regenerates_the_shipped_flaky_phones(tmp_path: Path) -> None:
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    for out in (a, b):
        assert main(["trace", "gen", "--topology", TOPOLOGY, *FLAKY_ARGS, "-o", str(out)]) == 0
    assert a.read_text() == b.read_text()
    assert _rows(a) == _rows(ROOT / "traces" / "flaky-phones.csv")
    names = {e.target for e in load_trace(a).events}
    assert names and all(n.startswith("phones-") for n in names)


def test_gen_weibull_diurnal_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "gen", "--topology", TOPOLOGY, "--duration", "2h", "--session-mean",
                 "10min", "--absence-mean", "5min", "--dist", "weibull", "--shape", "0.6",
                 "--diurnal-amplitude", "0.5", "--diurnal-period", "1h", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "time_s,device,event,arg" in out and "Weibull shape 0.6" in out
    assert "laptops-" in out  # all groups by default


@pytest.mark.parametrize("args, expected", [
    (["--session-mean", "10"], "no unit"),
    (["--session-mean", "10min", "--diurnal-amplitude", "3"], "--diurnal-amplitude"),
    (["--session-mean", "10min", "--groups", "tablets"], "unknown group(s) tablets"),
])
def test_gen_bad_input_exits_2(args: list[str], expected: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["trace", "gen", "--topology", TOPOLOGY, "--duration", "1h",
                 "--absence-mean", "1min", *args])
    assert code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("dist", [[], ["--dist", "exponential"]])
def test_gen_refuses_a_shape_without_weibull(dist: list[str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # the exponential draw has no shape: --shape 0.5 was ignored and an exponential trace written
    code = main(["trace", "gen", "--topology", TOPOLOGY, "--duration", "1h", "--session-mean",
                 "10min", "--absence-mean", "1min", "--shape", "0.5", *dist])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert "--shape: only --dist weibull has a shape, got --shape 0.5 with --dist exponential" \
        in captured.err, captured.err


def test_show_plot_title_names_the_seed_it_draws_picks_with(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a trace generated with seed 3, shown over a topology whose seed is 7: the title said
    # "(seed 7)" under a header saying "seed 3"
    from testbed.churn import show

    trace = tmp_path / "seed3.csv"
    assert main(["trace", "gen", "--topology", TOPOLOGY, *FLAKY_ARGS[:-1], "3", "-o",
                 str(trace)]) == 0
    assert "for topology default, seed 3" in trace.read_text()
    titles: list[str] = []
    monkeypatch.setattr(show, "plot_timeline",
                        lambda schedule, path, title="": titles.append(title))
    for seed, origin in (([], "the topology's seed"), (["--seed", "5"], "--seed")):
        assert main(["trace", "show", str(trace), "--topology", TOPOLOGY, "--plot",
                     str(tmp_path / "t.png"), *seed]) == 0
        assert titles.pop() == (f"churn: seed3.csv on topology default (picks seeded with "
                                f"{'5' if seed else '7'}, {origin})")


def test_show_prints_a_summary_and_draws_a_timeline(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "timeline.png"
    assert main(["trace", "show", str(ROOT / "traces" / "partition-heal.csv"), "--topology",
                 TOPOLOGY, "--bins", "4", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "device actions by event: join 0, leave 0, crash 0, partition 3, heal 3, slow 2" in out
    # the seed says what it seeds (it stood alone: "devices: 8 (phones 6, laptops 2), seed 7")
    assert "devices: 8 (phones 6, laptops 2); picks seeded with 7 (which devices a row such " \
        "as phones:2 takes)" in out, out
    assert "starts present: 8 of 8" in out
    assert "t=    120.0 s    8   6  ######++" in out  # both laptops partitioned
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_show_availability_bar_has_a_character_per_device_in_topology_order(
        capsys: pytest.CaptureFixture[str]) -> None:
    # the bar was a count drawn as "##......", which read as phones-0 and phones-1 present where
    # the overnight trace starts with the phones absent and the two laptops present
    assert main(["trace", "show", str(ROOT / "traces" / "overnight-charging.csv"), "--topology",
                 TOPOLOGY, "--bins", "2"]) == 0
    out = capsys.readouterr().out
    assert "bar: phones-0 .. laptops-1, # present, + partitioned, . absent" in out, out
    assert "t=      0.0 s    2   2  ......##" in out, out
    assert "t=    470.0 s    2   2  ......##" in out, out  # phones-2 and -4 left last
    assert main(["trace", "show", str(ROOT / "traces" / "flaky-phones.csv"), "--topology",
                 TOPOLOGY, "--bins", "1"]) == 0
    out = capsys.readouterr().out
    assert "starts present: 6 of 8 (absent: phones-1, phones-3)" in out
    assert "t=      0.0 s    6   6  #.#.####" in out, out


def test_show_availability_bar_past_64_devices_is_a_share(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("time_s,device,event,arg\n10,phones-a:50%,leave,\n")
    assert main(["trace", "show", str(trace), "--topology",
                 str(ROOT / "topologies" / "large.yaml"), "--bins", "1"]) == 0
    out = capsys.readouterr().out
    assert "of 240; a bar character is 3.75 devices" in out, out
    rows = [line.split()[-1] for line in out.splitlines() if line.lstrip().startswith("t=")]
    assert rows[0] == "#" * 64 and len(rows[1]) == 64 and rows[1].count(".") > 0, rows


def test_show_without_topology_summarizes_the_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "show", str(ROOT / "traces" / "mass-departure.csv")]) == 0
    out = capsys.readouterr().out
    assert "rows by event: join 2, leave 1, crash 1" in out
    assert "give --topology" in out


def test_show_malformed_trace_exits_2_with_line_numbers(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    code = main(["trace", "show", str(DATA / "malformed.csv"), "--topology", TOPOLOGY])
    err = capsys.readouterr().err
    assert code == 2
    assert "7 problem(s)" in err
    for expected in ("line 4: unknown event 'reboot'", "line 5: time goes backwards",
                     "line 6: unknown device 'tablets-0'", "line 10: time '70ms'"):
        assert expected in err


def test_show_inconsistent_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time_s,device,event,arg\n5,phones-0,crash,\n9,phones,leave,\n")
    assert main(["trace", "show", str(path), "--topology", TOPOLOGY]) == 2
    assert "line 3: leave phones: phones-0 is already absent (since line 2)" in \
        capsys.readouterr().err


def test_import_fedscale_and_sessions(tmp_path: Path) -> None:
    source = tmp_path / "client_behave_trace"
    source.write_bytes(pickle.dumps({7: {"active": [0, 30], "inactive": [10, 50],
                                         "finish_time": 60}}))
    out = tmp_path / "fedscale.csv"
    assert main(["trace", "import", "fedscale", str(source), "--topology", TOPOLOGY,
                 "--duration", "2min", "--time-scale", "2", "-o", str(out)]) == 0
    rows = _rows(out)
    # all 8 devices take the single client: present 0..10, 30..50, 60..70, 90..110 (/2)
    assert rows[0] == "time_s,device,event,arg"
    assert rows[1:9] == [f"5,{d},leave," for d in
                         [f"phones-{i}" for i in range(6)] + ["laptops-0", "laptops-1"]]
    assert len(rows) == 1 + 8 * 7
    out2 = tmp_path / "sessions.csv"
    assert main(["trace", "import", "sessions", str(DATA / "sessions.csv"), "--topology",
                 TOPOLOGY, "-o", str(out2)]) == 0
    assert "300,phones-0,join," in out2.read_text()


def test_import_refuses_a_pickle_that_carries_code(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    source = tmp_path / "evil.pkl"
    source.write_bytes(pickle.dumps(Evil()))
    code = main(["trace", "import", "fedscale", str(source), "--topology", TOPOLOGY])
    assert code == 2
    assert "refused: the pickle asks for the global" in capsys.readouterr().err
    assert not marker.exists()


def test_show_and_validate_note_when_a_trace_leaves_no_device_for_good(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "allgo.csv"
    trace.write_text("time_s,device,event,arg\n10,phones,leave,\n10,laptops,leave,\n")
    note = ("from t=10 s on no device is present and reachable and none comes back: a run "
            "still training then stalls, and testbed up and testbed simulate fail when the "
            "PS's progress watchdog fires (job.watchdog.no_progress_s after)")
    assert main(["trace", "show", str(trace), "--topology", TOPOLOGY]) == 0
    assert f"\nnote: {note}\n" in capsys.readouterr().out
    topology = tmp_path / "t.yaml"
    topology.write_text(Path(TOPOLOGY).read_text() + f"churn: {trace}\n")
    assert main(["validate", str(topology)]) == 0
    assert f"note: {topology}: the churn trace allgo.csv: {note}\n" in capsys.readouterr().out
    assert main(["trace", "show", str(ROOT / "traces" / "overnight-charging.csv"), "--topology",
                 TOPOLOGY]) == 0  # the laptops stay: no note
    assert "note:" not in capsys.readouterr().out
