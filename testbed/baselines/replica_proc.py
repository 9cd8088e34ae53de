"""Data-parallel training as real processes: replicas on device nodes, the PS on its node
(emulated data-parallel: synchronous with ``local_steps: 1``, DiLoCo rounds with H > 1).

``python -m testbed.baselines.replica_proc --plan PLAN.json --role ps|replica [--replica R]
[--join] --out REPORT.json``

Each replica builds the job's model as the single-process trainer does (same seed), trains on
its rows of every batch (read from the corpus itself, as the pipeline's stages do) and holds
each piece of work for its device model's time (x dilation).

* ``local_steps: 1``: a replica sends its gradient weighted by its share of the batch's rows
  (one frame: every parameter's gradient in ``named_parameters`` order, raw bytes) and its
  mean cross-entropy, receives the sum, and runs AdamW. The PS sums the gradients of the
  replicas that delivered one, in replica order (as :class:`~testbed.baselines.engine.
  DataParallelTrainer` does); when a replica is missing (churn) the sum is rescaled by
  ``batch rows / rows present`` so it is the average over the rows present, and the step's loss
  is the present replicas' cross-entropies weighted by their rows.
* ``local_steps: H > 1`` (DiLoCo): a replica runs AdamW itself every step and sends its loss;
  every H-th step it sends its parameters, the PS averages ``θ_global - θ_r`` and steps its outer
  Nesterov SGD, and sends ``θ_global`` back.

Churn: the runner kills a departed replica's process; the PS drops a replica whose
connection breaks from the step it was gathering, or one the runner says is lost (its lease
ran out while it was cut off, or a heal brought the end of a process that left while cut off:
``plan['lost_dir']``, read every :data:`WATCH_S` while the PS waits on the replica). A
replica process started again (``--join``) connects, and at the start of the PS's next step
receives the parameters and AdamW moments (the PS keeps a copy, updated as every replica is)
and the step to continue from.
A ``slow`` of a replica's device re-times its holds from the event's time, the piece under
way included (``HeldDevice``; :mod:`testbed.baselines.slow`).
Frames as :mod:`testbed.baselines.stage_proc` (kinds: 4 gradient, 5 loss, 6 parameters,
7 state, 9 hello).
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

from testbed.agent.hold import hold_until
from testbed.baselines.charge import ledger_path
from testbed.baselines.emulate import read_lost
from testbed.baselines.membership import ReplicaMembership, row_weights
from testbed.baselines.stage_proc import (
    HEADER,
    HELLO,
    PORT,
    HeldDevice,
    _connect,
    _control,
    recv_frame,
    send_frame,
)

WATCH_S = 0.02  # how often the PS, waiting on a replica, reads whether it was heard lost
# the most a replica's connection to the PS may hold unread (bytes): see receive_whole_frames
MAX_RCVBUF_BYTES = 64 << 20
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux's; above rmem_max, as root


def receive_whole_frames(listener: socket.socket, frame_bytes: int) -> int:
    """Let each replica's connection take a whole frame (its gradient or parameters) while
    the PS reads another replica's, as a PS reading them all at once would; returns the
    buffer asked for. The PS gathers in replica order; with the kernel's first receive window
    (87 KB here) the replicas' uploads of a step went one after another until the windows had
    grown: the default topology's first data-parallel step took 2.58 device s where the
    others took 0.65 (the simulator, whose flows share the links at once: 0.76 and 0.66).
    Set on the listener, so accepted connections have it from their handshake; capped at
    :data:`MAX_RCVBUF_BYTES` a connection."""
    want = min(max(frame_bytes, 1 << 16), MAX_RCVBUF_BYTES)
    try:  # as root, past net.core.rmem_max (208 KB on stock kernels)
        listener.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, want)
    except OSError:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, want)
    return want

GRADS, LOSS, PARAMS, STATE = 4, 5, 6, 7


def _flat(tensors: Any) -> bytes:
    """Tensors as one frame's raw bytes, in order."""
    import torch

    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy().tobytes()


def _unflat(payload: bytes, like: list[Any], dtype: Any) -> list[Any]:
    """Raw bytes back into tensors shaped as ``like`` (copies)."""
    import numpy as np
    import torch

    flat = torch.from_numpy(np.frombuffer(payload, dtype=dtype).copy())
    out, offset = [], 0
    for p in like:
        k = p.numel()
        out.append(flat[offset:offset + k].reshape(p.shape))
        offset += k
    return out


