"""Emulated byzantine devices: every corruption they count is a real change Freivalds catches."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.agent.behaviour import MODES, Behaviour, BehaviourError
from testbed.ps_backend.validation import check_result


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_changes_the_tile_and_is_caught(mode: str, dtype: type) -> None:
    rng = np.random.default_rng(3)
    b = Behaviour(byzantine_rate=1.0, byzantine_modes=(mode,), seed=1)
    caught = 0
    for i in range(200):
        a = rng.standard_normal((16, 32)).astype(dtype)
        w = rng.standard_normal((32, 16)).astype(dtype)
        c = a @ w
        out, used = b.apply(c, task_id=i)
        assert used is not None and not np.array_equal(out, c)
        assert used == mode or (mode == "stale" and i == 0 and used == "noise")
        caught += check_result(a, w, out) is not None
    assert caught == 200 and b.corrupted == 200


def test_rate_and_honest_results_pass_untouched(tmp_path) -> None:
    log = tmp_path / "b.jsonl"
    b = Behaviour(byzantine_rate=0.25, seed=5, log_path=str(log))
    c = np.random.default_rng(0).standard_normal((8, 8))
    changed = sum(b.apply(c, task_id=i)[1] is not None for i in range(2000))
    assert 400 < changed < 600 and changed == b.corrupted
    assert len(log.read_text().splitlines()) == changed
    honest = Behaviour(byzantine_rate=0.0)
    out, mode = honest.apply(c)
    assert out is c and mode is None


def test_same_seed_same_misbehaviour() -> None:
    c = np.random.default_rng(0).standard_normal((8, 8))
    runs = []
    for _ in range(2):
        b = Behaviour(byzantine_rate=0.5, seed=9, straggler_factor=3, straggler_rate=0.5)
        runs.append([(b.apply(c)[1], b.compute_factor()) for _ in range(100)])
    assert runs[0] == runs[1]
    assert {f for _, f in runs[0]} == {1.0, 3.0}


def test_a_zero_tile_scaled_is_not_counted() -> None:
    b = Behaviour(byzantine_rate=1.0, byzantine_modes=("scale",))
    zeros = np.zeros((4, 4))
    out, mode = b.apply(zeros)
    assert mode is None and b.corrupted == 0


@pytest.mark.parametrize("kwargs", [dict(byzantine_rate=1.5), dict(straggler_factor=0.5),
                                    dict(byzantine_modes=("zap",)), dict(scale_factor=1.0)])
def test_bad_settings_are_refused(kwargs) -> None:
    with pytest.raises(BehaviourError):
        Behaviour(**kwargs)


def _topology(behaviour=None, validation=None) -> dict:
    group = {"group": "liars", "profile": "snapdragon888", "count": 2,
             "link": {"down": "100Mbit", "up": "20Mbit"}}
    if behaviour is not None:
        group["behaviour"] = behaviour
    job = {"model": {"hidden": 32, "layers": 1, "heads": 2, "ffn": 64, "seq_len": 8}}
    if validation is not None:
        job["validation"] = validation
    return {"name": "t", "devices": [group], "job": job}


def test_topology_behaviour_and_validation_keys() -> None:
    from testbed.topology import parse_topology

    topo = parse_topology(_topology(
        {"byzantine": {"rate": "20%", "modes": ["noise", "scale"], "scale": 2},
         "straggler": {"factor": 3}},
        {"enabled": True, "freivalds_vectors": 2, "quarantine_after": 0}))
    spec = topo.groups[0].behaviour
    assert spec.byzantine.rate == pytest.approx(0.2) and spec.byzantine.modes == ("noise", "scale")
    assert spec.byzantine.scale_factor == 2 and spec.straggler.factor == 3
    assert spec.straggler.rate == 1.0
    assert topo.job.validation.freivalds_vectors == 2 and topo.job.validation.quarantine_after == 0
    plain = parse_topology(_topology())
    assert plain.groups[0].behaviour is None and plain.job.validation.enabled


def test_topology_behaviour_errors_name_their_yaml_path() -> None:
    from testbed.topology import TopologyError, parse_topology

    with pytest.raises(TopologyError) as err:
        parse_topology(_topology({"byzantine": {"rate": 2, "modes": ["zap"]},
                                  "straggler": {"factor": 0.5}, "sleepy": {}},
                                 {"freivalds_vectors": 0, "enabled": "yes", "x": 1}))
    text = str(err.value)
    for needle in ("devices[0].behaviour.byzantine.rate", "devices[0].behaviour.byzantine.modes[0]",
                   "devices[0].behaviour.straggler.factor", "devices[0].behaviour.sleepy",
                   "job.validation.freivalds_vectors", "job.validation.enabled",
                   "job.validation.x"):
        assert needle in text, needle


def test_up_turns_behaviour_into_agent_flags(tmp_path) -> None:
    from testbed.agent.__main__ import behaviour_from_args, build_parser
    from testbed.topology import parse_topology
    from testbed.up import behaviour_argv

    topo = parse_topology(_topology({"byzantine": {"rate": 0.3, "modes": ["bitflip"]},
                                     "straggler": {"factor": 2, "rate": "50%"}}))
    device = topo.devices[1]
    argv = behaviour_argv(device, tmp_path)
    args = build_parser().parse_args(["--ps", "x:1", "--name", device.name, *argv])
    b = behaviour_from_args(args)
    assert b.byzantine_rate == 0.3 and b.byzantine_modes == ("bitflip",)
    assert b.straggler_factor == 2 and b.straggler_rate == 0.5
    assert b.log_path == str(tmp_path / "liars-1.behaviour.jsonl")
    plain = build_parser().parse_args(["--ps", "x:1", "--name", "p"])  # old flags still work
    assert behaviour_from_args(plain) is None
