"""A run whose PS fails says why on `testbed up`'s own output (not only in summary.json and
ps.log): here every device crashes, and the watchdog ends the run."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import TINY, killed_at_exit, run_dir_of, start_up

pytestmark = pytest.mark.integration


def test_up_prints_why_the_ps_failed(tmp_path) -> None:
    trace = tmp_path / "all-crash.csv"
    trace.write_text("time_s,device,event,arg\n0.5,phones,crash,\n0.5,laptops,crash,\n")
    raw = yaml.safe_load(TINY.read_text())
    raw["job"].update(steps=100000, watchdog={"no_progress_s": 2})
    topology = tmp_path / "tiny.yaml"
    topology.write_text(yaml.safe_dump(raw))
    out = tmp_path / "runs"
    up = start_up(topology, out, "--churn", str(trace))
    with killed_at_exit(up):
        output, _ = up.communicate(timeout=120)
    summary = json.loads((run_dir_of(out) / "summary.json").read_text())
    assert up.returncode == 1 and summary["state"] == "failed", output
    assert summary["error"] and f"error: {summary['error']}" in output, output
