"""testbed simulate: run directory, the PS's planner's tiles, churn replay, bad input, scale."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from testbed.churn.schedule import load_schedule
from testbed.cli import main
from testbed.ps_backend.tiler import cut_regions, gemm_flops
from testbed.runlog import read_jsonl
from testbed.simulate.chain import linears, step_chain
from testbed.simulate.run import simulate
from testbed.simulate.sim import Simulation
from testbed.topology import load_topology

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"
TRACE = "time_s,device,event,arg\n0.002,phones-1,leave,\n0.004,phones-2,crash,\n" \
        "0.006,phones-1,join,\n0.008,laptops-0,slow,2\n"


def test_run_directory_is_complete_and_marked(tmp_path: Path) -> None:
    topology = load_topology(TINY).with_overrides(steps=2)
    summary = simulate(topology, tmp_path, noise=False)
    assert summary["simulated"] is True and summary["state"] == "done"
    steps = read_jsonl(tmp_path / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1]
    chain = [g for group in step_chain(topology.job) for g in group]
    for s in steps:
        assert s["gemms"] == len(chain) == 27  # 3 per submitted linear: 2 layers x 4 + the head
        assert s["device_time_s"] > 0 and 0 < s["efficiency"] <= 1.0
        assert s["bytes_down"] > 0 and s["bytes_up"] > 0
    assert summary["energy"]["total"]["total_j"] > 0
    assert summary["energy"]["total"]["carbon_g"] > 0
    assert (tmp_path / "report.png").stat().st_size > 0
    assert len(read_jsonl(tmp_path / "devices.jsonl")) == 4
    # the planner's share of the simulation's own time: some, and no more than all of it
    assert 0 < summary["planner_cpu_s"] <= summary["sim_wall_s"] + 0.01


def test_gemms_the_ps_keeps_are_counted_as_the_ps_counts_them(tmp_path: Path) -> None:
    """A step's ``gemms`` are all its GEMMs and ``gemms_local`` those under min_offload_flops,
    as the PS writes them (its executor's counts); the simulator wrote the offloaded ones and
    0."""
    text = TINY.read_text().replace("min_offload_flops: 0", "min_offload_flops: 300000")
    path = tmp_path / "tiny.yaml"
    path.write_text(text)
    topology = load_topology(path).with_overrides(steps=1)
    chain = [g for group in step_chain(topology.job) for g in group]
    local = sum(gemm_flops(g.m, g.k, g.n) < 300_000 for g in chain)
    assert 0 < local < len(chain)  # the threshold splits this job's GEMMs
    (tmp_path / "run").mkdir()
    simulate(topology, tmp_path / "run", noise=False, report=False)
    [step] = read_jsonl(tmp_path / "run" / "steps.jsonl")
    assert (step["gemms"], step["gemms_local"]) == (len(chain), local)


def test_every_tile_of_every_gemm_is_accepted_once(tmp_path: Path) -> None:
    topology = load_topology(TINY).with_overrides(steps=1)
    sim = Simulation(topology, noise=False)
    sim.start()
    _, stats, _ = sim.run_step(0)
    assert stats.tiles == sum(sim.tiles_per_gemm.values())
    assert not sim.scheduler.tasks and not sim.scheduler.pending
    # bytes up: every result tile's C once, whatever the tiling
    chain = [g for group in step_chain(topology.job) for g in group]
    assert stats.bytes_up >= sum(g.m * g.n * 8 for g in chain)  # K-split partials: more


def test_churn_replays_the_schedule_in_order(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE)
    topology = load_topology(TINY).with_overrides(steps=2)
    schedule = load_schedule(trace, topology)
    (tmp_path / "run").mkdir()
    simulate(topology, tmp_path / "run", schedule, report=False)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    churn = [(e["action"], e["device"]) for e in events if e["event"] == "churn"]
    assert churn == [(a.event.value, a.device) for a in schedule.actions]
    membership = [(e["event"], e["device"]) for e in events
                  if e["event"] in ("join", "leave", "disconnect")][4:]  # after the first four
    assert membership == [("leave", "phones-1"), ("disconnect", "phones-2"),
                          ("join", "phones-1")]
    times = [e["elapsed_s"] for e in events if e["event"] == "churn"]
    assert times == pytest.approx([a.time_s for a in schedule.actions], abs=1e-9)


def test_an_actions_churn_event_comes_before_what_it_causes(tmp_path: Path) -> None:
    """As `testbed up` records them (its replay stamps an action as it begins; the PS hears of
    it after): the simulator wrote a leave's `leave`, a crash's `disconnect` and a join's (or a
    heal's) `join` before the action's `churn` event."""
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE + "0.010,phones-2,partition,\n0.012,phones-2,join,\n"
                     "0.014,phones-2,heal,\n")
    topology = load_topology(TINY).with_overrides(steps=2)
    (tmp_path / "run").mkdir()
    simulate(topology, tmp_path / "run", load_schedule(trace, topology), report=False)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    order = [(e["event"], e["device"]) for e in events
             if e["event"] in ("churn", "join", "leave", "disconnect")][4:]  # the first joins
    assert order == [("churn", "phones-1"), ("leave", "phones-1"),
                     ("churn", "phones-2"), ("disconnect", "phones-2"),
                     ("churn", "phones-1"), ("join", "phones-1"),
                     ("churn", "laptops-0"),
                     ("churn", "phones-2"), ("churn", "phones-2"),  # joins cut off: not yet
                     ("churn", "phones-2"), ("join", "phones-2")]  # at the heal


def test_the_run_directory_names_the_trace_of_churn(tmp_path: Path) -> None:
    """`--churn` replaces the topology's trace, and the resolved topology.yaml says which: it
    said ``churn: null``, so a churn run could not be told from its directory."""
    import yaml

    trace = tmp_path / "t.csv"
    trace.write_text(TRACE)
    out = tmp_path / "runs"
    assert main(["simulate", str(TINY), "--churn", str(trace), "--steps", "1",
                 "--out", str(out)]) == 0
    [run_dir] = out.iterdir()
    resolved = yaml.safe_load((run_dir / "topology.yaml").read_text())
    assert resolved["churn"] == str(trace.resolve())


def test_an_interrupted_run_counts_the_step_under_way_as_the_ps_does(tmp_path: Path) -> None:
    """Its wall time and energy ran to the interrupt while its tiles and bytes stopped at the
    last finished step; now all of them count the step under way (PsCore.totals), and the
    finished steps are what steps.jsonl and steps_done say."""
    topology = load_topology(TINY).with_overrides(steps=5)

    def interrupt(step: int, device_s: float, tiles: int, *_: float) -> None:
        if step == 2 and tiles > 0:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        simulate(topology, tmp_path, noise=False, report=False, during=interrupt,
                 during_every_s=0.0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = read_jsonl(tmp_path / "steps.jsonl")
    assert summary["state"] == "interrupted" and summary["steps_done"] == len(steps) == 2
    assert summary["tiles"] > sum(s["tiles"] for s in steps)
    assert summary["bytes_down"] > sum(s["bytes_down"] for s in steps)
    assert summary["wall_s"] > sum(s["wall_s"] for s in steps)


def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("count: 3", "count: -3"))
    out = tmp_path / "runs"
    assert main(["simulate", str(bad), "--out", str(out)]) == 2
    trace = tmp_path / "t.csv"
    trace.write_text("time_s,device,event,arg\n1,nobody-7,leave,\n")
    assert main(["simulate", str(TINY), "--churn", str(trace), "--out", str(out)]) == 2
    assert main(["simulate", str(TINY), "--steps", "0", "--out", str(out)]) == 2
    # the file's own bound on job.steps holds for the flag too
    assert main(["simulate", str(TINY), "--steps", str(10**20), "--out", str(out)]) == 2
    assert not out.exists()


def test_ps_gemm_time_delays_every_offloaded_gemm(tmp_path: Path) -> None:
    topology = load_topology(TINY).with_overrides(steps=1)
    bare = Simulation(topology, noise=False)
    bare.start()
    bare_s, _, record = bare.run_step(0)
    per_gemm_s = 0.01
    slow = Simulation(topology, noise=False, ps_gemm_s=per_gemm_s)
    slow.start()
    slow_s, stats, slow_record = slow.run_step(0)
    # every GEMM waits for the PS, and a stage's first one with nothing else in flight
    stages = len(step_chain(topology.job))
    # the time some GEMM was out is in virtual seconds: all of a bare step, and none of the
    # PS's time before each submission
    assert record.gemm_wall_s == pytest.approx(bare_s, rel=1e-9)
    assert slow_record.gemm_wall_s <= slow_s - stages * per_gemm_s + 1e-9
    assert slow_record.gemm_wall_s >= bare_s * 0.5
    # ... and per stage of the chain (stages run one after another, so they add up)
    assert sum(spent for _, spent, _, _ in record.stages) == pytest.approx(bare_s, rel=1e-9)
    assert all(spent >= bound_s for _, spent, bound_s, _ in record.stages)
    assert slow_s >= stages * per_gemm_s
    assert slow_s >= bare_s + stages * per_gemm_s * 0.5
    assert slow_s <= bare_s + record.gemms * per_gemm_s + 1.0 * bare_s  # no more than that
    assert stats.tiles == sum(slow.tiles_per_gemm.values())
    with pytest.raises(ValueError, match="ps_gemm_s"):
        Simulation(topology, ps_gemm_s=-1.0)
    assert main(["simulate", str(TINY), "--ps-gemm-s", "-1", "--out",
                 str(tmp_path / "runs")]) == 2
    assert not (tmp_path / "runs").exists()


def test_a_straggler_computes_its_tiles_factor_times_slower_as_its_agent_would() -> None:
    """The topology's straggler behaviour: the simulator draws each tile's factor from the
    agent's own Behaviour (seeded as testbed up seeds the agent); it used to ignore it."""
    import yaml

    from testbed.topology import parse_topology

    def step(behaviour: dict | None) -> tuple[float, float]:
        raw = yaml.safe_load(TINY.read_text())
        for group in raw["devices"]:
            if behaviour is not None:
                group["behaviour"] = behaviour
        sim = Simulation(parse_topology(raw, str(TINY), TINY.parent).with_overrides(steps=1),
                         noise=False)
        sim.start()
        device_s, stats, _ = sim.run_step(0)
        return device_s, stats.device_compute_s

    honest_s, honest_compute = step(None)
    slow_s, slow_compute = step({"straggler": {"factor": 4, "rate": "100%"}})
    assert 3.5 * honest_compute <= slow_compute <= 4.5 * honest_compute
    assert slow_s > honest_s
    _, half_compute = step({"straggler": {"factor": 4, "rate": "50%"}})
    assert 1.6 * honest_compute <= half_compute <= 3.4 * honest_compute


@pytest.mark.slow
def test_a_thousand_devices_compute_every_planned_tile_once(tmp_path: Path) -> None:
    # 1,000 devices on a job whose GEMMs the planner deals to many of them (~2,500 tiles; ~20 s
    # on a loaded 2-core host); bench/simulate_scale.py times OPT-shaped jobs
    text = TINY.read_text().replace("count: 3", "count: 900").replace("count: 1", "count: 100")
    # a PS link that is not the bottleneck (on tiny's default 1 Gbit one, sending each operand
    # once to one or two devices is the fastest plan, and the planner rightly makes it) and
    # 512 tokens, so that a GEMM spread over hundreds of devices pays its tiles' fixed cost
    text = text.replace("network: {backend: loopback}",
                        "network: {backend: loopback, ps: {link: {down: 100Gbit, up: 100Gbit}}}")
    text = text.replace("tile: 16, ", "").replace(  # the planner cuts (owners, K splits)
        "hidden: 32, layers: 2, heads: 2, ffn: 64, seq_len: 16",
        "hidden: 128, layers: 1, heads: 2, ffn: 512, seq_len: 128")
    path = tmp_path / "big.yaml"
    path.write_text(text)
    topology = load_topology(path).with_overrides(steps=1)
    sim = Simulation(topology)
    planned: dict[str, int] = {}
    placed: Counter[str] = Counter()
    placed_by: set[str] = set()
    plan, place = sim.planner.plan, sim.scheduler._place

    def recording_plan(job, slots):  # type: ignore[no-untyped-def]
        cut = plan(job, slots)
        planned[job.uid] = len(cut_regions(job.b.shape[1], job.a.shape[1], cut.regions))
        return cut

    def counting_place(slot, copy, c, compute_s, energy_j):  # type: ignore[no-untyped-def]
        placed[copy.task.job.uid] += 1
        placed_by.add(slot.device_id)
        return place(slot, copy, c, compute_s, energy_j)
    sim.planner.plan = recording_plan  # type: ignore[method-assign]
    sim.scheduler._place = counting_place  # type: ignore[method-assign]
    sim.start()
    device_s, stats, record = sim.run_step(0)
    assert len(sim.by_id) == 1000
    chain = [g for group in step_chain(topology.job) for g in group]
    assert len(planned) == record.gemms == len(chain)
    assert dict(placed) == planned  # every planned tile accepted exactly once
    assert stats.tiles == sum(planned.values()) == sum(sim.tiles_per_gemm.values())
    assert not sim.scheduler.tasks and not sim.scheduler.pending
    assert device_s > 0 and stats.bytes_up > 0
    # the plan spreads the tiles over the devices (the layers planned on one grid,
    # planner.plan_layer, take fewer of them than planned apart, for a faster step)
    assert len(placed_by) > 300


def test_trace_tiles_records_every_accepted_tile_as_testbed_up_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`testbed simulate --trace-tiles`: one tiles.jsonl row per accepted tile, with the PS's
    fields in virtual seconds, in order on each tile's way; bench/stage_profile.py reads it."""
    run_root = tmp_path / "runs"
    assert main(["simulate", str(TINY), "--steps", "1", "--trace-tiles",
                 "--out", str(run_root)]) == 0
    run_dir = next(run_root.iterdir())
    step = read_jsonl(run_dir / "steps.jsonl")[0]
    rows = read_jsonl(run_dir / "tiles.jsonl")
    assert len(rows) == step["tiles"] > 0 and step["time_dilation"] == 1.0
    names = {d.name for d in load_topology(TINY).devices}
    for r in rows:
        assert r["device"] in names and r["step"] == 0 and r["bytes_up"] > 0
        times = [r["sent_s"], r["arrived_s"], r["started_s"], r["done_s"], r["accepted_s"]]
        assert times == sorted(times), r  # handed out, on the device, started, done, back
        # a simulated device computes for exactly its modelled time (no dilation, no lag); the
        # times are written to the microsecond, so two roundings of half a microsecond each
        assert abs(r["done_s"] - r["started_s"] - r["compute_s"]) <= 1.0e-6 + 1e-9
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import stage_profile

    capsys.readouterr()
    assert stage_profile.main(["--run", str(run_dir), "--tiles", "--gemm", "fc1/forward"]) == 0
    out = capsys.readouterr().out
    assert "layers.0.fc1/forward" in out and "layers.1.fc1/forward" in out
    assert "qkv_proj" not in out.split("(median/largest")[1]  # only the GEMMs asked for
    # one line per group that computed some of a GEMM's tiles, under each of the two GEMMs
    assert sum(line.split()[0] in ("phones", "laptops") for line in out.splitlines()
               if line.startswith("    ") and not line.strip().startswith("group")) >= 2
    assert stage_profile.main(["--run", str(run_dir), "--tiles", "--gemm", "nothing"]) == 2


@pytest.mark.parametrize("command", ["simulate", "up"])
def test_trace_tiles_is_refused_for_a_baseline_before_anything_is_written(
        tmp_path: Path, command: str) -> None:
    import yaml

    raw = yaml.safe_load(TINY.read_text())
    raw["job"]["parallelism"] = {"strategy": "data-parallel"}
    path = tmp_path / "dp.yaml"
    path.write_text(yaml.safe_dump(raw))
    run_root = tmp_path / "runs"
    assert main([command, str(path), "--trace-tiles", "--out", str(run_root)]) == 2
    assert not run_root.exists()


def test_a_long_step_reports_its_progress_while_it_runs() -> None:
    """`during` is called every `during_every_s` of wall time within a step (0: after every
    event) with the step's device seconds and totals so far, both only growing."""
    topology = load_topology(TINY).with_overrides(steps=2)
    seen: list[tuple[float, int]] = []
    sim = Simulation(topology, noise=False, during=lambda s, st: seen.append((s, st.tiles)),
                     during_every_s=0.0)
    sim.start()
    for step in range(2):
        seen.clear()
        device_s, stats, _ = sim.run_step(step)
        assert len(seen) > 10
        assert [s for s, _ in seen] == sorted(s for s, _ in seen)
        assert [t for _, t in seen] == sorted(t for _, t in seen)
        assert seen[0] == (0.0, 0) and 0 < seen[-1][0] <= device_s
        assert 0 < seen[-1][1] <= stats.tiles


def test_simulate_reports_its_planning_before_and_while_it_runs(tmp_path: Path) -> None:
    """`simulate` plans every linear before the first step, as the PS does, and says so once
    (`on_planned`: shapes, processes, wall and CPU seconds; the CLI prints it: a large
    topology's plans take most of its first step's wall time). `during` gets, with the step's
    totals so far, the planner's CPU seconds of this step so far: never negative and only
    growing within a step; with the planning before, no more than the run's `planner_cpu_s`."""
    topology = load_topology(TINY).with_overrides(steps=2)
    seen: list[tuple[int, float, float]] = []
    planned: list[tuple[int, int, float, float]] = []
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    summary = simulate(topology, run_dir, noise=False, report=False,
                       during=lambda step, _d, _t, wall, planning, *_gemms:
                       seen.append((step, wall, planning)),
                       during_every_s=0.0,
                       on_planning=lambda: planned.append(()),  # said before it plans
                       on_planned=lambda *args: planned.append(args))
    assert planned[0] == () and len(planned) == 2
    planned.pop(0)
    shapes, processes, wall_s, ahead_cpu_s = planned[0]
    assert shapes == len({(lin.d_out, lin.d_in) for lin in linears(topology.job)})
    assert processes >= 1 and wall_s > 0.0 and ahead_cpu_s > 0.0
    assert {step for step, _, _ in seen} == {0, 1}
    last = {}
    for step in (0, 1):
        planning = [p for st, _, p in seen if st == step]
        assert planning == sorted(planning) and planning[0] >= 0.0
        last[step] = planning[-1]
    assert ahead_cpu_s + last[0] + last[1] <= summary["planner_cpu_s"] + 1e-3
    events = read_jsonl(run_dir / "events.jsonl")
    event = next(e for e in events if e["event"] == "planned")
    assert event["shapes"] == shapes and event["processes"] == processes
    names = [e["event"] for e in events]  # as the PS: planned before training starts
    assert names.index("planned") < names.index("training_start")


def test_simulate_runs_without_torch(tmp_path: Path) -> None:
    """`testbed simulate` shares the PS's scheduler, planner, bound and configuration but none of
    its tensors: it must not pay torch's import (about 1.5 s, each run) for them."""
    code = ("import sys\n"
            "from testbed.cli import main\n"
            f"assert main(['simulate', {str(TINY)!r}, '--steps', '1', '--out', {str(tmp_path)!r}])"
            " == 0\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
            "assert not heavy, heavy[:5]\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_a_tile_is_costed_as_it_starts_with_the_slow_factor_then(tmp_path: Path) -> None:
    """A churn ``slow`` reaches a tile already on the device and waiting behind another, as
    the agent reads its slow factor when it starts a tile: the same tile, started at the same
    moment in both runs, takes four times as long with ``slow 4`` applied while it waited
    (default.yaml: tiny.yaml's laptop never has a tile waiting)."""
    topology = load_topology(TINY.parents[2] / "topologies" / "default.yaml").with_overrides(
        steps=1)

    def laptop_tiles(trace: str | None) -> dict[tuple[str, int, int], dict]:
        schedule = None
        if trace is not None:
            path = tmp_path / "slow.csv"
            path.write_text("time_s,device,event,arg\n" + trace)
            schedule = load_schedule(path, topology)
        tiles: dict[tuple[str, int, int], dict] = {}
        sim = Simulation(topology, schedule, noise=False,
                         tile=lambda **t: tiles.setdefault((t["gemm"], t["task"], t["attempt"]),
                                                           t))
        sim.start()
        sim.run_step(0)
        return {k: t for k, t in tiles.items() if t["device"] == "laptops-0"}

    plain = laptop_tiles(None)
    waited = sorted((t for t in plain.values() if t["started_s"] - t["arrived_s"] > 1e-4),
                    key=lambda t: t["started_s"])
    assert waited, "no tile of laptops-0 waited behind another"
    tile = waited[len(waited) // 2]
    at_s = tile["started_s"] - 1e-6  # while the tile before it runs (no other is slowed)
    slowed = laptop_tiles(f"{at_s!r},laptops-0,slow,4\n")
    key = (tile["gemm"], tile["task"], tile["attempt"])
    assert slowed[key]["started_s"] == pytest.approx(tile["started_s"], rel=1e-9)
    assert slowed[key]["compute_s"] == pytest.approx(4 * tile["compute_s"], rel=1e-6)
