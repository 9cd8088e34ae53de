"""Data parallelism on Mininet under churn and as DiLoCo rounds (also under churn): the
replicas' and the PS's real processes give the in-process engine's float64 losses, with the
replicas dropped and taken back by the rule the engine follows (membership.py).

Needs root and the Mininet backend (skips naming what is missing).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from testbed.baselines import cost
from testbed.baselines.emulate import emulate_data_parallel
from testbed.baselines.engine import DataParallelTrainer
from testbed.emulator.network.probe import probe
from testbed.ps_backend.engine.data import load_corpus
from testbed.topology import load_topology

pytestmark = pytest.mark.integration

_missing = probe().missing()
needs_mininet = pytest.mark.skipif(bool(_missing), reason="Mininet backend unavailable, missing: "
                                                          + "; ".join(_missing))
REPLICAS = ["phones-0", "phones-1", "phones-2"]
OVERHEAD = 1.07  # Ethernet + IP + TCP per full packet (as test_baselines_mininet.py)
SLACK_BYTES = 64 * 1024


def write_topology(tmp_path: Path, steps: int, local_steps: int = 1,
                   link: dict[str, str] | None = None) -> Path:
    raw = {"name": "dp", "seed": 3,
           "network": {"backend": "mininet", "switches": ["ap0"],
                       "ps": {"switch": "ap0", "link": {"down": "1Gbit", "up": "1Gbit"}}},
           "devices": [{"group": "phones", "profile": "snapdragon888", "count": 3,
                        "switch": "ap0",
                        "link": link or {"down": "100Mbit", "up": "50Mbit", "delay": "2ms"}}],
           "job": {"model": {"hidden": 64, "layers": 2, "heads": 2, "ffn": 128, "seq_len": 32},
                   "batch_size": 6, "steps": steps, "dtype": "float64",
                   "optimizer": {"lr": 1e-3},
                   "parallelism": {"strategy": "data-parallel", "local_steps": local_steps}}}
    path = tmp_path / "dp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-8 * max(1.0, abs(w)), (got, want)


@needs_mininet
@pytest.mark.slow
def test_a_departed_replica_is_dropped_and_rejoins_with_the_engines_losses(
        tmp_path: Path) -> None:
    from testbed.churn import load_schedule

    steps = 6
    # a gradient (P·8 = 684 kB) takes 0.55 s up a 10 Mbit/s link, so the crash at 0.3 s lands
    # before replica 1 has delivered step 0's; the run (about 0.8 s a step, the trace's clock
    # starting with step 0) outlasts the join at 1.5 s by a few steps
    path = write_topology(tmp_path, steps, link={"down": "20Mbit", "up": "10Mbit",
                                                 "delay": "2ms"})
    trace = tmp_path / "churn.csv"
    trace.write_text("time_s,device,event,arg\n0.3,phones-1,crash,\n1.5,phones-1,join,\n")
    topo = load_topology(path)
    res = emulate_data_parallel(path, tmp_path / "run", replicas=REPLICAS,
                                schedule=load_schedule(trace, topo), timeout_s=240)
    took = res["took_part"]
    assert [c["event"] for c in res["churn"]] == ["crash", "join"]
    assert any(1 not in t for t in took), took  # replica 1 was dropped for some steps ...
    assert 1 in took[-1], took  # ... and back before the end
    assert all(0 in t and 2 in t for t in took)
    assert res["dropped_replica_steps"] == sum(3 - len(t) for t in took) > 0
    # the engine with the same replicas dropped for the same steps: the same losses
    torch.set_num_threads(1)
    dp = DataParallelTrainer(topo.job, seed=3, replicas=3, corpus=load_corpus(topo.job.data))
    want = [dp.step(present=[r in t for r in range(3)]).loss for t in took]
    close(res["losses"], want)
    # the rejoined replica first received the parameters and both AdamW moments
    back_at = next(i for i in range(1, steps) if 1 in took[i] and 1 not in took[i - 1])
    joined = res["reports"]["replica1-1"]
    assert joined["first_step"] == back_at
    p_bytes = cost.model_params(topo.job.model) * 8
    assert res["reports"]["ps"]["state_bytes"] == 3 * p_bytes
    assert joined["received_bytes"] == 3 * p_bytes + (steps - back_at) * p_bytes
    # the crashed process is charged what ran up to the kill (its report has no step: it was
    # killed inside step 0), and its standby went on from it (its ledger: draws and heat)
    from testbed.baselines.charge import ledger_path, read_ledger

    run = tmp_path / "run"
    crashed = next(w for w in res["work"] if w["process"] == "replica1")
    assert crashed["device_s"] > 0
    ledger = ledger_path(run / "replica1.json")
    assert json.loads((run / "replica1-1.go").read_text()) == [str(ledger)]
    assert read_ledger(ledger)


@needs_mininet
@pytest.mark.slow
def test_diloco_rounds_on_mininet_give_the_engines_losses(tmp_path: Path) -> None:
    steps, H = 4, 2
    path = write_topology(tmp_path, steps, local_steps=H)
    topo = load_topology(path)
    res = emulate_data_parallel(path, tmp_path / "run", replicas=REPLICAS, timeout_s=240)
    torch.set_num_threads(1)
    dp = DataParallelTrainer(topo.job, seed=3, replicas=3, local_steps=H,
                             corpus=load_corpus(topo.job.data))
    close(res["losses"], [s.loss for s in dp.run(steps)])
    assert res["took_part"] == [[0, 1, 2]] * steps
    p_bytes = cost.model_params(topo.job.model) * 8
    for r, d in enumerate(REPLICAS):
        rep = res["reports"][f"replica{r}"]
        # its loss every step, its parameters once a round; θ_global back once a round
        assert rep["sent_bytes"] == steps * 8 + (steps // H) * p_bytes
        assert rep["received_bytes"] == (steps // H) * p_bytes
        link = res["links"][d]
        assert rep["sent_bytes"] <= link["tx_bytes"] <= rep["sent_bytes"] * OVERHEAD \
            + SLACK_BYTES, (d, link)
        assert rep["received_bytes"] <= link["rx_bytes"] <= rep["received_bytes"] * OVERHEAD \
            + SLACK_BYTES, (d, link)


@needs_mininet
@pytest.mark.slow
def test_diloco_under_churn_drops_a_replica_for_its_round_and_takes_it_back_at_a_round_start(
        tmp_path: Path) -> None:
    from testbed.churn import load_schedule

    steps, H = 8, 2
    # slow links: a round's parameters take about 0.5 s each way, so the churn lands inside
    path = write_topology(tmp_path, steps, local_steps=H,
                          link={"down": "10Mbit", "up": "5Mbit", "delay": "2ms"})
    trace = tmp_path / "churn.csv"
    trace.write_text("time_s,device,event,arg\n0.3,phones-2,crash,\n1.2,phones-2,join,\n")
    topo = load_topology(path)
    res = emulate_data_parallel(path, tmp_path / "run", replicas=REPLICAS,
                                schedule=load_schedule(trace, topo), timeout_s=240)
    took = res["took_part"]
    assert [c["event"] for c in res["churn"]] == ["crash", "join"]
    assert any(2 not in t for t in took) and 2 in took[-1], took
    back_at = next(i for i in range(1, steps) if 2 in took[i] and 2 not in took[i - 1])
    assert back_at % H == 0, took  # taken back only at a round's start
    # the engine with the same replicas present: the same losses (its rejoin: θ_global and a
    # fresh inner AdamW, as the killed process's state is gone)
    torch.set_num_threads(1)
    dp = DataParallelTrainer(topo.job, seed=3, replicas=3, local_steps=H,
                             corpus=load_corpus(topo.job.data))
    close(res["losses"], [dp.step(present=[r in t for r in range(3)]).loss for t in took])
    p_bytes = cost.model_params(topo.job.model) * 8
    joined = res["reports"]["replica2-1"]
    assert joined["first_step"] == back_at
    # θ_global on joining, then θ_global after each of its rounds
    assert joined["received_bytes"] == p_bytes + ((steps - back_at) // H) * p_bytes


@needs_mininet
@pytest.mark.slow
def test_compare_replays_churn_on_emulated_data_parallel(tmp_path: Path) -> None:
    """`testbed compare --churn` on Mininet: the replica's crash and rejoin counted as dropped
    replica-steps, the losses the engine's with the same replicas present."""
    import json

    from testbed.cli import main

    steps = 6
    path = write_topology(tmp_path, steps, link={"down": "20Mbit", "up": "10Mbit",
                                                 "delay": "2ms"})
    trace = tmp_path / "churn.csv"
    # the crash lands inside step 0 (a gradient takes 0.55 s up a 10 Mbit/s link)
    trace.write_text("time_s,device,event,arg\n0.2,phones-0,crash,\n1.0,phones-0,join,\n")
    out = tmp_path / "out"
    assert main(["compare", str(path), "--churn", str(trace), "--strategies", "data-parallel",
                 "--out", str(out), "--no-report"]) == 0
    (cmp_dir,) = out.iterdir()
    data = json.loads((cmp_dir / "comparison.json").read_text())
    row = next(r for r in data["rows"] if r["strategy"] == "data-parallel")
    res = json.loads((cmp_dir / "data-parallel" / "data_parallel_emulated.json").read_text())
    took = res["took_part"]
    dropped = sum(3 - len(t) for t in took)
    assert [c["event"] for c in res["churn"]] == ["crash", "join"]
    gone = res["replicas"].index("phones-0")
    assert dropped > 0 and gone in took[-1], took
    # a dropped replica's rows of the batch went untrained: the row says how many
    trained = sum(end - start for t in took for start, end in (res["rows"][i] for i in t))
    asked = row["sequences_asked"]
    assert row["sequences_trained"] == trained < asked
    assert row["state"] == "done" and row["lost_work"] == \
        f"{dropped} replica-steps dropped ({asked - trained} of {asked} sequences untrained)"
    assert row["churn_events"] == 2 and row["churn_events_total"] == 2
    assert data["inputs"]["churn"] == str(trace.resolve())
    topo = load_topology(path)
    torch.set_num_threads(1)
    dp = DataParallelTrainer(topo.job, seed=3, replicas=3, corpus=load_corpus(topo.job.data))
    want = [dp.step(present=[r in t for r in range(3)]).loss for t in took]
    close(res["losses"], want)
    close(row["losses"], want)


