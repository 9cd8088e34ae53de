"""Runtime faults of a run, each as it was found and what it must do now:

* a run's files are read with a 4 GiB limit, which must not cost 4 GiB of address space (a run
  under ``ulimit -v`` ended every report in MemoryError);
* ``--resume`` drops the steps it will run again from ``steps.jsonl``: a kill while it does must
  not lose the steps before (the file was truncated, then written);
* a PS stopped with Ctrl-Z (or a suspended host) must not blame the devices for its own pause
  on ``fg`` (leases expired, then the watchdog failed the run);
* ``testbed clean RUN_DIR`` kills only that run's processes, and none of a run still running
  (it killed a pid that had been reused by another run's PS);
* a run whose PS left no summary still says how many steps it did, with their losses;
* a failure on an OSError names the file;
* a checkpoint killed at its rename leaves no temporary file for good.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import psutil
import pytest

import testbed
import testbed.ps_backend.core as core_module
import testbed.ps_backend.scheduler as scheduler_module
from testbed.emulator.network import cleanup
from testbed.ps_backend.core import Descriptor, PsConfig, PsCore, ResultIn
from testbed.ps_backend.scheduler import GemmJob, GemmSpec
from testbed.run_lock import RunLock
from testbed.runlog import RunLog, read_jsonl, write_json_atomic
from testbed.user_paths import read_user_text
from tests.conftest import TINY

SRC = str(Path(testbed.__file__).resolve().parents[1])  # children import this testbed


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SRC}


# -- read_user_text: memory for the file, not for the limit ----------------------------------------

def test_a_small_file_read_with_a_4_gib_limit_fits_in_a_2_gib_address_space(
        tmp_path: Path) -> None:
    """What ``ulimit -v 2000000`` does to `testbed report`: f.read(4 GiB + 1) asked for a 4 GiB
    buffer and raised MemoryError for a file of a few bytes."""
    path = tmp_path / "up.json"
    path.write_text('{"steps": 3}\n')
    code = (
        "import resource, sys\n"
        "from pathlib import Path\n"
        "from testbed.user_paths import read_user_text\n"  # imported before the limit
        "limit = 2 * 1024**3\n"
        "resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
        "print(read_user_text(Path(sys.argv[1]), 4 * 1024**3), end='')\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=60, env=_child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == '{"steps": 3}\n'


def test_a_file_that_grows_while_read_still_stops_at_the_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"x" * 300)
    real_fstat = os.fstat

    def smaller(fd: int) -> Any:  # the size it had when fstat looked; it grew since
        st = real_fstat(fd)
        return types.SimpleNamespace(st_size=10, st_mode=st.st_mode)
    monkeypatch.setattr("testbed.user_paths.os.fstat", smaller)
    with pytest.raises(OSError, match="larger than the 100 bytes"):
        read_user_text(path, 100)
    assert read_user_text(path, 300) == "x" * 300  # at the limit: whole
    assert read_user_text(path, 10**9) == "x" * 300


def test_a_file_whose_size_says_nothing_is_read_whole_and_limited() -> None:
    status = Path("/proc/self/status")  # a regular file of size 0 to stat
    assert read_user_text(status, 1 << 20).startswith("Name:")
    with pytest.raises(OSError, match="larger than the 10 bytes"):
        read_user_text(status, 10)


# -- --resume rewrites steps.jsonl: a kill in the middle loses nothing -----------------------------

RESTORE_CHILD = """
import inspect, sys
from pathlib import Path
import testbed.ps_backend.engine.checkpoint as checkpoint
from testbed.ps_backend import main
from testbed.runlog import RunLog

run_dir = Path(sys.argv[1])
checkpoint.load_resume_point = lambda trainer, directory: (None, [0.5, 0.4])

class Trainer:
    next_step = 2  # steps 0 and 1 are kept; 2 and 3 run again

class Ledger:
    def load(self, from_step):
        return 0

