"""The baselines' arithmetic, really executed: a GPipe pipeline and data-parallel replicas.

Both run the engine's own model (:class:`~testbed.ps_backend.engine.model.OptDecoder`), data
(:class:`~testbed.ps_backend.engine.data.BatchSampler`) and AdamW, in one process, and reproduce
the single-process :class:`~testbed.ps_backend.engine.trainer.Trainer` step for step (float64:
losses within 1e-8, ``tests/unit/test_baselines_engine.py``). They are the "same numbers" half of
issue #12; the costs (who computes, how long, which bytes cross which link) are the simulator's
(:mod:`testbed.baselines.pipeline_sim`, :mod:`testbed.baselines.data_parallel_sim`).

**Pipeline** (:class:`PipelineTrainer`, GPipe, Huang et al. 2019, arXiv 1811.06965): stage ``s``
holds decoder layers ``bounds[s]`` (contiguous); stage 0 also holds the embeddings, the last
stage the final layer norm and the LM head. The batch is cut into ``micro_batches`` row blocks;
every micro-batch goes forward through all stages (a stage sends its output activation
``[rows, seq_len, hidden]`` to the next: it crosses as a detached copy, so nothing but those
bytes links two stages), then every micro-batch goes backward in reverse order (the gradient of
that activation goes back). Each micro-batch's loss is its mean cross-entropy times its share of
the batch's tokens, so gradients accumulated over micro-batches equal the whole batch's. The LM
head is tied to the token embedding (OPT): with more than one stage the first and last stage
each hold a copy and exchange their gradients before the optimizer (as Megatron-LM does), so
both copies stay equal. Each stage runs its own AdamW over its own parameters.

**Data-parallel** (:class:`DataParallelTrainer`): ``replicas`` full copies of the model, each
with its own AdamW; replica ``r`` trains on its share of the batch's rows. ``local_steps = 1``:
every step the PS averages the gradients (weighted by rows) and every replica applies the same
update (synchronous data parallelism). ``local_steps = H > 1`` (DiLoCo, Douillard et al. 2023,
arXiv 2311.08105): each replica takes H AdamW steps on its own shares alone; then the PS
averages the replicas' parameter changes ``θ_global - θ_r`` as an outer gradient, steps an outer
SGD with Nesterov momentum (DiLoCo's: lr 0.7, momentum 0.9) and sends ``θ_global`` back. A
replica absent for a step or round (churn) is dropped from that average: the step's gradient
(H = 1) or the round's outer gradient (H > 1) and the loss average over the replicas present,
weighted by their rows (the absent replicas' rows are not trained that step). With H = 1 a
replica back after missing a step first takes the parameters and AdamW state of one that took
part (a rejoining device receives them), so the replicas present always agree.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from testbed.baselines.cost import split_rows
from testbed.baselines.membership import ReplicaMembership, row_weights
from testbed.ps_backend.engine.data import BatchSampler, Corpus, load_corpus
from testbed.ps_backend.engine.model import OptDecoder
from testbed.ps_backend.engine.offload import OffloadedLinear
from testbed.ps_backend.engine.optim import SGD
from testbed.ps_backend.engine.trainer import DTYPES, adamw
from testbed.topology import JobSpec

DILOCO_OUTER_LR = 0.7  # Douillard et al. 2023 (arXiv 2311.08105), section 3
DILOCO_OUTER_MOMENTUM = 0.9  # ibid., Nesterov


@dataclass(frozen=True)
class BaselineStep:
    """What one step of a baseline produced (loss as the single-process trainer reports it)."""

    step: int
    loss: float  # mean cross-entropy over the batch's tokens (of the replicas present), nats
    bytes_sent: dict[str, int]  # what crossed between parties this step: "<from>-><to>": bytes


def even_bounds(layers: int, stages: int) -> list[tuple[int, int]]:
    """Decoder layers cut into ``stages`` contiguous ranges of near-equal size."""
    return split_rows(layers, stages)


def _reference_model(job: JobSpec, seed: int) -> OptDecoder:
    """The model exactly as :class:`Trainer` initialises it (same RNG draws)."""
    if job.dtype not in DTYPES:
        raise ValueError(f"job.dtype: expected one of {tuple(DTYPES)}, got {job.dtype!r}")
    torch.manual_seed(seed)
    return OptDecoder(job.model).to(DTYPES[job.dtype])


class Stage(nn.Module):
    """One pipeline stage: decoder layers [first, end), plus embeddings (first stage) and the
    final norm and LM head (last stage)."""

    def __init__(self, model: OptDecoder, first: int, end: int, is_first: bool,
                 is_last: bool) -> None:
        super().__init__()
        parts: dict[str, nn.Module] = {"layers": nn.ModuleList(model.layers[first:end])}
        if is_first:
            parts["embed_tokens"] = model.embed_tokens
            parts["embed_positions"] = model.embed_positions
        if is_last:
            parts["final_layer_norm"] = model.final_layer_norm
            parts["lm_head"] = model.lm_head
        # one deepcopy of all parts: a weight tied inside the stage stays tied
        copied = copy.deepcopy(parts)
        self.layers = cast(nn.ModuleList, copied["layers"])
        self.embed_tokens = cast("nn.Embedding | None", copied.get("embed_tokens"))
        self.embed_positions = cast("nn.Embedding | None", copied.get("embed_positions"))
        self.final_layer_norm = cast("nn.LayerNorm | None", copied.get("final_layer_norm"))
        self.lm_head = cast("OffloadedLinear | None", copied.get("lm_head"))
        self.is_first, self.is_last = is_first, is_last
        self.first, self.end = first, end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens [B, T] (first stage) or hidden states [B, T, h] -> hidden states or logits."""
        if self.embed_tokens is not None and self.embed_positions is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.embed_tokens(x) + self.embed_positions(positions)
        for layer in self.layers:
            x = layer(x)
        if self.lm_head is not None and self.final_layer_norm is not None:
            x = self.lm_head(self.final_layer_norm(x))
        return x


