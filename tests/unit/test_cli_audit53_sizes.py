"""Sizes up to the limit they are checked against: `--ps-memory 1PiB` was `unknown size unit
'PiB'` while `--ps-memory 1MiB` was refused with "expected a size from 1GiB to 1PiB"."""

from __future__ import annotations

import pytest

from testbed import units
from testbed.cli import build_parser


@pytest.mark.parametrize("text, size_bytes", [("2TB", 2 * 1000**4), ("1PB", 1000**5),
                                              ("3TiB", 3 * 1024**4), ("1PiB", 1024**5),
                                              ("0.5PiB", 1024**5 // 2)])
def test_tera_and_peta_sizes_decimal_and_binary(text: str, size_bytes: int) -> None:
    assert units.parse_size_bytes(text) == size_bytes


def test_the_limit_a_size_is_checked_against_can_be_written() -> None:
    with pytest.raises(units.UnitError, match="at most 1PiB"):
        units.parse_size_bytes("1.1PiB")
    with pytest.raises(units.UnitError, match="expected one of B, KB, kB, MB, GB, TB, PB, KiB, "
                                              "MiB, GiB, TiB, PiB"):
        units.parse_size_bytes("1EiB")


@pytest.mark.parametrize("text, size_bytes", [("1PiB", 1024**5), ("2TB", 2 * 1000**4)])
def test_compare_takes_a_ps_memory_up_to_its_stated_maximum(text: str, size_bytes: int) -> None:
    args = build_parser().parse_args(["compare", "t.yaml", "--ps-memory", text])
    assert args.ps_memory == size_bytes
