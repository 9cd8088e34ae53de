"""The simulator names GEMM operands as the PS does, so its bytes down count each block once.

The PS keys an operand by its tensor (:class:`~testbed.ps_backend.executor.OperandKeys`: X shared
by forward and the weight gradient, ``Wᵀ`` of forward and ``W`` of the input gradient one tensor,
``dY`` and ``dYᵀ`` one tensor); the simulator keys it from the layer names
(:mod:`testbed.simulate.chain`). Here the real engine runs one step of the tiny model through an
executor that keys operands with the PS's ``OperandKeys``, and the chain's keys must induce the
same sharing, with the same orientation flags, GEMM for GEMM.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from testbed.ps_backend.bound import BoundDevice, BoundGemm, floats, stage_key, step_bound
from testbed.ps_backend.engine.trainer import Trainer
from testbed.ps_backend.executor import (
    DoneHandle,
    GemmHandle,
    GemmSpec,
    OperandKeys,
    TileExecutor,
)
from testbed.ps_backend.scheduler import GemmJob
from testbed.ps_backend.step_plan import bound_gemm
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


class CoreStub:
    """What TileExecutor hands its GEMMs to: keeps each job and completes it at once."""

    watchdog_reason = None

    def __init__(self) -> None:
        self.jobs: list[GemmJob] = []

    def submit(self, job: GemmJob) -> None:
        self.jobs.append(job)
        job.done.set_result(job.a @ job.b)


def stub_executor() -> tuple[TileExecutor, CoreStub]:
    """The PS's TileExecutor with every GEMM handed to a CoreStub (no server, no devices)."""
    core = CoreStub()
    server = SimpleNamespace(config=SimpleNamespace(min_offload_flops=0), ledger=None,
                             core=core, loop=SimpleNamespace(call_soon_threadsafe=(
                                 lambda fn, *args: fn(*args))))
    return TileExecutor(server), core  # type: ignore[arg-type]


def test_the_bound_holds_the_operands_the_simulator_holds(tmp_path: Path) -> None:
    """The PS's own executor names each operand for the bound (``bound_gemm``) so that a
    stage counts as held exactly the tensors the simulator's chain does: the two bounds agree
    stage by stage."""
    topology = load_topology(TINY)
    executor, core = stub_executor()
    Trainer(topology.job, topology.seed, executor).step()
    chain = [g for group in step_chain(topology.job) for g in group]
    assert [(j.spec.layer, j.spec.op) for j in core.jobs] == [(g.layer, g.op) for g in chain]
    item = core.jobs[0].a.itemsize
    simulated = [BoundGemm(g.m, g.k, g.n, item, stage_key(g.layer, g.op), *g.keys(0),
                           floats(g.op)) for g in chain]
    devices = [BoundDevice("phone", 2e9, 1e6, 1e6, 0.01), BoundDevice("laptop", 2e10, 5e6, 5e6)]
    ps, sim = step_bound([bound_gemm(j) for j in core.jobs], devices), \
        step_bound(simulated, devices)
    assert [s.stage for s in ps.stages] == [s.stage for s in sim.stages]
    for a, b in zip(ps.stages, sim.stages):
        assert a.bound_s == pytest.approx(b.bound_s, rel=1e-9), a.stage
    # the test can fail: with every operand new, the backward stages' bound is higher
    fresh = step_bound([BoundGemm(g.m, g.k, g.n, g.itemsize, g.stage, floating=g.floating)
                        for g in simulated], devices)
    assert fresh.bound_s > 1.05 * sim.bound_s


def test_a_new_tensor_at_a_freed_tensors_address_is_not_held() -> None:
    """The allocator gives a layer's new dY the address of the layer before's once that one is
    freed (a real hotcarbon run: layer 0's backward q/k/v bound 0.215 s against 0.503). Here
    the second GEMM's A is a new tensor in the first one's storage: the bound must count it as
    new, as it does a tensor elsewhere, and never as held."""
    executor, core = stub_executor()
    w = torch.randn(16, 8)
    first = torch.randn(32, 16)
    executor.submit(first, w, GemmSpec("l.1", "input_grad", 0, "w@0")).result()
    reused = torch.empty(0).set_(first.untyped_storage(), 0, first.shape, first.stride())
    reused.copy_(torch.randn(32, 16))  # new values where the freed tensor was
    elsewhere = torch.randn(32, 16)
    for a in (reused, elsewhere):
        executor.submit(a, w, GemmSpec("l.0", "input_grad", 0, "w@0")).result()
    jobs = [bound_gemm(j) for j in core.jobs]
    device = [BoundDevice("phone", 1e12, 1e3, 1e9)]  # the down link sets the bound
    at_reused = step_bound(jobs[:2], device).stages[1].bound_s
    at_elsewhere = step_bound([jobs[0], jobs[2]], device).stages[1].bound_s
    assert at_reused == pytest.approx(at_elsewhere, rel=1e-9)
    again = dataclasses.replace(jobs[0], stage=jobs[1].stage)  # the first's A once more: held
    held = step_bound([jobs[0], again], device).stages[1].bound_s
    assert at_reused > 2 * held


def test_each_gemms_digest_is_its_operands_though_each_operand_is_checksummed_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a ledger the PS checksums every GEMM's operands (``GemmJob.digest``); it keeps each
    operand's digest by its key for the step, and the digest is still the GEMM's own, step after
    step (a weight's new version is checksummed anew)."""
    from testbed.ps_backend import executor as executor_module
    from testbed.ps_backend.ledger import gemm_digest

    topology = load_topology(TINY)
    executor, core = stub_executor()
    executor.server.ledger = SimpleNamespace()  # type: ignore[attr-defined]  # any: it digests
    hashed: list[int] = []
    real = executor_module.stored_digest

    def counted(stored: Any) -> str:
        hashed.append(stored.size)
        return real(stored)
    monkeypatch.setattr(executor_module, "stored_digest", counted)
    trainer = Trainer(topology.job, topology.seed, executor)
    for _ in range(2):
        trainer.step()
    assert core.jobs and all(j.digest == gemm_digest(j.a, j.b) for j in core.jobs)
    operands = sum(j.a.size + j.b.size for j in core.jobs)
    assert sum(hashed) < 0.6 * operands  # each tensor once, though each serves two GEMMs
