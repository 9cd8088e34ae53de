"""`testbed up`'s parts that need no network: one clock, the spawner, the replay, the machine
check, cleaning from a partial run directory."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from testbed import capacity
from testbed.churn.replay import Replay, ReplayState, resume_point, state_after
from testbed.churn.schedule import build_schedule
from testbed.churn.trace import parse_trace
from testbed.emulator.agent_forkserver import ForkServerGone
from testbed.pdeathsig import die_with_parent
from testbed.runlog import RunLog, read_jsonl
from testbed.up import Spawner
from tests.conftest import REPO, TINY, killed_at_exit

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


# -- one clock ------------------------------------------------------------------------------------

def test_two_writers_of_one_run_dir_share_the_origin(tmp_path: Path) -> None:
    first = RunLog(tmp_path)
    time.sleep(0.3)
    second = RunLog(tmp_path)  # the PS, started later
    second.event("disconnect", device="d")
    first.event("churn", device="d")  # written after the disconnect
    first.close()
    second.close()
    assert first.started_s == second.started_s
    disconnect, churn = read_jsonl(tmp_path / "events.jsonl")
    assert disconnect["elapsed_s"] <= churn["elapsed_s"]
    assert abs((churn["t"] - churn["elapsed_s"]) - (disconnect["t"] - disconnect["elapsed_s"])) \
        <= 1e-5


# -- the spawner ----------------------------------------------------------------------------------

def _alive_after(spawn_on_thread: bool) -> bool:
    """Fork a sleeper with PR_SET_PDEATHSIG from a short-lived thread; is it alive after?"""
    spawner = Spawner()
    procs: list[subprocess.Popen] = []

    def fork() -> None:
        def start() -> subprocess.Popen:
            return subprocess.Popen(SLEEPER, preexec_fn=die_with_parent)
        procs.append(spawner.call(start) if spawn_on_thread else start())
    worker = threading.Thread(target=fork)
    worker.start()
    worker.join()
    try:
        time.sleep(0.5)
        return procs[0].poll() is None
    finally:
        procs[0].kill()
        procs[0].wait()
        spawner.close()


def test_a_child_started_for_a_thread_that_ended_lives_on() -> None:
    # Linux sends PR_SET_PDEATHSIG when the forking *thread* exits: a child forked directly by a
    # short-lived thread (as the churn replay did) dies with it ...
    assert not _alive_after(spawn_on_thread=False)
    # ... one forked by the spawner's long-lived thread does not.
    assert _alive_after(spawn_on_thread=True)


# -- the replay -----------------------------------------------------------------------------------

GROUPS = {"phones": ["phones-0", "phones-1", "phones-2"], "laptops": ["laptops-0"]}
TRACE = """time_s,device,event,arg
0.1,phones-0,leave,
0.2,laptops-0,partition,
0.3,phones-0,join,
0.4,laptops-0,heal,
0.5,phones-1,crash,
"""


class FakeRun:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object]] = []

    def start_agent(self, name: str, cut_off: bool = False) -> None:
        self.calls.append(("start", name, "cut off" if cut_off else None))

    def signal_agent(self, name: str, sig: int) -> bool:
        self.calls.append(("signal", name, signal.Signals(sig).name))
        return True

    def set_partitioned(self, name: str, partitioned: bool) -> bool:
        self.calls.append(("link", name, partitioned))
        return True

    def ps_alive(self) -> bool:
        return True


def _schedule():
    return build_schedule(parse_trace(TRACE, "t.csv", GROUPS), GROUPS, seed=1)


def _replay_all(replay: Replay) -> None:
    """Run the replay until it has applied TRACE's five actions (10 s at most), then stop it."""
    replay.start()
    deadline = time.monotonic() + 10
    while replay.applied < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    replay.stop()


def test_replay_applies_every_action_in_order_and_records_it(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_text(json.dumps({"state": "training"}))
    runlog = RunLog(tmp_path)
    run = FakeRun()
    _replay_all(Replay(_schedule(), run, tmp_path, dilation=0.2, event=runlog.event))
    runlog.close()
    assert run.calls == [("signal", "phones-0", "SIGTERM"), ("link", "laptops-0", True),
                         ("start", "phones-0", None), ("link", "laptops-0", False),
                         ("signal", "phones-1", "SIGKILL")]
    churn = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "churn"]
    assert [(e["device"], e["action"], e["effect"]) for e in churn] == [
        ("phones-0", "leave", "SIGTERM"), ("laptops-0", "partition", "link down"),
        ("phones-0", "join", "applied"), ("laptops-0", "heal", "link up"),
        ("phones-1", "crash", "SIGKILL")]


