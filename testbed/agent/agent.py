"""The device side of the protocol: join, pull tiles, compute, return.

Needs only grpcio and numpy (it runs on phones). Three threads:

* the main thread reads the PS's messages: it resolves each tile's operands against the local
  block cache at once (so the cache sees operations in the PS's order, see
  :mod:`testbed.wire.cache`), books the bytes on the emulated downlink, and queues the tile;
* a compute thread takes tiles in order, waits until their operands have "arrived", computes
  ``A @ B`` for real, and - on an emulated device - holds the result until the device model's time
  (x time dilation) has passed;
* gRPC's request thread sends what the outbox releases: results after the emulated uplink has
  carried them, heartbeats when nothing else went out for a while.

The PS decides everything about work; the agent only says how many tiles it wants outstanding.
On a broken stream it joins again with exponential backoff; on SIGTERM it leaves gracefully:
it says Leave (so the PS re-queues only its tiles in flight), then closes its channel, which
cuts short whatever call it is in, so a PS that no longer answers (its host froze, this
device's network went away) does not hold it.
SIGUSR1 partitions it (nothing in or out, as a pulled cable on loopback), SIGUSR2 heals it.
While partitioned, what would cross the cable waits (as TCP holds unacknowledged data) and goes
once healed; nothing is dropped: a dropped tile would stay "in flight" at the PS forever when
the partition is shorter than the lease. A SIGTERM while partitioned cannot reach the PS either:
the agent drops its work and stays silent until the PS's lease for it runs out (the PS ends the
stream) or the cut heals (it closes its channel then), as a device gone behind a down link.
SIGQUIT is a crash (the run's SIGKILL) that such a cut holds: at once when not partitioned; cut
off, the agent goes silent in the same way and kills itself (SIGKILL) when the cut heals or the
PS ends the stream, so the PS hears of it as it would of a device that died behind a down link.
An optional :class:`~testbed.agent.behaviour.Behaviour` makes it a straggler or byzantine.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import queue
import random
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, NoReturn

import grpc
import numpy as np

from testbed.agent.behaviour import Behaviour
from testbed.agent.hold import hold_until
from testbed.agent.link import MESSAGE_OVERHEAD_BYTES, LinkDirection
from testbed.agent.tls import CERT_NAME, PinError, parse_address, pinned_certificate
from testbed.emulator.dilation import DeviceClock
from testbed.errors import EXIT_OK
from testbed.wire import testbed_pb2 as pb
from testbed.wire import testbed_pb2_grpc as pb_grpc
from testbed.wire.cache import DEFAULT_CACHE_BYTES, BlockCache
from testbed.wire.tensors import operand_array, operand_nbytes, to_tensor

if TYPE_CHECKING:  # the agent runs on phones: nothing beyond grpcio and numpy at run time
    from testbed.emulator.device_model import DeviceModel

log = logging.getLogger("testbed.agent")

EXIT_REFUSED = 3  # the PS refused this device (a bad token, a version it does not speak)
# Results that are ready together go in one TileResults message: the PS's cost is mostly per
# message (bench/ps_throughput.py), so batching cuts its CPU per tile.
MAX_RESULTS_PER_MESSAGE = 64
# ...but a result waits for the next tile's only while that keeps it at most this much later
# than it could have left: tiny tiles travel together, a phone's 100 ms tile never waits
MAX_BATCH_DELAY_S = 0.002
RESULT_OVERHEAD_BYTES = 128  # a TileResult's fields besides the tensor bytes, generously


# An emulated device's hold ends at a deadline, woken on time: see testbed.agent.hold.
# After the hold it needs the GIL: a thread holding it (parsing the next tile, serialising a
# result) keeps it up to the switch interval (5 ms by default); 0.5 ms bounds that wait
GIL_SWITCH_S = 0.0005


class JoinRefused(Exception):
    """The PS refused the join (a wrong token), or the server is not a testbed PS: retrying
    will not help."""


@dataclass
class AgentOptions:
    ps_address: str
    token: str
    name: str
    instance: str = ""  # who the device is to the PS ("": this process, at random)
    group: str = ""
    kind: str = "emulated"  # emulated | real
    profile: str = ""
    predicted_gflops: float = 1.0
    max_in_flight: int = 2
    cache_bytes: int = DEFAULT_CACHE_BYTES
    down: LinkDirection = field(default_factory=LinkDirection)
    up: LinkDirection = field(default_factory=LinkDirection)
    backoff_s: tuple[float, float] = (0.2, 5.0)  # first and largest wait between re-joins
    telemetry_s: float = 2.0
    control_file: str = ""  # JSON {"slow": factor} written by the churn replay; polled
    behaviour: Behaviour | None = None  # emulated misbehaviour (byzantine, straggler)
    tls_fingerprint: str = ""  # the PS's certificate pin (testbed join); empty: plain channel
    progress_s: float = 0.0  # a line on the work done every this many seconds (0: none)


class Outbox:
    """Messages released at given times (the uplink's arrival times), in time order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, pb.DeviceMessage | None]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()

    def put(self, message: pb.DeviceMessage | None, at_s: float = 0.0) -> None:
        with self._cv:
            heapq.heappush(self._heap, (at_s, next(self._seq), message))
            self._cv.notify()

    def get(self, timeout_s: float) -> tuple[bool, pb.DeviceMessage | None]:
        """(True, message) when one is due within timeout_s, else (False, None)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                now = time.monotonic()
                if self._heap and self._heap[0][0] <= now:
                    return True, heapq.heappop(self._heap)[2]
                wait = deadline - now
                if self._heap:
                    wait = min(wait, self._heap[0][0] - now)
                if wait <= 0:
                    return False, None
                self._cv.wait(wait)

    def take_due_results(self, budget_bytes: int, most: int) -> list[pb.TileResult]:
        """Results already due at the head of the queue, in order, within a byte budget.

        Stops at the first message that is not a result (a heartbeat, the end), so the order of
        everything else is kept.
        """
        taken: list[pb.TileResult] = []
        now = time.monotonic()
        with self._cv:
            while self._heap and len(taken) < most:
                at_s, _, message = self._heap[0]
                body = message.WhichOneof("body") if message is not None else None
                if at_s > now or message is None or body not in ("result", "results"):
                    break
                results = [message.result] if body == "result" else list(message.results.results)
                size = sum(len(r.c.data) + RESULT_OVERHEAD_BYTES for r in results)
                if size > budget_bytes or len(taken) + len(results) > most:
                    break
                budget_bytes -= size
                heapq.heappop(self._heap)
                taken.extend(results)
        return taken


@dataclass
class PendingTile:
    tile: pb.Tile
    a: np.ndarray
    b: np.ndarray
    arrived_s: float  # when the operands are all on the device (emulated downlink)


def progress_line(name: str, done: int, recent: int, every_s: float, joined: bool) -> str:
    """What a device has done so far, for its periodic progress line."""
    line = f"{name}: {done} tile{'' if done == 1 else 's'} computed"
    if not joined:
        return line + "; not in the run at the moment (joining again)"
    if recent:
        return line + f", {recent} in the last {every_s:g} s"
    return line + (f", none in the last {every_s:g} s (the PS plans each GEMM with the devices "
                   f"that make it faster: a slow link or CPU can leave this one out, and the "
                   f"PS's own work between GEMMs takes time too)")


class Agent:
    """One device's protocol loop."""

    def __init__(self, options: AgentOptions, model: "DeviceModel | None" = None):
        self.options = options
        self.model = model  # None: a real device, no emulated timing
        if model is not None:  # bounds the GIL wait after a hold (see GIL_SWITCH_S)
            sys.setswitchinterval(GIL_SWITCH_S)
        self.stopping = threading.Event()
        self.partitioned = threading.Event()
        self.tiles_done = 0
        self._session: _Session | None = None
        self._clock = DeviceClock(time.monotonic())  # device time stays continuous when D changes
        self.slow_factor = 1.0  # compute time multiplier (churn `slow`)
        self._control_mtime = 0.0
        self.stopped_by = ""  # the signal that asked this agent to stop ("": none did)
        self.crashed = False  # asked to crash while cut off (SIGQUIT): it dies as it ends
        self.left_note = ""  # how it left, said in the one line it ends with
        self.joins = 0  # sessions the PS let in
        # the name the run knows this device by: the one asked for until the PS names it
        # (JoinReply.name; another device of the run may have asked the same), then that one
        self.name = options.name
        # a join again with the same name and instance takes the name back (PsCore._name_for)
        self.instance = options.instance or secrets.token_hex(8)

    def device_time_s(self, wall_s: float, dilation: float) -> float:
        """Device seconds since the agent started, for a monotonic wall time (D as set)."""
        return self._clock.device_s(wall_s)

    def set_dilation(self, dilation: float) -> None:
        """Follow the PS's D from now on: holds, link times and the device clock."""
        self._clock.set_dilation(dilation, time.monotonic())
        self.options.down.dilation = self.options.up.dilation = dilation

    def poll_control(self) -> None:
        """Pick up a new slow factor from the control file, if it changed."""
        path = self.options.control_file
        if not path:
            return
        try:
            mtime = os.stat(path).st_mtime
            if mtime == self._control_mtime:
                return
            self._control_mtime = mtime
            with open(path) as f:
                factor = float(json.load(f).get("slow", 1.0))
        except (OSError, ValueError, AttributeError):
            return
        if factor > 0:
            log.info("%s: compute slowed x%g", self.name, factor)
            self.slow_factor = factor

    # -- control from signal handlers ---------------------------------------------------------
    def request_stop(self, reason: str = "SIGTERM") -> None:
        """Leave gracefully and end run()."""
        self.stopped_by = self.stopped_by or reason
        self.stopping.set()
        session = self._session
        if session is not None:
            session.leave(reason)

    def request_crash(self) -> None:
        """Die as SIGKILL would (no Leave, no last line): at once, or, cut off, once the cut
        heals or the PS ends the session (until then silent: :meth:`_Session.go_silent`), as
        the cut holds a killed process's close. The run sends SIGQUIT for a trace's crash of an
        agent that blackholes itself (loopback), whose own SIGKILL no cut would hold."""
        self.crashed = True
        self.stopping.set()
        session = self._session
        if session is None or session.reply is None or not self.partitioned.is_set():
            _die()
        log.info("%s: crashed while cut off from the PS: silent, and dead when the cut heals "
                 "or the PS ends the session", self.name)
        session.go_silent()

    def set_partitioned(self, partitioned: bool) -> None:
        """Cut (True) or restore all traffic, as a pulled cable would."""
        if partitioned:
            self.partitioned.set()
        else:
            self.partitioned.clear()

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> int:
        """Join and work until the PS says stop or we are asked to; re-join on failures. An
        agent that crashed while cut off (:meth:`request_crash`) dies here once its session
        ended."""
        code = self._run()
        if self.crashed:
            _die()
        return code

    def _run(self) -> int:
        if self.options.progress_s > 0:
            threading.Thread(target=self._say_progress, args=(self.options.progress_s,),
                             name="progress", daemon=True).start()
        first, largest = self.options.backoff_s
        backoff = first
        while not self.stopping.is_set():
            while self.partitioned.is_set() and not self.stopping.is_set():
                time.sleep(0.05)
            try:
                session = _Session(self)
                self._session = session
                if self.stopping.is_set():
                    # the stop came while the session was being made: request_stop found no
                    # session to leave (and close), and the PS could hold its stream for ever
                    session.leave(self.stopped_by)
                    break
                reason = session.run()
                if reason == "stop":
                    return EXIT_OK
                backoff = first  # the session worked; the next failure starts small again
                if not self.stopping.is_set():
                    log.warning("%s: the PS ended this device's session (its lease ran out "
                                "while the device was silent, or the PS dropped it); joining "
                                "again in %.1f s", self.name, backoff)
            except Exception as exc:
                if self.stopping.is_set():
                    break  # our own stop cut a call short (request_stop): nothing to retry
                code = self._failed(exc, backoff)
                if code is not None:
                    return code
            finally:
                self._session = None
            if self.stopping.wait(backoff * random.uniform(0.8, 1.2)):
                break
            backoff = min(backoff * 2, largest)
        if self.stopped_by:
            log.info("%s: %s: %s", self.name, self.stopped_by, self.left_note or (
                "stopped while joining the run again" if self.joins else
                "stopped before joining the run"))
        return EXIT_OK

    def _say_progress(self, every_s: float) -> None:
        """A line every ``every_s`` on the work done, until the agent stops: a device that
        joined a run on another machine (``testbed join``) said nothing from its join to the
        run's end, however long that was."""
        before = self.tiles_done
        while not self.stopping.wait(every_s):
            done = self.tiles_done
            log.info("%s", progress_line(self.name, done, done - before, every_s,
                                         self._session is not None))
            before = done

    def _failed(self, exc: Exception, backoff_s: float) -> int | None:
        """Say why a session failed: the exit code when retrying will not help, else None (the
        agent joins again in backoff_s)."""
        name = self.name
        if isinstance(exc, JoinRefused):
            log.error("%s: join refused: %s", name, exc)
            return EXIT_REFUSED
        if isinstance(exc, PinError):
            log.error("%s: %s", name, exc)
            return EXIT_REFUSED
        if isinstance(exc, grpc.RpcError):
            log.warning("%s: %s: %s; joining again in %.1f s", name,
                        exc.code().name if hasattr(exc, "code") else "error",
                        exc.details() if hasattr(exc, "details") else exc, backoff_s)
        elif isinstance(exc, OSError):  # the TLS pin's own connection: the PS may not be up yet
            log.warning("%s: %s; joining again in %.1f s", name, exc, backoff_s)
        else:  # a protocol bug must not kill the device: start a fresh session
            log.error("%s: session failed; joining again in %.1f s", name, backoff_s,
                      exc_info=exc)
        return None


def _die() -> NoReturn:
    """End this process as a crash: SIGKILL, no cleanup, no last line."""
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(128 + signal.SIGKILL)  # not reached: the kernel ends us before


def _channel(options: AgentOptions, stopping: threading.Event) -> grpc.Channel:
    """The channel to the PS: plain on loopback and in emulated networks; TLS with the PS's
    pinned certificate when a fingerprint is given (a PS on another machine)."""
    settings = [
        ("grpc.max_receive_message_length", 1 << 30),
        ("grpc.max_send_message_length", 1 << 30),
        # the agent has its own backoff between sessions; gRPC's own reconnect backoff
        # (up to 120 s by default) made joins of hundreds of agents time out on a busy host
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000)]
    if not options.tls_fingerprint:
        return grpc.insecure_channel(options.ps_address, options=settings)
    cert = _pinned_unless_stopped(options, stopping)
    return grpc.secure_channel(options.ps_address, grpc.ssl_channel_credentials(cert),
                               options=[*settings, ("grpc.ssl_target_name_override", CERT_NAME)])


