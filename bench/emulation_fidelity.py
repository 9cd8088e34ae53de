"""Benchmark: how faithfully emulated devices keep to their performance model's tile times.

An in-process PS (:class:`PsServer`) hands GEMM tiles (submitted through
:class:`TileExecutor`) to real agent processes (``python -m testbed.agent --kind emulated``,
one BLAS thread each). Each agent really computes a tile, then holds the result until
``compute_s x D`` has passed, ``compute_s`` being its device model's time for the tile (the model
prediction with sampled noise and thermal factor) and D the time dilation; the result carries
``compute_s``.

Measured from the PS side, per device and tile i: the tile started on the device at
``start_i = max(received_s_i, arrived_{i-1})`` - the later of the moment its operands were on
the device (``TileResult.received_s``, the agent's ``time.monotonic()``, the same system-wide
CLOCK_MONOTONIC the PS reads) and the moment the device's previous result reached the PS (the
compute thread is sequential) - and ended when its result reached the PS (``arrived_i``).
``(arrived_i - start_i) / D`` is the tile's emulated duration as the PS saw it (it includes the
result's trip back, ~0.1-1 ms on loopback, and the PS loop's delay in reading it); its relative
error against the tile's ``compute_s`` is what this prints (median, p95, max, mean signed), plus
the share of tiles whose agent reported real compute longer than the hold (``lag_s > 0``) and
the share that waited for operands (the PS could not feed the device).

Measured at the device, per tile: ``(done_s - started_s) / D`` (``TileResult.started_s`` and
``done_s``: when the agent started computing and when the result was ready, the hold over) against
``compute_s``: what the emulator itself controls. The gap between the two figures is the PS's and
the host's share (a starved PS loop reads results late), not the emulated device's.

Settings: low load (2 agents), high load (16 agents on this machine's cores) and 240 agents,
each with a fixed D (1 at low load, else the formula's :func:`auto_dilation`) and with adaptive
D (the PS's probe, :func:`testbed.ps_backend.main.run_probe`, then
:class:`~testbed.emulator.dilation.DilationController` between "steps" of a few GEMMs each, as
in a run). Per tile the device-side error uses the D it ran at.

Per setting it also splits the device-side lateness (real compute beyond the hold, the hold's
wake-up) and the wait from a result being ready to the PS reading it, and prints the probe's D,
the D of each step and the host's 1-minute load average (other work on the host counts).
The many-agents settings use a GEMM of 256 tiles (2048 x 1024 x 2048), one per step.

    .venv/bin/python bench/emulation_fidelity.py --quick   # low and high load, ~20 s
    .venv/bin/python bench/emulation_fidelity.py [--quick] [--only LABEL]
        [--profile snapdragon888] [--high-agents 16] [--many-agents 240] [--target 0.1]
        [--many-target 0.15] [--gemms 24] [--many-gemms 12]
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from types import SimpleNamespace  # noqa: E402

from testbed.emulator.dilation import (  # noqa: E402
    DilationController,
    auto_dilation,
    calibrate_host_gflops,
    error_quantiles,
    tile_error,
)
from testbed.perf_model.profiles import load_profile  # noqa: E402
from testbed.ps_backend.core import PsConfig  # noqa: E402
from testbed.ps_backend.executor import TileExecutor  # noqa: E402
from testbed.ps_backend.host import PsServer  # noqa: E402
from testbed.ps_backend.scheduler import GemmSpec  # noqa: E402

log = logging.getLogger("bench.fidelity")


@dataclass
class ResultRecord:
    """One accepted tile result as the PS received it."""

    arrived_s: float  # PS monotonic clock
    device_id: str
    compute_s: float  # the device model's time for the tile (device seconds)
    lag_s: float  # real compute beyond the hold, as the agent reported it
    received_s: float  # when the tile's operands were on the device (agent monotonic clock)
    started_s: float  # when the agent started computing it
    done_s: float  # when the result was ready on the device (the hold over)
    dilation: float = 1.0  # the D the PS had set when the result arrived


class PsHarness:
    """An in-process PS plus agent processes; records every result; cleans up what it started."""

    def __init__(self, dilation: float, tile: int = 128, max_message_bytes: int = 64 << 20):
        self.token = secrets.token_hex(8)
        self.dilation = dilation
        config = PsConfig(token=self.token, run_name="bench", dtype=np.dtype("float32"),
                          tile_m=tile, tile_n=tile, min_offload_flops=0.0, lease_s=30.0,
                          max_message_bytes=max_message_bytes, time_dilation=dilation)
        self.server = PsServer(config).start()
        self.executor = TileExecutor(self.server)
        self.records: list[ResultRecord] = []
        self.agents: list[subprocess.Popen] = []
        self.logdir = Path(tempfile.mkdtemp(prefix="bench-fidelity-"))
        core = self.server.core
        assert core is not None

        def recording(conn: Any, result: Any, arrived: float) -> None:  # the PS loop thread
            self.records.append(ResultRecord(arrived, conn.device_id, result.compute_s,
                                             result.lag_s, result.received_s, result.started_s,
                                             result.done_s, core.config.time_dilation))
        core.accepted_observers.append(recording)

    def spawn(self, name: str, kind: str, profile: str = "", seed: int = 0,
              max_in_flight: int = 3, cores: set[int] | None = None) -> None:
        """Start one agent process."""
        cmd = [sys.executable, "-m", "testbed.agent", "--ps", f"127.0.0.1:{self.server.port}",
               "--name", name, "--kind", kind, "--seed", str(seed),
               "--max-in-flight", str(max_in_flight)]
        if profile:
            cmd += ["--profile", profile]
        env = dict(os.environ, TESTBED_TOKEN=self.token, OPENBLAS_NUM_THREADS="1",
                   OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        out = open(self.logdir / f"{name}.log", "w")
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None  # a host made slow
        self.agents.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            cwd=REPO, preexec_fn=pin))

    def wait_joined(self, count: int, timeout_s: float = 120.0) -> None:
        """Block until count devices are attached (their Work stream open)."""
        core = self.server.core
        assert core is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            attached = self.server.call(
                lambda: sum(c.outbox is not None for c in core.conns.values()))
            if attached >= count:
                return
            dead = [p.args[6] for p in self.agents if p.poll() is not None]
            if dead:
                raise RuntimeError(f"agent(s) exited early: {dead}; logs in {self.logdir}")
            time.sleep(0.1)
        raise TimeoutError(f"only {attached} of {count} agents attached in {timeout_s} s")

    def run_gemms(self, count: int, m: int, k: int, n: int, step: int = 0,
                  b_key: str = "bench.w") -> float:
        """Submit count GEMMs at once (B cached on devices under b_key); wall seconds to finish."""
        gen = torch.Generator().manual_seed(step)
        b = torch.randn(k, n, generator=gen)
        handles = []
        start = time.monotonic()
        for _ in range(count):
            a = torch.randn(m, k, generator=gen)
            handles.append(self.executor.submit(a, b, GemmSpec("bench", "forward", step,
                                                               b_key=f"{b_key}@{step}")))
        for h in handles:
            h.result()
        return time.monotonic() - start

    def close(self) -> None:
        """Stop the PS (devices get Stop), then end the agents we started, by pid."""
        try:
            self.server.stop("benchmark done")
        finally:
            for p in self.agents:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in self.agents:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if all(p.returncode in (0, -signal.SIGTERM) for p in self.agents):
                shutil.rmtree(self.logdir, ignore_errors=True)  # kept when an agent failed

    def __enter__(self) -> "PsHarness":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tile_errors(records: list[ResultRecord], dilation: float,
                skip_first: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per tile: relative error of its emulated duration against compute_s, its lag_s, and
    whether it waited for its operands (see the module docstring)."""
    by_device: dict[str, list[ResultRecord]] = {}
    for r in records:
        by_device.setdefault(r.device_id, []).append(r)
    errors, lags, starved = [], [], []
    for recs in by_device.values():
        for prev, cur in zip(recs[skip_first:], recs[skip_first + 1:]):
            start_s = max(cur.received_s, prev.arrived_s)
            device_s = (cur.arrived_s - start_s) / dilation
            errors.append(device_s / cur.compute_s - 1.0)
            lags.append(cur.lag_s)
            starved.append(cur.received_s > prev.arrived_s)
    return np.array(errors), np.array(lags), np.array(starved)