runlog = [RunLog(run_dir)] if "runlog" in inspect.signature(main._restore).parameters else []
main._restore(Trainer(), run_dir, *runlog, Ledger())
print("restored")
"""


def _steps_file(run_dir: Path, steps: int) -> None:
    log = RunLog(run_dir)
    for step in range(steps):
        log.step(step=step, loss=1.0 / (step + 1), wall_s=1.0, device_time_s=1.0,
                 bytes_down=10, bytes_up=5, tiles=4)
    log.close()


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to kill at a syscall")
@pytest.mark.parametrize("syscalls", ["write,pwrite64,writev", "rename,renameat,renameat2"])
def test_resume_killed_while_it_drops_steps_keeps_the_steps_before(
        tmp_path: Path, syscalls: str) -> None:
    """SIGKILL at the first write to steps.jsonl (the old rewrite in place: the file was already
    truncated, and stayed empty) or at the rename onto it (the new one): the steps before the
    checkpoint are in steps.jsonl either way."""
    _steps_file(tmp_path, 4)
    steps_path = tmp_path / "steps.jsonl"
    done = subprocess.run(
        ["strace", "-f", "-qq", "-o", os.devnull, "-P", str(steps_path), "-e",
         f"trace={syscalls}", "-e", f"inject={syscalls}:signal=SIGKILL:when=1",
         sys.executable, "-c", RESTORE_CHILD, str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=_child_env())
    if done.returncode != 0 and "restored" not in done.stdout and "PTRACE" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()[-200:]}")
    kept = [r["step"] for r in read_jsonl(steps_path)]
    assert kept in ([0, 1], [0, 1, 2, 3]), (kept, done.returncode, done.stderr[-1000:])
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".steps.jsonl")
                and done.returncode == 0]


def test_resume_drops_the_steps_it_runs_again_and_appends_after_the_kept_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from testbed.ps_backend import main

    _steps_file(tmp_path, 4)
    monkeypatch.setattr("testbed.ps_backend.engine.checkpoint.load_resume_point",
                        lambda trainer, directory: (None, [0.5, 0.4]))
    trainer = types.SimpleNamespace(next_step=2)
    ledger = types.SimpleNamespace(load=lambda from_step: 7)
    losses, reusable, checkpoint = main._restore(trainer, tmp_path, ledger)
    assert (losses, reusable, checkpoint) == ([0.5, 0.4], 7, None)
    assert [r["step"] for r in read_jsonl(tmp_path / "steps.jsonl")] == [0, 1]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary
    log = RunLog(tmp_path)  # as run_ps opens it: after the restore
    log.step(step=2, loss=0.3, wall_s=1.0, device_time_s=1.0, bytes_down=1, bytes_up=1)
    log.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "steps.jsonl")] == [0, 1, 2]


def test_a_rewrite_that_fails_before_its_rename_leaves_the_file_as_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from testbed.ps_backend.main import rewrite_durably

    path = tmp_path / "steps.jsonl"
    path.write_bytes(b"old\n")
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])

    def replace(src: Any, dst: Any) -> None:
        calls.append("replace")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        rewrite_durably(path, b"new\n")
    assert path.read_bytes() == b"old\n" and [p.name for p in tmp_path.iterdir()] == [path.name]
    assert calls == ["fsync", "replace"]  # the data reached the disk before the rename
    monkeypatch.setattr(os, "replace", real_replace)
    calls.clear()
    rewrite_durably(path, b"new\n")
    assert path.read_bytes() == b"new\n" and calls == ["fsync", "fsync"]  # file, directory


# -- a PS that was not running does not judge the devices for it -----------------------------------

class _Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class _Events:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def event(self, kind: str, /, **fields: Any) -> None:
        self.events.append((kind, fields))

    def device(self, **fields: Any) -> None:  # a departed session's final record: not looked at
        pass

    def note_write_error(self, exc: OSError) -> None:  # pragma: no cover - not reached
        raise exc


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    """The monotonic clock of the core and its scheduler, moved by hand (time.monotonic
    elsewhere is left alone)."""
    fake = _Clock()
    faked = types.SimpleNamespace(monotonic=fake, time=time.time, thread_time=time.thread_time,
                                  perf_counter=time.perf_counter, process_time=time.process_time)
    monkeypatch.setattr(core_module, "time", faked)
    monkeypatch.setattr(scheduler_module, "time", faked)
    return fake


def _busy_core(no_progress_s: float = 120.0,
               gflops: float = 1.0) -> tuple[PsCore, _Events, list[Any]]:
    """A core with two attached devices (``gflops`` predicted) holding the tiles of an
    outstanding 8 x 3 x 8 GEMM (four 4 x 4 tiles)."""
    events = _Events()
    config = PsConfig(token="t", run_name="pause", dtype=np.dtype("float64"), tile_m=4,
                      tile_n=4, min_offload_flops=0.0, planner="fifo",
                      no_progress_s=no_progress_s)
    core = PsCore(config, runlog=events)  # type: ignore[arg-type]
    conns = []
    for name in ("phones-0", "phones-1"):
        conn = core.join(Descriptor(name=name, group="phones", kind="real", profile="",
                                    predicted_gflops=gflops, max_in_flight=8,
                                    cache_bytes=1 << 20,
                                    platform="test"))
        assert core.attach(conn.device_id, conn.session_key) is conn
        conns.append(conn)
    a, b = np.ones((8, 3)), np.ones((3, 8))
    core.submit(GemmJob(uid="s0/l/forward#0", spec=GemmSpec("l", "forward", 0), a=a, b=b,
                        c=np.empty((8, 8)), version=0, a_key="A", b_key="B"))
    assert core.scheduler.tasks
    return core, events, conns


def _ticks(core: PsCore, clock: _Clock, seconds: float, heard: list[Any] = ()) -> None:
    """The host's ticks every 0.25 s for ``seconds``; the devices in ``heard`` heartbeat."""
    for _ in range(round(seconds / 0.25)):
        clock.now_s += 0.25
        for conn in heard:
            if conn.device_id in core.conns:
                core.seen(conn)
        core.tick()


