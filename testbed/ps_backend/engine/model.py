"""An OPT-style decoder-only transformer whose every linear layer is an :class:`OffloadedLinear`.

Shape (Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models", arXiv 2205.01068;
the pre-LayerNorm variant used by OPT-125m)::

    h = embed_tokens(tokens) + embed_positions(0..T-1)                 # [B, T, hidden]
    for each layer:  h = h + out_proj(attention(qkv_proj(LN(h))))   # causal; qkv = q|k|v
                     h = h + fc2(relu(fc1(LN(h))))
    logits = lm_head(final_layer_norm(h))       # lm_head.weight is embed_tokens.weight (tied)

Layer names (they appear in every :class:`GemmSpec`): ``layers.<i>.self_attn.qkv_proj``,
``layers.<i>.self_attn.out_proj``, ``layers.<i>.fc1``, ``layers.<i>.fc2``, ``lm_head``
(:meth:`OptDecoder.gemm_layers`). ``qkv_proj`` is the q, k and v projections of one input applied
as one linear (:func:`fused_linear`): one GEMM of each kind where three would each wait for their
own first and last blocks. The parameters stay the three projections' own (``state_dict``:
``layers.<i>.self_attn.{q,k,v,out}_proj.{weight,bias}``, as OPT names them); the LM head's b_keys
name the tied parameter, ``embed_tokens.weight``.

What stays on the PS (not GEMMs of a weight): embeddings, layer norms, the attention scores
``Q·Kᵀ`` and ``P·V`` (batched, activation × activation), the causal mask and softmax (torch's
``scaled_dot_product_attention``), ReLU.

Departures from OPT, on purpose: no dropout (runs must be deterministic); positions start at 0
(OPT offsets them by 2); the vocabulary is the model spec's (256 byte tokens by default).
Initialization follows OPT: weights and embeddings N(0, 0.02), biases 0, layer norms (1, 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from testbed.ps_backend.engine.offload import GemmContext, OffloadedLinear, fused_linear
from testbed.topology import ModelSpec


@dataclass(frozen=True)
class GemmLayer:
    """A linear as the executor sees it: its GemmSpec layer name, shape and weight b_key name."""

    name: str
    in_features: int
    out_features: int
    weight_key: str

    @classmethod
    def of(cls, lin: OffloadedLinear) -> GemmLayer:
        return cls(lin.name, lin.in_features, lin.out_features, lin.weight_key)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention; the projections are offloaded, q/k/v as one GEMM."""

    def __init__(self, spec: ModelSpec, prefix: str, context: GemmContext) -> None:
        super().__init__()
        if spec.hidden % spec.heads:
            raise ValueError(f"hidden ({spec.hidden}) must be divisible by heads ({spec.heads})")
        self.heads = spec.heads
        self.head_dim = spec.hidden // spec.heads
        h = spec.hidden
        self.q_proj = OffloadedLinear(h, h, name=f"{prefix}.q_proj", context=context)
        self.k_proj = OffloadedLinear(h, h, name=f"{prefix}.k_proj", context=context)
        self.v_proj = OffloadedLinear(h, h, name=f"{prefix}.v_proj", context=context)
        self.out_proj = OffloadedLinear(h, h, name=f"{prefix}.out_proj", context=context)
        self.qkv_name = f"{prefix}.qkv_proj"

    @property
    def qkv(self) -> tuple[OffloadedLinear, OffloadedLinear, OffloadedLinear]:
        """The projections applied as one linear, in output order."""
        return self.q_proj, self.k_proj, self.v_proj

    def gemm_layers(self) -> list[GemmLayer]:
        """The submitted linears: q/k/v as one (``qkv_proj``), then ``out_proj``."""
        qkv = GemmLayer(self.qkv_name, self.q_proj.in_features,
                        sum(p.out_features for p in self.qkv), f"{self.qkv_name}.weight")
        return [qkv, GemmLayer.of(self.out_proj)]

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, heads, T, head_dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape [B, T, hidden]; position t sees positions <= t."""
        b, t, hidden = x.shape
        qkv = fused_linear(x, self.qkv, self.qkv_name)
        q, k, v = (self._split(p) for p in qkv.split(hidden, dim=-1))
        # softmax(Q·Kᵀ/√d + causal mask)·V on the PS, by torch's fused kernel: it never holds
        # the [B, heads, T, T] scores, and at OPT-125m's shape (B 16, T 512) forward and
        # backward take a third of the explicit products' time on a 2-core host
        # (docs/engine.md, "Decisions")
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(ctx.transpose(1, 2).reshape(b, t, hidden))


class DecoderLayer(nn.Module):
    """One pre-LayerNorm decoder layer: attention block and ReLU feed-forward block."""

    def __init__(self, spec: ModelSpec, index: int, context: GemmContext) -> None:
        super().__init__()
        prefix = f"layers.{index}"
        self.self_attn_layer_norm = nn.LayerNorm(spec.hidden)
        self.self_attn = SelfAttention(spec, f"{prefix}.self_attn", context)
        self.final_layer_norm = nn.LayerNorm(spec.hidden)
        self.fc1 = OffloadedLinear(spec.hidden, spec.ffn, name=f"{prefix}.fc1", context=context)
        self.fc2 = OffloadedLinear(spec.ffn, spec.hidden, name=f"{prefix}.fc2", context=context)

    def gemm_layers(self) -> list[GemmLayer]:
        """The submitted linears of the layer, in forward order."""
        return [*self.self_attn.gemm_layers(), GemmLayer.of(self.fc1), GemmLayer.of(self.fc2)]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Apply the layer to hidden states [B, T, hidden]."""
        h = h + self.self_attn(self.self_attn_layer_norm(h))
        return h + self.fc2(F.relu(self.fc1(self.final_layer_norm(h))))


