"""Start emulated agents as forks of one process that has imported the agent already.

Each ``python -m testbed.agent`` spends ~0.5 CPU-s importing numpy, grpc, yaml and the device
model before it joins (docs/network.md, "Scale"); the 240 agents of ``topologies/large.yaml``
took 78-95 s to start on 2 cores, almost all of it those imports. ``testbed up`` therefore starts
one fork server per run (``python -m testbed.emulator.agent_forkserver``, on the PS's node, with
the run's environment) that imports the agent once; each agent is a fork of it that:

1. dies with the server (``PR_SET_PDEATHSIG``; the server itself dies with ``testbed up``);
2. points stdin at /dev/null and stdout and stderr at its own log;
3. enters its device's network and mount namespaces (``setns``, what ``mnexec -a PID`` does), when
   the device has a node of its own;
4. runs the agent's ``main`` with the same arguments ``python -m testbed.agent`` takes.

The server never starts a thread, a gRPC channel or a logging handler, so a fork starts from a
clean state (``threading`` and ``random`` reset themselves at a fork; every agent draws its noise
from its own ``--seed``). Every agent of a run shares the server's environment: that is also what
``/proc/PID/environ`` shows for it, which is how ``testbed clean`` finds a run's processes.

Protocol, one JSON object a line over the server's stdin and stdout:

* request: ``{"id": N, "args": [...], "log": PATH, "ns_pid": PID or null}``;
* replies: ``{"id": N, "pid": PID}`` once the agent is forked, and ``{"exited": PID, "code": C}``
  when the server reaps it (``C`` as ``subprocess.Popen.returncode``: -SIGNAL when killed).

The server and its agents ignore SIGINT and SIGHUP (a Ctrl-C, or a closed terminal's hangup,
reaches the whole process group: ``testbed up`` stops the PS, then the agents with SIGTERM, then
the server) and the server exits when its stdin closes.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

from testbed.pdeathsig import die_with_parent

MODULE = "testbed.emulator.agent_forkserver"
_libc = ctypes.CDLL(None, use_errno=True)


# -- the server (its own process) ------------------------------------------------------------

def _preload() -> None:
    """Import what every agent imports, so that a fork has nothing left to import."""
    import testbed.agent.__main__  # noqa: F401  (numpy, grpc, the protocol, the agent)
    import testbed.emulator.device_model  # noqa: F401  (what --kind emulated loads)
    import testbed.perf_model.profiles  # noqa: F401  (yaml, the profile loader)


def _enter_namespaces(pid: int) -> None:
    """Join pid's network and mount namespaces (those that differ from this process's)."""
    cwd = os.getcwd()
    for kind in ("net", "mnt"):
        path = f"/proc/{pid}/ns/{kind}"
        if os.stat(path).st_ino == os.stat(f"/proc/self/ns/{kind}").st_ino:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            if _libc.setns(fd, 0) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns {path}: {os.strerror(err)}")
        finally:
            os.close(fd)
    os.chdir(cwd)  # a new mount namespace starts at its root


def _run_agent(request: dict[str, Any], server_pid: int, close: list[int]) -> int:
    """In the forked child: become the device's agent; its exit code."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    die_with_parent()
    if os.getppid() != server_pid:  # the server died before the line above
        return 1
    # 0, 1 and 2 are open (the server's pipes and log), so these two are above them
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for fd in {null, log, *close} - {0, 1, 2}:
        os.close(fd)
    if request.get("ns_pid"):
        _enter_namespaces(int(request["ns_pid"]))
    from testbed.agent.__main__ import main

    sys.argv = ["testbed.agent", *request["args"]]
    return main(list(request["args"]), supervised=True)


def _fork_agent(request: dict[str, Any], close: list[int]) -> int:
    """Fork one agent; its pid (in the server)."""
    server_pid = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = _run_agent(request, server_pid, close)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # the child must not return into the server's loop
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve(read_fd: int = 0, write_fd: int = 1) -> int:
    """The server's loop: fork an agent per request, report each one's exit; 0 at EOF."""
    # gRPC starts in the agents, after the fork; none of them forks again (tests/conftest.py:
    # gRPC's fork handlers crashed children of a process that had used it)
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    _preload()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wake-up fd fires
    signal.set_wakeup_fd(wake_w)
    close_in_child = [read_fd, write_fd, wake_r, wake_w]
    children: set[int] = set()
    pending = b""

    def send(message: dict[str, Any]) -> None:
        os.write(write_fd, (json.dumps(message) + "\n").encode())

    while True:
        ready, _, _ = select.select([read_fd, wake_r], [], [])
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if read_fd not in ready:
            continue
        data = os.read(read_fd, 1 << 16)
        if not data:
            return 0
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = json.loads(line)
            pid = _fork_agent(request, close_in_child)
            children.add(pid)
            send({"id": request["id"], "pid": pid})


