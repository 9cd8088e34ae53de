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
    for needle in ("steps done 3/20", "loss 4.2500", "1234", "321/s", "12.5 MB", "phones-0", "busy",
                   "41.5", "laptops-0", "left", "requeued 2"):
        assert needle in text, needle


def test_the_header_names_each_group_that_sat_out_with_its_reason() -> None:
    snapshot = {"state": "training", "step": 1, "steps": 5,
                "sat_out": {"phones-a": "link in 13 of 18 backward GEMMs", "phones-d": "link"}}
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    console.print(render(snapshot, "large"))
    assert "sat out (planner, last step):  phones-a: link in 13 of 18 backward GEMMs;  " \
        "phones-d: link" in console.export_text()


def test_past_forty_devices_the_view_has_a_row_per_group() -> None:
    from testbed.dashboard import MAX_DEVICE_ROWS, render_devices

    devices = [{"device": f"phones-{i}", "group": "phones", "state": "busy" if i % 3 else "idle",
                "tiles_done": 2, "in_flight": 1, "bytes_down": 1e6, "bytes_up": 1e5,
                "observed_gflops": 10.0 + i % 2, "energy_j": 0.5,
                "telemetry": {"temperature_c": 30.0 + i}} for i in range(MAX_DEVICE_ROWS)]
    devices.append({"device": "laptops-0", "state": "left", "tiles_done": 7})  # no group field
    console = Console(record=True, width=100, file=open("/dev/null", "w"))
    console.print(render_devices(devices))
    lines = console.export_text().splitlines()
    assert len(lines) == 3  # the header and one row per group, no device rows
    laptops, phones = lines[1].split(), lines[2].split()
    assert laptops[:5] == ["laptops-0", "(1)", "1", "left", "7"]  # without a group: its own
    # 40 phones: 14 idle (i % 3 == 0), 26 busy; 80 tiles, 40 in flight, 40 MB down, 4 MB up,
    # mean speed 10.5 GFLOPS, the hottest at 69 °C, 20 J
    assert phones == ["phones", "(40)", "26", "busy", "14", "idle", "80", "40", "40M", "4.0M",
                      "10.5", "69.0", "20.0"]


def test_a_short_terminal_gets_a_row_per_group_before_its_rows_run_off_its_foot() -> None:
    # campus's 32 device rows on a 30-line terminal: the rows past its height were cut off
    from testbed.dashboard import MAX_DEVICE_ROWS, device_rows_for, render

    devices = [{"device": f"{g}-{i}", "group": g, "state": "busy", "tiles_done": 1}
               for g in ("phones", "laptops") for i in range(16)]
    snapshot = {"state": "training", "step": 1, "steps": 3, "devices": devices}
    for height, grouped in ((30, True), (60, False)):
        console = Console(record=True, width=80, height=height, file=open("/dev/null", "w"))
        console.print(render(snapshot, "campus", max_rows=device_rows_for(height)))
        text = console.export_text()
        assert ("phones (16)" in text) is grouped and ("phones-15" in text) is not grouped, text
        assert len(text.splitlines()) <= height, text
    assert device_rows_for(10) == 4 and device_rows_for(1000) == MAX_DEVICE_ROWS


def test_the_header_says_how_far_late_devices_can_have_moved_the_last_step() -> None:
    snapshot = {"state": "training", "step": 2, "steps": 5, "tile_error_p50": 0.001,
                "tile_error_p95": 0.5, "lateness_share": 0.0634}
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    console.print(render(snapshot, "default"))
    text = console.export_text()
    assert "tile err p50 0.1% p95 50.0%" in text and "late <= 6.3% of the step" in text
