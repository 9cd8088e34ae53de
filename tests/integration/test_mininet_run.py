"""`testbed up` on the Mininet backend, through the real command line (a subprocess).

* Parity: the same small float64 job on loopback and on Mininet gives the same losses.
* Campus bottleneck: behind one slow shared uplink, the PS's traffic never exceeds the uplink's
  rate (byte counters of the PS host's interface and of the uplink's ports, sampled while the run
  goes), the uplink is busy, and the steps are far longer than with a 10x faster uplink.
* Teardown: after a finished run, a SIGINT'ed one (exit 130) and a SIGKILL'ed one followed by
  ``testbed clean RUN_DIR``, nothing of the run is left: no process (pids.json, node shells,
  anything in the run's namespaces or carrying its prefix), no namespace, no interface.

Only things of the run are compared (its prefix from ``RUN_DIR/network.json``, its pids and
namespaces): other engineers create their own interfaces and processes at the same time.
Needs root and Mininet; skips naming what is missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest
import yaml

from testbed.emulator.network import cleanup
from testbed.emulator.network.probe import probe

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(probe().missing()),
                                 reason="Mininet backend unavailable, missing: "
                                        + "; ".join(probe().missing()))]

TESTBED = [sys.executable, "-m", "testbed.cli"]
RUN_TIMEOUT_S = 120.0

# A tiny job: 2 layers of width 32, float64, every GEMM tiled and sent to the devices.
JOB = {"model": {"family": "opt", "hidden": 32, "layers": 2, "heads": 2, "ffn": 64,
                 "seq_len": 16},
       "data": "builtin", "batch_size": 2, "steps": 3, "dtype": "float64",
       "optimizer": {"name": "adamw", "lr": 1e-3},
       "parallelism": {"strategy": "tile-tp", "tile": 16, "min_offload_flops": 0}}


def small_topology(backend: str, steps: int = 3) -> dict[str, Any]:
    """~4 devices on one access point, fast links, the tiny job."""
    return {"name": "small", "seed": 3,
            "network": {"backend": backend, "switches": ["ap0"],
                        "ps": {"switch": "ap0", "link": {"down": "1Gbit", "up": "1Gbit",
                                                         "delay": "0.1ms"}}},
            "devices": [{"group": "phones", "profile": "snapdragon888", "count": 3,
                         "switch": "ap0", "link": {"down": "1Gbit", "up": "1Gbit",
                                                   "delay": "0.1ms"}},
                        {"group": "laptops", "profile": "m2pro", "count": 1, "switch": "ap0",
                         "link": {"down": "1Gbit", "up": "1Gbit", "delay": "0.1ms"}}],
            "job": {**JOB, "steps": steps}, "time_dilation": 1}


UPLINK_QUEUE = 20  # packets: keeps what can sit in front of the uplink small and known


def campus_topology(uplink_bps: float) -> dict[str, Any]:
    """Two access switches behind a core; one shared uplink core-dc toward the PS."""
    rate = f"{uplink_bps:.0f}bit"
    fast = {"down": "1Gbit", "up": "1Gbit"}
    return {"name": "campus-bottleneck", "seed": 5,
            "network": {"backend": "mininet", "switches": ["dc", "core", "acc0", "acc1"],
                        "links": [{"switches": ["dc", "core"], "down": rate, "up": rate,
                                   "queue": UPLINK_QUEUE},
                                  {"switches": ["core", "acc0"], **fast},
                                  {"switches": ["core", "acc1"], **fast}],
                        "ps": {"switch": "dc", "link": fast}},
            "devices": [{"group": "lab", "profile": "m2pro", "count": 3, "switch": "acc0",
                         "link": {"down": "100Mbit", "up": "100Mbit"}},
                        {"group": "dorm", "profile": "snapdragon888", "count": 3,
                         "switch": "acc1", "link": {"down": "100Mbit", "up": "50Mbit"}}],
            "job": JOB, "time_dilation": 1}


# -- listings -------------------------------------------------------------------------------------

def root_links() -> set[str]:
    """Interface names of the root namespace (`ip -o link`)."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                         check=True).stdout
    return {line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines()}


def named_netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


ROOT_NETNS = netns_inode(os.getpid())