def test_an_action_due_after_the_training_ended_is_not_applied(tmp_path: Path) -> None:
    """A crash due after the last step met agents already stopped: it was applied to them
    ("absent") and counted among the run's churn events."""
    status = tmp_path / "status.json"
    status.write_text(json.dumps({"state": "training"}))
    runlog = RunLog(tmp_path)
    run = FakeRun()
    # at D 8 the actions are due 0.8 s of wall time apart, more than the replay's
    # STATUS_EVERY_S between two reads of status.json, with room for a busy host
    replay = Replay(_schedule(), run, tmp_path, dilation=8.0, event=runlog.event)
    replay.start()
    deadline = time.monotonic() + 10
    while replay.applied < 2 and time.monotonic() < deadline:  # 0.8 s and 1.6 s applied
        time.sleep(0.005)
    status.write_text(json.dumps({"state": "done"}))  # the PS ended at about 1.6 s
    time.sleep(2.8)  # the three actions left were due by 4 s
    replay.stop()
    runlog.close()
    assert replay.applied == 2 and len(run.calls) == 2, run.calls
    churn = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "churn"]
    assert len(churn) == 2


class LoopbackRun(FakeRun):
    """A network that cannot take links down (loopback): the agent blackholes itself, and a
    signal reaches only an agent that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.running = {"phones-0", "phones-1", "phones-2"}

    def start_agent(self, name: str, cut_off: bool = False) -> None:
        super().start_agent(name, cut_off)
        self.running.add(name)

    def signal_agent(self, name: str, sig: int) -> bool:
        if name not in self.running:
            return False
        super().signal_agent(name, sig)
        if sig in (signal.SIGTERM, signal.SIGKILL):
            self.running.discard(name)
        return True

    def set_partitioned(self, name: str, partitioned: bool) -> bool:
        return False


def test_an_agent_started_while_its_link_is_down_starts_cut_off_on_loopback(
        tmp_path: Path) -> None:
    """On loopback a cut is the agent's own: a device that joins while cut off (its partition
    came while it was away, or it crashed while cut off) got an agent that worked at once."""
    trace = ("time_s,device,event,arg\n0,laptops-0,leave,\n0.05,laptops-0,partition,\n"
             "0.1,laptops-0,join,\n0.15,phones-0,partition,\n0.2,phones-0,crash,\n"
             "0.25,phones-0,join,\n0.3,phones-0,heal,\n0.35,phones-0,crash,\n"
             "0.4,phones-0,join,\n")
    schedule = build_schedule(parse_trace(trace, "t.csv", GROUPS), GROUPS, seed=1)
    (tmp_path / "status.json").write_text(json.dumps({"state": "training"}))
    run = LoopbackRun()
    replay = Replay(schedule, run, tmp_path, dilation=0.2, event=lambda *a, **k: None)
    replay.start()
    deadline = time.monotonic() + 10
    while replay.applied < len(schedule.actions) and time.monotonic() < deadline:
        time.sleep(0.02)
    replay.stop()
    assert [c for c in run.calls if c[0] == "start"] == [
        ("start", "laptops-0", "cut off"), ("start", "phones-0", "cut off"),
        ("start", "phones-0", None)]  # healed before its last join


def test_a_crash_of_an_agent_cut_off_by_itself_is_held_as_the_cut_holds_its_close(
        tmp_path: Path) -> None:
    """On loopback SIGKILL closed a cut-off agent's socket past its own blackhole (the PS saw a
    disconnect at the crash, where a device behind a down link tells it nothing): the agent
    gets SIGQUIT and dies once healed or once the PS ends its session; a join before either
    kills it first (a crashed agent has nothing to finish), and after a heal it is dead."""
    trace = ("time_s,device,event,arg\n0.05,phones-0,partition,\n0.1,phones-0,crash,\n"
             "0.15,phones-0,join,\n0.2,phones-1,partition,\n0.25,phones-1,crash,\n"
             "0.3,phones-1,heal,\n0.35,phones-1,join,\n0.4,phones-2,crash,\n")
    schedule = build_schedule(parse_trace(trace, "t.csv", GROUPS), GROUPS, seed=1)
    (tmp_path / "status.json").write_text(json.dumps({"state": "training"}))
    run = LoopbackRun()
    effects: list[tuple[str, str]] = []
    replay = Replay(schedule, run, tmp_path, dilation=0.2,
                    event=lambda kind, **k: effects.append((k["device"], k["effect"]))
                    if kind == "churn" else None)
    replay.start()
    deadline = time.monotonic() + 10
    while replay.applied < len(schedule.actions) and time.monotonic() < deadline:
        time.sleep(0.02)
    replay.stop()
    assert run.calls == [
        ("signal", "phones-0", "SIGUSR1"), ("signal", "phones-0", "SIGQUIT"),
        ("signal", "phones-0", "SIGKILL"), ("start", "phones-0", "cut off"),
        ("signal", "phones-1", "SIGUSR1"), ("signal", "phones-1", "SIGQUIT"),
        ("signal", "phones-1", "SIGUSR2"), ("start", "phones-1", None),
        ("signal", "phones-2", "SIGKILL")]  # not cut off: killed at once
    assert [e for _, e in effects] == ["agent blackholed", "SIGQUIT", "applied",
                                       "agent blackholed", "SIGQUIT", "agent healed", "applied",
                                       "SIGKILL"]


class BrokenLink(FakeRun):
    """A run whose partition fails the way a bug would (the replay's own code raising)."""

    def set_partitioned(self, name: str, partitioned: bool) -> bool:
        raise RuntimeError("the link would not go down")


def _replay_until_it_fails(replay: Replay) -> None:
    replay.start()
    deadline = time.monotonic() + 10
    while replay.failure is None and time.monotonic() < deadline:
        time.sleep(0.02)
    replay.stop()


def test_a_replay_that_stops_says_where_and_why(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "status.json").write_text(json.dumps({"state": "training"}))
    runlog = RunLog(tmp_path)
    run = BrokenLink()
    replay = Replay(_schedule(), run, tmp_path, dilation=0.2, event=runlog.event)
    with caplog.at_level(logging.ERROR, logger="testbed.churn.replay"):
        _replay_until_it_fails(replay)
    runlog.close()
    assert replay.failure == ("the churn trace stopped replaying after 1 of its 5 actions: the "
                              "link would not go down")
    logged = [r for r in caplog.records if r.name == "testbed.churn.replay"]
    assert len(logged) == 1 and logged[0].exc_info is not None  # a bug keeps its traceback
    assert run.calls == [("signal", "phones-0", "SIGTERM")]  # nothing after the failure
    failed = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "churn_failed"]
    assert [(e["applied"], e["error"]) for e in failed] == [(1, "the link would not go down")]


