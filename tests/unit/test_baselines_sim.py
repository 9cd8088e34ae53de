"""Pipeline and data-parallel jobs in virtual time: bytes, restarts under churn, run directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.baselines import cost, pipeline_sim
from testbed.baselines.data_parallel_sim import LOSS_BYTES, DataParallelSim
from testbed.baselines.engine import PipelineTrainer, Stage, _reference_model
from testbed.baselines.pipeline_sim import PipelineSim, StepOutcome
from testbed.baselines.placement import PipelinePlan, device_infos, plan_pipeline
from testbed.baselines.run import simulate_baseline
from testbed.baselines.sim_core import LEASE_S, PS, BaselineWorld
from testbed.baselines.stage_proc import HeldDevice
from testbed.churn import load_schedule
from testbed.cli import main
from testbed.ps_backend.engine.data import builtin_corpus
from testbed.runlog import read_jsonl
from testbed.topology import Topology, load_topology, parse_topology


def topo(strategy: str, count: int = 4, steps: int = 6,
         behaviour: dict[str, Any] | None = None, **parallelism: Any) -> Topology:
    return parse_topology({
        "name": "bl", "seed": 3, "network": {"switches": ["ap0"],
                                             "ps": {"switch": "ap0",
                                                    "link": {"down": "1Gbit", "up": "1Gbit"}}},
        "devices": [{"group": "phones", "profile": "snapdragon888", "count": count,
                     "switch": "ap0", "link": {"down": "100Mbit", "up": "20Mbit",
                                               "delay": "10ms"},
                     **({"behaviour": behaviour} if behaviour else {})}],
        "job": {"model": {"hidden": 32, "layers": 4, "heads": 2, "ffn": 64, "seq_len": 16},
                "batch_size": 6, "steps": steps, "dtype": "float64",
                "parallelism": {"strategy": strategy, **parallelism}}})


def fixed_plan(monkeypatch: pytest.MonkeyPatch, devices: tuple[str, ...],
               bounds: tuple[tuple[int, int], ...], micro: int) -> None:
    """Pin the placement (the planner would put a tiny model on one phone)."""
    def plan(job: Any, infos: Any) -> PipelinePlan:
        present = {i.name for i in infos}
        chosen = tuple(d for d in devices if d in present)
        spare = [i.name for i in infos if i.name not in devices]
        chosen = chosen + tuple(spare[:len(devices) - len(chosen)])
        return PipelinePlan(chosen, bounds, micro, (0,) * len(bounds), 1.0)
    monkeypatch.setattr(pipeline_sim, "plan_pipeline", plan)


def run(sim: Any, steps: int) -> list[StepOutcome]:
    out: list[StepOutcome] = []
    sim.world.start()
    sim.run(steps, out.append)
    return out


def first_piece(t: Topology, device: str) -> tuple[float, float, BaselineWorld]:
    """When a data-parallel replica's first forward-and-backward piece starts on ``device``
    and its device seconds, in one step without churn; and that run's world."""
    probe = BaselineWorld(t, noise=False)
    started: list[float] = []
    real_compute = probe.compute

    def spy(dev: Any, gemms: Any, mem: float, then: Any) -> float:
        seconds = real_compute(dev, gemms, mem, then)
        if dev.name == device and gemms and not started:
            started.extend((probe.now_s, seconds))
        return seconds
    probe.compute = spy  # type: ignore[method-assign]
    run(DataParallelSim(t, probe), 1)
    return started[0], started[1], probe


