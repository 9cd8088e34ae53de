"""A pipeline run on Mininet: one real stage process per stage device, bytes on real links.

:func:`emulate_pipeline` brings the topology's network up with the Mininet backend, starts
:mod:`testbed.baselines.stage_proc` in each stage device's namespace, waits for the steps, and
reads each stage host's interface counters before and after: the bytes that crossed the links
between stage hosts, next to the payload bytes the stages say they sent. The losses are real
(the last stage's), so the run can be checked against the single-process trainer.

This is the first piece of the emulated baselines: no churn, no PS process (the stages read
their data), not yet behind ``testbed up`` or ``testbed compare`` (docs/baselines.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from testbed.baselines.placement import device_infos, plan_pipeline
from testbed.baselines.sim_core import BaselineWorld
from testbed.topology import load_topology


def _wait_all(procs: Sequence[tuple[Any, subprocess.Popen]], timeout_s: float,
              log_of: Any) -> list[str]:
    """Wait for every process; on the first failure (or the deadline) kill the others, whose
    peers are gone (they would wait on a socket until the deadline). Returns the failures."""
    deadline = time.monotonic() + timeout_s
    failed: list[str] = []
    while True:
        running = [(tag, p) for tag, p in procs if p.poll() is None]
        failed = [f"{tag} exited {p.returncode} (see {log_of(tag)})" for tag, p in procs
                  if p.returncode not in (None, 0)]
        if not running or failed or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for tag, p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
            if not failed:
                failed.append(f"{tag} did not finish within {timeout_s:g} s")
    return failed


def emulate_pipeline(topology_path: str | Path, run_dir: Path, steps: int | None = None,
                     devices: Sequence[str] | None = None,
                     bounds: Sequence[tuple[int, int]] | None = None,
                     micro_batches: int | None = None, dilation: float = 1.0,
                     timeout_s: float = 600.0) -> dict[str, Any]:
    """Run the topology's job as a GPipe pipeline on Mininet; return what was measured."""
    from testbed.emulator.network.mininet import MininetNetwork

    topo = load_topology(topology_path)
    job = topo.job
    if devices is None or bounds is None:
        plan = plan_pipeline(job, device_infos(topo))
        devices, bounds = plan.devices, plan.bounds
    m = micro_batches or job.parallelism.micro_batches
    net = MininetNetwork(topo, dilation=dilation)
    world = BaselineWorld(topo, noise=False)  # for the paths' one-way delays only
    app_delay = not net.caps.netem  # without netem the stages apply the delay themselves
    delay_s = [[world.path(src, dst)[1] * dilation if app_delay and src != dst else 0.0
                for src in devices] for dst in devices]
    run_dir.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[int, subprocess.Popen]] = []
    out: dict[str, Any] = {}
    net.start()
    try:
        plan_doc = {"topology": str(Path(topology_path).resolve()), "devices": list(devices),
                    "bounds": [list(b) for b in bounds], "micro_batches": m,
                    "steps": steps or job.steps, "dilation": dilation,
                    "ips": [net.host_ip(d) for d in devices], "delay_s": delay_s}
        plan_path = run_dir / "pipeline_plan.json"
        plan_path.write_text(json.dumps(plan_doc, indent=2))
        before = {d: net.interface_counters(d) for d in devices}
        t0 = time.monotonic()
        for s, d in enumerate(devices):
            log = (run_dir / f"stage{s}.log").open("w")
            procs.append((s, net.popen(d, [sys.executable, "-m", "testbed.baselines.stage_proc",
                                           "--plan", str(plan_path), "--stage", str(s),
                                           "--out", str(run_dir / f"stage{s}.json")],
                                       stdout=log, stderr=subprocess.STDOUT)))
        failed = _wait_all([(f"stage{s}", p) for s, p in procs], timeout_s,
                           lambda tag: run_dir / f"{tag}.log")
        wall_s = time.monotonic() - t0
        after = {d: net.interface_counters(d) for d in devices}
        if failed:
            raise RuntimeError("; ".join(failed))
        stages = [json.loads((run_dir / f"stage{s}.json").read_text())
                  for s in range(len(devices))]
        out = {"devices": list(devices), "bounds": [list(b) for b in bounds],
               "micro_batches": m, "wall_s": wall_s, "stages": stages,
               "losses": stages[-1]["losses"], "network": net.describe(),
               "links": {d: {"tx_bytes": after[d]["tx_bytes"] - before[d]["tx_bytes"],
                             "rx_bytes": after[d]["rx_bytes"] - before[d]["rx_bytes"]}
                         for d in devices}}
        (run_dir / "pipeline_emulated.json").write_text(json.dumps(out, indent=2))
        return out
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
        net.stop()


