"""The training loop the PS runs: forward, cross-entropy loss, backward, AdamW, one step at a time.

Steps are 0-based. ``version`` is the number of optimizer steps applied to the weights; step ``s``
of a run that started from scratch computes its GEMMs with weights at version ``s`` and leaves
them at version ``s + 1``. Both go into every :class:`GemmSpec` (step) and b_key (version).

The trainer never sets torch's thread count: that is the caller's business.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from testbed.ps_backend.engine.data import BatchSampler, Corpus, load_corpus
from testbed.ps_backend.engine.model import OptDecoder
from testbed.ps_backend.engine.offload import GemmContext
from testbed.ps_backend.engine.optim import AdamW
from testbed.ps_backend.executor import GemmExecutor
from testbed.topology import JobSpec

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def adamw(params: Iterable[nn.Parameter], job: JobSpec) -> AdamW:
    """The job's optimizer, as the trainer and the baselines build it.

    Fused: one pass over each parameter's tensors instead of one per term of the update (the PS
    runs it on the step's critical path, between its last GEMM and the next step's first).
    torch's own kernel, without ``torch.optim``'s start-up cost (:mod:`.optim`).
    """
    opt = job.optimizer
    return AdamW(params, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)


@dataclass(frozen=True)
class StepResult:
    """What one training step produced."""

    step: int  # 0-based
    loss: float  # mean cross-entropy over the batch's tokens, nats
    version: int  # weight version after this step's optimizer update
    tokens: int  # tokens in the batch
    gemms: int  # GEMMs submitted to the executor (0 on the plain torch path)
    gemm_flops: float  # 2·M·K·N summed over those GEMMs
    wall_s: float  # wall-clock time of the whole step


class Trainer:
    """Owns the model, optimizer and data sampler of one job; ``step()`` trains one step."""

    def __init__(self, job: JobSpec, seed: int, executor: GemmExecutor | None = None,
                 corpus: Corpus | None = None) -> None:
        if job.dtype not in DTYPES:
            raise ValueError(f"job.dtype: expected one of {tuple(DTYPES)}, got {job.dtype!r}")
        self.job = job
        self.seed = seed
        self.dtype = DTYPES[job.dtype]
        self.context = GemmContext(executor=executor)
        torch.manual_seed(seed)
        self.model = OptDecoder(job.model, self.context).to(self.dtype)
        opt = job.optimizer
        if opt.name != "adamw":
            raise ValueError(f"job.optimizer.name: only 'adamw' is supported, got {opt.name!r}")
        self.optimizer = adamw(self.model.parameters(), job)
        self.sampler = BatchSampler(corpus if corpus is not None else load_corpus(job.data),
                                    job.batch_size, job.model.seq_len, seed)
        self.next_step = 0  # the step that step() will run
        self.version = 0  # optimizer steps applied so far

    @property
    def executor(self) -> GemmExecutor | None:
        """The executor the offloaded layers use (None: plain torch)."""
        return self.context.executor

    @executor.setter
    def executor(self, executor: GemmExecutor | None) -> None:
        self.context.executor = executor

    def step(self) -> StepResult:
        """Run one training step and return its loss."""
        start_s = time.perf_counter()
        step = self.next_step
        inputs, targets = self.sampler.batch(step)
        self.context.step, self.context.version = step, self.version
        self.context.reset_counters()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        self.optimizer.step()
        self.version += 1
        self.next_step += 1
        result = StepResult(step, float(loss.detach()), self.version, targets.numel(),
                            self.context.gemms, self.context.gemm_flops,
                            time.perf_counter() - start_s)
        log.debug("step %d: loss %.6f, %d gemms, %.3f s", step, result.loss, result.gemms,
                  result.wall_s)
        return result

    def run(self, steps: int) -> list[StepResult]:
        """Run ``steps`` more steps (the single-process reference when no executor is set)."""
        return [self.step() for _ in range(steps)]

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this run bit for bit (see :mod:`.checkpoint`)."""
        return {"next_step": self.next_step, "version": self.version, "seed": self.seed,
                "model_spec": dataclasses.asdict(self.job.model), "dtype": self.job.dtype,
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state taken by :meth:`state_dict` (same job shape)."""
        mine = {"seed": self.seed, "model_spec": dataclasses.asdict(self.job.model),
                "dtype": self.job.dtype}
        wrong = [f"{k}: checkpoint has {state.get(k)!r}, this job has {v!r}"
                 for k, v in mine.items() if state.get(k) != v]
        if wrong:
            raise ValueError("checkpoint does not belong to this job: " + "; ".join(wrong))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.next_step = int(state["next_step"])
        self.version = int(state["version"])
