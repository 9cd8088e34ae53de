"""Time numpy ``A @ B`` on the phone; print one JSON line. Needs only numpy.

    python time_gemm.py describe
    python time_gemm.py M K N DTYPE WARMUP REPEATS MIN_SAMPLE_S

The timing loop is the one of testbed.perf_model.measure.LocalNumpyRunner: warm-up calls, then
each sample repeats the call until it lasts at least MIN_SAMPLE_S and reports seconds per call.
"""
import json
import platform
import sys
import time

import numpy as np


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("hardware", "model name", "processor\t: a")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main(argv):
    if argv[:1] == ["describe"]:
        print(json.dumps({"cpu_model": cpu_model(), "numpy": np.__version__,
                          "machine": platform.machine()}))
        return 0
    m, k, n = (int(x) for x in argv[:3])
    dtype, warmup, repeats, min_sample_s = argv[3], int(argv[4]), int(argv[5]), float(argv[6])
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    one_s = 1e-7
    for _ in range(max(warmup, 1)):
        start = time.perf_counter()
        a @ b
        one_s = time.perf_counter() - start
    inner = max(1, int(min_sample_s / max(one_s, 1e-7)))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            a @ b
        samples.append((time.perf_counter() - start) / inner)
    print(json.dumps({"samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