def emulate_data_parallel(topology_path: str | Path, run_dir: Path, steps: int | None = None,
                          replicas: Sequence[str] | None = None, dilation: float = 1.0,
                          timeout_s: float = 600.0) -> dict[str, Any]:
    """Run the topology's job as synchronous data parallelism on Mininet: one replica process
    per replica device, the averaging PS process on the PS's node."""
    from testbed.baselines.cost import split_rows
    from testbed.baselines.placement import plan_data_parallel
    from testbed.emulator.network.mininet import MininetNetwork

    topo = load_topology(topology_path)
    job = topo.job
    if job.parallelism.local_steps != 1:
        raise ValueError("the emulated data-parallel run averages every step (local_steps: 1); "
                         "DiLoCo rounds run in the simulator only so far")
    if replicas is None:
        replicas = plan_data_parallel(job, device_infos(topo)).replicas
    names = list(replicas)
    net = MininetNetwork(topo, dilation=dilation)
    world = BaselineWorld(topo, noise=False)
    app_delay = not net.caps.netem
    delay_s = [world.path("ps", d)[1] * dilation if app_delay else 0.0 for d in names]
    run_dir.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[str, subprocess.Popen]] = []
    net.start()
    try:
        plan_doc = {"topology": str(Path(topology_path).resolve()), "devices": names,
                    "rows": [list(r) for r in split_rows(job.batch_size, len(names))],
                    "steps": steps or job.steps, "dilation": dilation, "dtype": job.dtype,
                    "ps_ip": net.host_ip(None), "delay_s": delay_s}
        plan_path = run_dir / "data_parallel_plan.json"
        plan_path.write_text(json.dumps(plan_doc, indent=2))
        nodes: list[str | None] = [None, *names]
        before = {n: net.interface_counters(n) for n in nodes}
        t0 = time.monotonic()
        base = [sys.executable, "-m", "testbed.baselines.replica_proc", "--plan", str(plan_path)]
        for i, node in enumerate(nodes):
            tag = "ps" if node is None else f"replica{i - 1}"
            role = ["--role", "ps"] if node is None else ["--role", "replica", "--replica",
                                                          str(i - 1)]
            log = (run_dir / f"{tag}.log").open("w")
            procs.append((tag, net.popen(node, [*base, *role, "--out",
                                                str(run_dir / f"{tag}.json")],
                                         stdout=log, stderr=subprocess.STDOUT)))
        failed = _wait_all(procs, timeout_s, lambda tag: run_dir / f"{tag}.log")
        wall_s = time.monotonic() - t0
        after = {n: net.interface_counters(n) for n in nodes}
        if failed:
            raise RuntimeError("; ".join(failed))
        reports = {tag: json.loads((run_dir / f"{tag}.json").read_text()) for tag, _ in procs}
        out = {"replicas": names, "rows": plan_doc["rows"], "wall_s": wall_s,
               "losses": reports["ps"]["losses"], "reports": reports,
               "network": net.describe(),
               "links": {("ps" if n is None else n): {
                   "tx_bytes": after[n]["tx_bytes"] - before[n]["tx_bytes"],
                   "rx_bytes": after[n]["rx_bytes"] - before[n]["rx_bytes"]} for n in nodes}}
        (run_dir / "data_parallel_emulated.json").write_text(json.dumps(out, indent=2))
        return out
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
        net.stop()
