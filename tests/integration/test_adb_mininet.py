"""A phone placed in a Mininet topology: its traffic enters at a host of its own.

The fake adb server (a thread of this test) plugs one ``agent_phone``; the real agent runs as a
local process that reaches the host only through the phone's ``adb reverse`` rule. ``testbed
up`` (a subprocess) runs on the Mininet backend with the phone placed on the access point with a
link of its own. The test shows:

* the phone's connection to the PS comes from its own host (10.0.0.6: after the 4 devices),
  through the forwarder running in that host's namespace (``/proc/PID/net/tcp`` of the PS and of
  the forwarder: a connection between the phone's address and the PS's);
* its bytes cross its own shaped link: the host interface's counters grow while it computes, and
  the HTB class on that interface has the phone's ``up`` rate (scaled for whole frames, so the
  payload gets it) and carried those bytes;
* a USB hiccup, then the cable pulled mid-step: every tile the phone held is re-queued, the job
  ends, and the losses equal those of the same model trained in one process;
* ``summary.json`` has the phone's interface counters, read at stop.

Needs root, Mininet and the ``adb`` client's fake; skips naming what is missing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from testbed.emulator.network.base import wire_rate_bps
from testbed.emulator.network.probe import probe
from testbed.runlog import read_jsonl
from tests.conftest import (
    TINY,
    killed_at_exit,
    read_status,
    reference_losses,
    run_dir_of,
    start_up,
    wait_for,
)
from tests.fakes.adb_phones import agent_phone
from tests.fakes.fake_adb import FakeAdbServer

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(bool(probe().missing()),
                                 reason="Mininet backend unavailable, missing: "
                                        + "; ".join(probe().missing()))]
SERIAL = "MNPHONE1"
NAME = "adb-mnphone1"
PHONE_IP = "10.0.0.6"  # device_ip(4): after the topology's 4 devices
PS_IP = "10.0.0.1"
UP_RATE, UP_RATE_BPS = "20Mbit", 20e6
STEPS = 60


@pytest.fixture
def fake_adb_server() -> Iterator[FakeAdbServer]:
    server = FakeAdbServer().start()
    yield server
    server.stop()


def _topology(tmp_path: Path, adb_port: int) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw["network"] = {"backend": "mininet", "switches": ["ap0"],
                      "ps": {"switch": "ap0", "link": {"down": "1Gbit", "up": "1Gbit"}}}
    for group in raw["devices"]:
        group["switch"] = "ap0"
    raw["job"]["steps"] = STEPS
    raw["adb"] = {"enabled": True, "server": f"127.0.0.1:{adb_port}",
                  "telemetry_interval": "300ms",
                  "serials": {SERIAL: {"switch": "ap0",
                                       "link": {"down": "50Mbit", "up": UP_RATE}}}}
    path = tmp_path / "mn-phone.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _ip_hex(ip: str) -> str:
    """An IPv4 address as /proc/net/tcp writes it (little-endian hex)."""
    return "".join(f"{int(b):02X}" for b in reversed(ip.split(".")))


V4_MAPPED = "0000000000000000FFFF0000"  # ::ffff:0:0/96 as /proc/net/tcp6 writes it


def _tcp_established(pid: int) -> list[tuple[str, str]]:
    """(local ip:port, remote ip:port) of the established TCP connections in pid's netns."""
    def v4(end: str) -> str:  # an IPv4-mapped IPv6 address (::ffff:a.b.c.d) as its IPv4 form
        addr, _, port = end.partition(":")
        return f"{addr[-8:]}:{port}" if addr.startswith(V4_MAPPED) else end

    rows = []
    for table in ("tcp", "tcp6"):  # a dual-stack listener's IPv4 peers show in tcp6
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "01":  # ESTABLISHED
                rows.append((v4(f[1]), v4(f[2])))
    return rows


def _intf_tx_bytes(pid: int, intf: str) -> int:
    for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        if name.strip() == intf:
            return int(rest.split()[8])
    raise KeyError(intf)


def _phone_row(run_dir: Path) -> dict[str, Any] | None:
    return next((d for d in read_status(run_dir).get("devices", []) if d["device"] == NAME
                 and d.get("state") != "left"), None)