@pytest.mark.usefixtures("one_torch_thread")
def test_pipeline_moves_what_the_real_pipeline_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device-to-device bytes of the simulated step = bytes the executed pipeline sent."""
    bounds = ((0, 1), (1, 3), (3, 4))
    t = topo("pipeline", micro_batches=3)
    fixed_plan(monkeypatch, ("phones-0", "phones-1", "phones-2"), bounds, 3)
    world = BaselineWorld(t, noise=False)
    sent: list[tuple[str, str, float]] = []
    real_send = world.send

    def spy(src: str, dst: str, nbytes: float, then: Any) -> Any:
        sent.append((src, dst, nbytes))
        return real_send(src, dst, nbytes, then)
    world.send = spy  # type: ignore[method-assign]
    sim = PipelineSim(t, world)
    run(sim, 1)
    executed = PipelineTrainer(t.job, seed=3, bounds=list(bounds), micro_batches=3,
                               corpus=builtin_corpus(cap_bytes=64 * 1024)).step().bytes_sent
    stage = {"phones-0": 0, "phones-1": 1, "phones-2": 2}
    simulated: dict[str, float] = {}
    for src, dst, n in sent:
        if PS in (src, dst):
            continue
        key = f"stage{stage[src]}->stage{stage[dst]}"
        simulated[key] = simulated.get(key, 0) + n
    assert simulated == {k: float(v) for k, v in executed.items()}
    # and the PS sent the tokens to the first stage and the targets to the last, after the
    # stage's weights: only them, its Adam moments are zeros before the first step
    tokens = sum(n for s, d, n in sent if s == PS and d == "phones-0")
    hand_out = sim._stage_params(0) * 8
    assert tokens == hand_out + 6 * 16 * cost.TOKEN_BYTES


def test_a_lost_stage_restarts_from_the_checkpoint_and_counts_redone_steps(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    t = topo("pipeline", count=5, steps=8, micro_batches=2, checkpoint_every=3)
    fixed_plan(monkeypatch, ("phones-0", "phones-1"), ((0, 2), (2, 4)), 2)
    probe = BaselineWorld(t, noise=False)
    ends: list[float] = []
    steps: list[StepOutcome] = []
    probe.start()
    PipelineSim(t, probe).run(8, lambda o: (steps.append(o), ends.append(probe.now_s)))
    # phones-1 crashes in the middle of step 4 (checkpointed at the end of step 2)
    crash_s = ends[3] + steps[4].device_s / 2
    trace = tmp_path / "crash.csv"
    trace.write_text(f"time_s,device,event,arg\n{crash_s:.6f},phones-1,crash,\n")
    world = BaselineWorld(t, load_schedule(trace, t), noise=False)
    sim = PipelineSim(t, world)
    out = run(sim, 8)
    assert sim.restarts == 1
    assert sim.steps_redone == 2  # step 3 (done since the checkpoint) and step 4 (aborted)
    assert [o.step for o in out] == [0, 1, 2, 3, 3, 4, 5, 6, 7]
    assert [o.redo for o in out].count(True) == 1
    assert sim.plan is not None and "phones-1" not in sim.plan.devices
    assert world.now_s > sum(s.device_s for s in steps) + sim.restore_s - 1e-9


def test_a_churn_action_is_recorded_before_what_it_causes(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The `churn` event of a crash comes before the departure and the restart it causes, as
    testbed up and testbed simulate record tile-tp's (the departure came first)."""
    t = topo("pipeline", count=3, steps=4, micro_batches=2, checkpoint_every=1)
    fixed_plan(monkeypatch, ("phones-0", "phones-1"), ((0, 2), (2, 4)), 2)
    trace = tmp_path / "crash.csv"
    trace.write_text("time_s,device,event,arg\n0.5,phones-1,crash,\n")
    kinds: list[str] = []
    world = BaselineWorld(t, load_schedule(trace, t), noise=False,
                          emit=lambda event, /, **_f: kinds.append(event))
    run(PipelineSim(t, world), 4)
    churn = kinds.index("churn")
    assert "restart" in kinds[churn:], kinds
    assert not {"disconnect", "leave", "restart"} & set(kinds[:churn]), kinds


