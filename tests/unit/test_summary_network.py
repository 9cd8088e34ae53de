"""summary.json's ``network``: the network as the run had it, not as teardown left it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from testbed.summary import write_summary
from testbed.topology import load_topology

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"
# what MininetNetwork.describe() says before and after stop() (prefix and hosts emptied)
UP = {"backend": "mininet", "prefix": "tb1ht", "switch": "linux-bridge", "hosts": 9,
      "rate": "htb", "delay": "application", "dilation": 1.48}
DOWN = {**UP, "prefix": "", "hosts": 0}


def _summary(run_dir: Path, network_json: Any, network: dict[str, Any]) -> dict[str, Any]:
    (run_dir / "steps.jsonl").write_text('{"step": 0, "loss": 5.0, "device_time_s": 1.0}\n')
    if network_json is not None:
        (run_dir / "network.json").write_text(
            network_json if isinstance(network_json, str) else json.dumps(network_json))
    summary = write_summary(run_dir, load_topology(TINY), network, 1.0, 0, {})
    assert json.loads((run_dir / "summary.json").read_text())["network"] == summary["network"]
    return dict(summary["network"])


def test_a_mininet_runs_summary_names_the_prefix_and_hosts_it_ran_on(tmp_path: Path) -> None:
    # `testbed up topologies/default.yaml --steps 1` on Mininet: network.json said tb1ht and 9
    # hosts, summary.json "prefix": "" and "hosts": 0
    assert _summary(tmp_path, UP, DOWN) == UP


@pytest.mark.parametrize("network_json", [
    None,  # never came up
    {"backend": "mininet", "prefix": "tb1ht", "state": "starting"},  # died during bring-up
    {**UP, "backend": "loopback"},  # another backend's
    "{not json",
    "[1, 2]",
])
def test_without_a_description_of_the_same_network_the_teardowns_stands(
        tmp_path: Path, network_json: Any) -> None:
    assert _summary(tmp_path, network_json, DOWN) == DOWN


def test_what_the_end_of_the_run_says_wins_where_it_says_something(tmp_path: Path) -> None:
    # the dilation may move during a run: the end's figure is the one kept
    assert _summary(tmp_path, UP, {**DOWN, "dilation": 3.0}) == {**UP, "dilation": 3.0}
