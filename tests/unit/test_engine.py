"""The training engine: offloaded GEMMs give the plain-torch result, data, checkpoints."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from testbed.ps_backend.engine import checkpoint as ckpt
from testbed.ps_backend.engine.data import (
    BatchSampler,
    DataError,
    builtin_corpus,
    files_corpus,
    load_corpus,
    stdlib_sources,
)
from testbed.ps_backend.engine.model import OptDecoder, count_parameters
from testbed.ps_backend.engine.offload import (
    ExecutorResultError,
    GemmContext,
    OffloadedLinear,
    fused_linear,
)
from testbed.ps_backend.engine.trainer import Trainer
from testbed.ps_backend.executor import DoneHandle, LocalExecutor
from testbed.ps_backend.scheduler import GemmSpec
from testbed.topology import DataSpec, JobSpec, ModelSpec, OptimizerSpec

TINY = ModelSpec(hidden=32, layers=2, heads=2, ffn=64, seq_len=16)
STEPS = 5


def tiny_job(dtype: str = "float64", **changes: object) -> JobSpec:
    # lr 1e-3 so that 5 steps move the weights far enough for a wrong update to show
    return dataclasses.replace(JobSpec(model=TINY, batch_size=2, steps=STEPS, dtype=dtype,
                                       optimizer=OptimizerSpec(lr=1e-3, weight_decay=0.01)),
                               **changes)


class RecordingExecutor(LocalExecutor):
    """LocalExecutor that also records the operand shapes of each GEMM."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def submit(self, a: torch.Tensor, b: torch.Tensor, spec: GemmSpec) -> DoneHandle:
        self.shapes.append((tuple(a.shape), tuple(b.shape)))
        return super().submit(a, b, spec)  # type: ignore[return-value]


class NumpyTiledExecutor:
    """Cuts C = A·B into tm×tn tiles, each summed over tk-wide K slices, computed with numpy."""

    def __init__(self, tm: int = 5, tn: int = 7, tk: int = 6) -> None:
        self.tm, self.tn, self.tk = tm, tn, tk
        self.tiles = 0

    def submit(self, a: torch.Tensor, b: torch.Tensor, spec: GemmSpec) -> DoneHandle:
        an, bn = a.detach().numpy(), b.detach().numpy()
        m, k = an.shape
        n = bn.shape[1]
        c = np.zeros((m, n), dtype=an.dtype)
        for i in range(0, m, self.tm):
            for j in range(0, n, self.tn):
                for p in range(0, k, self.tk):  # K split: the PS sums the partial tiles
                    c[i:i + self.tm, j:j + self.tn] += (an[i:i + self.tm, p:p + self.tk]
                                                        @ bn[p:p + self.tk, j:j + self.tn])
                    self.tiles += 1
        return DoneHandle(torch.from_numpy(c))


def family_scale(tensors: dict[str, torch.Tensor]) -> float:
    """The largest magnitude in a family of tensors (all weights of a model)."""
    return max(float(t.abs().max()) for t in tensors.values())


def max_excess(got: torch.Tensor, want: torch.Tensor, rtol: float, scale: float,
               atol: float = 0.0) -> float:
    """How far |got - want| exceeds rtol * max(|got|, |want|, scale) + atol (<= 0: close).

    ``scale`` is the magnitude of the tensor's family, so a tensor whose true value is zero
    (a bias whose gradient vanishes) is compared against the family's size, not against its
    own rounding noise: a bare relative difference of two ~1e-15 numbers is meaningless.
    """
    bound = rtol * torch.maximum(torch.maximum(got.abs(), want.abs()),
                                 torch.full_like(want, scale)) + atol
    return float(((got - want).abs() - bound).max())


