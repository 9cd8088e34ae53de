"""Mutated inputs: the shipped topologies and traces with values swapped, keys dropped and
characters changed, seeded. Whatever the mutation, loading refuses with the input's own error
(TopologyError, TraceError: every problem with its place) or accepts; nothing else escapes.
Mutations like these found a profile name too long for the file system and a ``~user`` with no
such user, each of which had ended in a traceback from pathlib."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from testbed.churn.trace import TraceError, parse_trace
from testbed.topology import TopologyError, parse_topology

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = sorted((REPO / "topologies").glob("*.yaml"))
TRACES = sorted((REPO / "traces").glob("*.csv"))

# values of every kind a hand-edited file could hold where another was expected
VALUES: list[Any] = [
    None, -1, 0, 1e308, float("nan"), float("inf"), "", "x" * 300, "é🙂", [], {}, True, 2**70,
    "1Gbit", "-5Mbit", "10ms", "-1ms", "100%", "1e9", "0", [1, 2], {"a": 1}, "..", "a\0b",
    "../../etc/passwd", "0.5%", "NaN", "abc def", 3.5, "/" + "y" * 5000, "~no-such-user-here/x",
    {"files": ["x" * 300]}, {"files": ["a\0b"]}, {"files": []}, 1e-300, "1e400", "0x10",
]


def _paths(tree: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    items = tree.items() if isinstance(tree, dict) else \
        enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        yield from _paths(value, prefix + (key,))


def _mutate(tree: Any, rng: random.Random) -> Any:
    for _ in range(rng.choice([1, 1, 2, 3])):
        path = rng.choice(list(_paths(tree)))
        if not path:
            tree = copy.deepcopy(rng.choice(VALUES))
            continue
        parent = tree
        for key in path[:-1]:
            parent = parent[key]
        if rng.random() < 0.2:
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(VALUES))
    return tree


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.stem)
def test_a_mutated_topology_is_refused_with_its_problems_or_accepted(path: Path) -> None:
    base = yaml.safe_load(path.read_text())
    rng = random.Random(path.stem)
    refused = 0
    for _ in range(150):
        tree = _mutate(copy.deepcopy(base), rng)
        try:
            parse_topology(tree, str(path), path.parent)
        except TopologyError as exc:
            refused += 1
            assert exc.problems and all(isinstance(p, str) and p for p in exc.problems)
    assert refused > 75  # the mutations do reach the checks: most make a bad file


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_a_mutated_trace_is_refused_with_its_lines_or_accepted(path: Path) -> None:
    base = path.read_text()
    rng = random.Random(path.stem)
    pieces = ["", ",", "\n", "-1", "1e309", "nan", "inf", "leave", "join", "crash", "slow",
              "phones-0", "phones-*", "#", '"', "time_ms", "time_h", "\0", "\r", "é", "x" * 50,
              "99999999999999999999999999", "-0", " ", "2"]
    groups = {"phones": [f"phones-{i}" for i in range(8)], "laptops": ["laptops-0"]}
    refused = 0
    for _ in range(400):
        text = list(base)
        for _ in range(rng.randint(1, 6)):
            at = rng.randrange(len(text) + 1)
            roll = rng.random()
            if roll < 0.4:
                text[at:at] = list(rng.choice(pieces))
            elif roll < 0.7:
                del text[at:at + rng.randint(1, 8)]
            else:
                text[at:at] = [chr(rng.randrange(0x3000))]
        try:
            parse_trace("".join(text), str(path), groups)
        except TraceError as exc:
            refused += 1
            assert all(p.startswith("line ") for p in exc.problems), exc.problems
    assert refused > 100
