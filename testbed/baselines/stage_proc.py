"""One pipeline stage as a real process on its device's node (emulated pipeline, GPipe).

``python -m testbed.baselines.stage_proc --plan PLAN.json --stage S --out REPORT.json``

The stage builds the job's model exactly as the single-process trainer does (same seed), keeps
its own layers (:class:`~testbed.baselines.engine.Stage`), and trains with its neighbours over
TCP: activations go to stage ``S+1``, their gradients come back, the first and last stage
exchange the tied embedding's gradient, each stage steps its own AdamW. The arithmetic is real
and happens here, on the host's CPU inside the device's namespace; each piece of work then holds
until the device model's time for it (x dilation) has passed since it started, as an emulated
tile-tp agent holds a tile. Stage 0 and the last stage read the batch's tokens and targets from
the corpus themselves (data on the devices, as DT-FM assumes), so only activations, gradients
and the tied gradient cross links, with their real sizes. Under churn a ``slow`` of the stage's
device lengthens (or shortens) its holds from the event's time, the piece under way included
(:class:`HeldDevice`, the control file of :mod:`testbed.baselines.slow`).

Wire format, one frame per tensor: a header ``!BIIQd`` (kind, step, micro-batch, payload bytes,
sender's clock in seconds) then the raw little-endian tensor bytes. Kinds: 1 activation,
2 activation gradient, 3 tied-embedding gradient, 9 hello (payload: the sender's stage index).
Without netem the kernel shapes rates (HTB) but not delay: the receiver then waits until the
sender's clock plus the path's one-way delay (all namespaces share the host's clock).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from testbed.agent.hold import hold_until
from testbed.baselines.charge import (
    Part,
    charge,
    heat_spans,
    ledger_path,
    read_ledger,
    read_stopped,
    retimed_parts,
)
from testbed.baselines.slow import POLL_S, SlowControl, control_path
from testbed.user_paths import written_whole

if TYPE_CHECKING:  # imported lazily at run time (torch-heavy modules)
    from testbed.baselines.cost import Gemm
    from testbed.topology import Topology

HEADER = struct.Struct("!BIIQd")
ACT, GRAD, TIED, HELLO = 1, 2, 3, 9
PORT = 47100


def send_frame(sock: socket.socket, kind: int, step: int, micro: int, payload: bytes) -> None:
    """One frame: header then payload."""
    sock.sendall(HEADER.pack(kind, step, micro, len(payload), time.time()) + payload)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes (ConnectionError if the peer closes first)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, delay_s: float) -> tuple[int, int, int, bytes]:
    """The next frame; held until the sender's clock + delay_s (the path's one-way delay)."""
    kind, step, micro, n, sent = HEADER.unpack(recv_exact(sock, HEADER.size))
    payload = recv_exact(sock, n)
    wait = sent + delay_s - time.time()
    if wait > 0:
        hold_until(time.monotonic() + wait)  # woken on time on a busy host, as the agents
    return kind, step, micro, payload


def _connect(host: str, port: int, timeout_s: float = 60.0) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5.0)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def global_name(name: str, first_layer: int) -> str:
    """A stage parameter's name in the whole model (``layers.<i>`` counted from layer 0)."""
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        return f"layers.{first_layer + int(idx)}.{rest}"
    return name


def save_checkpoint(stage: Any, opt: Any, path: Path) -> None:
    """This stage's parameters and AdamW state by their names in the whole model (atomic)."""
    from testbed.ps_backend.engine.checkpoint import save_atomic

    params = {global_name(n, stage.first): p for n, p in stage.named_parameters()}
    state = {"params": {n: p.detach().clone() for n, p in params.items()},
             "adam": {n: {k: (v.clone() if hasattr(v, "clone") else v)
                          for k, v in opt.state[p].items()}
                      for n, p in params.items() if p in opt.state}}
    save_atomic(state, path)  # the PS's checkpoints' writer: a full disk is said as such


def load_checkpoint(stage: Any, opt: Any, files: list[Path]) -> None:
    """Set this stage's parameters and AdamW state from the stages' files of one checkpoint.

    The tied LM head of a last stage falls back to the token embedding's entry (a one-stage
    pipeline saves the tied weight once, under that name)."""
    import torch

    params: dict[str, Any] = {}
    adam: dict[str, Any] = {}
    for f in files:
        state = torch.load(f, weights_only=True)
        params.update(state["params"])
        adam.update(state["adam"])
    with torch.no_grad():
        for n, p in stage.named_parameters():
            name = global_name(n, stage.first)
            key = name if name in params or name != "lm_head.weight" else "embed_tokens.weight"
            p.copy_(params[key])
            if key in adam:
                opt.state[p] = {k: (v.clone() if hasattr(v, "clone") else v)
                                for k, v in adam[key].items()}


