"""How fast the ledger can checksum a GEMM's operands, per hash (GB/s on one thread).

With a ledger, the PS checksums every GEMM operand once a step before the GEMM goes out
(``testbed.ps_backend.ledger.gemm_digest``), on the trainer's thread, so on the step's critical
path: a step's operands, each once (``testbed.capacity.operand_bytes``: 5.2 GB for OPT-125m on
hotcarbon). This prints each candidate's rate on an 8192 x 3072 float32 operand (hotcarbon's
largest activation, 100 MB): BLAKE2b, CRC-32 (zlib) and XXH3-64 (the one the ledger uses), and
what each would cost a step of the topology's job.

    .venv/bin/python bench/operand_digest.py [--topology topologies/hotcarbon.yaml]
                                             [--rows 8192] [--cols 3072] [--repeat 10]
    .venv/bin/python bench/operand_digest.py --quick   # 2048 rows, 3 repeats
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import xxhash

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from testbed.capacity import operand_bytes  # noqa: E402
from testbed.topology import load_topology  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", default=str(REPO / "topologies" / "hotcarbon.yaml"),
                   help="whose step's operands to cost (default: hotcarbon)")
    p.add_argument("--rows", type=int, default=None,
                   help="rows of the float32 operand hashed (default 8192; quick: 2048)")
    p.add_argument("--cols", type=int, default=3072, help="its columns (default 3072)")
    p.add_argument("--repeat", type=int, default=None,
                   help="hashes timed per candidate (default 10; quick: 3)")
    p.add_argument("--quick", action="store_true",
                   help="a 2048-row operand hashed 3 times: seconds, the rates noisier")
    args = p.parse_args(argv)
    if args.rows is None:
        args.rows = 2048 if args.quick else 8192
    if args.repeat is None:
        args.repeat = 3 if args.quick else 10
    topology = load_topology(args.topology)
    step_bytes = operand_bytes(topology.job)
    x = np.random.default_rng(0).standard_normal((args.rows, args.cols), dtype=np.float32)
    hashes = {"BLAKE2b": lambda: hashlib.blake2b(x.data).hexdigest(),
              "CRC-32": lambda: zlib.crc32(x.data),
              "XXH3-64": lambda: xxhash.xxh3_64_hexdigest(x.data)}
    print(f"{args.rows} x {args.cols} float32 ({x.nbytes / 1e6:.0f} MB), one thread; "
          f"{topology.name}'s step has {step_bytes / 1e9:.2f} GB of operands")
    print(f"{'hash':10s}{'GB/s':>8s}{'s a step':>12s}")
    for name, digest in hashes.items():
        digest()
        start = time.perf_counter()
        for _ in range(args.repeat):
            digest()
        rate = args.repeat * x.nbytes / (time.perf_counter() - start)
        print(f"{name:10s}{rate / 1e9:8.2f}{step_bytes / rate:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
