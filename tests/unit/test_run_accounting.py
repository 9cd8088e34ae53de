"""A run's accounts agree with themselves: summary.json with steps.jsonl and events.jsonl,
devices.jsonl with the sessions that ended, `testbed simulate` with `testbed up` on churn.

(Findings of a stress run: a summary counting late results no step counts, `departed_devices`
0 beside `departures` 1, no final devices.jsonl record for a departed session, and a trace's
`leave` of a cut-off device counted as a leave by the simulator, as a disconnect by the
emulation.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from testbed.churn.schedule import load_schedule
from testbed.ps_backend.accounting import run_figures
from testbed.ps_backend.core import Descriptor, PsConfig, PsCore
from testbed.runlog import RunLog, read_jsonl, write_json_atomic
from testbed.simulate.run import simulate
from testbed.simulate.sim import Simulation
from testbed.summary import write_summary
from testbed.topology import load_topology
from tests.conftest import TINY

LEASE_S = 5.0  # the PS's lease (PsConfig.lease_s), which the simulation keeps too
# the tiny job's per-step figures under the summary's keys, as steps.jsonl names them
STEP_KEYS = {"tiles": "tiles", "recomputed_tiles": "recomputed_tiles",
             "requeued_tiles": "requeued_tiles", "rejected": "rejected", "late": "late",
             "bytes_down": "bytes_down", "bytes_up": "bytes_up",
             "device_compute_s": "device_compute_s", "energy_j": "energy_j",
             "failed_checks": "failed_checks", "backups": "backups",
             "backup_wins": "backup_wins", "wasted_tiles": "wasted"}


def test_every_step_figure_of_the_summary_is_named_for_the_step_record() -> None:
    assert set(run_figures(PsCore(_config()).finished)) == {*STEP_KEYS, "max_lag_s"}


def test_a_simulated_runs_summary_is_the_sum_of_its_steps_and_its_departures(
        tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("time_s,device,event,arg\n0.01,phones-1,leave,\n0.02,phones-2,crash,\n"
                     "0.03,phones-1,join,\n")
    topology = load_topology(TINY).with_overrides(steps=3)
    (tmp_path / "run").mkdir()
    summary = simulate(topology, tmp_path / "run", load_schedule(trace, topology),
                       report=False)
    steps = read_jsonl(tmp_path / "run" / "steps.jsonl")
    for key, step_key in STEP_KEYS.items():
        total = sum(s[step_key] for s in steps)
        if isinstance(total, int):
            assert summary[key] == total, key
        else:  # each record and the summary are rounded to 1e-6
            assert summary[key] == pytest.approx(total, rel=1e-9,
                                                 abs=0.5e-6 * (len(steps) + 1)), key
    assert summary["after_last_step"] == {}
    assert summary["departures"] == summary["departed_devices"] == 2


def test_departed_devices_counts_a_departure_recorded_after_the_ps_summary(
        tmp_path: Path) -> None:
    """The PS writes ps_summary.json, then a crash a moment before the end reaches it as a
    broken stream: events.jsonl had the disconnect (departures 1), the PS's file did not
    (departed_devices 0)."""
    log = RunLog(tmp_path)
    log.event("ps_start", expected_devices=4)
    log.step(step=0, loss=5.0, wall_s=1.0, device_time_s=1.0, tiles=10)
    write_json_atomic(tmp_path / "ps_summary.json", {
        "state": "done", "steps_done": 1, "steps": 1, "losses": [5.0], "final_loss": 5.0,
        "tiles": 10, "departed_devices": 0, "devices": []})
    log.event("churn", device="phones-1", action="crash", effect="SIGKILL")
    log.event("disconnect", device="phones-1", reason="stream broken", in_flight=0)
    log.event("ps_stop", state="done")
    log.close()
    summary = write_summary(tmp_path, load_topology(TINY), {"backend": "loopback"}, 1.0, 0, {})
    assert summary["departures"] == summary["departed_devices"] == 1
    assert json.loads((tmp_path / "summary.json").read_text())["departed_devices"] == 1


def _config() -> PsConfig:
    import numpy as np

    return PsConfig(token="secret", run_name="acct", dtype=np.dtype("float64"), tile_m=4,
                    tile_n=4, min_offload_flops=0.0, planner="fifo")


def test_a_departed_session_ends_with_a_final_devices_record(tmp_path: Path) -> None:
    """A reader that takes each device's last devices.jsonl record saw a device that left as
    it was at its last sample, idle, and never as gone."""
    log = RunLog(tmp_path)
    core = PsCore(_config(), runlog=log)
    conn = core.join(Descriptor(name="phones-0", group="phones", kind="emulated",
                                profile="snapdragon888", predicted_gflops=1.0, max_in_flight=8,
                                cache_bytes=1 << 20, platform="test"))
    core.attach(conn.device_id, conn.session_key)
    log.device(**core.device_records()[0])  # a periodic sample: idle
    assert core.leave(conn.device_id, conn.session_key, "SIGTERM") == 0
    log.close()
    records = read_jsonl(tmp_path / "devices.jsonl")
    assert [r["state"] for r in records] == ["idle", "left"]
    assert records[-1]["device_id"] == conn.device_id
    assert records[-1] == {**core.departed_records()[-1], "t": records[-1]["t"],
                           "elapsed_s": records[-1]["elapsed_s"]}


def test_simulate_writes_a_departed_sessions_record_when_it_departs(tmp_path: Path) -> None:
    """As the PS does: at the departure, so a device that left and joined again ends with its
    present session's record (the simulator wrote the departed ones after the present ones,
    at the end, so the last record of phones-1 was its first session's)."""
    trace = tmp_path / "t.csv"
    trace.write_text("time_s,device,event,arg\n0.01,phones-1,leave,\n0.03,phones-1,join,\n")
    topology = load_topology(TINY).with_overrides(steps=3)
    (tmp_path / "run").mkdir()
    simulate(topology, tmp_path / "run", load_schedule(trace, topology), report=False)
    records = read_jsonl(tmp_path / "run" / "devices.jsonl")
    phones_1 = [r for r in records if r["device"] == "phones-1"]
    assert [r["state"] for r in phones_1] == ["left", "idle"]
    assert phones_1[0]["elapsed_s"] == pytest.approx(0.01, abs=1e-9)
    assert len(records) == 5  # four present at the end, one session that ended


