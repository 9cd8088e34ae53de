"""The trainer's optimizers: torch.optim's updates bit for bit, without importing torch._dynamo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from testbed.ps_backend.engine.optim import SGD, AdamW

DTYPES = [torch.float32, torch.float64]
TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"


def _params(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def _train(opt: object, params: list[torch.Tensor], steps: int, g: torch.Generator,
           skip_last: bool = False) -> None:
    """``steps`` updates on gradients of random quadratics drawn from ``g`` (the last parameter
    gets none when ``skip_last``: an optimizer must leave it and its state alone)."""
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
        trained = params[:-1] if skip_last else params
        loss = sum(((p - torch.randn(p.shape, generator=g, dtype=p.dtype)) ** 2).sum() * (i + 1)
                   for i, p in enumerate(trained))
        loss.backward()  # type: ignore[union-attr]
        opt.step()  # type: ignore[attr-defined]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.detach(), y.detach()), (x, y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adamw_is_torchs_fused_adamw_bit_for_bit(dtype: torch.dtype) -> None:
    ours, theirs = _params(dtype), _params(dtype)
    kw = {"lr": 3e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    opt = AdamW(ours, **kw)
    _train(opt, ours, 6, _gen(1), skip_last=True)
    _train(torch.optim.AdamW(theirs, fused=True, **kw), theirs, 6, _gen(1),
           skip_last=True)
    _same(ours, theirs)
    assert not torch.equal(ours[0].detach(), _params(dtype)[0])  # it did move them
    assert ours[-1] not in opt.state and opt.state[ours[0]]["step"] == 6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("momentum, nesterov", [(0.9, True), (0.9, False), (0.0, False)])
def test_sgd_is_torchs_sgd_bit_for_bit(dtype: torch.dtype, momentum: float,
                                       nesterov: bool) -> None:
    """DiLoCo's outer step as the baselines build it (Nesterov when the momentum is above 0)."""
    ours, theirs = _params(dtype), _params(dtype)
    kw = {"lr": 0.7, "momentum": momentum, "nesterov": nesterov}
    _train(SGD(ours, **kw), ours, 5, _gen(2))
    _train(torch.optim.SGD(theirs, **kw), theirs, 5, _gen(2))
    _same(ours, theirs)


def test_state_dicts_go_both_ways_and_training_goes_on_the_same() -> None:
    """A checkpoint written by torch.optim (as the trainer's were before this module) loads in
    ours, and ours in torch's: three steps, the state handed over, three more, against six in
    one optimizer."""
    kw = {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.01}
    straight = _params(torch.float64)
    _train(AdamW(straight, **kw), straight, 6, _gen(3))

    handed = _params(torch.float64)
    g = _gen(3)
    torch_opt = torch.optim.AdamW(handed, fused=True, **kw)
    _train(torch_opt, handed, 3, g)
    ours = AdamW(handed, **kw)
    ours.load_state_dict(torch_opt.state_dict())
    assert ours.state[handed[0]]["step"].dtype == torch.float32
    _train(ours, handed, 3, g)
    _same(handed, straight)

    back = torch.optim.AdamW(handed, fused=True, **kw)
    back.load_state_dict(ours.state_dict())
    assert torch.equal(back.state[handed[1]]["exp_avg_sq"], ours.state[handed[1]]["exp_avg_sq"])
    assert back.state[handed[1]]["step"] == 6


def test_a_state_for_other_parameters_is_refused() -> None:
    opt = AdamW(_params(torch.float32), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    other = AdamW(_params(torch.float32)[:2], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    with pytest.raises(ValueError, match="2 parameter"):
        opt.load_state_dict(other.state_dict())


def test_training_a_step_does_not_import_torch_dynamo() -> None:
    """What the optimizers are for: a trainer's start and steps (and its checkpoint) without
    torch._dynamo, whose import took 1.6-2.0 s of every PS start (docs/engine.md)."""
    code = (
        "import sys, io, torch\n"
        "from pathlib import Path\n"
        "from testbed.ps_backend.engine.trainer import Trainer\n"
        "from testbed.topology import load_topology\n"
        f"topo = load_topology(Path({str(TINY)!r}))\n"
        "t = Trainer(topo.job, topo.seed, None)\n"
        "t.run(2)\n"
        "torch.save(t.state_dict(), io.BytesIO())\n"
        "sys.exit(3 if 'torch._dynamo' in sys.modules else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
