"""The operand-block cache a device keeps, and the PS's exact mirror of it.

A device caches operand blocks (weight column blocks, activation row blocks) under a key, with a
byte budget and least-recently-used eviction. The PS keeps a mirror of every device's cache and
decides, when it builds a tile, whether to send a block or only its key. Both sides apply the
same operations in the same order (the PS when it builds a message, the device when it receives
it; the stream keeps the order), so the mirror is exact without any acknowledgement.

Operations: ``use(key, version, nbytes)`` (a hit refreshes the key; a miss inserts it and evicts
the least recently used blocks until the budget holds), ``invalidate(before_version)`` (weights
changed: drop older blocks). A block larger than the whole budget is never cached.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Iterator, TypeVar

V = TypeVar("V")

# A device's budget unless it says otherwise (the agent's --cache-mib). A linear planned on one
# grid for forward and backward (docs/planning.md) keeps its forward blocks until backward: on
# topologies/hotcarbon.yaml (OPT-125m, 8,192 tokens a step, 15 phones) about 30 MB a phone a
# layer, 360 MB for the 12 layers, which the step planner allows only within half the budget
# (the other half carries backward's dY blocks through the LRU). 64 MiB, the budget before,
# held about one layer. A phone has 6-12 GB of memory; this host's agents share 24 GB.
DEFAULT_CACHE_BYTES = 768 * 1024 * 1024


class BlockCache(Generic[V]):
    """LRU cache of blocks by key with a byte budget; values are whatever the side stores."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, tuple[int, int, V]] = OrderedDict()  # key -> (ver, n, v)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> Iterator[str]:
        """The cached keys, least recently used first (no refresh)."""
        return iter(self._entries)

    def cacheable(self, nbytes: int) -> bool:
        """Whether a block of this size may be cached at all."""
        return 0 < nbytes <= self.capacity_bytes

    def get(self, key: str) -> V | None:
        """The value of a cached key, refreshed as most recently used; None on a miss."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[2]

    def put(self, key: str, version: int, nbytes: int, value: V) -> None:
        """Insert (or replace) a block, evicting least recently used ones to fit."""
        if not self.cacheable(nbytes):
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= old[1]
        self._entries[key] = (version, nbytes, value)
        self.used_bytes += nbytes
        while self.used_bytes > self.capacity_bytes:
            _, (_, n, _) = self._entries.popitem(last=False)
            self.used_bytes -= n

    def invalidate(self, before_version: int) -> int:
        """Drop every block of a version older than before_version; return how many."""
        stale = [k for k, (ver, _, _) in self._entries.items() if ver < before_version]
        for key in stale:
            self.used_bytes -= self._entries.pop(key)[1]
        return len(stale)
