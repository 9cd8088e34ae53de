"""The strategy keys of a topology and the memory fit of pipeline stages and replicas."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.baselines import cost
from testbed.baselines.memory import device_memory
from testbed.baselines.placement import (
    FitError,
    device_infos,
    plan_data_parallel,
    plan_pipeline,
)
from testbed.cli import main
from testbed.perf_model.profiles import load_profile
from testbed.topology import TopologyError, parse_topology

OPT125M = {"hidden": 768, "layers": 12, "heads": 12, "ffn": 3072, "seq_len": 512,
           "vocab": 50272}


def topo(model: dict[str, Any] | None = None, count: int = 15, profile: str = "snapdragon888",
         **parallelism: Any) -> dict[str, Any]:
    return {"name": "t", "devices": [{"group": "phones", "profile": profile, "count": count,
                                      "link": {"down": "10MB/s", "up": "10MB/s"}}],
            "job": {"model": model or {"hidden": 64, "layers": 4, "heads": 4, "ffn": 128,
                                       "seq_len": 32},
                    "batch_size": 16, "parallelism": parallelism}}


def test_strategy_keys_and_defaults() -> None:
    t = parse_topology(topo())
    p = t.job.parallelism
    assert (p.strategy, p.micro_batches, p.local_steps, p.checkpoint_every) == \
        ("tile-tp", 4, 1, 10)
    t = parse_topology(topo(strategy="data-parallel", local_steps=8))
    assert t.job.parallelism.strategy == "data-parallel" and t.job.parallelism.local_steps == 8
    t = parse_topology(topo(strategy="pipeline", micro_batches=16))
    assert t.job.parallelism.micro_batches == 16


@pytest.mark.parametrize("parallelism,expect", [
    ({"strategy": "zero"}, "job.parallelism.strategy"),
    ({"strategy": "pipeline", "micro_batches": 0}, "job.parallelism.micro_batches"),
    ({"strategy": "pipeline", "micro_batches": 17}, "micro_batches: 17 micro-batches"),
    ({"strategy": "data-parallel", "local_steps": "two"}, "job.parallelism.local_steps"),
])
def test_bad_strategy_keys_name_their_path(parallelism: dict[str, Any], expect: str) -> None:
    with pytest.raises(TopologyError, match=expect):
        parse_topology(topo(**parallelism))


def test_memory_figures_have_sources() -> None:
    mem = device_memory(load_profile("snapdragon888"))
    assert mem.ram_bytes == 8 * 2**30 and mem.usable_bytes == 4 * 2**30
    assert "Galaxy S21" in mem.source
    assert device_memory(load_profile("m4pro")).ram_bytes == 24 * 2**30


def test_stage_memory_is_weights_adam_and_in_flight_activations() -> None:
    t = parse_topology(topo(OPT125M, strategy="pipeline", micro_batches=4))
    plan = plan_pipeline(t.job, device_infos(t))
    spec = t.job.model
    per_layer = cost.state_bytes(cost.layer_params(spec), 4) + \
        4 * cost.layer_activation_bytes(spec, 4, 4)
    # 16 B/param (weights, gradients, 2 Adam moments) + activations of all 4 micro-batches
    assert cost.state_bytes(1000, 4) == 16_000
    a, b = plan.bounds[1]
    assert plan.stage_bytes[1] == (b - a) * per_layer
    assert all(s <= 4 * 2**30 for s in plan.stage_bytes)
    assert plan.bounds[0][0] == 0 and plan.bounds[-1][1] == 12
    assert all(x[1] == y[0] for x, y in zip(plan.bounds, plan.bounds[1:]))


def test_more_micro_batches_lower_the_estimate() -> None:
    t = parse_topology(topo(OPT125M))
    devices = device_infos(t)
    est = [plan_pipeline(dataclasses.replace(t.job, parallelism=dataclasses.replace(
        t.job.parallelism, micro_batches=m)), devices).estimate_s for m in (1, 4, 16)]
    assert est[0] > est[1] > est[2]


def test_a_model_no_placement_fits_is_refused_naming_devices_and_bytes() -> None:
    big = {"hidden": 2048, "layers": 24, "heads": 32, "ffn": 8192, "seq_len": 512,
           "vocab": 50272}
    with pytest.raises(TopologyError) as err:
        parse_topology(topo(big, strategy="pipeline"))
    text = str(err.value)
    assert "job.parallelism.strategy: pipeline: no placement" in text
    assert "phones: 15 x 4.00 GiB usable (of 8.00 GiB, snapdragon888)" in text
    assert "A layer needs 2.75 GiB" in text
    with pytest.raises(TopologyError, match="data-parallel: no device holds a replica"):
        parse_topology(topo(big, strategy="data-parallel"))
    parse_topology(topo(big))  # tile-tp: devices hold tiles, the PS the model


def test_data_parallel_uses_devices_that_fit_one_replica_per_sequence() -> None:
    t = parse_topology(topo(count=20, strategy="data-parallel"))
    plan = plan_data_parallel(t.job, device_infos(t))
    assert len(plan.replicas) == 16 and sum(plan.rows) == 16 and len(plan.left_out) == 4
    with pytest.raises(FitError):
        plan_data_parallel(dataclasses.replace(t.job, model=dataclasses.replace(
            t.job.model, **{k: v for k, v in OPT125M.items() if k != "vocab"}, vocab=50272),
            batch_size=16), device_infos(t)[:0])


def test_validate_exits_2_on_a_stage_a_phone_cannot_hold(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    big = {"hidden": 2048, "layers": 24, "heads": 32, "ffn": 8192, "seq_len": 512,
           "vocab": 50272}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(topo(big, strategy="pipeline")))
    assert main(["validate", str(path)]) == 2
    assert "no placement" in capsys.readouterr().err
    path.write_text(yaml.safe_dump(topo(strategy="pipeline")))
    assert main(["validate", str(path)]) == 0


def test_a_one_stage_pipeline_holds_the_tied_weight_once() -> None:
    """One device holding the whole model keeps the tied LM head and embedding as one tensor,
    as a data-parallel replica does (the placement had counted its V·h twice)."""
    t = parse_topology(topo(count=1, strategy="pipeline", micro_batches=4))
    plan = plan_pipeline(t.job, device_infos(t))
    spec, rows = t.job.model, 16 // 4
    activations = 4 * (spec.layers * cost.layer_activation_bytes(spec, rows, 4)
                       + cost.head_activation_bytes(spec, rows, 4))
    assert plan.bounds == ((0, spec.layers),)
    assert plan.stage_bytes == (cost.state_bytes(cost.model_params(spec), 4) + activations,)