@needs_mininet
@pytest.mark.slow
def test_testbed_up_runs_a_pipeline_topology_on_mininet(tmp_path: Path) -> None:
    """`job.parallelism.strategy: pipeline` through `testbed up`: exit 0, a run directory
    whose summary carries the single-process run's float64 losses."""
    import json

    from testbed.cli import main
    from testbed.ps_backend.engine.trainer import Trainer

    steps = 2
    path = write_topology(tmp_path, steps)
    raw = yaml.safe_load(path.read_text())
    raw["job"]["parallelism"] = {"strategy": "pipeline", "micro_batches": 2}
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "runs"
    assert main(["up", str(path), "--out", str(out), "--no-live"]) == 0
    (run_dir,) = out.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == "pipeline" and summary["state"] == "done"
    assert summary["steps_done"] == steps and summary["up_bytes_per_device_step"] >= 0
    # what ran, readable from the run directory alone (it named the file as typed)
    assert summary["topology"] == str(path.resolve())
    again = load_topology(run_dir / "topology.input.yaml")
    assert again.job.parallelism.strategy == "pipeline"
    assert [d.name for d in again.devices] == [d.name for d in load_topology(path).devices]
    topo = load_topology(path)
    torch.set_num_threads(1)
    want = [r.loss for r in Trainer(topo.job, seed=3,
                                    corpus=load_corpus(topo.job.data)).run(steps)]
    close(summary["losses"], want)


