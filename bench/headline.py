"""The seeds' headline comparisons in this testbed, simulated and emulated: are they reproduced?

Settings (OPT shapes with OPT's 50,272-token vocabulary, batch 16, sequence 512, float32,
Snapdragon 888 phones, the HotCarbon'25 setting, arXiv 2507.01803):

* 15 phones on 10 MB/s links and on 100 Mbit/s links;
* N = 4, 8, 15, 32, 100, 1,000 phones on 10 MB/s links (quick mode: 4, 15, 32);
* OPT-125m and OPT-1.3B (quick mode: OPT-125m); tile-tp is simulated up to 1,000 phones for
  both unless --tile-tp-max-devices says otherwise (the row left out says so, with an
  estimate of what simulating it would take; OPT-1.3B at 1,000 phones takes ~10 minutes).

Each case runs tile-tp, pipeline and data-parallel in virtual time (`testbed compare
--simulate`'s code) and prints time per step, energy and carbon per step, with the A5000 row.
Then, for each of the seeds' ratios, the measured value and whether it falls in the claimed
range:

* Cleave (arXiv 2512.22142): tile-parallel 4-10x faster than DT-FM (pipeline);
  supports 2-8x more devices (we count the devices up to which adding devices still cuts
  the time per step by >= 10%, tile-tp against pipeline);
* HotCarbon'25: edge training 1.5-4x more energy-efficient than the A5000, 3.5-8x less carbon.

Emulated (Mininet, root; `testbed compare`'s emulated code: real processes, real links): the
cases this host can run in real time, printed next to the simulator's figures for the same
case. By default the `mini` shape (hidden 128, 2 layers, sequence 64, 8,192-token vocabulary,
batch 16) on N = 4, 8, 15 phones at both link rates (quick: N = 4 at 10 MB/s); the OPT cases
are left out with the reason printed (a step of OPT-125m holds the phones for minutes of real
time, and its 15 data-parallel replicas need more memory than this host has); pass
`--emulate-models OPT-125m --emulate-devices 4` to run one anyway.

    .venv/bin/python bench/headline.py [--quick] [--steps N] [--tile-tp-max-devices N|MODEL=N,...]
        [--emulate auto|off] [--emulate-models mini,OPT-125m] [--emulate-devices 4,8,15]
        [--grid-g-per-kwh G] [--gpu-grid-g-per-kwh G]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# hidden, layers, heads, sequence, vocabulary
OPT = {"OPT-125m": (768, 12, 12, 512, 50272), "OPT-1.3B": (2048, 24, 32, 512, 50272)}
# tile-tp's simulation above these N is left out unless asked for (--tile-tp-max-devices)
TILE_TP_MAX = {"OPT-125m": 1000, "OPT-1.3B": 1000}
SHAPES = {**OPT, "mini": (128, 2, 2, 64, 8192)}  # mini: what this host emulates in real time
STRATEGIES = ("tile-tp", "pipeline", "data-parallel")


def raw_topology(devices: int, link: str, model: str, steps: int) -> dict[str, Any]:
    """N Snapdragon 888 phones behind one access point, links `link` both ways (YAML form)."""
    hidden, layers, heads, seq, vocab = SHAPES[model]
    return {
        "name": f"headline-{devices}", "seed": 25,
        "network": {"switches": ["ap0"],
                    "ps": {"switch": "ap0", "link": {"down": "10Gbit", "up": "10Gbit"}}},
        "devices": [{"group": "phones", "profile": "snapdragon888", "count": devices,
                     "switch": "ap0", "link": {"down": link, "up": link}}],
        "job": {"model": {"hidden": hidden, "layers": layers, "heads": heads,
                          "ffn": 4 * hidden, "seq_len": seq, "vocab": vocab},
                "batch_size": 16, "steps": steps, "optimizer": {"lr": 6e-4},
                "parallelism": {"tile": 256}}}


def topology(devices: int, link: str, model: str, steps: int) -> Any:
    """The case as a parsed topology."""
    from testbed.topology import parse_topology

    return parse_topology(raw_topology(devices, link, model, steps))


def run_case(devices: int, link: str, model: str, steps: int, grid: float,
             gpu_grid: float, strategies: tuple[str, ...] = STRATEGIES) -> dict[str, Any]:
    """The strategies on one setting in virtual time; rows keyed by strategy."""
    from testbed.baselines.compare import compare
    from testbed.baselines.gpu import load_gpu

    topo = topology(devices, link, model, steps)
    with tempfile.TemporaryDirectory(prefix="headline-") as tmp:
        t0 = time.monotonic()
        rows = compare(topo, Path(tmp), list(strategies), lambda _t: None, load_gpu("a5000"),
                       grid, gpu_grid, report=False)
        took = time.monotonic() - t0
    return {"rows": {r["strategy"]: r for r in rows}, "sim_s": took}


def run_emulated(devices: int, link: str, model: str, steps: int, grid: float,
                 gpu_grid: float) -> dict[str, Any]:
    """The strategies on one setting on Mininet (real processes and links, D = 1)."""
    import yaml

    from testbed.baselines.compare import compare_emulated
    from testbed.baselines.gpu import load_gpu
    from testbed.topology import load_topology

    raw = raw_topology(devices, link, model, steps)
    raw["network"]["backend"] = "mininet"
    raw["time_dilation"] = 1.0
    with tempfile.TemporaryDirectory(prefix="headline-emu-") as tmp:
        path = Path(tmp) / "topology.yaml"
        path.write_text(yaml.safe_dump(raw))
        t0 = time.monotonic()
        rows = compare_emulated(path, load_topology(path), Path(tmp), list(STRATEGIES),
                                load_gpu("a5000"), grid, gpu_grid)
        took = time.monotonic() - t0
    return {"rows": {r["strategy"]: r for r in rows}, "emu_s": took}


def host_memory_bytes() -> int:
    """This host's available memory (Linux /proc/meminfo), 0 when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def emulation_cost(result: dict[str, Any], devices: int, model: str) -> tuple[float, int]:
    """What emulating a simulated case would take on this host: real seconds (each strategy's
    simulated steps held in real time, D = 1) and the data-parallel replicas' memory."""
    from testbed.baselines import cost

    rows = result["rows"]
    wall_s = sum(rows[s].get("wall_s") or 0.0 for s in STRATEGIES if s in rows)
    job = topology(devices, "10MB/s", model, 1).job
    replicas = min(devices, job.batch_size)
    return wall_s, replicas * cost.replica_bytes(job, -(-job.batch_size // replicas))


def tile_tp_limits(text: str) -> dict[str, int] | None:
    """``--tile-tp-max-devices``: N (key "": every model) or MODEL=N,...; None if malformed."""
    limits: dict[str, int] = {}
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            model, _, n = part.rpartition("=")
            if model and model not in OPT:
                return None
            limits[model] = int(n)
    except ValueError:
        return None
    return limits if limits or not text.strip() else None


def fmt(x: Any, spec: str = ".3g") -> str:
    """A number, or '-' when the strategy did not run."""
    return "-" if x is None else format(x, spec)


def useful_devices(times: dict[int, float | None]) -> tuple[int | None, bool]:
    """The largest N up to which each step of N still cut the time per step by >= 10%, and
    whether that is the largest N measured (the true figure may then be larger)."""
    best = None
    prev = None
    measured = [n for n in sorted(times) if times[n] is not None]
    for n in measured:
        t = times[n]
        assert t is not None
        if prev is None or t <= 0.9 * prev:
            best = n
            prev = t
        else:
            break
    return best, best is not None and best == measured[-1]


def verdict(value: float | None, lo: float, hi: float) -> str:
    """'reproduced' when value is in [lo, hi]."""
    if value is None:
        return "not measurable"
    return "reproduced" if lo <= value <= hi else "NOT reproduced"


def emulated(args: argparse.Namespace, emu_models: list[str], emu_sizes: list[int],
             models: list[str], results: dict[tuple[int, str, str], dict[str, Any]]) -> None:
    """The emulated cases next to the simulator's figures for the same case; the OPT cases
    left out, each with what emulating it would take here."""
    print("EMULATED (Mininet: real processes and links, D = 1) next to SIMULATED, same case")
    for model in models:
        if model in emu_models:
            continue
        for (n, link, m), res in results.items():
            if m != model or n not in (4, 15):
                continue
            wall_s, replica_mem = emulation_cost(res, n, model)
            memory = (f" and data-parallel's replicas need {replica_mem / 2**30:.1f} GiB of "
                      f"memory (this host has {host_memory_bytes() / 2**30:.1f} GiB available)"
                      if res["rows"]["data-parallel"].get("step_s") else "")
            print(f"  {model}, N = {n}, {link}: left out: emulating it would hold this host for "
                  f">= {wall_s / 60:.0f} min (each strategy's simulated steps in real time)"
                  + memory)
    if args.emulate == "off":
        print("  not run (--emulate off)")
        return
    from testbed.emulator.network.probe import probe

    missing = probe().missing()
    if missing:
        print(f"  not run on this host: Mininet is missing {'; '.join(missing)}")
        return
    links = ["10MB/s"] if args.quick else ["10MB/s", "100Mbit"]
    print(f"  {'model':9} {'N':>3} {'link':>8} {'strategy':>13} | {'sim s/step':>10} "
          f"{'emu s/step':>10} | {'sim J/step':>10} {'emu J/step':>10} | "
          f"{'sim B up/dev':>12} {'emu B up/dev':>12} | emu wall s")
    for model in emu_models:
        for n in emu_sizes:
            for link in links:
                sim = run_case(n, link, model, args.steps, args.grid_g_per_kwh,
                               args.gpu_grid_g_per_kwh)["rows"]
                emu = run_emulated(n, link, model, args.steps, args.grid_g_per_kwh,
                                   args.gpu_grid_g_per_kwh)
                for s in STRATEGIES:
                    a, b = sim[s], emu["rows"][s]
                    if not b.get("step_s"):
                        print(f"  {model:9} {n:>3} {link:>8} {s:>13} | {fmt(a.get('step_s')):>10} "
                              f"{b['state']}: {str(b.get('note', ''))[:120]}")
                        continue
                    print(f"  {model:9} {n:>3} {link:>8} {s:>13} | {fmt(a.get('step_s')):>10} "
                          f"{fmt(b['step_s']):>10} | {fmt(a.get('energy_j_per_step')):>10} "
                          f"{fmt(b['energy_j_per_step']):>10} | "
                          f"{fmt(a.get('up_bytes_per_device_step')):>12} "
                          f"{fmt(b['up_bytes_per_device_step']):>12} | {b['wall_s']:.0f}",
                          flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the cases and print the tables and verdicts."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N = 4, 15, 32 and OPT-125m only")
    p.add_argument("--steps", type=int, default=2, help="steps per run (default 2)")
    p.add_argument("--tile-tp-max-devices", default="",
                   help="leave tile-tp's simulation out above this many devices: N for every "
                        "model, or MODEL=N,... (a model not named: " + ", ".join(
                            f"{m} {n}" for m, n in TILE_TP_MAX.items()) + "; on 1,000 phones "
                        "OPT-125m takes ~6 minutes to simulate here, OPT-1.3B ~10, "
                        "docs/baselines.md); the row says so, with an estimate")
    p.add_argument("--emulate", choices=("auto", "off"), default="auto",
                   help="auto (default): also run the emulated cases on Mininet when this "
                        "host can (root, Mininet); off: simulated only")
    p.add_argument("--emulate-models", default="mini",
                   help="shapes to emulate, comma-separated (default mini; OPT-125m holds the "
                        "phones for minutes per step)")
    p.add_argument("--emulate-devices", default=None,
                   help="N to emulate, comma-separated (default 4,8,15; quick: 4)")
    p.add_argument("--grid-g-per-kwh", type=float, default=475.0,
                   help="the phones' grid carbon intensity, gCO2e/kWh (default 475)")
    p.add_argument("--gpu-grid-g-per-kwh", type=float, default=475.0,
                   help="the A5000's grid carbon intensity, gCO2e/kWh (default 475)")
    args = p.parse_args(argv)
    sweep = [4, 15, 32] if args.quick else [4, 8, 15, 32, 100, 1000]
    models = ["OPT-125m"] if args.quick else list(OPT)
    emu_models = [m.strip() for m in args.emulate_models.split(",") if m.strip()]
    bad = [m for m in emu_models if m not in SHAPES]
    try:
        emu_sizes = [int(n) for n in (args.emulate_devices or ("4" if args.quick else "4,8,15"))
                     .split(",")]
    except ValueError:
        emu_sizes = []
    tile_limits = tile_tp_limits(args.tile_tp_max_devices)
    if tile_limits is None:
        print(f"error: --tile-tp-max-devices {args.tile_tp_max_devices!r}: expected N or "
              f"MODEL=N,... with models from {', '.join(OPT)}", file=sys.stderr)
        return 2
    if bad or not emu_sizes or min(emu_sizes) < 1:
        print(f"error: --emulate-models {bad} / --emulate-devices {args.emulate_devices}: "
              f"expected shapes from {', '.join(SHAPES)} and positive device counts",
              file=sys.stderr)
        return 2
    cases: list[tuple[int, str, str]] = []
    for model in models:
        cases.append((15, "10MB/s", model))
        cases.append((15, "100Mbit", model))
        cases += [(n, "10MB/s", model) for n in sweep if n != 15]
    results: dict[tuple[int, str, str], dict[str, Any]] = {}
    print("SIMULATED (virtual time; `testbed compare --simulate`'s code)")
    print(f"{'model':9} {'N':>5} {'link':>8} | " + " | ".join(
        f"{s:>13} s/step  J/step" for s in STRATEGIES) + " | gpu s/step J/step | sim s")
    tile_s_per_step: dict[tuple[str, int], float] = {}  # how long tile-tp took to simulate
    left_out: list[str] = []
    for case in cases:
        skip_tile = case[0] > tile_limits.get(case[2], tile_limits.get("", TILE_TP_MAX[case[2]]))
        t0 = time.monotonic()
        res = run_case(*case, steps=args.steps, grid=args.grid_g_per_kwh,
                       gpu_grid=args.gpu_grid_g_per_kwh,
                       strategies=STRATEGIES[1:] if skip_tile else STRATEGIES)
        if skip_tile:
            res["rows"]["tile-tp"] = {"state": "left out (1)"}
            known = [(n, t) for (m, n), t in tile_s_per_step.items() if m == case[2]]
            if known:
                n0, t_0 = max(known)
                guess = f"~{t_0 * (case[0] / n0) ** 2 * args.steps / 3600:.1f} h"
                basis = f"{n0} phones took {t_0:.0f} s per step to simulate here"
            else:
                guess, basis = "hours", "no smaller N timed in this run"
            left_out.append(f"(1) {case[2]}, N = {case[0]}: tile-tp's simulation would take "
                            f"{guess} (its backup search grows with devices squared; {basis})"
                            f"; --tile-tp-max-devices {case[2]}={case[0]} runs it")
        elif case[1] == "10MB/s":
            tile_s_per_step[(case[2], case[0])] = (time.monotonic() - t0) / args.steps
        results[case] = res
        rows = res["rows"]
        gpu = rows["gpu:a5000"]
        cells = []
        for s in STRATEGIES:
            r = rows[s]
            cells.append(f"{fmt(r.get('step_s')):>20} {fmt(r.get('energy_j_per_step')):>7}"
                         if r.get("step_s") else f"{r['state']:>28}")
        print(f"{case[2]:9} {case[0]:>5} {case[1]:>8} | " + " | ".join(cells) +
              f" | {fmt(gpu['step_s']):>10}{'*' if gpu.get('note') else ' '}"
              f"{fmt(gpu['energy_j_per_step']):>6} | "
              f"{res['sim_s']:.0f}", flush=True)
    for line in left_out:
        print(line)
    print("* the job does not fit the GPU's memory (no activation recomputation or mixed "
          "precision is modelled); its time is shown as if it did")
    print()
    emulated(args, emu_models, emu_sizes, models, results)
    print()
    for model in models:
        times = {s: {n: results[(n, "10MB/s", model)]["rows"][s].get("step_s")
                     for n in sweep} for s in ("tile-tp", "pipeline")}
        (n_tile, open_tile), (n_pipe, open_pipe) = (useful_devices(times["tile-tp"]),
                                                    useful_devices(times["pipeline"]))
        devices = (n_tile / n_pipe) if n_tile and n_pipe else None
        at_least = ">= " if open_tile and not open_pipe and devices is not None else ""
        print(f"{model}, N = {', '.join(map(str, sweep))} phones at 10 MB/s: devices still "
              f"useful: tile-tp {'>= ' if open_tile else ''}{n_tile}, pipeline "
              f"{'>= ' if open_pipe else ''}{n_pipe} -> {at_least}{fmt(devices)}x (claimed "
              f"2-8x): {verdict(devices, 2, 8)}"
              + (" (or more: tile-tp still sped up at the largest N simulated)"
                 if at_least else ""))
        for link in ("10MB/s", "100Mbit"):
            base = results[(15, link, model)]["rows"]
            tile, pipe, dp, gpu = (base["tile-tp"], base["pipeline"], base["data-parallel"],
                                   base["gpu:a5000"])
            speed = (pipe["step_s"] / tile["step_s"]) if pipe.get("step_s") and \
                tile.get("step_s") else None
            energy = gpu["energy_j_per_step"] / tile["energy_j_per_step"] \
                if tile.get("energy_j_per_step") else None
            carbon = gpu["carbon_g_per_step"] / tile["carbon_g_per_step"] \
                if tile.get("carbon_g_per_step") else None
            print(f"{model}, 15 phones at {link}:")
            if tile.get("step_s") and not pipe.get("step_s"):
                print(f"  larger models: tile-tp trains {model}, the pipeline "
                      f"({pipe['state']}) and data-parallel ({dp['state']}) cannot: "
                      f"reproduced (Cleave: tile-parallel trains larger models)")
            print(f"  tile-tp faster than pipeline: {fmt(speed)}x (claimed 4-10x): "
                  f"{verdict(speed, 4, 10)}"
                  + ("" if pipe.get("step_s") else f" (pipeline: {pipe['state']})"))
            print(f"  A5000 energy / edge (tile-tp) energy per step: {fmt(energy)}x (claimed "
                  f"1.5-4x): {verdict(energy, 1.5, 4)}")
            print(f"  A5000 carbon / edge carbon per step: {fmt(carbon)}x (claimed 3.5-8x): "
                  f"{verdict(carbon, 3.5, 8)} (grids {args.gpu_grid_g_per_kwh:g} vs "
                  f"{args.grid_g_per_kwh:g} gCO2e/kWh)")
            best_edge = min((r["energy_j_per_step"] for r in (tile, pipe, dp)
                             if r.get("energy_j_per_step")), default=None)
            if best_edge:
                print(f"  (best edge strategy's energy per step: {best_edge:.4g} J; the "
                      f"A5000's {gpu['energy_j_per_step']:.4g} J)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
