"""The topology schema: every problem reported with its YAML path; units; CLI exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from testbed import units
from testbed.cli import main
from testbed.topology import TopologyError, load_topology, parse_topology

REPO = Path(__file__).resolve().parents[2]


def minimal() -> dict:
    return {"name": "t", "devices": [{"group": "phones", "profile": "snapdragon888", "count": 2,
                                      "link": {"down": "100Mbit", "up": "20Mbit"}}],
            "job": {"model": {"hidden": 32, "layers": 1, "heads": 2, "ffn": 64, "seq_len": 8}}}


@pytest.mark.parametrize("text,bps", [("20Mbit", 20e6), ("1Gbit", 1e9), ("10MB/s", 80e6),
                                      ("1.5Kbit", 1500.0), ("2MiB/s", 2 * 8 * 1024**2)])
def test_rates(text: str, bps: float) -> None:
    assert units.parse_rate_bps(text) == pytest.approx(bps)


@pytest.mark.parametrize("bad", ["20", 20, "20Mbits", "-1Mbit", "fast", True, None])
def test_bad_rates_are_refused(bad: object) -> None:
    with pytest.raises(units.UnitError):
        units.parse_rate_bps(bad)


def test_durations_fractions_sizes() -> None:
    assert units.parse_duration_s("10ms") == pytest.approx(0.01)
    assert units.parse_fraction("0.5%") == pytest.approx(0.005)
    assert units.parse_size_bytes("2GiB") == 2 * 1024**3
    with pytest.raises(units.UnitError):
        units.parse_fraction("150%")


def test_shipped_topologies_validate() -> None:
    for path in sorted((REPO / "topologies").glob("*.yaml")):
        topo = load_topology(path)
        assert topo.devices, path


def test_default_expands_devices() -> None:
    topo = load_topology(REPO / "topologies" / "default.yaml")
    names = [d.name for d in topo.devices]
    assert names[:2] == ["phones-0", "phones-1"] and len(names) == 8
    assert topo.devices[0].link.up_bps == 20e6


def test_every_problem_is_reported_with_its_path() -> None:
    raw = minimal()
    raw["bogus"] = 1  # unknown key
    raw["devices"][0]["count"] = -3  # negative count
    raw["devices"][0]["profile"] = "no-such-phone"  # missing profile
    raw["devices"][0]["link"]["up"] = "20Mbits"  # bad unit
    raw["job"]["batch_size"] = "eight"  # wrong type
    with pytest.raises(TopologyError) as info:
        parse_topology(raw, "t.yaml")
    problems = info.value.problems
    expected = {"bogus": "unknown key", "devices[0].count": "must not be negative",
                "devices[0].profile": "no device profile", "devices[0].link.up": "Mbits",
                "job.batch_size": "expected int"}
    for path, words in expected.items():
        assert any(p.startswith(f"{path}:") and words in p for p in problems), (path, problems)
    assert len(problems) == len(expected)


def test_switch_references_and_tree() -> None:
    raw = minimal()
    raw["network"] = {"switches": ["core", "ap0"], "ps": {"switch": "core"},
                      "links": [{"switches": ["core", "nope"], "down": "1Gbit", "up": "1Gbit"}]}
    raw["devices"][0]["switch"] = "ap9"
    with pytest.raises(TopologyError) as info:
        parse_topology(raw)
    text = str(info.value)
    assert "network.links[0].switches" in text and "devices[0].switch: unknown switch" in text


def _write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_validate_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(_write(tmp_path, minimal()))]) == 0
    raw = minimal()
    raw["devices"][0]["count"] = -1
    raw["job"]["steps"] = 0
    assert main(["validate", str(_write(tmp_path, raw))]) == 2
    err = capsys.readouterr().err
    assert "devices[0].count" in err and "job.steps" in err and "topo.yaml" in err


def test_validate_reports_yaml_syntax_with_line(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ndevices: [\n")
    assert main(["validate", str(path)]) == 2
    assert "line" in capsys.readouterr().err


def test_up_on_a_broken_file_starts_nothing(tmp_path: Path) -> None:
    raw = minimal()
    raw["devices"][0]["link"]["down"] = "fast"
    out = tmp_path / "runs"
    assert main(["up", str(_write(tmp_path, raw)), "--out", str(out), "--no-live"]) == 2
    assert not out.exists()  # no run directory, so no process was started either
