"""A partition and heal on Mininet: the device's tiles are reassigned during the partition (its
lease expires: the PS hears nothing), and after the heal it joins again and computes tiles.

Times are compared as Unix times (``t``): the PS and ``testbed up`` write events.jsonl with
their own ``elapsed_s`` origins.

Needs root and Mininet; skips naming what is missing.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import yaml

from testbed.emulator.network.probe import probe
from testbed.runlog import read_jsonl
from tests.conftest import killed_at_exit, read_status, run_dir_of, start_up, wait_for

MISSING = probe().missing()
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(MISSING), reason="Mininet backend unavailable, missing: "
                                 + "; ".join(MISSING))]
PARTITION_S, HEAL_S = 2.0, 9.0  # after training starts; the PS's lease is 5 s
FAST = {"down": "1Gbit", "up": "1Gbit", "delay": "0.1ms"}


def partition_topology(tmp_path: Path) -> Path:
    trace = tmp_path / "partition.csv"
    trace.write_text(f"time_s,device,event,arg\n{PARTITION_S},phones-0,partition,\n"
                     f"{HEAL_S},phones-0,heal,\n")
    raw = {"name": "part", "seed": 3,
           "network": {"backend": "mininet", "switches": ["ap0"],
                       "ps": {"switch": "ap0", "link": FAST}},
           "devices": [{"group": "phones", "profile": "snapdragon888", "count": 3,
                        "switch": "ap0", "link": FAST},
                       {"group": "laptops", "profile": "m2pro", "count": 1, "switch": "ap0",
                        "link": FAST}],
           "job": {"model": {"family": "opt", "hidden": 32, "layers": 2, "heads": 2, "ffn": 64,
                             "seq_len": 16},
                   "batch_size": 2, "steps": 2000, "dtype": "float64",
                   "optimizer": {"name": "adamw", "lr": 1e-3},
                   # fifo: every device keeps tiles in flight (the planner may leave phones
                   # out of so small a model), so the partitioned phone surely holds one
                   "parallelism": {"strategy": "tile-tp", "tile": 16, "min_offload_flops": 0,
                                   "planner": "fifo"}},
           "churn": str(trace), "time_dilation": 1}
    path = tmp_path / "partition.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _working_again(run_dir: Path) -> bool:
    return any(d["device"] == "phones-0" and d["state"] in ("busy", "idle")
               and d["tiles_done"] > 0 for d in read_status(run_dir).get("devices", []))


@pytest.mark.slow
def test_partition_reassigns_tiles_and_heal_brings_the_device_back(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    proc = start_up(partition_topology(tmp_path), out)
    with killed_at_exit(proc):
        run_dir = run_dir_of(out)
        events_path = run_dir / "events.jsonl"

        def healed_and_rejoined() -> bool:
            events = read_jsonl(events_path)
            heal = [e for e in events if e["event"] == "churn" and e["action"] == "heal"]
            return bool(heal) and any(e["event"] == "join" and e["device"] == "phones-0"
                                      and e["t"] > heal[0]["t"]
                                      for e in events) and _working_again(run_dir)
        wait_for(healed_and_rejoined, 240, "phones-0 to be healed, join again and compute")
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    events = read_jsonl(run_dir / "events.jsonl")
    churn = {e["action"]: e for e in events if e["event"] == "churn"}
    assert churn["partition"]["effect"] == "link down" and churn["heal"]["effect"] == "link up"
    t_part, t_heal = churn["partition"]["t"], churn["heal"]["t"]
    gone = [e for e in events if e["event"] in ("lease_expired", "disconnect")
            and e["device"] == "phones-0"]
    assert gone and gone[0]["event"] == "lease_expired", gone
    lease = gone[0]
    assert t_part < lease["t"] < t_heal  # noticed during the partition
    # every tile it held went to another device: a backup copy (idle devices back up an overdue
    # tile) had already finished it or was out, or it was re-queued at the expiry
    # it held a tile when cut off: still in flight, or already beaten by a backup copy (a losing
    # copy no longer counts as in flight, docs/fault-tolerance.md)
    assert lease["in_flight"] + lease["cancelled"] >= 1
    assert lease["done_elsewhere"] + lease["backed_up"] + lease["requeued_tiles"] \
        == lease["in_flight"]
    if lease["requeued_tiles"]:
        recovered = [e for e in events if e["event"] == "recovered"
                     and e["device"] == "phones-0"]
        assert recovered and recovered[0]["t"] < t_heal
    steps = [s for s in read_jsonl(run_dir / "steps.jsonl") if t_part < s["t"] < t_heal]
    assert steps, "training stalled during the partition"
    assert not [e for e in events if e["event"] == "reject"]
