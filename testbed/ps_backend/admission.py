"""Admission: what the PS lets in before a device is registered, and how many connections.

Limits against hostile or broken clients (docs/fault-tolerance.md, "Limits"): joins are
rate-limited per peer address before the token is even checked (:class:`JoinLimiter`), refused
joins are counted and logged at a bounded rate (:class:`RefusalLog`), and the number of TCP
connections is capped below the file-descriptor limit (:func:`connection_cap`), so that the PS's
own files (checkpoints, ledger segments, run logs) always find a descriptor.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from typing import Callable

from testbed.ps_backend.validation import clip_text

log = logging.getLogger(__name__)

FD_RESERVE = 256  # file descriptors kept back from gRPC for the PS's own files (checkpoints,
# ledger segments, run logs, torch): connections beyond the rest are closed as they arrive
MIN_CONNECTIONS = 64
JOINS_PER_S_PER_PEER = 100.0  # refill rate of each peer address's join bucket
JOIN_BURST_PER_PEER = 500.0  # bucket size: a loopback run's agents all join from 127.0.0.1
PEER_BUCKETS_MAX = 4096  # addresses remembered; beyond, one shared bucket for the rest
REFUSAL_EVENT_PERIOD_S = 1.0  # at most one join_refused event per reason in this period


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    elif hard == resource.RLIM_INFINITY and soft != hard:
        soft = max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        except (ValueError, OSError):
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return int(soft)


def connection_cap(fd_limit: int) -> int:
    """Most TCP connections the PS accepts at once for a soft fd limit."""
    return max(MIN_CONNECTIONS, fd_limit - FD_RESERVE)



class JoinLimiter:
    """Token buckets per peer address, consulted before the token is even checked."""

    def __init__(self, rate_per_s: float = JOINS_PER_S_PER_PEER,
                 burst: float = JOIN_BURST_PER_PEER, max_peers: int = PEER_BUCKETS_MAX):
        self.rate_per_s, self.burst, self.max_peers = rate_per_s, burst, max_peers
        self._buckets: dict[str, tuple[float, float]] = {}  # peer -> (tokens, last time)

    def allow(self, peer: str, now_s: float | None = None) -> bool:
        """Whether a join from this peer address may proceed now (takes one token)."""
        now_s = time.monotonic() if now_s is None else now_s
        if peer not in self._buckets and len(self._buckets) >= self.max_peers:
            self._prune(now_s)
            if len(self._buckets) >= self.max_peers:
                peer = "*"  # too many addresses: the rest share one bucket
        tokens, last = self._buckets.get(peer, (self.burst, now_s))
        tokens = min(self.burst, tokens + (now_s - last) * self.rate_per_s)
        allowed = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if allowed else tokens, now_s)
        return allowed

    def _prune(self, now_s: float) -> None:
        full_after_s = self.burst / self.rate_per_s
        self._buckets = {p: (t, last) for p, (t, last) in self._buckets.items()
                         if now_s - last < full_after_s}


class RefusalLog:
    """Refused joins, counted by reason; an event at most once a period per reason.

    The client chooses what a refused join says about itself, so its name is cut short and
    logged only in these periodic summaries: events.jsonl grows by at most one line per reason
    per period, whatever the rate of refusals.
    """

    def __init__(self, emit: Callable[..., None], period_s: float = REFUSAL_EVENT_PERIOD_S):
        self.emit = emit
        self.period_s = period_s
        self.totals: dict[str, int] = {}
        self._unlogged: dict[str, int] = {}
        self._last_s: dict[str, float] = {}

    def note(self, reason: str, name: str, peer: str, now_s: float | None = None) -> None:
        """Count one refusal; emit an event if this reason's period has passed."""
        now_s = time.monotonic() if now_s is None else now_s
        self.totals[reason] = self.totals.get(reason, 0) + 1
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        if now_s - self._last_s.get(reason, -math.inf) >= self.period_s:
            self._last_s[reason] = now_s
            count = self._unlogged.pop(reason)
            self.emit("join_refused", reason=reason, device=clip_text(name, 64),
                      peer=clip_text(peer, 64), refusals=count)
            if count > 1 or self.totals[reason] == 1:
                log.warning("refused %d join(s): %s (last from %s)", count, reason,
                            clip_text(peer, 64))

