"""What a pipeline stage or a data-parallel replica computes and holds: pure functions of the
model spec (no torch).

Symbols: ``h`` hidden, ``f`` ffn, ``V`` vocab, ``T`` seq_len, ``a`` heads, ``d = h / a``,
``r`` the rows (sequences) of a micro-batch, ``t = r·T`` its tokens, ``b`` bytes per element
(4 for float32, 8 for float64).

**GEMMs of one decoder layer, forward** (the engine's model, testbed/ps_backend/engine/model.py):
q, k, v, out projections ``[t x h] @ [h x h]``; fc1 ``[t x h] @ [h x f]``; fc2
``[t x f] @ [f x h]``; attention scores ``Q·Kᵀ`` and ``P·V`` for each of ``r·a`` (sequence,
head) pairs, ``[T x d] @ [d x T]`` and ``[T x T] @ [T x d]``. A batched attention product is
timed as one GEMM of the same FLOPs with its rows stacked (``m = r·a·T``): the device models are
fitted on single GEMMs. Backward of ``C[m x n] = A[m x k] @ B[k x n]``: ``dA[m x k] = dC @ Bᵀ``
(``m, n, k``) and ``dB[k x n] = Aᵀ @ dC`` (``k, m, n``). The LM head: ``[t x h] @ [h x V]``.

**Other work** (layer norms, softmax, residual adds, ReLU, the loss, AdamW) is memory-bound: its
time is the bytes it moves over the device's memory bandwidth. Per token per layer, forward,
we count ``16·h + 2·f + 3·a·T`` elements read or written (two norms ~4h each, two residual adds
3h each, q scaling 2h, ReLU 2f, softmax and mask ~3 per score); backward twice that. AdamW
reads a weight, its gradient and two moments and writes three: ``7·b`` bytes per parameter.

**Memory of a stage** (bytes): weights, gradients and Adam's two moments ``4·b·P`` for its
``P`` parameters, plus the activations every in-flight micro-batch keeps for backward (GPipe:
all ``m`` micro-batches of the step). Saved per token per layer: the norms' inputs and outputs
``4h``, q, k, v ``3h``, the attention probabilities and scores ``2·a·T``, the context ``h``,
fc1's output and ReLU's ``2f``: ``8h + 2f + 2·a·T`` elements (Korthikanti et al. 2022,
arXiv 2205.05198, count the same tensors for GPT without dropout masks); the head keeps the
final norm's output ``h`` and the log-softmax the loss saves ``V`` per token (the logits
themselves are not saved: the head's backward needs its input and weight only).
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.topology import JobSpec, ModelSpec

DTYPE_BYTES = {"float32": 4, "float64": 8}
TOKEN_BYTES = 4  # a token id as int32 on the wire (byte-level and OPT's 50k vocabularies fit)


def split_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, end) row ranges, sizes differing by at most one."""
    if not 1 <= parts <= rows:
        raise ValueError(f"cannot cut {rows} rows into {parts} non-empty parts")
    base, extra = divmod(rows, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out



@dataclass(frozen=True)
class Gemm:
    """``C[m x n] = A[m x k] @ B[k x n]``; ``op`` as in the engine (forward, input_grad...)."""

    m: int
    k: int
    n: int
    op: str

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


def _with_backward(fwd: list[Gemm]) -> tuple[list[Gemm], list[Gemm]]:
    bwd: list[Gemm] = []
    for g in reversed(fwd):
        bwd.append(Gemm(g.m, g.n, g.k, "input_grad"))
        bwd.append(Gemm(g.k, g.m, g.n, "weight_grad"))
    return fwd, bwd


def layer_gemms(spec: ModelSpec, rows: int) -> tuple[list[Gemm], list[Gemm]]:
    """(forward, backward) GEMMs of one decoder layer for ``rows`` sequences."""
    h, f, T, a = spec.hidden, spec.ffn, spec.seq_len, spec.heads
    d, t = h // a, rows * T
    pairs = rows * a
    fwd = [Gemm(t, h, h, "forward")] * 3 + [
        Gemm(pairs * T, d, T, "forward"),  # Q·Kᵀ, all (sequence, head) pairs stacked
        Gemm(pairs * T, T, d, "forward"),  # P·V
        Gemm(t, h, h, "forward"), Gemm(t, h, f, "forward"), Gemm(t, f, h, "forward")]
    return _with_backward(fwd)


def head_gemms(spec: ModelSpec, rows: int) -> tuple[list[Gemm], list[Gemm]]:
    """(forward, backward) GEMMs of the LM head for ``rows`` sequences."""
    return _with_backward([Gemm(rows * spec.seq_len, spec.hidden, spec.vocab, "forward")])


def layer_params(spec: ModelSpec) -> int:
    """Parameters of one decoder layer (4 projections with biases, fc1, fc2, two norms)."""
    h, f = spec.hidden, spec.ffn
    return 4 * (h * h + h) + 2 * h * f + f + h + 4 * h


def embed_params(spec: ModelSpec) -> int:
    """Token and position embeddings."""
    return (spec.vocab + spec.seq_len) * spec.hidden


def head_params(spec: ModelSpec) -> int:
    """The final norm and the LM head's weight (a copy of the tied embedding on a last stage)."""
    return 2 * spec.hidden + tied_params(spec)


def tied_params(spec: ModelSpec) -> int:
    """The LM head's weight, tied to the token embedding: ``V·h``."""
    return spec.vocab * spec.hidden


def stage_params(spec: ModelSpec, layers: int, first: bool, last: bool) -> int:
    """Parameters of a pipeline stage: its ``layers`` decoder layers, the embeddings on the first
    stage, the final norm and LM head on the last. The first and last of several stages each
    hold a copy of the tied weight (they exchange its gradient); one stage that is both holds
    it once, as :class:`~testbed.baselines.engine.Stage` keeps it tied."""
    n = layers * layer_params(spec)
    if first:
        n += embed_params(spec)
    if last:
        n += head_params(spec) - (tied_params(spec) if first else 0)
    return n


def layer_elementwise_bytes(spec: ModelSpec, rows: int, dtype_bytes: int) -> tuple[float, float]:
    """(forward, backward) bytes of one layer's memory-bound work for ``rows`` sequences."""
    per_token = 16 * spec.hidden + 2 * spec.ffn + 3 * spec.heads * spec.seq_len
    fwd = float(rows * spec.seq_len * per_token * dtype_bytes)
    return fwd, 2 * fwd


def head_elementwise_bytes(spec: ModelSpec, rows: int, dtype_bytes: int) -> tuple[float, float]:
    """(forward, backward) bytes of the final norm, softmax and loss for ``rows`` sequences."""
    fwd = float(rows * spec.seq_len * (4 * spec.hidden + 3 * spec.vocab) * dtype_bytes)
    return fwd, 2 * fwd


def optimizer_bytes(params: int, dtype_bytes: int) -> float:
    """Bytes AdamW moves for ``params`` parameters (read 4 tensors, write 3)."""
    return 7.0 * params * dtype_bytes


def state_bytes(params: int, dtype_bytes: int) -> int:
    """Weights, gradients and Adam's two moments."""
    return 4 * params * dtype_bytes


def layer_activation_bytes(spec: ModelSpec, rows: int, dtype_bytes: int) -> int:
    """Activations one decoder layer keeps for backward, for ``rows`` sequences."""
    per_token = 8 * spec.hidden + 2 * spec.ffn + 2 * spec.heads * spec.seq_len
    return rows * spec.seq_len * per_token * dtype_bytes


def head_activation_bytes(spec: ModelSpec, rows: int, dtype_bytes: int) -> int:
    """Activations the final norm and LM head keep for backward, for ``rows`` sequences."""
    return rows * spec.seq_len * (spec.hidden + spec.vocab) * dtype_bytes


def boundary_bytes(spec: ModelSpec, rows: int, dtype_bytes: int) -> int:
    """The activation one stage sends the next for ``rows`` sequences (and its gradient back)."""
    return rows * spec.seq_len * spec.hidden * dtype_bytes


def model_params(spec: ModelSpec) -> int:
    """All parameters (the tied head counted once), as testbed.topology.model_parameters."""
    return embed_params(spec) + spec.layers * layer_params(spec) + 2 * spec.hidden


def replica_bytes(job: JobSpec, rows: int) -> int:
    """Memory of a whole-model replica training on ``rows`` sequences at once."""
    b = DTYPE_BYTES[job.dtype]
    spec = job.model
    return (state_bytes(model_params(spec), b) + spec.layers * layer_activation_bytes(spec, rows, b)
            + head_activation_bytes(spec, rows, b))


def replica_step_work(spec: ModelSpec, rows: int, dtype_bytes: int) -> tuple[list[Gemm], float]:
    """A whole-model replica's step on ``rows`` sequences: its GEMMs in the order it runs them
    (forward, head, backward) and the bytes of its memory-bound work (the optimizer apart)."""
    lf, lb = layer_gemms(spec, rows)
    hf, hb = head_gemms(spec, rows)
    ef, eb = layer_elementwise_bytes(spec, rows, dtype_bytes)
    hef, heb = head_elementwise_bytes(spec, rows, dtype_bytes)
    return lf * spec.layers + hf + hb + lb * spec.layers, spec.layers * (ef + eb) + hef + heb


def stage_work(spec: ModelSpec, layers: int, with_head: bool, kind: str, rows: int,
               dtype_bytes: int) -> tuple[list[Gemm], float]:
    """A pipeline stage's forward (``kind`` "F") or backward ("B") pass of one micro-batch of
    ``rows`` sequences over ``layers`` layers, plus the head on the last stage: its GEMMs and
    the bytes of its memory-bound work."""
    forward = kind == "F"
    lf, lb = layer_gemms(spec, rows)
    ef, eb = layer_elementwise_bytes(spec, rows, dtype_bytes)
    gemms = (lf if forward else lb) * layers
    mem = (ef if forward else eb) * layers
    if with_head:
        hf, hb = head_gemms(spec, rows)
        hef, heb = head_elementwise_bytes(spec, rows, dtype_bytes)
        gemms = gemms + (hf if forward else hb)
        mem += hef if forward else heb
    return gemms, mem


def step_gemm_flops(job: JobSpec) -> float:
    """FLOPs of every GEMM of one training step (attention products included)."""
    spec, rows = job.model, job.batch_size
    fwd, bwd = layer_gemms(spec, rows)
    hf, hb = head_gemms(spec, rows)
    return spec.layers * sum(g.flops for g in fwd + bwd) + sum(g.flops for g in hf + hb)


def step_elementwise_bytes(job: JobSpec) -> float:
    """Bytes of the memory-bound work of one training step, AdamW included."""
    b = DTYPE_BYTES[job.dtype]
    spec = job.model
    lf, lb = layer_elementwise_bytes(spec, job.batch_size, b)
    hf, hb = head_elementwise_bytes(spec, job.batch_size, b)
    return spec.layers * (lf + lb) + hf + hb + optimizer_bytes(model_params(spec), b)
