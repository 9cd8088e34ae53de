"""Can this machine hold a run? Checked by ``testbed up`` before it starts anything.

An emulated run is one PS process plus one agent process per device (plus one node shell per host
on Mininet), all on this machine. Three resources run out first, each with a rule:

* **memory**: the PS ``PS_BASE_BYTES`` + 4 copies of the model's weights (weights, gradients,
  AdamW's two moments), plus per agent ``AGENT_BASE_BYTES`` + its block cache, at most
  ``min(cache, a step's operands)`` (:func:`device_cache_bytes`, :func:`operand_bytes`) and all
  caches together at most ``CACHE_SHARES`` times a step's operands, plus ``SHELL_BYTES`` per
  Mininet host;
  the sum must fit in the memory available now (``MemAvailable``, or what the cgroup still
  allows, whichever is less). Figures measured by ``bench/mininet_scale.py`` (docs/network.md):
  an idle agent's USS is 8.9 MB as a fork of the agent fork server, as ``testbed up`` starts
  it, and 26.5-26.8 MB as a fresh interpreter (``--launch exec``); the PS's RSS 276-366 MB, a
  node shell's 3.4 MB. ``AGENT_BASE_BYTES`` keeps the fresh interpreter's figure: working
  forks of ``topologies/default.yaml`` reached USS 28.5-30.5 MB (phones) and 76-77 MB
  (laptops) with their block caches, which are not measured apart from the rest.
* **tasks** (processes and threads): ``AGENT_TASKS`` per agent (``python -m testbed.agent``:
  main thread, compute thread, gRPC's threads; 10 measured with psutil on a working agent),
  ``PS_TASKS`` for the PS, one per node shell; they must fit under ``kernel.pid_max``,
  ``kernel.threads-max``, the cgroup's ``pids.max`` (each minus the tasks that exist now) and,
  for a user without CAP_SYS_RESOURCE, ``RLIMIT_NPROC``.
* **file descriptors**: the PS holds a socket per agent plus ``PS_BASE_FDS``; children inherit
  ``testbed up``'s ``RLIMIT_NOFILE``. When the soft limit is too low but the hard one is enough,
  :func:`raise_fd_limit` raises the soft limit for the run; when the hard limit is too low the run
  is refused.

Units: bytes (``_bytes``), counts.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.wire.cache import DEFAULT_CACHE_BYTES

MB = 1e6
AGENT_BASE_BYTES = 32 * MB  # a fresh agent's idle USS 26.8 MB (a fork's: 8.9), + headroom
MIN_AGENT_CACHE_BYTES = 64 * 1024 * 1024
CACHE_SHARES = 4  # all agents' caches together: at most this many times a step's operands
PS_BASE_BYTES = 400 * MB  # measured RSS 338-366 MB (torch, grpc, the engine)
SHELL_BYTES = 4 * MB  # a Mininet node shell: measured RSS 3.4 MB
AGENT_TASKS = 12  # measured: 10 threads per working emulated agent (tiny.yaml run), + headroom
PS_TASKS = 64
PS_BASE_FDS = 256
MEMORY_SHARE = 0.9  # leave 10% of what is available to the rest of the machine


@dataclass(frozen=True)
class Needs:
    """What a run will ask of the machine."""

    agents: int
    shells: int  # Mininet node shells (0 on loopback)
    memory_bytes: float
    tasks: int
    fds: int  # the PS's open files and sockets


@dataclass(frozen=True)
class HostLimits:
    """What the machine offers now; None where a limit does not apply or cannot be read."""

    available_bytes: float | None
    memory_source: str
    tasks_free: int | None
    tasks_source: str
    fd_soft: int
    fd_hard: int


def weight_bytes(job: Any) -> float:
    """Bytes of the model's weights (``ModelSpec.parameters``) in the job's dtype."""
    return job.model.parameters * (8 if job.dtype == "float64" else 4)


def operand_bytes(job: Any) -> float:
    """Bytes of a step's GEMM operands: the weights, and each offloaded linear's input and
    output gradient (:func:`~testbed.simulate.chain.linears`), in the job's dtype. Blocks of
    older steps are dropped, so no cache holds more."""
    from testbed.simulate.chain import linears

    tokens = job.batch_size * job.model.seq_len
    columns = sum(lin.d_in + lin.d_out for lin in linears(job))
    return weight_bytes(job) + tokens * columns * (8 if job.dtype == "float64" else 4)


def agent_cache_bytes(job: Any) -> int:
    """The cache budget ``testbed up`` and ``testbed simulate`` give each emulated device: a
    step's operands (:func:`operand_bytes`), between ``MIN_AGENT_CACHE_BYTES`` and the agent's
    default (``DEFAULT_CACHE_BYTES``), whatever the number of devices.

    A plan gives the work to the devices whose links make it worth it, often a few of many
    (10 laptops of 100 devices in ``bench/simulate_scale.py``'s topology), and a linear
    planned on one grid keeps each device's blocks from forward to backward. An even share of
    the operands (four of them a device, as before) left those few a 64 MiB cache: the blocks
    they held were evicted before backward and sent again (one OPT-125m step, 3.93 s of device
    time against 3.37 with room; docs/planning.md). A cache fills only with what its device
    receives, blocks of older steps are dropped, and the memory rule counts all caches
    together at most ``CACHE_SHARES`` times a step's operands."""
    return int(min(DEFAULT_CACHE_BYTES, max(MIN_AGENT_CACHE_BYTES, operand_bytes(job))))


def device_cache_bytes(job: Any, group: Any) -> int:
    """The cache budget of an emulated device of this topology group: the group's ``cache``
    when it sets one (a phone with little memory to spare), else :func:`agent_cache_bytes`."""
    return group.cache_bytes if group.cache_bytes is not None else agent_cache_bytes(job)


def needs_of(topology: Any, backend: str) -> Needs:
    """The run's needs under the rules of the module docstring."""
    agents = len(topology.devices)
    shells = agents + 1 if backend == "mininet" else 0
    weights = weight_bytes(topology.job)
    operands = operand_bytes(topology.job)
    # each agent's cache up to its budget, all of them together what a step sends them (blocks
    # of older steps are dropped): each block to CACHE_SHARES devices on average, a generous
    # figure (hotcarbon's step sends 1.7 times its operands, simulated and emulated)
    cached = min(sum(min(device_cache_bytes(topology.job, d.group), operands)
                     for d in topology.devices), CACHE_SHARES * operands)
    memory = (PS_BASE_BYTES + 4 * weights + agents * AGENT_BASE_BYTES + cached
              + shells * SHELL_BYTES)
    return Needs(agents, shells, memory, agents * AGENT_TASKS + PS_TASKS + shells,
                 agents + PS_BASE_FDS)


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo_available_bytes() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_dir() -> Path | None:
    """This process's cgroup v2 directory, if there is one."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                d = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
                return d if d.is_dir() else None
    except OSError:
        pass
    return None


def _task_count() -> int:
    """Tasks (threads) that exist now, from /proc."""
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                n += len(os.listdir(f"/proc/{d}/task"))
            except OSError:
                continue
    return n


def host_limits() -> HostLimits:
    """Read the machine's limits now (Linux)."""
    available = _meminfo_available_bytes()
    memory_source = "MemAvailable in /proc/meminfo"
    cg = _cgroup_dir()
    if cg is not None:
        limit, used = _read_int(str(cg / "memory.max")), _read_int(str(cg / "memory.current"))
        if limit is not None and used is not None and (available is None
                                                       or limit - used < available):
            available, memory_source = float(limit - used), f"{cg}/memory.max - memory.current"
    tasks = _task_count()
    candidates: list[tuple[int, str]] = []
    for path in ("/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max"):
        value = _read_int(path)
        if value is not None:
            candidates.append((value - tasks, path))
    if cg is not None:
        limit, used = _read_int(str(cg / "pids.max")), _read_int(str(cg / "pids.current"))
        if limit is not None and used is not None:
            candidates.append((limit - used, f"{cg}/pids.max - pids.current"))
    if os.geteuid() != 0:  # RLIMIT_NPROC does not bind root
        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        if soft != resource.RLIM_INFINITY:
            candidates.append((soft - tasks, "RLIMIT_NPROC (ulimit -u)"))
    tasks_free, tasks_source = min(candidates) if candidates else (None, "")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = 1 << 62
    return HostLimits(available, memory_source, tasks_free, tasks_source,
                      inf if soft == resource.RLIM_INFINITY else soft,
                      inf if hard == resource.RLIM_INFINITY else hard)


def problems(needs: Needs, host: HostLimits) -> list[str]:
    """Why the machine cannot hold the run (empty: it can)."""
    out = []
    if host.available_bytes is not None and needs.memory_bytes > MEMORY_SHARE \
            * host.available_bytes:
        out.append(f"memory: {needs.agents} agent(s) and the PS need about "
                   f"{needs.memory_bytes / 1e9:.1f} GB, but only "
                   f"{host.available_bytes / 1e9:.1f} GB is available ({host.memory_source}; "
                   f"a run may use {MEMORY_SHARE:.0%} of it)")
    if host.tasks_free is not None and needs.tasks > host.tasks_free:
        out.append(f"processes: {needs.agents} agent(s) x {AGENT_TASKS} threads"
                   f"{f' + {needs.shells} node shells' if needs.shells else ''} + the PS need "
                   f"{needs.tasks} tasks, but only {max(0, host.tasks_free)} more fit "
                   f"({host.tasks_source})")
    if needs.fds > host.fd_hard:
        out.append(f"file descriptors: the PS needs about {needs.fds} ({needs.agents} "
                   f"connections + {PS_BASE_FDS}), but the hard limit is {host.fd_hard} "
                   f"(RLIMIT_NOFILE, ulimit -Hn)")
    return out


def raise_fd_limit(needs: Needs) -> None:
    """Raise this process's soft RLIMIT_NOFILE to what the run needs (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needs.fds:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needs.fds, hard) if hard !=
                                                   resource.RLIM_INFINITY else needs.fds, hard))


def check(topology: Any, backend: str) -> tuple[Needs, list[str]]:
    """The run's needs and the machine's problems with them, read now."""
    needs = needs_of(topology, backend)
    return needs, problems(needs, host_limits())
