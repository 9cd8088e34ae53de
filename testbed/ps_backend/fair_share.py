"""What one device of each group gets of the links it shares while a number of devices of every
group move data at once: the max-min fair share over each device's own link and the switch
links above it (the simulator's :func:`~testbed.simulate.network.max_min_rates`).

Pure and group-level (the devices of a group share one path), so the planner can take the shares
again for the devices a step's plans count on (``step_plan.planned_count``) as well as for the
topology's every device (``config.plan_inputs``)."""

from __future__ import annotations

import math
from typing import Mapping

Rates = tuple[float, float]  # (down, up) bytes/s


def group_fair_shares_Bps(counts: Mapping[str, int], own_Bps: Mapping[str, Rates],
                          paths: Mapping[str, tuple[str, ...]], capacity_Bps: Mapping[str, Rates],
                          ps_Bps: Rates | None = None) -> dict[str, Rates]:
    """Per group of ``counts`` with a device or more, the (down, up) bytes/s one of its devices
    gets while ``counts[g]`` devices of every group move data: each device's own link
    (``own_Bps``, per group), the shared links on its group's path (``paths``: group -> link
    names; ``capacity_Bps``: name -> (down, up)) and, with ``ps_Bps``, a link every device
    shares (the PS's)."""
    from testbed.simulate.network import max_min_rates

    groups = [g for g, n in counts.items() if n > 0]
    names = sorted({s for g in groups for s in paths.get(g, ())})
    link_of = {s: i for i, s in enumerate(names)}  # the shared links first
    shares = {g: [math.inf, math.inf] for g in groups}
    for direction in (0, 1):
        capacity = [capacity_Bps[s][direction] for s in names]
        ps = [len(capacity)] if ps_Bps is not None else []  # after the shared links
        if ps_Bps is not None:
            capacity.append(ps_Bps[direction])
        flows, owner = [], []
        for g in groups:
            shared = [link_of[s] for s in paths.get(g, ())]
            for _ in range(counts[g]):
                capacity.append(own_Bps[g][direction])  # each device's own link
                flows.append([len(capacity) - 1, *shared, *ps])
                owner.append(g)
        for g, rate in zip(owner, max_min_rates(flows, capacity)):
            shares[g][direction] = min(shares[g][direction], float(rate))
    return {g: (down, up) for g, (down, up) in shares.items()}
