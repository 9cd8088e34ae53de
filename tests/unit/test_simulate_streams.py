"""A simulated device's messages travel as on its one gRPC stream: one after another."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.churn.schedule import load_schedule
from testbed.simulate.sim import Simulation
from testbed.topology import load_topology

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"


@pytest.mark.parametrize("direction", [0, 1])
def test_a_devices_messages_go_one_after_another(direction: int) -> None:
    sim = Simulation(load_topology(TINY), noise=False)
    dev = sim.devices["phones-0"]
    dev.session = 1  # present (no join: nothing else runs)
    arrived: list[float] = []
    nbytes = 1_000_000
    for _ in range(2):
        sim._transfer(dev, direction, nbytes, lambda: arrived.append(sim.now_s))
    assert sim.run_until(lambda: len(arrived) == 2)
    path = dev.up_path if direction else dev.down_path
    rate_Bps = min(sim.net.capacity_Bps[link] for link in path)
    one_s = nbytes / rate_Bps
    # FIFO: the first has the link to itself; sharing it would bring both in at 2 x one_s
    assert arrived[0] == pytest.approx(one_s + dev.delay_s, rel=1e-9, abs=1e-12)
    assert arrived[1] == pytest.approx(2 * one_s + dev.delay_s, rel=1e-9, abs=1e-12)


def test_messages_of_different_devices_share_the_ps_link() -> None:
    """Two devices' streams are two flows: max-min on the PS link, each at its own link's
    rate or half the PS link's, whichever is less (the PS link made the bottleneck here)."""
    sim = Simulation(load_topology(TINY), noise=False)
    ps_down = sim.devices["phones-0"].down_path[0]
    sim.net.set_capacity(ps_down, sim.devices["phones-0"].link_Bps[0])
    a, b = sim.devices["phones-0"], sim.devices["phones-1"]
    arrived: dict[str, float] = {}
    for dev in (a, b):
        dev.session = 1
        sim._transfer(dev, 0, 1_000_000,
                      lambda name=dev.spec.name: arrived.__setitem__(name, sim.now_s))
    assert sim.run_until(lambda: len(arrived) == 2)
    rate_Bps = sim.net.capacity_Bps[ps_down] / 2
    for dev in (a, b):
        assert arrived[dev.spec.name] == pytest.approx(1_000_000 / rate_Bps + dev.delay_s,
                                                       rel=1e-9, abs=1e-12)


def test_a_partitioned_devices_tiles_get_backups_before_its_lease_ends(tmp_path: Path) -> None:
    """As the PS's periodic tick pumps, copies stuck behind a cut link are backed up as soon as
    they are overdue; without it nothing pumps once the others are idle, and the step waits for
    the lease to expire."""
    trace = tmp_path / "t.csv"
    trace.write_text("time_s,device,event,arg\n0.004,laptops-0,partition,\n")
    topology = load_topology(TINY).with_overrides(steps=1)
    sim = Simulation(topology, load_schedule(trace, topology), noise=False)
    sim.start()
    device_s, stats, _ = sim.run_step(0)
    assert sim.devices["laptops-0"].partitioned
    assert stats.backups > 0 and stats.tiles == sum(sim.tiles_per_gemm.values())
    assert device_s < sim.config.lease_s / 2, device_s



def test_the_simulator_sends_each_message_the_ps_would(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """The simulator sends a pump's tiles as scheduler.message_runs cuts them, as PsCore.pump
    does: with no wait allowed every tile that brings bytes is a message of its own (one whose
    blocks the device holds rides along for free), though some pumps hand a device two tiles
    (tiny at batch 64)."""
    import testbed.ps_backend.scheduler as scheduler_module
    import testbed.ps_backend.step_plan as step_plan_module
    import testbed.simulate.sim as sim_module
    monkeypatch.setattr(scheduler_module, "DOWN_BATCH_DELAY_S", 0.0)
    # each GEMM planned on its own: tiny's layers planned on one grid for both passes
    # (planner.plan_layer) give a device one tile a pump
    monkeypatch.setattr(step_plan_module, "LAYER_GAIN", 0.0)
    pumped: list[int] = []
    sent: list[int] = []
    cut: list[int] = []  # the messages message_runs made, tiles each
    real_runs = sim_module.message_runs

    def spy_runs(assignments: list, down_Bps: float) -> list:
        pumped.append(len(assignments))
        runs = real_runs(assignments, down_Bps)
        cut.extend(len(r) for r in runs)
        # no wait: a message's tiles after its first bring no bytes
        assert all(a.nbytes == 0 for r in runs for a in r[1:])
        return runs
    monkeypatch.setattr(sim_module, "message_runs", spy_runs)
    real_send = Simulation._send
    monkeypatch.setattr(Simulation, "_send",
                        lambda self, dev, a: (sent.append(len(a)), real_send(self, dev, a)))
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY.read_text().replace("batch_size: 4", "batch_size: 64"))
    sim = Simulation(load_topology(path).with_overrides(steps=1), noise=False)
    sim.start()
    sim.run_step(0)
    assert max(pumped) > 1 and max(cut) >= 1
    assert sent == cut and sum(sent) == sum(pumped)
    assert sum(1 for n in sent if n == 1) > len(sent) / 2  # most tiles bring their blocks


