"""Data-parallel training (synchronous, or DiLoCo with ``local_steps: H``) in virtual time.

Replicas from :func:`~testbed.baselines.placement.plan_data_parallel` (every device that holds
the whole model, one per sequence of the batch at most). One step: each replica runs forward
and backward over its rows (every layer and the head on its own device model). Then:

* ``local_steps: 1``: each replica sends its gradient (``P·b`` bytes) to the PS, the PS
  averages the gradients of the replicas present and sends the average back (``P·b``), and
  every replica runs AdamW;
* ``local_steps: H > 1``: each replica runs AdamW itself; every H-th step it sends its
  parameters (``P·b``), the PS runs the outer step and sends the new parameters back.

All of a round's transfers share the PS's link, switch links and device links (max-min fair).
**Churn**, by the rule the engine and the emulation follow
(:class:`~testbed.baselines.membership.ReplicaMembership`): the replicas are placed once, over
the devices present at the start, each with fixed rows. A replica that is lost is dropped from
its round (its bytes are not waited for; nothing is redone); the step it was lost in goes
without its rows unless its part had reached the PS (its gradient, its parameters at a round's
end, or between DiLoCo's outer steps its loss, sent when its forward and backward end), as the
emulated PS counts it. When its device is back it first
receives the others' state from the PS and trains from the next round. Devices that were not
placed as replicas stay out. Each step reports ``replicas`` (those that began it),
``took_part`` and ``dropped_replicas`` (the placement's replicas not in ``took_part``), whose
sum over the steps is ``dropped_replica_steps``.
"""

from __future__ import annotations

import functools
from typing import Callable

from testbed.baselines import cost
from testbed.baselines.membership import ReplicaMembership, join_state_bytes
from testbed.baselines.pipeline_sim import NoPlacement, StepOutcome
from testbed.baselines.placement import (
    DataParallelPlan,
    FitError,
    device_infos,
    plan_data_parallel,
)
from testbed.baselines.sim_core import PS, BaselineWorld, Device, Transfer
from testbed.topology import Topology

LOSS_BYTES = 8  # a replica's loss of a step, one float64 (replica_proc's LOSS frame)


