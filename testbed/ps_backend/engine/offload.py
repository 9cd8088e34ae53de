"""Offloaded linear layers: every GEMM of an ``nn.Linear`` goes through a :class:`GemmExecutor`.

Naming and shapes, written down once (``X``: input flattened to 2-D, ``W``: weight, ``dY``: the
gradient of the output)::

    op            C        =  A       @  B       A shape     B shape     b_key
    forward       Y        =  X       @  Wᵀ      [M, in]     [in, out]   "<param>@<version>"
    input_grad    dX       =  dY      @  W       [M, out]    [out, in]   "<param>@<version>"
    weight_grad   dW       =  dYᵀ     @  X       [out, M]    [M, in]     None (B is an activation)

``M`` is the product of the input's leading dimensions (batch × sequence). ``<param>`` is the
dotted name of the weight parameter (``layers.0.fc1.weight``; the tied LM head names the token
embedding, ``embed_tokens.weight``). ``<version>`` is the number of optimizer steps applied to the
weights so far, so a device's cached block of ``W`` is valid exactly while the version is.
A and B may be non-contiguous views (``Wᵀ``, ``dYᵀ``); executors must not assume contiguity.
``b_key`` names the weight tensor, not its orientation: ``Wᵀ`` in forward and ``W`` in the input
gradient are one tensor, so a device that holds a block of it serves both uses from its cache
(the tile executor tells the two apart by the view's layout, see ``OperandKeys``).

The bias add and the bias gradient (a column sum of ``dY``) run on the PS: they are not GEMMs.

Which executor, step and version a GEMM belongs to comes from a :class:`GemmContext` that the
model's layers share and the trainer sets before each step. With no executor set, the layer is a
plain ``F.linear`` under torch's own autograd (the single-process reference).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Variable

from testbed.ps_backend.executor import GemmExecutor, GemmHandle
from testbed.ps_backend.scheduler import GemmSpec

log = logging.getLogger(__name__)


@dataclass
class GemmContext:
    """What the offloaded layers of one model need to know about the current step.

    The trainer owns it: it sets ``executor`` once and ``step``/``version`` before each step.
    ``gemms`` and ``gemm_flops`` count what was submitted since the last :meth:`reset_counters`.
    """

    executor: GemmExecutor | None = None
    step: int = 0  # training step, 0-based
    version: int = 0  # optimizer steps applied to the weights so far
    gemms: int = 0
    gemm_flops: float = 0.0  # 2·M·K·N summed over submitted GEMMs
    # weight gradients still on the devices (see OffloadedLinearFunction.backward)
    pending_grads: list[_PendingGrad] = field(default_factory=list)
    _settle_queued: bool = False

    def reset_counters(self) -> None:
        """Zero the per-step GEMM counters (and forget weight gradients of a step that did not
        finish: its backward raised)."""
        self.gemms = 0
        self.gemm_flops = 0.0
        self.pending_grads.clear()
        self._settle_queued = False

    def defer(self, pending: _PendingGrad) -> None:
        """Leave a weight gradient in flight until the end of this backward pass: nothing in
        the pass reads it, so the next layers' GEMMs go out while it runs on
        (:func:`~testbed.ps_backend.bound.floats`)."""
        self.pending_grads.append(pending)
        if not self._settle_queued:
            # runs when the whole backward pass is done, before .backward() returns (the
            # engine's hook for work a pass leaves behind; torch's DDP uses it alike)
            Variable._execution_engine.queue_callback(self.settle)
            self._settle_queued = True

    def settle(self) -> None:
        """Wait for the weight gradients in flight and add each into its parameters' ``.grad``,
        as autograd's accumulation would."""
        self._settle_queued = False
        while self.pending_grads:
            pending = self.pending_grads.pop(0)
            dw = _result(pending.handle, pending.shape, pending.dtype, pending.spec)
            for param, r0, r1 in pending.targets:
                grad = dw if (r0, r1) == (0, dw.shape[0]) else dw[r0:r1]
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)


@dataclass
class _PendingGrad:
    """A weight gradient GEMM in flight and the parameters whose gradient it is: rows
    ``r0:r1`` of ``dW`` are ``param``'s (several parameters for a fused linear)."""

    handle: GemmHandle
    shape: tuple[int, int]
    dtype: torch.dtype
    spec: GemmSpec
    targets: tuple[tuple[nn.Parameter, int, int], ...]


class ExecutorResultError(RuntimeError):
    """An executor returned a product of the wrong shape or dtype."""


def _submit(ctx: GemmContext, executor: GemmExecutor, a: torch.Tensor, b: torch.Tensor,
            spec: GemmSpec) -> GemmHandle:
    ctx.gemms += 1
    ctx.gemm_flops += 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    return executor.submit(a, b, spec)


def _result(handle: GemmHandle, shape: tuple[int, int], dtype: torch.dtype,
            spec: GemmSpec) -> torch.Tensor:
    c = handle.result()
    if tuple(c.shape) != shape or c.dtype != dtype:
        raise ExecutorResultError(
            f"{spec.layer} {spec.op} (step {spec.step}): executor returned "
            f"{tuple(c.shape)} {c.dtype}, expected {shape} {dtype}")
    return c