@pytest.fixture(params=[1, 2], ids=["blas1", "blas2"])
def blas_threads(request: pytest.FixtureRequest) -> object:
    """Run a parity test with 1 and with 2 intra-op threads: a reduction order must not matter.

    (``OMP_NUM_THREADS`` is read once at start-up; ``torch.set_num_threads`` changes the same
    pool at run time, so both counts run in one session.)
    """
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def final_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def expected_gemms(model: OptDecoder, step: int, m: int) -> tuple[list, list]:
    """The GEMMs of one step, in the order forward (all layers) then backward (reverse)."""
    forward, backward = [], []
    for lin in model.gemm_layers():
        i, o, key = lin.in_features, lin.out_features, lin.weight_key
        forward.append((GemmSpec(lin.name, "forward", step, f"{key}@{step}"), (m, i), (i, o)))
        backward.append([(GemmSpec(lin.name, "input_grad", step, f"{key}@{step}"),
                          (m, o), (o, i)),
                         (GemmSpec(lin.name, "weight_grad", step, None), (o, m), (m, i))])
    return forward, backward


# ------------------------------------------------------------------------------------------------
# Offloaded GEMMs against plain torch


# A bias on the keys adds q·b to every score of a query: softmax ignores it, so its gradient is
# zero and it never moves from its (zero) initial value; only rounding noise (~1e-15) remains.
UNTRAINED = ("self_attn.k_proj.bias",)


def test_local_executor_matches_plain_torch_float64_and_sees_three_gemms_per_linear(
        blas_threads: int) -> None:
    plain = Trainer(tiny_job(), seed=3)
    executor = RecordingExecutor()
    offloaded = Trainer(tiny_job(), seed=3, executor=executor)
    start = final_weights(plain)
    plain_losses = [r.loss for r in plain.run(STEPS)]
    results = offloaded.run(STEPS)
    for p, r in zip(plain_losses, results):
        assert abs(r.loss - p) <= 1e-10 * abs(p)
    after_plain, after_off = final_weights(plain), final_weights(offloaded)
    scale = family_scale(after_plain)
    for name, w in after_plain.items():
        assert max_excess(after_off[name], w, 1e-10, scale) <= 0, name
        if name.endswith(UNTRAINED):
            assert float((w - start[name]).abs().max()) <= 1e-10 * scale, name
        else:
            assert float((w - start[name]).abs().max()) > 1e-4 * scale, f"{name} did not train"

    # Every linear's input needs a gradient in this model (q/k/v and fc1 read a LayerNorm output,
    # out_proj/fc2 read activations, lm_head the final LayerNorm), so no input_grad is skipped:
    # exactly 3 GEMMs per submitted linear per step, q/k/v one linear.
    linears = offloaded.model.gemm_layers()
    assert len(linears) == 4 * TINY.layers + 1
    assert len(offloaded.model.offloaded_linears()) == 6 * TINY.layers + 1
    assert all(r.gemms == 3 * len(linears) for r in results)
    assert len(executor.calls) == STEPS * 3 * len(linears)
    m = 2 * TINY.seq_len
    per_step = 3 * len(linears)
    for step in range(STEPS):
        calls = list(zip(executor.calls, executor.shapes))[step * per_step:(step + 1) * per_step]
        forward, backward = expected_gemms(offloaded.model, step, m)
        got_forward = [(s, a, b) for s, (a, b) in calls[:len(linears)]]
        assert got_forward == forward  # forward order = module order, versions = step
        got_backward = sorted(((s, a, b) for s, (a, b) in calls[len(linears):]),
                              key=lambda x: (x[0].layer, x[0].op))
        want_backward = sorted((g for pair in backward for g in pair),
                               key=lambda x: (x[0].layer, x[0].op))
        assert got_backward == want_backward
    head = [s for s in executor.calls if s.layer == "lm_head" and s.op == "forward"]
    assert [s.b_key for s in head] == [f"embed_tokens.weight@{v}" for v in range(STEPS)]