@needs_mininet
@pytest.mark.slow
def test_a_slow_replica_holds_its_pieces_factor_times_longer_from_its_time(
        tmp_path: Path) -> None:
    """phones-1 slowed x4 at trace 0.3 s: replica 1's forward-and-backward pieces begun after
    the slow's time (its control file's) take 4 times the device seconds of those before (its
    ledger, as re-timed), the other replicas' do not change, and the losses are the engine's
    (a slow changes time, not arithmetic)."""
    import statistics

    from testbed.baselines.charge import ledger_path, read_ledger
    from testbed.churn import load_schedule

    steps = 8
    path = write_topology(tmp_path, steps)
    trace = tmp_path / "slow.csv"
    trace.write_text("time_s,device,event,arg\n0.3,phones-1,slow,4\n")
    topo = load_topology(path)
    res = emulate_data_parallel(path, tmp_path / "run", replicas=REPLICAS,
                                schedule=load_schedule(trace, topo), timeout_s=240)
    run = tmp_path / "run"
    assert [(c["event"], c["replica"], c["factor"]) for c in res["churn"]] == [("slow", 1, 4.0)]
    at_s = json.loads((run / "devices" / "phones-1.slow").read_text())["at_s"]

    def pieces(r: int) -> tuple[list[float], list[float]]:
        """Device seconds of replica r's forward-and-backward pieces that ended before at_s,
        and of those begun after it."""
        whole: dict[float, dict[str, float]] = {}
        for p in read_ledger(ledger_path(run / f"replica{r}.json")):
            if p.get("retimed"):
                whole[p["t0"]]["s"] = p["parts"][-1][1]
            elif p["gemms"]:
                whole[p["t0"]] = {"s": p["parts"][-1][1], "D": p["dilation"]}
        before = [w["s"] for t, w in whole.items() if t + w["s"] * w["D"] < at_s]
        after = [w["s"] for t, w in whole.items() if t > at_s]
        return before, after

    before, after = pieces(1)
    assert before and len(after) >= 2, (before, after)
    ratio = statistics.median(after) / statistics.median(before)
    assert abs(ratio - 4.0) <= 0.1 * 4.0, ratio  # the device model's noise: a few per cent
    for r in (0, 2):
        b, a = pieces(r)
        assert abs(statistics.median(a) / statistics.median(b) - 1.0) <= 0.1
    # the run's time is training's, from its start to the PS's end: it had the processes'
    # start-up and ends in it too (5.1 s against 1.6 s of steps here; now 2.4)
    steps_wall = sum(res["reports"]["ps"]["step_s"])
    assert steps_wall <= res["wall_s"] <= steps_wall + 2.0, (res["wall_s"], steps_wall)
    torch.set_num_threads(1)
    want = [r.loss for r in DataParallelTrainer(topo.job, seed=3, replicas=3,
                                                corpus=load_corpus(topo.job.data)).run(steps)]
    close(res["losses"], want)


