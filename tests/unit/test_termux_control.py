"""The Termux listener's pieces that are pure: the phone's socket table, the uid verdict, and
the listener's check of the agent options it accepts (docs/adb-bridge.md, "The Termux
listener")."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

from testbed.adb_bridge import termux_control as tc

SERVE_PY = Path(tc.__file__).resolve().parent / "phone" / "termux_serve.py"

# 127.0.0.1:7702 is 0100007F:1E16. adbd's listener and accepted socket (uid 2000), Termux's
# socket to it over IPv4 (uid 10234), another app's over a v4-mapped IPv6 socket (uid 10999),
# a TIME_WAIT leftover and an orphan in FIN_WAIT2 (inode 0), and an unrelated socket.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1E16 00000000:0000 0A 00000000:00000000 00:00000000 00000000  2000        0 111 1
   1: 0100007F:1E16 0100007F:A001 01 00000000:00000000 00:00000000 00000000  2000        0 112 1
   2: 0100007F:A001 0100007F:1E16 01 00000000:00000000 00:00000000 00000000 10234        0 113 1
   3: 0100007F:A002 0100007F:1E16 06 00000000:00000000 03:00000000 00000000     0        0 0 3
   4: 0100007F:A003 0100007F:1E16 05 00000000:00000000 00:00000000 00000000     0        0 0 3
   5: 0100007F:B000 0100007F:1E14 01 00000000:00000000 00:00000000 00000000 10234        0 114 1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0000000000000000FFFF00000100007F:A004 0000000000000000FFFF00000100007F:1E16 01 00000000:00000000 00:00000000 00000000 10999        0 115 1
   1: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000 10234        0 116 1
"""  # noqa: E501


def test_parse_proc_net_tcp_reads_ipv4_and_mapped_ipv6() -> None:
    sockets = tc.parse_proc_net_tcp(TCP + TCP6)
    assert len(sockets) == 8
    first = sockets[0]
    assert (first.local_ip, first.local_port, first.state, first.uid) == (
        "127.0.0.1", 7702, "LISTEN", 2000)
    mapped = sockets[6]
    assert (mapped.local_ip, mapped.local_port, mapped.remote_ip, mapped.remote_port,
            mapped.state, mapped.uid, mapped.inode) == ("127.0.0.1", 0xA004, "127.0.0.1", 7702,
                                                       "ESTABLISHED", 10999, 115)
    assert sockets[7].local_ip == "::1" and sockets[7].local_port == 8080
    assert not sockets[3].live and not sockets[4].live and sockets[2].live


def test_verdict_names_foreign_uids_and_ignores_dead_sockets() -> None:
    only_termux = tc.parse_proc_net_tcp(TCP)
    assert tc.foreign_uids(only_termux, 7702, 10234) == set()  # TIME_WAIT, orphan: no reader
    assert tc.termux_sockets(only_termux, 7702, 10234) == 1
    both = tc.parse_proc_net_tcp(TCP + TCP6)
    assert tc.foreign_uids(both, 7702, 10234) == {10999}
    assert tc.foreign_uids(both, 7700, 10234) == set()  # another port: none of its business
    assert tc.termux_sockets(both, 7700, 10234) == 1  # line 5: the agent dialling the PS


def test_package_uid_from_pm_or_dumpsys() -> None:
    assert tc.parse_package_uid("package:com.termux uid:10234\n") == 10234
    assert tc.parse_package_uid("Packages:\n  Package [com.termux] (1a2b):\n"
                                "    userId=10187\n") == 10187
    assert tc.parse_package_uid("") is None


def test_serve_command_names_the_port_only_when_moved() -> None:
    assert tc.serve_command(7702) == "sh /data/local/tmp/testbed/termux-agent.sh serve"
    assert tc.serve_command(7812).endswith("serve 127.0.0.1:7812")


