"""Benchmark: sim-to-real on this host - a real device and an emulated copy of it, same job.

Runs one job twice through an in-process PS (:class:`PsServer` + :class:`TileExecutor`): once
with a real device (``python -m testbed.agent --kind real``: this machine computing tiles with
numpy, no emulation) and once with an emulated device (``--kind emulated --profile host``: the
host's fitted model, with its sampled noise, decides how long each tile takes; D = 1). Each has
one BLAS thread and up to ``--in-flight`` tiles outstanding (so the next tile is on the device
when the last one finishes and the round trip is hidden); a step's time is then the device's
tile times plus what the PS adds, the same for both.

A step is the GEMMs of one training step of a decoder's linear layers (``--layers`` layers of
hidden -> ffn -> hidden over ``--tokens`` tokens): per linear, forward Y = X W^T, then the
input-gradient dX = dY W and weight-gradient dW = dY^T X submitted together, as the engine does.
Prints per-step wall times of each device, their ratio emulated / real, and the devices' own
summed tile compute times.

    .venv/bin/python bench/sim_to_real.py [--steps 5] [--tokens 1024] [--hidden 512 --ffn 2048]
    .venv/bin/python bench/sim_to_real.py --quick   # 2 steps of 256 tokens, one round
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulation_fidelity import PsHarness  # noqa: E402

from testbed.ps_backend.scheduler import GemmSpec  # noqa: E402


def step_gemms(ps: PsHarness, step: int, tokens: int, hidden: int, ffn: int, layers: int
               ) -> float:
    """Run one step's GEMMs through the PS; return its wall seconds."""
    gen = torch.Generator().manual_seed(1000 + step)
    shapes = [(hidden, ffn), (ffn, hidden)] * layers  # (in, out) of each linear
    weights = [torch.randn(o, i, generator=gen) * 0.02 for i, o in shapes]
    xs = [torch.randn(tokens, i, generator=gen) for i, _ in shapes]
    dys = [torch.randn(tokens, o, generator=gen) for _, o in shapes]
    ex = ps.executor
    start = time.monotonic()
    for j, (x, w) in enumerate(zip(xs, weights)):
        ex.submit(x, w.t().contiguous(), GemmSpec(f"l{j}", "forward", step,
                                                  b_key=f"l{j}.w@{step}:T")).result()
    for j in reversed(range(len(shapes))):
        dx = ex.submit(dys[j], weights[j], GemmSpec(f"l{j}", "input_grad", step,
                                                    b_key=f"l{j}.w@{step}"))
        dw = ex.submit(dys[j].t().contiguous(), xs[j], GemmSpec(f"l{j}", "weight_grad", step))
        dx.result(), dw.result()
    return time.monotonic() - start


def run_device(kind: str, args: argparse.Namespace) -> tuple[list[float], float]:
    """Per-step wall seconds and the device's summed compute_s, for one device kind."""
    with PsHarness(dilation=1.0, tile=args.tile) as ps:
        ps.spawn(f"{kind}-0", kind, "host" if kind == "emulated" else "", seed=1,
                 max_in_flight=args.in_flight)
        ps.wait_joined(1)
        step_gemms(ps, -1, args.tokens, args.hidden, args.ffn, args.layers)  # warm-up
        ps.records.clear()
        times = [step_gemms(ps, s, args.tokens, args.hidden, args.ffn, args.layers)
                 for s in range(args.steps)]
        compute_s = sum(r.compute_s for r in ps.records)
    return times, compute_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None,
                   help="steps per device and round (default 5; quick: 2)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens of a step's activations (default 1024; quick: 256)")
    p.add_argument("--hidden", type=int, default=512, help="hidden width (default 512)")
    p.add_argument("--ffn", type=int, default=2048, help="FFN width (default 2048)")
    p.add_argument("--layers", type=int, default=1, help="layers (default 1)")
    p.add_argument("--tile", type=int, default=256, help="tile edge (default 256)")
    p.add_argument("--in-flight", type=int, default=3, help="tiles outstanding per device")
    p.add_argument("--rounds", type=int, default=None,
                   help="alternate real and emulated this many times (load drifts; "
                        "default 2; quick: 1)")
    p.add_argument("--quick", action="store_true",
                   help="2 steps of 256 tokens, one round: seconds, a smoke run")
    args = p.parse_args(argv)
    for name, full, quick in (("steps", 5, 2), ("tokens", 1024, 256), ("rounds", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    logging.basicConfig(level=logging.WARNING)
    real: list[float] = []
    emulated: list[float] = []
    real_c = emu_c = 0.0
    for _ in range(args.rounds):
        t, c = run_device("real", args)
        real += t
        real_c += c
        t, c = run_device("emulated", args)
        emulated += t
        emu_c += c
    print(f"job: {args.layers} x 2 linears ({args.hidden} <-> {args.ffn}), {args.tokens} tokens, "
          f"tile {args.tile}; {args.steps} steps x {args.rounds} rounds per device")
    print(f"{'step':>5}{'real s':>10}{'emulated s':>12}{'ratio':>8}")
    for i, (r, e) in enumerate(zip(real, emulated)):
        print(f"{i:>5}{r:>10.4f}{e:>12.4f}{e / r:>8.3f}")
    mr, me = statistics.median(real), statistics.median(emulated)
    print(f"median step: real {mr:.4f} s, emulated {me:.4f} s, ratio {me / mr:.3f}")
    print(f"device compute per step (sum of tiles' compute_s): real {real_c / len(real):.4f} s "
          f"(measured numpy time), emulated {emu_c / len(emulated):.4f} s (model time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
