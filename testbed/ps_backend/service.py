"""The gRPC service: a thin adapter between the protocol and the core (:class:`PsCore`).

Each message is converted at this edge: a Join's descriptor becomes a
:class:`~testbed.ps_backend.core.Descriptor`, a result a
:class:`~testbed.ps_backend.core.ResultIn` (its tensor decoded here), and what the core queues
for a device (:class:`~testbed.ps_backend.core.Outgoing`) becomes a ``ServerMessage`` (operand
blocks encoded here). Everything else - admission, registry, scheduling, accounting - is the
core's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import grpc
import numpy as np

from testbed.ps_backend.admission import JOINS_PER_S_PER_PEER
from testbed.ps_backend.core import (
    STREAM_CLOSED,
    Descriptor,
    DeviceConn,
    OperandOut,
    Outgoing,
    PsCore,
    ResultIn,
)
from testbed.wire import MAX_IN_FLIGHT
from testbed.wire import testbed_pb2 as pb
from testbed.wire import testbed_pb2_grpc as pb_grpc
from testbed.wire.tensors import TensorError, from_tensor, to_tensor

# A device holds at most MAX_IN_FLIGHT tiles, and the copies the PS cancelled on it (whose results
# still come back), so an honest message carries fewer results than this. A token holder's
# 200,000 results for tasks never sent (1.6 MB, far under max_message_bytes) kept the PS busy
# long enough for an honest device's 5 s lease to expire (a one-off fuzzing script): such a
# message ends the stream.
MAX_RESULTS_PER_MESSAGE = 4 * MAX_IN_FLIGHT


class ProtocolViolation(Exception):
    """A message no honest device sends: its stream ends (a departure: its tiles re-queued)."""


log = logging.getLogger(__name__)


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string ("ipv4:127.0.0.1:5555" -> "ipv4:127.0.0.1")."""
    if peer.startswith("ipv6:["):
        return peer.split("]", 1)[0] + "]"
    head, sep, _ = peer.rpartition(":")
    return head if sep and head else peer


# -- conversions at the edge -------------------------------------------------------------------
def descriptor_from_pb(d: pb.DeviceDescriptor) -> Descriptor:
    """A Join's descriptor as plain data."""
    return Descriptor(d.name, d.group, d.kind, d.profile, d.predicted_gflops, d.max_in_flight,
                      d.cache_bytes, d.platform, d.keeps_held, d.instance)


def result_from_pb(r: pb.TileResult) -> ResultIn:
    """A result as plain data; a tensor that does not decode leaves ``c`` None and says why."""
    c: np.ndarray | None = None
    problem = ""
    try:
        c = from_tensor(r.c)
    except TensorError as exc:
        problem = str(exc)
    return ResultIn(r.task_id, r.attempt, c, len(r.c.data), r.compute_s, r.energy_j, r.lag_s,
                    r.received_s, r.started_s, r.done_s, problem)


def _operand_to_pb(o: OperandOut, operand: pb.Operand) -> None:
    operand.version = o.version
    if o.parts:
        for part in o.parts:
            _operand_to_pb(part, operand.parts.add())
        return
    operand.key = o.key
    operand.transposed = o.transposed
    operand.held = o.held
    if o.block is not None:
        to_tensor(o.block, operand.tensor)


