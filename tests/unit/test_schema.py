"""The shared validation mechanism: every problem, with its path in the file's notation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError, field_validator

from testbed.errors import InputError
from testbed.schema import Schema, error_path, finite, parse


class Link(Schema):
    down: float
    up: float = 1.0

    @field_validator("down", "up")
    @classmethod
    def _finite(cls, v: float) -> float:
        return finite(v)


class Doc(Schema):
    name: str
    links: list[Link] = []


def test_error_path_writes_indices_and_keys_as_a_user_would():
    assert error_path(("devices", 1, "link", "up")) == "devices[1].link.up"
    assert error_path((), root="") == "<top>"
    assert error_path(("a",), root="adb") == "adb.a"


def test_parse_reports_every_problem_with_its_path_once():
    raw = {"name": "x", "links": [{"down": 1.0}, {"down": "nan"}, {"down": 2, "bogus": 1}],
           "extra": True}
    with pytest.raises(InputError) as info:
        parse(Doc, raw, "topo.yaml")
    problems = info.value.problems
    assert info.value.source == "topo.yaml"
    assert any(p.startswith("links[1].down: ") and "finite" in p for p in problems), problems
    assert "links[2].bogus: unknown key (expected one of: down, up)" in problems
    assert "extra: unknown key (expected one of: name, links)" in problems
    assert len(problems) == 3


def test_parse_names_missing_keys_and_returns_a_frozen_model():
    with pytest.raises(InputError) as info:
        parse(Doc, {}, "f")
    assert info.value.problems == ["name: required key is missing"]
    doc = parse(Doc, {"name": "ok"}, "f")
    with pytest.raises(ValidationError):
        doc.name = "changed"  # type: ignore[misc]


def test_yaml_floats_hints_and_unknown_keys_before_their_siblings():
    from typing import ClassVar

    from testbed.schema import Float, Int

    class Inner(Schema):
        unknown_key_hints: ClassVar[dict[str, str]] = {"loss": "loss is not applied here"}
        rate: Float = 1.0
        count: Int = 0

    class Outer(Schema):
        inner: Inner
        after: Float = 0.0

    ok = parse(Outer, {"inner": {"rate": "3e-4", "count": 2}, "after": 1}, "f")
    assert ok.inner.rate == 3e-4 and ok.after == 1.0
    with pytest.raises(InputError) as info:
        parse(Outer, {"inner": {"rate": True, "count": 1.5, "loss": "1%", "x": 1},
                      "after": float("inf"), "z": 0}, "f")
    assert info.value.problems == [
        "z: unknown key (expected one of: inner, after)",
        "inner.loss: loss is not applied here",
        "inner.x: unknown key (expected one of: rate, count)",
        "inner.rate: expected float, got bool True",
        "inner.count: expected int, got float 1.5",
        "after: must be a finite number, got inf"]
