"""A GPipe pipeline (DT-FM-style) in virtual time, on the topology's devices and network.

Before step 0 the PS hands every stage its weights (``P·b`` for its ``P`` parameters; the
emulated stages build them from the job's seed instead). One step (``m`` micro-batches over
``S`` stages, placement by :func:`~testbed.baselines.placement.plan_pipeline`):

1. the PS sends micro-batch ``j``'s tokens to stage 0 and its targets to the last stage;
2. stage ``s`` runs forward ``F(s, 0..m-1)`` then backward ``B(s, m-1..0)`` in that order
   (GPipe), each piece as soon as its input is there and the previous piece is done; ``F(s, j)``
   sends its activation ``[rows, T, h]`` to stage ``s+1``, ``B(s, j)`` the activation's gradient
   to stage ``s-1`` (device to device over the topology's links);
3. the first and last stage exchange the tied embedding's gradients (``V·h`` each way);
4. each stage runs AdamW on its parameters; every ``checkpoint_every`` steps each stage then
   uploads its weights and Adam moments (``3·P·b``) to the PS.

**Churn as DT-FM handles it**: a stage's device lost (left, crashed, or partitioned past the
lease) stops the pipeline. The PS places the model again on the devices present (waiting for
joins if none fits), sends every stage its state from the last checkpoint (``3·P·b``; the
weights alone, ``P·b``, before the first checkpoint, as at the start), and training
resumes at the checkpoint's step: the steps since then are done again and counted
(``steps_redone``; a ``restart`` event says why and how much). A device joining later is not
taken into a running pipeline (DT-FM's schedule is fixed once placed); it is used at the next
restart.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from testbed.baselines import cost
from testbed.baselines.placement import FitError, PipelinePlan, device_infos, plan_pipeline
from testbed.baselines.sim_core import PS, BaselineWorld, Device, Transfer
from testbed.topology import Topology


class NoPlacement(RuntimeError):
    """No placement fits the devices present, and none joins before the trace ends."""


@dataclass
class StepOutcome:
    """One executed step (a redone step is executed again)."""

    step: int
    device_s: float
    bytes_down: int
    bytes_up: int
    compute_s: float
    energy_j: float
    redo: bool
    fields: dict[str, Any] = field(default_factory=dict)


class PipelineSim:
    """Runs the topology's job as a GPipe pipeline; :meth:`run` yields each executed step."""

    def __init__(self, topology: Topology, world: BaselineWorld,
                 plan: PipelinePlan | None = None) -> None:
        self.topology = topology
        self._first_plan = plan  # a fixed first placement (experiments); restarts re-plan
        self.job = topology.job
        self.world = world
        world.on_lost = self._lost
        world.on_back = lambda _dev: None  # a running pipeline does not take new devices
        self.b = cost.DTYPE_BYTES[self.job.dtype]
        self.plan: PipelinePlan | None = None
        self.attempt = 0
        self.failed: str | None = None
        self.transfers: list[Transfer] = []
        self.checkpoint_step = 0  # the step the last checkpoint resumes at
        self.restarts = 0
        self.steps_redone = 0
        self.restore_s = 0.0
        self.highest_done = -1

    # -- placement -----------------------------------------------------------------------------
    def _place(self) -> None:
        """Place the model on the devices present, waiting for joins if none fits."""
        w = self.world
        while True:
            names = {d.name for d in w.present()}
            if self._first_plan is not None and set(self._first_plan.devices) <= names:
                self.plan, self._first_plan = self._first_plan, None
                break
            self._first_plan = None
            try:
                self.plan = plan_pipeline(self.job, device_infos(self.topology, names))
                break
            except FitError as exc:
                waiting = self._wait_for_change(names)
                if not waiting:
                    why = exc.problems[0] if names else "every device has left"
                    raise NoPlacement(f"no pipeline placement fits the devices present at "
                                      f"t={w.now_s:.6g} s and no device joins later: "
                                      f"{why}") from None
        used = set(self.plan.devices)
        for d in w.devices.values():
            if d.name in used:
                w.participate(d)
            else:
                w.retire(d, "leave", "not in the pipeline's placement")
        w.emit("placement", stages=len(self.plan.devices), devices=list(self.plan.devices),
               bounds=[list(b) for b in self.plan.bounds], micro_batches=self.plan.micro_batches,
               stage_bytes=list(self.plan.stage_bytes), estimate_s=round(self.plan.estimate_s, 6))

    def _wait_for_change(self, names: set[str]) -> bool:
        w = self.world
        return w.run_until(lambda: {d.name for d in w.present()} != names)

    def _stage_params(self, s: int) -> int:
        assert self.plan is not None
        a, b = self.plan.bounds[s]
        return cost.stage_params(self.job.model, b - a, s == 0, s == len(self.plan.devices) - 1)

    def _restore(self) -> float:
        """The PS sends every stage its state at the checkpoint (weights, and Adam's moments
        once a step has trained them); returns the seconds it took."""
        assert self.plan is not None
        w = self.world
        start = w.now_s
        left = [len(self.plan.devices)]
        attempt = self.attempt
        # before any step the moments are zeros a stage makes itself: the weights alone (P·b),
        # as data-parallel's first hand-out
        tensors = 3 if self.checkpoint_step > 0 else 1

        def one() -> None:
            left[0] -= 1
        for s, name in enumerate(self.plan.devices):
            self.transfers.append(w.send(PS, name, tensors * self._stage_params(s) * self.b, one))
        if not w.run_until(lambda: left[0] == 0 or self.attempt != attempt):
            raise NoPlacement("the network stalled while restoring a checkpoint")
        return w.now_s - start

    # -- churn ---------------------------------------------------------------------------------
    def _lost(self, dev: Device, kind: str, reason: str) -> None:
        w = self.world
        in_plan = self.plan is not None and dev.name in self.plan.devices
        w.retire(dev, kind, reason)
        if in_plan and self.failed is None:
            self.failed = f"stage on {dev.name} lost: {reason}"
            self.attempt += 1
            for t in self.transfers:
                w.cancel(t)
            self.transfers.clear()
            for d in w.devices.values():
                w.stop_work(d)

    # -- one step ------------------------------------------------------------------------------
    def _step(self, step: int) -> bool:
        """Run one step; False if a stage was lost on the way."""
        plan = self.plan
        assert plan is not None
        if self.failed is not None:  # a stage was lost between steps
            return False
        w, job, spec, b = self.world, self.job, self.job.model, self.b
        S, m = len(plan.devices), plan.micro_batches
        rows = [e - a for a, e in cost.split_rows(job.batch_size, m)]
        devs = [w.devices[n] for n in plan.devices]
        attempt = self.attempt
        ready_f = [[False] * m for _ in range(S)]
        ready_b = [[False] * m for _ in range(S)]
        order = [[("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))]
                 for _ in range(S)]
        pos = [0] * S
        running = [False] * S
        opt_left = [S]

        def live(fn: Callable[[], None]) -> Callable[[], None]:
            def wrapped() -> None:
                if self.attempt == attempt:
                    fn()
            return wrapped

        def work(s: int, kind: str, j: int) -> tuple[list[cost.Gemm], float]:
            a, e = plan.bounds[s]
            return cost.stage_work(spec, e - a, s == S - 1, kind, rows[j], b)

        def pump(s: int) -> None:
            if running[s] or pos[s] >= len(order[s]):
                return
            kind, j = order[s][pos[s]]
            if not (ready_f if kind == "F" else ready_b)[s][j]:
                return
            running[s] = True
            gemms, mem = work(s, kind, j)
            w.compute(devs[s], gemms, mem, live(lambda: finished(s, kind, j)))

        def finished(s: int, kind: str, j: int) -> None:
            running[s] = False
            pos[s] += 1
            act = cost.boundary_bytes(spec, rows[j], b)
            if kind == "F":
                if s < S - 1:
                    self._send(devs[s].name, devs[s + 1].name, act,
                               live(lambda: arrive(ready_f, s + 1, j)))
                else:
                    ready_b[s][j] = True  # the loss is here: its backward may start
            elif s > 0:
                self._send(devs[s].name, devs[s - 1].name, act,
                           live(lambda: arrive(ready_b, s - 1, j)))
            if pos[s] == len(order[s]):
                stage_done(s)
            pump(s)

        def arrive(ready: list[list[bool]], s: int, j: int) -> None:
            ready[s][j] = True
            pump(s)

        tied_left = [2 if S > 1 else 0]
        backward_done = [0]

        def stage_done(s: int) -> None:
            backward_done[0] += 1 if s in (0, S - 1) else 0
            if s not in (0, S - 1):
                optimizer(s)
            elif S == 1:
                optimizer(0)
            elif backward_done[0] == 2:  # both ends done: exchange the tied gradient
                nbytes = spec.vocab * spec.hidden * b
                for x, y in ((0, S - 1), (S - 1, 0)):
                    self._send(devs[x].name, devs[y].name, nbytes, live(functools.partial(tied, y)))

        def tied(s: int) -> None:
            tied_left[0] -= 1
            if tied_left[0] == 0:
                optimizer(0)
                optimizer(S - 1)

        def optimizer(s: int) -> None:
            w.compute(devs[s], [], cost.optimizer_bytes(self._stage_params(s), b),
                      live(lambda: checkpoint(s)))

        ckpt = (step + 1) % job.parallelism.checkpoint_every == 0

        def checkpoint(s: int) -> None:
            if ckpt:
                self._send(devs[s].name, PS, 3 * self._stage_params(s) * b, live(optimized))
            else:
                optimized()

        def optimized() -> None:
            opt_left[0] -= 1

        for j in range(m):  # tokens to the first stage, targets to the last
            tok = rows[j] * spec.seq_len * cost.TOKEN_BYTES
            self._send(PS, devs[0].name, tok, live(functools.partial(arrive, ready_f, 0, j)))
            self._send(PS, devs[-1].name, tok, live(lambda: None))
        ok = w.run_until(lambda: opt_left[0] == 0 or self.attempt != attempt)
        if not ok:
            raise NoPlacement(f"the pipeline stalled at t={w.now_s:.3f} s (step {step})")
        self.transfers.clear()
        if self.attempt != attempt:
            return False
        if ckpt:
            self.checkpoint_step = step + 1
        return True

    def _send(self, src: str, dst: str, nbytes: float, then: Callable[[], None]) -> None:
        self.transfers.append(self.world.send(src, dst, nbytes, then))

    # -- the run -------------------------------------------------------------------------------
    def run(self, steps: int, on_step: Callable[[StepOutcome], None]) -> None:
        """Train ``steps`` steps, restarting from checkpoints on churn."""
        w = self.world
        self._recover()
        step = 0
        while step < steps:
            before = self._snapshot()
            t0 = w.now_s
            if self._step(step):
                on_step(self._outcome(step, t0, before))
                self.highest_done = max(self.highest_done, step)
                step += 1
                continue
            # a stage was lost: DT-FM restarts from the last checkpoint on a new placement
            lost_reason, self.failed = self.failed, None
            redone = step - self.checkpoint_step + 1  # the finished ones and the aborted one
            self.steps_redone += redone
            self.restarts += 1
            t_fail = w.now_s
            restore_s = self._recover()
            w.emit("restart", reason=lost_reason, failed_step=step,
                   resume_step=self.checkpoint_step, steps_redone=redone,
                   placement_s=round(w.now_s - t_fail - restore_s, 6),
                   restore_s=round(restore_s, 6), stages=list(self.plan.devices)
                   if self.plan else [])
            step = self.checkpoint_step

    def _recover(self) -> float:
        """Place and restore until both succeed; returns the restore seconds."""
        while True:
            # no placement while placing: a device lost meanwhile is simply not chosen
            self.plan, self.failed = None, None
            self._place()
            restore_s = self._restore()
            self.restore_s += restore_s
            if self.failed is None:
                return restore_s
            # a new stage was lost while restoring: place again

    def _snapshot(self) -> tuple[int, int, float, float]:
        ds = self.world.devices.values()
        return (sum(d.bytes_down for d in ds), sum(d.bytes_up for d in ds),
                sum(d.compute_s for d in ds), sum(d.energy_j for d in ds))

    def _outcome(self, step: int, t0: float, before: tuple[int, int, float, float]
                 ) -> StepOutcome:
        after = self._snapshot()
        assert self.plan is not None
        return StepOutcome(step, self.world.now_s - t0, after[0] - before[0],
                           after[1] - before[1], after[2] - before[2], after[3] - before[3],
                           redo=step <= self.highest_done,
                           fields={"stages": len(self.plan.devices),
                                   "micro_batches": self.plan.micro_batches})


def pipeline_bubble_fraction(stages: int, micro_batches: int) -> float:
    """GPipe's idle share of a step with equal stages: (S - 1) / (m + S - 1)."""
    return (stages - 1) / (micro_batches + stages - 1) if stages > 0 else math.nan
