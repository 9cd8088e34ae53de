"""The one shape of a bad-input error: every problem of one input, each with where it is.

Topology files, churn traces and the like are checked whole and fail once, listing every problem
with its place (a YAML path, a line number); the CLI prints the message and exits 2.
"""

from __future__ import annotations


class InputError(ValueError):
    """Every problem found in one input (``source``), each already saying where it is."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}")
