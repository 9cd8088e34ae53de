"""A pipeline on Mininet: stage processes on the stage hosts, bytes measured on their links.

Needs root and the Mininet backend (skips naming what is missing).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch
import yaml

from testbed.baselines.emulate import emulate_pipeline
from testbed.baselines.engine import PipelineTrainer
from testbed.emulator.network.probe import probe
from testbed.ps_backend.engine.data import load_corpus
from testbed.ps_backend.engine.trainer import Trainer
from testbed.topology import load_topology

pytestmark = pytest.mark.integration

_missing = probe().missing()
needs_mininet = pytest.mark.skipif(bool(_missing), reason="Mininet backend unavailable, missing: "
                                                          + "; ".join(_missing))
BOUNDS = [(0, 1), (1, 3), (3, 4)]
STEPS = 2
# per packet of at most 1448 payload bytes, Ethernet + IP + TCP with timestamps add 66 bytes
# (4.6%); pure ACKs, the hellos, the handshake and IPv6 neighbour discovery add a few kB
OVERHEAD = 1.07
SLACK_BYTES = 64 * 1024


def write_topology(tmp_path: Path) -> Path:
    raw = {"name": "pipe", "seed": 3,
           "network": {"backend": "mininet", "switches": ["ap0"],
                       "ps": {"switch": "ap0", "link": {"down": "1Gbit", "up": "1Gbit"}}},
           "devices": [{"group": "phones", "profile": "snapdragon888", "count": 4,
                        "switch": "ap0", "link": {"down": "100Mbit", "up": "50Mbit",
                                                  "delay": "2ms"}}],
           "job": {"model": {"hidden": 64, "layers": 4, "heads": 2, "ffn": 128, "seq_len": 64},
                   "batch_size": 8, "steps": STEPS, "dtype": "float64",
                   "optimizer": {"lr": 1e-3},
                   "parallelism": {"strategy": "pipeline", "micro_batches": 4}}}
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@needs_mininet
@pytest.mark.slow
def test_pipeline_on_mininet_moves_its_activations_over_the_stage_links(tmp_path: Path) -> None:
    path = write_topology(tmp_path)
    devices = ["phones-1", "phones-2", "phones-3"]  # phones-0 stays idle: its link is quiet
    res = emulate_pipeline(path, tmp_path / "run", devices=devices, bounds=BOUNDS,
                           timeout_s=300)
    topo = load_topology(path)
    torch.set_num_threads(1)
    corpus = load_corpus(topo.job.data)
    # the real arithmetic: the last stage's losses are the single-process run's
    want = [r.loss for r in Trainer(topo.job, seed=3, corpus=corpus).run(STEPS)]
    assert len(res["losses"]) == STEPS
    for got, w in zip(res["losses"], want):
        assert abs(got - w) <= 1e-8 * max(1.0, abs(w))
    # the payload each stage sent is what the in-process pipeline sends, boundary by boundary
    pipe = PipelineTrainer(topo.job, seed=3, bounds=BOUNDS, micro_batches=4, corpus=corpus)
    engine: dict[str, int] = {}
    for _ in range(STEPS):
        for k, v in pipe.step().bytes_sent.items():
            engine[k] = engine.get(k, 0) + v
    sent: dict[str, int] = {}
    for st in res["stages"]:
        sent.update(st["sent_bytes"])
    assert sent == engine
    # and those bytes crossed the stage hosts' own links (kernel counters of each host's e0)
    for s, d in enumerate(devices):
        payload_out = sum(v for k, v in sent.items() if k.startswith(f"stage{s}->"))
        payload_in = sum(v for k, v in sent.items() if k.endswith(f"->stage{s}"))
        link = res["links"][d]
        assert payload_out <= link["tx_bytes"] <= payload_out * OVERHEAD + SLACK_BYTES, (d, link)
        assert payload_in <= link["rx_bytes"] <= payload_in * OVERHEAD + SLACK_BYTES, (d, link)
    assert res["network"]["backend"] == "mininet"


@needs_mininet
@pytest.mark.slow
def test_data_parallel_on_mininet_averages_through_the_ps_over_real_links(
        tmp_path: Path) -> None:
    from testbed.baselines import cost
    from testbed.baselines.emulate import emulate_data_parallel

    path = write_topology(tmp_path)
    replicas = ["phones-0", "phones-1", "phones-2"]
    res = emulate_data_parallel(path, tmp_path / "run", replicas=replicas, timeout_s=300)
    topo = load_topology(path)
    torch.set_num_threads(1)
    want = [r.loss for r in Trainer(topo.job, seed=3, corpus=load_corpus(topo.job.data))
            .run(STEPS)]
    assert len(res["losses"]) == STEPS
    for got, w in zip(res["losses"], want):
        assert abs(got - w) <= 1e-8 * max(1.0, abs(w))
    grad_bytes = cost.model_params(topo.job.model) * 8  # float64
    for r, d in enumerate(replicas):
        sent = res["reports"][f"replica{r}"]["sent_bytes"]
        assert sent == STEPS * (grad_bytes + 8)  # its gradient and its loss, every step
        link = res["links"][d]
        assert sent <= link["tx_bytes"] <= sent * OVERHEAD + SLACK_BYTES, (d, link)
        back = STEPS * grad_bytes  # the summed gradient
        assert back <= link["rx_bytes"] <= back * OVERHEAD + SLACK_BYTES, (d, link)
    ps = res["links"]["ps"]
    assert 3 * STEPS * grad_bytes <= ps["rx_bytes"] <= 3 * STEPS * (grad_bytes + 8) * OVERHEAD \
        + SLACK_BYTES
    assert res["links"].get("phones-3") is None  # not a replica: not watched


@needs_mininet
@pytest.mark.slow
def test_compare_on_mininet_runs_every_strategy_with_the_same_losses(tmp_path: Path) -> None:
    import csv
    import json

    from testbed.cli import main

    path = write_topology(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["job"]["model"]["seq_len"] = 32
    raw["job"]["parallelism"] = {"tile": 32, "micro_batches": 4}
    raw["time_dilation"] = 2
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    assert main(["compare", str(path), "--out", str(out)]) == 0
    (cmp_dir,) = out.iterdir()
    rows = {r["strategy"]: r for r in csv.DictReader((cmp_dir / "comparison.csv").open())}
    assert all(rows[s]["state"] == "done" for s in ("tile-tp", "pipeline", "data-parallel"))
    data = json.loads((cmp_dir / "comparison.json").read_text())
    assert data["inputs"]["mode"].startswith("emulated on Mininet")
    # float64: three executors on real processes, one set of losses
    losses = {r["strategy"]: r["losses"] for r in data["rows"] if r.get("losses")}
    assert set(losses) == {"tile-tp", "pipeline", "data-parallel"}
    for got in losses.values():
        assert got == pytest.approx(losses["tile-tp"], rel=1e-6), losses
    assert "agree within 1e-6" in (cmp_dir / "comparison.md").read_text()
    assert float(rows["data-parallel"]["up_bytes_per_device_step"]) > 0


@needs_mininet
@pytest.mark.slow
def test_a_failing_stage_ends_the_run_at_once_and_says_where(tmp_path: Path) -> None:
    import time

    path = write_topology(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"stage\d exited 1 \(see .*stage\d\.log\)"):
        # 16 micro-batches of a batch of 8: every stage refuses to start
        emulate_pipeline(path, tmp_path / "run", devices=["phones-1", "phones-2"],
                         bounds=[(0, 2), (2, 4)], micro_batches=16, timeout_s=300)
    assert time.monotonic() - t0 < 120  # not the 300 s deadline
    assert "cannot cut 8 rows into 16" in (tmp_path / "run" / "stage0.log").read_text()


@needs_mininet
@pytest.mark.slow
def test_a_lost_stage_restarts_from_its_checkpoint_with_the_same_losses(tmp_path: Path) -> None:
    from testbed.churn import load_schedule

    path = write_topology(tmp_path)
    raw = yaml.safe_load(path.read_text())
    # slow links (about 1 s a step at D = 2) so that the crash lands inside the run
    raw["devices"][0]["link"] = {"down": "10Mbit", "up": "5Mbit", "delay": "2ms"}
    raw["job"]["steps"] = 8
    raw["job"]["parallelism"]["checkpoint_every"] = 2
    path.write_text(yaml.safe_dump(raw))
    trace = tmp_path / "crash.csv"
    trace.write_text("time_s,device,event,arg\n3.5,phones-2,crash,\n")
    topo = load_topology(path)
    res = emulate_pipeline(path, tmp_path / "run", devices=["phones-1", "phones-2"],
                           bounds=[(0, 2), (2, 4)], dilation=2.0,
                           schedule=load_schedule(trace, topo), timeout_s=300)
    assert res["restarts"] == 1 and "phones-2" not in res["devices"]
    assert res["churn_events"] == 1  # the trace's one event came while it ran (compare's column)
    redo = [e for e in res["executed"] if e["redo"]]
    # the steps finished since the checkpoint ran again; the aborted one counts too
    assert res["steps_redone"] == len(redo) + 1
    assert len(res["executed"]) == 8 + len(redo)
    torch.set_num_threads(1)
    want = [r.loss for r in Trainer(topo.job, seed=3, corpus=load_corpus(topo.job.data))
            .run(8)]
    assert len(res["losses"]) == 8  # resumed from the checkpoint on another placement ...
    for got, w in zip(res["losses"], want):  # ... and still the single-process run
        assert abs(got - w) <= 1e-8 * max(1.0, abs(w))
    for e in redo:  # a redone step computes the same loss again
        first = next(x for x in res["executed"] if x["step"] == e["step"])
        assert abs(first["loss"] - e["loss"]) <= 1e-12 * max(1.0, abs(e["loss"]))
    # the killed attempt's stages are charged what ran up to the kill (their ledgers), at
    # least the whole steps their last reports had; the restart goes on from phones-1's
    # earlier process (its ledger: its draws and its heat)
    from testbed.baselines.charge import ledger_path, read_ledger

    run = tmp_path / "run"
    killed = [w for w in res["work"] if w["attempt"] == 0]
    assert sorted(w["device"] for w in killed) == ["phones-1", "phones-2"]
    for w in killed:
        last_report = json.loads((run / f"stage{w['stage']}-attempt0.json").read_text())
        assert w["device_s"] >= last_report["device_s"] * (1 - 1e-9)
    plan0 = json.loads((run / "pipeline_plan0.json").read_text())
    plan1 = json.loads((run / "pipeline_plan1.json").read_text())
    for d, history in zip(plan1["devices"], plan1["history"]):  # none on a fresh device
        before = [str(ledger_path(run / f"stage{s}-attempt0.json"))
                  for s, e in enumerate(plan0["devices"]) if e == d]
        assert history == before
        assert all(read_ledger(Path(p)) for p in history)


@needs_mininet
@pytest.mark.slow
def test_sighup_stops_a_pipeline_run_with_its_summary_and_leaves_nothing(
        tmp_path: Path) -> None:
    """`testbed up` of a pipeline, its terminal closed (SIGHUP) while the stages train: exit
    130, summary.json says interrupted, and no stage process, namespace or interface of the
    run is left (the run's network is told apart by the interfaces that came up with it)."""
    import json
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from testbed.run_lock import holder
    from tests.integration.test_mininet_run import cmdline_has, root_links

    path = write_topology(tmp_path)
    out = tmp_path / "out"
    before = root_links()
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", "up", str(path), "--steps",
                             "10000", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # every stage of the placement has connected: training runs
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no pipeline training within 120 s"
            plans = list(out.glob("*/pipeline/pipeline_plan0.json"))
            if plans and len(list(plans[0].parent.joinpath("ready0").iterdir())) == len(
                    json.loads(plans[0].read_text())["devices"]):
                break
            time.sleep(0.1)
        run_dir = plans[0].parents[1]
        assert holder(run_dir) is not None  # locked as a tile-tp run's directory is
        ours = root_links() - before
        stages = [p for p in psutil.pids() if cmdline_has(p, "testbed.baselines.stage_proc")
                  and cmdline_has(p, str(run_dir))]
        assert ours and stages
        proc.send_signal(signal.SIGHUP)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output[-3000:]
    assert holder(run_dir) is None
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "interrupted" and summary["exit_code"] == 130
    assert not [p for p in stages if psutil.pid_exists(p)
                and cmdline_has(p, "testbed.baselines.stage_proc")], "a stage is left"
    assert not ours & root_links(), "an interface of the run is left"


@needs_mininet
@pytest.mark.slow
def test_a_slow_stretches_a_stages_holds_from_its_time_and_its_restart_starts_with_it(
        tmp_path: Path) -> None:
    """Every phone slowed x4 at trace 0.5 s, then the one stage's phone crashes at 1.5 s: the
    stage's pieces begun after the slow's time take 4 times the device seconds of those before
    (its ledger), its steps hold about 4 times as long, and the stage restarted on another
    phone starts slowed (its control file, written before its process existed)."""
    from testbed.baselines.charge import ledger_path, read_ledger
    from testbed.baselines.emulate import ChurnApplied, Progress
    from testbed.churn import load_schedule

    raw = yaml.safe_load((Path(__file__).parents[1] / "data" / "slow.yaml").read_text())
    raw["job"]["parallelism"]["checkpoint_every"] = 2  # the restart redoes a step or two
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(raw))
    topo = load_topology(path)
    trace = tmp_path / "slow-crash.csv"
    trace.write_text("time_s,device,event,arg\n0.5,phones,slow,4\n1.5,phones-0,crash,\n")
    seen: list[Progress] = []
    D = 2.0
    res = emulate_pipeline(path, tmp_path / "run", steps=24, devices=["phones-0"],
                           bounds=[(0, 4)], dilation=D, schedule=load_schedule(trace, topo),
                           timeout_s=120, progress=seen.append)
    run = tmp_path / "run"
    assert res["restarts"] == 1 and res["devices"] != ["phones-0"]
    slows = [p for p in seen if isinstance(p, ChurnApplied) and p.event == "slow"]
    assert [p.device for p in slows] == ["phones-0", "phones-1", "phones-2"]
    assert "stage 0 computes x4" in slows[0].effect
    at_s = json.loads((run / "devices" / "phones-0.slow").read_text())["at_s"]

    def steps(attempt: int) -> list[tuple[float, float, float]]:
        """(start, end on the host's clock, device seconds) of each step: 9 pieces a step
        (4 forwards, 4 backwards, AdamW), as re-timed."""
        pieces = read_ledger(ledger_path(run / f"stage0-attempt{attempt}.json"))
        whole: dict[float, list[list[float]]] = {}
        for p in pieces:
            whole[p["t0"]] = p["parts"]  # a re-timed line replaces its piece's parts
        t0s = sorted(whole)
        out = []
        for i in range(0, len(t0s) - 8, 9):
            group = t0s[i:i + 9]
            device_s = sum(whole[t][-1][1] for t in group)
            out.append((group[0], group[-1] + whole[group[-1]][-1][1] * D, device_s))
        return out

    first = steps(0)
    before = [s for a, e, s in first if e < at_s]
    after = [s for a, e, s in first if a > at_s]
    assert len(before) >= 3 and len(after) >= 2, (len(before), len(after))
    ratio = statistics.median(after) / statistics.median(before)
    assert abs(ratio - 4.0) <= 0.1 * 4.0, ratio  # the device model's noise: a few per cent
    restarted = [s for _, _, s in steps(1)]
    assert len(restarted) >= 2
    assert abs(statistics.median(restarted) / statistics.median(before) - 4.0) <= 0.4
    # the holds really were longer: each stage's wall seconds per step (its report)
    wall0 = json.loads((run / "stage0-attempt0.json").read_text())["step_s"]
    wall1 = json.loads((run / "stage0-attempt1.json").read_text())["step_s"]
    assert statistics.median(wall1) >= 3.0 * statistics.median(wall0[:len(before)])


