"""`testbed up --resume` of a damaged run directory is refused before anything starts.

One tiny loopback run is killed (its PS, with SIGKILL) after its second checkpoint; each case
damages a copy of it as an edit, a full disk or another program could, and checks the pre-flight
check (``testbed.up.resume_problems`` and ``_resume_target``): exit 2, a message naming the file
and the line or field, every file of the run directory as it was (checksums), and no process of
the run left. A finished run and ``--steps 0`` are refused the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
from pathlib import Path
from typing import Callable

import numpy as np
import psutil
import pytest

from testbed.ps_backend.engine.checkpoint import latest_checkpoint
from testbed.ps_backend.ledger import MAGIC, _xxh3
from tests.conftest import (
    REPO,
    cli_argv,
    killed_at_exit,
    run_dir_of,
    start_up,
    tiny_topology,
    wait_for,
)

pytestmark = pytest.mark.integration
STEPS = 6  # the killed run's: it is killed once 2 are checkpointed, long before the last
CHURN = "time_s,device,event,arg\n1000,phones-2,leave,\n"


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny loopback run whose PS was SIGKILLed after the checkpoint of step 2."""
    tmp = tmp_path_factory.mktemp("killed")
    out = tmp / "runs"
    up = start_up(tiny_topology(tmp, steps=STEPS), out)
    with killed_at_exit(up):
        run_dir = run_dir_of(out)
        wait_for(lambda: (run_dir / "checkpoints" / "step-000002.pt").exists(), 120,
                 "the checkpoint of step 2")
        os.kill(json.loads((run_dir / "pids.json").read_text())["ps"], signal.SIGKILL)
        output, _ = up.communicate(timeout=60)
    assert up.returncode == 1, output
    newest = latest_checkpoint(run_dir / "checkpoints")
    assert newest is not None and newest.name < f"step-{STEPS:06d}.pt", "the run finished"
    assert list((run_dir / "ledger").glob("step-*.tiles")), "no journal to damage"
    return run_dir


