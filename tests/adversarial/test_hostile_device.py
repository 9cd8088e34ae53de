"""A token holder sends absurd numbers and names: each is refused or bounded, nothing is poisoned,
later joins and the lease watcher keep working, and the run trains to the single-process losses.
A token holder joining under an honest device's name cannot get that device quarantined."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import grpc
import pytest

from testbed.wire import MAX_IN_FLIGHT
from testbed.wire import testbed_pb2 as pb
from testbed.wire.tensors import to_tensor
from tests.adversarial.psproc import (
    PsProcess,
    Rogue,
    device_cache,
    job_topology,
    tile_operands,
)
from tests.conftest import wait_for

pytestmark = pytest.mark.integration


def _refused(rogue: Rogue, **descriptor: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        rogue.join(**descriptor)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    return refused.value


@pytest.mark.slow
def test_absurd_numbers_and_names_are_refused_or_bounded(tmp_path: Path) -> None:
    steps = 3
    topology = job_topology(tmp_path, steps=steps)
    with PsProcess(topology, tmp_path / "run", "--expect-devices", "1") as ps:
        rogue = Rogue(ps.address)
        assert "predicted_gflops" in _refused(rogue, predicted_gflops=math.nan).details()
        _refused(rogue, predicted_gflops=math.inf)
        _refused(rogue, predicted_gflops=-1.0)
        _refused(rogue, predicted_gflops=1.0, name="x" * 10_000)
        _refused(rogue, name="bad\nname")
        _refused(rogue, name="rogue", max_in_flight=10**6)
        assert "device.instance" in _refused(rogue, max_in_flight=1,
                                             instance="i" * 1_000).details()
        # later joins still work, and the lease watcher still drops a silent device
        for i in range(30):  # and departed devices are counted, not listed forever
            quitter = Rogue(ps.address, name=f"quitter-{i}")
            reply = quitter.join()
            quitter.stub.Leave(pb.LeaveRequest(device_id=reply.device_id,
                                               session_key=reply.session_key), timeout=10)
            quitter.close()
        silent = Rogue(ps.address, name="silent")
        silent.join()
        drained = silent.attach()
        threading.Thread(target=lambda: [None for _ in drained], daemon=True).start()
        wait_for(lambda: any(e["event"] == "lease_expired" and e["device"] == "silent"
                             for e in ps.events()), 60, "the silent device's lease to expire")
        # status.json is rewritten every STATUS_PERIOD_S, after the event is logged
        wait_for(lambda: ps.status().get("devices_departed", 0) >= 31, 30,
                 "status.json to count the 31 departures")
        status = ps.status()
        assert len(status["devices"]) <= 10 + 2

        # a tile answered with Inf timings and energy, then telemetry with thousands of keys
        rogue = Rogue(ps.address, name="rogue", gflops=1000, window=1)
        rogue.join(name="rogue", predicted_gflops=1000.0, max_in_flight=1)
        responses = rogue.attach()
        rogue.send(pb.DeviceMessage(telemetry=pb.Telemetry(
            values={f"k{i}": float(i) for i in range(2000)})))
        rogue.send(pb.DeviceMessage(telemetry=pb.Telemetry(
            values={**{f"t{i}": 1.0 for i in range(40)}, "temp": math.nan},
            labels={"state": "y" * 10_000})))
        cache = device_cache()
        bad = [dict(energy_j=math.inf), dict(compute_s=math.nan), dict(compute_s=1e300),
               dict(lag_s=-1.0)]
        reasons: list[str] = []
        for message in responses:
            if message.HasField("reject"):
                reasons.append(message.reject.reason)
                if len(reasons) == len(bad):
                    break
            for tile in message.tiles:
                ops = tile_operands(tile, cache)
                numbers = bad[len(reasons)] if len(reasons) < len(bad) else {}
                rogue.send(pb.DeviceMessage(result=pb.TileResult(
                    task_id=tile.task_id, attempt=tile.attempt, c=to_tensor(ops[0] @ ops[1]),
                    **numbers)))
        for numbers, reason in zip(bad, reasons):
            assert next(iter(numbers)) in reason, (numbers, reason)
        rogue_record = wait_for(lambda: next((d for d in ps.status().get("devices", [])
                                              if d["device"] == "rogue"), None), 10, "rogue")
        assert len(rogue_record["telemetry"]) <= 32
        assert all(len(str(v)) <= 200 for v in rogue_record["telemetry"].values())
        rogue.close()
        ps.agent("honest-0")
        code, output = ps.finish()
        assert code == 0, output
    ps.assert_losses_match(steps)
    summary = ps.summary()
    assert summary["results_refused"] >= len(bad)
    json.dumps(summary, allow_nan=False)  # no Infinity or NaN in the records
    for line in (ps.run_dir / "events.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in events.jsonl"))


@pytest.mark.slow
def test_a_name_hijack_cannot_get_the_honest_device_quarantined(tmp_path: Path) -> None:
    steps = 3
    topology = job_topology(tmp_path, steps=steps,
                            validation={"enabled": True, "quarantine_after": 1})
    with PsProcess(topology, tmp_path / "run", "--expect-devices", "1") as ps:
        # the hijacker takes honest-0's name first and returns a wrong tile: quarantined
        rogue = Rogue(ps.address, name="honest-0", gflops=1000, window=1)
        reply = rogue.join()
        cache = device_cache()
        for message in rogue.attach():
            if message.HasField("reject"):
                break
            for tile in message.tiles:
                ops = tile_operands(tile, cache)
                rogue.send(pb.DeviceMessage(result=pb.TileResult(
                    task_id=tile.task_id, attempt=tile.attempt,
                    c=to_tensor(ops[0] @ ops[1] + 1.0))))
        wait_for(lambda: any(e["event"] == "quarantine" for e in ps.events()), 30,
                 "the hijacker's quarantine")
        ps.agent("honest-0")  # the real one joins later, under its own name
        time.sleep(0.5)
        code, output = ps.finish()
        assert code == 0, output
        rogue.close()
    ps.assert_losses_match(steps)
    quarantines = [e for e in ps.events() if e["event"] == "quarantine"]
    assert [q["device_id"] for q in quarantines] == [reply.device_id]
    honest = [d for d in ps.summary()["devices"]
              if d["device"] == "honest-0" and d["device_id"] != reply.device_id]
    assert honest and all(d["state"] != "quarantined" for d in honest)
    assert sum(d["tiles_done"] for d in honest) > 0


def test_a_message_of_more_results_than_a_device_can_hold_ends_its_stream(
        tmp_path: Path) -> None:
    """200,000 results for tasks never sent, in one 1.6 MB message, kept the PS busy long enough
    for the honest device's lease to expire; such a message now ends the sender's stream at
    once, and the run trains on with the honest device."""
    from testbed.ps_backend.service import MAX_RESULTS_PER_MESSAGE

    steps = 2
    topology = job_topology(tmp_path, steps=steps)
    with PsProcess(topology, tmp_path / "run", "--expect-devices", "1") as ps:
        ps.agent("honest-0")
        rogue = Rogue(ps.address, name="flooder")
        rogue.join()
        responses = rogue.attach()
        threading.Thread(target=lambda: [None for _ in responses], daemon=True).start()
        flood = pb.TileResults(results=[pb.TileResult(task_id=10**9 + i)
                                        for i in range(200_000)])
        rogue.send(pb.DeviceMessage(results=flood))
        wait_for(lambda: any(e["event"] == "disconnect" and e["device"] == "flooder"
                             for e in ps.events()), 30, "the flooder's stream to end")
        code, output = ps.finish()
        assert code == 0, output
        rogue.close()
    ps.assert_losses_match(steps)
    events = ps.events()
    ended = [e for e in events if e["event"] == "disconnect" and e["device"] == "flooder"]
    assert "protocol violation" in json.dumps(ended[0]), ended[0]
    assert f"{MAX_IN_FLIGHT} tiles" in json.dumps(ended[0])
    assert sum(e["event"] == "reject" for e in events) < MAX_RESULTS_PER_MESSAGE
    assert not [e for e in events if e["event"] == "lease_expired"]


def test_joins_that_never_attach_get_no_work(tmp_path: Path) -> None:
    """A token holder joins fast devices, one a second, and never opens their streams. They were
    planned tiles at Join, and each stalled the step until its 5 s lease expired (this test
    against the old core.py: the run stopped on its 120 s watchdog); now a device counts once
    it attaches."""
    steps = 3
    topology = job_topology(tmp_path, steps=steps)
    with PsProcess(topology, tmp_path / "run", "--expect-devices", "1") as ps:
        stop = threading.Event()

        def phantoms() -> None:
            for i in range(1000):
                if stop.wait(0 if i < 5 else 1.0):
                    return
                try:
                    Rogue(ps.address, name=f"phantom-{i}").join(
                        name=f"phantom-{i}", predicted_gflops=1000.0, max_in_flight=64)
                except grpc.RpcError:  # the PS has finished
                    return
        joiner = threading.Thread(target=phantoms, daemon=True)
        joiner.start()
        time.sleep(0.5)  # the first phantoms are registered before the honest device joins
        ps.agent("honest-0")
        try:
            code, output = ps.finish()
        finally:
            stop.set()
            joiner.join(10)
        assert code == 0, output
    ps.assert_losses_match(steps)
    from testbed.runlog import read_jsonl
    walls = [s["wall_s"] for s in read_jsonl(tmp_path / "run" / "steps.jsonl")]
    assert max(walls) < 4.0, walls  # under the 5 s lease a phantom's tiles would wait out
    assert sum(e["event"] == "join" and e["device"].startswith("phantom") for e in ps.events()) >= 5


def test_endless_bad_results_leave_the_log_and_the_queue_bounded(tmp_path: Path) -> None:
    """A token holder sends results for tasks it never got, message after message, and never
    reads its stream: its rejects are logged one by one up to REJECT_EVENTS_LOGGED, then
    summarised; no more Rejects are queued for it past MAX_QUEUED_REJECTS; the honest device
    trains on."""
    from testbed.ps_backend.core import REJECT_EVENTS_LOGGED
    from testbed.ps_backend.service import MAX_RESULTS_PER_MESSAGE

    steps = 2
    topology = job_topology(tmp_path, steps=steps)
    with PsProcess(topology, tmp_path / "run", "--expect-devices", "1") as ps:
        ps.agent("honest-0")
        rogue = Rogue(ps.address, name="spammer")
        rogue.join()
        # kept (a dropped call is cancelled) but never read: the Rejects pile up at the PS
        responses = rogue.attach()
        sent = 0
        for m in range(40):
            rogue.send(pb.DeviceMessage(results=pb.TileResults(results=[
                pb.TileResult(task_id=10**9 + m * MAX_RESULTS_PER_MESSAGE + i)
                for i in range(MAX_RESULTS_PER_MESSAGE)])))
            sent += MAX_RESULTS_PER_MESSAGE
        wait_for(lambda: any(e["event"] == "rejects_summarised" for e in ps.events()), 60,
                 "a summary of the spammer's rejects")
        code, output = ps.finish()
        assert code == 0, output
        rogue.close()
        del responses
    ps.assert_losses_match(steps)
    events = ps.events()
    logged = [e for e in events if e["event"] == "reject" and e["device"] == "spammer"]
    summaries = [e for e in events if e["event"] == "rejects_summarised"]
    assert len(logged) == REJECT_EVENTS_LOGGED
    assert summaries and all(s["device"] == "spammer" for s in summaries)
    assert len(logged) + sum(s["rejects"] for s in summaries) <= sent
    assert len(events) < 2_000, len(events)  # 10,240 results sent
