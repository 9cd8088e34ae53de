"""Schedule efficiency: how close each planner's steps come to the analytic lower bound.

    .venv/bin/python bench/schedule_efficiency.py --quick      # small model, 1 step, minutes
    .venv/bin/python bench/schedule_efficiency.py --topologies hotcarbon --steps 1   # real size
    .venv/bin/python bench/schedule_efficiency.py --plan-only  # no run: plans against the bound

For each topology (default, home-wifi, campus, hotcarbon, large) and each planner
(``auto``, ``fifo``) a real ``testbed up`` run (loopback backend, real PS and agent processes)
trains ``--steps`` steps; printed per run, over its steps: bytes down / ``bytes_min_down``,
device time / ``bound_s``, tiles per device group and the wall time. ``--quick`` replaces each
job's model by a small one (hidden 128, 2 layers, sequence 64) so the whole bench finishes in
minutes.

``--simulate`` runs ``testbed simulate`` instead (the same planner and scheduler in virtual time,
no processes, no PS time): the full-size jobs in seconds; wall time is then the simulation's.

``--plan-only`` runs nothing: for every GEMM shape of one step it prints the planner's
predicted time against the bound of that GEMM alone on the topology's devices.
No figure is asserted; timings depend on the host and its load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOPOLOGIES = ("default", "home-wifi", "campus", "hotcarbon", "large")
QUICK_MODEL = {"hidden": 128, "layers": 2, "heads": 4, "ffn": 512, "seq_len": 64}


def _write_variant(name: str, planner: str, quick: bool, steps: int, out: Path) -> Path:
    """The topology with the bench's planner, steps and (``quick``) model; loopback network."""
    raw = yaml.safe_load((REPO / "topologies" / f"{name}.yaml").read_text())
    job = raw["job"]
    job["steps"] = steps
    job.setdefault("parallelism", {})["planner"] = planner
    if quick:
        job["model"].update(QUICK_MODEL)
        job["batch_size"] = min(job.get("batch_size", 8), 8)
    raw["network"]["backend"] = "loopback"
    path = out / f"{name}-{planner}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_one(topology: Path, out: Path, timeout_s: float, simulate: bool = False
            ) -> dict[str, Any]:
    """One `testbed up` (or `testbed simulate`) run; its steps and summary."""
    start = time.monotonic()
    argv = ["simulate", str(topology)] if simulate else ["up", str(topology), "--no-live"]
    proc = subprocess.run([sys.executable, "-m", "testbed.cli", *argv, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    wall_s = time.monotonic() - start
    dirs = sorted(d for d in out.glob("*") if d.is_dir())
    if proc.returncode != 0 or not dirs:
        return {"error": (proc.stdout + proc.stderr)[-400:], "wall_s": wall_s}
    run_dir = dirs[-1]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"steps": steps, "summary": summary, "wall_s": wall_s}


def describe(result: dict[str, Any]) -> str:
    """One line of figures for a run."""
    if "error" in result:
        return f"FAILED after {result['wall_s']:.0f} s: {result['error']!r}"
    steps = result["steps"]
    down = sum(s["bytes_down"] for s in steps)
    min_down = sum(s["bytes_min_down"] for s in steps) or 1
    dev = sum(s["device_time_s"] for s in steps)
    bound = sum(s["bound_s"] or 0 for s in steps) or float("nan")
    groups: dict[str, int] = {}
    for d in result["summary"].get("devices", []):
        groups[d.get("group", "?")] = groups.get(d.get("group", "?"), 0) + d.get("tiles_done", 0)
    sat = result["summary"].get("sat_out") or {}
    wall = sum(s["wall_s"] for s in steps) or float("nan")
    gemm_wall = sum(s.get("gemm_wall_s", 0.0) for s in steps)
    # the rest of the step's wall time no offloaded GEMM was outstanding: the PS's own work
    simulated = bool(result["summary"].get("simulated"))  # its gemm_wall_s is host time
    ps_share = f"  PS-only {1 - gemm_wall / wall:4.0%} of wall" \
        if gemm_wall and not simulated else ""
    return (f"down/min {down / min_down:6.2f}  device/bound {dev / bound:6.2f}  "
            f"device {dev:8.2f} s  bound {bound:8.3f} s  wall {result['wall_s']:6.0f} s  "
            f"tiles {groups}{ps_share}" + (f"  sat out {sat}" if sat else ""))


def plan_only(names: list[str], quick: bool) -> None:
    """Print, per GEMM shape, the plan's predicted time against the GEMM's bound."""
    from testbed.ps_backend.bound import (
        BoundDevice,
        BoundGemm,
        PsLink,
        SwitchLink,
        lowest_switch_link,
        stage_bound,
    )
    from testbed.ps_backend.config import plan_inputs
    from testbed.ps_backend.planner import PlanDevice, plan_gemm
    from testbed.topology import load_topology

    for name in names:
        topo = load_topology(REPO / "topologies" / f"{name}.yaml")
        inputs = plan_inputs(topo)
        plan_links, own_links = inputs["plan_links"], inputs["group_links"]
        classes = []
        for g, n, r in inputs["planned_groups"]:
            down, up, rtt = plan_links[g]
            classes.append(PlanDevice(g, r * 1e9, down, up, rtt, count=n))
        # each device below the lowest switch link on its path, which the bound caps them by
        links = {sw: SwitchLink(*v) for sw, v in inputs["switch_links"].items()}
        devices = []
        for c in classes:
            down, up, rtt = own_links[c.name]
            link = lowest_switch_link(inputs["group_paths"][c.name], links)
            devices += [BoundDevice(f"{c.name}{i}", c.rate_flops, down, up, rtt, link)
                        for i in range(c.count)]
        spec = topo.job.model
        hidden, ffn, seq = (128, 512, 64) if quick else (spec.hidden, spec.ffn, spec.seq_len)
        tokens = topo.job.batch_size * seq
        item = 4 if topo.job.dtype == "float32" else 8
        print(f"{name}: {tokens} tokens, hidden {hidden}, ffn {ffn}")
        for label, (m, k, n) in (("fwd qkv", (tokens, hidden, 3 * hidden)),
                                 ("fwd fc1", (tokens, hidden, ffn)),
                                 ("dX fc1", (tokens, ffn, hidden)),
                                 ("dW fc1", (ffn, tokens, hidden))):
            plan = plan_gemm(m, k, n, item, classes, *inputs["ps_link_Bps"])
            bound = stage_bound([BoundGemm(m, k, n, item, "s")], devices,
                                PsLink(*inputs["ps_link_Bps"]), set(), links=links)
            print(f"  {label:8s} grid {plan.grid} tile {plan.tile_m}x{plan.tile_n} "
                  f"predicted {plan.predicted_s:8.4f} s  bound {bound.bound_s:8.4f} s "
                  f"({bound.limit})  ratio {plan.predicted_s / bound.bound_s:5.2f}"
                  + (f"  sat out {plan.sat_out}" if plan.sat_out else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, one step")
    p.add_argument("--plan-only", action="store_true", help="print plans against the bound")
    p.add_argument("--simulate", action="store_true",
                   help="run `testbed simulate` (virtual time) instead of `testbed up`")
    p.add_argument("--topologies", default=",".join(TOPOLOGIES),
                   help="comma-separated names in topologies/ (default: "
                        + ",".join(TOPOLOGIES) + ")")
    p.add_argument("--planners", default="auto,fifo", help="comma-separated: auto, fifo")
    p.add_argument("--steps", type=int, default=1,
                   help="steps per run (default 1)")
    p.add_argument("--timeout-s", type=float, default=3600,
                   help="per run, seconds (default 3600)")
    args = p.parse_args(argv)
    names = [n for n in args.topologies.split(",") if n]
    unknown = [n for n in names if not (REPO / "topologies" / f"{n}.yaml").exists()]
    planners = [x for x in args.planners.split(",") if x]
    if unknown or any(x not in ("auto", "fifo") for x in planners) or args.steps < 1:
        print(f"error: unknown topology {unknown} or planner {planners}, or --steps < 1",
              file=sys.stderr)
        return 2
    if args.plan_only:
        plan_only(names, args.quick)
        return 0
    failed = False
    with tempfile.TemporaryDirectory(prefix="tb-sched-") as tmp:
        for name in names:
            for planner in planners:
                out = Path(tmp) / f"{name}-{planner}"
                out.mkdir()
                topology = _write_variant(name, planner, args.quick, args.steps, out)
                result = run_one(topology, out / "runs", args.timeout_s, args.simulate)
                failed |= "error" in result
                print(f"{name:10s} {planner:5s} {describe(result)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
