"""The optimizers of the trainer and the baselines: torch's own update arithmetic, called directly.

``torch.optim``'s classes import ``torch._dynamo`` at their first call (``Optimizer.step``'s
wrapper and the methods marked ``_disable_dynamo`` do): 1.6-2.0 s of the start of every PS and
every baseline stage or replica process on our 2-core hosts (docs/engine.md), for a compiler the
testbed never uses. These two classes do the same updates without it:

* :class:`AdamW` runs the fused CPU kernel that ``torch.optim.AdamW(fused=True)`` runs
  (``torch._fused_adamw_``), on the same state (a float32 ``step`` tensor, ``exp_avg``,
  ``exp_avg_sq``);
* :class:`SGD` (DiLoCo's outer step) takes the per-tensor steps of ``torch.optim.SGD`` on CPU.

Their updates are torch's bit for bit (``tests/unit/test_optim.py`` compares them step by
step), and ``state_dict()`` has torch's layout (``state`` by parameter index, one entry in
``param_groups``), so a checkpoint written by either loads in the other.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch
from torch import Tensor


class _Optimizer:
    """What the two share: the parameters, their state (by tensor, as ``torch.optim`` keys it)
    and its dict form."""

    def __init__(self, params: Iterable[Tensor], hyper: dict[str, Any]):
        self.params = list(params)
        self.hyper = hyper
        self.state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def with_grads(self) -> list[tuple[Tensor, Tensor]]:
        """(parameter, gradient) of the parameters that have one (the others are not updated)."""
        return [(p, g) for p in self.params if (g := p.grad) is not None]

    def state_dict(self) -> dict[str, Any]:
        return {"state": {i: dict(self.state[p]) for i, p in enumerate(self.params)
                          if p in self.state},
                "param_groups": [{**self.hyper, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the state (copied, floating tensors cast to their parameter's dtype, as
        ``torch.optim`` does; ``step`` stays a float32 scalar). The hyperparameters stay this
        optimizer's own: the job's, which the checkpoint's owner checks (``Trainer``)."""
        groups = state_dict.get("param_groups", [])
        count = sum(len(g["params"]) for g in groups)
        if len(groups) != 1 or count != len(self.params):
            raise ValueError(f"optimizer state for {count} parameter(s) in {len(groups)} "
                             f"group(s); this optimizer has {len(self.params)} in one")
        self.state = defaultdict(dict)
        for i, entry in state_dict["state"].items():
            p = self.params[int(i)]
            self.state[p] = {k: self._cast(k, v, p) for k, v in entry.items()}

    @staticmethod
    def _cast(key: str, value: Any, param: Tensor) -> Any:
        if not isinstance(value, Tensor):
            return value
        if key == "step":
            return value.detach().to(dtype=torch.float32).clone()
        if value.is_floating_point():
            return value.detach().to(dtype=param.dtype, device=param.device).clone()
        return value.detach().clone()


class AdamW(_Optimizer):
    """AdamW with decoupled weight decay, no AMSGrad: ``torch.optim.AdamW(fused=True)``'s
    update."""

    def __init__(self, params: Iterable[Tensor], lr: float, betas: tuple[float, float],
                 weight_decay: float, eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay, "amsgrad": False,
                                  "maximize": False, "fused": True})

    @torch.no_grad()
    def step(self) -> None:
        by_dtype: dict[torch.dtype, list[list[Tensor]]] = {}
        for p, grad in self.with_grads():
            state = self.state[p]
            if not state:  # lazily, as torch.optim does: a parameter never trained has none
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            lists = by_dtype.setdefault(p.dtype, [[], [], [], [], []])
            for out, tensor in zip(lists, (p, grad, state["exp_avg"], state["exp_avg_sq"],
                                           state["step"])):
                out.append(tensor)
        h = self.hyper
        for params, grads, exp_avgs, exp_avg_sqs, steps in by_dtype.values():
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps,
                                amsgrad=False, lr=h["lr"], beta1=h["betas"][0],
                                beta2=h["betas"][1], weight_decay=h["weight_decay"],
                                eps=h["eps"], maximize=False, grad_scale=None,
                                found_inf=None)


class SGD(_Optimizer):
    """SGD with momentum (Nesterov's when asked), no weight decay or dampening:
    ``torch.optim.SGD``'s update on CPU, one tensor at a time."""

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.0,
                 nesterov: bool = False):
        if nesterov and momentum <= 0:
            raise ValueError("Nesterov momentum needs a momentum above 0")
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov,
                                  "dampening": 0.0, "weight_decay": 0.0})

    @torch.no_grad()
    def step(self) -> None:
        lr, momentum = self.hyper["lr"], self.hyper["momentum"]
        for p, grad in self.with_grads():
            if momentum != 0:
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = grad.detach().clone()
                else:
                    buf.mul_(momentum).add_(grad)
                grad = grad.add(buf, alpha=momentum) if self.hyper["nesterov"] else buf
            p.add_(grad, alpha=-lr)