class DataParallelSim:
    """Runs the topology's job as data-parallel replicas; :meth:`run` reports every step."""

    def __init__(self, topology: Topology, world: BaselineWorld) -> None:
        self.topology = topology
        self.job = topology.job
        self.world = world
        world.on_lost = self._lost
        world.on_back = lambda _dev: None  # taken in at the next round's placement
        self.b = cost.DTYPE_BYTES[self.job.dtype]
        self.params = cost.model_params(self.job.model)
        self.plan: DataParallelPlan | None = None
        # the step under way: its replicas not lost (-> their transfers), those whose part (a
        # loss, a gradient or parameters) has reached the PS, and those lost before that
        self.live: dict[str, list[Transfer]] = {}
        self.delivered: set[str] = set()
        self.lives: dict[str, int] = {}  # replica -> times it was lost (_guard)
        self.dropped: set[str] = set()
        self.has_weights: set[str] = set()
        self.dropped_replica_steps = 0
        self.index: dict[str, int] = {}  # replica device -> its slot
        self.membership = ReplicaMembership(0)
        self.took_part: list[str] = []
        self.replicas_last_step = 0
        self._recheck: Callable[[], None] = lambda: None

    def _lost(self, dev: Device, kind: str, reason: str) -> None:
        w = self.world
        w.retire(dev, kind, reason)
        self.lives[dev.name] = self.lives.get(dev.name, 0) + 1  # what it had under way is void
        if dev.name in self.live:
            if dev.name not in self.delivered:  # its rows are missing from the step
                self.dropped.add(dev.name)
            self.membership.drop(self.index[dev.name])
            for t in self.live.pop(dev.name):
                w.cancel(t)
            w.stop_work(dev)
            self._recheck()  # the others may have been waiting for it at the PS

    def _place(self) -> None:
        """The replicas, once, over the devices present at the start (waiting for one that
        holds a replica when none does)."""
        w = self.world
        while True:
            names = {d.name for d in w.present()}
            try:
                plan = plan_data_parallel(self.job, device_infos(self.topology, names))
                break
            except FitError as exc:
                if not w.run_until(functools.partial(self._changed, names)):
                    why = exc.problems[0] if names else "every device has left"
                    raise NoPlacement(f"no device present holds a replica at "
                                      f"t={w.now_s:.6g} s and none joins later: {why}") from None
        w.emit("placement", replicas=list(plan.replicas), rows=list(plan.rows),
               replica_bytes=plan.replica_bytes, left_out=len(plan.left_out))
        self.plan = plan
        self.index = {n: r for r, n in enumerate(plan.replicas)}
        self.membership = ReplicaMembership(len(plan.replicas),
                                            self.job.parallelism.local_steps,
                                            range(len(plan.replicas)))
        for d in w.devices.values():
            if d.name not in self.index:
                w.retire(d, "leave", "not a replica")

    def _members(self, step: int) -> tuple[list[int], list[int]]:
        """This step's replicas and joiners; waits (virtual time) while no replica is present."""
        w = self.world
        while True:
            names = {d.name for d in w.present()}
            live, joining = self.membership.begin(step, [self.index[n] for n in names
                                                         if n in self.index])
            if live:
                return live, joining
            if not w.run_until(functools.partial(self._changed, names)):
                why = ("every device has left" if not names else
                       "no replica's device is back (the replicas: "
                       f"{', '.join(self.plan.replicas if self.plan else ())})")
                raise NoPlacement(f"data-parallel step {step}: no replica present at "
                                  f"t={w.now_s:.6g} s and none comes back: {why}")

    def _changed(self, names: set[str]) -> bool:
        return {d.name for d in self.world.present()} != names

    def _step(self, step: int) -> None:
        w, job, b = self.world, self.job, self.b
        H = job.parallelism.local_steps
        if self.plan is None:
            self._place()
        plan = self.plan
        assert plan is not None
        live, joining = self._members(step)
        sync = self.membership.round_ends(step)
        active = [(plan.replicas[r], plan.rows[r]) for r in live]
        pending = {name for name, _ in active}
        self.replicas_last_step = len(active)
        self.live = {name: [] for name, _ in active}
        self.delivered, self.dropped = set(), set()

        def gone(name: str) -> bool:
            return name not in self.live

        def done(name: str) -> None:
            pending.discard(name)

        def optimizer(name: str) -> None:
            w.compute(w.devices[name], [], cost.optimizer_bytes(self.params, b),
                      lambda: None if gone(name) else done(name))

        arrived: set[str] = set()
        sent_back = [False]

        def at_ps(name: str) -> None:
            arrived.add(name)
            self.delivered.add(name)
            recheck()

        def recheck() -> None:
            if not sync or sent_back[0] or not arrived:
                return
            if arrived >= {n for n in pending if not gone(n)}:  # everyone present: send back
                sent_back[0] = True
                for n in sorted(arrived):
                    if gone(n):
                        continue
                    then = (lambda n=n: optimizer(n)) if H == 1 else (lambda n=n: done(n))
                    self.live[n].append(w.send(PS, n, self.params * b, self._guard(n, then)))

        def computed(name: str) -> None:
            if H > 1:  # the inner AdamW step happens on the replica
                if sync:
                    w.compute(w.devices[name], [], cost.optimizer_bytes(self.params, b),
                              self._guard(name, lambda: self._up(name, b, at_ps)))
                else:
                    # its loss goes to the PS now, as the emulated replica's does: its part.
                    # It is done once the loss is there and its AdamW step ran (a replica cut
                    # off meanwhile is not: its loss waits for the heal, or its lease ends)
                    left = [2]

                    def one(name: str = name) -> None:
                        left[0] -= 1
                        if left[0] == 0:
                            done(name)

                    def loss_in(name: str = name) -> None:
                        self.delivered.add(name)
                        one(name)
                    self.live[name].append(w.send(name, PS, LOSS_BYTES,
                                                  self._guard(name, loss_in)))
                    w.compute(w.devices[name], [], cost.optimizer_bytes(self.params, b),
                              self._guard(name, one))
            else:
                self._up(name, b, at_ps)

        self._recheck = recheck
        for r in live:
            name, rows = plan.replicas[r], plan.rows[r]
            dev = w.devices[name]
            w.participate(dev)
            if name not in self.has_weights or r in joining:  # first the parameters (state)
                self.has_weights.add(name)
                nbytes = (join_state_bytes(self.params, b, H, step) if r in joining
                          else self.params * b)

                def start(name: str = name, rows: int = rows) -> None:
                    self._compute(name, rows, computed)
                self.live[name].append(w.send(PS, name, nbytes, self._guard(name, start)))
            else:
                self._compute(dev.name, rows, computed)
        # checked after every event: all() stops at the first replica still at work, where a
        # set of them all was built each time (4,000 replicas: 17.2 s a step, now 9.0)
        ok = w.run_until(lambda: all(gone(n) for n in pending))
        if not ok:
            raise NoPlacement(f"data-parallel step {step} stalled at t={w.now_s:.3f} s")
        self.took_part = [n for n, _ in active if n not in self.dropped]
        if not self.took_part:  # no rows trained: the emulation's PS stops here too
            raise NoPlacement(f"data-parallel step {step}: every replica was lost during the "
                              f"step (by t={w.now_s:.3f} s)"
                              + ("" if w.present() else ": every device has left"))
        self.dropped_replica_steps += self._missing()
        self.live = {}
        self._recheck = lambda: None

    def _missing(self) -> int:
        """The placement's replicas the last step went without: away at its start or lost
        before their part reached the PS (as the emulated PS counts them)."""
        assert self.plan is not None
        return len(self.plan.replicas) - len(self.took_part)

    def _guard(self, name: str, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn``, run only while the replica is still the one it was made for: not lost
        since (a lost replica's work, stopped, still has its end queued; back in a later step,
        it would have delivered that step a part it never made)."""
        life = self.lives.get(name, 0)

        def wrapped() -> None:
            if name in self.live and self.lives.get(name, 0) == life:
                fn()
        return wrapped

    def _compute(self, name: str, rows: int, then: Callable[[str], None]) -> None:
        w, spec, b = self.world, self.job.model, self.b
        gemms, mem = cost.replica_step_work(spec, rows, b)
        w.compute(w.devices[name], gemms, mem, self._guard(name, lambda: then(name)))

    def _up(self, name: str, b: int, at_ps: Callable[[str], None]) -> None:
        """Its loss and its gradient (or parameters, at a round's end) up to the PS."""
        self.live[name].append(self.world.send(name, PS, self.params * b + LOSS_BYTES,
                                               self._guard(name, lambda: at_ps(name))))

    def run(self, steps: int, on_step: Callable[[StepOutcome], None]) -> None:
        """Train ``steps`` steps."""
        w = self.world
        for step in range(steps):
            ds = w.devices.values()
            before = (sum(d.bytes_down for d in ds), sum(d.bytes_up for d in ds),
                      sum(d.compute_s for d in ds), sum(d.energy_j for d in ds))
            t0 = w.now_s
            self._step(step)
            assert self.plan is not None
            on_step(StepOutcome(step, w.now_s - t0,
                                sum(d.bytes_down for d in ds) - before[0],
                                sum(d.bytes_up for d in ds) - before[1],
                                sum(d.compute_s for d in ds) - before[2],
                                sum(d.energy_j for d in ds) - before[3], redo=False,
                                fields={"replicas": self.replicas_last_step,
                                        "local_steps": self.job.parallelism.local_steps,
                                        "dropped_replicas": self._missing(),
                                        "took_part": list(self.took_part)}))