def test_a_restart_after_a_checkpoint_restores_the_weights_and_adam_moments(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Weights alone (P·b) before the first step, as data-parallel's hand-out; weights and both
    moments (3·P·b) when resuming at a checkpoint that has them."""
    t = topo("pipeline", count=3, steps=4, micro_batches=2, checkpoint_every=1)
    fixed_plan(monkeypatch, ("phones-0", "phones-1"), ((0, 2), (2, 4)), 2)
    trace = tmp_path / "crash.csv"
    trace.write_text("time_s,device,event,arg\n0.5,phones-1,crash,\n")
    world = BaselineWorld(t, load_schedule(trace, t), noise=False)
    restores: list[list[tuple[str, float]]] = []
    real_restore = PipelineSim._restore

    def spy(sim: PipelineSim) -> float:
        restores.append([])
        real_send = world.send

        def send(src: str, dst: str, nbytes: float, then: Any) -> Any:
            restores[-1].append((dst, nbytes))
            return real_send(src, dst, nbytes, then)
        monkeypatch.setattr(world, "send", send)
        try:
            return real_restore(sim)
        finally:
            monkeypatch.setattr(world, "send", real_send)
    monkeypatch.setattr(PipelineSim, "_restore", spy)
    sim = PipelineSim(t, world)
    run(sim, 4)
    assert sim.restarts == 1 and sim.checkpoint_step > 0
    params = [cost.stage_params(t.job.model, 2, True, False) * 8,
              cost.stage_params(t.job.model, 2, False, True) * 8]
    assert restores[0] == [("phones-0", params[0]), ("phones-1", params[1])]
    assert restores[1] == [("phones-0", 3 * params[0]), ("phones-2", 3 * params[1])]


def test_data_parallel_drops_a_departed_replica_and_keeps_the_rows_fixed(
        tmp_path: Path) -> None:
    """The rule the engine and the emulation follow (membership.py): a replica lost is out of
    its step, its rows untrained (not re-split over the others); back, it first takes the
    parameters and AdamW moments (3·P·b) and trains again."""
    t = topo("data-parallel", count=3, steps=5)
    base = BaselineWorld(t, noise=False)
    base.start()
    ends: list[float] = []
    steps: list[StepOutcome] = []
    DataParallelSim(t, base).run(5, lambda o: (steps.append(o), ends.append(base.now_s)))
    assert all(o.fields["replicas"] == 3 for o in steps)
    params = cost.model_params(t.job.model)
    # every replica sends its loss and gradient up and gets the average back: P*8 bytes each
    # way, and the loss's 8 up
    assert steps[1].bytes_up == 3 * (params * 8 + LOSS_BYTES)
    assert steps[1].bytes_down == 3 * params * 8
    crash_s = ends[0] + steps[1].device_s * 0.3
    join_s = ends[2] + steps[3].device_s * 0.1  # back during step 3: taken in at step 4
    trace = tmp_path / "crash.csv"
    trace.write_text(f"time_s,device,event,arg\n{crash_s:.6f},phones-2,crash,\n"
                     f"{join_s:.6f},phones-2,join,\n")
    world = BaselineWorld(t, load_schedule(trace, t), noise=False)
    sim = DataParallelSim(t, world)
    out = run(sim, 5)
    assert [o.step for o in out] == [0, 1, 2, 3, 4]  # nothing redone
    took = [o.fields["took_part"] for o in out]
    two, three = ["phones-0", "phones-1"], ["phones-0", "phones-1", "phones-2"]
    assert took == [three, two, two, two, three]
    # each step counts the replica slots it went without (lost during it, or away at its
    # start), and the run's total is their sum
    assert [o.fields["dropped_replicas"] for o in out] == [0, 1, 1, 1, 0]
    assert sim.dropped_replica_steps == 3
    # the two replicas left keep their rows: the step computes two thirds of the batch
    ratio = out[2].compute_s / steps[2].compute_s
    assert 0.6 <= ratio <= 0.75, ratio
    # at step 4 phones-2 first receives the parameters and both Adam moments
    assert out[4].bytes_down == 3 * params * 8 + 3 * params * 8


def test_data_parallel_stops_when_every_replica_is_lost_during_a_step(tmp_path: Path) -> None:
    """No rows trained: the emulated PS stops the run ("every replica was lost"), and so does
    the simulator, even though the devices come back later, instead of reporting the step done
    at the moment of the loss."""
    t = topo("data-parallel", count=3, steps=3)
    trace = tmp_path / "crash.csv"
    trace.write_text("time_s,device,event,arg\n0.001,phones,crash,\n5,phones,join,\n")
    sim = DataParallelSim(t, BaselineWorld(t, load_schedule(trace, t), noise=False))
    with pytest.raises(pipeline_sim.NoPlacement, match="every replica was lost during the step"):
        run(sim, 3)


def test_diloco_talks_to_the_ps_every_h_steps() -> None:
    t = topo("data-parallel", count=3, steps=6, local_steps=3)
    out = run(DataParallelSim(t, BaselineWorld(t, noise=False)), 6)
    ups = [o.bytes_up for o in out]
    # every step each replica's loss; every third its parameters too
    losses = 3 * LOSS_BYTES
    assert ups[0] == ups[1] == ups[3] == ups[4] == losses
    assert ups[2] == ups[5] == losses + 3 * cost.model_params(t.job.model) * \
        cost.DTYPE_BYTES[t.job.dtype]


def test_simulate_writes_a_run_directory_for_each_strategy(tmp_path: Path) -> None:
    for strategy in ("pipeline", "data-parallel"):
        t = topo(strategy, steps=3)
        out = tmp_path / strategy
        out.mkdir()
        summary = simulate_baseline(t, out, report=False)
        assert summary["state"] == "done" and summary["strategy"] == strategy
        lines = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == [0, 1, 2]
        assert summary["energy"]["total"]["total_j"] > 0
        assert summary["energy"]["total"]["carbon_g"] > 0
        # the pipeline's first placement ships the stages their weights before step 0
        assert summary["wall_s"] == pytest.approx(
            sum(x["wall_s"] for x in lines) + summary.get("restore_s", 0.0), abs=1e-5)


def test_testbed_simulate_dispatches_on_strategy(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    raw = yaml.safe_load((Path(__file__).parents[1] / "data" / "tiny.yaml").read_text())
    raw["job"]["parallelism"] = {"strategy": "pipeline", "micro_batches": 2}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["simulate", str(path), "--steps", "2", "--out", str(tmp_path / "runs")]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == "pipeline" and summary["steps_done"] == 2
    assert (run_dir / "report.md").is_file()
    # its last line gives the steps' device time, and apart the model's hand-out that precedes
    # them (it gave their sum as the steps', then called the hand-out "restores and restarts"
    # in a run with none)
    steps_s = sum(s["device_time_s"] for s in read_jsonl(run_dir / "steps.jsonl"))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary["restarts"] == 0
    assert last.startswith(f"done: 2 steps, {steps_s:.3f} s device time ("
                           f"{summary['wall_s']:.3f} s in all, the model handed out to its "
                           f"devices included)"), last
    # `testbed up` runs the baselines on Mininet only: on loopback, exit 2 saying so
    assert main(["up", str(path), "--out", str(tmp_path / "up")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: job.parallelism.strategy: pipeline" in err and "Mininet" in err
    assert not (tmp_path / "up").exists()  # nothing started, nothing written
    raw["job"]["parallelism"] = {"strategy": "pipe-line"}
    path.write_text(yaml.safe_dump(raw))
    assert main(["up", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "job.parallelism.strategy" in err and "pipeline" in err


def test_device_to_device_paths_skip_the_ps_link() -> None:
    t = topo("pipeline")
    world = BaselineWorld(t)
    links, delay = world.path("phones-0", "phones-1")
    names = [world.net.names[i] for i in links]
    assert names == ["phones-0:up", "phones-1:down"] and delay == pytest.approx(0.02)
    links, _ = world.path(PS, "phones-0")
    assert [world.net.names[i] for i in links] == ["ps:up", "phones-0:down"]
    _ = dataclasses  # keep the import for typed helpers above


def test_diloco_drops_a_lost_replica_for_the_rest_of_its_round(tmp_path: Path) -> None:
    t = topo("data-parallel", count=3, steps=6, local_steps=3)
    ends: list[float] = []
    probe = BaselineWorld(t, noise=False)
    probe.start()
    DataParallelSim(t, probe).run(6, lambda o: ends.append(probe.now_s))
    crash_s = ends[0] / 2  # phones-2 crashes during the first inner step
    trace = tmp_path / "crash.csv"
    trace.write_text(f"time_s,device,event,arg\n{crash_s:.6f},phones-2,crash,\n")
    world = BaselineWorld(t, load_schedule(trace, t), noise=False)
    sim = DataParallelSim(t, world)
    out = run(sim, 6)
    assert [o.fields["replicas"] for o in out] == [3, 2, 2, 2, 2, 2]
    assert sim.dropped_replica_steps == 6  # phones-2's slot is empty in all six steps


@pytest.mark.parametrize("strategy", ["pipeline", "data-parallel"])
def test_a_run_whose_devices_all_leave_fails_saying_so(tmp_path: Path, strategy: str) -> None:
    t = topo(strategy, count=2, steps=50)
    trace = tmp_path / "gone.csv"
    trace.write_text("time_s,device,event,arg\n0.5,phones-0,crash,\n0.5,phones-1,crash,\n")
    out = tmp_path / "run"
    out.mkdir()
    summary = simulate_baseline(t, out, load_schedule(trace, t), report=False)
    assert summary["state"] == "failed" and summary["exit_code"] == 1
    assert "every device has left" in summary["error"]
    assert 0 < summary["steps_done"] < 50


def test_a_partition_healed_and_cut_again_is_lost_a_lease_after_the_second_cut(
        tmp_path: Path) -> None:
    """The PS counts the lease from the last message: the first cut's timer, still running
    when the device was cut again, must not declare it lost 3 s into the second cut."""
    t = topo("pipeline", count=2)
    trace = tmp_path / "cuts.csv"
    trace.write_text("time_s,device,event,arg\n1,phones-1,partition,\n2,phones-1,heal,\n"
                     "3,phones-1,partition,\n")
    world = BaselineWorld(t, load_schedule(trace, t), noise=False)
    lost: list[tuple[str, float]] = []
    world.on_lost = lambda dev, _kind, _why: lost.append((dev.name, world.now_s))
    world.start()
    world.run_until(lambda: False)
    assert [name for name, _ in lost] == ["phones-1"]
    assert lost[0][1] == pytest.approx(3 + LEASE_S, rel=1e-12)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("bounds", [((0, 4),), ((0, 1), (1, 3), (3, 4))])
def test_a_stage_holds_the_parameters_the_real_stage_holds(
        bounds: tuple[tuple[int, int], ...]) -> None:
    """What a stage's AdamW, checkpoint and restore move: a one-stage pipeline holds the tied
    LM head and token embedding once (it had counted V·h twice); the ends of a longer one hold a
    copy each."""
    t = topo("pipeline")
    sim = PipelineSim(t, BaselineWorld(t, noise=False))
    sim.plan = PipelinePlan(tuple(f"phones-{s}" for s in range(len(bounds))), bounds, 2,
                            (0,) * len(bounds), 1.0)
    model = _reference_model(t.job, t.seed)
    last = len(bounds) - 1
    real = [sum(p.numel() for p in Stage(model, a, e, s == 0, s == last).parameters())
            for s, (a, e) in enumerate(bounds)]
    assert [sim._stage_params(s) for s in range(len(bounds))] == real


def test_work_stopped_part_way_is_charged_only_up_to_the_stop() -> None:
    """compute() charges a piece when it is queued; a stop refunds what had not run, and a
    piece queued behind it in full."""
    t = topo("pipeline", count=2)
    world = BaselineWorld(t, noise=False)
    dev = world.devices["phones-0"]
    gemms, mem = cost.stage_work(t.job.model, 4, True, "F", 6, 8)
    first = world.compute(dev, gemms, mem, lambda: None)
    world.compute(dev, gemms, mem, lambda: None)  # queued behind the first
    full_j = dev.energy_j / 2
    world.pass_time(first * 0.4)
    world.stop_work(dev)
    assert dev.compute_s == pytest.approx(first * 0.4, rel=1e-9)
    assert 0 < dev.energy_j < full_j
    assert dev.busy_until_s == pytest.approx(first * 0.4, rel=1e-12)


def test_a_stopped_piece_is_in_the_device_models_telemetry_as_far_as_it_ran() -> None:
    """The device model's own account (the device record's telemetry) kept the whole piece
    when compute_s and energy_j had been cut back to the stop: it now keeps what ran, the
    rest counted idle, and the tiles never started are taken off."""
    t = topo("pipeline", count=2)
    world = BaselineWorld(t, noise=False)
    dev = world.devices["phones-0"]
    gemms, mem = cost.stage_work(t.job.model, 4, True, "F", 6, 8)
    world.compute(dev, gemms, mem, lambda: None)
    gemm_s = dev.model.telemetry(0.0)["busy_s"]  # the first piece's GEMMs (factor 1)
    world.compute(dev, gemms, mem, lambda: None)  # queued behind the first
    whole = dev.model.telemetry(0.0)
    world.pass_time(gemm_s * 0.5)
    world.stop_work(dev)
    tel = dev.model.telemetry(world.now_s)
    assert tel["busy_s"] == pytest.approx(gemm_s * 0.5, rel=1e-9)
    assert tel["busy_s"] == pytest.approx(dev.compute_s, rel=1e-9)
    assert tel["compute_energy_j"] == pytest.approx(dev.energy_j, rel=1e-9)
    assert tel["busy_s"] + tel["idle_s"] == pytest.approx(whole["busy_s"] + whole["idle_s"],
                                                          rel=1e-9)
    assert 0 < tel["tiles"] < len(gemms)  # those never started are taken off


def test_a_slow_applies_from_its_time_to_the_piece_under_way(tmp_path: Path) -> None:
    """A churn slow halfway through a replica's forward and backward (one piece) makes the
    rest of it factor times longer; it waited for the replica's next piece (its AdamW)."""
    t = topo("data-parallel", count=2, steps=1)
    start_s, piece_s, probe = first_piece(t, "phones-0")
    adamw_s = probe.devices["phones-0"].compute_s - piece_s
    trace = tmp_path / "slow.csv"
    trace.write_text("time_s,device,event,arg\n"
                     f"{start_s + 0.5 * piece_s:.12f},phones-0,slow,3\n")
    world = BaselineWorld(t, load_schedule(trace, t), noise=False)
    out = run(DataParallelSim(t, world), 1)
    assert world.devices["phones-0"].compute_s == pytest.approx(
        0.5 * piece_s + 1.5 * piece_s + 3 * adamw_s, rel=1e-6)
    assert out[0].device_s > probe.now_s + 0.9 * piece_s  # the step waited for it


