"""The bridge in `testbed up`: live-view merge, event routing, phones at start, placements."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from testbed.adb_bridge.bridge import BridgeEvent, PhoneStatus
from testbed.adb_bridge.config import AdbSpec
from testbed.adb_bridge.run_hook import AdbRunHook, adb_spec_of, merge_status, network_problem
from testbed.dashboard import render
from testbed.errors import InputError
from testbed.runlog import RunLog, read_jsonl
from testbed.topology import load_topology
from tests.conftest import closed_port, tiny_topology
from tests.fakes.adb_phones import recorded_phone
from tests.fakes.fake_adb import FakeAdbServer, FakePhone

SAMPLE = {"battery_level_fraction": 0.85, "battery_temperature_c": 31.2, "thermal_max_c": 47.5,
          "thermal_status": 2}


def _snapshot() -> dict:
    return {"state": "training", "step": 1, "steps": 4, "devices": [
        {"device": "phones-0", "group": "phones", "state": "busy", "tiles_done": 3,
         "telemetry": {"temperature_c": 40.0}},
        {"device": "adb-p1", "group": "adb", "state": "busy", "tiles_done": 5, "telemetry": {}},
        {"device": "adb-p1", "group": "adb", "state": "left", "tiles_done": 2, "telemetry": {}}]}


def test_merge_puts_phone_telemetry_in_its_live_row_and_lists_unjoined_phones() -> None:
    phones = [PhoneStatus("P1", "device", "adb-p1", agent_pid=123),
              PhoneStatus("P2", "device", "adb-p2", problem="no Python that the adb shell can "
                                                            "run on this phone"),
              PhoneStatus("P3", "unauthorized", "adb-p3"),
              PhoneStatus("P4", "device", "adb-p4", agent_pid=77)]  # started, not joined yet
    snapshot = _snapshot()
    merged = merge_status(snapshot, phones, {"adb-p1": SAMPLE, "adb-p2": SAMPLE})
    assert snapshot == _snapshot()  # the input is not changed
    rows = merged["devices"]
    assert rows[0] == _snapshot()["devices"][0]  # emulated rows untouched
    live = rows[1]
    assert live["state"] == "busy" and live["telemetry"]["temperature_c"] == 47.5
    assert live["telemetry"]["battery_level_fraction"] == 0.85
    assert rows[2]["telemetry"] == {}  # the departed row of the same phone stays as it was
    extra = {r["device"]: r for r in rows[3:]}
    assert set(extra) == {"adb-p2", "adb-p3"}
    assert extra["adb-p2"]["state"] == "adb:failed" and "no Python" in extra["adb-p2"]["problem"]
    assert extra["adb-p2"]["telemetry"]["temperature_c"] == 47.5
    assert extra["adb-p3"]["state"] == "adb:unauthorized" and "telemetry" not in extra["adb-p3"]
    console = Console(file=io.StringIO(), width=160)
    console.print(render(merged, "t"))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "47.5" in text and "adb:failed" in text and "adb:unauthorized" in text


def test_a_phone_waiting_for_the_termux_listener_says_what_to_type() -> None:
    waiting = "in Termux run `sh /data/local/tmp/testbed/termux-agent.sh serve` (once)"
    merged = merge_status(_snapshot(), [PhoneStatus("P5", "device", "adb-p5", waiting=waiting)],
                          {})
    row = merged["devices"][-1]
    assert row["device"] == "adb-p5" and row["state"] == "adb:waiting"
    assert row["problem"] == waiting
    console = Console(file=io.StringIO(), width=200)
    console.print(render(merged, "t"))
    assert "adb:waiting" in console.file.getvalue()  # type: ignore[attr-defined]


def test_temperature_falls_back_to_the_battery() -> None:
    merged = merge_status(_snapshot(), [PhoneStatus("P1", "device", "adb-p1", agent_pid=1)],
                          {"adb-p1": {**SAMPLE, "thermal_max_c": None}})
    assert merged["devices"][1]["telemetry"]["temperature_c"] == 31.2


def _topology(tmp_path: Path, **adb: object) -> Path:
    return tiny_topology(tmp_path, adb={"server": "127.0.0.1:5037", **adb})


def test_network_problem_on_mininet_wants_placed_phones(tmp_path: Path) -> None:
    on = load_topology(_topology(tmp_path, enabled=True))
    off = load_topology(_topology(tmp_path, enabled=False))
    placed = load_topology(_topology(tmp_path, enabled=True, serials={
        "R58M": {"link": {"down": "100Mbit", "up": "20Mbit", "delay": "5ms"}}, "P2": None}))
    relay_link = load_topology(_topology(tmp_path, enabled=True, serials={"R58M": {}},
                                         link={"down": "1Mbit", "up": "1Mbit"}))
    assert adb_spec_of(on) is not None and adb_spec_of(off) is None
    assert network_problem(on, "loopback") is None
    assert network_problem(off, "mininet") is None
    assert network_problem(placed, "mininet") is None
    problem = network_problem(on, "mininet")
    assert problem is not None and problem.startswith("adb.serials:") and "switch:" in problem
    problem = network_problem(relay_link, "mininet")
    assert problem is not None and problem.startswith("adb.link:")
    spec = adb_spec_of(placed)
    assert spec is not None and sorted(spec.serials or ()) == ["P2", "R58M"]
    places = {p.serial: p for p in spec.placements}
    first, second = places["R58M"], places["P2"]
    assert first.name == "adb-r58m" and first.switch is None
    assert (first.link.down_bps, first.link.up_bps, first.link.delay_s) == (100e6, 20e6, 0.005)
    assert (second.link.down_bps, second.link.up_bps) == (1e9, 1e9)  # the default link


def test_placement_errors_name_their_yaml_path(tmp_path: Path) -> None:
    raw = yaml.safe_load(tiny_topology(tmp_path).read_text())
    raw["network"] = {"backend": "mininet", "switches": ["ap0"], "ps": {"switch": "ap0"}}
    for group in raw["devices"]:
        group["switch"] = "ap0"
    raw["adb"] = {"enabled": True, "serials": {
        "GOOD": {"switch": "ap0", "link": {"down": "10Mbit", "up": "5Mbit"}},
        "NOSWITCH": {"link": {"down": "10Mbit", "up": "5Mbit"}},
        "BAD": {"switch": "ap9", "link": {"down": "fast", "up": "5Mbit"}, "color": "red"}}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(InputError) as info:
        load_topology(path)
    text = str(info.value)
    assert "adb.serials.NOSWITCH.switch: required when switches are declared" in text
    assert "adb.serials.BAD.switch: unknown switch 'ap9'" in text
    assert "adb.serials.BAD.link.down" in text and "adb.serials.BAD.color" in text
    assert "adb.serials.GOOD" not in text
    assert str(path) in text


def test_events_go_to_the_run_log_and_notes(tmp_path: Path) -> None:
    runlog = RunLog(tmp_path)
    notes: list[str] = []
    hook = AdbRunHook(AdbSpec(enabled=True), tmp_path, "tok", runlog, notes)
    hook._on_event(BridgeEvent("telemetry", "P1", 0.0, dict(SAMPLE)))
    hook._on_event(BridgeEvent("agent-failed", "P2", 0.0, {"reason": "too old"}))
    hook._on_event(BridgeEvent("poll-failed", "P1", 0.0, {
        "reason": "phone P1: `dumpsys thermalservice` did not finish in 10 s",
        "command": "dumpsys thermalservice", "failed_polls": 1}))
    hook._on_event(BridgeEvent("unplugged", "P1", 0.0, {"cause": "unplugged", "had_agent": True,
                                                         "name": "adb-p1"}))
    runlog.close()
    samples = read_jsonl(tmp_path / "devices.jsonl")
    assert samples[0]["kind"] == "adb-telemetry" and samples[0]["device"] == "adb-p1"
    assert samples[0]["serial"] == "P1" and samples[0]["thermal_max_c"] == 47.5
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [e["event"] for e in events] == ["adb_agent_failed", "adb_poll_failed",
                                            "adb_unplugged"]
    assert events[0]["device"] == "adb-p2" and events[0]["reason"] == "too old"
    assert not any(e["event"] == "adb_telemetry" for e in events)
    assert notes[:2] == ["adb P2: cannot run the agent: too old",
                         "phone P1: `dumpsys thermalservice` did not finish in 10 s; a poll of "
                         "adb P1 was lost"]
    assert hook.summary()["telemetry"]["adb-p1"]["battery_level_fraction"] == 0.85
    json.dumps(hook.summary())  # goes into summary.json as it is


def test_phones_at_start_counts_devices_of_the_chosen_serials(tmp_path: Path) -> None:
    with FakeAdbServer() as server:
        server.plug(recorded_phone("P1"))
        server.plug(recorded_phone("P2"))
        server.plug(FakePhone("P3", state="unauthorized"))
        runlog = RunLog(tmp_path)
        every = AdbRunHook(AdbSpec(True, "127.0.0.1", server.port), tmp_path, "t", runlog)
        assert every.phones_at_start() == ["P1", "P2"]
        some = AdbRunHook(AdbSpec(True, "127.0.0.1", server.port, serials=("P2", "P3")),
                          tmp_path, "t", runlog)
        assert some.phones_at_start() == ["P2"]
        runlog.close()
    event = read_jsonl(tmp_path / "events.jsonl")[0]
    assert event["event"] == "adb_phones_at_start" and event["other_states"] == {
        "P3": "unauthorized"}


def test_phones_at_start_without_an_adb_server_is_a_clear_error(tmp_path: Path) -> None:
    port = closed_port()
    runlog = RunLog(tmp_path)
    hook = AdbRunHook(AdbSpec(True, "127.0.0.1", port), tmp_path, "t", runlog)
    with pytest.raises(RuntimeError, match=f"cannot reach the adb server at 127.0.0.1:{port}"):
        hook.phones_at_start()
    runlog.close()


def test_job_running_follows_the_ps_status(tmp_path: Path) -> None:
    runlog = RunLog(tmp_path)
    hook = AdbRunHook(AdbSpec(enabled=True), tmp_path, "t", runlog)
    assert hook.job_running()  # no status.json yet: the PS is starting
    for state, running in (("waiting for devices", True), ("training", True), ("done", False),
                           ("interrupted", False), ("failed", False)):
        (tmp_path / "status.json").write_text(json.dumps({"state": state}))
        assert hook.job_running() is running, state
    runlog.close()
