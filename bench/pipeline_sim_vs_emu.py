"""The same pipeline simulated and emulated on Mininet: device time per step, side by side.

Three stages on 3 of 4 Snapdragon 888 phones (100/50 Mbit, 2 ms), a 4-layer model (hidden 256,
ffn 1024, seq 128, batch 8, float32), GPipe with 4 micro-batches, the same placement both ways.
The emulated time of a step is the slowest stage's wall time divided by the dilation D (the
stages hold each piece for its device-model time x D; HTB rates are divided by D). Prints both,
their ratio, and each stage's p95 lag (host compute longer than the modelled time: then the
emulation is late, the simulation is not). Needs root and Mininet.

    .venv/bin/python bench/pipeline_sim_vs_emu.py [--quick] [--steps N] [--dilation D]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

DEVICES = ("phones-1", "phones-2", "phones-3")
BOUNDS = ((0, 1), (1, 3), (3, 4))


def main(argv: list[str] | None = None) -> int:
    """Run both and print the comparison."""
    from testbed.baselines.emulate import emulate_pipeline
    from testbed.baselines.pipeline_sim import PipelineSim, StepOutcome
    from testbed.baselines.placement import PipelinePlan
    from testbed.baselines.sim_core import BaselineWorld
    from testbed.emulator.network.probe import probe
    from testbed.topology import load_topology

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 steps (default 4)")
    p.add_argument("--steps", type=int,
                   help="training steps (default 4; quick: 2)")
    p.add_argument("--dilation", type=float, default=3.0,
                   help="the emulation's time dilation D (default 3)")
    args = p.parse_args(argv)
    steps = args.steps or (2 if args.quick else 4)
    missing = probe().missing()
    if missing:
        print(f"Mininet backend unavailable: {'; '.join(missing)}")
        return 1
    with tempfile.TemporaryDirectory(prefix="pipeline-sim-emu-") as tmp:
        path = Path(tmp) / "pipe.yaml"
        path.write_text(yaml.safe_dump({
            "name": "pipe", "seed": 3,
            "network": {"backend": "mininet", "switches": ["ap0"],
                        "ps": {"switch": "ap0", "link": {"down": "1Gbit", "up": "1Gbit"}}},
            "devices": [{"group": "phones", "profile": "snapdragon888", "count": 4,
                         "switch": "ap0", "link": {"down": "100Mbit", "up": "50Mbit",
                                                   "delay": "2ms"}}],
            "job": {"model": {"hidden": 256, "layers": 4, "heads": 4, "ffn": 1024,
                              "seq_len": 128},
                    "batch_size": 8, "steps": steps, "dtype": "float32",
                    "parallelism": {"strategy": "pipeline", "micro_batches": 4,
                                    "checkpoint_every": 1_000_000}}}))
        topo = load_topology(path)
        emu = emulate_pipeline(path, Path(tmp) / "run", devices=DEVICES, bounds=BOUNDS,
                               dilation=args.dilation, timeout_s=900)
    world = BaselineWorld(topo)
    plan = PipelinePlan(DEVICES, BOUNDS, 4, (0, 0, 0), 0.0)
    sim_steps: list[StepOutcome] = []
    world.start()
    PipelineSim(topo, world, plan=plan).run(steps, sim_steps.append)
    emu_s = [max(st["step_s"][i] for st in emu["stages"]) / args.dilation
             for i in range(steps)]
    print(f"D = {args.dilation:g}, delay: {emu['network']['delay']}")
    print(f"{'step':>4} {'simulated s':>12} {'emulated s':>11} {'emu/sim':>8}")
    for i, (s, e) in enumerate(zip(sim_steps, emu_s)):
        print(f"{i:>4} {s.device_s:>12.4f} {e:>11.4f} {e / s.device_s:>8.3f}")
    later = [e / s.device_s for s, e in zip(sim_steps[1:], emu_s[1:])] or [0.0]
    print(f"median emu/sim after step 0: {statistics.median(later):.3f}")
    print("stage lag p95 (s, device time):",
          [round(st["lag_p95_s"] / args.dilation, 4) for st in emu["stages"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