def test_ctrl_z_longer_than_the_watchdog_then_fg_fails_nothing(clock: _Clock) -> None:
    """r06: 130 s stopped (watchdog 120 s, lease 5 s). Before: every lease expired on waking,
    then "no device attached for 130 s"."""
    core, events, conns = _busy_core()
    _ticks(core, clock, 2, heard=conns)
    clock.now_s += 130  # SIGSTOP ... SIGCONT: no tick, no message meanwhile
    core.tick()
    assert core.watchdog_reason is None
    assert sorted(core.conns) == sorted(c.device_id for c in conns)
    assert not [kind for kind, _ in events.events if kind == "lease_expired"]
    paused = [fields for kind, fields in events.events if kind == "ps_paused"]
    assert len(paused) == 1 and 129 < paused[0]["seconds"] <= 130, paused
    assert core.metrics()["paused_s"] == paused[0]["seconds"]
    _ticks(core, clock, 3, heard=conns)  # they heartbeat again: all is as before
    assert core.watchdog_reason is None and len(core.conns) == 2


def test_after_a_pause_a_silent_device_still_loses_its_lease_and_the_watchdog_still_counts(
        clock: _Clock) -> None:
    core, events, (talks, silent) = _busy_core(no_progress_s=10)
    _ticks(core, clock, 3, heard=[talks])  # silent for 3 s of a 5 s lease
    clock.now_s += 60
    core.tick()
    assert silent.device_id in core.conns  # its lease counts the PS's running time only
    _ticks(core, clock, 2.5, heard=[talks])
    assert silent.device_id not in core.conns  # 3 s + 2.5 s > 5 s
    assert any(kind == "lease_expired" for kind, _ in events.events)
    _ticks(core, clock, 6, heard=[talks])  # no tile accepted: 3 + 0.25 + 8.5 s > 10 s
    assert core.watchdog_reason is not None and "no tile accepted" in core.watchdog_reason


def _return_one(core: PsCore, conn: Any, now_s: float, compute_s: float) -> None:
    """The device returns (the right values of) one of the tiles it holds."""
    task_id, copy = next(iter(conn.slot.in_flight.items()))
    c = copy.task.a_block() @ copy.task.b_block()
    core.on_results(conn, [ResultIn(task_id, copy.attempt, c, c.nbytes, compute_s=compute_s,
                                    energy_j=0.0, lag_s=0.0, received_s=now_s, started_s=0.0,
                                    done_s=compute_s)])


def test_copies_out_during_a_pause_are_not_backed_up_and_teach_no_overhead(
        clock: _Clock) -> None:
    """Tiles of 96 FLOPs on devices of 100 FLOP/s, two a device: about 1 s each. The PS stops
    for 30 s: on waking the copies out are not overdue (before, each was backed up on the other
    device), and the results that come in teach an overhead of the PS's running time, not of
    its pause (before, about 9 s)."""
    core, events, conns = _busy_core(gflops=1e-7)
    assert all(len(c.slot.in_flight) == 2 for c in conns)
    clock.now_s += 1.0
    for conn in conns:
        _return_one(core, conn, clock.now_s, compute_s=0.96)
    _ticks(core, clock, 0.25, heard=conns)
    assert core.stats.backups == 0
    clock.now_s += 30
    core.tick()
    assert [kind for kind, _ in events.events].count("ps_paused") == 1
    assert core.stats.backups == 0
    clock.now_s += 0.75
    for conn in conns:
        _return_one(core, conn, clock.now_s, compute_s=0.96)
    for conn in conns:
        overhead = conn.slot.overhead_s
        assert overhead is not None and overhead < 1.0, overhead  # the PS ran 2 s in all
    assert core.stats.tiles == 4


