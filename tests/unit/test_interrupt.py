"""Ctrl-C and SIGTERM stop a command the same way: exit 130, one line, no traceback. A
simulation keeps the steps it finished (summary.json says interrupted, the report is drawn);
a command that writes a file writes it whole or not at all."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import yaml

from tests.conftest import REPO, catches, cli_argv, killed_at_exit, wait_for

TINY = REPO / "tests" / "data" / "tiny.yaml"


def _start(argv: list[str], cwd: Path) -> subprocess.Popen[str]:
    # SIGINT ignored, as a shell without job control starts a background job (`testbed
    # simulate T & kill -INT $!` in a script): Python then installs no handler of its own,
    # and the command must (it ran on to its end)
    return subprocess.Popen(cli_argv(*argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=cwd,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


@pytest.mark.parametrize("sig, strategy", [(signal.SIGINT, "tile-tp"),
                                         (signal.SIGTERM, "tile-tp"),
                                         (signal.SIGTERM, "pipeline"),
                                         (signal.SIGINT, "data-parallel")])
def test_an_interrupted_simulation_keeps_its_steps(tmp_path: Path, sig: int,
                                                   strategy: str) -> None:
    """The baselines' simulation too (a simulated pipeline kept no summary.json)."""
    raw = yaml.safe_load(TINY.read_text())
    raw["job"].setdefault("parallelism", {})["strategy"] = strategy
    topology = tmp_path / "job.yaml"
    topology.write_text(yaml.safe_dump(raw))
    out = tmp_path / "runs"
    proc = _start(["simulate", str(topology), "--steps", "1000000", "--out", str(out)],
                  tmp_path)
    with killed_at_exit(proc):
        steps = wait_for(lambda: next(out.glob("*/steps.jsonl"), None), 120, "a run directory")
        wait_for(lambda: len(steps.read_text().splitlines()) >= 3, 120, "three steps")
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "Traceback" not in output and "interrupted: " in output, output[-2000:]
    summary = json.loads((steps.parent / "summary.json").read_text())
    assert summary["state"] == "interrupted" and summary["exit_code"] == 130
    recorded = steps.read_text().splitlines()
    assert summary["steps_done"] == len(recorded) >= 3
    assert (steps.parent / "report.png").exists()


def test_an_interrupted_comparison_says_which_strategy_and_where_its_steps_are(
        tmp_path: Path) -> None:
    """It printed nothing while each strategy ran, and 'interrupted' alone at the end."""
    out = tmp_path / "cmp"
    proc = _start(["compare", str(TINY), "--simulate", "--steps", "1000000", "--out", str(out)],
                  tmp_path)
    with killed_at_exit(proc):
        steps = wait_for(lambda: next(out.glob("*/tile-tp/steps.jsonl"), None), 120,
                         "tile-tp's run directory")
        wait_for(lambda: len(steps.read_text().splitlines()) >= 2, 120, "two steps")
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "tile-tp: 1000000 step(s) in virtual time..." in output, output[-2000:]
    partial = steps.parent.parent / "comparison.md"
    assert f"interrupted during tile-tp (its run so far: {steps.parent}); a partial comparison " \
           f"(the strategies that finished, the one under way as far as it got) is in " \
           f"{partial}" in output, output[-2000:]
    assert json.loads((steps.parent / "summary.json").read_text())["state"] == "interrupted"
    # the partial comparison says so, and which strategies never ran
    text = partial.read_text()
    assert "INTERRUPTED, partial" in text
    assert "| tile-tp | interrupted |" in text, text
    assert "| pipeline | not run (interrupted before it) |" in text, text


def test_sigterm_stops_a_measurement_in_one_line_leaving_no_file(tmp_path: Path) -> None:
    out = tmp_path / "m.csv"
    proc = _start(["perf", "measure", "--out", str(out)], tmp_path)
    wait_for(lambda: catches(proc.pid, signal.SIGTERM), 60, "the command's SIGTERM handler")
    time.sleep(0.5)  # into the sweep (a minute in all), or still before it: no file either way
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert output.strip().splitlines()[-1] == "interrupted" and "Traceback" not in output
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary


def test_output_whose_reader_went_away_goes_to_dev_null() -> None:
    """`testbed up T | head`: once head exits, writes fail with EPIPE; ReaderSafe swallows
    them and points the descriptor at /dev/null, so what the stream still buffers cannot fail
    the process at exit either."""
    import os
    import stat

    from testbed.cli import ReaderSafe

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone
    stream = ReaderSafe(os.fdopen(write_end, "w", buffering=1))
    previous = signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it up
    try:
        assert stream.write("step 0: loss 5.4390\n") == len("step 0: loss 5.4390\n")
        stream.flush()
        assert stream.write("step 1\n") == 7
        assert stat.S_ISCHR(os.fstat(write_end).st_mode)  # /dev/null now, not the pipe
        assert stream.isatty() is False  # the rest is the stream's own
    finally:
        signal.signal(signal.SIGPIPE, previous)
        stream.close()


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_output_that_a_full_disk_cuts_short_fails_the_command(unbuffered: str) -> None:
    """`testbed trace gen ... > trace.csv` on a full disk exited 0 with the file cut short (under
    PYTHONUNBUFFERED the text layer drops what a short write left, without an error). A reader
    that went away is no failure (above); a disk that took part of the output is."""
    import os

    argv = [*cli_argv(), "trace", "gen", "--topology", str(REPO / "topologies/home-wifi.yaml"),
            "--duration", "2h", "--session-mean", "90s", "--absence-mean", "40s"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    with open("/dev/full", "w") as full:  # every write: ENOSPC
        proc = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, env=env,
                              timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "standard output: No space left on device" in proc.stderr
    assert "Traceback" not in proc.stderr
    closed = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, timeout=120, preexec_fn=lambda: os.close(1))
    assert closed.returncode == 0 and "Traceback" not in closed.stderr, closed.stderr


def test_a_signal_after_the_command_returned_leaves_its_exit_code() -> None:
    """The program (no argv) keeps the signals off until it exits: a SIGTERM right after the
    command returned ended the process by the default action (exit -15, a shell's 143) where
    the command had said 0 or 130."""
    script = ("import os, signal, sys\n"
              "from testbed.cli import main\n"
              f"sys.argv = ['testbed', 'validate', {str(TINY)!r}]\n"
              "code = main()\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "print('after the signals')\n"
              "sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "after the signals" in proc.stdout and "Traceback" not in proc.stderr


def test_a_caller_in_python_gets_its_own_handlers_back(
        cli_here: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    assert cli_here("validate", str(TINY)).returncode == 0
    assert {s: signal.getsignal(s) for s in before} == before
