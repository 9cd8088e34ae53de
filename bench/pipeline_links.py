"""A pipeline on Mininet: payload each stage sent against the bytes its host's link carried.

Three stages of a 4-layer float64 model on 3 of 4 phones (100/50 Mbit, 2 ms), GPipe with 4
micro-batches; prints per stage host the payload out/in (activations, their gradients, the
tied-embedding gradient), the kernel's tx/rx byte counters of the host's interface, the
overhead, the wall time per step and the stages' losses. Needs root and Mininet.

    .venv/bin/python bench/pipeline_links.py [--quick] [--steps N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import yaml


def main(argv: list[str] | None = None) -> int:
    """Run the pipeline and print the table."""
    from testbed.baselines.emulate import emulate_pipeline
    from testbed.emulator.network.probe import probe

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 steps (default 5)")
    p.add_argument("--steps", type=int, help="training steps (default 5; quick: 2)")
    args = p.parse_args(argv)
    steps = args.steps or (2 if args.quick else 5)
    missing = probe().missing()
    if missing:
        print(f"Mininet backend unavailable: {'; '.join(missing)}")
        return 1
    with tempfile.TemporaryDirectory(prefix="pipeline-links-") as tmp:
        path = Path(tmp) / "pipe.yaml"
        path.write_text(yaml.safe_dump({
            "name": "pipe", "seed": 3,
            "network": {"backend": "mininet", "switches": ["ap0"],
                        "ps": {"switch": "ap0", "link": {"down": "1Gbit", "up": "1Gbit"}}},
            "devices": [{"group": "phones", "profile": "snapdragon888", "count": 4,
                         "switch": "ap0", "link": {"down": "100Mbit", "up": "50Mbit",
                                                   "delay": "2ms"}}],
            "job": {"model": {"hidden": 64, "layers": 4, "heads": 2, "ffn": 128,
                              "seq_len": 64},
                    "batch_size": 8, "steps": steps, "dtype": "float64",
                    "parallelism": {"strategy": "pipeline", "micro_batches": 4}}}))
        devices = ["phones-1", "phones-2", "phones-3"]
        res = emulate_pipeline(path, Path(tmp) / "run", devices=devices,
                               bounds=[(0, 1), (1, 3), (3, 4)], timeout_s=600)
    sent: dict[str, int] = {}
    for st in res["stages"]:
        sent.update(st["sent_bytes"])
    print(f"{steps} steps, {res['wall_s']:.1f} s wall from training's start "
          f"({res['wall_s'] / steps:.2f} s a step), delay: {res['network']['delay']}")
    print(f"{'stage host':12} {'payload out':>12} {'tx bytes':>10} {'over':>6} "
          f"{'payload in':>11} {'rx bytes':>10} {'over':>6}")
    for s, d in enumerate(devices):
        out = sum(v for k, v in sent.items() if k.startswith(f"stage{s}->"))
        inn = sum(v for k, v in sent.items() if k.endswith(f"->stage{s}"))
        link = res["links"][d]
        print(f"{d:12} {out:>12,} {link['tx_bytes']:>10,} {link['tx_bytes'] / out - 1:>6.1%} "
              f"{inn:>11,} {link['rx_bytes']:>10,} {link['rx_bytes'] / inn - 1:>6.1%}")
    print("losses:", ", ".join(f"{x:.6f}" for x in res["losses"]))
    print("lag p95 per stage (s):", [round(st["lag_p95_s"], 4) for st in res["stages"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
