"""The server host: the gRPC server and the PS's core on one event-loop thread.

Threads: the gRPC server and all scheduling state live on one asyncio event loop (the "loop
thread", started by :meth:`PsServer.start`); the training engine runs in another thread and
reaches the loop only through :meth:`PsServer.call`, ``call_soon_threadsafe`` (the
:class:`~testbed.ps_backend.executor.TileExecutor`) and ``concurrent.futures`` results. So the
:class:`~testbed.ps_backend.core.PsCore` and its scheduler need no locks.
"""

from __future__ import annotations

import asyncio
import resource
import threading
from typing import Any, Callable

import grpc

from testbed.ps_backend.admission import connection_cap
from testbed.ps_backend.core import PsConfig, PsCore
from testbed.ps_backend.ledger import Ledger
from testbed.ps_backend.service import ParameterServerServicer
from testbed.ps_backend.tls import TlsIdentity
from testbed.runlog import RunLog
from testbed.wire import testbed_pb2_grpc as pb_grpc

# gRPC's own limits against hostile or broken clients (docs/fault-tolerance.md, "Limits")
HANDSHAKE_TIMEOUT_MS = 10_000  # a TCP connection that does not finish HTTP/2 setup is closed
CONNECTION_IDLE_MS = 60_000  # a connection with no RPC for this long is closed (GOAWAY)
MAX_STREAMS_PER_CONNECTION = 16  # an agent needs one Work stream plus a Join or Leave


class PsServer:
    """The gRPC server on its own event-loop thread; start() returns once it listens."""

    def __init__(self, config: PsConfig, runlog: RunLog | None = None,
                 listen: str = "127.0.0.1:0", ledger: Ledger | None = None,
                 tls_listen: str | None = None, tls: TlsIdentity | None = None):
        self.config = config
        self.runlog = runlog
        self.ledger = ledger
        self.listen = listen
        # devices beyond loopback (network.ps.listen): a second port, TLS only
        self.tls_listen, self.tls = tls_listen, tls
        self.tls_port = 0
        self.loop = asyncio.new_event_loop()
        self.core: PsCore | None = None
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._thread = threading.Thread(target=self._run, name="ps-loop", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._periodic: list[Callable[[], None]] = []
        self.max_connections = 0

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._ready.set()
        if self._error is None:
            self.loop.run_forever()

    async def _start(self) -> None:
        try:
            self.core = PsCore(self.config, self.runlog, self.ledger)
            limit = self.config.max_message_bytes
            fd_limit = self.config.fd_limit or resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            self.max_connections = connection_cap(fd_limit)
            self._server = grpc.aio.server(options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", 1 << 30),
                ("grpc.so_reuseport", 0),
                # hostile clients (docs/fault-tolerance.md, "Limits"): connections beyond the
                # cap are closed as they arrive, so they never take the fds the PS's own files
                # need; a connection that never speaks HTTP/2, or sits without an RPC, is closed
                ("grpc.max_allowed_incoming_connections", self.max_connections),
                ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
                ("grpc.max_connection_idle_ms", CONNECTION_IDLE_MS),
                ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION)])
            pb_grpc.add_ParameterServerServicer_to_server(ParameterServerServicer(self.core),
                                                          self._server)
            self.port = self._server.add_insecure_port(self.listen)
            if self.port == 0:
                raise RuntimeError(f"cannot listen on {self.listen}")
            if self.tls_listen is not None and self.tls is not None:
                credentials = grpc.ssl_server_credentials([(self.tls.key_pem, self.tls.cert_pem)])
                self.tls_port = self._server.add_secure_port(self.tls_listen, credentials)
                if self.tls_port == 0:
                    raise RuntimeError(f"cannot listen on {self.tls_listen} "
                                       "(network.ps.listen): address not on this host, or port "
                                       "taken")
            await self._server.start()
            self.loop.create_task(self._watch_leases())
        except BaseException as exc:
            self._error = exc

    async def _watch_leases(self) -> None:
        assert self.core is not None
        while True:
            await asyncio.sleep(self.config.tick_s)
            self.core.tick()
            for fn in self._periodic:
                fn()

    def every_tick(self, fn: Callable[[], None]) -> None:
        """Run fn on the loop thread about every 0.25 s (status snapshots)."""
        self.loop.call_soon_threadsafe(self._periodic.append, fn)

    def start(self) -> PsServer:
        """Start the loop thread; return once the server listens (raise why it cannot)."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the loop thread and return its result (from any other thread)."""
        async def wrapper() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result()

    def stop(self, reason: str = "run finished", grace_s: float = 2.0) -> None:
        """Tell devices to stop, then shut the server down with a grace period."""
        if not self._thread.is_alive():
            return
        core = self.core
        if core is not None:
            self.call(lambda: core.stop_all(reason))
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=grace_s + 5)