def test_the_watchdog_says_how_the_last_device_went(clock: _Clock) -> None:
    """Every device cut off (a network down): their leases expire, and the watchdog's reason
    names the last one to go and how, not only that no tile came back."""
    core, events, (first, last) = _busy_core(no_progress_s=10)
    _ticks(core, clock, 1, heard=[first, last])
    _ticks(core, clock, 2, heard=[last])  # the first falls silent 1 s before the last
    _ticks(core, clock, 10)
    reason = core.watchdog_reason
    assert reason is not None and reason.startswith("no tile accepted"), reason
    assert f"no device has been attached since {last.slot.name} left" in reason, reason
    assert "(lease_expired: no message for more than 5 s)" in reason, reason


def test_ticks_late_by_less_than_the_pause_threshold_are_no_pause(clock: _Clock) -> None:
    core, events, conns = _busy_core()
    assert core.config.pause_s == 2.0  # 8 ticks of 0.25 s, under half the 5 s lease
    for _ in range(4):  # a busy loop: ticks 1.5 s apart, nobody heard from
        clock.now_s += 1.5
        core.tick()
    assert not [kind for kind, _ in events.events if kind == "ps_paused"]
    assert not core.conns  # 6 s without a message: leases expired as they should


# -- testbed clean RUN_DIR: this run's processes only, and never a running run's -------------------