def cmdline_has(pid: int, needle: str) -> bool:
    try:
        return needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def environ_has(pid: int, entry: str) -> bool:
    try:
        return entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def processes_of(prefix: str, netns: set[int], ended_s: float | None = None) -> set[int]:
    """Every live pid that is the run's: node shell, prefix marker, or inside its namespaces.

    ``ended_s``: when the run ended. The kernel reuses a freed namespace's inode number, so once
    the run's namespaces are gone another run's (on a shared host, any program's) may have the
    same number: a process inside it counts only if it started before the run ended."""
    def started_in_run(pid: int) -> bool:
        try:
            return ended_s is None or psutil.Process(pid).create_time() <= ended_s
        except psutil.Error:
            return False
    return {pid for pid in psutil.pids()
            if cmdline_has(pid, f"mininet:{prefix}")
            or environ_has(pid, f"TESTBED_NET_PREFIX={prefix}")
            or (netns_inode(pid) in netns and started_in_run(pid))}


@dataclass
class Seen:
    """What a run had while it ran (to check later that all of it is gone)."""

    prefix: str = ""
    pids: dict[str, Any] = field(default_factory=dict)  # pids.json
    procs: list[psutil.Process] = field(default_factory=list)
    netns: set[int] = field(default_factory=set)
    links: set[str] = field(default_factory=set)


# -- running `testbed up` -------------------------------------------------------------------------

STARTED: list[Up] = []


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test():
    """A test that fails half-way must not leave its `testbed up` running."""
    yield
    while STARTED:
        STARTED.pop().abandon()


class Up:
    """`testbed up TOPOLOGY --no-live --out OUT` as a subprocess, observed from outside."""

    def __init__(self, tmp: Path, topology: dict[str, Any], name: str):
        self.out = tmp / f"runs-{name}"
        self.path = tmp / f"{name}.yaml"
        self.path.write_text(yaml.safe_dump(topology, sort_keys=False))
        self.log = tmp / f"{name}.out"
        self.named_before = named_netns()
        self.ended_s: float | None = None  # when `testbed up` exited (wait)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([*TESTBED, "up", str(self.path), "--no-live", "--out",
                                          str(self.out)], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self.seen = Seen()
        STARTED.append(self)

    def abandon(self) -> None:
        """A failed test's run: stop it (SIGTERM, as Ctrl-C) or kill it and `testbed clean`."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            if self._file("pids.json") is not None:
                subprocess.run([*TESTBED, "clean", str(self.run_dir)], capture_output=True,
                               timeout=60)

    @property
    def run_dir(self) -> Path:
        dirs = [d for d in self.out.iterdir() if d.is_dir()] if self.out.exists() else []
        assert len(dirs) == 1, f"expected one run directory in {self.out}, got {dirs}"
        return dirs[0]

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_until(self, what: str, ready: Callable[[], bool], timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.proc.poll() is not None:
                pytest.fail(f"testbed up exited {self.proc.returncode} before {what}:\n"
                            f"{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout_s} s:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def _file(self, name: str) -> Path | None:
        if not self.out.exists() or not any(self.out.iterdir()):
            return None
        p = self.run_dir / name
        return p if p.exists() else None

    def _all_started(self) -> bool:
        path = self._file("pids.json")  # rewritten as each process starts
        try:
            return path is not None and json.loads(path.read_text()).get("starting") is False
        except json.JSONDecodeError:
            return False

    def observe(self) -> Seen:
        """Once the agents run: record the run's prefix, pids, node shells, namespaces, links."""
        self.wait_until("pids.json with every agent started", self._all_started)
        seen = self.seen
        net = json.loads(self.run_dir.joinpath("network.json").read_text())
        assert net["backend"] == "mininet", net
        seen.prefix = net["prefix"]
        seen.pids = json.loads(self.run_dir.joinpath("pids.json").read_text())
        shells = [p for p in psutil.pids() if cmdline_has(p, f"mininet:{seen.prefix}")]
        seen.netns = {netns_inode(p) for p in shells} - {None, ROOT_NETNS}
        assert len(seen.netns) == len(seen.pids["agents"]) + 1, "one namespace per host"
        tracked = set(shells) | {seen.pids["ps"], *seen.pids["agents"].values()}
        tracked |= processes_of(seen.prefix, seen.netns)
        for pid in tracked:
            try:
                seen.procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        assert {netns_inode(seen.pids["ps"])} | {netns_inode(p) for p in
                                                 seen.pids["agents"].values()} <= seen.netns, \
            "the PS and the agents run inside the run's hosts"
        seen.links = {n for n in root_links() if n.startswith(seen.prefix)}
        assert seen.links, "the run has bridges and ports in the root namespace"
        return seen

    def steps(self) -> list[dict[str, Any]]:
        p = self._file("steps.jsonl")
        if p is None:
            return []
        return [json.loads(line) for line in p.read_text().splitlines() if line.endswith("}")]

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> int:
        try:
            code = self.proc.wait(timeout_s)
            self.ended_s = time.time()
            return code
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"testbed up did not end within {timeout_s} s:\n{self.output()[-3000:]}")

    def summary(self) -> dict[str, Any]:
        return json.loads(self.run_dir.joinpath("summary.json").read_text())