def _cut_off_leave(tmp_path: Path, heal_s: float | None,
                   action: str = "leave") -> list[tuple[str, float]]:
    """phones-0 cut off at 0.01 s and left (or crashed: ``action``) at 0.02 s (healed at
    ``heal_s``); the PS's records of its departure as (event, virtual time)."""
    rows = f"time_s,device,event,arg\n0.01,phones-0,partition,\n0.02,phones-0,{action},\n"
    if heal_s is not None:
        rows += f"{heal_s},phones-0,heal,\n"
    trace = tmp_path / "t.csv"
    trace.write_text(rows)
    topology = load_topology(TINY)
    events: list[tuple[str, float]] = []

    def event(name: str, /, **_: object) -> None:
        events.append((name, sim.now_s))
    sim = Simulation(topology, load_schedule(trace, topology), noise=False, event=event)
    sim.start()
    sim.pass_time(LEASE_S + 1.0)
    return [(kind, t) for kind, t in events if kind in ("leave", "disconnect", "lease_expired")]


def test_a_leave_while_cut_off_reaches_the_ps_as_its_lease_running_out(tmp_path: Path) -> None:
    """The device cannot say Leave across the cut: `testbed up` (the agent stays silent) and
    the simulation both let the lease run out; the simulation counted a leave at once."""
    [(kind, t)] = _cut_off_leave(tmp_path, None)
    assert kind == "lease_expired"
    assert t == pytest.approx(0.01 + LEASE_S, abs=1e-9)


def test_a_leave_while_cut_off_then_a_heal_reaches_the_ps_as_a_disconnect(
        tmp_path: Path) -> None:
    [(kind, t)] = _cut_off_leave(tmp_path, 1.0)
    assert kind == "disconnect"
    assert t == pytest.approx(1.0, abs=1e-9)


def test_a_crash_while_cut_off_reaches_the_ps_as_its_lease_running_out(tmp_path: Path) -> None:
    """A killed device's socket closes no more across a cut than a leaving one's: the
    simulation counted a disconnect at the crash."""
    [(kind, t)] = _cut_off_leave(tmp_path, None, "crash")
    assert kind == "lease_expired"
    assert t == pytest.approx(0.01 + LEASE_S, abs=1e-9)


def test_a_crash_while_cut_off_then_a_heal_reaches_the_ps_as_a_broken_stream(
        tmp_path: Path) -> None:
    [(kind, t)] = _cut_off_leave(tmp_path, 1.0, "crash")
    assert kind == "disconnect"
    assert t == pytest.approx(1.0, abs=1e-9)