class ForkServerKilled(FakeRun):
    """A run whose agents' fork server was SIGKILLed: a join cannot start its agent."""

    def start_agent(self, name: str, cut_off: bool = False) -> None:
        super().start_agent(name, cut_off)
        raise ForkServerGone("the agent fork server (pid 4242) was killed by SIGKILL; see "
                             "RUN/agents/forkserver.log")


def test_a_join_after_the_fork_server_died_stops_the_replay_in_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """It logged a traceback from the replay's thread; the run failed as it should."""
    (tmp_path / "status.json").write_text(json.dumps({"state": "training"}))
    replay = Replay(_schedule(), ForkServerKilled(), tmp_path, dilation=0.2,
                    event=lambda *a, **k: None)
    with caplog.at_level(logging.ERROR, logger="testbed.churn.replay"):
        _replay_until_it_fails(replay)
    assert replay.failure == (
        "the churn trace stopped replaying after 2 of its 5 actions: phones-0's join at t=0.3 s "
        "cannot start its agent: the agent fork server (pid 4242) was killed by SIGKILL; see "
        "RUN/agents/forkserver.log; no agent can start any more")
    logged = [r for r in caplog.records if r.name == "testbed.churn.replay"]
    assert [(r.getMessage(), r.exc_info) for r in logged] == [
        (f"{replay.failure}; the run fails", None)]


