"""`testbed join` stopped at each phase, for real: a PS process with a TLS listener on
127.0.0.1 (`network.ps.listen`), `testbed join` processes, signals. Each stop leaves gracefully
(the PS re-queues only the device's tiles in flight), ends within seconds even when the PS no
longer answers, and exits 130 with one line, as every testbed command interrupted."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest
import yaml

from tests.adversarial.psproc import TOKEN, PsProcess
from tests.conftest import REPO, TINY, catches, killed_at_exit, stopped, wait_for

pytestmark = pytest.mark.integration

PROMPT_S = 8.0  # a stop ends `testbed join` within this (the Leave's own timeout is 2 s)


class LanPS(NamedTuple):
    """A PS whose topology sets network.ps.listen on loopback, and what its join command
    needs."""

    ps: PsProcess
    lan_address: str
    fingerprint: str


@pytest.fixture(scope="module")
def lan_ps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LanPS]:
    """The PS training a long run with one honest agent on its plain port, so that LAN
    devices can come and go meanwhile; killed at the module's end."""
    tmp = tmp_path_factory.mktemp("join-faults")
    raw = yaml.safe_load(TINY.read_text())
    raw["network"] = {"backend": "loopback", "ps": {"listen": "127.0.0.1:0"}}
    raw["job"]["steps"] = 5000  # longer than the tests: closed at the end
    topology = tmp / "lan.yaml"
    topology.write_text(yaml.safe_dump(raw))
    with PsProcess(topology, tmp / "run", "--expect-devices", "1") as ps:
        info = json.loads((ps.run_dir / "ps.json").read_text())
        ps.agent("honest-0")
        wait_for(lambda: ps.status().get("state") == "training", 120, "training")
        yield LanPS(ps, info["lan_address"], info["fingerprint"])


def _join(address: str, fingerprint: str, tmp_path: Path, name: str) -> subprocess.Popen:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    return subprocess.Popen(
        [sys.executable, "-m", "testbed.cli", "join", address, "--fingerprint", fingerprint,
         "--token-file", str(token_file), "--name", name], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stopped(proc: subprocess.Popen, sig: signal.Signals) -> tuple[str, float]:
    """Send sig; return the output and the seconds until the process ended (killed, and the
    test failed, past PROMPT_S)."""
    started = time.monotonic()
    proc.send_signal(sig)
    try:
        out, _ = proc.communicate(timeout=PROMPT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"`testbed join` still running {PROMPT_S} s after {sig.name}:\n{out}")
    return out, time.monotonic() - started


def _joined(lan: LanPS, name: str) -> bool:
    return any(e["event"] == "join" and e.get("device") == name for e in lan.ps.events())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=lambda sig: sig.name)
def test_a_signal_mid_step_leaves_and_exits_130_with_one_line(
        lan_ps: LanPS, tmp_path: Path, sig: signal.Signals) -> None:
    name = f"lan-{sig.name.lower()}"
    proc = _join(lan_ps.lan_address, lan_ps.fingerprint, tmp_path, name)
    with killed_at_exit(proc):
        wait_for(lambda: _joined(lan_ps, name), 60, f"{name} to join")
        time.sleep(1.0)  # computing tiles now
        out, _ = _stopped(proc, sig)
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
    last = out.strip().splitlines()[-1]
    assert f"{name}: {sig.name}: left the run; the PS re-queued" in last, out
    leave = wait_for(lambda: next((e for e in lan_ps.ps.events() if e["event"] == "leave"
                                   and e.get("device") == name), None), 10, "the leave event")
    assert leave["reason"] == sig.name
    # only its own tiles in flight (fewer when another device also held one, or had done it)
    assert 0 <= leave["requeued_tiles"] <= leave["in_flight"], leave
    assert f"re-queued the {leave['requeued_tiles']} tile(s)" in last, out


def test_a_stop_during_a_stalled_handshake_ends_at_once(tmp_path: Path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # the kernel accepts; nothing ever answers the ClientHello
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    proc = _join(address, "sha256:" + "ab" * 32, tmp_path, "lan-stalled")
    with listener, killed_at_exit(proc):
        listener.settimeout(60)
        conn, _ = listener.accept()  # it dialled: in the handshake (its timeout: 10 s)
        with conn:
            wait_for(lambda: catches(proc.pid, signal.SIGTERM), 30, "join's SIGTERM handler")
            out, took_s = _stopped(proc, signal.SIGTERM)
    assert proc.returncode == 130, out
    assert took_s < 3.0, (took_s, out)
    assert out.strip().splitlines() == [out.strip().splitlines()[-1]], out  # one line
    assert "SIGTERM: stopped before joining the run" in out, out


def test_ctrl_c_ends_join_while_the_ps_is_frozen(lan_ps: LanPS, tmp_path: Path) -> None:
    """The PS's host froze (or this device's network went away): Ctrl-C used to wait for
    ever on a Work stream that nothing would end."""
    proc = _join(lan_ps.lan_address, lan_ps.fingerprint, tmp_path, "lan-frozen")
    with killed_at_exit(proc):
        wait_for(lambda: _joined(lan_ps, "lan-frozen"), 60, "lan-frozen to join")
        time.sleep(0.5)
        lan_ps.ps.proc.send_signal(signal.SIGSTOP)
        try:
            # the PS frozen for good before the join is stopped: CI once saw the PS answer
            # the join's Leave after kill(SIGSTOP) had returned
            wait_for(lambda: stopped(lan_ps.ps.proc.pid), 10, "the PS to stop")
            out, _ = _stopped(proc, signal.SIGINT)
        finally:
            lan_ps.ps.proc.send_signal(signal.SIGCONT)
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
    assert "SIGINT: left the run without the PS's answer" in out.strip().splitlines()[-1], out
