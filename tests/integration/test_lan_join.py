"""A device on another machine: an agent in a network namespace of its own (its own stack, a
veth to this one) joins over TLS with the PS's pinned certificate (`testbed join`). A wrong
fingerprint and a wrong token are refused with clear messages, and the token is on no process's
command line."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from testbed.runlog import read_jsonl
from tests.adversarial.psproc import TOKEN, PsProcess
from tests.conftest import REPO, TINY, wait_for

pytestmark = pytest.mark.integration


class LanNamespace:
    """A namespace `tbl<id>` joined to this one by a veth pair with a /30 of its own."""

    def __init__(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            pytest.skip("needs root and iproute2 to make a network namespace")
        tag = secrets.token_hex(2)
        self.name, self.here, self.there = f"tbl{tag}", f"tbl{tag}a", f"tbl{tag}b"
        octet = int(tag, 16) % 250 + 1
        self.ps_ip, self.device_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"
        for cmd in (["ip", "netns", "add", self.name],
                    ["ip", "link", "add", self.here, "type", "veth", "peer", "name", self.there],
                    ["ip", "link", "set", self.there, "netns", self.name],
                    ["ip", "addr", "add", f"{self.ps_ip}/30", "dev", self.here],
                    ["ip", "link", "set", self.here, "up"],
                    ["ip", "-n", self.name, "addr", "add", f"{self.device_ip}/30", "dev",
                     self.there],
                    ["ip", "-n", self.name, "link", "set", self.there, "up"],
                    ["ip", "-n", self.name, "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)

    def popen(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.name, *argv], env=env, cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.here], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


def _lan_topology(tmp_path: Path, listen: str, steps: int) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw["network"] = {"backend": "loopback", "ps": {"listen": listen}}
    raw["job"]["steps"] = steps
    path = tmp_path / "lan.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _no_token_in_any_cmdline(token: str) -> None:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert token.encode() not in cmdline.read_bytes(), f"token in {cmdline}"
        except OSError:  # the process ended meanwhile
            pass


@pytest.mark.parametrize("everywhere", [False, True], ids=["its-address", "0.0.0.0"])
def test_a_lan_device_joins_over_tls_with_the_pinned_certificate(tmp_path: Path,
                                                                 everywhere: bool) -> None:
    """The PS listens on the address the device reaches, or on every address of its host; then
    the device takes that address from the several the PS names (ps.json's lan_addresses, as
    `testbed up` prints them)."""
    ns = LanNamespace()
    steps = 3
    try:
        listen = "0.0.0.0:0" if everywhere else f"{ns.ps_ip}:0"
        topology = _lan_topology(tmp_path, listen, steps)
        with PsProcess(topology, tmp_path / "run", "--expect-devices", "1") as ps:
            info = json.loads((ps.run_dir / "ps.json").read_text())
            addresses, fingerprint = info["lan_addresses"], info["fingerprint"]
            assert info["lan_address"] == addresses[0] and fingerprint.startswith("sha256:")
            assert not any(a.startswith(("0.0.0.0:", "127.")) for a in addresses), addresses
            (address,) = [a for a in addresses if a.startswith(ns.ps_ip + ":")]
            assert everywhere or addresses == [address]
            assert oct((ps.run_dir / "ps-tls.key").stat().st_mode & 0o777) == "0o600"
            token_file = tmp_path / "token"
            token_file.write_text(TOKEN + "\n")
            wrong_token = tmp_path / "wrong-token"
            wrong_token.write_text("not-the-token\n")
            env = {k: v for k, v in ps.env.items() if k != "TESTBED_TOKEN"}
            join = [sys.executable, "-m", "testbed.cli", "join", address]

            # another certificate's fingerprint: refused before the token is sent
            other = "sha256:" + "ab" * 32
            bad_pin = ns.popen([*join, "--fingerprint", other, "--token-file", str(token_file),
                                "--name", "lan-pin"], env)
            out, _ = bad_pin.communicate(timeout=60)
            assert bad_pin.returncode == 3, out
            assert "not the pinned" in out and fingerprint in out, out

            # the right certificate, the wrong token
            bad_token = ns.popen([*join, "--fingerprint", fingerprint, "--token-file",
                                  str(wrong_token), "--name", "lan-token"], env)
            out, _ = bad_token.communicate(timeout=60)
            assert bad_token.returncode == 3, out
            assert "join refused" in out and "wrong join token" in out, out

            good = ns.popen([*join, "--fingerprint", fingerprint, "--token-file",
                             str(token_file), "--name", "lan-0"], env)
            ps.agents.append(good)
            # three tiny steps of one device can be done between two looks
            wait_for(lambda: ps.status().get("state") in ("training", "done"), 120, "training")
            _no_token_in_any_cmdline(TOKEN)
            code, output = ps.finish()
            assert code == 0, output
            good_out, _ = good.communicate(timeout=60)
            assert good.returncode == 0, good_out
        ps.assert_losses_match(steps)
        records = {r["device"]: r for r in read_jsonl(ps.run_dir / "devices.jsonl")}
        assert records["lan-0"]["kind"] == "real"
        assert records["lan-0"]["tiles_done"] > 0
        joins = [e for e in ps.events() if e["event"] == "join" and e.get("device") == "lan-0"]
        assert joins, "the LAN device's join is logged"
    finally:
        ns.close()


def test_listen_must_be_an_ip_and_a_port(tmp_path: Path) -> None:
    raw = yaml.safe_load(TINY.read_text())
    raw["network"] = {"backend": "loopback", "ps": {"listen": "my-laptop:99999"}}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "testbed.cli", "validate", str(bad)],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "network.ps.listen" in proc.stderr and "HOST:PORT" in proc.stderr, proc.stderr
