"""The operand-block cache a device keeps, and the PS's exact mirror of it.

A device caches operand blocks (weight column blocks, activation row blocks) under a key, with a
byte budget and least-recently-used eviction. The PS keeps a mirror of every device's cache and
decides, when it builds a tile, whether to send a block or only its key. Both sides apply the
same operations in the same order (the PS when it builds a message, the device when it receives
it; the stream keeps the order), so the mirror is exact without any acknowledgement.

Operations: ``use(key, version, nbytes)`` (a hit refreshes the key; a miss inserts it and evicts
the least recently used blocks until the budget holds), ``invalidate(before_version)`` (weights
changed: drop older blocks). A block larger than the whole budget is never cached.

**Held blocks.** A linear planned on one grid for forward and backward keeps each device's
forward blocks until its backward (docs/planning.md, "Parts"), and by then they are the least
recently used of the cache: the blocks of every later layer came after them. So a use may mark
a block *held* (``Operand.held``), and eviction takes the least recently used block that is not
held first, a held one only when none is left. A block stays held until it leaves the cache
(blocks of a step go at the next step's ``invalidate``); the planner keeps what its plans hold
within half a device's budget (``step_plan.HELD_SHARE``), so the other half still turns over.
A device says it follows this rule when it joins (``DeviceDescriptor.keeps_held``); for one that
does not (an agent older than the rule), the PS marks nothing held in its mirror or its tiles.
"""

from __future__ import annotations

import itertools
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
    """LRU cache of blocks by key with a byte budget, held blocks evicted last; values are
    whatever the side stores."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        # key -> (version, nbytes, value), least recently used first: the blocks evicted first,
        # then the held ones (a key is in one of the two)
        self._loose: OrderedDict[str, tuple[int, int, V]] = OrderedDict()
        self._held: OrderedDict[str, tuple[int, int, V]] = OrderedDict()
        # counts every change of which keys are cached (a put, an eviction, an invalidation):
        # the PS's backup search remembers a device's answer until it changes
        self.changes = 0

    def __contains__(self, key: str) -> bool:
        return key in self._loose or key in self._held

    def __len__(self) -> int:
        return len(self._loose) + len(self._held)

    def keys(self) -> Iterator[str]:
        """The cached keys in the order they would be evicted (no refresh)."""
        return itertools.chain(self._loose, self._held)

    def cacheable(self, nbytes: int) -> bool:
        """Whether a block of this size may be cached at all."""
        return 0 < nbytes <= self.capacity_bytes

    def get(self, key: str, held: bool = False) -> V | None:
        """The value of a cached key, refreshed as most recently used (and held from now on,
        with ``held``); None on a miss."""
        entry = self._held.get(key)
        if entry is not None:
            self._held.move_to_end(key)
            return entry[2]
        entry = self._loose.get(key)
        if entry is None:
            return None
        if held:
            self._held[key] = self._loose.pop(key)
        else:
            self._loose.move_to_end(key)
        return entry[2]

    def put(self, key: str, version: int, nbytes: int, value: V, held: bool = False) -> None:
        """Insert (or replace) a block, evicting to fit: the least recently used of the blocks
        not held, then of the held ones. A block held before stays held. A block not held that
        does not fit beside the held ones evicts itself last: it is used now and not kept."""
        if not self.cacheable(nbytes):
            return
        old = self._held.pop(key, None)
        held = held or old is not None
        if old is None:
            old = self._loose.pop(key, None)
        if old is not None:
            self.used_bytes -= old[1]
        (self._held if held else self._loose)[key] = (version, nbytes, value)
        self.used_bytes += nbytes
        self.changes += 1
        while self.used_bytes > self.capacity_bytes:
            _, (_, n, _) = (self._loose or self._held).popitem(last=False)
            self.used_bytes -= n

    def invalidate(self, before_version: int) -> int:
        """Drop every block of a version older than before_version; return how many."""
        dropped = 0
        for entries in (self._loose, self._held):
            stale = [k for k, (ver, _, _) in entries.items() if ver < before_version]
            for key in stale:
                self.used_bytes -= entries.pop(key)[1]
            dropped += len(stale)
        self.changes += dropped
        return dropped