def test_each_device_counts_its_bytes_per_pass() -> None:
    """What each device received and sent, per pass (bench/stage_profile.py --links), adds up
    to the step's bytes; forward's results are the forward GEMMs' outputs."""
    from testbed.simulate.chain import linears

    topology = load_topology(TINY).with_overrides(steps=1)
    sim = Simulation(topology, noise=False)
    sim.start()
    _, stats, _ = sim.run_step(0)
    moved = [d.moved for d in sim.devices.values()]
    assert sum(m["fwd"][0] + m["bwd"][0] for m in moved) == stats.bytes_down
    assert sum(m["fwd"][1] + m["bwd"][1] for m in moved) == stats.bytes_up
    job = topology.job
    tokens = job.batch_size * job.model.seq_len
    item = sim.dtype.itemsize
    outputs = sum(tokens * lin.d_out * item for lin in linears(job))  # K split: partials more
    assert sum(m["fwd"][1] for m in moved) >= outputs


def _run_trace(tmp_path: Path, rows: str, steps: int = 1) -> tuple[Simulation, list[dict]]:
    trace = tmp_path / "t.csv"
    trace.write_text("time_s,device,event,arg\n" + rows)
    topology = load_topology(TINY).with_overrides(steps=steps)
    events: list[dict] = []

    def event(kind: str, /, **fields: object) -> None:
        events.append({**fields, "event": kind, "t": sim.now_s})
    sim = Simulation(topology, load_schedule(trace, topology), noise=False, event=event)
    sim.start()
    for step in range(steps):
        sim.run_step(step)
    return sim, events


def test_a_lease_runs_from_the_last_cut_not_an_earlier_healed_one(tmp_path: Path) -> None:
    """Cut at 1 s, healed at 2 s, cut again at 3 s: the PS hears the device between the cuts,
    so its lease ends at 3 s + lease, not at 1 s + lease (the first cut's timer)."""
    sim, events = _run_trace(tmp_path, "1,phones-0,partition,\n2,phones-0,heal,\n"
                                       "3,phones-0,partition,\n20,phones-0,heal,\n")
    sim.pass_time(12.0)  # the step may end before either lease would
    lease_s = sim.config.lease_s
    expired = [e for e in events if e["event"] == "lease_expired"]
    assert [e["t"] for e in expired] == [pytest.approx(3 + lease_s, abs=1e-9)], expired


def test_a_device_that_joins_while_cut_off_joins_when_its_link_heals(tmp_path: Path) -> None:
    """Its agent starts but cannot reach the PS (on Mininet its port is down): it was
    registered at once, dealt tiles it could never return, and with no heal the step stalled."""
    sim, events = _run_trace(tmp_path, "0,phones-0,leave,\n0,phones-1,leave,\n"
                                       "0.001,phones-0,partition,\n0.001,phones-1,partition,\n"
                                       "0.002,phones-0,join,\n0.002,phones-1,join,\n"
                                       "0.5,phones-0,heal,\n", steps=2)
    sim.pass_time(1.0)  # tiny's steps may end before the heal
    joins = [e for e in events if e["event"] == "join"
             and e["device"] in ("phones-0", "phones-1")]
    assert [(e["device"], e["t"]) for e in joins] == [("phones-0", pytest.approx(0.5))]
    assert sim.devices["phones-0"].present and not sim.devices["phones-1"].present


def test_departures_give_the_reasons_testbed_up_records(tmp_path: Path) -> None:
    """A leave is the agent's Leave, which names its signal (`SIGTERM`), and a crash the end
    of a stream the killed agent's kernel closed (`STREAM_CLOSED`), as `testbed up` records
    them on loopback and Mininet; the simulator said `left` and `stream broken`."""
    from testbed.ps_backend.core import STREAM_CLOSED

    _sim, events = _run_trace(tmp_path, "0.001,phones-0,leave,\n0.001,phones-1,crash,\n")
    gone = {e["device"]: (e["event"], e["reason"]) for e in events
            if e["event"] in ("leave", "disconnect", "lease_expired")}
    assert gone == {"phones-0": ("leave", "SIGTERM"), "phones-1": ("disconnect", STREAM_CLOSED)}
