"""What the baselines' simulations share with ``testbed simulate``: devices, network, churn.

The same parts as :mod:`testbed.simulate.sim`, assembled for strategies whose bytes travel
device to device rather than PS to device:

* **Devices**: ``device_model_for(profile, seed = topology seed x 1000 + index)`` (the seeds
  ``testbed up`` and ``testbed simulate`` give the same device), so regression times, noise,
  thermal throttling and energy are the tile simulation's. A device runs its work one piece
  after another; a GEMM is timed by ``tile_cost(m, k, n, op, start, slowdown=factor)`` (the
  factors below, so the device model's account and heat see the longer work); memory-bound work
  (:mod:`testbed.baselines.cost`) takes ``bytes / memory bandwidth`` at busy power. A churn
  ``slow`` multiplies both from its time, the rest of the work under way included
  (:meth:`BaselineWorld.set_slow`), and so does the group's ``behaviour.straggler`` on a share
  ``rate`` of the pieces (a stage's forward or backward of one micro-batch, a replica's forward and
  backward, an AdamW step), drawn as tile-tp's simulation and agents draw it per tile. Work
  is charged (``compute_s``, ``energy_j``) when it is queued; work stopped part-way (its device
  lost, its step abandoned) is charged only up to the stop, energy pro rata within the GEMM it
  was in (:mod:`testbed.baselines.charge`, the emulated processes' rule too), and so are the
  counters of the device model's ``telemetry`` (which a ``slow`` re-times too); its thermal
  state takes back the heat of what did not run (`EmulatedDevice.rewind`) and, re-timed, heats
  along the re-timed work.
* **Network**: the topology's links in a :class:`~testbed.simulate.network.FlowNetwork`
  (max-min fair flows, loss folded into each device link by Mathis' cap as the emulator does).
  A transfer from device A to device B goes up A's link and the switch links to the lowest
  switch both hang under, then down to B: two phones on one access point share only the
  access point's switching, never the PS's link. PS <-> device paths are the tile
  simulation's. The last byte arrives after the path's one-way delay (sum of its links').
  A transfer's bytes count at both ends when it starts; a cancelled one keeps only those it
  had sent.
* **Churn**: the schedule's actions at their times from the start of training. What they do
  to the device happens then: ``leave`` and ``crash`` end its process (its work stops there),
  ``partition`` takes its links down and ``heal`` up, ``join`` starts it, ``slow`` scales its
  compute from then on. What the strategy's coordinator (the pipeline's scheduler,
  data-parallel's PS) learns of it follows the rule ``testbed up`` and ``testbed simulate``
  follow (:mod:`testbed.baselines.heard`, docs/churn.md): a departure of a reachable device
  at once; a partitioned device at its lease (5 s, the PS's, counted from that cut:
  :mod:`testbed.simulate.lease`), unless a heal comes first; a leave or crash of a cut-off
  device at that lease or at a heal that comes first. The strategy reacts through
  :meth:`BaselineWorld.on_lost` / :meth:`on_back`, and places on the devices the coordinator
  holds (:meth:`BaselineWorld.present`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

from testbed.agent.behaviour import Behaviour, straggler_for
from testbed.baselines.charge import retimed_parts, unrun_share
from testbed.baselines.cost import Gemm
from testbed.baselines.heard import LEASE_S as LEASE_S  # the PS's lease, re-exported
from testbed.baselines.heard import Heard, Hearing
from testbed.baselines.placement import DEFAULT_MEMORY_BYTES_S
from testbed.churn.schedule import ChurnAction, ChurnSchedule
from testbed.churn.trace import ChurnEvent
from testbed.emulator.device_model import DeviceModel, device_model_for
from testbed.emulator.network.base import loss_cap_bps
from testbed.perf_model.profiles import PowerParams, load_profile
from testbed.simulate.events import EventLoop
from testbed.simulate.network import FlowNetwork
from testbed.topology import DeviceSpec, Topology

MESSAGE_OVERHEAD_BYTES = 64  # per transfer, as the tile simulation adds per message
PS = "ps"


@dataclass(eq=False)
class Device:
    """One device as the baselines' simulation sees it."""

    spec: DeviceSpec
    model: DeviceModel
    power: PowerParams | None
    memory_bytes_s: float
    own: tuple[int, int]  # its down and up links
    link_Bps: tuple[float, float]
    switch: str | None
    present: bool = False  # its process runs (the coordinator may not know: heard.py)
    partitioned: bool = False
    stops: int = 0  # bumps as its work is stopped: a stopped piece's end does not run
    slow: float = 1.0
    straggler: Behaviour | None = None  # its group's behaviour.straggler, drawn per piece
    busy_until_s: float = 0.0
    compute_s: float = 0.0
    energy_j: float = 0.0
    # the work charged and not yet run, part by part, so that work stopped part-way is
    # charged only up to the stop and a churn `slow` re-times what is left
    queued: list[Part] = field(default_factory=list)
    bytes_down: int = 0  # received
    bytes_up: int = 0  # sent
    joined: bool = False  # has a join event in the log (a participant)

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(eq=False)
class Part:
    """A GEMM or the memory-bound work of a piece queued on a device (device seconds)."""

    start_s: float
    end_s: float
    joules: float
    model_s: float = 0.0  # what the device model charged for it (its telemetry): seconds
    model_j: float = 0.0  # and joules; 0 for memory-bound work, which the model never sees
    then: Callable[[], None] | None = None  # the piece's callback, on its last part
    timing: int = 0  # bumped as a slow re-times it: a callback queued before does not run