class PromptPS(FakeRun):
    """A PS that logs the broken stream while the signal is still being sent (as a fast one
    does: the kill lands, the PS's thread writes, then the replay's call returns)."""

    def __init__(self, runlog: RunLog) -> None:
        super().__init__()
        self.runlog = runlog

    def signal_agent(self, name: str, sig: int) -> bool:
        super().signal_agent(name, sig)
        time.sleep(0.01)
        self.runlog.event("disconnect", device=name)
        time.sleep(0.01)
        return True


def test_an_action_is_stamped_before_what_it_causes(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_text(json.dumps({"state": "training"}))
    runlog = RunLog(tmp_path)
    _replay_all(Replay(_schedule(), PromptPS(runlog), tmp_path, dilation=0.2,
                       event=runlog.event))
    runlog.close()
    events = read_jsonl(tmp_path / "events.jsonl")
    for device, action in (("phones-0", "leave"), ("phones-1", "crash")):
        churn = next(e for e in events if e["event"] == "churn" and e["action"] == action)
        broken = next(e for e in events if e["event"] == "disconnect" and e["device"] == device)
        assert churn["elapsed_s"] <= broken["elapsed_s"], (churn, broken)


def test_resume_goes_on_from_where_the_run_was(tmp_path: Path) -> None:
    schedule = _schedule()
    # a first session: clock started at t=100, two actions applied, the run stopped at t=100.5
    # with dilation 2, i.e. at trace time 0.25
    events = [{"event": "churn_clock_start", "t": 100.0, "offset_s": 0.0},
              {"event": "churn", "t": 100.2}, {"event": "churn", "t": 100.4},
              {"event": "run_stop", "t": 100.5}]
    state = resume_point(schedule, events, dilation=2.0)
    assert state.applied == 2
    assert abs(state.trace_s - 0.25) <= 1e-9
    assert state.present == {"phones-1", "phones-2", "laptops-0"}  # phones-0 has left
    assert state.partitioned == {"laptops-0"}
    assert state_after(schedule, 5).present == {"phones-0", "phones-2", "laptops-0"}

    (tmp_path / "status.json").write_text(json.dumps({"state": "training"}))
    runlog = RunLog(tmp_path)
    run = FakeRun()
    replay = Replay(schedule, run, tmp_path, dilation=0.2, event=runlog.event, start=state)
    replay.start()
    deadline = time.monotonic() + 10
    while replay.applied < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    replay.stop()
    runlog.close()
    # the partition in force is applied again, then only the actions not yet applied
    assert run.calls == [("link", "laptops-0", True), ("start", "phones-0", None),
                         ("link", "laptops-0", False), ("signal", "phones-1", "SIGKILL")]
    records = read_jsonl(tmp_path / "events.jsonl")
    assert [e["action"] for e in records if e["event"] == "churn"] == ["join", "heal", "crash"]
    assert records[0]["offset_s"] == 0.25


def test_a_resumed_replay_with_nothing_left_does_nothing(tmp_path: Path) -> None:
    replay = Replay(_schedule(), FakeRun(), tmp_path, 1.0, event=lambda *a, **k: None,
                    start=ReplayState(applied=5))
    replay.start()
    assert replay._thread is None


# -- the machine check ----------------------------------------------------------------------------

def _topology(count: int):
    from testbed.topology import parse_topology

    raw = yaml.safe_load(TINY.read_text())
    raw["devices"][0]["count"] = count
    return parse_topology(raw)


ROOMY = capacity.HostLimits(available_bytes=20e9, memory_source="MemAvailable",
                            tasks_free=90_000, tasks_source="kernel.threads-max",
                            fd_soft=1024, fd_hard=1 << 20)


def test_a_small_run_fits_and_a_huge_one_is_refused_naming_each_limit() -> None:
    assert capacity.problems(capacity.needs_of(_topology(3), "loopback"), ROOMY) == []
    needs = capacity.needs_of(_topology(9_000), "mininet")
    tight = capacity.HostLimits(20e9, "MemAvailable", 90_000, "kernel.threads-max", 1024, 4096)
    problems = capacity.problems(needs, tight)
    assert len(problems) == 3
    memory, tasks, fds = problems
    assert memory.startswith("memory: 9001 agent(s)") and "20.0 GB" in memory
    assert "MemAvailable" in memory
    assert tasks.startswith("processes: 9001 agent(s)") and "kernel.threads-max" in tasks
    assert "9002 node shells" in tasks
    assert fds.startswith("file descriptors:") and "4096" in fds
    # the memory figure follows the rule: PS + per agent its base, and the caches, each within
    # its budget and all together within CACHE_SHARES times a step's operands
    job = _topology(1).job
    weights, operands = capacity.weight_bytes(job), capacity.operand_bytes(job)
    assert operands > weights
    cached = min(9_001 * min(capacity.agent_cache_bytes(job), operands),
                 capacity.CACHE_SHARES * operands)
    want = (capacity.PS_BASE_BYTES + 4 * weights + 9_001 * capacity.AGENT_BASE_BYTES + cached
            + 9_002 * capacity.SHELL_BYTES)
    assert abs(needs.memory_bytes - want) <= 1e-9 * want


def test_a_device_may_cache_a_steps_operands_however_many_devices_there_are() -> None:
    """A plan may give the work to a few of many devices; each of those must be able to keep
    its blocks from forward to backward (an even share over all devices left them 64 MiB)."""
    from pathlib import Path

    from testbed.topology import load_topology

    mib = 1 << 20
    tiny = _topology(3).job
    assert capacity.agent_cache_bytes(tiny) == capacity.MIN_AGENT_CACHE_BYTES  # a tiny step
    large = load_topology(Path(REPO) / "topologies" / "large.yaml").job  # 240 devices
    assert capacity.agent_cache_bytes(large) == int(capacity.operand_bytes(large)) > 64 * mib
    hotcarbon = load_topology(Path(REPO) / "topologies" / "hotcarbon.yaml").job
    assert capacity.operand_bytes(hotcarbon) > 768 * mib
    assert capacity.agent_cache_bytes(hotcarbon) == 768 * mib  # the agent's own default


def test_a_groups_own_cache_is_what_its_devices_get_and_what_the_memory_rule_counts() -> None:
    from testbed.topology import parse_topology

    raw = yaml.safe_load((Path(REPO) / "topologies" / "hotcarbon.yaml").read_text())
    default = parse_topology(raw)
    raw["devices"][0]["cache"] = "256MiB"
    small = parse_topology(raw)
    mib = 1 << 20
    assert capacity.device_cache_bytes(small.job, small.devices[0].group) == 256 * mib
    assert capacity.device_cache_bytes(default.job, default.devices[0].group) == 768 * mib
    # 15 phones, each cache within a step's operands and all far within CACHE_SHARES of them
    assert capacity.needs_of(default, "loopback").memory_bytes - \
        capacity.needs_of(small, "loopback").memory_bytes == pytest.approx(15 * 512 * mib)


def test_the_machine_here_is_read() -> None:
    host = capacity.host_limits()
    assert host.available_bytes is None or host.available_bytes > 0
    assert host.fd_hard >= host.fd_soft > 0


def test_up_refuses_a_run_the_machine_cannot_hold_before_starting_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from testbed import cli
    from testbed.emulator.network import select

    # a small machine's limits, not this one's (a host with hundreds of GB free holds any run
    # a test would write): 2 GB available, tasks and files to spare
    small = capacity.HostLimits(available_bytes=2e9, memory_source="a small machine's",
                                tasks_free=1 << 20, tasks_source="a small machine's",
                                fd_soft=1 << 20, fd_hard=1 << 20)
    monkeypatch.setattr(capacity, "host_limits", lambda: small)

    def make_network(*args: object, **kwargs: object) -> object:
        raise AssertionError("testbed up made the run's network")
    monkeypatch.setattr(select, "make_network", make_network)
    raw = yaml.safe_load(TINY.read_text())
    raw["devices"][0]["count"] = 100  # 100 agents x 32 MB + the PS's 400 MB: ~3.6 GB
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "runs"
    children = {c.pid for c in psutil.Process().children(recursive=True)}
    code = cli.main(["up", str(path), "--no-live", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "cannot hold the run" in err and str(path) in err
    assert "memory: 101 agent(s)" in err and "only 2.0 GB is available" in err, err
    assert not out.exists()  # nothing was started or written
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= children


# -- testbed clean RUN_DIR from a partial run directory -----------------------------------------

def test_clean_works_from_whatever_the_run_dir_has(tmp_path: Path) -> None:
    from testbed import cli

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "up.json").write_text("{}")  # killed before pids.json or network.json existed
    assert cli.main(["clean", str(run_dir)]) == 0
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                              "testbed.agent", "--run-dir", str(run_dir)])  # this run's agent
    with killed_at_exit(stray):
        deadline = time.monotonic() + 10  # until it has exec'd (its command line is set)
        while "testbed.agent" not in psutil.Process(stray.pid).cmdline() \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        (run_dir / "pids.json").write_text(json.dumps({"ps": None,
                                                       "agents": {"d": stray.pid}}))
        assert cli.main(["clean", str(run_dir)]) == 0
        assert stray.wait(10) is not None
    assert not psutil.pid_exists(stray.pid) or psutil.Process(stray.pid).status() == "zombie"
    not_a_run = tmp_path / "other"
    not_a_run.mkdir()
    assert cli.main(["clean", str(not_a_run)]) == 2


