"""The GEMM chain of one training step, from the model spec alone (no torch, no tensors).

The same GEMMs, in the same order and with the same names, as the engine submits
(:mod:`testbed.ps_backend.engine.offload`, :mod:`testbed.ps_backend.engine.model`): per offloaded
linear ``forward`` ``Y[M,out] = X[M,in] @ Wᵀ``, then in backward ``input_grad``
``dX[M,in] = dY[M,out] @ W`` and ``weight_grad`` ``dW[out,in] = dYᵀ[out,M] @ X[M,in]``, with
``M = batch_size x seq_len``. Forward runs layer by layer, each GEMM waiting for the previous
(the engine waits on every forward result); backward submits a layer's two GEMMs together and
runs the layers in reverse (autograd's order: the LM head first, then per decoder layer
``fc2, fc1, out_proj, qkv_proj``; the q, k and v projections are one linear, see
:func:`~testbed.ps_backend.engine.offload.fused_linear`).

Each GEMM carries the tensor names of its operands (the same tensor: ``W`` in forward and in
``dX``, ``dY`` in ``dX`` and ``dW``, ``X`` in forward and ``dW``) and whether it
uses that tensor transposed (``Wᵀ`` in forward, ``dYᵀ`` in ``dW``): the PS derives both from
storage (:class:`~testbed.ps_backend.executor.OperandKeys`) and this module from the layer names
(:data:`OPERANDS`, the table of :mod:`testbed.ps_backend.engine.offload`). They are what the
bound calls held data and what the scheduler names cached blocks by
(:func:`~testbed.ps_backend.scheduler.block_key`, in the stored tensor's coordinates), so a
block a device received for one GEMM is a cache hit for another exactly as on the PS;
``tests/unit/test_simulate_operand_keys.py`` checks the names against the engine's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.ps_backend.tiler import gemm_flops
from testbed.topology import JobSpec

# Which tensor each operand of a linear's GEMMs is, and whether the GEMM uses it transposed
# (offload.py's table: forward Y = X·Wᵀ, input_grad dX = dY·W, weight_grad dW = dYᵀ·X).
OPERANDS = {"forward": (("X", False), ("W", True)),
            "input_grad": (("dY", False), ("W", False)),
            "weight_grad": (("dY", True), ("X", False))}


@dataclass(frozen=True)
class ChainGemm:
    """One GEMM of the step: ``C[m x n] = A[m x k] @ B[k x n]``."""

    layer: str
    op: str  # forward | input_grad | weight_grad
    m: int
    k: int
    n: int
    a_name: str  # the operands' tensors (a weight: its parameter's name)
    b_name: str
    weight_key: str  # the weight parameter's name (b_keys of forward and input_grad)
    a_transposed: bool = False  # the GEMM uses the tensor transposed (Wᵀ, dYᵀ)
    b_transposed: bool = False

    @property
    def flops(self) -> float:
        return gemm_flops(self.m, self.k, self.n)

    def keys(self, version: int) -> tuple[str, str]:
        """The PS's cache keys of A's and B's tensors at a weight version: a weight's is its
        GemmSpec b_key (``<param>@<version>``), an activation's its name in the step."""
        return f"{self.a_name}@{version}", f"{self.b_name}@{version}"


@dataclass(frozen=True)
class Linear:
    name: str
    d_in: int
    d_out: int
    input_name: str  # the tensor X it reads
    weight_key: str


def linears(job: JobSpec) -> list[Linear]:
    """Every offloaded linear layer in forward order."""
    spec = job.model
    h, f = spec.hidden, spec.ffn
    out: list[Linear] = []
    for i in range(spec.layers):
        p = f"layers.{i}"
        out.append(Linear(f"{p}.self_attn.qkv_proj", h, 3 * h, f"{p}.self_attn:in",
                          f"{p}.self_attn.qkv_proj.weight"))
        out.append(Linear(f"{p}.self_attn.out_proj", h, h, f"{p}.self_attn.out_proj:in",
                          f"{p}.self_attn.out_proj.weight"))
        out.append(Linear(f"{p}.fc1", h, f, f"{p}.fc1:in", f"{p}.fc1.weight"))
        out.append(Linear(f"{p}.fc2", f, h, f"{p}.fc2:in", f"{p}.fc2.weight"))
    out.append(Linear("lm_head", h, spec.vocab, "lm_head:in", "embed_tokens.weight"))
    return out


def step_chain(job: JobSpec) -> list[list[ChainGemm]]:
    """The step's GEMMs as consecutive submissions: forward one by one, backward in pairs."""
    tokens = job.batch_size * job.model.seq_len
    layers = linears(job)

    def gemm(lin: Linear, op: str, m: int, k: int, n: int) -> ChainGemm:
        tensors = {"X": lin.input_name, "W": lin.weight_key, "dY": f"{lin.name}:dY"}
        (a, a_t), (b, b_t) = OPERANDS[op]
        return ChainGemm(lin.name, op, m, k, n, tensors[a], tensors[b], lin.weight_key,
                         a_t, b_t)
    chain: list[list[ChainGemm]] = []
    for lin in layers:
        chain.append([gemm(lin, "forward", tokens, lin.d_in, lin.d_out)])
    for lin in reversed(layers):
        chain.append([gemm(lin, "input_grad", tokens, lin.d_out, lin.d_in),
                      gemm(lin, "weight_grad", lin.d_out, tokens, lin.d_in)])
    return chain