def test_a_slow_shrinks_the_rest_of_a_piece_and_its_energy() -> None:
    """Back to full speed mid-piece (slow 1 after slow 4): the rest runs 4 times faster, and
    the piece's end event comes sooner (its first end is dropped)."""
    t = topo("pipeline", count=2)
    world = BaselineWorld(t, noise=False)
    dev = world.devices["phones-0"]
    world.set_slow(dev, 4.0)
    gemms, mem = cost.stage_work(t.job.model, 4, True, "F", 6, 8)
    ends: list[float] = []
    queued_s = world.compute(dev, gemms, mem, lambda: ends.append(world.now_s))
    queued_j = dev.energy_j
    world.pass_time(queued_s * 0.5)
    world.set_slow(dev, 1.0)
    world.pass_time(queued_s * 2)
    assert ends == [pytest.approx(queued_s * (0.5 + 0.5 / 4), rel=1e-9)]
    assert dev.compute_s == pytest.approx(ends[0], rel=1e-9)
    assert dev.energy_j == pytest.approx(queued_j * (0.5 + 0.5 / 4), rel=1e-6)


@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_a_slow_ends_a_piece_under_way_once(factor: float) -> None:
    """A slow at the factor already in force (`slow 1` on a device never slowed) moved no
    end, and the piece's callback ran twice: once as queued, once as queued again."""
    t = topo("pipeline", count=2)
    world = BaselineWorld(t, noise=False)
    dev = world.devices["phones-0"]
    gemms, mem = cost.stage_work(t.job.model, 4, True, "F", 6, 8)
    ends: list[float] = []
    queued_s = world.compute(dev, gemms, mem, lambda: ends.append(world.now_s))
    world.pass_time(queued_s * 0.5)
    world.set_slow(dev, factor)
    world.pass_time(queued_s * 4)
    assert ends == [pytest.approx(queued_s * (0.5 + 0.5 * factor), rel=1e-9)]


