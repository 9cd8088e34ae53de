"""The listener a user starts once inside Termux: ``sh termux-agent.sh serve``.

It runs as the Termux app's user with Termux's python, and dials the bridge's control port
(``127.0.0.1:<phone_port + 2>`` on the phone, which ``adb reverse`` carries to the bridge on the
host). Over that connection the bridge starts and stops the agent. It needs no Android
permission: apps may connect to the phone's loopback. It retries every second, so it can be
started before the phone is plugged in, and it survives a USB hiccup or the end of a run.

Protocol: JSON, one object per line, both ways (docs/adb-bridge.md, "The Termux listener").

* listener -> bridge, first: ``{"hello": "testbed-termux", "protocol": 1, "uid", "pid",
  "python", "numpy", "grpc", "numpy_error", "grpc_error", "agent_pid"}``;
* bridge -> listener: ``{"id": N, "cmd": "start", "argv": [...], "token": "..."}``,
  ``{"id": N, "cmd": "stop"}``, ``{"id": N, "cmd": "status"}``, ``{"id": N, "cmd": "gemm",
  "args": [...]}`` (``time_gemm.py`` with checked arguments, for ``testbed adb measure``); the
  listener answers each with ``{"id": N, "ok": true|false, "error": "...", "pid": P}`` (``gemm``:
  ``"result"``, the script's JSON line);
* listener -> bridge, any time: ``{"event": "agent-exited", "pid": P, "code": C, "log_tail"}``.

Any app on the phone can connect to the phone's loopback, so the bridge authenticates this
listener (by the uid that owns its socket, read from ``/proc/net/tcp`` over adb) before it sends
the token. This side cannot authenticate the bridge (apps may not read ``/proc/net`` since
Android 10), so it accepts only a fixed set of agent options with checked values: whoever sits
at the control port can make it start the agent against a loopback port, nothing else (no
``--token-file``, which would send a Termux file as the token, no paths, no other program).
The token reaches the agent in its environment (``TESTBED_TOKEN``), which only Termux's user and
root can read: never on a command line, never on disk.

Runs on the phone's Python alone: standard library only, no testbed imports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

PROTOCOL = 1
RETRY_S = 1.0
MAX_LINE_BYTES = 1 << 16
NAME = r"[A-Za-z0-9._-]{1,64}"
NUMBER = r"[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?"
# option -> pattern its value must match in full; nothing else reaches the agent's command line
ALLOWED_OPTIONS = {
    "--ps": r"127\.0\.0\.1:[0-9]{1,5}",
    "--name": NAME,
    "--group": NAME,
    "--kind": r"real|emulated",
    "--profile": NAME,
    "--gflops": NUMBER,
    "--seed": r"[0-9]{1,9}",
    "--max-in-flight": r"[0-9]{1,4}",
    "--cache-mib": NUMBER,
}
TOKEN = r"[\x21-\x7e]{1,512}"
GEMM_ARGS = (r"[0-9]{1,5}", r"[0-9]{1,5}", r"[0-9]{1,5}", r"float32|float64", r"[0-9]{1,3}",
             r"[0-9]{1,3}", NUMBER)  # M K N DTYPE WARMUP REPEATS MIN_SAMPLE_S
GEMM_TIMEOUT_S = 600.0


def check_argv(argv: object) -> str | None:
    """Why these agent options are refused, or None when every one is allowed."""
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return "argv must be a list of strings"
    if len(argv) % 2:
        return "argv must be option/value pairs"
    for option, value in zip(argv[::2], argv[1::2]):
        pattern = ALLOWED_OPTIONS.get(option)
        if pattern is None:
            return f"option {option!r} is not allowed (allowed: {sorted(ALLOWED_OPTIONS)})"
        if not re.fullmatch(pattern, value):
            return f"{option} {value!r} does not match {pattern}"
    if "--ps" not in argv[::2] or "--name" not in argv[::2]:
        return "argv needs --ps and --name"
    return None


def check_gemm_args(args: object) -> str | None:
    """Why these time_gemm.py arguments are refused, or None."""
    if args == ["describe"]:
        return None
    if not isinstance(args, list) or len(args) != len(GEMM_ARGS) or not all(
            isinstance(a, str) and re.fullmatch(p, a) for a, p in zip(args, GEMM_ARGS)):
        return f"gemm args must be ['describe'] or M K N DTYPE WARMUP REPEATS MIN_SAMPLE_S, " \
               f"got {args!r}"
    return None


def module_versions() -> dict[str, object]:
    """Python, numpy and grpc versions (None, and the error, when one does not import)."""
    report: dict[str, object] = {"python": sys.version.split()[0]}
    for module in ("numpy", "grpc"):
        try:
            report[module] = __import__(module).__version__
            report[module + "_error"] = ""
        except Exception as exc:  # any import failure is what the report is for
            report[module] = None
            report[module + "_error"] = f"{type(exc).__name__}: {exc}"
    return report


class Listener:
    """One listener: the agent it runs (at most one) and the current control connection."""

    def __init__(self, agent_dir: str, state_dir: str):
        self.agent_zip = os.path.join(agent_dir, "agent.zip")
        self.time_gemm = os.path.join(agent_dir, "time_gemm.py")
        self.state_dir = state_dir
        self.log_path = os.path.join(state_dir, "agent.log")
        self.agent: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()  # one writer at a time on the socket

    def send(self, message: dict[str, object]) -> None:
        """Write one line to the bridge (dropped when there is no connection)."""
        data = (json.dumps(message) + "\n").encode()
        with self.lock:
            if self.sock is not None:
                try:
                    self.sock.sendall(data)
                except OSError:
                    pass

    def agent_pid(self) -> int | None:
        """The running agent's pid, or None."""
        if self.agent is not None and self.agent.poll() is None:
            return self.agent.pid
        return None

    def hello(self) -> dict[str, object]:
        """The first line on every connection."""
        return {"hello": "testbed-termux", "protocol": PROTOCOL, "uid": os.getuid(),
                "pid": os.getpid(), "agent_pid": self.agent_pid(), **module_versions()}

    def start(self, message: dict[str, object]) -> dict[str, object]:
        """Start the agent (ending one that runs); the token goes into its environment."""
        argv, token = message.get("argv"), message.get("token")
        problem = check_argv(argv)
        if problem is None and not (isinstance(token, str) and re.fullmatch(TOKEN, token)):
            problem = "the token is missing or not printable ASCII"
        if problem is not None:
            return {"ok": False, "error": problem}
        versions = module_versions()
        missing = [m for m in ("numpy", "grpc") if not versions[m]]
        if missing:
            return {"ok": False, "error": "Termux's python cannot import "
                    + ", ".join(f"{m} ({versions[m + '_error']})" for m in missing)}
        if not os.path.isfile(self.agent_zip):
            return {"ok": False, "error": f"{self.agent_zip} is missing (the bridge pushes it)"}
        self.stop()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESTBED_TOKEN")}
        env["TESTBED_TOKEN"] = str(token)
        with open(self.log_path, "wb") as log:
            # Its own process group (Ctrl-C on the listener does not reach it: the listener
            # ends it with SIGTERM, a graceful leave), the listener's session.
            self.agent = subprocess.Popen(
                [sys.executable, self.agent_zip, *argv],  # type: ignore[misc]
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                preexec_fn=os.setpgrp)
        threading.Thread(target=self._watch, args=(self.agent,), daemon=True).start()
        return {"ok": True, "pid": self.agent.pid}

    def _watch(self, agent: subprocess.Popen[bytes]) -> None:
        code = agent.wait()
        try:
            with open(self.log_path, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
        except OSError:
            tail = ""
        self.send({"event": "agent-exited", "pid": agent.pid, "code": code, "log_tail": tail})

    def stop(self, grace_s: float = 0.0) -> dict[str, object]:
        """SIGTERM to the agent (it leaves gracefully); wait up to grace_s for it."""
        agent, pid = self.agent, self.agent_pid()
        if agent is not None and pid is not None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(timeout=grace_s) if grace_s > 0 else None
            except subprocess.TimeoutExpired:
                pass
        return {"ok": True, "pid": pid}

    def gemm(self, args: object) -> dict[str, object]:
        """Run time_gemm.py (pushed next to the agent) and return its JSON line."""
        problem = check_gemm_args(args)
        if problem is not None:
            return {"ok": False, "error": problem}
        try:
            done = subprocess.run([sys.executable, self.time_gemm, *args],  # type: ignore[misc]
                                  capture_output=True, timeout=GEMM_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"ok": False, "error": f"time_gemm.py: {exc}"}
        lines = done.stdout.decode(errors="replace").strip().splitlines()
        if done.returncode != 0 or not lines:
            tail = done.stderr.decode(errors="replace").strip()[-500:]
            return {"ok": False, "error": f"time_gemm.py exited {done.returncode}: {tail}"}
        try:
            return {"ok": True, "result": json.loads(lines[-1])}
        except ValueError:
            return {"ok": False, "error": f"unreadable time_gemm.py output {lines[-1][:200]!r}"}

    def handle(self, message: dict[str, object]) -> dict[str, object]:
        """Answer one request from the bridge."""
        cmd = message.get("cmd")
        if cmd == "start":
            reply = self.start(message)
        elif cmd == "stop":
            reply = self.stop()
        elif cmd == "status":
            reply = {"ok": True, "pid": self.agent_pid()}
        elif cmd == "gemm":
            reply = self.gemm(message.get("args"))
        else:
            reply = {"ok": False, "error": f"unknown cmd {cmd!r}"}
        return {"id": message.get("id"), **reply}

    def session(self, sock: socket.socket) -> None:
        """Serve one connection until the bridge closes it."""
        with self.lock:
            self.sock = sock
        self.send(self.hello())
        buf = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    return
                buf += chunk
                if len(buf) > MAX_LINE_BYTES and b"\n" not in buf:
                    return  # not the bridge
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    try:
                        message = json.loads(line)
                    except ValueError:
                        return
                    if isinstance(message, dict):
                        self.send(self.handle(message))
        except OSError:
            return
        finally:
            with self.lock:
                self.sock = None
            sock.close()


def main(argv: list[str]) -> int:
    """``termux_serve.py AGENT_DIR HOST:PORT``: dial the bridge, serve, dial again."""
    if len(argv) != 2 or not re.fullmatch(r"127\.0\.0\.1:[0-9]{1,5}", argv[1]):
        print("usage: termux_serve.py AGENT_DIR 127.0.0.1:PORT", file=sys.stderr)
        return 2
    host, port = argv[1].split(":")
    state_dir = os.path.join(os.environ.get("HOME", "."), ".testbed")
    os.makedirs(state_dir, exist_ok=True)
    listener = Listener(argv[0], state_dir)

    def terminate(*_: object) -> None:
        listener.stop(grace_s=10.0)
        sys.exit(0)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGHUP, terminate)
    print(f"testbed: waiting for the bridge at {argv[1]} (plug the phone in and run "
          f"`testbed up` or `testbed adb doctor` on the computer; Ctrl-C ends this)", flush=True)
    connected = False
    try:
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=5)
            except OSError:
                if connected:
                    print("testbed: the bridge is gone; waiting for it again", flush=True)
                    connected = False
                time.sleep(RETRY_S)
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if not connected:
                print("testbed: connected to the bridge", flush=True)
                connected = True
            listener.session(sock)
            time.sleep(RETRY_S)  # the bridge closed it: it refused us, or it stopped
    except KeyboardInterrupt:
        listener.stop(grace_s=10.0)
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