def main(argv: list[str] | None = None) -> int:
    """Run one stage; write its report (losses on the last stage, bytes, holds)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="the runner's plan JSON")
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--out", required=True, help="where to write this stage's report (JSON)")
    args = p.parse_args(argv)
    plan: dict[str, Any] = json.loads(Path(args.plan).read_text())
    report = run_stage(plan, args.stage, ledger_path(Path(args.out)))
    Path(args.out).write_text(json.dumps(report))
    return 0


def run_stage(plan: dict[str, Any], s: int, ledger: Path | None = None) -> dict[str, Any]:
    """Train plan['steps'] steps as stage s of the plan (each piece of work written to
    ``ledger`` as it starts; ``plan['draws_used'][s]``: the pieces and GEMMs whose draws the
    stage's device used in earlier attempts)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from testbed.baselines import cost
    from testbed.baselines.engine import Stage, _reference_model
    from testbed.ps_backend.engine.data import BatchSampler, load_corpus
    from testbed.ps_backend.engine.trainer import adamw
    from testbed.topology import load_topology

    torch.set_num_threads(1)
    topo = load_topology(plan["topology"])
    job = topo.job
    S = len(plan["devices"])
    first, last = s == 0, s == S - 1
    a, e = plan["bounds"][s]
    m = plan["micro_batches"]
    rows = [hi - lo for lo, hi in cost.split_rows(job.batch_size, m)]
    model = _reference_model(job, topo.seed)
    stage = Stage(model, a, e, first, last)
    del model
    opt = adamw(list(stage.parameters()), job)
    dtype = torch.float64 if job.dtype == "float64" else torch.float32
    npdtype = np.float64 if job.dtype == "float64" else np.float32
    b = cost.DTYPE_BYTES[job.dtype]
    spec = job.model
    device = HeldDevice(topo, plan["devices"][s], float(plan.get("dilation", 1.0)), ledger,
                        _control(plan, plan["devices"][s]), plan.get("clock_origin"))
    device.resume([Path(p) for p in plan.get("history", [[]] * (s + 1))[s]])
    sampler = BatchSampler(load_corpus(job.data), job.batch_size, spec.seq_len, topo.seed) \
        if first or last else None
    delays = plan["delay_s"][s]  # one-way delay from each other stage to this one
    listener = socket.create_server((plan["ips"][s], PORT), backlog=4)
    peers: dict[int, socket.socket] = {}
    if not last:
        peers[s + 1] = _connect(plan["ips"][s + 1], PORT)
        send_frame(peers[s + 1], HELLO, 0, 0, struct.pack("!I", s))
    if first and S > 2:
        peers[S - 1] = _connect(plan["ips"][S - 1], PORT)
        send_frame(peers[S - 1], HELLO, 0, 0, struct.pack("!I", s))
    expected = (1 if s > 0 else 0) + (1 if last and S > 2 else 0)
    for _ in range(expected):
        conn, _addr = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _, _, _, hello = recv_frame(conn, 0.0)
        peers[struct.unpack("!I", hello)[0]] = conn
    if plan.get("ready_dir"):  # connected: training can start (the runner's churn clock)
        Path(plan["ready_dir"], f"stage{s}").touch()
    sent: dict[str, int] = {}
    def work(kind: str, j: int) -> tuple[list[cost.Gemm], float]:
        return cost.stage_work(spec, e - a, last, kind, rows[j], b)

    def send(to: int, kind: int, step: int, j: int, t: torch.Tensor) -> None:
        payload = t.detach().contiguous().numpy().tobytes()
        send_frame(peers[to], kind, step, j, payload)
        key = f"stage{s}->stage{to}"
        sent[key] = sent.get(key, 0) + len(payload)

    def recv(frm: int, kind: int, step: int, j: int, shape: tuple[int, ...]) -> torch.Tensor:
        k, st, mj, payload = recv_frame(peers[frm], delays[frm])
        if (k, st, mj) != (kind, step, j):
            raise RuntimeError(f"stage {s}: expected frame {(kind, step, j)}, got {(k, st, mj)}")
        return torch.from_numpy(np.frombuffer(payload, dtype=npdtype).reshape(shape).copy())

    losses: list[float] = []
    step_s: list[float] = []
    start = int(plan.get("start_step", 0))
    if start > 0:  # a restart: resume from the checkpoint the runner names
        load_checkpoint(stage, opt, [Path(f) for f in plan["resume_files"]])
    every = int(plan.get("checkpoint_every", 0))
    progress = Path(plan["progress"]) if last and plan.get("progress") else None
    for step in range(start, plan["steps"]):
        t_step = time.monotonic()
        inputs = targets = None
        if sampler is not None:
            inputs, targets = sampler.batch(step)
        opt.zero_grad(set_to_none=True)
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        step_losses: list[torch.Tensor] = []
        offsets = cost.split_rows(job.batch_size, m)
        for j in range(m):
            lo, hi = offsets[j]
            shape = (rows[j], spec.seq_len, spec.hidden)
            if first:
                assert inputs is not None
                x: torch.Tensor = inputs[lo:hi]
            else:
                x = recv(s - 1, ACT, step, j, shape).to(dtype).requires_grad_(True)
            with device.piece(*work("F", j)):
                out = stage(x)
            saved.append((x, out))
            if not last:
                send(s + 1, ACT, step, j, out)
            else:
                assert targets is not None
                tgt = targets[lo:hi]
                step_losses.append(F.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                   tgt.reshape(-1)) * (tgt.numel()
                                                                       / targets.numel()))
        for j in reversed(range(m)):
            x, out = saved[j]
            if last:
                with device.piece(*work("B", j)):
                    step_losses[j].backward()
            else:
                g = recv(s + 1, GRAD, step, j, tuple(out.shape)).to(dtype)
                with device.piece(*work("B", j)):  # it starts when the gradient is here
                    out.backward(g)
            if not first:
                assert x.grad is not None
                send(s - 1, GRAD, step, j, x.grad)
        if S > 1 and (first or last):  # exchange the tied embedding's gradient
            w = stage.embed_tokens.weight if first else stage.lm_head.weight  # type: ignore[union-attr]
            assert w.grad is not None
            other = S - 1 if first else 0
            mine = w.grad.clone()
            # both ends send at once: send from a thread so that neither blocks on a full
            # socket buffer while the other does too
            sender = threading.Thread(target=send, args=(other, TIED, step, 0, mine))
            sender.start()
            theirs = recv(other, TIED, step, 0, tuple(mine.shape)).to(dtype)
            sender.join()
            w.grad = mine + theirs if first else theirs + mine
        params = sum(p.numel() for p in stage.parameters())
        with device.piece([], cost.optimizer_bytes(params, b)):
            opt.step()
        if every and (step + 1) % every == 0:
            save_checkpoint(stage, opt, Path(plan["ckpt_dir"]) / f"step{step + 1}" /
                            f"stage{s}.pt")
        step_s.append(time.monotonic() - t_step)
        if last:
            losses.append(float(sum(float(x.detach()) for x in step_losses)))
            if progress is not None:  # the runner reads it as it goes (its step lines, restarts)
                with progress.open("a") as fh:
                    fh.write(json.dumps({"step": step, "loss": losses[-1],
                                         "step_s": step_s[-1]}) + "\n")
        if plan.get("report_pattern"):  # so far, in case the runner ends this process
            _write_report(Path(plan["report_pattern"].format(s)),
                          _report(s, plan, losses, sent, step_s, device))
    for sock in peers.values():
        sock.close()
    listener.close()
    return _report(s, plan, losses, sent, step_s, device)



