"""`testbed net check`'s command line as a user writes it, and its table: no network comes up
in these tests (the probe is replaced by one that finds Mininet missing, which ends the check
with exit 1 right after the input is read)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import testbed.emulator.network.cli as net_cli
from testbed.cli import main
from testbed.emulator.network.check import Row, format_table

HOME = str(Path(__file__).resolve().parents[2] / "topologies" / "home-wifi.yaml")


@pytest.fixture
def chosen(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The device names each check chose; the network never starts (the probe says Mininet is
    missing, exit 1)."""
    import testbed.emulator.network.probe as probe

    seen: list[list[str]] = []
    real = net_cli.select_devices

    def spy(devices: Any, names: Any, per_group: Any) -> Any:
        out = real(devices, names, per_group)
        seen.append([d.name for d in out])
        return out

    monkeypatch.setattr(net_cli, "select_devices", spy)
    monkeypatch.setattr(probe, "probe", lambda: SimpleNamespace(
        missing=lambda: ["a fake probe's Mininet"], iperf3=True))
    return seen


def test_devices_before_the_topology_still_finds_the_topology(
        chosen: list[list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    # argparse gave --devices every name, the topology too, and said "required: topology"
    assert main(["net", "check", "--devices", "phones-1", "laptops-0", HOME]) == 1
    assert chosen == [["phones-1", "laptops-0"]]
    assert "missing: a fake probe's Mininet" in capsys.readouterr().err


def test_devices_with_no_name_is_refused_not_all_devices(
        chosen: list[list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    # nargs="*" took an empty --devices (an empty $LIST) for "all": 79 min on large.yaml
    assert main(["net", "check", HOME, "--devices"]) == 2
    assert "argument --devices: expected at least one argument" in capsys.readouterr().err
    assert main(["net", "check", "--devices", HOME]) == 2
    assert "error: --devices: expected at least one device name" in capsys.readouterr().err
    assert not chosen


def test_no_topology_says_so(chosen: list[list[str]],
                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["net", "check", "--devices", "phones-0", "laptops-0"]) == 2
    assert "error: no topology file: give it first, `testbed net check TOPOLOGY" \
        in capsys.readouterr().err
    assert not chosen


def test_a_missing_topology_after_devices_is_named(chosen: list[list[str]], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    gone = tmp_path / "gone.yaml"
    assert main(["net", "check", "--devices", "phones-0", str(gone)]) == 2
    assert f"error: {gone}: 1 problem(s):\n  - cannot read the file" in capsys.readouterr().err
    assert not chosen


def test_help_shows_the_topology_as_required_and_the_exit_codes(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["net", "check", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: testbed net check [-h] TOPOLOGY [--tolerance FRACTION]")
    assert "2 on bad input (nothing started)" in out
    assert "--tolerance FRACTION relative tolerance, a fraction above 0 up to 1" in out


def test_table_keeps_its_columns_for_long_device_names() -> None:
    rows = [Row("library-phones-long-0", "down", 100e6, 99e6, 0.1),
            Row("a-0", "rtt", 0.022, 0.0224, 0.1)]
    header, *body = format_table(rows).splitlines()
    col = header.index("what")
    assert [line[col - 1:].split()[0] for line in body] == ["down", "rtt"]


def test_table_shows_no_relative_error_against_no_configured_delay() -> None:
    # a link without delay: 0 ms configured, the check's 1 ms slack; '0.0%' read as exact
    line = format_table([Row("a-0", "rtt", 0.0, 0.0004, 0.1)]).splitlines()[1]
    assert line.split()[-2:] == ["-", "yes"]
    assert "0.0%" not in line


def test_an_interrupted_check_prints_the_devices_it_measured(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C after some devices: their rows came only as progress lines, with no table."""
    import testbed.emulator.network.check as check
    import testbed.emulator.network.mininet as mininet
    import testbed.emulator.network.probe as probe

    class FakeNetwork:
        prefix, hosts, bringup_s = "tbzzz", ["a"], 0.1

        def __init__(self, *_a: Any, **_k: Any) -> None:
            pass

        def __enter__(self) -> FakeNetwork:
            return self

        def __exit__(self, *_exc: Any) -> None:
            pass

    def interrupted(net: Any, devices: Any, *_a: Any, on_device: Any, **_k: Any) -> None:
        on_device(1, devices[0], [Row(devices[0].name, "down", 10e6, 9.9e6, 0.1),
                                  Row(devices[0].name, "up", 1e6, 0.5e6, 0.1)])
        raise KeyboardInterrupt

    monkeypatch.setattr(probe, "probe", lambda: SimpleNamespace(
        missing=lambda: [], iperf3=True, delay_mechanism="application"))
    monkeypatch.setattr(mininet, "MininetNetwork", FakeNetwork)
    monkeypatch.setattr(check, "check_devices", interrupted)
    assert main(["net", "check", HOME]) == 130
    out = capsys.readouterr().out
    assert "phones-0         down    10.00 Mbit/s    9.90 Mbit/s" in out, out
    assert "interrupted after 1 of 8 device(s); 1/2 within tolerance so far" in out, out
