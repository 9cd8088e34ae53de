"""Time dilation: stretch emulated time by D >= 1 when the host cannot keep up.

Emulated devices really compute their tiles with numpy on this host, then wait until their
model's device time has passed. With D, every emulated duration and delay is stretched by D on
the wall clock and every bandwidth divided by D; reports convert back:

    device_s = wall_s / D            lag_s = wall_s - D * model_device_s   (>= 0 is late)

``auto``: if all devices were busy at once, they would ask the host for
``sum_i G_i`` GFLOP of real numpy work per device-second (G_i the rate device i's model
predicts at the run's tile shape). The host delivers ``H`` GFLOP/s in total (the calibrated
single-thread numpy rate times the usable cores), of which we budget a ``headroom`` share
(the PS, gRPC and (de)serialization need the rest). Real compute keeps within emulated time when
``sum_i G_i / D <= headroom * H``, so

    D = max(1, sum_i G_i / (headroom * H))

Units: GFLOP/s (``_gflops``), seconds (``_s``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CALIBRATION_SHAPE = (128, 1024, 128)  # a typical tile: m, k, n


def auto_dilation(total_emulated_gflops: float, host_gflops: float,
                  headroom: float = 0.7) -> float:
    """D >= 1 such that the emulated devices' real compute fits in headroom * host_gflops."""
    if host_gflops <= 0:
        raise ValueError(f"host_gflops must be positive, got {host_gflops}")
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    if total_emulated_gflops < 0:
        raise ValueError(f"total_emulated_gflops must be >= 0, got {total_emulated_gflops}")
    return max(1.0, total_emulated_gflops / (headroom * host_gflops))


def device_seconds(wall_s: float, dilation: float) -> float:
    """Device time of a wall-clock interval under dilation D."""
    return wall_s / dilation


def wall_seconds(device_s: float, dilation: float) -> float:
    """Wall-clock time an emulated device must take for device_s under dilation D."""
    return device_s * dilation


def lag_seconds(wall_s: float, model_device_s: float, dilation: float) -> float:
    """How late a tile finished: its wall time minus the wall time its model asked for."""
    return wall_s - model_device_s * dilation


def usable_cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def calibrate_host_gflops(duration_s: float = 0.3, shape: tuple[int, int, int] = CALIBRATION_SHAPE,
                          cores: int | None = None, dtype: str = "float32") -> dict[str, float]:
    """Measure this host's single-thread numpy GEMM rate briefly; return it and the total.

    Returns ``{"single_thread_gflops", "cores", "host_gflops"}`` with host_gflops =
    single-thread rate x cores (emulated devices are separate single-threaded processes).
    The best of several short samples is used: other load only ever slows a sample down.
    """
    m, k, n = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    limiter = None
    try:
        from threadpoolctl import threadpool_limits
        limiter = threadpool_limits(limits=1, user_api="blas")
    except ImportError:  # the agent side may lack threadpoolctl; then BLAS picks its threads
        pass
    try:
        a @ b
        best_s = float("inf")
        deadline = time.perf_counter() + duration_s
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            for _ in range(4):
                a @ b
            best_s = min(best_s, (time.perf_counter() - start) / 4)
    finally:
        if limiter is not None:
            limiter.unregister()
    single = 2.0 * m * k * n / best_s / 1e9
    cores = cores or usable_cores()
    log.info("host calibration: %.1f GFLOP/s per thread x %d cores", single, cores)
    return {"single_thread_gflops": single, "cores": float(cores), "host_gflops": single * cores}


def choose_dilation(topology: Any) -> tuple[float, dict[str, Any]]:
    """The topology's time dilation, or (``time_dilation: auto``) D from a host calibration.

    Each group's rate is its profile's fitted time model at the job's tile shape (the
    profile's sustained GFLOPS when it has no model); returns (D, how it was chosen).
    """
    if topology.time_dilation is not None:
        return float(topology.time_dilation), {"mode": "fixed"}
    from testbed.perf_model.profiles import load_profile

    tile = topology.job.parallelism
    k = topology.job.model.hidden
    total = 0.0
    for group in topology.groups:
        profile = load_profile(str(group.profile_path))
        model = profile.model  # the fitted time model, when the profile has one
        seconds = model.predict_one(tile.tile_m, k, tile.tile_n) if model is not None else None
        rate = (2.0 * tile.tile_m * k * tile.tile_n / seconds / 1e9) if seconds else \
            profile.sustained_gflops
        total += rate * group.count
    host = calibrate_host_gflops()
    dilation = auto_dilation(total, host["host_gflops"])
    return dilation, {"mode": "auto", "emulated_gflops": round(total, 2),
                      "host_gflops": round(host["host_gflops"], 2)}