@pytest.fixture(scope="module")
def finished_run(killed_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the killed run, resumed to its end (a resume of an intact run works)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    shutil.copytree(killed_run, run_dir, symlinks=True)
    done = subprocess.run(cli_argv("up", "--resume", str(run_dir), "--no-live"), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps_done"] == STEPS
    return run_dir


def checksums(run_dir: Path) -> dict[str, str]:
    """Every entry of a run directory: a file's SHA-256, a directory, a symlink's target."""
    out = {}
    for path in sorted(run_dir.rglob("*")):
        name = str(path.relative_to(run_dir))
        if path.is_symlink():
            out[name] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            out[name] = "directory"
        else:
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def processes_of(run_dir: Path) -> list[int]:
    """Processes whose command line names the run directory (the PS, agents, fork server)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(str(run_dir) in part for part in proc.info["cmdline"] or []):
            found.append(proc.info["pid"])
    return found


def resume_refused(run_dir: Path, *extra: str) -> str:
    """Run `testbed up --resume RUN_DIR`; check it exits 2 and touches nothing; its stderr.

    In this process, through the command line's own entry point (a subprocess each spent about
    two seconds starting Python and importing torch, a minute over the cases): a traceback
    would fail the test as its exception."""
    from testbed.cli import main

    before = checksums(run_dir)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["up", "--resume", str(run_dir), "--no-live", *extra])
    assert code == 2, out.getvalue() + err.getvalue()
    assert checksums(run_dir) == before, "the refused resume changed the run directory"
    assert processes_of(run_dir) == [], "a process of the run was left"
    return err.getvalue()


# -- damage ------------------------------------------------------------------------------------
def _edit_json(name: str, **fields: object) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        obj = json.loads((run_dir / name).read_text())
        obj.update(fields)
        (run_dir / name).write_text(json.dumps(obj))
    return damage


def _raw_up_json(text: str) -> Callable[[Path], None]:
    return lambda run_dir: (run_dir / "up.json").write_text(text)


def _append(name: str, data: bytes) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        with open(run_dir / name, "ab") as f:
            f.write(data)
    return damage


def _with_churn(then: Callable[[Path], None]) -> Callable[[Path], None]:
    """The run replays a churn trace (up.json names it), and then the damage."""
    def damage(run_dir: Path) -> None:
        trace = run_dir.parent / "churn.csv"
        trace.write_text(CHURN)
        _edit_json("up.json", churn=str(trace))(run_dir)
        then(run_dir)
    return damage


def _directory_for(name: str) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        path.mkdir()
    return damage


def _newest_checkpoint(run_dir: Path) -> Path:
    path = latest_checkpoint(run_dir / "checkpoints")
    assert path is not None
    return path


def _newest_journal(run_dir: Path) -> Path:
    return sorted((run_dir / "ledger").glob("step-*.tiles"))[-1]


def _truncate_checkpoint(run_dir: Path) -> None:
    os.truncate(_newest_checkpoint(run_dir), 1000)


def _journal_directory(run_dir: Path) -> None:
    path = _newest_journal(run_dir)
    path.unlink()
    path.mkdir()


def _forged_record(**header: object) -> Callable[[Path], None]:
    """A journal record whose hash is intact and whose header is as given."""
    def damage(run_dir: Path) -> None:
        raw = json.dumps({"gemm": "g", "digest": "d", "r0": 0, "r1": 1, "c0": 0, "c1": 1,
                          "dtype": "<f8", **header}).encode()
        payload = np.zeros(1).tobytes()
        record = MAGIC + struct.pack("<I", len(raw)) + raw + struct.pack("<Q", len(payload)) \
            + payload + struct.pack("<Q", _xxh3(raw, payload).intdigest())
        with open(_newest_journal(run_dir), "ab") as f:
            f.write(record)
    return damage


def _other_model(run_dir: Path) -> None:
    path = run_dir / "topology.input.yaml"
    path.write_text(path.read_text().replace("hidden: 32", "hidden: 64")
                    .replace("ffn: 64", "ffn: 128"))


def _agents_file(run_dir: Path) -> None:
    shutil.rmtree(run_dir / "agents")
    (run_dir / "agents").write_text("not a directory\n")


DEEP = b"[" * 100_000 + b"]" * 100_000
CASES: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    # found by the PS after the run had started (finding 1)
    "checkpoint truncated": (_truncate_checkpoint, ["checkpoints/step-", "not a readable"]),
    "checkpoint of another model": (_other_model, ["checkpoints/step-", "hidden"]),
    "journal a directory": (_journal_directory, ["ledger/step-", "found a directory"]),
    "journal record without step": (_forged_record(), ["ledger/step-", "'step'"]),
    "journal record task a string": (_forged_record(step=0, task="x"),
                                     ["ledger/step-", "'task'"]),
    "steps line a list": (_append("steps.jsonl", b"[1,2]\n"), ["steps.jsonl: line", "list"]),
    "steps line step a string": (_append("steps.jsonl", b'{"step":"x"}\n'),
                                 ["steps.jsonl: line", "step: expected an integer"]),
    # up.json values (finding 3)
    "dilation 0": (_edit_json("up.json", dilation=0), ["up.json: dilation"]),
    "dilation negative": (_edit_json("up.json", dilation=-3), ["up.json: dilation"]),
    "dilation NaN": (_raw_up_json('{"steps": 6, "churn": null, "dilation": NaN, '
                                  '"dilation_info": {"mode": "fixed"}}'), ["up.json: dilation"]),
    "dilation Infinity": (_raw_up_json('{"steps": 6, "churn": null, "dilation": Infinity, '
                                       '"dilation_info": {"mode": "fixed"}}'),
                          ["up.json: dilation"]),
    "dilation 1e300": (_edit_json("up.json", dilation=1e300), ["up.json: dilation"]),
    "dilation_info empty": (_edit_json("up.json", dilation_info={}),
                            ["up.json: dilation_info.mode"]),
    "dilation_info nested deep": (
        lambda d: (d / "up.json").write_bytes(b'{"steps": 6, "churn": null, "dilation": 1, '
                                              b'"dilation_info": ' + DEEP + b"}"),
        ["up.json: not readable JSON", "nested too deeply"]),
    "steps 0 in up.json": (_edit_json("up.json", steps=0), ["up.json: steps"]),
    # other tracebacks (finding 4)
    "churn clock t a string": (
        _with_churn(_append("events.jsonl", b'{"t":"x","event":"churn_clock_start"}\n')),
        ["events.jsonl: line", "t: expected"]),
    "churn events line a list": (_with_churn(_append("events.jsonl", b"[1]\n")),
                                 ["events.jsonl: line", "list"]),
    "links_dilation without new": (
        _with_churn(_append("events.jsonl", b'{"t":1,"event":"links_dilation"}\n')),
        ["events.jsonl: line", "new: expected"]),
    "events byte not UTF-8": (_append("events.jsonl", b"\xff\n"),
                              ["events.jsonl: line", "not UTF-8"]),
    "events line nested deep": (_append("events.jsonl", DEEP + b"\n"),
                                ["events.jsonl: line", "nested too deeply"]),
    "steps.jsonl a directory": (_directory_for("steps.jsonl"), ["steps.jsonl", "directory"]),
    "events.jsonl a directory": (_directory_for("events.jsonl"), ["events.jsonl", "directory"]),
    "status.json a directory": (_directory_for("status.json"), ["status.json", "directory"]),
    "ps.json a directory": (_directory_for("ps.json"), ["ps.json", "directory"]),
    "summary.json a directory": (_directory_for("summary.json"), ["summary.json", "directory"]),
    "agents a file": (_agents_file, ["agents", "found a file"]),
    "clock.json origin a string": (_edit_json("clock.json", started_unix_s="x"),
                                   ["clock.json: started_unix_s"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_run_is_refused_untouched(killed_run: Path, tmp_path: Path, case: str) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run, run_dir, symlinks=True)
    damage, words = CASES[case]
    damage(run_dir)
    stderr = resume_refused(run_dir)
    for word in words:
        assert word in stderr, stderr
    assert str(run_dir) in stderr, stderr


def test_torn_last_line_is_no_damage(killed_run: Path) -> None:
    """What a kill leaves (a record cut off at the end) is skipped, as every reader does."""
    from testbed.runlog import read_jsonl, read_jsonl_checked

    path = killed_run / "events.jsonl"
    whole = read_jsonl(path)
    torn = path.parent / "torn.jsonl"
    torn.write_bytes(path.read_bytes() + b'{"t": 1.5, "event": "jo')
    try:
        assert read_jsonl(torn) == whole
        assert [r for _, r in read_jsonl_checked(torn)] == whole
    finally:
        torn.unlink()


def test_finished_run_is_refused_untouched(finished_run: Path) -> None:
    stderr = resume_refused(finished_run)
    assert f"run already finished: {STEPS} of {STEPS} steps" in stderr, stderr
    assert f"use --steps M with M > {STEPS}" in stderr, stderr
    stderr = resume_refused(finished_run, "--steps", "1")
    assert "run already finished" in stderr, stderr


def test_steps_0_on_resume_is_refused(killed_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run, run_dir, symlinks=True)
    stderr = resume_refused(run_dir, "--steps", "0")
    assert "--steps: expected 1 to" in stderr and "got 0" in stderr, stderr
