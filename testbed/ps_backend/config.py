"""The PS's configuration from a topology: message limits, and what the planner and the bound
need to know of the network (links, groups, shared switch links, the PS link).

Apart from ``main`` so that ``testbed simulate``, which builds its scheduler and planner from the
same configuration, does not import torch with the PS process's entry point.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from testbed.emulator.network.base import switch_path
from testbed.ps_backend.core import PsConfig
from testbed.topology import Topology


def max_message_bytes(tile_m: int, tile_n: int) -> int:
    """Largest device message the PS accepts with fixed tiles: four float64 result tiles of the
    configured shape, plus 64 KiB."""
    return 4 * tile_m * tile_n * 8 + 64 * 1024


PS_LINK = "ps"  # the PS's own link in group_paths (switch links go by their lower switch)
PLANNED_MESSAGE_BYTES = 64 * 1024 * 1024  # planned tiles are larger; the planner keeps under


def cut_Bps(topology: Topology) -> tuple[float, float]:
    """(down, up) bytes/s that can cross between the PS's switch and all the devices.

    Devices below a switch-to-switch link share it: a subtree hanging off the PS's switch
    carries at most its top link's rate and at most its devices' links summed; devices on the
    PS's switch carry their own. Every byte to or from a device crosses exactly one of these,
    so their sum caps the aggregate traffic (campus: the one shared 1 Gbit uplink).
    """
    links = {sl.lower: sl for sl in topology.network.links}
    top: dict[str | None, list[float]] = {}  # top link's lower switch -> [down, up] of members
    for g in topology.groups:
        path = switch_path(topology, g.switch)
        agg = top.setdefault(path[-1].lower if path else None, [0.0, 0.0])
        agg[0] += g.count * g.link.down_bps / 8
        agg[1] += g.count * g.link.up_bps / 8
    down = up = 0.0
    for key, (d, u) in top.items():
        if key is None:
            down, up = down + d, up + u
        else:
            link = links[key].link
            down += min(d, link.down_bps / 8)
            up += min(u, link.up_bps / 8)
    return down, up


def shared_paths(topology: Topology) -> dict[str, tuple[str, ...]]:
    """Per group, the switch links above it (by lower switch) that only some of the topology's
    devices sit below: the links its fair share is taken over (:func:`fair_shares_Bps`)."""
    below: dict[str, int] = {}  # devices below each switch link
    paths = {g.group: tuple(sl.lower for sl in switch_path(topology, g.switch))
             for g in topology.groups}
    for g in topology.groups:
        for switch in paths[g.group]:
            below[switch] = below.get(switch, 0) + g.count
    every = sum(g.count for g in topology.groups)
    return {g: tuple(s for s in path if below[s] < every) for g, path in paths.items()}


def fair_shares_Bps(topology: Topology, own_Bps: dict[str, tuple[float, float]],
                    ps_Bps: tuple[float, float] | None = None
                    ) -> dict[str, tuple[float, float]]:
    """Per group, the (down, up) bytes/s one of its devices gets while every device of the
    topology moves data at once: the max-min fair share of its own link (``own_Bps``, per group)
    and of the switch links above it that only some of the devices sit below (large: 59 phones
    below one 1 Gbit uplink get ~17 Mbit/s each of their 100;
    :func:`~testbed.ps_backend.fair_share.group_fair_shares_Bps`, which the planner calls again
    for the devices a step's plans count on).

    A switch link that every device sits below is left out, as is the PS's own link: all the
    traffic crosses it, so it caps the aggregate, which the planner weighs as the PS link
    (``ps_link_Bps``, :func:`cut_Bps`) with the devices that take part. A fair share for every
    device would not know which take part (campus's plans put the work on its 8 laptops, which
    then have its one uplink to themselves). With ``ps_Bps`` (down, up), every device shares
    that link too: what a device can count on while all of them move data, which the PS judges
    an emulated device's results against (``busy_up_Bps``, ``dilation.DeviceTimeline``).
    """
    from testbed.ps_backend.fair_share import group_fair_shares_Bps

    capacity = {sl.lower: (sl.link.down_bps / 8, sl.link.up_bps / 8)
                for sl in topology.network.links}
    return group_fair_shares_Bps({g.group: g.count for g in topology.groups}, own_Bps,
                                 shared_paths(topology), capacity, ps_Bps)


def plan_inputs(topology: Topology) -> dict[str, Any]:
    """What the planner and the bound need from the topology: links, groups, PS link.

    ``group_links`` is what each group's own path carries: the bound's (a subset of the devices
    could have a shared switch link to themselves). ``plan_links`` is that capped at the group's
    fair share of the switch links it shares (:func:`fair_shares_Bps`): the planner's, and what
    stealing and backups weigh, with ``group_paths`` (each group's switch links up to the PS's
    switch, by lower switch, then the PS's link) and ``shared_down_Bps`` (their rates): a block
    for a device queues behind what they carry for the others. The PS link they see is the
    PS's own, capped by what the switch links let through to all devices (:func:`cut_Bps`): a
    lower bound stays one, and the planner sees the shared uplink.
    """
    from testbed.emulator.network.base import loss_cap_bps, path_delay_s
    from testbed.perf_model.profiles import ProfileError, load_profile

    links = {}
    for d in topology.devices:  # per group: its first device (a group's devices share a path)
        if d.group.group in links:
            continue
        delay_s = path_delay_s(topology, d)
        cap_bps = loss_cap_bps(topology, d)  # a lossy path carries what TCP gets through it
        links[d.group.group] = (min(d.link.down_bps, cap_bps) / 8,
                                min(d.link.up_bps, cap_bps) / 8, 2 * delay_s)
    own = {g: (down, up) for g, (down, up, _) in links.items()}
    fair = fair_shares_Bps(topology, own)
    plan_links = {g: (*fair[g], rtt) for g, (_, _, rtt) in links.items()}
    groups = []
    for g in topology.groups:
        try:
            gflops = load_profile(g.profile_path).sustained_gflops
        except ProfileError:
            gflops = 1.0
        groups.append((g.group, g.count, float(gflops)))
    ps = topology.network.ps.link
    cut_down, cut_up = cut_Bps(topology)
    # each group's switch links up to the PS's switch, then the PS's link
    paths = {g.group: (*(sl.lower for sl in switch_path(topology, g.switch)), PS_LINK)
             for g in topology.groups}
    shared = {sl.lower: sl.link.down_bps / 8 for sl in topology.network.links}
    shared[PS_LINK] = ps.down_bps / 8
    # the bound's: each switch link's (down, up) and the next switch link above it (the one
    # whose lower switch is its upper; none above a link to the PS's switch)
    lowers = {sl.lower for sl in topology.network.links}
    uplinks = {sl.lower: (sl.link.down_bps / 8, sl.link.up_bps / 8,
                          sl.upper if sl.upper in lowers else "")
               for sl in topology.network.links}
    ps_link = (min(ps.down_bps / 8, cut_down), min(ps.up_bps / 8, cut_up))
    busy = {g: up for g, (_, up) in fair_shares_Bps(topology, own, ps_link).items()}
    return {"group_links": links, "plan_links": plan_links, "busy_up_Bps": busy,
            "fair_share_paths": shared_paths(topology),
            "ps_link_Bps": ps_link,
            "group_paths": paths, "shared_down_Bps": shared, "switch_links": uplinks,
            "planned_groups": tuple(groups)}


def ps_config(topology: Topology, **run: Any) -> PsConfig:
    """The PS's configuration for a topology's job; ``run`` sets the run's own fields (token,
    run name, dilation, ...). The simulator builds its scheduler and planner from the same."""
    job = topology.job
    p, validation = job.parallelism, job.validation
    fields: dict[str, Any] = dict(
        token="", run_name=topology.name, dtype=np.dtype(job.dtype), tile_m=p.tile_m,
        tile_n=p.tile_n, min_offload_flops=p.min_offload_flops,
        max_message_bytes=PLANNED_MESSAGE_BYTES if p.planner == "auto" else
        max_message_bytes(p.tile_m, p.tile_n),
        planner=p.planner, **plan_inputs(topology), check_values=validation.enabled,
        freivalds_vectors=validation.freivalds_vectors,
        quarantine_after=validation.quarantine_after)
    return PsConfig(**{**fields, **run})
