"""``summary.json``: a run's totals, written by ``testbed up`` once the PS has ended.

It starts from the PS's own ``ps_summary.json``; when the PS left none (it crashed, or was
killed with ``testbed up``), ``state`` is ``failed`` and what ``steps.jsonl`` holds fills in the
steps done, their losses and their totals (:func:`ps_summary_or_steps`, which the report falls
back to as well when a run has no ``summary.json``). To that it adds what only the supervisor
knows or what needs the whole event log: the network
(``network.json``'s description), time dilation, departures and churn counts from
``events.jsonl``, the ADB bridge's figures, the energy per device group, and for every real
device (``real_devices``) its measured tile times and battery energy next to its profile's
predictions. The report
(:mod:`testbed.report`) reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeGuard

from testbed.emulator.dilation import LATENESS_KINDS, next_dilation, worst_error
from testbed.runlog import read_jsonl, write_json_atomic
from testbed.user_paths import load_user_json, read_user_text

DEPARTURES = ("leave", "disconnect", "lease_expired")
# steps.jsonl's per-step counts that add up to the run's (ps_summary.json's keys of that name)
STEP_TOTALS = ("tiles", "recomputed_tiles", "requeued_tiles", "rejected", "bytes_down",
               "bytes_up")
MAX_PS_SUMMARY_BYTES = 1 << 30  # ps_summary.json: its device list is capped (DEPARTED_KEPT)


def is_number(value: Any) -> TypeGuard[float]:
    """An int or float of a record, not a bool (JSON's true is no figure)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# what the planner's reasons for a group sitting out mean (step_plan's sat_out), for the report
# and the live view
SAT_OUT_WHY = {"link": "moving its share costs more than computing it",
               "PS link": "the PS's link has no room for its share",
               "speed": "too slow to shorten the GEMM"}
SAT_OUT_PART = "N of the group's M devices sat out, the others computed"  # "(N of M)"


def steps_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A summary's figures of the steps, from ``steps.jsonl``'s records as checked by
    :func:`testbed.report.step_problems` (``step`` an integer, ``loss`` a number or null):
    ``steps_done`` (distinct steps), ``losses`` in step order, ``final_loss``, the
    ``STEP_TOTALS`` summed, their ``device_time_s`` summed (when there are steps), the last
    step's ``time_dilation``, ``simulated`` when every step was, and ``totals_from``:
    ``"steps.jsonl"`` to say where they came from. A step recorded twice counts once (its
    last record)."""
    by_step = {record["step"]: record for record in steps}
    ordered = [by_step[step] for step in sorted(by_step)]
    losses = [record["loss"] for record in ordered if is_number(record.get("loss"))]
    out: dict[str, Any] = {"steps_done": len(ordered), "losses": losses,
                           "final_loss": losses[-1] if losses else None}
    for key in STEP_TOTALS:
        out[key] = sum(record[key] for record in ordered if is_number(record.get(key)))
    if ordered:  # the finished steps' device time (its PS's summary counts the same)
        out["device_time_s"] = round(sum(record["device_time_s"] for record in ordered
                                         if is_number(record.get("device_time_s"))), 6)
    dilations = [record["time_dilation"] for record in ordered
                 if is_number(record.get("time_dilation"))]
    if dilations:
        out["time_dilation"] = dilations[-1]
    if ordered and all(record.get("simulated") is True for record in ordered):
        out["simulated"] = True  # virtual time: no wall time, no emulation to judge
    out["totals_from"] = "steps.jsonl"
    return out


def checked_steps(path: Path) -> list[dict[str, Any]]:
    """The records of a ``steps.jsonl`` that pass the report's checks (others are skipped)."""
    from testbed.report import step_problems  # the report imports this module

    return [record for record in read_jsonl(path) if not step_problems(record)]


def ps_summary_or_steps(run_dir: Path,
                        steps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The PS's own summary (``ps_summary.json``), or, when the PS left none (it crashed, or
    ``testbed up`` was killed with it; a file that is not a JSON object counts as none), state
    ``failed`` with :func:`steps_summary` of the run's steps, up.json's ``steps`` (the steps
    asked for) and, when no step has one, up.json's ``dilation`` as ``time_dilation``.
    ``steps``: the run's checked steps.jsonl records (default: read them,
    :func:`checked_steps`). Used by the summary and, for a run without one, by the report."""
    try:
        ps_summary = load_user_json(read_user_text(run_dir / "ps_summary.json",
                                                   MAX_PS_SUMMARY_BYTES, errors="replace"))
    except (OSError, ValueError):  # absent, unreadable, not JSON
        ps_summary = None
    if isinstance(ps_summary, dict):
        return ps_summary
    if steps is None:
        steps = checked_steps(run_dir / "steps.jsonl")
    out = {"state": "failed", **steps_summary(steps)}
    try:
        up = load_user_json(read_user_text(run_dir / "up.json", 1 << 20))
    except (OSError, ValueError):
        up = None
    asked = up.get("steps") if isinstance(up, dict) else None
    if isinstance(asked, int) and not isinstance(asked, bool) and asked >= 0:
        out["steps"] = asked
    dilation = up.get("dilation") if isinstance(up, dict) else None
    if "time_dilation" not in out and is_number(dilation) and 1 <= dilation <= 1e6:
        out["time_dilation"] = dilation  # the D the run started with, before any step
    return out


def event_counts(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Departures, churn actions, quarantines and resumes counted from events.jsonl records.

    ``departed_devices`` (sessions that ended) is ``departures`` again: the PS's own count in
    ``ps_summary.json`` stops when it writes that file, so a device whose stream broke just
    after (a crash 1 ms before the end) was in ``departures`` and not in it, and it counts one
    PS process of a resumed run; events.jsonl holds every session's end, from both.

    ``churn_events`` are the actions the run met: none after its PS's last stop. The replay
    stops once the PS's status says training is over, but reads it every 0.25 s, and an action
    due in between is applied to agents already stopped (effect ``absent``); it was counted,
    and `testbed compare` said tile-tp had met a crash that came after its last step."""
    departures = [e for e in events if e.get("event") in (*DEPARTURES, "quarantine")]
    departed = sum(e.get("event") in DEPARTURES for e in events)
    stops = [e["elapsed_s"] for e in events
             if e.get("event") == "ps_stop" and is_number(e.get("elapsed_s"))]
    return {
        "departures": departed, "departed_devices": departed,
        "churn_events": sum(e.get("event") == "churn" and not (
            stops and is_number(e.get("elapsed_s")) and e["elapsed_s"] > stops[-1])
            for e in events),
        "tiles_in_flight_at_departures": sum(int(e.get("in_flight", 0) or 0)
                                             for e in departures),
        "quarantines": sum(e.get("event") == "quarantine" for e in events),
        "resumes": sum(e.get("event") == "ps_resume" for e in events)}


def battery_joules(samples: list[dict[str, Any]]) -> tuple[float | None, int]:
    """Energy drawn from the battery over time-ordered telemetry samples (trapezoid rule on
    -current x voltage; current is positive into the battery), and how many samples were
    charging (then the battery does not see what the phone uses: the figure is a lower bound)."""
    points = [(float(x["elapsed_s"]),
               -float(x["battery_current_a"]) * float(x["battery_voltage_v"])) for x in samples
              if isinstance(x.get("battery_current_a"), (int, float))
              and isinstance(x.get("battery_voltage_v"), (int, float))
              and isinstance(x.get("elapsed_s"), (int, float))]
    charging = sum(w < 0 for _, w in points)
    if len(points) < 2:
        return None, charging
    joules = sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in zip(points, points[1:]))
    return joules, charging


