"""The live view in an 80-column terminal: no figure split from its label, devices that sit
out say so and why, and each column says what it holds."""

from __future__ import annotations

import io

from rich.console import Console

from testbed.dashboard import _short_bytes, render, render_devices


def _text(renderable: object, width: int) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


# a home-wifi snapshot after its first step, as the PS wrote it
AFTER_STEP_0 = {"state": "training", "step": 1, "steps": 2, "loss": 5.523, "losses": [5.523],
                "tiles": 572, "tiles_per_s": 128.0, "bytes_down": 59_200_000,
                "bytes_up": 15_500_000, "pending": 0, "requeued": 0, "rejected": 0,
                "efficiency": 0.71, "time_dilation": 2.29, "tile_error_p50": 0.0002,
                "tile_error_p95": 2.535, "lateness_share": 0.019,
                "recoveries": 0, "checks": 572, "goodput": 1.0,
                "validation_overhead_cpu": 0.0245}
FIGURES = ("steps done 1/2", "loss 5.5230", "tiles 572 (128/s)", "down 59.2 MB", "up 15.5 MB",
           "eff 0.71", "D 2.29", "tile err p50 0.0% p95 253.5%", "late <= 1.9% of the step",
           "recoveries 0", "backups 0/0 won", "goodput 100.0%",
           "checks 572 failed 0", "validation 2.45% CPU", "ledger reused 0")


def test_at_80_columns_no_figure_is_split_from_its_label() -> None:
    """The header wrapped as words: "tile err p50" ended one line and "0.0% p95 147.8%" began
    the next; "down" and "59.2 MB" were apart too."""
    text = _text(render(AFTER_STEP_0, "home-wifi"), 80)
    assert all(len(line) <= 80 for line in text.splitlines())
    for figure in FIGURES:
        assert figure in text, figure  # whole, on one line


def test_the_header_counts_steps_done_not_the_step_under_way() -> None:
    """"step 1/2" sat beside step 0's loss while the step lines and steps.jsonl count from 0."""
    text = _text(render(AFTER_STEP_0), 200)
    assert "steps done 1/2" in text and "step 1/2" not in text


def test_short_bytes_round_before_they_choose_their_format() -> None:
    """9.96 MB read "10.0M" beside "10M" in the same column."""
    assert _short_bytes(9.96e6) == "10M" and _short_bytes(9.94e6) == "9.9M"
    assert _short_bytes(999_600) == "1.0M" and _short_bytes(2_800_000) == "2.8M"
    assert _short_bytes(0) == "0" and _short_bytes(344_000) == "344k"


# a campus snapshot after its step: 30 of its 32 devices sat out
CAMPUS_DEVICES = (
    [{"device": f"lab-laptops-{i}", "group": "lab-laptops", "state": "idle",
      "tiles_done": 240 if i < 2 else 0, "in_flight": 0, "bytes_down": 6e7, "bytes_up": 5e7,
      "observed_gflops": 258.2, "energy_j": 1.2} for i in range(8)]
    + [{"device": f"{g}-{i}", "group": g, "state": "idle", "tiles_done": 0, "in_flight": 0,
        "bytes_down": 0, "bytes_up": 0, "observed_gflops": 20.2, "energy_j": 0.0,
        "telemetry": {"temperature_c": 25.1}}
       for g in ("library-phones", "dorm-phones") for i in range(12)])
CAMPUS = {**AFTER_STEP_0, "steps": 1, "devices": CAMPUS_DEVICES,
          "sat_out": {"lab-laptops": "link (6 of 8)", "library-phones": "link",
                      "dorm-phones": "link"}}


def test_devices_that_sit_out_say_so_and_why_in_80_columns() -> None:
    """They read "idle 0" with the speed their profile predicts, and the reason was a wrapped
    tail of the header; the table's last column was cut to "compute…"."""
    text = _text(render(CAMPUS, "campus"), 80)
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())
    rows = {line.split()[1]: line.split()[2:] for line in text.splitlines()
            if line.startswith("│ ") and line.split()[1].rstrip("0123456789").endswith("-")}
    assert rows["dorm-phones-3"][:3] == ["sat", "out", "0"]
    assert rows["lab-laptops-0"][:2] == ["idle", "240"]  # of its group, computing
    assert rows["lab-laptops-5"][:2] == ["sat", "out"]
    assert rows["library-phones-0"][6] == "-"  # no tile yet: no observed speed
    assert "lab-laptops: link (6 of 8)" in text and "dorm-phones: link" in text
    assert "link: moving its share costs more than computing it" in text
    assert "(N of M): N of the group's M devices sat out" in text


def test_devices_are_listed_in_number_order_and_energy_says_what_it_counts() -> None:
    text = _text(render_devices(CAMPUS_DEVICES), 120)
    names = [line.split()[0] for line in text.splitlines()[1:]]
    assert names.index("dorm-phones-2") < names.index("dorm-phones-10")
    assert "comp J" in text.splitlines()[0] and "energy J" not in text