@needs_mininet
@pytest.mark.slow
def test_a_cut_off_replica_is_dropped_at_its_lease_and_a_short_cut_drops_nothing(
        tmp_path: Path) -> None:
    """The rule of docs/churn.md on Mininet: phones-1 cut off 1-3 s (shorter than the lease:
    the PS waits for it, it takes part in every step), phones-2 cut off at 3.5 s and crashed
    at 4 s: the PS hears of it at its lease, 8.5 s (its process was killed at the partition
    itself before, and the PS saw the broken connection then); the losses are the engine's
    with those replicas present."""
    from testbed.churn import load_schedule

    raw = yaml.safe_load((Path(__file__).parents[1] / "data" / "slow.yaml").read_text())
    raw["job"]["parallelism"] = {"strategy": "data-parallel"}
    path = tmp_path / "cut.yaml"
    path.write_text(yaml.safe_dump(raw))
    trace = tmp_path / "cut.csv"
    trace.write_text("time_s,device,event,arg\n1,phones-1,partition,\n3,phones-1,heal,\n"
                     "3.5,phones-2,partition,\n4,phones-2,crash,\n")
    topo = load_topology(path)
    steps = 36
    res = emulate_data_parallel(path, tmp_path / "run", steps=steps, replicas=REPLICAS,
                                dilation=1.0, schedule=load_schedule(trace, topo),
                                timeout_s=300)
    churn = [(c["event"], c["replica"]) for c in res["churn"]]
    assert churn == [("crash", 2), ("lease_expired", 2)]
    assert abs(res["churn"][1]["time_s"] - 8.5) <= 0.5  # on this host's clock, D = 1
    took = res["took_part"]
    assert all(1 in t for t in took), took  # the short cut lost nothing
    out = [i for i, t in enumerate(took) if 2 not in t]
    assert out and out == list(range(out[0], steps)), took  # out from its cut on
    torch.set_num_threads(1)
    dp = DataParallelTrainer(topo.job, seed=3, replicas=3, corpus=load_corpus(topo.job.data))
    close(res["losses"], [dp.step(present=[r in t for r in range(3)]).loss for t in took])


@needs_mininet
def test_the_first_step_gathers_the_replicas_gradients_at_once(tmp_path: Path) -> None:
    """The PS reads the replicas' gradients in replica order; with the kernel's first receive
    window the others' uploads waited, one after another, until the windows had grown, so the
    first step was several times the others (the default topology: 2.58 device s against
    0.65; the simulator 0.76 and 0.66). Three replicas on 10 Mbit/s uplinks, about 0.6 s a
    gradient: step 0 took about three of them. It now takes what the later steps take."""
    path = write_topology(tmp_path, 3, link={"down": "100Mbit", "up": "10Mbit"})
    res = emulate_data_parallel(path, tmp_path / "run", replicas=REPLICAS, timeout_s=240)
    step_s = res["reports"]["ps"]["step_s"]
    assert len(step_s) == 3
    assert step_s[0] <= 1.3 * max(step_s[1:]), step_s