def alive_not_zombie(p: psutil.Process) -> bool:
    """Whether this very process (pid and start time) still runs."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_nothing_left(up: Up) -> None:
    """No process, namespace or interface of the run remains; `ip netns` is unchanged."""
    seen = up.seen
    assert seen.prefix and seen.procs and seen.netns and seen.links, "observe() ran"
    alive = [p for p in seen.procs if alive_not_zombie(p)]
    assert not alive, f"processes of the run still alive: {alive}"
    for pid in [seen.pids["ps"], *seen.pids["agents"].values()]:
        assert not (psutil.pid_exists(pid) and (cmdline_has(pid, "testbed.agent")
                                                or cmdline_has(pid, "testbed.ps_backend"))), pid
    assert not processes_of(seen.prefix, seen.netns, up.ended_s), "a process of the run is left"
    in_use = {netns_inode(p) for p in psutil.pids()}
    assert not (seen.netns & in_use), "a namespace of the run is still in use"
    left = {n for n in root_links() if n.startswith(seen.prefix)}
    assert not left, f"interfaces of the run left: {sorted(left)}"
    assert named_netns() == up.named_before
    assert not cleanup.record_path(seen.prefix).exists(), "the run record is removed"


# -- parity and the finished run ------------------------------------------------------------------

@pytest.fixture(scope="module")
def finished_mininet_run(tmp_path_factory) -> Up:
    """The small job on Mininet, run to its end."""
    up = Up(tmp_path_factory.mktemp("mn"), small_topology("mininet"), "small-mininet")
    up.observe()
    assert up.wait() == 0, up.output()[-3000:]
    return up


@pytest.mark.slow
def test_same_losses_on_loopback_and_mininet(tmp_path, finished_mininet_run):
    lo = Up(tmp_path, small_topology("loopback"), "small-loopback")
    assert lo.wait() == 0, lo.output()[-3000:]
    mn = finished_mininet_run
    s_lo, s_mn = lo.summary(), mn.summary()
    assert s_lo["network"]["backend"] == "loopback"
    assert s_mn["network"]["backend"] == "mininet"
    assert s_mn["network"]["delay"] in ("netem", "application")  # the mechanism is stated
    for s in (s_lo, s_mn):
        assert s["state"] == "done" and s["steps_done"] == 3
        assert s["tiles"] > 0 and all(st["gemms_local"] == 0 for st in
                                      (lo.steps() if s is s_lo else mn.steps()))
        assert len({d["device"] for d in s["devices"]}) == 4  # every device joined
        assert sum(d["tiles_done"] for d in s["devices"]) >= s["tiles"]  # devices computed
    assert len(s_lo["losses"]) == len(s_mn["losses"]) == 3
    assert s_mn["losses"] == pytest.approx(s_lo["losses"], rel=1e-9, abs=0)
    steps_lo = [st["loss"] for st in lo.steps()]
    steps_mn = [st["loss"] for st in mn.steps()]
    assert steps_mn == pytest.approx(steps_lo, rel=1e-9, abs=0)
    assert steps_lo == s_lo["losses"]


@pytest.mark.slow
def test_finished_run_leaves_nothing(finished_mininet_run):
    assert_nothing_left(finished_mininet_run)


# -- teardown after SIGINT and SIGKILL ------------------------------------------------------------

def start_training(tmp_path: Path, name: str) -> Up:
    """A long run of the small job on Mininet, observed, and past its first step."""
    up = Up(tmp_path, small_topology("mininet", steps=400), name)
    up.observe()
    up.wait_until("a training step", lambda: len(up.steps()) >= 1)
    return up


@pytest.mark.slow
def test_sigint_exits_130_and_leaves_nothing(tmp_path):
    up = start_training(tmp_path, "sigint")
    up.proc.send_signal(signal.SIGINT)
    assert up.wait(60) == 130, up.output()[-3000:]
    summary = up.summary()
    assert summary["exit_code"] == 130 and summary["interrupted_by"] == ["SIGINT"]
    assert summary["state"] == "interrupted" and summary["steps_done"] < 400
    assert_nothing_left(up)


@pytest.mark.slow
def test_sigkill_then_clean_run_dir_leaves_nothing(tmp_path):
    up = start_training(tmp_path, "sigkill")
    up.proc.send_signal(signal.SIGKILL)
    up.wait(10)
    prefix = up.seen.prefix
    # PR_SET_PDEATHSIG takes the PS and the agents with testbed up, and the node shells end when
    # their pty closes (the namespaces go with them); the bridges stay for `testbed clean`.
    time.sleep(1.0)
    left = {n for n in root_links() if n.startswith(prefix)}
    assert f"{prefix}s0" in left, "a SIGKILLed run leaves its bridge for `testbed clean`"
    done = subprocess.run([*TESTBED, "clean", str(up.run_dir)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert prefix in done.stdout, done.stdout
    assert_nothing_left(up)


# -- the campus bottleneck ------------------------------------------------------------------------

def read_counters(ps_shell: int, ps_intf: str, uplink_ports: tuple[str, str]) -> dict[str, int]:
    """Byte counters: the PS host's interface (in its namespace) and the uplink's two ports."""
    counters: dict[str, int] = {}
    for line in Path(f"/proc/{ps_shell}/net/dev").read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        if name.strip() == ps_intf:
            f = rest.split()
            counters["ps_rx"], counters["ps_tx"] = int(f[0]), int(f[8])
    snmp = [line.split() for line in Path(f"/proc/{ps_shell}/net/snmp").read_text().splitlines()
            if line.startswith("Tcp:")]
    tcp = dict(zip(snmp[0][1:], snmp[1][1:]))
    counters["ps_retrans_segs"] = int(tcp["RetransSegs"])
    upper, lower = uplink_ports
    stats = "/sys/class/net/{}/statistics/{}"
    counters["uplink_down_rx"] = int(Path(stats.format(lower, "rx_bytes")).read_text())
    counters["uplink_down"] = int(Path(stats.format(upper, "tx_bytes")).read_text())
    counters["uplink_up"] = int(Path(stats.format(lower, "tx_bytes")).read_text())
    return counters


class Sampler(threading.Thread):
    """Samples read_counters() every period until stopped: [(monotonic s, counters)]."""

    def __init__(self, read: Callable[[], dict[str, int]], period_s: float = 0.1):
        super().__init__(daemon=True)
        self.read, self.period_s = read, period_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append((time.monotonic(), self.read()))
            except (OSError, KeyError):  # the PS's namespace went away at the end
                return
            self.stop.wait(self.period_s)


def uplink_ports(prefix: str) -> tuple[str, str]:
    """The uplink dc-core's ports by the naming plan, checked to be one veth pair on the bridges."""
    upper, lower = f"{prefix}s0e2", f"{prefix}s1e1"  # dc: e1 = PS; core: e1 = first link
    sys_net = Path("/sys/class/net")
    assert (sys_net / upper / "master").resolve().name == f"{prefix}s0"
    assert (sys_net / lower / "master").resolve().name == f"{prefix}s1"
    assert (sys_net / upper / "iflink").read_text() == (sys_net / lower / "ifindex").read_text()
    return upper, lower