def test_pids_survive_a_torn_file(tmp_path: Path) -> None:
    from testbed.emulator.network.cleanup import clean_run_dir

    (tmp_path / "pids.json").write_text('{"ps": 12')  # killed mid-write (not atomic elsewhere)
    assert clean_run_dir(tmp_path)[0].endswith("stopped 0 leftover process(es)")
    assert os.path.exists(tmp_path / "pids.json")
    for edited in ('{"ps": "12", "agents": 5}', '{"agents": ["a", 3]}', '[1, 2]'):
        (tmp_path / "pids.json").write_text(edited)  # not as testbed up writes it
        assert clean_run_dir(tmp_path)[0].endswith("stopped 0 leftover process(es)"), edited


def test_a_new_dilation_moves_the_replays_clock_from_that_moment(tmp_path: Path) -> None:
    # phones-0 leaves at trace time 0.1: 5 wall seconds at D 50; after 0.2 s (trace 0.004) D
    # becomes 1, so the leave is due ~0.1 s later, not 4.8 s
    (tmp_path / "status.json").write_text(json.dumps({"state": "training"}))
    run = FakeRun()
    replay = Replay(_schedule(), run, tmp_path, dilation=50.0, event=lambda *a, **k: None)
    started = time.monotonic()
    replay.start()
    time.sleep(0.2)
    assert replay.applied == 0
    replay.set_dilation(1.0)
    deadline = time.monotonic() + 10
    while replay.applied < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    elapsed = time.monotonic() - started
    replay.stop()
    assert run.calls[0] == ("signal", "phones-0", "SIGTERM")
    assert 0.25 <= elapsed < 2.0, elapsed  # ~0.3 s; at the old D it would be 5 s


