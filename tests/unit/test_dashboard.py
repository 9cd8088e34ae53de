"""The live view renders a snapshot into text."""

from __future__ import annotations

from rich.console import Console

from testbed.dashboard import render


def test_render_snapshot() -> None:
    snapshot = {"state": "training", "step": 3, "steps": 20, "loss": 4.25, "losses": [5, 4.8, 4.25],
                "tiles": 1234, "tiles_per_s": 321.0, "bytes_down": 12_500_000, "bytes_up": 2_000,
                "pending": 7, "requeued": 2, "rejected": 1,
                "devices": [{"device": "phones-0", "group": "phones", "state": "busy",
                             "tiles_done": 99, "in_flight": 2, "bytes_down": 1e6, "bytes_up": 5e5,
                             "observed_gflops": 9.2, "energy_j": 3.5,
                             "telemetry": {"temperature_c": 41.5}},
                            {"device": "laptops-0", "group": "laptops", "state": "left",
                             "tiles_done": 5}]}
    console = Console(record=True, width=140, file=open("/dev/null", "w"))
    console.print(render(snapshot, "home"))
    text = console.export_text()
    for needle in ("step 3/20", "loss 4.2500", "1234", "321/s", "12.5 MB", "phones-0", "busy",
                   "41.5", "laptops-0", "left", "requeued 2"):
        assert needle in text, needle