def _send_quietly(sock: socket.socket, kind: int, step: int, payload: bytes) -> None:
    """Send a frame; a replica gone after delivering counted for this step, not the next."""
    try:
        send_frame(sock, kind, step, 0, payload)
    except OSError:
        pass


class LostReplica(ConnectionError):
    """The runner says the replica is lost (its lease ran out, or a heal brought its end)."""


def recv_watching(sock: socket.socket, delay_s: float,
                  lost: Any) -> tuple[int, int, int, bytes]:
    """:func:`~testbed.baselines.stage_proc.recv_frame`, reading ``lost()`` every
    :data:`WATCH_S` while the bytes do not come: a cut-off replica sends nothing, and the PS
    learns it is lost only from the runner (:class:`LostReplica`)."""
    def exact(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = sock.recv(min(n - len(buf), 1 << 20))
            except socket.timeout:
                if lost():
                    raise LostReplica("heard lost") from None
                continue
            if not chunk:
                raise ConnectionError("peer closed the connection")
            buf += chunk
        return bytes(buf)
    sock.settimeout(WATCH_S)
    try:
        kind, step, micro, n, sent = HEADER.unpack(exact(HEADER.size))
        payload = exact(n)
    finally:
        sock.settimeout(None)
    wait = sent + delay_s - time.time()
    if wait > 0:
        hold_until(time.monotonic() + wait)
    return kind, step, micro, payload


def run_ps(plan: dict[str, Any]) -> dict[str, Any]:
    """Gather the replicas for plan['steps'] steps (churn: the ones that deliver); return the
    losses and, per step, which replicas took part."""
    import numpy as np
    import torch

    from testbed.baselines.cost import DTYPE_BYTES, model_params
    from testbed.baselines.engine import (
        DILOCO_OUTER_LR,
        DILOCO_OUTER_MOMENTUM,
        _reference_model,
    )
    from testbed.ps_backend.engine.optim import SGD
    from testbed.ps_backend.engine.trainer import adamw
    from testbed.topology import load_topology

    torch.set_num_threads(1)
    topo = load_topology(plan["topology"])
    job = topo.job
    npdtype = np.float64 if plan["dtype"] == "float64" else np.float32
    H = int(plan.get("local_steps", 1))
    keep_state = bool(plan.get("keep_state", False))
    rows = [b - a for a, b in plan["rows"]]
    batch = sum(rows)
    initial = set(plan.get("initial", range(len(rows))))
    model = _reference_model(job, topo.seed) if keep_state or H > 1 else None
    params = [p for _, p in model.named_parameters()] if model is not None else []
    opt = adamw(params, job) if keep_state and H == 1 else None
    outer = (SGD(params, lr=DILOCO_OUTER_LR, momentum=DILOCO_OUTER_MOMENTUM, nesterov=True)
             if H > 1 else None)
    listener = socket.create_server((plan["ps_ip"], PORT), backlog=len(rows) + 8)
    receive_whole_frames(listener, 2 * model_params(job.model) * DTYPE_BYTES[job.dtype])
    lock = threading.Lock()
    pending: list[tuple[int, socket.socket]] = []

    def hello(conn: socket.socket) -> tuple[int, socket.socket]:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _, _, _, msg = recv_frame(conn, 0.0)
        return struct.unpack("!I", msg)[0], conn

    members: dict[int, socket.socket] = {}  # connected replicas taking part
    lost_dir = Path(plan["lost_dir"]) if plan.get("lost_dir") else None
    heard_lost: dict[int, int] = {}  # replica -> the runner's count of its losses, as read

    def newly_lost(r: int) -> bool:
        """Whether the runner has said replica r is lost since the PS last read it."""
        if lost_dir is None:
            return False
        n = read_lost(lost_dir, r)
        if n > heard_lost.get(r, 0):
            heard_lost[r] = n
            return True
        return False
    while len(members) < len(initial):
        r, conn = hello(listener.accept()[0])
        members[r] = conn
    if plan.get("ready"):
        Path(plan["ready"]).write_text("ready")
    if plan.get("start"):  # under churn: the runner's standbys are warm, its clock starts now
        while not Path(plan["start"]).exists():
            time.sleep(0.01)

    def accept_joiners() -> None:
        while True:
            try:
                conn, _ = listener.accept()
                joined = hello(conn)
            except OSError:
                return  # the listener closed: the run is over
            with lock:
                pending.append(joined)
    threading.Thread(target=accept_joiners, daemon=True).start()
    delays = plan["delay_s"]
    losses: list[float] = []
    took_part: list[list[int]] = []
    step_s: list[float] = []
    received = sent_total = state_bytes = 0
    deadline = time.monotonic() + float(plan.get("timeout_s", 600.0))
    # who takes part in each step: the rule the engine and the simulator follow
    membership = ReplicaMembership(len(rows), H, initial)
    waiting: dict[int, socket.socket] = {}  # connected again, to be taken in at a round start

    def drop(r: int) -> None:
        membership.drop(r)
        sock = members.pop(r, None)
        if sock is not None:
            sock.close()
    t_prev = time.monotonic()
    for step in range(plan["steps"]):
        while True:
            with lock:
                joiners, pending[:] = list(pending), []
            # the runner's word on losses, read after the joiners: a loss it wrote before
            # a replica's new process connected is the old connection's
            for r in range(len(rows)):
                if newly_lost(r):
                    drop(r)
            for r, conn in joiners:  # a replica's process started again
                drop(r)
                old = waiting.pop(r, None)
                if old is not None:
                    old.close()
                waiting[r] = conn
            live, joining = membership.begin(step, [*members, *waiting])
            for r in joining:  # first the state the others hold (membership.py)
                conn = waiting.pop(r)
                moments: list[Any] = []
                if H == 1 and opt is not None and step > 0:
                    states = [opt.state[p] for p in params]
                    moments = ([s["exp_avg"] for s in states]
                               + [s["exp_avg_sq"] for s in states])
                payload = _flat([*params, *moments]) if params else b""
                try:
                    send_frame(conn, STATE, step, 1 if moments else 0, payload)
                except OSError:
                    conn.close()
                    membership.drop(r)
                    continue
                state_bytes += len(payload)
                members[r] = conn
            if any(r in members for r in live):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"PS: no replica present at step {step}")
            time.sleep(0.02)  # every replica is gone: wait for one to join
        sync = membership.round_ends(step)
        grads: dict[int, Any] = {}
        ce: dict[int, float] = {}
        for r in sorted(members):  # replica order: the in-process trainer's summation order
            def lost(r: int = r) -> bool:
                return newly_lost(r)
            try:
                kind, st, _, payload = recv_watching(members[r], delays[r], lost)
                if (kind, st) != (LOSS, step):
                    raise RuntimeError(f"PS: expected replica {r}'s loss of step {step}")
                ce[r] = struct.unpack("!d", payload)[0]
                if sync:
                    kind, st, _, payload = recv_watching(members[r], delays[r], lost)
                    if (kind, st) != (GRADS if H == 1 else PARAMS, step):
                        raise RuntimeError(f"PS: expected replica {r}'s frame of step {step}")
                    grads[r] = np.frombuffer(payload, dtype=npdtype)
                    received += len(payload)
            except (ConnectionError, OSError):  # its process is gone: dropped from this step
                ce.pop(r, None)
                grads.pop(r, None)
                drop(r)
        here = sorted(ce)
        if not here:
            raise RuntimeError(f"PS: every replica was lost during step {step}")
        weights = row_weights(rows, here)
        rows_here = sum(rows[r] for r in here)
        losses.append(sum(ce[r] * weights[r] for r in here))
        took_part.append(here)
        out = b""
        if H == 1:
            total = grads[here[0]]
            for r in here[1:]:
                total = total + grads[r]
            if rows_here != batch:  # the replicas sent rows/batch-weighted gradients
                total = total * (batch / rows_here)
            out = total.tobytes()
            if opt is not None:  # the PS's copy takes the same AdamW step as every replica
                for p, g in zip(params, _unflat(out, params, npdtype)):
                    p.grad = g.clone()
                opt.step()
        elif sync:
            assert outer is not None
            outer.zero_grad(set_to_none=True)
            reps = [_unflat(grads[r].tobytes(), params, npdtype) for r in here]
            with torch.no_grad():
                for i, p in enumerate(params):  # as DataParallelTrainer._outer_step
                    delta = torch.zeros_like(p)
                    for rep in reps:
                        delta += p - rep[i]
                    p.grad = delta / len(reps)
            outer.step()
            out = _flat(params)
        if out:
            kind_back = GRADS if H == 1 else PARAMS
            senders = [threading.Thread(target=_send_quietly,
                                        args=(members[r], kind_back, step, out))
                       for r in here if r in members]
            for t in senders:
                t.start()
            lost_now: list[int] = []
            while any(t.is_alive() for t in senders):  # one cut off blocks its sender
                for t in senders:
                    t.join(WATCH_S)
                for r in [r for r in here if r in members and r not in lost_now]:
                    if newly_lost(r):  # its sender is woken, the send fails quietly
                        lost_now.append(r)
                        try:
                            members[r].shutdown(socket.SHUT_RDWR)
                        except OSError:  # its connection broke already (a reset)
                            pass
            for r in lost_now:  # it took part in this step: out from the next
                drop(r)
            sent_total += len(out) * len(senders)
        now = time.monotonic()
        step_s.append(now - t_prev)
        t_prev = now
        if plan.get("progress"):  # the runner reads it as it goes (its step lines)
            with Path(plan["progress"]).open("a") as fh:
                fh.write(json.dumps({"step": step, "loss": losses[-1], "took_part": here,
                                     "step_s": step_s[-1]}) + "\n")
    listener.close()
    with lock:  # replicas back too late to be taken in: the run is over
        late = [conn for _, conn in pending]
    for sock in [*members.values(), *waiting.values(), *late]:
        sock.close()
    return {"role": "ps", "losses": losses, "took_part": took_part, "step_s": step_s,
            "received_bytes": received, "sent_bytes": sent_total, "state_bytes": state_bytes}