def test_resume_counts_trace_time_at_each_d_an_adaptive_run_had() -> None:
    # clock started at t=100 at D 2; the links moved to D 4 at t=100.2; stopped at t=100.6:
    # 0.2 / 2 + 0.4 / 4 = 0.2 of trace time (at D 2 throughout it would be 0.3)
    events = [{"event": "links_dilation", "t": 99.0, "old": 1.0, "new": 2.0},  # the probe's
              {"event": "churn_clock_start", "t": 100.0, "offset_s": 0.0},
              {"event": "links_dilation", "t": 100.2, "old": 2.0, "new": 4.0},
              {"event": "run_stop", "t": 100.6}]
    state = resume_point(_schedule(), events, dilation=1.0)
    assert abs(state.trace_s - 0.2) <= 1e-9


# -- the plain progress of `testbed up --no-live` -----------------------------------------------

def _plain_lines(run_dir: Path, script: list[str]) -> list[str]:
    """What `testbed up --no-live` prints while the PS's status.json goes through ``script``,
    one state a poll (a step 0 line appears in steps.jsonl once the state is training)."""
    from types import SimpleNamespace

    from rich.console import Console

    from testbed.errors import EXIT_OK
    from testbed.up import _watch

    polls = iter(range(len(script) + 1))

    def poll() -> int | None:
        i = next(polls)
        if i < len(script):
            (run_dir / "status.json").write_text(json.dumps({"state": script[i]}))
        if script[min(i, len(script) - 1)] == "training" and \
                not (run_dir / "steps.jsonl").exists():
            (run_dir / "steps.jsonl").write_text(json.dumps(
                {"step": 0, "loss": 5.25, "tiles": 71, "wall_s": 0.5}) + "\n")
        return 0 if i >= len(script) else None

    run = SimpleNamespace(run_dir=run_dir, poll=poll, adb=None, notes=[],
                          topology=SimpleNamespace(name="tiny"), failures=lambda: [],
                          died_unasked=lambda: [])
    console = Console(record=True, width=120)
    assert _watch(run, threading.Event(), console, live=False) == EXIT_OK  # type: ignore[arg-type]
    return console.export_text().splitlines()