def test_a_slowed_piece_is_in_the_device_models_telemetry_as_it_ran() -> None:
    """The device model's account (the device record's telemetry) follows a churn slow, at a
    piece's start and re-timed mid-piece: its busy time and compute energy are the GEMMs'
    share of compute_s and energy_j (the factor was applied after the model: slowed 4 times,
    the telemetry said a quarter)."""
    t = topo("pipeline", count=2)
    world = BaselineWorld(t, noise=False)
    dev = world.devices["phones-0"]
    world.set_slow(dev, 4.0)
    gemms, _ = cost.stage_work(t.job.model, 4, True, "F", 6, 8)
    queued_s = world.compute(dev, gemms, 0.0, lambda: None)  # GEMMs only: all the model's
    world.pass_time(queued_s * 0.5)
    world.set_slow(dev, 2.0)
    world.pass_time(queued_s * 2)
    tel = dev.model.telemetry(world.now_s)
    assert dev.compute_s == pytest.approx(queued_s * (0.5 + 0.5 / 2), rel=1e-9)
    assert tel["busy_s"] == pytest.approx(dev.compute_s, rel=1e-9)
    assert tel["compute_energy_j"] == pytest.approx(dev.energy_j, rel=1e-9)
    assert tel["busy_s"] + tel["idle_s"] == pytest.approx(world.now_s, rel=1e-9)


def test_a_cancelled_transfer_counts_the_bytes_it_had_sent() -> None:
    t = topo("pipeline", count=2)
    world = BaselineWorld(t, noise=False)
    transfer = world.send("phones-0", "phones-1", 1e6, lambda: None)
    world.pass_time(0.1)  # phones-0's uplink: 20 Mbit/s, 250,000 B in 0.1 s
    world.cancel(transfer)
    sent = 250_000 - 64  # the message's overhead went first
    a, b = world.devices["phones-0"], world.devices["phones-1"]
    assert a.bytes_up == pytest.approx(sent, abs=1) and b.bytes_down == a.bytes_up
    world.cancel(transfer)  # twice: nothing more taken off
    assert b.bytes_down == a.bytes_up == pytest.approx(sent, abs=1)


