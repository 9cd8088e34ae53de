"""Synchronous data-parallel training as real processes: replicas on device nodes, the PS
averaging their gradients on its node (emulated data-parallel, ``local_steps: 1``).

``python -m testbed.baselines.replica_proc --plan PLAN.json --role ps|replica [--replica R]
--out REPORT.json``

Each replica builds the job's model as the single-process trainer does (same seed), trains on
its rows of every batch (read from the corpus itself, as the pipeline's stages do), holds the
forward and backward for its device model's time (x dilation), sends its gradient weighted by
its share of the rows to the PS (one frame: every parameter's gradient in ``named_parameters``
order, raw bytes), receives the sum, and runs AdamW (held for its modelled time). The PS sums
the replicas' gradients in replica order (as :class:`~testbed.baselines.engine.
DataParallelTrainer` does, so the result is the in-process one bit for bit), sends the sum
back, and adds up the replicas' weighted losses: the step's loss. Frames as
:mod:`testbed.baselines.stage_proc` (kinds: 4 gradient, 5 loss, 9 hello).
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

from testbed.baselines.stage_proc import HELLO, PORT, _connect, recv_frame, send_frame

GRADS, LOSS = 4, 5


def run_ps(plan: dict[str, Any]) -> dict[str, Any]:
    """Average the replicas' gradients for plan['steps'] steps; return the losses."""
    import numpy as np

    npdtype = np.float64 if plan["dtype"] == "float64" else np.float32
    n = len(plan["devices"])
    listener = socket.create_server((plan["ps_ip"], PORT), backlog=n + 4)
    peers: dict[int, socket.socket] = {}
    while len(peers) < n:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _, _, _, hello = recv_frame(conn, 0.0)
        peers[struct.unpack("!I", hello)[0]] = conn
    delays = plan["delay_s"]
    losses: list[float] = []
    received = 0
    for step in range(plan["steps"]):
        grads: list[np.ndarray] = []
        loss = 0.0
        for r in range(n):  # replica order: the in-process trainer's summation order
            kind, st, _, payload = recv_frame(peers[r], delays[r])
            if (kind, st) != (GRADS, step):
                raise RuntimeError(f"PS: expected replica {r}'s gradient of step {step}")
            grads.append(np.frombuffer(payload, dtype=npdtype))
            received += len(payload)
            kind, st, _, payload = recv_frame(peers[r], delays[r])
            loss += struct.unpack("!d", payload)[0]
        total = grads[0]
        for g in grads[1:]:
            total = total + g
        out = total.tobytes()
        senders = [threading.Thread(target=send_frame, args=(peers[r], GRADS, step, 0, out))
                   for r in range(n)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        losses.append(loss)
    for sock in peers.values():
        sock.close()
    listener.close()
    return {"role": "ps", "losses": losses, "received_bytes": received,
            "sent_bytes": len(out) * n * plan["steps"] if plan["steps"] else 0}


def run_replica(plan: dict[str, Any], r: int) -> dict[str, Any]:
    """Train as replica r; return what it sent and its device time."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from testbed.baselines import cost
    from testbed.baselines.engine import _adamw, _reference_model
    from testbed.emulator.device_model import device_model_for
    from testbed.perf_model.profiles import load_profile
    from testbed.ps_backend.engine.data import BatchSampler, load_corpus
    from testbed.topology import load_topology

    torch.set_num_threads(1)
    topo = load_topology(plan["topology"])
    job, spec = topo.job, topo.job.model
    model = _reference_model(job, topo.seed)
    opt = _adamw(list(model.parameters()), job)
    params = [p for _, p in model.named_parameters()]
    npdtype = np.float64 if job.dtype == "float64" else np.float32
    b = cost.DTYPE_BYTES[job.dtype]
    lo, hi = plan["rows"][r]
    share = (hi - lo) / job.batch_size
    me = next(d for d in topo.devices if d.name == plan["devices"][r])
    profile = load_profile(str(me.group.profile_path), check=False)
    device = device_model_for(profile, seed=topo.seed * 1000 + me.index)
    bandwidth = profile.model.bandwidth_bytes_s if profile.model is not None else 10e9
    dilation = float(plan.get("dilation", 1.0))
    sampler = BatchSampler(load_corpus(job.data), job.batch_size, spec.seq_len, topo.seed)
    ps = _connect(plan["ps_ip"], PORT)
    send_frame(ps, HELLO, 0, 0, struct.pack("!I", r))
    rows = hi - lo
    lf, lb = cost.layer_gemms(spec, rows)
    hf, hb = cost.head_gemms(spec, rows)
    ef, eb = cost.layer_elementwise_bytes(spec, rows, b)
    hef, heb = cost.head_elementwise_bytes(spec, rows, b)
    gemms = lf * spec.layers + hf + hb + lb * spec.layers
    mem = spec.layers * (ef + eb) + hef + heb
    n_params = sum(p.numel() for p in params)
    now_s = [0.0]
    energy_j = [0.0]  # compute energy: the device model's joules, memory-bound work at busy power
    busy_w = profile.power.busy_w(1.0) if profile.power is not None else 0.0
    lag_s: list[float] = []

    def hold(started: float, work: list[cost.Gemm], nbytes: float) -> None:
        costs = [device.tile_cost(g.m, g.k, g.n, g.op, now_s[0]) for g in work]
        mem_s = nbytes / bandwidth
        seconds = sum(c.seconds for c in costs) + mem_s
        energy_j[0] += sum(c.joules for c in costs) + busy_w * mem_s
        now_s[0] += seconds
        wait = started + seconds * dilation - time.monotonic()
        lag_s.append(max(0.0, -wait))
        if wait > 0:
            time.sleep(wait)

    sent = 0
    step_s: list[float] = []
    for step in range(plan["steps"]):
        t_step = time.monotonic()
        inputs, targets = sampler.batch(step)
        opt.zero_grad(set_to_none=True)
        t0 = time.monotonic()
        logits = model(inputs[lo:hi])
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[lo:hi].reshape(-1))
        (ce * share).backward()
        hold(t0, gemms, mem)
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        payload = flat.detach().numpy().tobytes()
        send_frame(ps, GRADS, step, 0, payload)
        send_frame(ps, LOSS, step, 0, struct.pack("!d", float(ce.detach()) * share))
        sent += len(payload) + 8
        kind, st, _, back = recv_frame(ps, plan["delay_s"][r])
        if (kind, st) != (GRADS, step):
            raise RuntimeError(f"replica {r}: expected the summed gradient of step {step}")
        total = torch.from_numpy(np.frombuffer(back, dtype=npdtype).copy())
        offset = 0
        for p in params:
            k = p.numel()
            p.grad = total[offset:offset + k].reshape(p.shape).clone()
            offset += k
        t0 = time.monotonic()
        opt.step()
        hold(t0, [], cost.optimizer_bytes(n_params, b))
        step_s.append(time.monotonic() - t_step)
    ps.close()
    lag = sorted(lag_s)
    return {"role": "replica", "replica": r, "device": plan["devices"][r], "sent_bytes": sent,
            "device_s": now_s[0], "energy_j": energy_j[0], "step_s": step_s,
            "lag_p95_s": lag[int(0.95 * (len(lag) - 1))] if lag else 0.0}


def main(argv: list[str] | None = None) -> int:
    """Run the PS or one replica; write its report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True)
    p.add_argument("--role", choices=("ps", "replica"), required=True)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    plan: dict[str, Any] = json.loads(Path(args.plan).read_text())
    report = run_ps(plan) if args.role == "ps" else run_replica(plan, args.replica)
    Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
