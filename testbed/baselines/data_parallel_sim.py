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
**Churn**: a replica that is lost is dropped from its round (its rows are lost for that round,
its bytes are not waited for; nothing is redone). A device that joins and can hold a replica
gets the current parameters from the PS and trains from the next round; replicas are placed
again at every round over the devices present.
"""

from __future__ import annotations

import functools
from typing import Callable

from testbed.baselines import cost
from testbed.baselines.pipeline_sim import NoPlacement, StepOutcome
from testbed.baselines.placement import (
    DataParallelPlan,
    FitError,
    device_infos,
    plan_data_parallel,
)
from testbed.baselines.sim_core import PS, BaselineWorld, Device, Transfer
from testbed.topology import Topology


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
        self.live: dict[str, list[Transfer]] = {}  # replica -> its transfers in progress
        self.dropped: set[str] = set()
        self.has_weights: set[str] = set()
        self.dropped_replica_steps = 0
        self.out_this_round: set[str] = set()  # dropped replicas wait for the next round
        self.replicas_last_step = 0
        self._recheck: Callable[[], None] = lambda: None

    def _lost(self, dev: Device, reason: str) -> None:
        w = self.world
        w.retire(dev, "disconnect" if "broken" in reason else
                 "lease_expired" if "message" in reason else "leave", reason)
        self.has_weights.discard(dev.name)
        if dev.name in self.live:
            self.dropped.add(dev.name)
            for t in self.live.pop(dev.name):
                w.cancel(t)
            w.stop_work(dev)
            self._recheck()  # the others may have been waiting for it at the PS

    def _replan(self) -> None:
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
                                      f"t={w.now_s:.1f} s and none joins later: {why}") from None
        if self.plan is None or plan.replicas != self.plan.replicas:
            w.emit("placement", replicas=list(plan.replicas), rows=list(plan.rows),
                   replica_bytes=plan.replica_bytes, left_out=len(plan.left_out))
        self.plan = plan
        used = set(plan.replicas)
        for d in w.devices.values():
            if d.name in used:
                w.participate(d)
            else:
                w.retire(d, "leave", "not a replica")

    def _changed(self, names: set[str]) -> bool:
        return {d.name for d in self.world.present()} != names

    def _step(self, step: int) -> None:
        w, job, b = self.world, self.job, self.b
        H = job.parallelism.local_steps
        if step % H == 0:
            self.out_this_round = set()
            self._replan()
        plan = self.plan
        assert plan is not None
        sync = (step + 1) % H == 0
        here = {d.name for d in w.present()}
        active = [(n, rows) for n, rows in zip(plan.replicas, plan.rows)
                  if n in here and n not in self.out_this_round]
        if not active:  # every replica of the round is gone: place again now
            self.out_this_round = set()
            self._replan()
            plan = self.plan
            assert plan is not None
            active = list(zip(plan.replicas, plan.rows))
        pending = {name for name, _ in active}
        self.replicas_last_step = len(active)
        self.live = {name: [] for name, _ in active}
        self.dropped = set()

        def gone(name: str) -> bool:
            return name in self.dropped or name not in self.live

        def done(name: str) -> None:
            pending.discard(name)

        def optimizer(name: str) -> None:
            w.compute(w.devices[name], [], cost.optimizer_bytes(self.params, b),
                      lambda: None if gone(name) else done(name))

        arrived: set[str] = set()
        sent_back = [False]

        def at_ps(name: str) -> None:
            arrived.add(name)
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
                    optimizer(name)
            else:
                self._up(name, b, at_ps)

        self._recheck = recheck
        for name, rows in active:
            dev = w.devices[name]
            start: Callable[[], None]
            if name not in self.has_weights:  # a new replica first gets the parameters
                self.has_weights.add(name)

                def start(name: str = name, rows: int = rows) -> None:
                    self._compute(name, rows, computed)
                self.live[name].append(w.send(PS, name, self.params * b,
                                              self._guard(name, start)))
            else:
                self._compute(dev.name, rows, computed)
        ok = w.run_until(lambda: not {n for n in pending if not gone(n)})
        if not ok:
            raise NoPlacement(f"data-parallel step {step} stalled at t={w.now_s:.3f} s")
        self.dropped_replica_steps += len(self.dropped)
        self.out_this_round |= self.dropped
        self.live = {}
        self._recheck = lambda: None

    def _guard(self, name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def wrapped() -> None:
            if name in self.live and name not in self.dropped:
                fn()
        return wrapped

    def _compute(self, name: str, rows: int, then: Callable[[str], None]) -> None:
        w, spec, b = self.world, self.job.model, self.b
        lf, lb = cost.layer_gemms(spec, rows)
        hf, hb = cost.head_gemms(spec, rows)
        ef, eb = cost.layer_elementwise_bytes(spec, rows, b)
        hef, heb = cost.head_elementwise_bytes(spec, rows, b)
        gemms = lf * spec.layers + hf + hb + lb * spec.layers
        mem = spec.layers * (ef + eb) + hef + heb
        w.compute(w.devices[name], gemms, mem, self._guard(name, lambda: then(name)))

    def _up(self, name: str, b: int, at_ps: Callable[[str], None]) -> None:
        self.live[name].append(self.world.send(name, PS, self.params * b,
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
                                        "dropped_replicas": len(self.dropped)}))