class HeldDevice:
    """The emulated device a stage or replica process runs on.

    Each piece of work (its GEMMs from the device model, its memory-bound bytes at the profile's
    bandwidth) is held until its modelled time x D has passed since it started, x the group's
    straggler factor when the piece straggles (drawn per piece as the simulator draws it) and
    x the churn ``slow`` factor in force (its ``control`` file, :mod:`testbed.baselines.slow`);
    the device's time, its compute energy (the model's joules, memory-bound work at busy
    power) and how late each hold ended (lag) add up as it goes. A ``slow`` that takes effect
    while a piece is under way re-times what is left of it from the slow's time
    (:func:`~testbed.baselines.charge.retime`): a slow-down is followed from its time exactly
    (read at the latest when the hold would end), a speed-up within :data:`~testbed.baselines.
    slow.POLL_S` of wall time (the hold reads the file that often). With a ``ledger``, each
    piece is written there as it starts, and again as re-timed (:mod:`testbed.baselines.
    charge`), so that a process killed mid-piece is charged what ran; :meth:`resume` goes on
    from the device's earlier processes (their draws and heat). Its model runs on the run's
    clock (:meth:`device_time_s`).
    """

    def __init__(self, topology: Topology, name: str, dilation: float,
                 ledger: Path | None = None, control: Path | None = None,
                 clock_origin: float | None = None):
        from testbed.agent.behaviour import straggler_for
        from testbed.emulator.device_model import device_model_for
        from testbed.perf_model.profiles import load_profile

        me = next(d for d in topology.devices if d.name == name)
        profile = load_profile(str(me.group.profile_path), check=False)
        seed = topology.seed * 1000 + me.index
        self.model = device_model_for(profile, seed=seed)
        self.straggler = straggler_for(me, seed)
        self.bandwidth = profile.model.bandwidth_bytes_s if profile.model is not None else 10e9
        self.busy_w = profile.power.busy_w(1.0) if profile.power is not None else 0.0
        self.dilation = dilation
        # the device's clock, which its model's idle time, cooling and heat follow: device
        # seconds since clock_origin (time.monotonic(), the run's, shared by the device's
        # processes), as the simulated device's is the simulation's time. It was the busy
        # seconds alone, so the model never saw an idle second: a stage busy a third of the
        # time heated as if busy all of it
        self.clock_origin = time.monotonic() if clock_origin is None else clock_origin
        self.device_s = 0.0
        self.energy_j = 0.0
        self.lag_s: list[float] = []
        self._ledger = ledger.open("a", buffering=1) if ledger is not None else None
        self.control = SlowControl(control)  # the factor in force when the process starts
        self.slow = self.control.current.factor  # the factor the piece under way is timed at
        self._t0 = 0.0  # the piece under way: its start (time.monotonic())
        self._parts: list[Part] = []  # its parts, device seconds from its start
        self._gemm_parts = 0  # how many of them, first, are GEMMs (a slow may split one)
        self._until: float | None = None  # when its hold ends; None: no piece under way

    def device_time_s(self, wall_s: float) -> float:
        """The device's clock at a ``time.monotonic()`` time: seconds since its origin over D
        (D 0, no holds: its busy seconds so far)."""
        if self.dilation <= 0:
            return self.device_s
        return max(0.0, (wall_s - self.clock_origin) / self.dilation)

    def resume(self, ledgers: list[Path]) -> None:
        """Go on where the device's earlier processes (a restart's stage, a returning
        replica's standby) left it, from their ledgers: with their straggler and noise draws
        used up (:meth:`skip_draws`) and their heat in its thermal state, each piece's GEMMs
        busy at their start on the run's clock (the device then idles, and cools, until this
        process's first piece), as the simulated device goes on with its one model."""
        pieces = [p for path in ledgers for p in read_ledger(path)]
        used = charge(pieces, None)
        self.skip_draws(used.pieces, used.gemms)
        if self.dilation <= 0:
            return
        spans = []  # (device time, seconds) of each GEMM the model timed, as far as it ran
        for path in ledgers:  # a killed process's pieces up to its kill (charge.py)
            for t0, start_s, seconds in heat_spans(read_ledger(path), read_stopped(path)):
                spans.append((self.device_time_s(t0) + start_s, seconds))
        self.model.warm(sorted(spans))

    def skip_draws(self, pieces: int, gemms: int) -> None:
        """Use up the straggler draws of ``pieces`` pieces and the noise draws of ``gemms``
        GEMMs: those the device's earlier processes used (their ledgers say how many), so
        that a process started again does not repeat their delays."""
        if self.straggler is not None:
            for _ in range(pieces):
                self.straggler.compute_factor()
        if gemms:
            self.model.skip_draws(gemms)

    def begin(self, gemms: list[Gemm], mem_bytes: float) -> float:
        """A piece starts now: time it, count it, write it to the ledger; returns when its
        hold ends (``time.monotonic()``; a ``slow`` while it runs moves that)."""
        started = time.monotonic()
        self.slow = self.control.poll().factor
        factor = self.slow * (self.straggler.compute_factor() if self.straggler is not None
                              else 1.0)
        now_s = self.device_time_s(started)
        costs = [self.model.tile_cost(g.m, g.k, g.n, g.op, now_s, slowdown=factor)
                 for g in gemms]
        parts: list[Part] = []
        t = 0.0
        for c in costs:
            parts.append((t, t + c.seconds, c.joules))
            t = parts[-1][1]
        mem_s = mem_bytes / self.bandwidth * factor
        parts.append((t, t + mem_s, self.busy_w * mem_s))
        seconds = t + mem_s
        if self._ledger is not None:
            self._ledger.write(json.dumps({"t0": started, "dilation": self.dilation,
                                           "gemms": len(gemms), "parts": parts}) + "\n")
        self.energy_j += sum(p[2] for p in parts)
        self.device_s += seconds
        self._t0, self._parts, self._gemm_parts = started, parts, len(gemms)
        self._until = started + seconds * self.dilation
        return self._until

    def follow_slow(self) -> None:
        """Read the control file; a new factor re-times what is left of the piece under way
        from the factor's time (or from the piece's start, had it taken effect before)."""
        old, new = self.slow, self.control.poll()
        if new.factor == old:
            return
        self.slow = new.factor
        if self._until is None or not self._parts:
            return  # between pieces: the next one is timed at it
        at = max(0.0, min(new.at_s, time.monotonic()) - self._t0)
        at = at / self.dilation if self.dilation > 0 else 0.0
        became = retimed_parts(self._parts, at, new.factor / old)
        self._gemm_parts = sum(len(b) for b in became[:self._gemm_parts])
        parts = [part for b in became for part in b]
        self.device_s += parts[-1][1] - self._parts[-1][1]
        self.energy_j += sum(p[2] for p in parts) - sum(p[2] for p in self._parts)
        self._parts = parts
        self._until = self._t0 + parts[-1][1] * self.dilation
        if self._ledger is not None:
            self._ledger.write(json.dumps({"t0": self._t0, "dilation": self.dilation,
                                           "retimed": True, "parts": parts,
                                           "gemm_parts": self._gemm_parts}) + "\n")

    def end(self, until: float) -> None:
        """Hold until the piece's modelled time x D has passed (its real compute is done),
        reading the control file every :data:`~testbed.baselines.slow.POLL_S` meanwhile.
        ``until``: what :meth:`begin` returned (the end as re-timed since is kept here)."""
        if self._until is None:  # no piece begun: hold to the time given
            self._until = until
        self.follow_slow()
        wait = self._until - time.monotonic()
        self.lag_s.append(max(0.0, -wait))  # the real compute ran past the hold's end
        while wait > 0:  # tile-tp's agents' hold: woken on time on a busy host
            hold_until(time.monotonic() + min(wait, POLL_S))
            self.follow_slow()
            wait = self._until - time.monotonic()
        self._until, self._parts = None, []

    @contextlib.contextmanager
    def piece(self, gemms: list[Gemm], mem_bytes: float) -> Iterator[None]:
        """One piece: its real compute runs in the ``with`` block, then the hold."""
        until = self.begin(gemms, mem_bytes)
        yield
        self.end(until)

    def lag_p95_s(self) -> float:
        """The 95th percentile of how late its holds ended, wall seconds."""
        lag = sorted(self.lag_s)
        return lag[int(0.95 * (len(lag) - 1))] if lag else 0.0

    def lag_stats(self) -> dict[str, float]:
        """How late its holds ended, wall seconds: p95, the largest and the sum (the time its
        real compute added to the device model's, which a step can be longer by)."""
        return {"lag_p95_s": self.lag_p95_s(), "lag_max_s": max(self.lag_s, default=0.0),
                "lag_total_s": sum(self.lag_s)}


def _control(plan: dict[str, Any], device: str) -> Path | None:
    """The device's churn ``slow`` control file, when the runner replays churn."""
    return control_path(Path(plan["control_dir"]), device) if plan.get("control_dir") else None


def _report(s: int, plan: dict[str, Any], losses: list[float], sent: dict[str, int],
            step_s: list[float], device: HeldDevice) -> dict[str, Any]:
    return {"stage": s, "device": plan["devices"][s], "losses": losses, "sent_bytes": sent,
            "step_s": step_s, "device_s": device.device_s, "energy_j": device.energy_j,
            **device.lag_stats()}


def _write_report(path: Path, report: dict[str, Any]) -> None:
    with written_whole(path) as handle:
        handle.write(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