def real_device_models(devices: list[dict[str, Any]], events: list[dict[str, Any]],
                       telemetry: list[dict[str, Any]]) -> dict[str, Any]:
    """Per real device: measured tile times and rate next to its profile's prediction, and the
    battery's measured energy next to the modelled energy (see docs/adb-bridge.md)."""
    predicted = {str(e.get("device")): e.get("predicted_gflops") for e in events
                 if e.get("event") == "join" and e.get("kind") == "real"}
    out: dict[str, Any] = {}
    for name, gflops_pred in predicted.items():
        records = [d for d in devices if d.get("device") == name]
        tiles = sum(int(d.get("tiles_done") or 0) for d in records)
        compute_s = sum(float(d.get("compute_s") or 0.0) for d in records)
        # the rate the PS estimated in the session that computed the most tiles
        busiest = max(records, key=lambda d: int(d.get("tiles_done") or 0), default={})
        gflops_obs = float(busiest["observed_gflops"]) if busiest.get("observed_gflops") else None
        row: dict[str, Any] = {"tiles_done": tiles, "compute_s": round(compute_s, 6),
                               "predicted_gflops": gflops_pred, "observed_gflops": gflops_obs,
                               "measured_s_per_tile": compute_s / tiles if tiles else None,
                               "predicted_s_per_tile": None, "model_error_fraction": None}
        if tiles and gflops_obs and isinstance(gflops_pred, (int, float)) and gflops_pred > 0:
            # the same tiles at the predicted rate: measured time x observed / predicted rate
            row["predicted_s_per_tile"] = compute_s / tiles * gflops_obs / gflops_pred
            row["model_error_fraction"] = round(gflops_pred / gflops_obs - 1.0, 6)
        samples = sorted((x for x in telemetry if x.get("device") == name
                          and x.get("kind") == "adb-telemetry"),
                         key=lambda x: float(x.get("elapsed_s") or 0.0))
        measured_j, charging = battery_joules(samples)
        row["modelled_energy_j"] = round(sum(float(d.get("energy_j") or 0.0) for d in records), 6)
        row["measured_energy_j"] = None if measured_j is None else round(measured_j, 6)
        row["energy_samples"] = len(samples)
        row["charging_samples"] = charging
        out[name] = row
    return out


