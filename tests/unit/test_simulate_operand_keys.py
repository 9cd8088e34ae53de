"""The simulator names GEMM operands as the PS does, so its bytes down count each block once.

The PS keys an operand by its tensor (:class:`~testbed.ps_backend.executor.OperandKeys`: X shared
by forward and the weight gradient, ``Wᵀ`` of forward and ``W`` of the input gradient one tensor,
``dY`` and ``dYᵀ`` one tensor); the simulator keys it from the layer names
(:mod:`testbed.simulate.chain`). Here the real engine runs one step of the tiny model through an
executor that keys operands with the PS's ``OperandKeys``, and the chain's keys must induce the
same sharing, with the same orientation flags, GEMM for GEMM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from testbed.ps_backend.engine.trainer import Trainer
from testbed.ps_backend.executor import DoneHandle, GemmHandle, GemmSpec, OperandKeys
from testbed.simulate.chain import step_chain
from testbed.simulate.sim import Simulation
from testbed.topology import Topology, load_topology

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"


class KeyingExecutor:
    """Computes locally; records each GEMM's operand keys as the PS's TileExecutor makes them."""

    def __init__(self) -> None:
        self.keys = OperandKeys()
        self.calls: list[tuple[str, str, str, bool, str, bool, int, int]] = []

    def submit(self, a: torch.Tensor, b: torch.Tensor, spec: GemmSpec) -> GemmHandle:
        a_key, a_t, _ = self.keys.get(a, spec.step)
        b_ident, b_t, _ = self.keys.get(b, spec.step)
        self.calls.append((spec.layer, spec.op, a_key, a_t, spec.b_key or b_ident, b_t,
                           a.numel() * a.element_size(), b.numel() * b.element_size()))
        return DoneHandle(a @ b)


def ps_keys(topology: Topology) -> KeyingExecutor:
    """One training step of the engine with the PS's operand keys recorded."""
    executor = KeyingExecutor()
    Trainer(topology.job, topology.seed, executor).step()
    return executor


def test_chain_shares_operands_exactly_where_the_ps_does() -> None:
    topology = load_topology(TINY)
    ps = ps_keys(topology).calls
    chain = [g for group in step_chain(topology.job) for g in group]
    assert [(c[0], c[1]) for c in ps] == [(g.layer, g.op) for g in chain]
    to_sim: dict[str, str] = {}
    to_ps: dict[str, str] = {}
    for call, g in zip(ps, chain):
        a_key, b_key = g.keys(0)
        for ps_key, ps_t, sim_key, sim_t in ((call[2], call[3], a_key, g.a_transposed),
                                             (call[4], call[5], b_key, g.b_transposed)):
            assert ps_t == sim_t, (call, g)
            # one PS tensor is one simulated tensor and back: the same sharing both ways
            assert to_sim.setdefault(ps_key, sim_key) == sim_key, (call, g)
            assert to_ps.setdefault(sim_key, ps_key) == ps_key, (call, g)
    weights = {call[4] for call in ps if call[1] != "weight_grad"}
    assert weights <= set(to_ps), "weights are keyed by their GemmSpec b_key on both sides"
    # the sharing is real: 9 submitted linears, 27 GEMMs, 54 operands, far fewer tensors
    assert len(to_sim) == 2 * (4 + 4 + 4) + 3  # per layer 4 X, 4 W, 4 dY; the head 3


def one_device_whole_gemms(tmp_path: Path) -> Topology:
    """tiny.yaml with one device and tiles larger than any GEMM: one tile per GEMM."""
    doc: dict[str, Any] = yaml.safe_load(TINY.read_text())
    doc["devices"] = [g for g in doc["devices"] if g["group"] == "laptops"]
    doc["job"]["parallelism"].update(planner="fifo", tile=4096)
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_topology(path)


def test_step_bytes_down_are_each_distinct_operand_once(tmp_path: Path) -> None:
    topology = one_device_whole_gemms(tmp_path)
    ps = ps_keys(topology).calls
    # what the PS's keys say must travel to a device that caches everything (64 MiB holds the
    # whole tiny step): every distinct tensor once, a transposed weight not again
    distinct: dict[str, int] = {}
    for call in ps:
        distinct[call[2]] = call[6]
        distinct[call[4]] = call[7]
    every_operand = sum(c[6] + c[7] for c in ps)
    assert sum(distinct.values()) < 0.6 * every_operand  # the test can tell the two apart
    sim = Simulation(topology, noise=False)
    sim.start()
    for step in range(2):  # the second step's weights are a new version: sent again
        _, stats, _ = sim.run_step(step)
        assert sum(sim.tiles_per_gemm[u] for u in sim.tiles_per_gemm
                   if u.startswith(f"s{step}/")) == len(ps)  # one tile per GEMM
        assert stats.bytes_down == sum(distinct.values()), step  # exact: whole blocks