# -- the client (in `testbed up`) ------------------------------------------------------------

class ForkServerGone(RuntimeError):
    """The server has ended (killed, crashed) while the run still wanted an agent: none can be
    started any more. The message says how it ended and where its log is."""


class ForkedAgent:
    """What ``testbed up`` holds for an agent the server forked: the subset of
    :class:`subprocess.Popen` it uses (pid, returncode, poll, wait, signals)."""

    def __init__(self, pid: int, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _set_exited(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the agent unless it is known to have exited (as Popen does)."""
        if self.returncode is not None:
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class AgentForkServer:
    """The client end of a running server: :meth:`start` forks an agent, :meth:`close` ends it.

    ``proc`` is the server's process, started with ``stdin`` and ``stdout`` pipes (the caller
    starts it, on the node and with the environment the agents should have, see
    :func:`server_argv`). Safe to call from any thread.
    """

    def __init__(self, proc: subprocess.Popen, log_path: Path | None = None):
        assert proc.stdin is not None and proc.stdout is not None
        self.proc = proc
        self.pid = proc.pid
        self.log_path = log_path
        self._stdin: IO[bytes] = proc.stdin
        self._lock = threading.Lock()
        self._next_id = 0
        self._starting: dict[int, tuple[Future, list[str]]] = {}
        self._agents: dict[int, ForkedAgent] = {}
        self._closing = False
        self._ended = False  # the reader saw the server's end: no request can be answered
        self.died: str | None = None  # why the server ended when close() did not end it
        self._reader = threading.Thread(target=self._read, args=(proc.stdout,),
                                        name="agent-forkserver", daemon=True)
        self._reader.start()

    def start(self, args: list[str], log_path: Path, ns_pid: int | None) -> ForkedAgent:
        """Fork an agent with ``args`` (those of ``python -m testbed.agent``), its output
        appended to ``log_path``, in ``ns_pid``'s namespaces (None: the server's own).
        :class:`ForkServerGone` when the server is gone, or goes before it answers."""
        future: Future = Future()
        with self._lock:
            # a request after the reader saw the end would wait for ever: the write itself
            # can succeed while a dying agent still holds the server's end of the pipe
            if self._ended:
                raise ForkServerGone(self._gone())
            self._next_id += 1
            request_id = self._next_id
            self._starting[request_id] = (future, args)
            line = json.dumps({"id": request_id, "args": args, "log": str(log_path),
                               "ns_pid": ns_pid}) + "\n"
            try:
                self._stdin.write(line.encode())
                self._stdin.flush()
            except (BrokenPipeError, ValueError):
                self._starting.pop(request_id, None)
                raise ForkServerGone(self._gone()) from None
        return future.result()

    def close(self, timeout_s: float = 5.0) -> None:
        """End the server (after its agents were stopped: any left die with it)."""
        with self._lock:
            self._closing = True
            try:
                self._stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._reader.join(timeout_s)

    def _gone(self) -> str:
        code = self.proc.poll()
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and -code in \
            signal.valid_signals() else f"exited with code {code}"
        where = f"; see {self.log_path}" if self.log_path else ""
        return f"the agent fork server (pid {self.pid}) {how}{where}"

    def _read(self, stream: IO[bytes]) -> None:
        for raw in stream:
            message = json.loads(raw)
            with self._lock:
                if "exited" in message:
                    agent = self._agents.pop(message["exited"], None)
                    if agent is not None:
                        agent._set_exited(int(message["code"]))
                    continue
                future, args = self._starting.pop(message["id"])
                agent = ForkedAgent(int(message["pid"]), args)
                self._agents[agent.pid] = agent
            future.set_result(agent)
        # the server is gone: its agents died with it (PR_SET_PDEATHSIG, SIGKILL)
        self.proc.wait()
        with self._lock:
            self._ended = True
            if not self._closing:
                self.died = self._gone()
            for agent in self._agents.values():
                agent._set_exited(-signal.SIGKILL)
            self._agents.clear()
            starting, self._starting = self._starting, {}
        for future, _ in starting.values():
            future.set_exception(ForkServerGone(self._gone()))


def server_argv() -> list[str]:
    """The command that runs the server."""
    return [sys.executable, "-m", MODULE]


def main() -> int:
    try:
        return serve()
    except OSError as exc:
        if exc.errno == errno.EPIPE:  # testbed up went away
            return 0
        raise


if __name__ == "__main__":
    sys.exit(main())