def _agent_cut_off_then_stopped(tmp_path: Path, heal_after_s: float | None, crash: bool = False
                                ) -> tuple[list[dict[str, Any]], float]:
    """A real PS (in process, lease 1.5 s) and a real agent on loopback: the agent is cut off
    (SIGUSR1, as `testbed up` partitions it), 0.3 s later asked to leave (SIGTERM, as the
    trace's leave; with ``crash``, SIGQUIT, as the trace's crash), and with ``heal_after_s``
    healed (SIGUSR2) that long after: the PS's departure events, and the Unix time of the
    heal (inf: none)."""
    import os
    import secrets
    import signal
    import subprocess
    import sys
    import time

    import numpy as np

    from testbed.ps_backend.host import PsServer
    from tests.conftest import killed_at_exit

    token = secrets.token_hex(8)
    config = PsConfig(token=token, run_name="cut-off-leave", dtype=np.dtype("float64"),
                      tile_m=4, tile_n=4, min_offload_flops=0.0, planner="fifo", lease_s=1.5,
                      heartbeat_s=0.1)
    log = RunLog(tmp_path)
    server = PsServer(config, runlog=log).start()
    core = server.core
    assert core is not None
    repo = Path(__file__).resolve().parents[2]
    agent_log = tmp_path / "agent.log"
    agent = subprocess.Popen(
        [sys.executable, "-m", "testbed.agent", "--ps", f"127.0.0.1:{server.port}",
         "--name", "phones-0", "--kind", "real"],
        env=dict(os.environ, TESTBED_TOKEN=token, PYTHONPATH=str(repo)), cwd=repo,
        stdout=agent_log.open("w"), stderr=subprocess.STDOUT)
    try:
        with killed_at_exit(agent):
            deadline = time.monotonic() + 60
            while not server.call(lambda: any(c.outbox is not None
                                              for c in core.conns.values())):
                assert agent.poll() is None, agent_log.read_text()
                assert time.monotonic() < deadline, "the agent did not attach within 60 s"
                time.sleep(0.05)
            agent.send_signal(signal.SIGUSR1)
            time.sleep(0.3)
            agent.send_signal(signal.SIGQUIT if crash else signal.SIGTERM)
            healed_t = math.inf
            if heal_after_s is not None:
                time.sleep(heal_after_s)
                healed_t = time.time()
                agent.send_signal(signal.SIGUSR2)
            assert agent.wait(10) == (-signal.SIGKILL if crash else 0), agent_log.read_text()
            time.sleep(0.3)  # the PS's loop records what the agent's exit brought
    finally:
        server.stop("test done")
        log.close()
    departures = [e for e in read_jsonl(tmp_path / "events.jsonl")
                  if e["event"] in ("leave", "disconnect", "lease_expired")]
    return departures, healed_t


def test_an_agent_asked_to_leave_while_cut_off_lets_its_lease_run_out(tmp_path: Path) -> None:
    """On loopback the agent closed its channel, which the cut does not hold: the PS counted
    a disconnect at the leave, where a device behind a link that is down tells it nothing."""
    departures, _ = _agent_cut_off_then_stopped(tmp_path, None)
    assert [e["event"] for e in departures] == ["lease_expired"], departures


def test_an_agent_that_left_while_cut_off_is_gone_for_the_ps_at_the_heal(tmp_path: Path) -> None:
    """Healed within its lease, the close the agent made on leaving reaches the PS then."""
    departures, healed_t = _agent_cut_off_then_stopped(tmp_path, 0.3)  # within the lease
    assert [e["event"] for e in departures] == ["disconnect"], departures
    assert departures[0]["t"] >= healed_t, (departures, healed_t)


def test_an_agent_that_crashed_while_cut_off_lets_its_lease_run_out(tmp_path: Path) -> None:
    """`testbed up` on loopback sends a cut-off agent SIGQUIT for the trace's crash (its
    SIGKILL closed the socket past the agent's blackhole: a disconnect at the crash); the
    agent stays silent and dies (SIGKILL) once the PS has ended its session."""
    departures, _ = _agent_cut_off_then_stopped(tmp_path, None, crash=True)
    assert [e["event"] for e in departures] == ["lease_expired"], departures


def test_an_agent_that_crashed_while_cut_off_is_gone_for_the_ps_at_the_heal(
        tmp_path: Path) -> None:
    departures, healed_t = _agent_cut_off_then_stopped(tmp_path, 0.3, crash=True)
    assert [e["event"] for e in departures] == ["disconnect"], departures
    assert departures[0]["t"] >= healed_t, (departures, healed_t)
