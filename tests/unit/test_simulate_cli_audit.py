"""`testbed simulate` as a new user runs it: options the command would silently ignore are
refused before anything is written, what it prints names what it measured, and its help says
what the options take."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.cli import main
from testbed.simulate.run import during_line, efficiency_text

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"


def _tiny(tmp_path: Path, **changes: Any) -> Path:
    """tests/data/tiny.yaml with top-level sections or job.parallelism keys changed."""
    raw = yaml.safe_load(TINY.read_text())
    raw["job"]["parallelism"].update(changes.pop("parallelism", {}))
    raw.update(changes)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("strategy", ["pipeline", "data-parallel"])
def test_ps_gemm_s_is_refused_for_a_baseline_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], strategy: str) -> None:
    """A baseline offloads no GEMM: --ps-gemm-s was silently ignored (exit 0)."""
    topology = _tiny(tmp_path, parallelism={"strategy": strategy})
    out = tmp_path / "runs"
    assert main(["simulate", str(topology), "--steps", "1", "--ps-gemm-s", "0.5",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ps-gemm-s" in err and strategy in err
    assert not out.exists()


def test_an_empty_topology_argument_is_named(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`testbed simulate ""` said `error: .: cannot read the file: not a regular file`."""
    out = tmp_path / "runs"
    assert main(["simulate", "", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "TOPOLOGY" in err and "empty" in err
    assert not out.exists()


def test_fifo_does_not_announce_a_planning_it_does_not_do(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """planner: fifo plans nothing before the first step, and 'planning every linear's
    tiles' was printed with no 'planned' line after it."""
    topology = _tiny(tmp_path, parallelism={"planner": "fifo"})
    assert main(["simulate", str(topology), "--steps", "1", "--out",
                 str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "planning" not in out and "step 0:" in out


def test_no_bound_is_not_blamed_on_tile_tp(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """tile-tp with no GEMM above min_offload_flops has no bound: the end line said 'no bound
    for this strategy', and tile-tp has one."""
    topology = _tiny(tmp_path, parallelism={"min_offload_flops": 1e18})
    assert main(["simulate", str(topology), "--steps", "1", "--out",
                 str(tmp_path / "runs")]) == 0
    done = capsys.readouterr().out.splitlines()[-1]
    assert "strategy" not in done and "min_offload_flops" in done
    assert efficiency_text({"efficiency": None}, "pipeline") == \
        "n/a (no bound for this strategy)"
    assert efficiency_text({"efficiency": 0.8123}, "tile-tp") == "0.81"


@pytest.mark.parametrize("section, said", [
    ({"adb": {"enabled": True}}, "adb.enabled"),
    ({"network": {"backend": "loopback", "ps": {"listen": "0.0.0.0:50051"}}},
     "network.ps.listen"),
])
def test_devices_it_does_not_simulate_are_said(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], section: dict[str, Any],
        said: str) -> None:
    """Real adb phones and devices of other machines were left out without a word."""
    topology = _tiny(tmp_path, **section)
    assert main(["simulate", str(topology), "--steps", "1", "--out",
                 str(tmp_path / "runs")]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("note:")]
    assert len(notes) == 1 and said in notes[0] and "4 devices" in notes[0]


def test_the_progress_line_says_which_seconds_are_which() -> None:
    """'(12 s, planning 12 CPU s of them)' did not say the 12 s were wall seconds."""
    line = during_line(0, 0.098, 404, 12.4, 0.2, 2, 291)
    assert line == ("  step 0: 0.098 s of device time so far, 404 tiles, 2 of 291 GEMMs "
                    "submitted (12 s to simulate so far, 0 CPU s of it planning)")


def test_help_names_what_each_option_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """The usage line read `[--churn CHURN] [--steps STEPS] [--out OUT] [--ps-gemm-s PS_GEMM_S]`
    and the description gave exit 2 only; the README writes TRACE, N, DIR, S."""
    assert main(["simulate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for part in ("--churn TRACE", "--steps N", "--out DIR", "--ps-gemm-s S", "TOPOLOGY",
                 "1 to 10,000,000", "0 done", "1 failed", "130 interrupted"):
        assert part in text, part
    assert text.count("tile-tp only") == 2


def _tiny_job(tmp_path: Path, **job: Any) -> Path:
    """tests/data/tiny.yaml with job keys set."""
    raw = yaml.safe_load(TINY.read_text())
    raw["job"].update(job)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("event", ["crash", "partition"])
def test_a_run_whose_devices_all_go_fails_as_the_ps_watchdog_fails_it(
        tmp_path: Path, capsys: Any, event: str) -> None:
    """Every device crashed (or was cut off) at 0.005 s. The PS's watchdog fails `testbed up`
    once no device has been attached for `no_progress_s` (crashed), or no tile was accepted for
    that long (cut off, within their 5 s lease), and the simulation fails the same way at the
    same time (at the tick after, as the PS checks at its ticks), saying why. It used to run
    on until its queue ran dry, and a trace that brought devices back after more than
    `no_progress_s` ran to its end where `testbed up` failed."""
    trace = tmp_path / "gone.csv"
    trace.write_text(f"time_s,device,event,arg\n0.005,phones,{event},\n"
                     f"0.005,laptops,{event},\n" + ("10,laptops-0,join,\n" if event == "crash"
                                                    else "10,laptops-0,heal,\n"))
    topology = _tiny_job(tmp_path, watchdog={"no_progress_s": 3})
    assert main(["simulate", str(topology), "--churn", str(trace), "--steps", "2",
                 "--out", str(tmp_path / "runs")]) == 1
    err = capsys.readouterr().err
    if event == "crash":
        assert "error: no device attached for 3 s (watchdog no_progress_s = 3); no device " \
            "has been attached since " in err, err
        assert "(disconnect: stream closed by the device)" in err, err
    else:
        assert "error: no tile accepted for 3 s with " in err and \
            " on 4 attached devices; watchdog no_progress_s = 3)" in err, err
    run = next((tmp_path / "runs").iterdir())
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    fired = [e for e in events if e["event"] == "watchdog"]
    assert len(fired) == 1 and 3.005 < fired[0]["elapsed_s"] <= 3.005 + 0.25, fired
    assert json.loads((run / "summary.json").read_text())["state"] == "failed"


@pytest.mark.parametrize("event", ["crash", "partition"])
def test_without_the_watchdog_a_run_whose_devices_all_go_says_why_it_stalled(
        tmp_path: Path, capsys: Any, event: str) -> None:
    """Every device crashed at 0.005 s, and the run said `simulation stalled at t=0.250000 s:
    ... no device can make progress`: the time of the queue running dry, not the cause."""
    trace = tmp_path / "gone.csv"
    trace.write_text(f"time_s,device,event,arg\n0.005,phones,{event},\n"
                     f"0.005,laptops,{event},\n")
    topology = _tiny_job(tmp_path, watchdog={"no_progress_s": 0})
    assert main(["simulate", str(topology), "--churn", str(trace), "--steps", "2",
                 "--out", str(tmp_path / "runs")]) == 1
    err = capsys.readouterr().err
    why = ("no device is present (each has left, crashed or stayed cut off past its lease, and "
           "the churn trace brings none back)")
    assert "error: simulation stalled: " in err and f" tiles outstanding and {why}" in err, err