@contextlib.contextmanager
def _processes(*specs: tuple[list[str], Path | None],
               cwd: Path | None = None) -> Iterator[list[subprocess.Popen]]:
    """Sleeping processes with those extra arguments (and stdout into that file), killed and
    reaped when the block ends; returned once each has exec'd."""
    procs = []
    try:
        for args, stdout in specs:
            out = open(stdout, "ab") if stdout is not None else subprocess.DEVNULL
            procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                           *args], stdout=out, stderr=subprocess.STDOUT,
                                          cwd=cwd))
            if stdout is not None:
                out.close()  # type: ignore[union-attr]
        for proc in procs:
            deadline = time.monotonic() + 10
            while args_of(proc.pid)[-1:] != specs[procs.index(proc)][0][-1:] \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def args_of(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def _run_dir(tmp_path: Path, name: str) -> Path:
    run_dir = tmp_path / name
    (run_dir / "agents").mkdir(parents=True)
    (run_dir / "up.json").write_text("{}")
    return run_dir


def test_clean_kills_only_processes_that_name_this_run_directory(tmp_path: Path) -> None:
    """r08: the old run's pids.json names a pid now held by another run's PS (pid reuse); it
    was killed, and that run ended "interrupted". Only a process whose command line names this
    run directory (the PS) or that writes its output there (the fork server, an agent) is
    this run's."""
    old, other = _run_dir(tmp_path, "old"), _run_dir(tmp_path, "other")
    specs = [
        (["testbed.ps_backend", "--run-dir", str(other)], other / "ps.log"),  # another run's PS
        (["testbed.agent"], other / "agents" / "phones-0.log"),  # another run's agent
        (["testbed.ps_backend", "--run-dir", str(old)], None),  # this run's PS
        (["testbed.emulator.agent_forkserver"], old / "agents" / "phones-0.log"),  # its agent
    ]
    with _processes(*specs) as procs:
        others, ours = procs[:2], procs[2:]
        write_json_atomic(old / "pids.json", {
            "testbed_up": None, "ps": others[0].pid, "agent_forkserver": ours[1].pid,
            "agents": {"phones-0": others[1].pid, "phones-1": ours[0].pid}})
        lines = cleanup.clean_run_dir(old)
        assert lines[0].endswith("stopped 2 leftover process(es)"), lines
        for proc in ours:
            assert proc.wait(10) is not None
        assert all(proc.poll() is None for proc in others), "another run's process was killed"
    # working in the directory is not naming it: "-m" or "testbed.agent" is no path in it
    with _processes((["-m", "testbed.agent"], None), cwd=old) as (stranger,):
        write_json_atomic(old / "pids.json", {"ps": stranger.pid})
        assert cleanup.clean_run_dir(old)[0].endswith("stopped 0 leftover process(es)")
        assert stranger.poll() is None


def test_clean_refuses_a_run_whose_testbed_up_still_runs(tmp_path: Path) -> None:
    """The lock `testbed up` holds on its run directory, or (a run made before the lock)
    pids.json's testbed_up: a live `testbed up` naming the directory."""
    from testbed.cli import main

    run_dir = _run_dir(tmp_path, "live")
    with _processes((["testbed.ps_backend", "--run-dir", str(run_dir)], None)) as (ps,):
        write_json_atomic(run_dir / "pids.json", {"testbed_up": None, "ps": ps.pid})
        lock = RunLock(run_dir)
        try:
            with pytest.raises(ValueError, match="still running") as refused:
                cleanup.clean_run_dir(run_dir)
            assert isinstance(refused.value, cleanup.RunStillRunning)
            assert main(["clean", str(run_dir)]) == 2
        finally:
            lock.release()
        assert ps.poll() is None, "a running run's PS was killed"
        script = tmp_path / "testbed"  # `testbed up --resume RUN_DIR`, as ps shows it
        script.write_text("import time\ntime.sleep(60)\n")
        up = subprocess.Popen([sys.executable, str(script), "up", "--resume", str(run_dir)])
        try:
            deadline = time.monotonic() + 10
            while args_of(up.pid)[-1:] != [str(run_dir)] and time.monotonic() < deadline:
                time.sleep(0.01)
            write_json_atomic(run_dir / "pids.json", {"testbed_up": up.pid, "ps": ps.pid})
            with pytest.raises(ValueError, match=f"pid {up.pid}"):
                cleanup.clean_run_dir(run_dir)
            assert ps.poll() is None
        finally:
            up.kill()
            up.wait()
        assert cleanup.clean_run_dir(run_dir)[0].endswith("stopped 1 leftover process(es)")
        assert ps.wait(10) is not None


# -- a PS that left no summary: the steps say what was done -------------------------------------

def _crashed_run(run_dir: Path, damaged: bool = False) -> None:
    """What a run whose PS was killed after 3 steps leaves (no ps_summary.json); ``damaged``:
    with a line that is no step record (the summary skips it; the report refuses it)."""
    run_dir.mkdir(exist_ok=True)
    write_json_atomic(run_dir / "up.json", {"steps": 6})
    log = RunLog(run_dir)
    for step, loss in enumerate([5.5, 5.0, 4.5]):
        log.step(step=step, loss=loss, wall_s=1.0, device_time_s=0.5, bytes_down=100,
                 bytes_up=50, tiles=10, recomputed_tiles=1, requeued_tiles=2, rejected=0,
                 time_dilation=1.0)
    log.close()
    with open(run_dir / "steps.jsonl", "a") as f:
        if damaged:
            f.write('{"step": "three", "loss": 1.0}\n')
        f.write('{"step": 3, "loss": 4.')  # torn by the kill


def test_the_summary_of_a_run_whose_ps_left_none_counts_the_recorded_steps(
        tmp_path: Path) -> None:
    """r09: summary.json was {"state": "failed"}; `testbed up` printed "failed: 0 steps, final
    loss None" with three steps in steps.jsonl."""
    from testbed.summary import write_summary
    from testbed.topology import load_topology

    _crashed_run(tmp_path, damaged=True)
    summary = write_summary(tmp_path, load_topology(TINY), {"backend": "loopback"}, 1.0, 1, {})
    assert summary["state"] == "failed" and summary["steps_done"] == 3
    assert summary["losses"] == [5.5, 5.0, 4.5] and summary["final_loss"] == 4.5
    assert (summary["tiles"], summary["bytes_down"], summary["requeued_tiles"]) == (30, 300, 6)
    assert summary["steps"] == 5  # the topology's: what this session was asked for
    assert summary["totals_from"] == "steps.jsonl"
    assert json.loads((tmp_path / "summary.json").read_text())["steps_done"] == 3


@pytest.mark.parametrize("summary_json", [None, {"state": "failed", "exit_code": 1}])
def test_the_report_of_such_a_run_counts_the_recorded_steps(
        tmp_path: Path, summary_json: dict[str, Any] | None) -> None:
    """`testbed up` killed after its PS (no summary.json), or a summary written before the
    steps were counted: the report said "state: ? ... steps: 3 of ?; final loss: none"."""
    from testbed.report import markdown

    _crashed_run(tmp_path)
    if summary_json is not None:
        write_json_atomic(tmp_path / "summary.json", summary_json)
    text = markdown(tmp_path).read_text()
    assert "- state: failed" in text, text
    assert "- steps: 3 of 6; final loss 4.5000" in text, text
    assert "- tiles: 30," in text, text


def test_the_report_of_a_run_without_summary_json_takes_the_ps_summary(tmp_path: Path) -> None:
    from testbed.report import markdown

    _crashed_run(tmp_path)
    write_json_atomic(tmp_path / "ps_summary.json", {
        "state": "done", "steps_done": 3, "steps": 3, "final_loss": 4.5, "losses": [5.5, 5, 4.5],
        "tiles": 31, "wall_s": 3.5, "time_dilation": 1.0, "bytes_down": 1, "bytes_up": 1})
    text = markdown(tmp_path).read_text()
    assert "- state: done" in text and "- steps: 3 of 3; final loss 4.5000" in text, text
    assert "- tiles: 31," in text, text


# -- a failure on an OSError names its file ---------------------------------------------------

def test_an_oserror_failure_keeps_its_file_name() -> None:
    """r12: ledger/ removed during a run: the summary's error was "FileNotFoundError(2, 'No
    such file or directory')", without the path."""
    from testbed.ps_backend.main import failure_text

    exc = FileNotFoundError(2, "No such file or directory", "/runs/r/ledger")
    assert failure_text(exc) == \
        "FileNotFoundError: [Errno 2] No such file or directory: '/runs/r/ledger'"
    assert failure_text(OSError(18, "Invalid cross-device link", "/a", None, "/b")) == \
        "OSError: [Errno 18] Invalid cross-device link: '/a' -> '/b'"
    assert failure_text(ValueError("bad")) == "ValueError: bad"
    assert failure_text(KeyError("k")) == "KeyError: 'k'"
    assert failure_text(RuntimeError()) == "RuntimeError"


# -- checkpoints: a temporary left by a kill goes at the next save ---------------------------------

def test_a_save_removes_the_temporaries_of_killed_saves_and_nothing_else(tmp_path: Path) -> None:
    from testbed.ps_backend.main import _save

    directory = tmp_path / "checkpoints"
    directory.mkdir()
    stale = [directory / ".step-000002.pt.123-0a1b2c3d", directory / ".step-000003.pt.9-abcdef01"]
    kept = [directory / "notes.tmp", directory / ".step-000002.pt.tmp",
            directory / ".other.pt.123-0a1b2c3d", directory / "step-000001.pt.123-0a1b2c3d",
            directory / ".step-000002.pt.123-0a1b2c3d.tmp", directory / ".step-2.pt.123-0a1b2c3d"]
    for path in stale + kept:
        path.write_bytes(b"torn")
    trainer = types.SimpleNamespace(next_step=4, state_dict=lambda: {"step": 4})
    saved = _save(trainer, tmp_path, [1.0, 0.9, 0.8, 0.7])
    assert saved.name == "step-000004.pt"
    names = sorted(p.name for p in directory.iterdir())
    assert names == sorted([saved.name] + [p.name for p in kept]), names


def test_up_s_last_line_names_no_loss_when_no_step_finished(tmp_path: Path) -> None:
    """It said "failed: 0 steps, final loss None, 0 tiles"."""
    from testbed.up import final_line

    line = final_line({"state": "failed", "steps_done": 0, "final_loss": None, "tiles": 0},
                      tmp_path)
    assert line.startswith("failed: 0 steps, 0 tiles") and "None" not in line, line
    line = final_line({"state": "done", "steps_done": 1, "final_loss": 4.5, "tiles": 7}, tmp_path)
    assert line.startswith("done: 1 step, final loss 4.5000, 7 tiles"), line
    line = final_line({"state": "done", "steps_done": 40, "final_loss": 4.5, "tiles": 1905,
                       "resumes": 1}, tmp_path)
    assert line.startswith("done: 40 steps, final loss 4.5000, 1905 tiles (this session's)")