def test_numpy_tiled_executor_matches_plain_torch(blas_threads: int) -> None:
    for dtype, tolerance in (("float64", 1e-8), ("float32", 1e-5)):
        plain = [r.loss for r in Trainer(tiny_job(dtype), seed=5).run(STEPS)]
        executor = NumpyTiledExecutor()
        tiled = [r.loss for r in Trainer(tiny_job(dtype), seed=5, executor=executor).run(STEPS)]
        assert executor.tiles > 1000  # it really cut the GEMMs
        for p, t in zip(plain, tiled):
            assert abs(t - p) <= tolerance * abs(p), (dtype, plain, tiled)


class EventExecutor:
    """Records submit and result events; a handle computes only when result() is called."""

    def __init__(self) -> None:
        self.events: list[tuple[str, GemmSpec]] = []

    def submit(self, a: torch.Tensor, b: torch.Tensor, spec: GemmSpec) -> "EventExecutor._Handle":
        self.events.append(("submit", spec))
        return EventExecutor._Handle(self, a, b, spec)

    class _Handle:
        def __init__(self, owner: "EventExecutor", a: torch.Tensor, b: torch.Tensor,
                     spec: GemmSpec) -> None:
            self.owner, self.a, self.b, self.spec = owner, a, b, spec

        def result(self) -> torch.Tensor:
            self.owner.events.append(("result", self.spec))
            return self.a @ self.b


def test_backward_has_input_and_weight_gradient_in_flight_together() -> None:
    executor = EventExecutor()
    trainer = Trainer(tiny_job("float32"), seed=1, executor=executor)
    trainer.step()
    for lin in trainer.model.gemm_layers():
        idx = {(kind, s.op): n for n, (kind, s) in enumerate(executor.events)
               if s.layer == lin.name}
        last_submit = max(idx["submit", "input_grad"], idx["submit", "weight_grad"])
        first_result = min(idx["result", "input_grad"], idx["result", "weight_grad"])
        assert last_submit < first_result, lin.name