@pytest.mark.skipif(shutil.which("mnexec") is None, reason="mnexec not on PATH")
def test_phone_in_its_own_mininet_host(fake_adb_server: FakeAdbServer, tmp_path: Path) -> None:
    fake_adb_server.plug(agent_phone(
        SERIAL, tmp_path / "phone", tmp_path / "phone-logs",
        env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}))
    topology = _topology(tmp_path, fake_adb_server.port)
    out = tmp_path / "runs"
    proc = start_up(topology, out, "--join-timeout", "90")
    with killed_at_exit(proc):
        run_dir = run_dir_of(out)
        wait_for(lambda: (_phone_row(run_dir) or {}).get("tiles_done", 0) > 0, 120,
                 f"{NAME} to compute tiles")
        events = read_jsonl(run_dir / "events.jsonl")
        fwd = next(e for e in events if e["event"] == "adb_forwarder_started")
        assert fwd["ip"] == PHONE_IP and fwd["device"] == NAME
        intf = f"{fwd['host']}e0"
        ps_pid = json.loads((run_dir / "pids.json").read_text())["ps"]
        ps_port = json.loads((run_dir / "ps.json").read_text())["port"]
        ps_end = f"{_ip_hex(PS_IP)}:{ps_port:04X}"
        # The PS's namespace sees the phone at its host's address ...
        assert any(local == ps_end and remote.startswith(_ip_hex(PHONE_IP) + ":")
                   for local, remote in _tcp_established(ps_pid)), _tcp_established(ps_pid)
        # ... and the forwarder, in that host, holds the other end.
        assert any(local.startswith(_ip_hex(PHONE_IP) + ":") and remote == ps_end
                   for local, remote in _tcp_established(fwd["pid"]))
        # Its bytes cross its own link: the host interface counts them while it computes,
        # and the HTB class on it (the phone's up rate) carried them.
        tx0 = _intf_tx_bytes(fwd["pid"], intf)
        done0 = (_phone_row(run_dir) or {}).get("tiles_done", 0)
        wait_for(lambda: (_phone_row(run_dir) or {}).get("tiles_done", 0) > done0 + 2, 60,
                 f"{NAME} to compute more tiles")
        tx1 = _intf_tx_bytes(fwd["pid"], intf)
        assert tx1 > tx0 + 2 * 16 * 16 * 8  # at least two float64 16x16 results went up
        tc = subprocess.run(["mnexec", "-a", str(fwd["pid"]), "tc", "-s", "class", "show",
                             "dev", intf], capture_output=True, text=True, check=True).stdout
        # the class runs at the rate that gives the payload the phone's up rate
        rates = [float(x) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[unit]
                 for x, unit in re.findall(r"\brate (\d+(?:\.\d+)?)([KMG]?)bit", tc)]
        assert any(r == pytest.approx(wire_rate_bps(UP_RATE_BPS), rel=1e-3) for r in rates), tc
        sent = int(tc.split("Sent ", 1)[1].split()[0])
        assert sent >= tx0 // 2, (sent, tx0)  # the phone's traffic went through the class
        # A USB hiccup, then the cable pulled as the first tiles of the new session arrive.
        fake_adb_server.drop_connections(SERIAL)
        unplugged = fake_adb_server.unplug_on_download(SERIAL, min_bytes=2048)
        assert unplugged.wait(60), "the phone got no tiles after it joined again"
        output, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, output

    events = read_jsonl(run_dir / "events.jsonl")
    start = next(e for e in events if e["event"] == "training_start")
    assert start["expected_devices"] == 5 and start["devices"] == 5
    departures = [e for e in events if e.get("device") == NAME
                  and e["event"] in ("disconnect", "leave", "lease_expired")]
    assert [d["event"] for d in departures] == ["disconnect", "disconnect"], departures
    gone = departures[-1]
    assert gone["in_flight"] >= 1
    assert gone["requeued_tiles"] == len(gone["requeued"]) == gone["in_flight"]
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(STEPS))
    want, _ = reference_losses(topology, STEPS)
    for s, w in zip(steps, want):
        assert abs(s["loss"] - w) <= 1e-8 * max(abs(w), 1e-12), (s["step"], s["loss"], w)

    summary = json.loads((run_dir / "summary.json").read_text())
    link = summary["adb"]["links"][NAME]
    assert link["intf"] == intf and link["tx_bytes"] >= tx1 and link["rx_bytes"] > 0
    assert not (run_dir / "adb-fwd").exists()  # the socket directory is removed at stop
