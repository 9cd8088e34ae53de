"""One rule for which data-parallel replicas take part in a step (engine, simulator, emulation):
rows fixed, a lost replica out for the rest of its round, back at the next round's start."""

from __future__ import annotations

import pytest

from testbed.baselines.engine import DataParallelTrainer
from testbed.baselines.membership import ReplicaMembership, join_state_bytes, row_weights
from testbed.ps_backend.engine.data import builtin_corpus
from testbed.topology import JobSpec, ModelSpec, OptimizerSpec


def test_synchronous_replicas_drop_out_for_a_step_and_come_back_the_next() -> None:
    m = ReplicaMembership(3, local_steps=1)
    assert m.begin(0, [0, 1, 2]) == ([0, 1, 2], [])
    m.drop(1)  # lost during step 0
    assert m.begin(1, [0, 2]) == ([0, 2], [])
    assert m.begin(2, [0, 1, 2]) == ([0, 1, 2], [1])  # back: first sent the state


def test_diloco_replicas_come_back_only_at_a_round_start() -> None:
    m = ReplicaMembership(3, local_steps=3)
    assert m.begin(0, [0, 1, 2]) == ([0, 1, 2], [])
    m.drop(2)
    assert m.begin(1, [0, 1, 2]) == ([0, 1], [])  # its device is back, its round is not
    assert m.begin(2, [0, 1, 2]) == ([0, 1], [])
    assert m.round_ends(2) and not m.round_ends(3)
    assert m.begin(3, [0, 1, 2]) == ([0, 1, 2], [2])


def test_with_every_replica_gone_a_returning_one_joins_at_once() -> None:
    m = ReplicaMembership(2, local_steps=4)
    m.begin(0, [0, 1])
    assert m.begin(1, []) == ([], [])
    assert m.begin(2, [1]) == ([1], [1])


def test_weights_and_join_bytes() -> None:
    assert row_weights([2, 2, 4], [0, 2]) == {0: pytest.approx(1 / 3), 2: pytest.approx(2 / 3)}
    with pytest.raises(ValueError):
        row_weights([2, 2], [])
    assert join_state_bytes(10, 8, 1, 5) == 240 and join_state_bytes(10, 8, 1, 0) == 80
    assert join_state_bytes(10, 8, 4, 8) == 80


@pytest.mark.usefixtures("one_torch_thread")
def test_a_diloco_replica_back_takes_theta_global_and_a_fresh_inner_adamw() -> None:
    job = JobSpec(model=ModelSpec(hidden=32, layers=2, heads=2, ffn=64, seq_len=16),
                  batch_size=6, steps=4, dtype="float64",
                  optimizer=OptimizerSpec(lr=1e-3, weight_decay=0.01))
    dp = DataParallelTrainer(job, seed=3, replicas=3, local_steps=2,
                             corpus=builtin_corpus(cap_bytes=64 * 1024))
    dp.step()
    dp.step(present=[True, False, True])  # replica 1 lost at the round's last step
    assert dp.membership.members == {0, 2}
    glob = [p.detach().clone() for p in dp.global_model.parameters()]
    first = dp.step()  # step 2 starts a round: replica 1 is back
    assert dp.membership.members == {0, 1, 2}
    assert "replica1->ps" not in first.bytes_sent  # a round's bytes go at its end
    # it took one inner step from θ_global with a fresh AdamW (step count 1, not 2)
    state = dp.optimizers[1].state_dict()["state"]
    assert all(float(s["step"]) == 1.0 for s in state.values())
    assert all(float(s["step"]) == 3.0 for s in dp.optimizers[0].state_dict()["state"].values())
    moved = [float((p.detach() - g).abs().max()) for p, g in zip(dp.replicas[1].parameters(),
                                                                   glob)]
    assert 0 < max(moved) < 0.01  # one AdamW step of lr 1e-3 from θ_global