class OffloadedLinearFunction(torch.autograd.Function):
    """``Y = X·Wᵀ + b`` whose three GEMMs an executor computes (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x2d: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                bias: torch.Tensor | None, gemm_ctx: GemmContext, layer: str,
                weight_key: str, grad_targets: tuple[tuple[nn.Parameter, int, int], ...]
                ) -> torch.Tensor:
        executor = gemm_ctx.executor
        assert executor is not None  # OffloadedLinear takes the plain path otherwise
        step, version = gemm_ctx.step, gemm_ctx.version
        spec = GemmSpec(layer, "forward", step, f"{weight_key}@{version}")
        y = _result(_submit(gemm_ctx, executor, x2d, weight.t(), spec),
                    (x2d.shape[0], weight.shape[0]), x2d.dtype, spec)
        if bias is not None:
            y.add_(bias)  # the executor's product is this call's own: no second 8192 x N tensor
        ctx.save_for_backward(x2d, weight)
        ctx.gemm = (gemm_ctx, executor, layer, weight_key, step, version, bias is not None,
                    grad_targets)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x2d, weight = ctx.saved_tensors
        gemm_ctx, executor, layer, weight_key, step, version, has_bias, targets = ctx.gemm
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx_spec = GemmSpec(layer, "input_grad", step, f"{weight_key}@{version}")
        dw_spec = GemmSpec(layer, "weight_grad", step, None)
        # Submit both GEMMs before waiting on either, so that they are in flight together.
        dx_handle = _submit(gemm_ctx, executor, dy, weight, dx_spec) if need_x else None
        dw_handle = _submit(gemm_ctx, executor, dy.t(), x2d, dw_spec) if need_w else None
        db = dy.sum(0) if (need_b and has_bias) else None
        dx = None if dx_handle is None else _result(dx_handle, tuple(x2d.shape), dy.dtype, dx_spec)
        if dw_handle is not None:
            # Nothing in this pass reads dW: autograd goes on with dX (the PS's own work, the
            # next layers' GEMMs) while dW's results are still coming; the context adds dW into
            # the parameters' .grad when the pass ends.
            gemm_ctx.defer(_PendingGrad(dw_handle, (weight.shape[0], weight.shape[1]), dy.dtype,
                                        dw_spec, targets))
        return dx, None, db, None, None, None, None


def offloaded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     context: GemmContext, name: str, weight_key: str,
                     grad_targets: tuple[tuple[nn.Parameter, int, int], ...] | None = None
                     ) -> torch.Tensor:
    """``x·weightᵀ + bias`` for ``x`` of shape ``[..., in]``: its GEMMs go to the context's
    executor under the layer name ``name``, or plain ``F.linear`` with no executor.

    ``weight``'s gradient goes into ``.grad`` of the parameters ``grad_targets`` names (rows
    ``r0:r1`` of it each; default: ``weight`` itself, which must then be a parameter) at the
    end of the backward pass, not through autograd (OffloadedLinearFunction.backward)."""
    if context.executor is None:
        return F.linear(x, weight, bias)
    if grad_targets is None:
        if not isinstance(weight, nn.Parameter):
            raise TypeError(f"{name}: an offloaded weight that is no parameter needs "
                            f"grad_targets (the parameters its gradient belongs to)")
        grad_targets = ((weight, 0, weight.shape[0]),)
    lead = x.shape[:-1]
    y = OffloadedLinearFunction.apply(x.reshape(-1, weight.shape[1]), weight, bias, context,
                                      name, weight_key, grad_targets)
    return y.reshape(*lead, weight.shape[0])


def fused_linear(x: torch.Tensor, layers: Sequence[OffloadedLinear], name: str) -> torch.Tensor:
    """Linears that read the same input, applied as one: ``x·[W₁; W₂; …]ᵀ + [b₁, b₂, …]``.

    Their outputs side by side, each entry the same dot product as the linear's own; the
    executor sees one GEMM of each kind (forward, input_grad, weight_grad) named ``name``, with
    the b_key ``<name>.weight@<version>``. One GEMM instead of several pays wherever a GEMM's
    start and end cost time (the first blocks down before anything computes, the last results
    up after): the planner cuts the whole and the step waits once. In backward, the weight
    gradient's rows go to the layers' own weights (``grad_targets``) and ``dX`` is one K-split
    GEMM over all of them. The concatenation is made at every call (the weights change every
    step); its b_key's version names it as any weight's does.
    """
    weight = torch.cat(tuple(layer.weight for layer in layers))
    biases = tuple(layer.bias for layer in layers if layer.bias is not None)
    if biases and len(biases) != len(layers):
        raise ValueError(f"{name}: the fused linears must all have a bias or none")
    bias = torch.cat(biases) if biases else None
    rows = itertools.accumulate((layer.weight.shape[0] for layer in layers), initial=0)
    starts = list(rows)
    targets = tuple((layer.weight, r0, r1)
                    for layer, r0, r1 in zip(layers, starts, starts[1:]))
    return offloaded_linear(x, weight, bias, layers[0].context, name, f"{name}.weight", targets)


class OffloadedLinear(nn.Module):
    """A drop-in ``nn.Linear`` whose GEMMs go to the executor of its :class:`GemmContext`.

    ``name`` is the layer's dotted name (``layers.0.fc1``); ``weight_key`` names the weight in
    b_keys and defaults to ``<name>.weight`` (a tied layer points it at the shared parameter).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, name: str = "",
                 context: GemmContext | None = None, weight_key: str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.name = name
        self.weight_key = weight_key or f"{name}.weight"
        self.context = context if context is not None else GemmContext()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to ``x`` of shape ``[..., in_features]``."""
        return offloaded_linear(x, self.weight, self.bias, self.context, self.name,
                                self.weight_key)

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")