# what a network's description empties once it is torn down (Mininet's prefix and host count)
BROUGHT_UP_KEYS = ("prefix", "hosts")


def network_as_brought_up(run_dir: Path, network: dict[str, Any]) -> dict[str, Any]:
    """The network's description at the end of a run, with what teardown emptied taken from
    ``network.json`` (written when the network came up): a Mininet run's summary said
    ``"prefix": ""`` and ``"hosts": 0`` after its 9 hosts of network tb1ht were gone. A
    ``network.json`` of another backend, of a bring-up that never finished (``state:
    starting``) or unreadable changes nothing."""
    try:
        recorded = load_user_json(read_user_text(run_dir / "network.json", 1 << 20))
    except (OSError, ValueError):
        return network
    if (not isinstance(recorded, dict) or recorded.get("state") == "starting"
            or recorded.get("backend") != network.get("backend")):
        return network
    out = dict(network)
    for key in BROUGHT_UP_KEYS:
        if key in recorded and not out.get(key):
            out[key] = recorded[key]
    return out


def write_summary(run_dir: Path, topology: Any, network: dict[str, Any], dilation: float,
                  exit_code: int, extra: dict[str, Any],
                  adb: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write summary.json for a finished (or failed, or interrupted) run; return it."""
    summary = ps_summary_or_steps(run_dir)
    if summary.get("totals_from") == "steps.jsonl":  # the steps this session was asked for
        steps = getattr(getattr(topology, "job", None), "steps", None)
        if isinstance(steps, int):
            summary["steps"] = steps
        if extra.get("interrupted_by"):  # stopped (during start-up, say) before the PS could
            summary["state"] = "interrupted"  # write its own: not a failure
    summary.update(extra)
    summary["exit_code"] = exit_code
    summary["network"] = network_as_brought_up(run_dir, network)
    events = read_jsonl(run_dir / "events.jsonl")
    summary.update(event_counts(events))
    if adb is not None:
        summary["adb"] = adb
    real = real_device_models(summary.get("devices") or [], events,
                              read_jsonl(run_dir / "devices.jsonl"))
    if real:
        summary["real_devices"] = real
    target = summary.get("dilation_target_p95")
    if is_number(target):  # which steps' lateness passed the target: the warning names them
        summary["steps_late"] = [
            int(r["step"]) for r in read_jsonl(run_dir / "steps.jsonl")
            if isinstance(r.get("step"), int) and is_number(r.get("lateness_share"))
            and r["lateness_share"] > target]
    from testbed.emulator.energy import topology_energy

    # the D the run started with; events.jsonl has every change from it (an adaptive run's)
    summary["energy"] = topology_energy(topology, summary.get("devices") or [], events, dilation)
    write_json_atomic(run_dir / "summary.json", summary)
    return summary


def write_simulated_summary(run_dir: Path, topology: Any, summary: dict[str, Any],
                            events: list[dict[str, Any]], report: bool) -> dict[str, Any]:
    """Finish a simulated run's summary.json (``testbed simulate``, a baseline in virtual time):
    the events' counts and the energy (virtual time is device time: D 1) added, written, and
    with ``report`` the report drawn; return it."""
    from testbed.emulator.energy import topology_energy

    summary.update(event_counts(events))
    summary["energy"] = topology_energy(topology, summary["devices"], events, 1.0)
    write_json_atomic(run_dir / "summary.json", summary)
    if report:
        from testbed.report import make_report

        make_report(run_dir)
    return summary


def run_warnings(summary: dict[str, Any]) -> list[str]:
    """The lines a run's end carries when its device times are not to be trusted."""
    out = []
    below = summary.get("steps_below_bound") or 0
    if below:
        out.append(f"WARNING: {below} step(s) took less device time than their lower bound "
                   f"(bound_s), which no schedule on this topology can: the emulated links or "
                   f"time dilation did not follow the topology, and this run's device times "
                   f"are wrong (steps.jsonl: efficiency > 1)")
    if summary.get("fidelity_ok") is False:
        out.append(fidelity_warning(summary))
    deaths = summary.get("agent_deaths")
    if isinstance(deaths, list) and deaths:
        who = ", ".join(f"{d.get('device')} ({d.get('exit')})" for d in deaths
                        if isinstance(d, dict))
        out.append(f"WARNING: {len(deaths)} device agent(s) died with no churn event asking "
                   f"them to: {who}. The run went on without them, so it had fewer devices "
                   f"than its topology; their logs are in agents/")
    return out


def fidelity_warning(summary: dict[str, Any]) -> str:
    """The one line a run whose emulated devices did not keep their model's times ends with."""
    share = summary.get("lateness_share_max")
    moved = f"up to {100 * share:.1f}%" if isinstance(share, (int, float)) else "that much"
    target, largest = summary["dilation_target_p95"], summary.get("dilation_max")
    fix = "a number fixes it"
    if isinstance(largest, (int, float)) and largest >= 1:
        # the adaptive controller's rule: lateness is wall time, so it falls as 1 / D
        suggested = next_dilation(largest, worst_error(summary["tile_error_p95"], share),
                                  target)
        fix = f"try time_dilation: {suggested:.3g}"
    return (f"WARNING: emulation fidelity missed its target "
            f"({100 * target:.0f}%){_late_steps(summary)}: the emulated devices' lateness "
            f"can have moved a step's device time by {moved}{lateness_kinds(summary)}; p95 "
            f"tile-time error {100 * summary['tile_error_p95']:.1f}% (time dilation "
            f"{_dilation_span(summary.get('dilation_min'), largest)}). A larger "
            f"time_dilation gives the emulated devices and links more of this host's CPU per "
            f"device second ({fix}; time_dilation: {{target_p95: ...}} raises it "
            f"between steps)")


def _late_steps(summary: dict[str, Any]) -> str:
    """Which steps missed, as ' in step 0 of 20', ' in 3 of 20 steps (0, 4, 7)', or '': a
    run whose first step alone missed reads apart from one that missed throughout."""
    late, done = summary.get("steps_late"), summary.get("steps_done")
    if not isinstance(late, list) or not late or not isinstance(done, int):
        return ""
    if len(late) == 1:
        return f" in step {late[0]} of {done}"
    shown = ", ".join(str(s) for s in late[:5]) + (", ..." if len(late) > 5 else "")
    return f" in {len(late)} of {done} steps ({shown})"


def _dilation_span(smallest: Any, largest: Any) -> str:
    """The run's time dilation, 1.48, or 1.48..3.2 when it moved ("1.4799..1.4799" said both
    ends of a D that never moved, to four places)."""
    if not (is_number(smallest) and is_number(largest)):
        return f"{smallest}..{largest}"
    if f"{smallest:.3g}" == f"{largest:.3g}":
        return f"{largest:.3g}"
    return f"{smallest:.3g}..{largest:.3g}"


def lateness_kinds(summary: dict[str, Any]) -> str:
    """The worst step's lateness by kind, as ' (compute holds a%, tile starts b%, uplinks
    c%)', or '' when the run has none."""
    shares = summary.get("lateness_shares_worst")
    if not isinstance(shares, dict):
        return ""
    parts = [f"{name} {100 * shares[kind]:.1f}%" for kind, name in LATENESS_KINDS.items()
             if isinstance(shares.get(kind), (int, float))]
    return f" ({', '.join(parts)})" if parts else ""