@needs_mininet
@pytest.mark.slow
def test_a_cut_off_stage_is_lost_at_its_lease_and_a_short_cut_loses_nothing(
        tmp_path: Path) -> None:
    """The rule of docs/churn.md on Mininet: phones-1 (stage 1 of 2) cut off 1-3 s (shorter
    than the lease: the pipeline stalls and goes on, no restart), then cut off at 5 s and
    crashed at 5.5 s: the runner hears it at its lease, 10 s, not at the crash (and it
    killed the stage at the partition itself before)."""
    from testbed.baselines.emulate import ChurnApplied, Connected, Progress
    from testbed.churn import load_schedule

    raw = yaml.safe_load((Path(__file__).parents[1] / "data" / "slow.yaml").read_text())
    raw["job"]["parallelism"]["checkpoint_every"] = 10
    path = tmp_path / "cut.yaml"
    path.write_text(yaml.safe_dump(raw))
    trace = tmp_path / "cut.csv"
    trace.write_text("time_s,device,event,arg\n1,phones-1,partition,\n3,phones-1,heal,\n"
                     "5,phones-1,partition,\n5.5,phones-1,crash,\n")
    seen: list[tuple[float, Progress]] = []
    res = emulate_pipeline(path, tmp_path / "run", steps=150, devices=["phones-0", "phones-1"],
                           bounds=[(0, 2), (2, 4)], dilation=1.0,
                           schedule=load_schedule(trace, load_topology(path)), timeout_s=300,
                           progress=lambda p: seen.append((time.monotonic(), p)))
    assert res["restarts"] == 1 and res["devices"] == ["phones-0"]
    start = next(t for t, p in seen if isinstance(p, Connected))
    churn = [(t, p) for t, p in seen if isinstance(p, ChurnApplied)]
    assert [(p.event, p.trace_s) for _, p in churn] == [
        ("partition", 1.0), ("heal", 3.0), ("partition", 5.0), ("crash", 5.5),
        ("lease_expired", pytest.approx(10.0, rel=1e-9))]
    assert {p.device for _, p in churn} == {"phones-1"}
    assert abs(churn[-1][0] - start - 10.0) <= 0.5  # when it was heard, on this host's clock
    # the short cut stalled the pipeline (TCP's retransmission after the heal) and lost no step
    first = [e for e in res["executed"] if not e["redo"]]
    assert max(e["wall_s"] for e in first) >= 2.0