def test_a_replica_crashing_mid_piece_is_charged_no_more_than_it_was_there(
        tmp_path: Path) -> None:
    """The device record, the summary's totals and the energy all stop at the crash: its busy
    and idle seconds add up to its presence (its busy seconds had run past it)."""
    t = topo("data-parallel", count=3, steps=1)
    start_s, piece_s, _ = first_piece(t, "phones-2")  # its forward and backward
    crash_s = start_s + 0.5 * piece_s
    trace = tmp_path / "crash.csv"
    trace.write_text(f"time_s,device,event,arg\n{crash_s:.9f},phones-2,crash,\n")
    out = tmp_path / "run"
    out.mkdir()
    summary = simulate_baseline(t, out, load_schedule(trace, t), noise=False, report=False)
    us = 1e-6  # the records' rounding
    record = next(d for d in summary["devices"] if d["device"] == "phones-2")
    assert record["compute_s"] == pytest.approx(crash_s - start_s, abs=us)
    # the device model's account too (it had the whole piece: 0.107 s on the default topology)
    assert record["telemetry"]["busy_s"] <= record["compute_s"] + us
    energy = summary["energy"]["devices"]["phones-2"]
    assert energy["busy_s"] + energy["idle_s"] == pytest.approx(crash_s, abs=2 * us)
    assert summary["device_compute_s"] == pytest.approx(
        sum(d["compute_s"] for d in summary["devices"]), abs=len(summary["devices"]) * us)


def test_a_replica_lost_after_its_gradient_reached_the_ps_took_part_in_the_step(
        tmp_path: Path) -> None:
    """Its gradient is in the step's average, as in the emulated PS: the step took its rows
    (it had been counted dropped because it was lost before the step ended); it is missing
    from the next step instead."""
    t = topo("data-parallel", count=3, steps=2)
    probe = BaselineWorld(t, noise=False)
    sent_back: list[float] = []
    real_send = probe.send

    def spy(src: str, dst: str, nbytes: float, then: Any) -> Any:
        if src == PS and not sent_back and probe.devices[dst].compute_s > 0:
            sent_back.append(probe.now_s)  # every gradient is at the PS: the average goes back
        return real_send(src, dst, nbytes, then)
    probe.send = spy  # type: ignore[method-assign]
    ends: list[float] = []
    probe.start()
    DataParallelSim(t, probe).run(2, lambda o: ends.append(probe.now_s))
    crash_s = (sent_back[0] + ends[0]) / 2
    trace = tmp_path / "late.csv"
    trace.write_text(f"time_s,device,event,arg\n{crash_s:.9f},phones-2,crash,\n")
    sim = DataParallelSim(t, BaselineWorld(t, load_schedule(trace, t), noise=False))
    out = run(sim, 2)
    three, two = ["phones-0", "phones-1", "phones-2"], ["phones-0", "phones-1"]
    assert [o.fields["took_part"] for o in out] == [three, two]
    assert [o.fields["dropped_replicas"] for o in out] == [0, 1]
    assert sim.dropped_replica_steps == 1


@pytest.mark.parametrize("strategy", ["pipeline", "data-parallel"])
def test_a_straggling_group_computes_its_pieces_factor_times_slower(strategy: str) -> None:
    """The group's behaviour.straggler, drawn per piece as tile-tp's simulation draws it per
    tile (the baselines ignored it, so a compare with stragglers slowed tile-tp alone)."""
    def compute_s(straggler: dict[str, Any] | None) -> float:
        t = topo(strategy, steps=2, behaviour={"straggler": straggler} if straggler else None)
        out = run(PipelineSim(t, BaselineWorld(t, noise=False)) if strategy == "pipeline"
                  else DataParallelSim(t, BaselineWorld(t, noise=False)), 2)
        return sum(o.compute_s for o in out)

    honest = compute_s(None)
    assert compute_s({"factor": 4, "rate": "100%"}) == pytest.approx(4 * honest, rel=1e-3)
    assert 1.3 * honest <= compute_s({"factor": 4, "rate": "50%"}) <= 3.7 * honest


def test_an_emulated_device_straggles_on_the_pieces_the_simulated_one_does() -> None:
    """HeldDevice (the stage and replica processes) holds a straggling piece factor times
    longer, drawing from the same seed as the simulator: the same pieces straggle."""
    honest_t = topo("pipeline")
    slow_t = topo("pipeline", behaviour={"straggler": {"factor": 3, "rate": "50%"}})
    gemms, mem = cost.stage_work(honest_t.job.model, 4, True, "F", 6, 8)
    honest, slow = HeldDevice(honest_t, "phones-0", 0.0), HeldDevice(slow_t, "phones-0", 0.0)
    worlds = BaselineWorld(honest_t), BaselineWorld(slow_t)
    emulated, simulated = [], []
    for _ in range(12):
        before = honest.device_s, slow.device_s
        honest.end(honest.begin(gemms, mem))
        slow.end(slow.begin(gemms, mem))
        emulated.append((slow.device_s - before[1]) / (honest.device_s - before[0]))
        h, s = (w.compute(w.devices["phones-0"], gemms, mem, lambda: None) for w in worlds)
        simulated.append(s / h)
    assert emulated == pytest.approx(simulated, rel=1e-6)
    assert {round(f, 3) for f in emulated} == {1.0, 3.0}


def _default_dp(tmp_path: Path, rows: str, steps: int, local_steps: int = 1) -> list[StepOutcome]:
    raw = yaml.safe_load((Path(__file__).parents[2] / "topologies" / "default.yaml").read_text())
    raw["job"]["parallelism"] = {"strategy": "data-parallel", "local_steps": local_steps}
    raw["job"]["steps"] = steps
    raw["time_dilation"] = 1
    path = tmp_path / "dp.yaml"
    path.write_text(yaml.safe_dump(raw))
    (tmp_path / "t.csv").write_text("time_s,device,event,arg\n" + rows)
    t = load_topology(path)
    world = BaselineWorld(t, load_schedule(tmp_path / "t.csv", t), noise=False)
    return run(DataParallelSim(t, world), steps)


