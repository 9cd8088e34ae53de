"""A lossy path carries what TCP gets through it (Mathis' rate for the path's round trip and
loss), and every part that models loss caps a device's link at that one rate: tile-tp's plans
and bound, the baselines' simulation and placement, net check's expectation. A path with loss
and no delay has no round trip to cap by, which load_run_inputs says in a note."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from testbed.agent.link import MSS_BYTES
from testbed.baselines.placement import device_infos
from testbed.baselines.sim_core import BaselineWorld
from testbed.emulator.network.base import loss_cap_bps, loss_without_delay
from testbed.emulator.network.check import path_rate_bps
from testbed.ps_backend.config import plan_inputs
from testbed.topology import parse_topology
from testbed.up import load_run_inputs

JOB = {"model": {"hidden": 64, "layers": 1, "heads": 1, "ffn": 64, "seq_len": 16}}


def lossy(own_delay: str = "0ms") -> dict:
    """A phone whose own link is lossy; the delay of its path is the switch link's and the
    PS link's (10 + 5 ms one way) plus its own."""
    return {"name": "lossy",
            "network": {"backend": "loopback", "switches": ["core", "ap"],
                        "links": [{"switches": ["core", "ap"], "down": "1Gbit", "up": "1Gbit",
                                   "delay": "10ms"}],
                        "ps": {"switch": "core", "link": {"down": "1Gbit", "up": "1Gbit",
                                                          "delay": "5ms"}}},
            "devices": [{"group": "phones", "profile": "snapdragon888", "count": 2,
                         "switch": "ap", "link": {"down": "100Mbit", "up": "50Mbit",
                                                  "delay": own_delay, "loss": "1%"}}],
            "job": JOB}


def mathis_bps(rtt_s: float, loss: float) -> float:
    return 8 * MSS_BYTES / rtt_s * math.sqrt(3 / (2 * loss))


def test_the_cap_takes_the_whole_paths_round_trip_not_the_device_links_delay():
    topo = parse_topology(lossy())
    want = mathis_bps(2 * 0.015, 0.01)  # 15 ms one way, none of it on the device's own link
    assert want < 50e6  # the cap binds both ways
    assert loss_cap_bps(topo, topo.devices[0]) == pytest.approx(want, rel=1e-12)


def test_tile_tp_and_the_baselines_see_the_same_capped_links():
    topo = parse_topology(lossy())
    cap = loss_cap_bps(topo, topo.devices[0])
    down, up, _ = plan_inputs(topo)["group_links"]["phones"]
    assert (down * 8, up * 8) == pytest.approx((cap, cap), rel=1e-12)
    world = BaselineWorld(topo, noise=False)
    for d in topo.devices:  # the baselines' simulation used the device link's 0 ms: no cap
        assert world.devices[d.name].link_Bps == pytest.approx((cap / 8, cap / 8), rel=1e-12)
    for info in device_infos(topo):  # and the pipeline's placement, the nominal rates
        assert (info.down_bps, info.up_bps) == pytest.approx((cap, cap), rel=1e-12)
    assert path_rate_bps(topo, topo.devices[0], "down") == pytest.approx(cap, rel=1e-12)
    assert path_rate_bps(topo, topo.devices[0], "up") == pytest.approx(cap, rel=1e-12)


def test_a_path_without_loss_keeps_its_rates():
    raw = lossy()
    del raw["devices"][0]["link"]["loss"]
    topo = parse_topology(raw)
    assert loss_cap_bps(topo, topo.devices[0]) == math.inf
    assert path_rate_bps(topo, topo.devices[0], "up") == 50e6
    assert loss_without_delay(topo) == []


def test_loss_on_a_path_without_delay_is_a_note_not_an_error(tmp_path: Path, capsys):
    raw = lossy()
    raw["network"]["links"][0]["delay"] = "0ms"
    raw["network"]["ps"]["link"]["delay"] = "0ms"
    topo = parse_topology(raw)
    notes = loss_without_delay(topo)
    assert len(notes) == 1 and notes[0].startswith("note: devices[0] (phones): ")
    assert "loss of 1%" in notes[0] and "give the path a delay" in notes[0]
    assert loss_without_delay(parse_topology(lossy())) == []  # the switch link's delay counts

    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(raw))
    inputs = load_run_inputs(path)
    assert not isinstance(inputs, int)  # a valid run, said once before it starts
    assert capsys.readouterr().err.count("note: devices[0] (phones)") == 1