class OptDecoder(nn.Module):
    """The whole language model: tokens [B, T] int64 -> logits [B, T, vocab]."""

    def __init__(self, spec: ModelSpec, context: GemmContext | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.context = context if context is not None else GemmContext()
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        self.embed_positions = nn.Embedding(spec.seq_len, spec.hidden)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, self.context)
                                    for i in range(spec.layers))
        self.final_layer_norm = nn.LayerNorm(spec.hidden)
        self.lm_head = OffloadedLinear(spec.hidden, spec.vocab, bias=False, name="lm_head",
                                       context=self.context, weight_key="embed_tokens.weight")
        self.lm_head.weight = self.embed_tokens.weight  # type: ignore[assignment]  # tied (OPT)
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=0.02)
        nn.init.normal_(self.embed_positions.weight, mean=0.0, std=0.02)

    def offloaded_linears(self) -> list[OffloadedLinear]:
        """Every offloaded linear layer (the parameters' holders), in forward order."""
        return [m for m in self.modules() if isinstance(m, OffloadedLinear)]

    def gemm_layers(self) -> list[GemmLayer]:
        """What the executor sees: each submitted linear in forward order, q/k/v fused."""
        out = [g for layer in self.layers for g in cast(DecoderLayer, layer).gemm_layers()]
        return [*out, GemmLayer.of(self.lm_head)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] for tokens [B, T] (T <= seq_len)."""
        t = tokens.shape[1]
        if t > self.spec.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len {self.spec.seq_len}")
        positions = torch.arange(t, device=tokens.device)
        h = self.embed_tokens(tokens) + self.embed_positions(positions)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.final_layer_norm(h))


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters of a built model (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def gemm_flops_per_token(spec: ModelSpec) -> float:
    """Forward FLOPs of the offloaded GEMMs per token (2·in·out per linear); backward is 2×."""
    h, f = spec.hidden, spec.ffn
    return 2.0 * (spec.layers * (4 * h * h + 2 * h * f) + h * spec.vocab)


__all__ = ["OptDecoder", "DecoderLayer", "GemmLayer", "SelfAttention",
           "count_parameters", "gemm_flops_per_token"]