def test_a_lost_replicas_stopped_work_does_not_end_after_it_is_back(tmp_path: Path) -> None:
    """phones-2, ten times slower, crashes inside step 0 and is back for step 1: its stopped
    step-0 work still had its end queued, which then sent step 1 a second gradient (nine
    uploads from eight replicas) and could count phones-2 in a step it was lost from."""
    out = _default_dp(tmp_path, "0.0,phones-2,slow,10\n0.15,phones-2,crash,\n"
                                "0.3,phones-2,join,\n", steps=2)
    params = cost.model_params(load_topology(tmp_path / "dp.yaml").job.model)
    one = params * 4 + LOSS_BYTES  # float32: a replica's loss and gradient
    assert "phones-2" not in out[0].fields["took_part"]
    assert "phones-2" in out[1].fields["took_part"]
    assert [o.bytes_up for o in out] == [7 * one, 8 * one]


def test_a_diloco_replica_cut_off_before_its_loss_is_sent_is_dropped(tmp_path: Path) -> None:
    """Between DiLoCo's rounds a replica's part is its loss: one cut off before sending it
    was counted as taking part, as a crash at that moment was not."""
    cut = _default_dp(tmp_path, "0.15,phones-2,partition,\n", steps=1, local_steps=2)
    crash = _default_dp(tmp_path, "0.15,phones-2,crash,\n", steps=1, local_steps=2)
    assert "phones-2" not in cut[0].fields["took_part"]
    assert cut[0].fields["took_part"] == crash[0].fields["took_part"]


