"""How fast the ledger can checksum a GEMM's operands, per hash (GB/s on one thread).

With a ledger, the PS checksums every GEMM operand once a step before the GEMM goes out
(``testbed.ps_backend.ledger.gemm_digest``): 10.4 GB a step of OPT-125m on hotcarbon, on the
trainer's thread, so on the step's critical path. This prints each candidate's rate on an
8192 x 3072 float32 operand (hotcarbon's largest activation, 100 MB): BLAKE2b, CRC-32 (zlib) and
XXH3-64 (the one the ledger uses), and what each would cost a hotcarbon step.

    .venv/bin/python bench/operand_digest.py [--rows 8192] [--cols 3072] [--repeat 10]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import zlib

import numpy as np
import xxhash

HOTCARBON_OPERAND_BYTES = 10.4e9  # a step's operands, each once (docs/planning.md)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=3072)
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args(argv)
    x = np.random.default_rng(0).standard_normal((args.rows, args.cols), dtype=np.float32)
    hashes = {"BLAKE2b": lambda: hashlib.blake2b(x.data).hexdigest(),
              "CRC-32": lambda: zlib.crc32(x.data),
              "XXH3-64": lambda: xxhash.xxh3_64_hexdigest(x.data)}
    print(f"{args.rows} x {args.cols} float32 ({x.nbytes / 1e6:.0f} MB), one thread")
    print(f"{'hash':10s}{'GB/s':>8s}{'s per hotcarbon step':>24s}")
    for name, digest in hashes.items():
        digest()
        start = time.perf_counter()
        for _ in range(args.repeat):
            digest()
        rate = args.repeat * x.nbytes / (time.perf_counter() - start)
        print(f"{name:10s}{rate / 1e9:8.2f}{HOTCARBON_OPERAND_BYTES / rate:24.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