@pytest.fixture(scope="module")
def serve() -> ModuleType:
    spec = importlib.util.spec_from_file_location("termux_serve", SERVE_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["termux_serve"] = module
    spec.loader.exec_module(module)
    return module


def test_listener_accepts_the_bridges_options(serve: ModuleType) -> None:
    argv = ["--ps", "127.0.0.1:7700", "--name", "adb-r58m12", "--kind", "real",
            "--profile", "snapdragon888", "--gflops", "20.9", "--group", "adb"]
    assert serve.check_argv(argv) is None


@pytest.mark.parametrize("argv, why", [
    (["--ps", "127.0.0.1:7700", "--name", "x", "--token-file", "/data/data/com.termux/files/"
      "home/.ssh/id_ed25519"], "'--token-file' is not allowed"),
    (["--ps", "10.0.0.5:7700", "--name", "x"], "--ps '10.0.0.5:7700' does not match"),
    (["--ps", "127.0.0.1:7700", "--name", "x;rm -rf ~"], "--name 'x;rm -rf ~' does not match"),
    (["--ps", "127.0.0.1:7700", "--name"], "option/value pairs"),
    (["--name", "x", "--kind", "real"], "needs --ps and --name"),
    ("--ps 127.0.0.1:7700", "a list of strings"),
])
def test_listener_refuses_other_options(serve: ModuleType, argv: object, why: str) -> None:
    problem = serve.check_argv(argv)
    assert problem is not None and why in problem, problem


def test_listener_refuses_a_start_without_a_token(serve: ModuleType, tmp_path: Path) -> None:
    listener = serve.Listener(str(tmp_path), str(tmp_path))
    reply = listener.handle({"id": 3, "cmd": "start", "argv": ["--ps", "127.0.0.1:1",
                                                              "--name", "x"]})
    assert reply["id"] == 3 and not reply["ok"] and "token" in reply["error"]
    assert listener.handle({"id": 4, "cmd": "launch"})["error"] == "unknown cmd 'launch'"
    assert listener.agent is None


def _control(table: str, uid_text: str = "package:com.termux uid:10234\n"
             ) -> tuple[tc.TermuxControl, list[tuple[str, dict]]]:
    """A TermuxControl whose phone answers from canned text (no adb needed)."""
    answers = {tc.UID_COMMAND: (0, uid_text), tc.UID_FALLBACK_COMMAND: (0, ""),
               tc.SOCKETS_COMMAND: (0, table)}
    events: list[tuple[str, dict]] = []
    control = tc.TermuxControl(lambda c: answers[c], 7702,
                               lambda kind, data: events.append((kind, data)))
    control.start()
    return control, events


def _dial(control: tc.TermuxControl, hello: dict) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", control.port), timeout=10)
    s.sendall((json.dumps(hello) + "\n").encode())
    return s


HELLO = {"hello": "testbed-termux", "protocol": 1, "uid": 10234, "numpy": "2.1", "grpc": "1.6"}


@pytest.mark.parametrize("table, hello, uid_text, reason", [
    (TCP + TCP6, HELLO, None, "uid 10999 (not Termux, uid 10234) is connected"),
    ("", HELLO, None, "cannot read the phone's /proc/net/tcp"),
    (TCP, {**HELLO, "protocol": 0}, None, "speaks protocol 0"),
    (TCP, {"hi": 1}, None, "did not say hello"),
    (TCP, HELLO, "", "cannot find Termux's uid"),
    (TCP.replace(" 10234 ", " 10235 ", 1), HELLO, None, "uid 10235 (not Termux"),
])
def test_control_refuses_and_says_why(table: str, hello: dict, uid_text: str | None,
                                      reason: str) -> None:
    control, events = _control(table, *(() if uid_text is None else (uid_text,)))
    try:
        with _dial(control, hello) as s:
            assert s.recv(100) == b""  # closed, nothing sent
        assert not control.connected()
        kinds = [k for k, _ in events]
        assert kinds == ["listener-refused"] and reason in events[0][1]["reason"], events
    finally:
        control.stop()


def test_control_admits_termux_and_carries_requests() -> None:
    control, events = _control(TCP)
    try:
        with _dial(control, HELLO) as s:
            assert control.wait_connected(10) and control.hello["numpy"] == "2.1"
            reader = s.makefile("rb")
            replies: list[dict] = []

            def answer() -> None:
                request = json.loads(reader.readline())
                replies.append(request)
                s.sendall((json.dumps({"event": "agent-exited", "pid": 7, "code": 1,
                                       "log_tail": "boom"}) + "\n").encode())
                s.sendall((json.dumps({"id": request["id"], "ok": True, "pid": 42})
                           + "\n").encode())

            thread = threading.Thread(target=answer)
            thread.start()
            reply = control.request("start", argv=["--ps", "127.0.0.1:7700"], token="t0k")
            thread.join(10)
            assert reply["ok"] and reply["pid"] == 42
            assert replies[0]["cmd"] == "start" and replies[0]["token"] == "t0k"
            assert ("agent-exited", {"event": "agent-exited", "pid": 7, "code": 1,
                                     "log_tail": "boom"}) in events
            reader.close()  # else the socket's file stays open after s.close()
        # the reader thread marks the link down, then tells: wait for the telling
        deadline = time.monotonic() + 10
        while events[-1][0] != "listener-lost" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert events[-1][0] == "listener-lost" and not control.connected()
        with pytest.raises(tc.ControlError, match="no Termux listener"):
            control.request("status")
    finally:
        control.stop()


def test_listener_checks_gemm_arguments(serve: ModuleType) -> None:
    assert serve.check_gemm_args(["describe"]) is None
    assert serve.check_gemm_args(["64", "128", "32", "float32", "2", "5", "0.001"]) is None
    for bad in (["64", "128", "32", "float16", "2", "5", "0.001"],
                ["64", "128", "32", "float32", "2", "5", "0.001", "--x"],
                ["64", "128", "32", "float32", "2", "5", "1e-3; rm -rf ~"], "describe"):
        assert "gemm args must be" in serve.check_gemm_args(bad), bad