def run_replica(plan: dict[str, Any], r: int, out: Path | None = None,
                join: bool = False, go: Path | None = None) -> dict[str, Any]:
    """Train as replica r (``join``: a process started again, which first takes the state from
    the PS; ``go``: a standby that connects once that file exists, so the churn trace's join
    time is not this host's Python start-up); return what it sent and its device time (also
    written to ``out`` every step, so a killed replica's work is still counted)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from testbed.baselines import cost
    from testbed.baselines.engine import _reference_model
    from testbed.ps_backend.engine.data import BatchSampler, load_corpus
    from testbed.ps_backend.engine.trainer import adamw
    from testbed.topology import load_topology

    torch.set_num_threads(1)
    topo = load_topology(plan["topology"])
    job, spec = topo.job, topo.job.model
    H = int(plan.get("local_steps", 1))
    model = _reference_model(job, topo.seed)
    params = [p for _, p in model.named_parameters()]
    opt = adamw(params, job)
    npdtype = np.float64 if job.dtype == "float64" else np.float32
    b = cost.DTYPE_BYTES[job.dtype]
    lo, hi = plan["rows"][r]
    share = (hi - lo) / job.batch_size
    device = HeldDevice(topo, plan["devices"][r], float(plan.get("dilation", 1.0)),
                        ledger_path(out) if out is not None else None,
                        _control(plan, plan["devices"][r]), plan.get("clock_origin"))
    sampler = BatchSampler(load_corpus(job.data), job.batch_size, spec.seq_len, topo.seed)
    if go is not None:  # a standby: warm (model built), waiting for its device to be back
        go.with_suffix(".warm").write_text("warm")
        while not go.exists():
            time.sleep(0.01)
        # the go file lists the device's earlier processes' ledgers: go on from them
        device.resume([Path(p) for p in json.loads(go.read_text())])
    ps = _connect(plan["ps_ip"], PORT)
    # killed (its device crashed or left), the kernel must not go on sending what the process
    # had queued: a reset, so the PS sees the replica gone instead of its buffered gradient
    ps.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    send_frame(ps, HELLO, 0, 0, struct.pack("!I", r))
    first_step, received = 0, 0
    if join:  # a replica back: the PS's parameters and AdamW moments, and where to go on
        try:
            kind, first_step, has_moments, payload = recv_frame(ps, plan["delay_s"][r])
        except (ConnectionError, OSError):  # the run ended before it was taken in
            return {"role": "replica", "replica": r, "device": plan["devices"][r],
                    "first_step": int(plan["steps"]), "sent_bytes": 0, "received_bytes": 0,
                    "device_s": 0.0, "energy_j": 0.0, "step_s": [], "lag_p95_s": 0.0,
                    "lag_max_s": 0.0, "lag_total_s": 0.0}
        if kind != STATE:
            raise RuntimeError(f"replica {r}: expected the state from the PS")
        received += len(payload)
        like = params + (params + params if has_moments else [])
        parts = _unflat(payload, like, npdtype)
        with torch.no_grad():
            for p, v in zip(params, parts):
                p.copy_(v)
        if has_moments:
            n = len(params)
            sd = opt.state_dict()
            sd["state"] = {i: {"step": torch.tensor(float(first_step)),
                               "exp_avg": parts[n + i].clone(),
                               "exp_avg_sq": parts[2 * n + i].clone()} for i in range(n)}
            opt.load_state_dict(sd)
    while not join and plan.get("start") and not Path(plan["start"]).exists():
        time.sleep(0.01)  # under churn: step 0 starts with the runner's clock, as the PS's
    rows = hi - lo
    gemms, mem = cost.replica_step_work(spec, rows, b)
    n_params = sum(p.numel() for p in params)
    sent = 0
    step_s: list[float] = []

    def report() -> dict[str, Any]:
        return {"role": "replica", "replica": r, "device": plan["devices"][r],
                "first_step": first_step, "sent_bytes": sent, "received_bytes": received,
                "device_s": device.device_s, "energy_j": device.energy_j, "step_s": step_s,
                **device.lag_stats()}
    for step in range(first_step, plan["steps"]):
        t_step = time.monotonic()
        inputs, targets = sampler.batch(step)
        opt.zero_grad(set_to_none=True)
        with device.piece(gemms, mem):
            logits = model(inputs[lo:hi])
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                 targets[lo:hi].reshape(-1))
            (ce * share if H == 1 else ce).backward()
        send_frame(ps, LOSS, step, 0, struct.pack("!d", float(ce.detach())))
        sent += 8
        if H == 1:
            payload = _flat(p.grad for p in params)  # type: ignore[misc]
            send_frame(ps, GRADS, step, 0, payload)
            sent += len(payload)
            kind, st, _, back = recv_frame(ps, plan["delay_s"][r])
            if (kind, st) != (GRADS, step):
                raise RuntimeError(f"replica {r}: expected the summed gradient of step {step}")
            received += len(back)
            for p, g in zip(params, _unflat(back, params, npdtype)):
                p.grad = g.clone()
        with device.piece([], cost.optimizer_bytes(n_params, b)):
            opt.step()
        if H > 1 and (step + 1) % H == 0:  # DiLoCo: the round's parameters up, θ_global back
            payload = _flat(params)
            send_frame(ps, PARAMS, step, 0, payload)
            sent += len(payload)
            kind, st, _, back = recv_frame(ps, plan["delay_s"][r])
            if (kind, st) != (PARAMS, step):
                raise RuntimeError(f"replica {r}: expected θ_global after step {step}")
            received += len(back)
            with torch.no_grad():
                for p, v in zip(params, _unflat(back, params, npdtype)):
                    p.copy_(v)
        step_s.append(time.monotonic() - t_step)
        if out is not None:
            out.write_text(json.dumps(report()))
    ps.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 0, 0))
    ps.shutdown(socket.SHUT_WR)  # a normal end: what is queued still reaches the PS
    ps.close()
    return report()


def main(argv: list[str] | None = None) -> int:
    """Run the PS or one replica; write its report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True)
    p.add_argument("--role", choices=("ps", "replica"), required=True)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--join", action="store_true",
                   help="a replica started again: take the state from the PS first")
    p.add_argument("--go", help="a standby: wait for this file before connecting")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    plan: dict[str, Any] = json.loads(Path(args.plan).read_text())
    report = (run_ps(plan) if args.role == "ps"
              else run_replica(plan, args.replica, Path(args.out), args.join,
                               Path(args.go) if args.go else None))
    Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
