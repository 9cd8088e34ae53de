"""Which data-parallel replicas take part in a step: one rule for the engine, the simulator and
the emulation (docs/baselines.md, "A dropped replica").

The replicas are placed once, at the start, over the devices present then; each keeps its rows
of every batch for the whole run (the batch is never re-split). At a step's start a replica
whose device is gone is dropped; one lost during the step is dropped from it (:meth:`drop`).
A dropped replica stays out for the rest of its round (``local_steps`` steps; a round is one
step when ``local_steps`` is 1). A replica whose device is back takes part again from the next
round's start, or from the next step when no replica is left. Joining, it first receives the
state the others hold: with ``local_steps: 1`` the parameters and both AdamW moments (the
step count is the step); with DiLoCo the round's θ_global, and its inner AdamW starts afresh
(its process, and the state in it, was lost with the device). The rows of replicas out of a
step are not trained in that step; the step's gradient and loss average over the rows that
are (:func:`row_weights`).
"""

from __future__ import annotations

from typing import Iterable, Sequence


class ReplicaMembership:
    """The replicas taking part in each step, under churn (see the module's docstring)."""

    def __init__(self, replicas: int, local_steps: int = 1,
                 initial: Iterable[int] | None = None) -> None:
        if local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {local_steps}")
        self.replicas = replicas
        self.local_steps = local_steps
        self.members: set[int] = set(range(replicas) if initial is None else initial)

    def begin(self, step: int, present: Iterable[int]) -> tuple[list[int], list[int]]:
        """The replicas taking part in ``step`` (their devices ``present`` at its start), and
        those of them joining now (first sent the others' state); both sorted."""
        here = {r for r in present if 0 <= r < self.replicas}
        self.members &= here
        joining: list[int] = []
        if step % self.local_steps == 0 or not self.members:
            joining = sorted(here - self.members)
            self.members |= set(joining)
        return sorted(self.members), joining

    def drop(self, replica: int) -> None:
        """Replica lost during the step: out of it and of the rest of its round."""
        self.members.discard(replica)

    def round_ends(self, step: int) -> bool:
        """Whether ``step`` is the last of its round (DiLoCo's outer step follows it)."""
        return (step + 1) % self.local_steps == 0


def row_weights(rows: Sequence[int], here: Sequence[int]) -> dict[int, float]:
    """Each present replica's share of the rows trained this step (loss and gradient weights)."""
    total = sum(rows[r] for r in here)
    if total <= 0:
        raise ValueError("no rows trained in this step: no replica present")
    return {r: rows[r] / total for r in here}


def join_state_bytes(params: int, dtype_bytes: int, local_steps: int, step: int) -> int:
    """Bytes a joining replica receives: the parameters, with both AdamW moments when the
    replicas share one optimizer state (``local_steps: 1``, after step 0)."""
    return params * dtype_bytes * (3 if local_steps == 1 and step > 0 else 1)


__all__ = ["ReplicaMembership", "join_state_bytes", "row_weights"]
