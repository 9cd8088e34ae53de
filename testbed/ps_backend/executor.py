"""The seam between the training engine and whoever computes its GEMMs.

Every offloaded linear layer asks an executor for ``C = A @ B`` three times a step (forward,
input gradient, weight gradient). The engine never knows whether the product is computed in this
process (:class:`LocalExecutor`, used by the single-process reference run and by tests) or cut into
tiles that devices compute (:class:`TileExecutor`: it hands each GEMM to the server host's loop
thread, where :class:`~testbed.ps_backend.core.PsCore` queues its tiles).

``submit`` returns at once with a handle, so that the backward pass can have the input-gradient
and the weight-gradient GEMMs of one layer in flight together; ``result()`` blocks.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch

from testbed.ps_backend.ledger import stored_digest, stored_operand
from testbed.ps_backend.scheduler import GemmJob, GemmSpec
from testbed.ps_backend.tiler import gemm_flops
from testbed.ps_backend.watchdog import WatchdogError

if TYPE_CHECKING:
    from testbed.ps_backend.core import PsCore
    from testbed.ps_backend.host import PsServer

class GemmHandle(Protocol):
    def result(self) -> torch.Tensor:
        """Block until C is complete; return it with A's dtype."""
        ...


class GemmExecutor(Protocol):
    def submit(self, a: torch.Tensor, b: torch.Tensor, spec: GemmSpec) -> GemmHandle:
        """Start computing C = A @ B (A: M x K, B: K x N, both 2-D, same dtype)."""
        ...


@dataclass
class DoneHandle:
    """A handle whose result is already there."""

    value: torch.Tensor

    def result(self) -> torch.Tensor:
        return self.value


class LocalExecutor:
    """Computes every GEMM in this process with torch (the single-process reference)."""

    def __init__(self) -> None:
        self.calls: list[GemmSpec] = []  # what was asked, in order (tests read it)

    def submit(self, a: torch.Tensor, b: torch.Tensor, spec: GemmSpec) -> GemmHandle:
        self.calls.append(spec)
        return DoneHandle(a @ b)


class DivergedError(RuntimeError):
    """The model's tensors are no longer finite (for example ``lr: .inf``)."""


class TileHandle:
    """A GEMM in flight on devices; result() blocks until every tile is placed."""

    def __init__(self, job: GemmJob, interrupted: threading.Event,
                 core: "PsCore | None" = None):
        self.job = job
        self.interrupted = interrupted
        self.core = core

    def result(self) -> torch.Tensor:
        while True:
            if self.interrupted.is_set():
                raise InterruptedError("the run was stopped")
            if self.core is not None and self.core.watchdog_reason is not None:
                raise WatchdogError(self.core.watchdog_reason)
            try:
                c = self.job.done.result(timeout=0.2)
                return torch.from_numpy(c)
            except TimeoutError:
                continue


class _Operand(NamedTuple):
    """What :class:`OperandKeys` keeps of one tensor of the step."""

    root: weakref.ref[torch.Tensor]  # the tensor (a view's base): its address is reused once freed
    key: str
    array: weakref.ref[np.ndarray]  # the PS's array of it, as stored
    copied: bool  # the array is a copy, not the tensor's memory


