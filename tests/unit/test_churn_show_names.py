"""testbed trace show's 'names used' line: each name when few, counted per group stem when many
(a thousand devices' trace printed ten kilobytes of names on one line)."""

from __future__ import annotations

from testbed.churn.show import NAMES_LISTED, names_used


def test_a_few_names_are_listed_in_their_order() -> None:
    assert names_used(["phones-4", "phones-1", "laptops"]) == "phones-4, phones-1, laptops"
    assert names_used([]) == "none"


def test_many_names_are_counted_per_stem_with_their_range() -> None:
    names = [f"phones-{i}" for i in range(0, 900, 2)] + [f"laptops-{i}" for i in range(100)]
    line = names_used(names + ["tablets"])
    assert line == "551 (phones-0 .. phones-898: 450; laptops-0 .. laptops-99: 100; tablets)"
    assert len(line) < 100


def test_many_names_without_numbers_are_cut_with_a_count() -> None:
    names = [f"group{chr(97 + i)}" for i in range(NAMES_LISTED + 5)]
    line = names_used(names)
    assert line.startswith(f"{NAMES_LISTED + 5} (groupa; groupb;")
    assert line.endswith("; 5 more)")