GEMMS_PER_STEP = 4  # adaptive mode: D may change after every this many GEMMs


def lateness_parts(records: list[ResultRecord]) -> dict[str, float]:
    """Where a tile's device-side lateness arises, p95 in ms: real compute beyond the hold
    (``lag_s``, the host's CPU share), the rest of the lateness (the hold's wake-up: the run
    queue, the GIL), and the wait from the result being ready to the PS reading it (the agent's
    uplink thread, gRPC, the PS's loop: the PS's share, outside the device-side error)."""
    if not records:
        return {"overrun_p95_ms": 0.0, "late_p95_ms": 0.0, "wake_p95_ms": 0.0,
                "to_ps_p95_ms": 0.0}
    late = np.array([r.done_s - r.started_s - r.compute_s * r.dilation for r in records])
    overrun = np.array([r.lag_s for r in records])
    to_ps = np.array([r.arrived_s - r.done_s for r in records])
    p95 = lambda x: float(np.quantile(x, 0.95) * 1e3)  # noqa: E731
    return {"overrun_p95_ms": p95(overrun), "late_p95_ms": p95(late),
            "wake_p95_ms": p95(np.maximum(0.0, late - overrun)), "to_ps_p95_ms": p95(to_ps)}


def run_setting(label: str, agents: int, dilation: float | None, profile: str, gemms: int,
                shape: tuple[int, int, int], start: float = 1.0,
                target: float = 0.1, gemms_per_step: int = 4) -> dict[str, Any]:
    """One setting: start agents, run GEMMs, return the error figures (dilation None: adaptive,
    probing from ``start``)."""
    m, k, n = shape
    started = time.monotonic()
    probe_d = None
    with PsHarness(dilation or start) as ps:
        for i in range(agents):
            ps.spawn(f"emu-{i}", "emulated", profile, seed=i)
        ps.wait_joined(agents, timeout_s=max(120.0, agents * 1.5))
        controller = None
        if dilation is None:
            from testbed.ps_backend.main import run_probe
            job = SimpleNamespace(parallelism=SimpleNamespace(tile_m=128, tile_n=128),
                                  model=SimpleNamespace(hidden=k), dtype="float32")
            d, _ = run_probe(ps.server, ps.executor, job, agents, start, target, seed=1)
            ps.server.call(lambda: ps.server.core.set_dilation(d))  # type: ignore[union-attr]
            controller = DilationController(d, target)
            probe_d = d
        dilations = [ps.server.config.time_dilation]
        ps.run_gemms(2, m, k, n, step=0)  # warm-up: operand caches, thermal start
        ps.records.clear()
        wall_s, step = 0.0, 0
        step_p95: list[float] = []  # each step's device-side p95 error
        while step * gemms_per_step < gemms:
            first = len(ps.records)
            wall_s += ps.run_gemms(min(gemms_per_step, gemms - step * gemms_per_step), m, k, n,
                                   step=step + 1)
            step += 1
            step_errors = [tile_error(r.started_s, r.done_s, r.compute_s, r.dilation)
                           for r in ps.records[first:]]
            step_p95.append(error_quantiles(step_errors)["p95"] or 0.0)
            if controller is not None:  # between steps, as the PS's run loop does
                controller.observe(step_errors)
                d = controller.between_steps()
                ps.server.call(lambda d=d: ps.server.core.set_dilation(d))  # type: ignore
                dilations.append(d)
        final_d = ps.server.config.time_dilation
        errors, lags, starved = tile_errors(ps.records, final_d)
        at_device = np.array([tile_error(r.started_s, r.done_s, r.compute_s, r.dilation)
                              for r in ps.records])
        tiles = len(ps.records)
        records = list(ps.records)
        parts = lateness_parts(records)
        dilation = final_d
        load_1m = os.getloadavg()[0]
    if len(errors) == 0:
        raise RuntimeError(f"{label}: no tiles were observed")
    abs_err = np.abs(errors)
    return {"agents": agents, "dilation": dilation, "tiles": tiles, "samples": len(errors),
            "wall_s": wall_s, "median_err": float(np.median(abs_err)),
            "p95_err": float(np.quantile(abs_err, 0.95)), "max_err": float(abs_err.max()),
            "mean_signed_err": float(errors.mean()),
            "lagging_share": float(np.mean(lags > 0)), "starved_share": float(starved.mean()),
            "p95_lag_ms": float(np.quantile(lags, 0.95) * 1e3),
            "device_median_err": float(np.median(np.abs(at_device))),
            "device_p95_err": float(np.quantile(np.abs(at_device), 0.95)),
            "probe_d": probe_d, "d_min": min(dilations), "d_max": max(dilations),
            "d_path": dilations[:-1] if probe_d is not None else dilations,  # D of each step
            "d_next": final_d, "step_p95": step_p95,
            "load_1m": load_1m, "setting_s": time.monotonic() - started, **parts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="snapdragon888", help="device profile of the agents")
    p.add_argument("--low-agents", type=int, default=2,
                   help="agents of the low-load settings")
    p.add_argument("--high-agents", type=int, default=16,
                   help="agents of the high-load settings")
    p.add_argument("--many-agents", type=int, default=240,
                   help="agents of the many-agents settings")
    p.add_argument("--target", type=float, default=0.1,
                   help="adaptive p95 error target, a fraction")
    p.add_argument("--many-target", type=float, default=0.15,
                   help="adaptive p95 error target with many agents")
    p.add_argument("--quick", action="store_true",
                   help="8 GEMMs a setting, low and high load only (about 20 s): the "
                        "many-agents settings need GBs of memory; with --only many, many "
                        "agents adaptive only")
    p.add_argument("--only", default="", help="run only settings whose label contains this")
    p.add_argument("--gemms", type=int, default=24, help="GEMMs per setting (32 tiles each)")
    p.add_argument("--shape", type=int, nargs=3, default=(512, 2048, 1024),
                   metavar=("M", "K", "N"), help="each GEMM; tiles are 128 x K x 128")
    p.add_argument("--many-gemms", type=int, default=12,
                   help="GEMMs of the many-agents settings (one per step)")
    p.add_argument("--many-shape", type=int, nargs=3, default=(2048, 1024, 2048),
                   metavar=("M", "K", "N"),
                   help="the many-agents settings' GEMM: 256 tiles, about one per device")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    profile = load_profile(args.profile)
    assert profile.model is not None, f"profile {args.profile} has no time model"

    def model_gflops(k: int) -> float:
        tile = (128, k, 128)
        return float(2.0 * np.prod(tile) / profile.model.predict_one(*tile) / 1e9)

    host = calibrate_host_gflops()
    d_auto = auto_dilation(args.high_agents * model_gflops(args.shape[1]), host["host_gflops"])
    d_many = auto_dilation(args.many_agents * model_gflops(args.many_shape[1]),
                           host["host_gflops"])
    print(f"profile {args.profile}: model rate {model_gflops(args.shape[1]):.1f} GFLOP/s at "
          f"tile 128 x {args.shape[1]} x 128; host {host['single_thread_gflops']:.1f} "
          f"GFLOP/s/thread x {host['cores']:.0f} cores; formula's D for {args.high_agents} "
          f"agents: {d_auto:.2f}, for {args.many_agents}: {d_many:.2f}")
    gemms = 8 if args.quick else args.gemms
    many_gemms = max(4, args.many_gemms // 2) if args.quick else args.many_gemms
    shape, many_shape = tuple(args.shape), tuple(args.many_shape)
    # label, agents, fixed D (None: adaptive), start D, GEMMs, shape, GEMMs per step, target
    few = (gemms, shape, GEMMS_PER_STEP, args.target)
    many = (many_gemms, many_shape, 1, args.many_target)
    plan = [("low, fixed D", args.low_agents, 1.0, 1.0, *few),
            ("low, adaptive", args.low_agents, None, 1.0, *few),
            ("high, fixed D", args.high_agents, d_auto, d_auto, *few),
            ("high, adaptive", args.high_agents, None, d_auto, *few),
            ("many, adaptive", args.many_agents, None, d_many, *many)]
    if not args.quick:
        plan.insert(4, ("many, fixed D", args.many_agents, d_many, d_many, *many))
    elif "many" not in args.only:
        # the many agents' PS held 3.4 GB when a quick run was killed for memory on a host
        # with 3.1 GB free; a smoke run must not risk that
        plan.pop()
        print(f"  (many, adaptive: left out by --quick, {args.many_agents} agents; "
              "--quick --only many runs it)", flush=True)
    rows = []
    for label, agents, d, start, count, gemm, per_step, target in plan:
        if args.only in label:
            rows.append((label, run_setting(label, agents, d, args.profile, count, gemm,
                                            start=start, target=target,
                                            gemms_per_step=per_step)))
            print(f"  ({label}: {rows[-1][1]['setting_s']:.0f} s)", flush=True)
    print(f"\nat the device: (done - started) / (D x compute_s) - 1 per tile; adaptive target "
          f"p95 <= {100 * args.target:.0f}% ({100 * args.many_target:.0f}% with many agents)")
    print("late = done beyond started + D x compute_s; overrun = real compute beyond the hold; "
          "wake = the rest (the hold's wake-up); to PS = result ready -> PS read it (p95, ms)")
    print(f"{'setting':<16}{'agents':>7}{'probe D':>8}{'D range':>14}{'tiles':>7}"
          f"{'med%':>7}{'p95%':>7}{'late':>7}{'overrun':>8}{'wake':>7}{'to PS':>8}"
          f"{'load 1m':>8}{'wall s':>7}")
    for label, r in rows:
        probe = "-" if r["probe_d"] is None else f"{r['probe_d']:.2f}"
        d_range = f"{r['d_min']:.2f}-{r['d_max']:.2f}" if r["d_max"] > r["d_min"] \
            else f"{r['d_min']:.2f}"
        print(f"{label:<16}{r['agents']:>7}{probe:>8}{d_range:>14}{r['tiles']:>7}"
              f"{100 * r['device_median_err']:>7.2f}{100 * r['device_p95_err']:>7.2f}"
              f"{r['late_p95_ms']:>7.2f}{r['overrun_p95_ms']:>8.2f}{r['wake_p95_ms']:>7.2f}"
              f"{r['to_ps_p95_ms']:>8.1f}{r['load_1m']:>8.1f}{r['wall_s']:>7.1f}")
    for label, r in rows:
        if r["probe_d"] is not None:
            path = " ".join(f"{d:.2f}" for d in r["d_path"])
            p95s = " ".join(f"{100 * e:.1f}" for e in r["step_p95"])
            print(f"{label}: D per step {path} (next: {r['d_next']:.2f}); "
                  f"p95% per step {p95s}")
    print("\nas the PS saw each tile: (arrived - max(received, previous arrived)) / D against "
          "compute_s (final D)")
    print(f"{'setting':<16}{'timed':>7}{'median%':>9}{'p95%':>8}{'max%':>8}{'bias%':>8}"
          f"{'lagging':>9}{'fed late':>9}")
    for label, r in rows:
        print(f"{label:<16}{r['samples']:>7}"
              f"{100 * r['median_err']:>9.2f}{100 * r['p95_err']:>8.2f}{100 * r['max_err']:>8.1f}"
              f"{100 * r['mean_signed_err']:>8.2f}{100 * r['lagging_share']:>8.1f}%"
              f"{100 * r['starved_share']:>8.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
