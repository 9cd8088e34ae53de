"""`testbed net check`'s choice of devices (--devices, --per-group) and its bad-input exits,
which happen before any network comes up."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli import main
from testbed.emulator.network.cli import select_devices
from testbed.topology import load_topology

LARGE = Path(__file__).resolve().parents[2] / "topologies" / "large.yaml"


def names(devices):
    return [d.name for d in devices]


def test_all_devices_by_default():
    devices = list(load_topology(LARGE).devices)
    assert select_devices(devices, None, None) == devices


def test_per_group_takes_the_first_of_each_group_in_topology_order():
    devices = list(load_topology(LARGE).devices)
    chosen = names(select_devices(devices, None, 2))
    assert chosen == ["phones-a-0", "phones-a-1", "phones-b-0", "phones-b-1", "phones-c-0",
                      "phones-c-1", "phones-d-0", "phones-d-1", "laptops-0", "laptops-1"]


def test_per_group_and_named_devices_add_up_without_repeats():
    devices = list(load_topology(LARGE).devices)
    chosen = names(select_devices(devices, ["phones-b-7", "laptops-0"], 1))
    assert chosen == ["phones-a-0", "phones-b-0", "phones-b-7", "phones-c-0", "phones-d-0",
                      "laptops-0"]
    # more than a group holds: the whole group, no more
    assert len(select_devices(devices, None, 100)) == len(devices)


def test_unknown_device_is_named():
    devices = list(load_topology(LARGE).devices)
    with pytest.raises(ValueError, match=r"phones-z-0.*phones-a-0"):
        select_devices(devices, ["phones-z-0"], None)


@pytest.mark.parametrize("flags, message", [
    (["--per-group", "0"], "argument --per-group: expected 1 to 1,000,000, got 0"),
    (["--devices", "nope-3"], f"no such device(s) ['nope-3'] (devices are named "
                              f"<group>-<index>, e.g. phones-a-0) in {LARGE}"),
])
def test_bad_selection_exits_2_before_the_network(capsys, flags, message):
    assert main(["net", "check", str(LARGE), *flags]) == 2
    assert message in capsys.readouterr().err
