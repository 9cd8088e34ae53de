"""Byzantine devices: every wrong tile they return is caught, no honest tile is refused, the
training result is the single-process one; a device that keeps failing checks is quarantined.

The liars are real agent processes with ``devices[].behaviour.byzantine`` (noise, bit flips,
stale and scaled tiles); each logs every corruption it makes (agents/<name>.behaviour.jsonl),
which is matched against the PS's rejections in events.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from testbed.runlog import read_jsonl
from tests.conftest import TINY, reference_losses, run_dir_of, start_up

pytestmark = pytest.mark.integration


def byzantine_topology(tmp_path: Path, steps: int, liars: int, honest_phones: int,
                       rate: float, quarantine_after: int, planner: str = "auto") -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw["job"].setdefault("parallelism", {})["planner"] = planner
    raw["job"].update(steps=steps, dtype="float64",
                      validation={"enabled": True, "freivalds_vectors": 1,
                                  "quarantine_after": quarantine_after})
    phones = raw["devices"][0]
    phones["count"] = honest_phones
    raw["devices"].append({"group": "liars", "profile": "snapdragon888", "count": liars,
                           "link": phones["link"],
                           "behaviour": {"byzantine": {"rate": rate}}})
    path = tmp_path / "byzantine.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _run(topology: Path, out: Path) -> tuple[Path, list[dict], dict]:
    proc = start_up(topology, out)
    output, _ = proc.communicate(timeout=400)
    run_dir = run_dir_of(out)
    assert proc.returncode == 0, output
    return run_dir, read_jsonl(run_dir / "events.jsonl"), \
        json.loads((run_dir / "summary.json").read_text())


def _corruptions(run_dir: Path) -> list[dict]:
    out: list[dict] = []
    for path in sorted((run_dir / "agents").glob("*.behaviour.jsonl")):
        out += read_jsonl(path)
    return out


def _same_training(run_dir: Path, topology: Path, steps: int) -> None:
    got = [s["loss"] for s in read_jsonl(run_dir / "steps.jsonl")]
    want, want_weights = reference_losses(topology, steps)
    assert len(got) == steps
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-8 * abs(w), (g, w)
    weights = torch.load(sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1],
                         weights_only=True)["model"]
    scale = max(w.abs().max().item() for w in want_weights.values())
    for name, want_w in want_weights.items():
        assert (weights[name] - want_w).abs().max().item() <= 1e-8 * scale, name


@pytest.mark.slow
def test_every_corrupted_tile_is_caught(tmp_path: Path) -> None:
    steps = 15  # x 360 tiles: fixed 64x64 tiles (planner: fifo), enough lies to judge
    topology = byzantine_topology(tmp_path, steps, liars=2, honest_phones=7, rate=0.3,
                                  quarantine_after=0,  # 2 of 10 devices lie; never quarantine
                                  planner="fifo")
    run_dir, events, summary = _run(topology, tmp_path / "runs")
    assert summary["tiles"] >= 5000 and summary["checks"] >= 5000

    made = {(c["device"], c["task"], c["attempt"]) for c in _corruptions(run_dir)}
    rejects = [e for e in events if e["event"] == "reject"]
    refused = {(e["device"], e["task"], e["attempt"]) for e in rejects if e["failed_check"]}
    assert len(made) >= 100, "too few corruptions to judge"
    assert {m["mode"] for m in _corruptions(run_dir)} == {"noise", "bitflip", "stale", "scale"}
    # no honest tile refused: every refusal is a corruption, and only liars were refused
    assert refused <= made
    assert {e["device"] for e in rejects} <= {"liars-0", "liars-1"}
    # every corruption caught, except results that never came back before the run stopped
    outstanding = {(d["device"], task, attempt) for d in summary["devices"]
                   for task, attempt in d.get("outstanding", [])}
    assert made - refused <= outstanding, sorted(made - refused - outstanding)[:5]
    assert summary["failed_checks"] == len(refused)
    assert not summary["quarantined"]
    _same_training(run_dir, topology, steps)
    assert summary["validation_us_per_tile"] > 0 and summary["validation_cpu_s"] > 0


@pytest.mark.slow
def test_a_lying_device_is_quarantined_and_its_tiles_redone(tmp_path: Path) -> None:
    steps = 2
    topology = byzantine_topology(tmp_path, steps, liars=1, honest_phones=2, rate=1.0,
                                  quarantine_after=3)
    run_dir, events, summary = _run(topology, tmp_path / "runs")
    quarantines = [e for e in events if e["event"] == "quarantine"]
    assert [(q["device"], q["failed_checks"]) for q in quarantines] == [("liars-0", 3)]
    assert summary["quarantined"] == ["liars-0"] and summary["quarantines"] == 1
    liar = next(d for d in summary["devices"] if d["device"] == "liars-0")
    assert liar["state"] == "quarantined" and liar["tiles_done"] == 0
    rejects = [e for e in events if e["event"] == "reject"]
    assert {e["device"] for e in rejects} == {"liars-0"}
    # after the quarantine nothing new was handed to it: its refusals are the three that
    # triggered it plus at most what it still held then (its window: --max-in-flight 8)
    assert 3 <= len(rejects) <= 3 + 8
    held = quarantines[0]["requeued_tiles"]
    if held:
        assert any(e["event"] == "recovered" and e["cause"] == "quarantine" for e in events)
    _same_training(run_dir, topology, steps)
