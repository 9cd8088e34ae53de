"""The same topologies run both ways: emulated (`testbed up`, real processes) and simulated
(`testbed simulate`), side by side.

Per step: device time (emulated: wall / dilation; simulated: virtual seconds), bytes down and up,
tiles; per run: tiles per device group, and the churn actions each applied (same trace, same
order?). The emulated step also reports ``gemm_wall_s`` (wall time some offloaded GEMM was
outstanding); ``wall_s - gemm_wall_s`` is the PS's own work between GEMMs (layer norms,
attention, the optimizer, small GEMMs, Python), which the simulation does not model: the column
``emu PS-local`` shows it in device seconds, and ``sim + PS-local`` what the simulated time
would be with it added, to say which part of a gap it explains.

    .venv/bin/python bench/sim_vs_emu.py --quick     # tests/data/tiny.yaml, 2 steps
    .venv/bin/python bench/sim_vs_emu.py [--steps N] [--cases default,campus,...]
    .venv/bin/python bench/sim_vs_emu.py --cases default --steps 1 --keep /tmp/sve
    .venv/bin/python bench/sim_vs_emu.py --cases default --steps 1 --emu-from /tmp/sve

``--keep DIR`` keeps both run directories (``DIR/<case>/emu``, ``DIR/<case>/sim``) to compare
their steps.jsonl, devices.jsonl and events.jsonl; ``--emu-from DIR`` reads the emulated run
kept there instead of running it again (the slow half), and simulates afresh.

Cases: default, home-wifi, campus, hotcarbon-short (15 phones, 2 of the 12 layers, seq 128,
batch 4) and default under each ready churn trace (traces/*.csv). Emulation is CPU-heavy:
every case brings up real processes (and Mininet namespaces when root).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = ROOT / "topologies"
TRACES = ROOT / "traces"
TINY = ROOT / "tests" / "data" / "tiny.yaml"


def cases(quick: bool) -> dict[str, tuple[Path, Path | None, dict[str, Any]]]:
    """name -> (topology, churn trace or None, job overrides)."""
    if quick:
        return {"tiny": (TINY, None, {})}
    out: dict[str, tuple[Path, Path | None, dict[str, Any]]] = {
        "default": (TOPOLOGIES / "default.yaml", None, {}),
        "home-wifi": (TOPOLOGIES / "home-wifi.yaml", None, {}),
        "campus": (TOPOLOGIES / "campus.yaml", None, {}),
        "hotcarbon-short": (TOPOLOGIES / "hotcarbon.yaml", None,
                            {"model": {"layers": 2, "seq_len": 128}, "batch_size": 4}),
    }
    for trace in sorted(TRACES.glob("*.csv")):
        out[f"default+{trace.stem}"] = (TOPOLOGIES / "default.yaml", trace, {})
    return out


def write_topology(src: Path, overrides: dict[str, Any], dst: Path) -> Path:
    """The topology with job overrides applied (a copy; the source is not touched)."""
    doc = yaml.safe_load(src.read_text())
    for key, value in overrides.items():
        if isinstance(value, dict):
            doc["job"].setdefault(key, {}).update(value)
        else:
            doc["job"][key] = value
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dst


def run(command: str, topology: Path, steps: int, out: Path, trace: Path | None,
        timeout_s: float, ps_gemm_s: float = 0.0) -> tuple[Path | None, float, str]:
    """Run `testbed up|simulate`; (run directory, wall seconds, error text)."""
    cmd = [sys.executable, "-m", "testbed.cli", command, str(topology), "--steps", str(steps),
           "--out", str(out)]
    if command == "up":
        cmd.append("--no-live")
    elif ps_gemm_s > 0:
        cmd += ["--ps-gemm-s", repr(ps_gemm_s)]
    if trace is not None:
        cmd += ["--churn", str(trace)]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - start, f"timed out after {timeout_s:g} s"
    wall = time.monotonic() - start
    dirs = sorted(p for p in out.iterdir() if p.is_dir()) if out.exists() else []
    if proc.returncode != 0 or not dirs:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        return (dirs[-1] if dirs else None), wall, f"exit {proc.returncode}: {tail}"
    return dirs[-1], wall, ""


def reuse(emu_root: Path) -> tuple[Path | None, float, str]:
    """A kept emulated run (the newest run directory under ``emu_root``); no wall time."""
    dirs = sorted(p for p in emu_root.iterdir() if p.is_dir())
    if not dirs or not (dirs[-1] / "steps.jsonl").exists():
        return None, 0.0, f"no run with steps.jsonl under {emu_root}"
    return dirs[-1], 0.0, ""


def read_run(run_dir: Path) -> dict[str, Any]:
    """Steps, tiles per group and the churn actions applied, from a run directory."""
    def jsonl(name: str) -> list[dict[str, Any]]:
        path = run_dir / name
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    from testbed.ps_backend.ledger import iter_step_records

    groups: Counter[str] = Counter()
    devices = jsonl("devices.jsonl")
    steps = jsonl("steps.jsonl")
    if (run_dir / "ledger").is_dir():  # emulated: the accepted tiles of the training steps
        # the ledger keeps (devices.jsonl's totals also count the time-dilation probe's tiles)
        group_of = {d["device"]: d.get("group", "?") for d in devices}
        for step in steps:
            for record in iter_step_records(run_dir / "ledger", int(step["step"])):
                groups[group_of.get(record.device, "?")] += 1
    else:
        for d in devices:
            groups[d.get("group", "?")] += int(d.get("tiles_done", 0))
    churn = [(e.get("action"), e.get("device"), e.get("effect")) for e in jsonl("events.jsonl")
             if e.get("kind", e.get("event")) == "churn"]
    return {"steps": steps, "groups": groups, "churn": churn}


def _ratio(sim: float, emu: float) -> str:
    return f"{sim / emu:6.2f}" if emu > 0 else "     -"


def compare(name: str, emu: dict[str, Any], sim: dict[str, Any],
            bare: dict[str, Any] | None = None) -> list[float]:
    """Print one case side by side; return sim/emu device-time ratios per step.

    ``bare``: the simulation without the PS's per-GEMM time, when ``sim`` has it.
    """
    print(f"\n== {name}")
    if bare is not None:
        print("simulated device time without the PS's per-GEMM time, per step: " + ", ".join(
            f"{float(b['device_time_s']):.3f}" for b in bare["steps"]))
    print(f"{'step':>4} {'emu dev s':>10} {'sim dev s':>10} {'sim/emu':>7} {'emu PS-local':>12} "
          f"{'sim+PS-local':>12} {'/emu':>6} {'gap/GEMM ms':>11} {'tiles e/s':>13} "
          f"{'MB down e/s':>15} {'MB up e/s':>15}")
    ratios = []
    for e, s in zip(emu["steps"], sim["steps"]):
        dilation = float(e.get("time_dilation") or 1.0)
        ps_local = max(0.0, float(e["wall_s"]) - float(e.get("gemm_wall_s") or 0.0)) / dilation
        emu_s, sim_s = float(e["device_time_s"]), float(s["device_time_s"])
        ratios.append(sim_s / emu_s if emu_s > 0 else float("nan"))
        # host wall ms per offloaded GEMM that would close the gap (a flat per-GEMM cost)
        gap_ms = (emu_s - sim_s) * dilation / max(1, int(s.get("gemms") or 0)) * 1e3
        print(f"{e['step']:>4} {emu_s:>10.3f} {sim_s:>10.3f} {_ratio(sim_s, emu_s):>7} "
              f"{ps_local:>12.3f} {sim_s + ps_local:>12.3f} "
              f"{_ratio(sim_s + ps_local, emu_s):>6} {gap_ms:>11.2f} "
              f"{e['tiles']:>6}/{s['tiles']:<6} "
              f"{e['bytes_down'] / 1e6:>7.2f}/{s['bytes_down'] / 1e6:<7.2f} "
              f"{e['bytes_up'] / 1e6:>7.2f}/{s['bytes_up'] / 1e6:<7.2f}")
    groups = sorted(set(emu["groups"]) | set(sim["groups"]))
    emu_n, sim_n = max(1, sum(emu["groups"].values())), max(1, sum(sim["groups"].values()))
    print(f"share of tiles per group, emulated ({emu_n} tiles of the steps its ledger keeps) / "
          f"simulated ({sim_n} tiles of all steps): " + ", ".join(
              f"{g} {100 * emu['groups'][g] / emu_n:.0f}%/{100 * sim['groups'][g] / sim_n:.0f}%"
              for g in groups))
    if emu["churn"] or sim["churn"]:
        n = min(len(emu["churn"]), len(sim["churn"]))
        same = emu["churn"][:n] == sim["churn"][:n]
        print(f"churn actions applied: emulated {len(emu['churn'])}, simulated "
              f"{len(sim['churn'])}; the first {n} {'agree' if same else 'DIFFER'}")
    return ratios


def main(argv: list[str] | None = None) -> int:
    """Run the cases both ways and print them side by side."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tests/data/tiny.yaml only")
    p.add_argument("--steps", type=int, default=2,
                   help="steps per run, both ways (default 2)")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--timeout-s", type=float, default=1800.0,
                   help="per emulated run, seconds (default 1800)")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="keep the run directories under DIR/<case>/{emu,sim} (default: "
                        "a temporary directory, removed)")
    p.add_argument("--emu-from", type=Path, default=None, metavar="DIR",
                   help="read each case's emulated run from DIR/<case>/emu (as --keep left "
                        "it) instead of running it")
    p.add_argument("--ps-gemm-ms", type=float, default=0.0,
                   help="model the PS's own time per offloaded GEMM in the simulation: this "
                        "many host wall ms, divided by the emulated run's time dilation")
    args = p.parse_args(argv)
    table = cases(args.quick)
    wanted = [c for c in args.cases.split(",") if c] or list(table)
    unknown = [c for c in wanted if c not in table]
    if unknown:
        print(f"error: unknown case(s) {unknown}; choose from {list(table)}", file=sys.stderr)
        return 2
    if args.emu_from is not None:
        missing = [c for c in wanted if not (args.emu_from / c / "emu").is_dir()]
        if missing:
            print(f"error: --emu-from {args.emu_from}: no emulated run for {missing} "
                  f"(expected {args.emu_from}/<case>/emu/<run>)", file=sys.stderr)
            return 2
    summary = []
    with tempfile.TemporaryDirectory(prefix="sim-vs-emu-") as scratch:
        tmp = str(args.keep) if args.keep is not None else scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for name in wanted:
            src, trace, overrides = table[name]
            topo = write_topology(src, overrides, Path(tmp) / f"{name}.yaml")
            if args.emu_from is not None:
                emu_dir, emu_wall, emu_err = reuse(args.emu_from / name / "emu")
            else:
                emu_dir, emu_wall, emu_err = run("up", topo, args.steps,
                                                 Path(tmp) / name / "emu", trace, args.timeout_s)
            dilation = 1.0
            if emu_dir is not None and args.ps_gemm_ms > 0:
                first = read_run(emu_dir)["steps"][:1]
                dilation = float(first[0].get("time_dilation") or 1.0) if first else 1.0
            sim_dir, sim_wall, sim_err = run("simulate", topo, args.steps,
                                             Path(tmp) / name / "sim", trace, args.timeout_s,
                                             args.ps_gemm_ms / 1e3 / dilation)
            emu_note = f" ({emu_err})" if emu_err else ""
            sim_note = f" ({sim_err})" if sim_err else ""
            print(f"\n{name}: emulated {emu_wall:.1f} s wall{emu_note}, simulated "
                  f"{sim_wall:.1f} s wall{sim_note}")
            if emu_dir is None or sim_dir is None:
                continue
            bare = None
            if args.ps_gemm_ms > 0:
                bare_dir, _, _ = run("simulate", topo, args.steps, Path(tmp) / name / "bare",
                                     trace, args.timeout_s)
                bare = read_run(bare_dir) if bare_dir is not None else None
            ratios = compare(name, read_run(emu_dir), read_run(sim_dir), bare)
            summary.append((name, ratios))
    print("\nsimulated / emulated device time per step:")
    for name, ratios in summary:
        print(f"  {name:28} " + " ".join(f"{r:.2f}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