def _pinned_unless_stopped(options: AgentOptions, stopping: threading.Event) -> bytes:
    """The PS's pinned certificate (:func:`pinned_certificate`), fetched in a thread of its own:
    a PS that accepts the connection and never completes the handshake (its host froze) or a
    network that drops it holds the fetch up to its timeout, and a stop must not wait for that
    (ConnectionError at once)."""
    answer: queue.Queue[bytes | Exception] = queue.Queue()

    def fetch() -> None:
        try:
            answer.put(pinned_certificate(*parse_address(options.ps_address),
                                          options.tls_fingerprint))
        except Exception as exc:  # PinError, ConnectionError: raised in the caller's thread
            answer.put(exc)
    threading.Thread(target=fetch, name="tls-pin", daemon=True).start()
    while not stopping.is_set():
        try:
            got = answer.get(timeout=0.1)
        except queue.Empty:
            continue
        if isinstance(got, Exception):
            raise got
        return got
    raise ConnectionError(f"stopped before the TLS handshake with {options.ps_address} ended")


class _Session:
    """One join and one Work stream."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self.options = agent.options
        self.channel = _channel(self.options, agent.stopping)
        self.stub = pb_grpc.ParameterServerStub(self.channel)
        self.outbox = Outbox()
        # one item per message from the PS: the tiles that arrived together, so a real device
        # answers a message of n tiles with one message of n results
        self.compute_q: queue.Queue[list[PendingTile] | None] = queue.Queue()
        self.cache: BlockCache[np.ndarray] = BlockCache(self.options.cache_bytes)
        self.reply: pb.JoinReply | None = None
        self.closed = threading.Event()
        # left while cut off: nothing more crosses the cut, the connection stays as the cut
        # holds it until the PS ends the session or the cut heals (leave)
        self.gone = threading.Event()
        self.dilation = 1.0

    def _descriptor(self) -> pb.DeviceDescriptor:
        o = self.options
        import platform
        return pb.DeviceDescriptor(name=self.agent.name, instance=self.agent.instance,
                                   group=o.group, kind=o.kind, profile=o.profile,
                                   predicted_gflops=o.predicted_gflops,
                                   max_in_flight=o.max_in_flight, cache_bytes=o.cache_bytes,
                                   keeps_held=True,
                                   platform=f"{platform.system()} {platform.machine()} "
                                            f"Python {platform.python_version()}")

    def run(self) -> str:
        """Returns "stop" when the PS ended the run, "ended" when the stream closed."""
        try:
            self.reply = self.stub.Join(pb.JoinRequest(token=self.options.token,
                                                       device=self._descriptor()), timeout=30)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise JoinRefused(exc.details()) from exc
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # retried for ever before
                raise JoinRefused(
                    f"{self.options.ps_address} answered in gRPC but has no testbed Join "
                    f"({exc.details()}): not a testbed PS, or one of another version; give "
                    f"the address in the join command `testbed up` printed") from exc
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the PS is ending the run
                log.info("%s: PS says: %s", self.agent.name, exc.details())
                return "stop"
            raise
        self.agent.joins += 1
        if self.reply.name and self.reply.name != self.agent.name:
            log.warning("%s: another device of this run goes by that name; this one is %s "
                        "in the run's records (give each device its own --name)",
                        self.agent.name, self.reply.name)
            self.agent.name = self.reply.name
        self.dilation = self.reply.time_dilation or 1.0
        self.agent.set_dilation(self.dilation)
        log.info("%s joined as %s (dilation %.2f)", self.agent.name, self.reply.device_id,
                 self.dilation)
        worker = threading.Thread(target=self._compute_loop, name="compute", daemon=True)
        worker.start()
        try:
            return self._receive(self.stub.Work(self._requests()))
        finally:
            self.closed.set()
            self.compute_q.put(None)
            self.outbox.put(None)
            self.channel.close()

    def leave(self, reason: str) -> None:
        """Tell the PS we are going (best effort), then close the channel: that ends the Work
        stream, and a Join in progress, at once, whether or not the PS still answers.

        Cut off (SIGUSR1, loopback's pulled cable) nothing can tell the PS, not even the
        channel's close: the session drops its work and goes silent, and the connection stays
        until the PS ends it (its lease runs out: ``lease_expired``) or the cut heals (the close
        then reaches the PS: ``disconnect``), as over a link that is down (docs/churn.md)."""
        if self.gone.is_set():
            return
        if self.reply is not None and self.agent.partitioned.is_set():
            self.agent.left_note = ("left the run while cut off from the PS; the PS re-queues "
                                    "this device's tiles when its lease runs out, or when the "
                                    "cut heals before that and the connection's close reaches "
                                    "it")
            self.go_silent()
            return
        if self.reply is not None:
            try:
                left = self.stub.Leave(pb.LeaveRequest(device_id=self.reply.device_id,
                                                       session_key=self.reply.session_key,
                                                       reason=reason), timeout=2)
                self.agent.left_note = (f"left the run; the PS re-queued the "
                                        f"{left.requeued_tiles} tile(s) it had in flight here")
            except grpc.RpcError as exc:
                self.agent.left_note = (f"left the run without the PS's answer "
                                        f"({exc.details()}); it re-queues this device's tiles "
                                        f"when its lease runs out")
            except ValueError:  # a signal arrived after the channel closed: gone anyway
                self.agent.left_note = "left the run; its connection to the PS had closed"
        self.outbox.put(None)
        if not self.closed.is_set():
            self.channel.close()

    def go_silent(self) -> None:
        """Gone while cut off (a leave, a crash): drop the work, send nothing more, and end the
        connection once the cut heals, unless the PS ended the session first."""
        if self.gone.is_set():
            return
        self.gone.set()
        threading.Thread(target=self._end_once_healed, name="gone", daemon=True).start()

    def _end_once_healed(self) -> None:
        """A session gone while cut off: once the cut heals, close the channel (a leave) or
        die (a crash: the kernel closes the socket), unless the PS ended the session first
        (then :meth:`Agent.run` ends the process)."""
        while self.agent.partitioned.is_set() and not self.closed.is_set():
            time.sleep(0.05)
        if self.closed.is_set():
            return
        if self.agent.crashed:
            _die()
        self.channel.close()

    # -- down: the PS's messages ----------------------------------------------------------------
    def _receive(self, responses: Iterator[pb.ServerMessage]) -> str:
        for message in responses:
            self._wait_while_partitioned()  # the cable is out: it arrives once healed
            if self.gone.is_set():  # left while cut off: what the PS sends is dropped
                continue
            if message.HasField("invalidate"):
                self.cache.invalidate(message.invalidate.before_version)
            if message.time_dilation > 0:  # the PS changed D between steps
                self.dilation = message.time_dilation
                self.agent.set_dilation(self.dilation)
                log.info("%s: time dilation now %.2f", self.agent.name, self.dilation)
            if message.HasField("reject"):
                log.warning("%s: PS rejected task %d: %s", self.agent.name,
                            message.reject.task_id, message.reject.reason)
            now = time.monotonic()
            delivery = []
            for tile in message.tiles:
                a, b = operand_array(tile.a, self.cache, 1), operand_array(tile.b, self.cache, 0)
                size = operand_nbytes(tile.a) + operand_nbytes(tile.b) + \
                    MESSAGE_OVERHEAD_BYTES
                delivery.append(PendingTile(tile, a, b, self.options.down.deliver_at(size, now)))
            if delivery:
                self.compute_q.put(delivery)
            if message.HasField("stop"):
                log.info("%s: PS says stop: %s", self.agent.name, message.stop.reason)
                self.agent.stopping.set()
                return "stop"
        return "ended"

    def _wait_while_partitioned(self) -> None:
        while self.agent.partitioned.is_set() and not self.closed.is_set() \
                and not self.gone.is_set():
            time.sleep(0.05)

    # -- compute ----------------------------------------------------------------------------------
    def _compute_loop(self) -> None:
        batch: list[pb.TileResult] = []
        while True:
            if batch and not self._next_has_arrived():  # nothing else ready: the batch goes
                self._post(batch)
                batch = []
            delivery = self.compute_q.get()
            if delivery is None or self.closed.is_set() or self.gone.is_set():
                return
            for item in delivery:
                hold_until(item.arrived_s)  # the downlink's arrival, woken on time under load
                result = self._compute(item)
                if self.agent.model is not None:
                    # an emulated device's results each leave at their own modelled time (the
                    # outbox still merges those that are due together)
                    self._post([result])
                    continue
                batch.append(result)
                if self._batch_full(batch):
                    self._post(batch)
                    batch = []

    def _batch_full(self, batch: list[pb.TileResult]) -> bool:
        """Whether a real device's batch goes out now, before the next tile is computed: at
        MAX_RESULTS_PER_MESSAGE results, when one more result of this size would pass half of
        the PS's message limit (as `_batched`), or when computing one more tile (taking as
        long as the last) would hold the first result back more than MAX_BATCH_DELAY_S."""
        limit = (self.reply.max_message_bytes if self.reply is not None else 0) or (4 << 20)
        size = sum(len(r.c.data) + RESULT_OVERHEAD_BYTES for r in batch)
        last = batch[-1]
        held_s = time.monotonic() - batch[0].done_s + (last.done_s - last.started_s)
        return len(batch) >= MAX_RESULTS_PER_MESSAGE or held_s > MAX_BATCH_DELAY_S or \
            size + size // len(batch) > limit // 2

    def _next_has_arrived(self) -> bool:
        """Whether the next message's tiles are already on the device (peek, take nothing)."""
        with self.compute_q.mutex:
            head = self.compute_q.queue[0] if self.compute_q.queue else None
        return head is not None and head[0].arrived_s <= time.monotonic()

    def _post(self, batch: list[pb.TileResult]) -> None:
        """Queue results on the emulated uplink as one message."""
        if len(batch) == 1:
            message = pb.DeviceMessage(result=batch[0])
        else:
            message = pb.DeviceMessage(results=pb.TileResults(results=batch))
        size = sum(len(r.c.data) + MESSAGE_OVERHEAD_BYTES for r in batch)
        self.outbox.put(message, self.options.up.deliver_at(size, batch[-1].done_s))

    def _compute(self, item: PendingTile) -> pb.TileResult:
        tile = item.tile
        self.agent.poll_control()
        behaviour = self.options.behaviour
        factor = self.agent.slow_factor * (behaviour.compute_factor() if behaviour else 1.0)
        start = time.monotonic()
        c = item.a @ item.b
        real_s = time.monotonic() - start
        lag_s, energy_j, compute_s = 0.0, 0.0, real_s
        if self.agent.model is not None:
            cost = self.agent.model.tile_cost(int(tile.m), int(tile.k), int(tile.n), tile.op,
                                              self.agent.device_time_s(start, self.dilation),
                                              slowdown=factor)
            hold_s = cost.seconds * self.dilation
            lag_s = max(0.0, real_s - hold_s)
            done = hold_until(start + hold_s)  # an absolute deadline from the tile's start
            compute_s, energy_j = cost.seconds, cost.joules
        else:
            if factor > 1:  # a real device made slow: wait out the extra time
                time.sleep(real_s * (factor - 1))
                compute_s = real_s * factor
            done = time.monotonic()
        if behaviour is not None:
            c, _ = behaviour.apply(c, int(tile.task_id), int(tile.attempt), tile.gemm,
                                   self.agent.name)
        self.agent.tiles_done += 1
        return pb.TileResult(
            task_id=tile.task_id, attempt=tile.attempt, c=to_tensor(c), compute_s=compute_s,
            energy_j=energy_j, lag_s=lag_s, received_s=item.arrived_s, started_s=start,
            done_s=done)

    # -- up: what we send -----------------------------------------------------------------------
    def _batched(self, message: pb.DeviceMessage) -> pb.DeviceMessage:
        """A result plus the results due right behind it, as one TileResults message."""
        body = message.WhichOneof("body")
        if body not in ("result", "results"):
            return message
        assert self.reply is not None
        first = [message.result] if body == "result" else list(message.results.results)
        limit = self.reply.max_message_bytes or (4 << 20)
        budget = limit // 2 - sum(len(r.c.data) + RESULT_OVERHEAD_BYTES for r in first)
        more = self.outbox.take_due_results(budget, MAX_RESULTS_PER_MESSAGE - len(first))
        if not more:
            return message
        return pb.DeviceMessage(results=pb.TileResults(results=[*first, *more]))

    def _requests(self) -> Iterator[pb.DeviceMessage]:
        assert self.reply is not None
        yield pb.DeviceMessage(attach=pb.Attach(device_id=self.reply.device_id,
                                                session_key=self.reply.session_key))
        heartbeat_s = max(0.05, self.reply.heartbeat_s)
        last_sent = last_telemetry = time.monotonic()
        while not self.closed.is_set():
            if self.gone.is_set():  # left while cut off: nothing crosses the cut any more,
                self.closed.wait(0.05)  # and an end of this stream would reach the PS
                continue
            due, message = self.outbox.get(timeout_s=heartbeat_s / 2)
            if due and message is None:
                return
            if self.agent.partitioned.is_set():
                if message is None:
                    continue  # no heartbeats while the cable is out: the lease may expire
                self._wait_while_partitioned()  # a result leaves once healed
                if self.closed.is_set():
                    return
                if self.gone.is_set():
                    continue
            now = time.monotonic()
            if message is not None:
                last_sent = now
                yield self._batched(message)
            if now - last_sent >= heartbeat_s:
                last_sent = now
                yield pb.DeviceMessage(heartbeat=pb.Heartbeat(device_time_s=now))
            behaviour = self.options.behaviour
            if (self.agent.model is not None or behaviour is not None) \
                    and now - last_telemetry >= self.options.telemetry_s:
                last_telemetry = now
                values = self.agent.model.telemetry(self.agent.device_time_s(
                    now, self.dilation)) if self.agent.model is not None else {}
                if behaviour is not None:
                    values = {**values, **behaviour.telemetry()}
                if values:
                    yield pb.DeviceMessage(telemetry=pb.Telemetry(values=values))
