"""``summary.json``: a run's totals, written by ``testbed up`` once the PS has ended.

It starts from the PS's own ``ps_summary.json`` (absent when the PS died: then ``state`` is
``failed``) and adds what only the supervisor knows or what needs the whole event log: the network
(``network.json``'s description), time dilation, departures and churn counts from
``events.jsonl``, the ADB bridge's figures and the energy per device group. The report
(:mod:`testbed.report`) reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testbed.runlog import read_jsonl, write_json_atomic

DEPARTURES = ("leave", "disconnect", "lease_expired")


def event_counts(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Departures, churn actions, quarantines and resumes counted from events.jsonl records."""
    departures = [e for e in events if e.get("event") in (*DEPARTURES, "quarantine")]
    return {
        "departures": sum(e.get("event") in DEPARTURES for e in events),
        "churn_events": sum(e.get("event") == "churn" for e in events),
        "tiles_in_flight_at_departures": sum(int(e.get("in_flight", 0) or 0)
                                             for e in departures),
        "quarantines": sum(e.get("event") == "quarantine" for e in events),
        "resumes": sum(e.get("event") == "ps_resume" for e in events)}


def write_summary(run_dir: Path, topology: Any, network: dict[str, Any], dilation: float,
                  exit_code: int, extra: dict[str, Any],
                  adb: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write summary.json for a finished (or failed, or interrupted) run; return it."""
    ps_summary_path = run_dir / "ps_summary.json"
    summary: dict[str, Any] = json.loads(ps_summary_path.read_text()) \
        if ps_summary_path.exists() else {"state": "failed"}
    summary.update(extra)
    summary["exit_code"] = exit_code
    summary["network"] = network
    events = read_jsonl(run_dir / "events.jsonl")
    summary.update(event_counts(events))
    if adb is not None:
        summary["adb"] = adb
    from testbed.emulator.energy import topology_energy

    summary["energy"] = topology_energy(topology, summary.get("devices") or [], events,
                                        float(summary.get("time_dilation") or dilation))
    write_json_atomic(run_dir / "summary.json", summary)
    return summary