def message_to_pb(out: Outgoing) -> pb.ServerMessage:
    """What the core queued for a device, as the message that carries it."""
    message = pb.ServerMessage(time_dilation=out.time_dilation)
    for t in out.tiles:
        tile = message.tiles.add(task_id=t.task_id, attempt=t.attempt, step=t.step, gemm=t.gemm,
                                 op=t.op, row=t.row, col=t.col, m=t.m, k=t.k, n=t.n,
                                 deadline_s=t.deadline_s)
        _operand_to_pb(t.a, tile.a)
        _operand_to_pb(t.b, tile.b)
    if out.invalidate_before is not None:
        message.invalidate.before_version = out.invalidate_before
    if out.reject is not None:
        message.reject.task_id, message.reject.reason = out.reject
    if out.stop is not None:
        message.stop.reason = out.stop
    return message


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    """Thin adapter: gRPC in, PsCore calls, gRPC out."""

    def __init__(self, core: PsCore):
        self.core = core

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext
                   ) -> pb.JoinReply:
        core = self.core
        device = descriptor_from_pb(request.device)
        peer = peer_host(context.peer() or "")
        if not core.join_limiter.allow(peer):  # before the token: costs an attacker the most
            core.refusals.note("too many joins from this address", request.device.name, peer)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many joins from {peer}: at most "
                                f"{JOINS_PER_S_PER_PEER:g} per second; try again later")
        if not core.check_token(request.token):
            core.refusals.note("wrong token", request.device.name, peer)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "wrong join token for this run")
        problem = core.descriptor_problem(device)
        if problem is not None:
            core.refusals.note("bad descriptor: " + problem.split(" ", 1)[0],
                               request.device.name, peer)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if core.stopping:
            # not UNAVAILABLE, which a device retries: the run is over (its agent exits 0)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the run is ending")
        conn = core.join(device)
        cfg = self.core.config
        return pb.JoinReply(device_id=conn.device_id, session_key=conn.session_key,
                            lease_s=cfg.lease_s, heartbeat_s=cfg.heartbeat_s,
                            max_message_bytes=cfg.max_message_bytes,
                            time_dilation=cfg.time_dilation, run_name=cfg.run_name,
                            dtype=pb.FLOAT64 if cfg.dtype == np.float64 else pb.FLOAT32,
                            name=conn.slot.name)

    async def Work(self, request_iterator: AsyncIterator[pb.DeviceMessage],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ServerMessage]:
        try:
            first = await request_iterator.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("body") != "attach":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the first message on Work must be Attach")
        conn = self.core.attach(first.attach.device_id, first.attach.session_key)
        if conn is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "unknown device id, wrong session key, or already attached; "
                                "join again")
        assert conn is not None and conn.outbox is not None
        reader = asyncio.ensure_future(self._read(conn, request_iterator))
        try:
            while True:
                out = await conn.outbox.get()
                if out is None:
                    break
                yield message_to_pb(out)
        finally:
            reader.cancel()
            if conn.device_id in self.core.conns and not self.core.stopping:
                self.core.drop(conn.device_id, "disconnect", conn.end_reason)

    async def _read(self, conn: DeviceConn, requests: AsyncIterator[pb.DeviceMessage]) -> None:
        try:
            async for message in requests:
                self._on_message(conn, message)
            conn.end_reason = STREAM_CLOSED
        except asyncio.CancelledError:
            pass
        except ProtocolViolation as exc:
            conn.end_reason = f"protocol violation: {exc}"
            log.warning("stream of %s ended: %s", conn.slot.name, conn.end_reason)
        except Exception as exc:  # a broken or oversized stream ends here
            conn.end_reason = f"stream broken: {exc}"
            log.info("stream of %s ended: %s", conn.slot.name, exc)
        finally:
            if conn.outbox is not None:
                conn.outbox.put_nowait(None)

    def _on_message(self, conn: DeviceConn, msg: pb.DeviceMessage) -> None:
        """One message from an attached device, converted and handed to the core."""
        core = self.core
        body = msg.WhichOneof("body")
        if body == "result":
            core.on_results(conn, [result_from_pb(msg.result)])
        elif body == "results":
            if len(msg.results.results) > MAX_RESULTS_PER_MESSAGE:
                raise ProtocolViolation(f"{len(msg.results.results):,} results in one message; "
                                        f"a device holds at most {MAX_IN_FLIGHT} tiles")
            core.on_results(conn, [result_from_pb(r) for r in msg.results.results])
        elif body == "credit":
            core.on_credit(conn, msg.credit.tiles)
        elif body == "telemetry":
            core.on_telemetry(conn, msg.telemetry.values, msg.telemetry.labels)
        elif body == "attach":
            core.on_stray_attach(conn)
        else:  # a heartbeat, or a body this PS does not know: still a sign of life
            core.seen(conn)

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext
                    ) -> pb.LeaveReply:
        n = self.core.leave(request.device_id, request.session_key, request.reason)
        if n is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "unknown device or key")
        return pb.LeaveReply(requeued_tiles=n)