def test_single_layer_gradients_and_skipped_gemms() -> None:
    torch.manual_seed(0)
    executor = LocalExecutor()
    ctx = GemmContext(executor=executor, step=4, version=9)
    layer = OffloadedLinear(6, 5, name="probe", context=ctx).double()
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)  # any leading shape
    y = layer(x)
    assert y.shape == (3, 4, 5)
    upstream = torch.randn_like(y)
    y.backward(upstream)
    ref_x = x.detach().clone().requires_grad_(True)
    ref_w = layer.weight.detach().clone().requires_grad_(True)
    ref_b = layer.bias.detach().clone().requires_grad_(True)
    F.linear(ref_x, ref_w, ref_b).backward(upstream)
    want_y = F.linear(ref_x, ref_w, ref_b).detach()
    # relative to the output's magnitude too: an entry near 0 (|y| ~ 7e-4 here) is a difference
    # of O(1) terms, whose rounding is relative to those terms, not to the entry
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12 * float(want_y.abs().max()))
    for got, want in ((x.grad, ref_x.grad), (layer.weight.grad, ref_w.grad),
                      (layer.bias.grad, ref_b.grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    assert [(s.op, s.step, s.b_key) for s in executor.calls] == [
        ("forward", 4, "probe.weight@9"), ("input_grad", 4, "probe.weight@9"),
        ("weight_grad", 4, None)]

    # An input that needs no gradient: no input_grad GEMM. A frozen weight: no weight_grad GEMM.
    executor.calls.clear()
    layer(torch.randn(2, 6, dtype=torch.float64)).sum().backward()
    assert [s.op for s in executor.calls] == ["forward", "weight_grad"]
    executor.calls.clear()
    layer.weight.requires_grad_(False)
    layer(torch.randn(2, 6, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert [s.op for s in executor.calls] == ["forward", "input_grad"]


def test_fused_linears_are_one_gemm_of_each_kind_and_each_linear_as_its_own() -> None:
    torch.manual_seed(1)
    executor = LocalExecutor()
    ctx = GemmContext(executor=executor, step=2, version=5)
    layers = [OffloadedLinear(6, n, name=f"p{n}", context=ctx).double() for n in (5, 3, 4)]
    with torch.no_grad():
        for layer in layers:
            layer.bias.normal_()
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    y = fused_linear(x, layers, "fused")
    assert y.shape == (3, 4, 12)
    upstream = torch.randn_like(y)
    y.backward(upstream)
    assert [(s.layer, s.op, s.b_key) for s in executor.calls] == [
        ("fused", "forward", "fused.weight@5"), ("fused", "input_grad", "fused.weight@5"),
        ("fused", "weight_grad", None)]
    # The same as each linear on its own under torch's autograd, output and every gradient.
    ref_x = x.detach().clone().requires_grad_(True)
    refs = [(layer.weight.detach().clone().requires_grad_(True),
             layer.bias.detach().clone().requires_grad_(True)) for layer in layers]
    outs = [F.linear(ref_x, w, b) for w, b in refs]
    torch.cat(outs, dim=-1).backward(upstream)
    for got, want in zip(y.split([5, 3, 4], dim=-1), outs):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-12, atol=1e-15)
    for layer, (w, b) in zip(layers, refs):
        torch.testing.assert_close(layer.weight.grad, w.grad, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(layer.bias.grad, b.grad, rtol=1e-12, atol=1e-15)
    # Without an executor it is plain torch, the same values.
    ctx.executor = None
    torch.testing.assert_close(fused_linear(ref_x, layers, "fused"), y, rtol=1e-12, atol=1e-15)
    layers[1].bias = None
    with pytest.raises(ValueError, match="fused: the fused linears must all have a bias or none"):
        fused_linear(ref_x, layers, "fused")


class _LoggedHandle:
    def __init__(self, value: torch.Tensor, spec: GemmSpec, log: list[str]) -> None:
        self.value, self.spec, self.log = value, spec, log

    def result(self) -> torch.Tensor:
        self.log.append(f"wait {self.spec.layer} {self.spec.op}")
        return self.value


class _LoggedStep(torch.autograd.Function):
    """The identity, which logs when autograd reaches it: the PS's own work between linears."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, log: list[str]) -> torch.Tensor:  # type: ignore[override]
        ctx.log = log  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, dy: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.log.append("ps work")  # type: ignore[attr-defined]
        return dy, None


def test_a_weight_gradient_is_awaited_when_the_backward_pass_ends() -> None:
    """Backward waits for dX and goes on with autograd (the PS's work, the next linear's
    GEMMs) while dW is out; it takes every dW when the pass ends, and the gradients are
    torch's, bit for bit (the tied, the fused and the plain weights)."""
    log: list[str] = []

    class Logged(LocalExecutor):
        def submit(self, a: torch.Tensor, b: torch.Tensor, spec: GemmSpec) -> _LoggedHandle:  # type: ignore[override]
            log.append(f"submit {spec.layer} {spec.op}")
            return _LoggedHandle(super().submit(a, b, spec).result(), spec, log)

    torch.manual_seed(3)
    ctx = GemmContext(executor=Logged())
    qkv = [OffloadedLinear(6, n, name=f"p{n}", context=ctx).double() for n in (5, 3)]
    head = OffloadedLinear(8, 6, name="head", context=ctx).double()
    tied = nn.Parameter(torch.randn(6, 8, dtype=torch.float64))
    head.weight = tied
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)

    def model(x: torch.Tensor, linear: object) -> torch.Tensor:
        h = linear(x, qkv) if linear is not None else fused_linear(x, qkv, "qkv")
        h = _LoggedStep.apply(torch.tanh(h), log)
        y = F.linear(h, tied, head.bias) if linear is not None else head(h)
        return (y.sum(-1) + (x @ tied).pow(2).sum(-1)).sum()  # tied: a second use of the weight

    model(x, None).backward()
    assert log == ["submit qkv forward", "wait qkv forward", "submit head forward",
                   "wait head forward",
                   "submit head input_grad", "submit head weight_grad", "wait head input_grad",
                   "ps work",
                   "submit qkv input_grad", "submit qkv weight_grad", "wait qkv input_grad",
                   "wait head weight_grad", "wait qkv weight_grad"]
    got = [x.grad, tied.grad, head.bias.grad] + [p.grad for q in qkv for p in (q.weight, q.bias)]
    params = [x, tied, head.bias] + [p for q in qkv for p in (q.weight, q.bias)]
    for p in params:
        p.grad = None
    model(x, lambda x, ls: torch.cat([F.linear(x, q.weight, q.bias) for q in ls], -1)).backward()
    for g, p in zip(got, params):
        assert g is not None and p.grad is not None
        torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-15)


def test_executor_returning_a_wrong_shape_is_a_clear_error() -> None:
    class Wrong:
        def submit(self, a: torch.Tensor, b: torch.Tensor, spec: GemmSpec) -> DoneHandle:
            return DoneHandle(torch.zeros(a.shape[0], b.shape[1] + 1))

    layer = OffloadedLinear(4, 3, name="bad", context=GemmContext(executor=Wrong()))
    with pytest.raises(ExecutorResultError, match=r"bad forward .*\(2, 4\).*expected \(2, 3\)"):
        layer(torch.randn(2, 4))


# ------------------------------------------------------------------------------------------------
# Model


def test_opt_125m_builds_with_about_125m_parameters() -> None:
    opt125m = ModelSpec(hidden=768, layers=12, heads=12, ffn=3072, seq_len=2048, vocab=50272)
    model = OptDecoder(opt125m)
    n = count_parameters(model)
    assert n == opt125m.parameters  # ModelSpec's count, from the shape alone
    # OPT-125m has 125,239,296 parameters with its 2050 learned positions; we use 2048.
    assert n == 125_239_296 - 2 * 768
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert len(model.offloaded_linears()) == 6 * 12 + 1
    assert len(model.gemm_layers()) == 4 * 12 + 1  # q/k/v submitted as one linear
    assert model.lm_head.weight is model.embed_tokens.weight
    # With the byte vocabulary (256 tokens) the same shape has 86.8 M parameters.
    assert dataclasses.replace(opt125m, vocab=256).parameters == 86_825_472


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = OptDecoder(TINY).double()
    tokens = torch.randint(0, 256, (1, TINY.seq_len))
    changed = tokens.clone()
    changed[0, 9] = (tokens[0, 9] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[0, :9], after[0, :9])  # earlier positions cannot see token 9
    assert not torch.allclose(before[0, 9:], after[0, 9:])  # position 9 and later do


# ------------------------------------------------------------------------------------------------
# Data


def test_batches_are_reproducible_per_seed_and_step() -> None:
    corpus = builtin_corpus()
    a = BatchSampler(corpus, batch_size=4, seq_len=32, seed=7)
    b = BatchSampler(corpus, batch_size=4, seq_len=32, seed=7)
    x0, y0 = a.batch(0)
    assert x0.shape == y0.shape == (4, 32) and x0.dtype == y0.dtype == torch.int64
    assert torch.equal(x0[:, 1:], y0[:, :-1])  # targets are the next bytes
    for step in (0, 3, 11):
        assert all(torch.equal(u, v) for u, v in zip(a.batch(step), b.batch(step)))
    assert not torch.equal(a.batch(1)[0], x0)
    assert not torch.equal(BatchSampler(corpus, 4, 32, seed=8).batch(0)[0], x0)


def test_builtin_corpus_is_the_sorted_stdlib_sources_capped() -> None:
    corpus = builtin_corpus()
    files = stdlib_sources()
    assert len(corpus) == min(4 * 2**20, sum(p.stat().st_size for p in files))
    assert corpus.tokens[:200].numpy().tobytes() == files[0].read_bytes()[:200]
    assert all("site-packages" not in p.parts for p in files)
    assert load_corpus(DataSpec()).sha256 == corpus.sha256


def test_user_files_are_the_corpus(tmp_path: Path) -> None:
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_bytes(b"abcdefghijklmnopqrstuvwxyz" * 4)
    two.write_bytes(b"0123456789" * 3)
    corpus = load_corpus(DataSpec("files", (one, two)))
    text = one.read_bytes() + two.read_bytes()
    assert corpus.tokens.numpy().tobytes() == text
    x, y = BatchSampler(corpus, batch_size=3, seq_len=8, seed=0).batch(2)
    for row_x, row_y in zip(x, y):
        window = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
        assert window in text


def test_short_corpus_and_missing_file_are_clear_errors(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 16)
    with pytest.raises(DataError, match=r"has 16 bytes; a window of seq_len \+ 1 = 17 bytes"):
        BatchSampler(files_corpus([short]), batch_size=1, seq_len=16, seed=0)
    BatchSampler(files_corpus([short]), batch_size=1, seq_len=15, seed=0).batch(0)  # just fits
    with pytest.raises(DataError, match=r"job.data.files\[1\]: cannot read .*missing.txt"):
        files_corpus([short, tmp_path / "missing.txt"])


# ------------------------------------------------------------------------------------------------
# Checkpoints


def test_checkpoint_round_trip_is_bitwise(tmp_path: Path) -> None:
    job = tiny_job("float32")
    first = Trainer(job, seed=2)
    first.run(3)
    path = ckpt.save_checkpoint(first, tmp_path / ckpt.checkpoint_name(first.next_step))
    rng_at_save = torch.get_rng_state()
    later = first.run(2)
    weights = final_weights(first)

    executor = LocalExecutor()
    resumed = Trainer(job, seed=2, executor=executor)
    torch.rand(10)  # move the global RNG; loading must put it back
    assert ckpt.latest_checkpoint(tmp_path) == path
    assert ckpt.load_checkpoint(resumed, path) == 3
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    again = resumed.run(2)
    assert [r.loss for r in again] == [r.loss for r in later]
    assert [r.step for r in again] == [3, 4]
    for name, w in final_weights(resumed).items():
        assert torch.equal(w, weights[name]), name
    assert {s.b_key for s in executor.calls if s.layer == "lm_head" and s.op == "forward"} == {
        "embed_tokens.weight@3", "embed_tokens.weight@4"}


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Trainer(tiny_job("float32"), seed=4)
    trainer.run(1)
    path = ckpt.save_checkpoint(trainer, tmp_path / "latest.pt")
    before = path.read_bytes()
    trainer.run(1)

    def torn_save(obj: object, f: object) -> None:
        f.write(b"half a checkpoint")  # type: ignore[attr-defined]
        raise OSError("killed while writing")

    monkeypatch.setattr(ckpt.torch, "save", torn_save)
    with pytest.raises(OSError, match="killed while writing"):
        ckpt.save_checkpoint(trainer, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt"]  # no temp file left
    fresh = Trainer(tiny_job("float32"), seed=4)
    assert ckpt.load_checkpoint(fresh, path) == 1


def test_checkpoint_of_another_job_is_refused(tmp_path: Path) -> None:
    path = ckpt.save_checkpoint(Trainer(tiny_job("float32"), seed=4), tmp_path / "a.pt")
    other = Trainer(tiny_job("float32", model=dataclasses.replace(TINY, ffn=48)), seed=4)
    with pytest.raises(ckpt.CheckpointError, match=r"model_spec: checkpoint has .*'ffn': 64"):
        ckpt.load_checkpoint(other, path)
    (tmp_path / "torn.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="torn.pt: not a readable checkpoint"):
        ckpt.load_checkpoint(other, tmp_path / "torn.pt")