def _totals(parts: list[Part]) -> tuple[float, float, float, float]:
    """Seconds, joules, model seconds and model joules of parts."""
    return (sum(p.end_s - p.start_s for p in parts), sum(p.joules for p in parts),
            sum(p.model_s for p in parts), sum(p.model_j for p in parts))


@dataclass
class Transfer:
    flow_id: int
    src: str
    dst: str
    nbytes: int  # the payload counted at both ends when it started


@dataclass
class BaselineWorld(EventLoop):
    """The event queue, the network and the devices; strategies drive it."""

    topology: Topology
    schedule: ChurnSchedule | None = None
    emit: Callable[..., None] = lambda *_a, **_k: None
    noise: bool = True
    now_s: float = 0.0
    net: FlowNetwork = field(default_factory=FlowNetwork)
    devices: dict[str, Device] = field(default_factory=dict)
    on_lost: Callable[[Device, str, str], None] = lambda _d, _k, _r: None
    on_back: Callable[[Device], None] = lambda _d: None

    def __post_init__(self) -> None:
        self._start_events()
        self._build()
        self.wanted: set[str] = set()
        self.hearing = Hearing(self, (), self._heard)  # start() sets who is there

    # -- set-up --------------------------------------------------------------------------------
    def _build(self) -> None:
        topo, net = self.topology, self.net
        ps = topo.network.ps.link
        self._ps_links = (net.add_link(ps.down_bps / 8, "ps:down"),
                          net.add_link(ps.up_bps / 8, "ps:up"))
        self._ps_delay = ps.delay_s
        self._ps_switch = topo.network.ps.switch
        self._parent: dict[str, tuple[str, int, int, float]] = {}
        for sl in topo.network.links:
            self._parent[sl.lower] = (sl.upper, net.add_link(sl.link.down_bps / 8,
                                                              f"{sl.lower}:down"),
                                      net.add_link(sl.link.up_bps / 8, f"{sl.lower}:up"),
                                      sl.link.delay_s)
        profiles = {g.group: load_profile(str(g.profile_path), check=False) for g in topo.groups}
        for d in topo.devices:
            cap = loss_cap_bps(topo, d)  # tile-tp's, over the path to the PS
            down_Bps, up_Bps = min(d.link.down_bps, cap) / 8, min(d.link.up_bps, cap) / 8
            own = (net.add_link(down_Bps, f"{d.name}:down"), net.add_link(up_Bps, f"{d.name}:up"))
            p = profiles[d.group.group]
            bw = p.model.bandwidth_bytes_s if p.model is not None else DEFAULT_MEMORY_BYTES_S
            seed = topo.seed * 1000 + d.index  # as testbed up seeds the device's agent
            self.devices[d.name] = Device(
                d, device_model_for(p, seed=seed, noise=self.noise, rewindable=True), p.power,
                bw, own,
                (down_Bps, up_Bps), d.group.switch, straggler=straggler_for(d, seed))

    def _chain(self, switch: str | None) -> list[str | None]:
        out = [switch]
        while switch in self._parent:
            switch = self._parent[switch][0]
            out.append(switch)
        return out

    def path(self, src: str, dst: str) -> tuple[list[int], float]:
        """Links and one-way delay from src to dst (device names or :data:`PS`)."""
        links: list[int] = []
        delay = 0.0
        a = self.devices.get(src)
        b = self.devices.get(dst)
        up_chain = self._chain(a.switch) if a else [self._ps_switch]
        down_chain = self._chain(b.switch) if b else [self._ps_switch]
        common = next((s for s in up_chain if s in down_chain), None)
        if a is not None:
            links.append(a.own[1])
            delay += a.spec.link.delay_s
        else:
            links.append(self._ps_links[1])
            delay += self._ps_delay
        for s in up_chain:
            if s == common or s not in self._parent:
                break
            links.append(self._parent[s][2])
            delay += self._parent[s][3]
        down: list[int] = []
        for s in down_chain:
            if s == common or s not in self._parent:
                break
            down.append(self._parent[s][1])
            delay += self._parent[s][3]
        links.extend(reversed(down))
        if b is not None:
            links.append(b.own[0])
            delay += b.spec.link.delay_s
        else:
            links.append(self._ps_links[0])
            delay += self._ps_delay
        return links, delay

    # -- the event queue -----------------------------------------------------------------------
    # -- work ----------------------------------------------------------------------------------
    def send(self, src: str, dst: str, nbytes: float, then: Callable[[], None]) -> Transfer:
        """Move nbytes from src to dst over the network; ``then`` runs when they have arrived."""
        links, delay = self.path(src, dst)
        self._count_bytes(src, dst, int(nbytes))
        flow = self.net.start(nbytes + MESSAGE_OVERHEAD_BYTES, links, delay, then)
        return Transfer(flow.flow_id, src, dst, int(nbytes))

    def _count_bytes(self, src: str, dst: str, nbytes: int) -> None:
        for name, attr in ((src, "bytes_up"), (dst, "bytes_down")):
            dev = self.devices.get(name)
            if dev is not None:
                setattr(dev, attr, getattr(dev, attr) + nbytes)

    def cancel(self, transfer: Transfer) -> None:
        """Stop a transfer (an endpoint is gone or the step was abandoned); the bytes it had not
        sent yet are taken off both ends' counts (one already sent is left as it is)."""
        flow = self.net.flows.get(transfer.flow_id)
        if flow is not None:
            # the message's overhead goes first, as a frame's header does
            unsent = min(transfer.nbytes, round(flow.left_bytes))
            self._count_bytes(transfer.src, transfer.dst, -unsent)
        self.net.cancel(transfer.flow_id)

    def compute(self, dev: Device, gemms: list[Gemm], memory_bytes: float,
                then: Callable[[], None]) -> float:
        """Queue work on a device after what it is doing; ``then`` runs when it ends.

        Returns the work's device seconds (as queued: a later churn ``slow`` re-times it)."""
        start = max(self.now_s, dev.busy_until_s)
        dev.model.settle(self.now_s)  # rewinds come at now or later (stop_work, set_slow)
        factor = dev.slow * (dev.straggler.compute_factor() if dev.straggler else 1.0)
        t = start
        parts: list[Part] = []
        for g in gemms:
            c = dev.model.tile_cost(g.m, g.k, g.n, g.op, t, slowdown=factor)
            parts.append(Part(t, t + c.seconds, c.joules, c.seconds, c.joules))
            t = parts[-1].end_s
        mem_s = memory_bytes / dev.memory_bytes_s * factor
        busy_w = dev.power.busy_w(1.0) if dev.power is not None else 0.0
        parts.append(Part(t, t + mem_s, busy_w * mem_s, then=then))
        t += mem_s
        dev.queued = [q for q in dev.queued if q.end_s > self.now_s] + \
            [p for p in parts if p.end_s > p.start_s or p.then is not None]
        dev.busy_until_s = t
        dev.compute_s += t - start
        dev.energy_j += sum(p.joules for p in parts)
        self._finish(dev, parts[-1])
        return t - start

    def _finish(self, dev: Device, last: Part) -> None:
        """Run the piece's callback at its last part's end, unless a ``slow`` has re-timed the
        part since (and queued its callback again) or its work was stopped (a device that
        left while cut off stops at once, before its coordinator knows). By timing, not by
        end: a slow equal to the factor in force moves no end, and the callback ran twice."""
        timing, stops, then = last.timing, dev.stops, last.then
        assert then is not None
        self.at(last.end_s,
                lambda: then() if last.timing == timing and dev.stops == stops else None)

    def stop_work(self, dev: Device) -> None:
        """The device drops what it was computing (its step was abandoned): the part of its work
        not run by now is no longer charged (time, and energy pro rata within a part:
        :mod:`testbed.baselines.charge`), nor is it in the device model's telemetry."""
        model_s = model_j = 0.0
        unstarted = 0
        for p in dev.queued:
            share = unrun_share(p.start_s, p.end_s, self.now_s)
            if share > 0:
                dev.compute_s -= (p.end_s - p.start_s) * share
                dev.energy_j -= p.joules * share
                model_s += p.model_s * share
                model_j += p.model_j * share
                unstarted += share == 1.0 and p.model_s > 0
        dev.model.unrun(model_s, model_j, unstarted)
        dev.model.rewind(self.now_s, [])  # and its heat, as far as it ran
        dev.queued.clear()
        dev.stops += 1
        dev.busy_until_s = min(dev.busy_until_s, self.now_s)

    def set_slow(self, dev: Device, factor: float) -> None:
        """A churn ``slow``: the device computes ``factor`` times slower than its profile from
        now on, mid-piece and mid-GEMM: what is left of its queued work takes ``factor / its
        old factor`` times its time and energy, and the pieces end that much later (or
        sooner). The straggler factor a piece drew stays with it."""
        ratio = factor / dev.slow
        dev.slow = factor
        live = [p for p in dev.queued if p.end_s > self.now_s]
        rows = [(p.start_s, p.end_s, p.joules, p.model_s, p.model_j) for p in live]
        queued: list[Part] = []
        for p, became in zip(live, retimed_parts(rows, self.now_s, ratio)):  # charge's rule
            p.timing += 1  # a callback queued for it does not run: it is queued again below
            for i, (start, end, joules, model_s, model_j) in enumerate(became):
                last = i == len(became) - 1
                queued.append(Part(start, end, joules, model_s, model_j,
                                   p.then if last else None))
            if p.then is not None:
                self._finish(dev, queued[-1])
        before, after = _totals(live), _totals(queued)
        dev.compute_s += after[0] - before[0]
        dev.energy_j += after[1] - before[1]
        # the device model's account (its telemetry) follows the re-timed work
        dev.model.unrun(before[2] - after[2], before[3] - after[3], 0)
        dev.model.rewind(self.now_s, [  # and its heat: what is left of each GEMM, re-timed
            (max(p.start_s, self.now_s), p.end_s - max(p.start_s, self.now_s),
             p.model_j / p.model_s) for p in queued if p.model_s > 0 and p.end_s > self.now_s])
        dev.queued = queued
        if queued:
            dev.busy_until_s = max(self.now_s, queued[-1].end_s)

    # -- membership ----------------------------------------------------------------------------
    def participate(self, dev: Device) -> None:
        """Log the device's join the first time a strategy uses it (energy counts from here)."""
        if not dev.joined:
            dev.joined = True
            self.emit("join", device=dev.name, group=dev.spec.group.group, kind="emulated",
                      profile=dev.spec.group.profile)

    def retire(self, dev: Device, kind: str, reason: str) -> None:
        """Log the device's departure from the strategy's run (energy stops counting)."""
        if dev.joined:
            dev.joined = False
            self.emit(kind, device=dev.name, reason=reason)

    def present(self) -> list[Device]:
        """Devices the coordinator holds now: present, and reachable as far as it knows (one
        cut off within its lease, or gone while cut off, is until it hears otherwise)."""
        return [d for d in self.devices.values() if self.hearing.held(d.name)]

    def start(self) -> None:
        """Devices present at the start are there; churn actions are queued at their times."""
        names = self.schedule.initially_present if self.schedule is not None else \
            frozenset(self.devices)
        for name in names:
            self.devices[name].present = True
            self.wanted.add(name)
        self.hearing = Hearing(self, names, self._heard)
        if self.schedule is not None:
            self.emit("churn_clock_start", actions=len(self.schedule.actions),
                      already_applied=0, offset_s=0.0)
            for action in self.schedule.actions:
                self.at(action.time_s, lambda a=action: self._apply(a))  # type: ignore[misc]

    def _apply(self, action: ChurnAction) -> None:
        """One churn action: its ``churn`` event, then what it does, so that the departure or
        restart it causes is recorded after it, as ``testbed up`` and ``testbed simulate``
        record tile-tp's."""
        dev = self.devices[action.device]
        effect, act = self._action(dev, action)
        self.emit("churn", **action.churn_event(effect))
        act()

    def _action(self, dev: Device, action: ChurnAction) -> tuple[str, Callable[[], None]]:
        """What a churn action does to ``dev``: its effect as the ``churn`` event says it, and
        the doing."""
        event = action.event
        hear = functools.partial(self.hearing.apply, action)
        if event is ChurnEvent.JOIN:
            def join() -> None:
                self.wanted.add(dev.name)
                dev.present = True
                hear()
            return ("absent" if dev.present else "applied"), join
        if event in (ChurnEvent.LEAVE, ChurnEvent.CRASH):
            def leave() -> None:
                self.wanted.discard(dev.name)
                if dev.present:  # its process ends and drops its work, heard or not
                    dev.present = False
                    self.stop_work(dev)
                hear()
            effect = "SIGTERM" if event is ChurnEvent.LEAVE else "SIGKILL"
            return (effect if dev.present else "absent"), leave
        if event in (ChurnEvent.PARTITION, ChurnEvent.HEAL):
            down = event is ChurnEvent.PARTITION

            def cut() -> None:
                hear()  # a heal: the end the cut held is heard before the link is up
                dev.partitioned = down
                for link, rate in zip(dev.own, dev.link_Bps):
                    self.net.set_capacity(link, 0.0 if down else rate)
            return ("link down" if down else "link up"), cut
        factor = float(action.factor or 1.0)
        return f"compute x{action.factor}", lambda: self.set_slow(dev, factor)

    def _heard(self, heard: Heard) -> None:
        """What the coordinator learns (:mod:`testbed.baselines.heard`), to the strategy."""
        dev = self.devices[heard.device]
        if heard.lost:
            self.on_lost(dev, heard.kind, heard.reason)
        else:
            self.on_back(dev)

    def device_records(self) -> list[dict[str, Any]]:
        """Final per-device records in the PS's shape (devices.jsonl, summary.json, energy)."""
        out = []
        for d in self.devices.values():
            if not (d.compute_s or d.bytes_down or d.bytes_up):
                continue
            out.append({"device": d.name, "group": d.spec.group.group, "kind": "emulated",
                        "profile": d.spec.group.profile, "state": "idle" if d.present else "left",
                        "tiles_done": 0, "bytes_down": d.bytes_down, "bytes_up": d.bytes_up,
                        "compute_s": round(d.compute_s, 6), "energy_j": round(d.energy_j, 6),
                        "telemetry": d.model.telemetry(self.now_s)})
        return out
