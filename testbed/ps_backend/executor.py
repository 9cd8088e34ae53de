"""The seam between the training engine and whoever computes its GEMMs.

Every offloaded linear layer asks an executor for ``C = A @ B`` three times a step (forward,
input gradient, weight gradient). The engine never knows whether the product is computed in this
process (:class:`LocalExecutor`, used by the single-process reference run and by tests) or cut into
tiles that devices compute (:class:`testbed.ps_backend.scheduler.TileExecutor`).

``submit`` returns at once with a handle, so that the backward pass can have the input-gradient
and the weight-gradient GEMMs of one layer in flight together; ``result()`` blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

OPS = ("forward", "input_grad", "weight_grad")


@dataclass(frozen=True)
class GemmSpec:
    """What one GEMM is, for scheduling, caching and the ledger.

    ``b_key`` names B when B is a weight (or its transpose) at one version, for example
    ``"layers.0.fc1.weight@3:T"``: devices cache blocks of B under that name, so that on a cache
    hit only A's block travels. ``None`` when B is an activation (the weight-gradient GEMM).
    """

    layer: str  # e.g. "layers.0.fc1"
    op: str  # one of OPS
    step: int  # training step, 0-based
    b_key: str | None = None


class GemmHandle(Protocol):
    def result(self) -> torch.Tensor:
        """Block until C is complete; return it with A's dtype."""
        ...


class GemmExecutor(Protocol):
    def submit(self, a: torch.Tensor, b: torch.Tensor, spec: GemmSpec) -> GemmHandle:
        """Start computing C = A @ B (A: M x K, B: K x N, both 2-D, same dtype)."""
        ...


@dataclass
class DoneHandle:
    """A handle whose result is already there."""

    value: torch.Tensor

    def result(self) -> torch.Tensor:
        return self.value


class LocalExecutor:
    """Computes every GEMM in this process with torch (the single-process reference)."""

    def __init__(self) -> None:
        self.calls: list[GemmSpec] = []  # what was asked, in order (tests read it)

    def submit(self, a: torch.Tensor, b: torch.Tensor, spec: GemmSpec) -> GemmHandle:
        self.calls.append(spec)
        return DoneHandle(a @ b)