def test_pipeline_placement_weighs_a_groups_expected_straggling(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An m2pro whose every piece takes 4 times as long (expected 60 GFLOP/s) against a steady
    m2 (124): placement went by the profiles alone and put the stage on the m2pro, whose steps
    the simulator (and the emulation) then ran 4 times slower than its estimate."""
    def two(**straggler: Any) -> Topology:
        link = {"down": "300Mbit", "up": "100Mbit", "delay": "5ms"}
        job = yaml.safe_load((Path(__file__).parents[2] / "topologies" / "default.yaml")
                             .read_text())["job"]  # hidden 96, sequence 256, batch 32
        raw: dict[str, Any] = {
            "name": "two", "seed": 3,
            "network": {"switches": ["ap0"], "ps": {"switch": "ap0", "link": {
                "down": "1Gbit", "up": "1Gbit"}}},
            "devices": [{"group": "fast", "profile": "m2pro", "count": 1, "switch": "ap0",
                         "link": link, "behaviour": {"straggler": straggler}},
                        {"group": "steady", "profile": "m2", "count": 1, "switch": "ap0",
                         "link": link}],
            "job": {**job, "steps": 2, "parallelism": {"strategy": "pipeline"}}}
        return parse_topology(raw)

    t = two(factor=4, rate="100%")
    infos = device_infos(t)
    assert {i.name: i.slowdown for i in infos} == {"fast-0": 4.0, "steady-0": 1.0}
    assert plan_pipeline(t.job, infos).devices == ("steady-0",)
    assert plan_pipeline(t.job, device_infos(two(factor=4, rate="10%"))).devices == ("fast-0",)
    placed = sum(o.device_s for o in run(PipelineSim(t, BaselineWorld(t, noise=False)), 2))
    fixed_plan(monkeypatch, ("fast-0",), ((0, t.job.model.layers),), 4)
    on_fast = sum(o.device_s for o in run(PipelineSim(t, BaselineWorld(t, noise=False)), 2))
    assert placed < 0.5 * on_fast  # 0.156 against 0.362 s a step here


def _cut_run(tmp_path: Path, strategy: str, rows: str, steps: int = 200
             ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """tests/data/slow.yaml (no slow) as ``strategy`` under phones-0's churn ``rows``: the
    summary and the events."""
    raw = yaml.safe_load((Path(__file__).parents[1] / "data" / "slow.yaml").read_text())
    raw["job"]["parallelism"]["strategy"] = strategy
    raw["job"]["steps"] = steps
    path = tmp_path / f"{strategy}.yaml"
    path.write_text(yaml.safe_dump(raw))
    t = load_topology(path)
    trace = tmp_path / "cut.csv"
    trace.write_text("time_s,device,event,arg\n" + rows)
    out = tmp_path / f"run-{strategy}"
    out.mkdir()
    summary = simulate_baseline(t, out, load_schedule(trace, t), noise=False, report=False)
    return summary, read_jsonl(out / "events.jsonl")


def _heard(events: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """phones-0's departures as the coordinator recorded them: (kind, time)."""
    return [(e["event"], e["elapsed_s"]) for e in events
            if e.get("device") == "phones-0" and e["event"] in
            ("leave", "disconnect", "lease_expired") and "not " not in e.get("reason", "not ")]


@pytest.mark.parametrize("strategy", ["pipeline", "data-parallel"])
@pytest.mark.parametrize("event", ["leave", "crash"])
def test_a_departure_while_cut_off_is_heard_at_the_lease(tmp_path: Path, strategy: str,
                                                         event: str) -> None:
    """A leave or crash of a cut-off device reaches the coordinator as a network would tell
    it: at its lease (5 s after the cut), not at the departure (it was counted at 1.5 s)."""
    summary, events = _cut_run(tmp_path, strategy,
                               f"1,phones-0,partition,\n1.5,phones-0,{event},\n")
    assert _heard(events) == [("lease_expired", pytest.approx(1 + LEASE_S, rel=1e-9))]
    assert summary["steps_done"] == 200
    if strategy == "pipeline":
        restart = next(e for e in events if e["event"] == "restart")
        assert restart["elapsed_s"] >= 1 + LEASE_S


@pytest.mark.parametrize("strategy", ["pipeline", "data-parallel"])
@pytest.mark.parametrize("event", ["leave", "crash"])
def test_a_departure_while_cut_off_is_heard_at_a_heal_that_comes_first(
        tmp_path: Path, strategy: str, event: str) -> None:
    """The heal brings the connection's end the cut held: a disconnect then, and the device,
    gone, does not come back with its link."""
    summary, events = _cut_run(tmp_path, strategy, f"1,phones-0,partition,\n"
                                                   f"1.5,phones-0,{event},\n3,phones-0,heal,\n")
    assert _heard(events) == [("disconnect", pytest.approx(3.0, rel=1e-9))]
    if strategy == "pipeline":
        assert summary["restarts"] == 1
        stages = [e["devices"] for e in events if e["event"] == "placement"]
        assert "phones-0" not in stages[-1]
    else:
        assert summary["dropped_replica_steps"] == 197  # out from the step under way on


@pytest.mark.parametrize("strategy", ["pipeline", "data-parallel"])
def test_a_partition_shorter_than_the_lease_loses_nothing(tmp_path: Path,
                                                          strategy: str) -> None:
    summary, events = _cut_run(tmp_path, strategy, "1,phones-0,partition,\n4,phones-0,heal,\n")
    assert _heard(events) == []
    assert summary.get("restarts", 0) == 0 and summary.get("dropped_replica_steps", 0) == 0


def test_a_replica_that_leaves_while_cut_off_stops_computing_at_its_leave(
        tmp_path: Path) -> None:
    """Its process is gone at the leave, whenever the PS hears of it: its work is charged
    up to the leave, not to the lease (as a crash without a cut is)."""
    t = topo("data-parallel", count=3, steps=1)
    start_s, piece_s, _ = first_piece(t, "phones-2")
    cut_s, leave_s = start_s + 0.2 * piece_s, start_s + 0.5 * piece_s
    charged = []
    for rows in (f"{cut_s:.9f},phones-2,partition,\n{leave_s:.9f},phones-2,leave,\n",
                 f"{leave_s:.9f},phones-2,crash,\n"):
        trace = tmp_path / "t.csv"
        trace.write_text("time_s,device,event,arg\n" + rows)
        out = tmp_path / f"run{len(charged)}"
        out.mkdir()
        summary = simulate_baseline(t, out, load_schedule(trace, t), noise=False,
                                    report=False)
        charged.append(next(d["compute_s"] for d in summary["devices"]
                            if d["device"] == "phones-2"))
    assert charged[0] == pytest.approx(leave_s - start_s, abs=1e-6)
    assert charged[0] == pytest.approx(charged[1], abs=1e-6)


def _heat(dev: Any, spans: list[tuple[float, float]], watts: float, until_s: float) -> float:
    """The device's temperature at until_s had it been busy at ``watts`` over ``spans``
    (start, seconds) alone, idle otherwise, from ambient at 0."""
    from testbed.emulator.thermal import ThermalState

    state = ThermalState(dev.model.thermal.params)
    idle_w, clock = dev.power.idle_w, 0.0
    for start, seconds in spans:
        state.advance(start - clock, idle_w)
        state.advance(seconds, watts)
        clock = start + seconds
    state.advance(until_s - clock, idle_w)
    return state.temperature_c


def test_a_stopped_piece_heats_its_device_only_as_far_as_it_ran() -> None:
    """Its thermal state kept the whole piece's heat (and the heat of the pieces queued
    behind it), as if the device had computed work it dropped."""
    t = topo("pipeline", count=2)
    world = BaselineWorld(t, noise=False)
    dev = world.devices["phones-0"]
    big = [cost.Gemm(2048, 2048, 2048, "forward")]  # about a second on the phone
    seconds = world.compute(dev, big, 0.0, lambda: None)
    watts = dev.energy_j / dev.compute_s
    world.compute(dev, big, 0.0, lambda: None)  # queued behind it
    world.pass_time(seconds * 0.4)
    world.stop_work(dev)
    end_s = 3 * seconds
    expected = _heat(dev, [(0.0, seconds * 0.4)], watts, end_s)
    whole = _heat(dev, [(0.0, 2 * seconds)], watts, end_s)
    got = dev.model.telemetry(end_s)["temperature_c"]
    assert got == pytest.approx(expected, rel=1e-9)
    assert got < whole - 0.1 * (whole - expected)  # the difference is no rounding


@pytest.mark.parametrize("factor", [3.0, 0.5])
def test_a_slowed_piece_heats_its_device_along_its_re_timed_work(factor: float) -> None:
    """A slow mid-piece: the rest of it is busy factor times longer (or shorter), at the same
    power; the heat followed the piece as first timed."""
    t = topo("pipeline", count=2)
    world = BaselineWorld(t, noise=False)
    dev = world.devices["phones-0"]
    seconds = world.compute(dev, [cost.Gemm(2048, 2048, 2048, "forward")], 0.0, lambda: None)
    watts = dev.energy_j / dev.compute_s
    half = seconds / 2
    world.pass_time(half)
    world.set_slow(dev, factor)
    end_s = 4 * seconds
    expected = _heat(dev, [(0.0, half), (half, half * factor)], watts, end_s)
    assert dev.model.telemetry(end_s)["temperature_c"] == pytest.approx(expected, rel=1e-9)
