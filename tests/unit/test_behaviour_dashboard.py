"""The live view shows the fault-tolerance figures and quarantined devices."""

from __future__ import annotations

from rich.console import Console

from testbed.dashboard import render


def test_fault_line_and_quarantined_device() -> None:
    snapshot = {"state": "training", "step": 2, "steps": 5, "loss": 4.0, "losses": [5, 4],
                "recoveries": 3, "recovery_p50_s": 0.012, "recovery_p95_s": 0.25,
                "recomputed_tiles": 7, "backups": 10, "backup_wins": 4, "goodput": 0.93,
                "checks": 500, "failed_checks": 12, "validation_overhead_cpu": 0.031,
                "tiles_from_ledger": 24, "quarantined": ["liars-0"],
                "devices": [{"device": "liars-0", "group": "liars", "state": "quarantined",
                             "tiles_done": 0}]}
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    console.print(render(snapshot, "byz"))
    text = console.export_text()
    for needle in ("recoveries 3: p50 12 ms p95 250 ms", "recomputed 7", "backups 4/10 won",
                   "goodput 93.0%", "failed 12", "validation 3.10% CPU", "ledger reused 24",
                   "quarantined liars-0", "quarantined"):
        assert needle in text, needle
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    console.print(render({"state": "starting"}))
    assert "recovery" not in console.export_text()  # nothing before the PS reports