class PipelineTrainer:
    """GPipe over contiguous stages, one process; see the module docstring."""

    def __init__(self, job: JobSpec, seed: int, bounds: Sequence[tuple[int, int]],
                 micro_batches: int, corpus: Corpus | None = None) -> None:
        layers = job.model.layers
        if not bounds or bounds[0][0] != 0 or bounds[-1][1] != layers or any(
                a >= b for a, b in bounds) or any(
                bounds[i][1] != bounds[i + 1][0] for i in range(len(bounds) - 1)):
            raise ValueError(f"stage bounds {list(bounds)} must cut layers 0..{layers} into "
                             f"contiguous non-empty ranges")
        self.job, self.seed = job, seed
        self.micro_batches = micro_batches
        self.rows = split_rows(job.batch_size, micro_batches)
        model = _reference_model(job, seed)
        n = len(bounds)
        self.stages = [Stage(model, a, b, i == 0, i == n - 1) for i, (a, b) in enumerate(bounds)]
        self.optimizers = [adamw(list(s.parameters()), job) for s in self.stages]
        self.sampler = BatchSampler(corpus if corpus is not None else load_corpus(job.data),
                                    job.batch_size, job.model.seq_len, seed)
        self.next_step = 0

    def _tied(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if len(self.stages) == 1:
            return None
        embed, head = self.stages[0].embed_tokens, self.stages[-1].lm_head
        assert embed is not None and head is not None
        return embed.weight, head.weight

    def step(self) -> BaselineStep:
        """One GPipe step: all micro-batches forward, all backward, tied grads, AdamW per stage."""
        step = self.next_step
        inputs, targets = self.sampler.batch(step)
        total_tokens = targets.numel()
        sent: dict[str, int] = {}

        def count(key: str, t: torch.Tensor) -> None:
            sent[key] = sent.get(key, 0) + t.numel() * t.element_size()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        for s in self.stages:
            s.train()
        n = len(self.stages)
        saved: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per mb: (input, output)
        losses: list[torch.Tensor] = []
        for a, b in self.rows:  # forward of every micro-batch (GPipe)
            x: torch.Tensor = inputs[a:b]
            per_stage = []
            for i, stage in enumerate(self.stages):
                out = stage(x)
                per_stage.append((x, out))
                if i < n - 1:  # the activation crosses to the next stage's device
                    x = out.detach().clone().requires_grad_(True)
                    count(f"stage{i}->stage{i + 1}", x)
            logits = per_stage[-1][1]
            tgt = targets[a:b]
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
                          * (tgt.numel() / total_tokens))
            saved.append(per_stage)
        for j in reversed(range(len(self.rows))):  # backward, last micro-batch first
            losses[j].backward()
            for i in range(n - 1, 0, -1):
                x_in = saved[j][i][0]
                grad = x_in.grad
                assert grad is not None
                count(f"stage{i}->stage{i - 1}", grad)
                saved[j][i - 1][1].backward(grad.clone())
        tied = self._tied()
        if tied is not None:  # the two copies of the tied embedding exchange gradients
            w0, w1 = tied
            g0, g1 = w0.grad, w1.grad
            assert g0 is not None and g1 is not None
            count(f"stage0->stage{n - 1}", g0)
            count(f"stage{n - 1}->stage0", g1)
            total = g0 + g1
            w0.grad, w1.grad = total, total.clone()
        for opt in self.optimizers:
            opt.step()
        self.next_step += 1
        loss = float(sum(float(x.detach()) for x in losses))
        return BaselineStep(step, loss, sent)

    def run(self, steps: int) -> list[BaselineStep]:
        """Run ``steps`` more steps."""
        return [self.step() for _ in range(steps)]

    def state(self) -> dict[str, torch.Tensor]:
        """The model's parameters by the reference model's names (from the owning stage)."""
        out: dict[str, torch.Tensor] = {}
        for s in self.stages:
            for name, p in s.named_parameters():
                if name.startswith("layers."):
                    _, idx, rest = name.split(".", 2)
                    name = f"layers.{s.first + int(idx)}.{rest}"
                if name == "lm_head.weight":
                    continue  # tied: embed_tokens.weight, held by stage 0
                out.setdefault(name, p.detach())
        return out