def test_plain_progress_names_each_phase_before_training_once(tmp_path: Path) -> None:
    """Without the live view, `testbed up` prints the PS's phases before training as they
    change (waiting for devices, probing, planning: minutes on large topologies), each once,
    then a line per step; not how the run ended, which its last line says (a short run can go
    from starting to done between two polls)."""
    lines = _plain_lines(tmp_path, ["starting", "waiting for devices", "waiting for devices",
                                    "planning", "planning", "training", "training", "done"])
    assert lines == ["PS: waiting for devices", "PS: planning",
                     "step 0: loss 5.2500, 71 tiles, 0.50 s"], lines
    (tmp_path / "status.json").unlink()
    (tmp_path / "steps.jsonl").unlink()
    assert _plain_lines(tmp_path, ["starting", "done"]) == []


def test_a_steps_line_gives_its_device_time_and_how_late_the_devices_ran() -> None:
    from testbed.up import step_line

    step = {"step": 3, "loss": 4.5, "tiles": 71, "wall_s": 1.5, "device_time_s": 0.75,
            "lateness_share": 0.4321}
    assert step_line(step) == "step 3: loss 4.5000, 71 tiles, 1.50 s (0.75 s of device time; " \
        "devices late <= 43.2% of it)"
    step["lateness_share"] = None  # no emulated tiles
    assert step_line(step) == "step 3: loss 4.5000, 71 tiles, 1.50 s (0.75 s of device time)"


def test_the_watch_ends_a_run_whose_side_failed(tmp_path: Path) -> None:
    """A churn replay that stopped (or records that cannot be written) ends the run at the next
    poll, not when the PS has trained every step: it is not the run that was asked for."""
    from types import SimpleNamespace

    from rich.console import Console

    from testbed.errors import EXIT_FAILURE
    from testbed.up import _watch

    polls = iter(range(1000))
    run = SimpleNamespace(run_dir=tmp_path, poll=lambda: None, adb=None, notes=[],
                          topology=SimpleNamespace(name="tiny"), died_unasked=lambda: [],
                          failures=lambda: ["the churn trace stopped"] if next(polls) >= 2
                          else [])
    started = time.monotonic()
    code = _watch(run, threading.Event(), Console(record=True), live=False)  # type: ignore[arg-type]
    assert code == EXIT_FAILURE and time.monotonic() - started < 5


def test_resume_counts_the_trace_time_the_devices_samples_lived_past_the_last_event(
        tmp_path: Path) -> None:
    """A run killed in a stretch with no event (every device cut off, waiting for its heal):
    its last event is far behind where it stood, and the devices' samples go on. The replay
    goes on from the latest record of any run file, not the last event, which lost the
    stretch and made the partition longer than the trace says."""
    from testbed.churn.replay import TAIL_BYTES, last_record_t

    schedule = _schedule()
    events = [{"event": "churn_clock_start", "t": 100.0, "offset_s": 0.0},
              {"event": "churn", "t": 100.2}]
    samples = tmp_path / "devices.jsonl"
    filler = json.dumps({"device": "phones-0", "t": 100.5, "pad": "x" * 200})
    lines = [filler] * (2 * TAIL_BYTES // len(filler))  # more than the tail read
    samples.write_text("\n".join([*lines, json.dumps({"device": "phones-1", "t": 103.5}),
                                  '{"device": "phones-2", "t": 10']))  # a torn last line
    assert last_record_t(samples) == 103.5
    assert last_record_t(tmp_path / "absent.jsonl") == 0.0
    state = resume_point(schedule, events, dilation=2.0, later_t=last_record_t(samples))
    assert abs(state.trace_s - 1.75) <= 1e-9  # (103.5 - 100) / 2, not (100.2 - 100) / 2
