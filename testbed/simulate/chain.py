"""The GEMM chain of one training step, from the model spec alone (no torch, no tensors).

The same GEMMs, in the same order and with the same names, as the engine submits
(:mod:`testbed.ps_backend.engine.offload`, :mod:`testbed.ps_backend.engine.model`): per offloaded
linear ``forward`` ``Y[M,out] = X[M,in] @ Wᵀ``, then in backward ``input_grad``
``dX[M,in] = dY[M,out] @ W`` and ``weight_grad`` ``dW[out,in] = dYᵀ[out,M] @ X[M,in]``, with
``M = batch_size x seq_len``. Forward runs layer by layer, each GEMM waiting for the previous
(the engine waits on every forward result); backward submits a layer's two GEMMs together and
runs the layers in reverse (autograd's order: the LM head first, then per decoder layer
``fc2, fc1, out_proj, v_proj, k_proj, q_proj``).

Each GEMM carries the tensor names the bound uses for held data (the same tensor: ``X`` of q/k/v,
``W`` in forward and in ``dX``, ``dY`` in ``dX`` and ``dW``, ``X`` in forward and ``dW``), which
the PS derives from storage pointers and this module from the layer names.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.ps_backend.tiler import gemm_flops
from testbed.topology import JobSpec


@dataclass(frozen=True)
class ChainGemm:
    """One GEMM of the step: ``C[m x n] = A[m x k] @ B[k x n]``."""

    layer: str
    op: str  # forward | input_grad | weight_grad
    m: int
    k: int
    n: int
    a_name: str
    b_name: str
    weight_key: str  # the weight parameter's name (b_keys of forward and input_grad)

    @property
    def flops(self) -> float:
        return gemm_flops(self.m, self.k, self.n)


@dataclass(frozen=True)
class Linear:
    name: str
    d_in: int
    d_out: int
    input_name: str  # the tensor X it reads (shared by q/k/v)
    weight_key: str


def linears(job: JobSpec) -> list[Linear]:
    """Every offloaded linear layer in forward order."""
    spec = job.model
    h, f = spec.hidden, spec.ffn
    out: list[Linear] = []
    for i in range(spec.layers):
        p = f"layers.{i}"
        attn_in = f"{p}.self_attn:in"
        for proj in ("q_proj", "k_proj", "v_proj"):
            out.append(Linear(f"{p}.self_attn.{proj}", h, h, attn_in,
                              f"{p}.self_attn.{proj}.weight"))
        out.append(Linear(f"{p}.self_attn.out_proj", h, h, f"{p}.self_attn.out_proj:in",
                          f"{p}.self_attn.out_proj.weight"))
        out.append(Linear(f"{p}.fc1", h, f, f"{p}.fc1:in", f"{p}.fc1.weight"))
        out.append(Linear(f"{p}.fc2", f, h, f"{p}.fc2:in", f"{p}.fc2.weight"))
    out.append(Linear("lm_head", h, spec.vocab, "lm_head:in", "embed_tokens.weight"))
    return out


def _backward_order(layers: list[Linear]) -> list[Linear]:
    """Autograd's order: reverse, except q/k/v come back as v, k, q after out_proj."""
    return list(reversed(layers))


def step_chain(job: JobSpec) -> list[list[ChainGemm]]:
    """The step's GEMMs as consecutive submissions: forward one by one, backward in pairs."""
    tokens = job.batch_size * job.model.seq_len
    layers = linears(job)
    chain: list[list[ChainGemm]] = []
    for lin in layers:
        chain.append([ChainGemm(lin.name, "forward", tokens, lin.d_in, lin.d_out,
                                lin.input_name, lin.weight_key, lin.weight_key)])
    for lin in _backward_order(layers):
        dy = f"{lin.name}:dY"
        chain.append([
            ChainGemm(lin.name, "input_grad", tokens, lin.d_out, lin.d_in, dy, lin.weight_key,
                      lin.weight_key),
            ChainGemm(lin.name, "weight_grad", lin.d_out, tokens, lin.d_in, dy, lin.input_name,
                      lin.weight_key)])
    return chain
