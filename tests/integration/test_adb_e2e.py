"""A phone over adb in a real ``testbed up`` run, beside emulated devices, on loopback.

The phone is scripted on the fake adb server (a thread of this test). Its shell runs the real
agent: the zip the bridge built and pushed with sync, started by the start-script command as a
local process that reaches the PS only through the phone's ``adb reverse`` rule and the bridge's
relay. The run is ``testbed up`` as a user starts it (a subprocess).

The phone computes tiles; then a USB hiccup breaks its connection and its agent joins again (a
new device for the PS); mid-step the fake pulls the cable as the PS's first tiles of that session
reach the phone, with the phone's uplink held just before, so the phone leaves holding tiles whose
results never come back. The PS must re-queue every one of them, and the job must end with the
losses of the same model trained in one process.

Why this choreography: the PS hands idle devices backup copies of tiles that straggle, and a
departure re-queues only tiles no other device holds, so a phone that is merely stalled for a
while has its tiles copied elsewhere and re-queues nothing. The scheduler makes backups only of
and for devices that have returned a valid result: a phone in a fresh session that has returned
nothing holds only its own tiles, so its departure must re-queue exactly what it held.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from testbed.runlog import read_jsonl
from tests.conftest import (
    killed_at_exit,
    read_status,
    reference_losses,
    run_dir_of,
    start_up,
    tiny_topology,
    wait_for,
)
from tests.fakes.adb_phones import agent_phone
from tests.fakes.fake_adb import FakeAdbServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SERIAL = "E2EPHONE1"
NAME = "adb-e2ephone1"  # device_name(SERIAL)
STEPS = 10


@pytest.fixture
def fake_adb_server() -> Iterator[FakeAdbServer]:
    server = FakeAdbServer().start()
    yield server
    server.stop()  # also ends every local process a phone's shell started


def _phone_row(run_dir: Path) -> dict[str, Any] | None:
    return next((d for d in read_status(run_dir).get("devices", []) if d["device"] == NAME
                 and d.get("state") != "left"), None)


def _cmdlines() -> list[str]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace"))
            except OSError:
                pass  # the process ended meanwhile
    return out


def _run_token(phone: Any) -> str:
    """The run's token, as the bridge pushed it to the phone (the fake logs every push)."""
    tokens = {data.decode().strip() for path, data in phone.pushes if "/token-" in path}
    assert len(tokens) == 1 and len(next(iter(tokens))) == 32, tokens
    return tokens.pop()


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def test_phone_joins_computes_and_unplug_requeues(fake_adb_server: FakeAdbServer,
                                                  tmp_path: Path) -> None:
    phone = fake_adb_server.plug(agent_phone(
        SERIAL, tmp_path / "phone", tmp_path / "phone-logs",
        env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}))
    topology = tiny_topology(
        tmp_path, dtype="float64", steps=STEPS,
        adb={"enabled": True, "server": f"127.0.0.1:{fake_adb_server.port}",
             "telemetry_interval": "300ms", "link": {"down": "1Gbit", "up": "1Gbit"}})
    out = tmp_path / "runs"
    proc = start_up(topology, out)
    with killed_at_exit(proc):
        run_dir = run_dir_of(out)
        # The phone joins the PS through its reverse rule and relay and computes tiles.
        wait_for(lambda: (_phone_row(run_dir) or {}).get("tiles_done", 0) > 0, 60,
                 f"{NAME} to compute tiles")
        # The join token is in no process's command line: not the PS's, not the emulated
        # devices', not the phone agent's (it read it from a file the bridge then removed).
        token = _run_token(phone)
        leaks = [cmd for cmd in _cmdlines() if token in cmd]
        assert not leaks, leaks
        assert any("agent.zip" in cmd and "--token-file" in cmd for cmd in _cmdlines())
        # A USB hiccup: the phone's connection breaks and its agent joins again, as a new
        # device of the PS. Mid-step the fake pulls the cable as the PS's first tiles of that
        # session reach the phone (2 KiB: more than the join and control messages), with the
        # phone's uplink held just before, so none of those tiles can come back.
        fake_adb_server.drop_connections(SERIAL)
        unplugged = fake_adb_server.unplug_on_download(SERIAL, min_bytes=2048)
        assert unplugged.wait(30), "the phone got no tiles after it joined again"
        output, _ = proc.communicate(timeout=75)
    assert proc.returncode == 0, output
    assert all(p.poll() is not None for p in phone.processes)  # the phone's agent is gone

    events = read_jsonl(run_dir / "events.jsonl")
    kinds = [e["event"] for e in events]
    at_start = next(e for e in events if e["event"] == "adb_phones_at_start")
    assert at_start["serials"] == [SERIAL] and at_start["devices"] == [NAME]
    start = next(e for e in events if e["event"] == "training_start")
    assert start["expected_devices"] == 5 and start["devices"] == 5  # 4 emulated + the phone
    assert "adb_agent_started" in kinds and "adb_unplugged" in kinds
    ready = next(e for e in events if e["event"] == "adb_ready")
    assert ready["profile"] == "snapdragon888"
    joins = [e for e in events if e["event"] == "join" and e["device"] == NAME]
    assert joins and joins[0]["kind"] == "real" and joins[0]["group"] == "adb"

    # Two departures: the hiccup, then the unplug, which re-queued every tile the phone held.
    departures = [e for e in events if e.get("device") == NAME
                  and e["event"] in ("disconnect", "leave", "lease_expired")]
    assert [d["event"] for d in departures] == ["disconnect", "disconnect"], departures
    assert len({d["device_id"] for d in departures}) == 2  # two sessions, two PS devices
    gone = departures[-1]
    assert gone["in_flight"] >= 1  # the phone held tiles when it left ...
    assert gone["requeued_tiles"] == len(gone["requeued"]) == gone["in_flight"]  # ... all back
    assert kinds.index("adb_unplugged") > kinds.index("adb_agent_started")
    assert events.index(gone) < kinds.index("ps_stop")  # it left while the job was running

    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert sum(s["requeued_tiles"] for s in steps) >= gone["requeued_tiles"]
    assert sum(s["recomputed_tiles"] for s in steps) >= gone["requeued_tiles"]
    want, _ = reference_losses(topology, STEPS)
    for s, w in zip(steps, want):
        assert _relative(s["loss"], w) <= 1e-8, (s["step"], s["loss"], w)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "done" and summary["exit_code"] == 0
    phone_records = [d for d in summary["devices"] if d["device"] == NAME]
    assert len(phone_records) == 2 and all(r["state"] == "left" for r in phone_records)
    assert phone_records[0]["tiles_done"] > 0  # the first session computed tiles
    emulated = {d["device"] for d in summary["devices"]} - {NAME}
    assert emulated == {"phones-0", "phones-1", "phones-2", "laptops-0"}

    # The bridge's telemetry of the phone reached devices.jsonl and the summary.
    samples = [d for d in read_jsonl(run_dir / "devices.jsonl")
               if d.get("kind") == "adb-telemetry" and d.get("device") == NAME]
    assert samples and samples[0]["battery_level_fraction"] == 0.85
    assert samples[0]["serial"] == SERIAL and samples[0]["thermal_status"] == 2
    assert summary["adb"]["telemetry"][NAME]["battery_level_fraction"] == 0.85
