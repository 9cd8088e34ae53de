"""Churn: trace format and validation, generators, importers, and the pure replay plan.

For ``testbed up``::

    from testbed.churn import load_schedule
    schedule = load_schedule(topology.churn, topology)   # TraceError (exit 2) on any problem
    start(schedule.initially_present)
    for action in schedule.actions:                       # ordered, deterministic
        wait_until(action.time_s); apply(action)          # action.to_dict() -> events.jsonl

See docs/churn.md for the format and the decisions behind it.
"""

from testbed.churn.schedule import (
           ChurnAction,
           ChurnSchedule,
           build_schedule,
           groups_of,
           load_schedule,
)
from testbed.churn.trace import ChurnEvent, Trace, TraceError, TraceEvent, load_trace, parse_trace

__all__ = ["ChurnAction", "ChurnEvent", "ChurnSchedule", "Trace", "TraceError", "TraceEvent",
           "build_schedule", "groups_of", "load_schedule", "load_trace", "parse_trace"]