class DataParallelTrainer:
    """Replicas on shares of the batch; averaged gradients (H = 1) or DiLoCo rounds (H > 1)."""

    def __init__(self, job: JobSpec, seed: int, replicas: int, local_steps: int = 1,
                 outer_lr: float = DILOCO_OUTER_LR,
                 outer_momentum: float = DILOCO_OUTER_MOMENTUM,
                 corpus: Corpus | None = None) -> None:
        if local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {local_steps}")
        self.job, self.seed = job, seed
        self.local_steps = local_steps
        self.rows = split_rows(job.batch_size, replicas)
        model = _reference_model(job, seed)
        self.replicas = [copy.deepcopy(model) for _ in range(replicas)]
        self.optimizers = [adamw(list(m.parameters()), job) for m in self.replicas]
        self.global_model = copy.deepcopy(model)  # the PS's copy (DiLoCo's outer parameters)
        self.outer = SGD(self.global_model.parameters(), lr=outer_lr, momentum=outer_momentum,
                         nesterov=outer_momentum > 0)
        self.sampler = BatchSampler(corpus if corpus is not None else load_corpus(job.data),
                                    job.batch_size, job.model.seq_len, seed)
        self.next_step = 0
        self.membership = ReplicaMembership(replicas, local_steps)
        self._source = 0  # a replica that took part in the last step (H = 1: all hold its state)

    def _param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.global_model.parameters())

    def step(self, present: Sequence[bool] | None = None) -> BaselineStep:
        """One step; ``present[r]`` False: replica r's device is gone for this step (it is
        dropped from it and its round, :class:`~testbed.baselines.membership.
        ReplicaMembership`)."""
        step = self.next_step
        here = list(present) if present is not None else [True] * len(self.replicas)
        live, joining = self.membership.begin(step, [r for r, p in enumerate(here) if p])
        if not live:
            raise ValueError(f"step {step}: no replica present")
        inputs, targets = self.sampler.batch(step)
        weights = row_weights([b - a for a, b in self.rows], live)
        sync = self.local_steps == 1
        loss = 0.0
        sent: dict[str, int] = {}
        self._join(joining, step)
        for r in live:
            model, opt, (a, b) = self.replicas[r], self.optimizers[r], self.rows[r]
            opt.zero_grad(set_to_none=True)
            model.train()
            logits = model(inputs[a:b])
            share = weights[r]
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[a:b].reshape(-1))
            # synchronous: each replica's gradient weighted by its share, summed on the PS
            (ce * share if sync else ce).backward()
            loss += float(ce.detach()) * share
        if sync:
            named = [dict(self.replicas[r].named_parameters()) for r in live]
            for name in named[0]:
                grads = [n[name].grad for n in named]
                total = grads[0]
                assert total is not None
                for g in grads[1:]:
                    assert g is not None
                    total = total + g
                for n in named:
                    n[name].grad = total.clone()
            for r in live:
                sent[f"replica{r}->ps"] = self._param_bytes()
                sent[f"ps->replica{r}"] = self._param_bytes()
        for r in live:
            self.optimizers[r].step()
        self._source = live[0]
        self.next_step += 1
        if not sync and self.membership.round_ends(step):
            self._outer_step(live)  # the replicas present for the whole round
            for r in live:
                sent[f"replica{r}->ps"] = self._param_bytes()
                sent[f"ps->replica{r}"] = self._param_bytes()
        return BaselineStep(step, loss, sent)

    def _join(self, back: list[int], step: int) -> None:
        """Replicas joining take the state the others hold, as a rejoining device receives it:
        H = 1, the parameters and AdamW state of the replica that last took part (every
        replica present holds the same); DiLoCo, θ_global and a fresh inner AdamW (the old one
        was lost with the device's process)."""
        if not back or step == 0:
            return
        with torch.no_grad():
            for r in back:
                if self.local_steps == 1:
                    src = self._source
                    if src == r:
                        continue
                    for q, p in zip(self.replicas[r].parameters(),
                                    self.replicas[src].parameters()):
                        q.copy_(p)
                    self.optimizers[r].load_state_dict(
                        copy.deepcopy(self.optimizers[src].state_dict()))
                else:
                    for q, p in zip(self.replicas[r].parameters(),
                                    self.global_model.parameters()):
                        q.copy_(p)
                    self.optimizers[r] = adamw(list(self.replicas[r].parameters()), self.job)

    def _outer_step(self, live: list[int]) -> None:
        """DiLoCo's outer step over the replicas present; every replica restarts from it."""
        self.outer.zero_grad(set_to_none=True)
        glob = dict(self.global_model.named_parameters())
        reps = [dict(self.replicas[r].named_parameters()) for r in live]
        with torch.no_grad():
            for name, p in glob.items():
                delta = torch.zeros_like(p)
                for rep in reps:
                    delta += p - rep[name]
                p.grad = delta / len(reps)
        self.outer.step()
        with torch.no_grad():
            for model in self.replicas:  # an absent replica also restarts from the new weights
                for name, q in model.named_parameters():
                    q.copy_(glob[name])

    def run(self, steps: int) -> list[BaselineStep]:
        """Run ``steps`` more steps with every replica present."""
        return [self.step() for _ in range(steps)]


__all__ = ["BaselineStep", "DataParallelTrainer", "PipelineTrainer", "Stage", "even_bounds",
           "split_rows", "DILOCO_OUTER_LR", "DILOCO_OUTER_MOMENTUM"]