def max_window_bps(samples: list[tuple[float, dict[str, int]]], key: str,
                   window_s: float) -> float:
    """The largest mean rate (bit/s) of counter `key` over any span of at least window_s."""
    best_bps = 0.0
    j = 0
    for t0, c0 in samples:
        while j < len(samples) and samples[j][0] - t0 < window_s:
            j += 1
        if j == len(samples):
            break
        t1, c1 = samples[j]
        best_bps = max(best_bps, 8 * (c1[key] - c0[key]) / (t1 - t0))
    return best_bps


def campus_run(tmp_path: Path, uplink_bps: float, name: str) -> tuple[Up, list]:
    """Run the campus job; sample the PS's and the uplink's counters while it trains."""
    up = Up(tmp_path, campus_topology(uplink_bps), name)
    seen = up.observe()
    shell = next(p for p in psutil.pids() if cmdline_has(p, f"mininet:{seen.prefix}ps"))
    ports = uplink_ports(seen.prefix)
    sampler = Sampler(lambda: read_counters(shell, f"{seen.prefix}pse0", ports))
    sampler.start()
    try:
        assert up.wait() == 0, up.output()[-3000:]
    finally:
        sampler.stop.set()
        sampler.join()
    return up, sampler.samples


@pytest.mark.slow
def test_campus_uplink_is_the_bottleneck(tmp_path):
    slow_bps, fast_bps = 4e6, 40e6
    slow, samples = campus_run(tmp_path, slow_bps, "campus-slow")
    window_s = 2.0
    # the run is sampled across several of the windows below, each spanned by many samples (it
    # lasts about 5 s: a sample count of 50, asked for before, was met or missed by one)
    span_s = samples[-1][0] - samples[0][0]
    assert span_s >= 2 * window_s and len(samples) >= 10 * span_s / window_s, \
        (span_s, len(samples))
    # Bytes that may pass a counter ahead of the uplink's HTB: its burst, its queue, slack.
    allowance_bytes = 15_000 + UPLINK_QUEUE * 1514 + 4 * 1514
    limit_bps = slow_bps + 8 * allowance_bytes / window_s
    keys = ("ps_rx", "uplink_up", "uplink_down", "uplink_down_rx", "ps_tx")
    peak = {key: max_window_bps(samples, key, window_s) for key in keys}
    (t0, c0), (t1, c1) = samples[0], samples[-1]
    total = {key: c1[key] - c0[key] for key in c0}
    print(f"\ncampus at {slow_bps / 1e6:g} Mbit/s over {t1 - t0:.1f} s: bytes {total}; peak "
          f"{window_s:g}-s rates (Mbit/s) { {k: round(v / 1e6, 3) for k, v in peak.items()} }")
    # What the PS receives, and what the PS's sending puts through toward the devices (both
    # ends of the uplink), never exceed the uplink's rate over any 2 s.
    for key in ("ps_rx", "uplink_up", "uplink_down", "uplink_down_rx"):
        assert peak[key] <= limit_bps, f"{key}: {peak[key] / 1e6:.3f} Mbit/s over " \
                                       f"{window_s} s exceeds the {slow_bps / 1e6:g} Mbit/s uplink"
    # All of the PS's traffic crosses the uplink: up, everything it receives; down, everything it
    # sends but the frames the uplink's queue dropped (TCP sent those again: ps_tx counts both).
    # A sample reads the PS's counters before the uplink's, so a frame sent between the two
    # reads of the last sample counts on the uplink only (seen: 340 bytes over 2.2 MB).
    assert total["uplink_up"] == pytest.approx(total["ps_rx"], rel=0.01)
    assert total["uplink_down"] <= total["ps_tx"] + 4 * 1514
    assert total["uplink_down"] >= 0.8 * total["ps_tx"]
    if total["ps_tx"] - total["uplink_down"] > 64 * 1514:
        assert total["ps_retrans_segs"] > 0, "frames were dropped, so TCP retransmitted"
    # The uplink is busy: it is what limits the run.
    assert peak["uplink_down"] >= 0.7 * slow_bps, peak
    steps_slow = slow.steps()
    assert len(steps_slow) == 3
    for st in steps_slow:  # a step cannot beat its downlink bytes through the uplink
        assert st["wall_s"] >= 0.95 * 8 * st["bytes_down"] / slow_bps, st
    fast, _ = campus_run(tmp_path, fast_bps, "campus-fast")
    steps_fast = fast.steps()
    assert slow.summary()["losses"] == fast.summary()["losses"]  # same job, other network
    mean_slow = sum(s["wall_s"] for s in steps_slow) / len(steps_slow)
    mean_fast = sum(s["wall_s"] for s in steps_fast) / len(steps_fast)
    print(f"campus: mean step {mean_slow:.2f} s at {slow_bps / 1e6:g} Mbit/s, "
          f"{mean_fast:.2f} s at {fast_bps / 1e6:g} Mbit/s")
    assert mean_slow >= 2 * mean_fast, (mean_slow, mean_fast)  # ~4-6x on a quiet machine