class OperandKeys:
    """Cache keys and the PS's arrays of GEMM operands by tensor identity within a step.

    Two GEMMs whose operand is the same tensor (X in forward and in the weight gradient) get the
    same key, so a block a device received for one is a cache hit for the other, and they share
    the PS's array (a weight's copy, an activation's own memory: :meth:`get`). So do the two
    orientations of one tensor: a transposed view (``Wᵀ`` in forward, ``dYᵀ`` in the weight
    gradient) is keyed as the stored tensor it views, with a flag, and its blocks are named, sent
    and cached as stored; the device uses them transposed
    (:func:`testbed.wire.tensors.operand_array`). A tensor is identified by its storage address,
    offset, shape and strides (after undoing a transpose) and its version counter (an in-place
    change makes a new key). An address is reused only after its tensor is
    freed, so the key stays only while a weak reference to the tensor's root (the base of a
    view) is alive; a freed root's address gets a fresh key. Keys end with the step (the
    weights' version), and the table is emptied when the step changes.

    Each fresh array is checked for finiteness once (shared ones are not checked again): a
    non-finite operand raises :class:`DivergedError`, since every honest device's result would
    be refused for the PS's own divergence and the GEMM would never finish.
    """

    def __init__(self) -> None:
        self._keys: dict[tuple[Any, ...], _Operand] = {}
        self._serial = itertools.count()
        self._step = -1

    def get(self, t: torch.Tensor, step: int, own_copy: bool = True
            ) -> tuple[str, bool, np.ndarray]:
        """(key, transposed, the PS's array of it in the operand's orientation) of an operand of
        a GEMM of this step; ``transposed``: the key names the tensor ``t`` is a transpose of.

        ``own_copy``: the array is a copy (a weight: the optimizer steps it in place once the
        step's GEMMs are done, and late copies of tiles are still checked against it); without
        it the array shares the tensor's memory and keeps it alive (an activation, which the
        engine never changes in place: copying them cost 5.9 s of a hotcarbon step's 29 s of
        the PS's own work, `py-spy` of the PS)."""
        if step != self._step:
            self._keys.clear()
            self._step = step
        root = t._base if t._base is not None else t
        transposed = t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous()
        stored = t.t() if transposed else t
        ident = (stored.data_ptr(), stored.storage_offset(), tuple(stored.shape),
                 stored.stride(), stored.dtype, stored._version)
        entry = self._keys.get(ident)
        if entry is not None and entry.root() is root:
            copy = entry.array()
            if copy is not None and (entry.copied or not own_copy):
                return entry.key, transposed, copy.T if transposed else copy
            key = entry.key
        else:
            key = f"t{next(self._serial)}@{step}"
        array = stored.detach().numpy()
        own_copy = own_copy or not array.flags.c_contiguous  # as stored, in C order
        copy = np.array(array, order="C", copy=True) if own_copy else array
        # one pass and no temporary (an isfinite mask is a new array a quarter of the operand's
        # size, on the step's critical path): NaN comes out of both ends, ±Inf out of its own
        lo, hi = torch.aminmax(stored.detach()) if stored.numel() else (0.0, 0.0)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise DivergedError(f"an operand of a step-{step} GEMM ({tuple(t.shape)}) has "
                                f"non-finite values (NaN or Inf): the model diverged (check "
                                f"job.optimizer.lr)")
        self._keys[ident] = _Operand(weakref.ref(root), key, weakref.ref(copy), own_copy)
        return key, transposed, copy.T if transposed else copy


class TileExecutor:
    """The executor the engine uses in a real run: big GEMMs become tiles, small ones stay here."""

    def __init__(self, server: "PsServer", interrupted: threading.Event | None = None):
        self.server = server
        self.config = server.config
        self._uids = itertools.count()
        self.interrupted = interrupted or threading.Event()
        self.local_gemms = 0
        self.offloaded_gemms = 0
        self._step = -1  # GEMM uids count from 0 in every step, so a restart names them alike
        self._operands = OperandKeys()
        self._digests: dict[str, str] = {}  # operand key -> its stored tensor's digest, this step

    def submit(self, a: torch.Tensor, b: torch.Tensor, spec: GemmSpec) -> GemmHandle:
        m, k = a.shape
        n = b.shape[1]
        if spec.step != self._step:
            self._step, self._uids = spec.step, itertools.count()
            self._digests.clear()
        seq = next(self._uids)
        if gemm_flops(m, k, n) < self.config.min_offload_flops:
            self.local_gemms += 1
            return DoneHandle(a @ b)
        self.offloaded_gemms += 1
        # A is an activation in every GEMM of a linear (X, dY, dYᵀ); B is a weight when the
        # spec names one (Wᵀ, W) and an activation otherwise (X of the weight gradient)
        a_key, a_transposed, a_np = self._operands.get(a, spec.step, own_copy=False)
        b_ident_key, b_transposed, b_np = self._operands.get(b, spec.step,
                                                             own_copy=spec.b_key is not None)
        uid = f"s{spec.step}/{spec.layer}/{spec.op}#{seq}"
        job = GemmJob(uid=uid, spec=spec, a=a_np, b=b_np,
                      c=np.empty((m, n), dtype=a_np.dtype), version=spec.step,
                      a_key=a_key, b_key=spec.b_key or b_ident_key, a_transposed=a_transposed,
                      b_transposed=b_transposed, done=Future(),
                      digest=self._digest((a_key, a_np), (b_ident_key, b_np))
                      if self.server.ledger is not None else "")
        core = self.server.core
        assert core is not None
        self.server.loop.call_soon_threadsafe(core.submit, job)
        return TileHandle(job, self.interrupted, core)

    def _digest(self, *operands: tuple[str, np.ndarray]) -> str:
        """:func:`~testbed.ps_backend.ledger.gemm_digest` of operands named by their keys, each
        operand's digest taken once a step (the key, not the address: a freed tensor's storage is
        reused within a step, see OperandKeys)."""
        parts = []
        for key, x in operands:
            stored, flag = stored_operand(x)
            digest = self._digests.get(key)
            if digest is None:
                digest = self._digests[key] = stored_digest(stored)
            parts.append(digest + flag)
        return "".join(parts)
