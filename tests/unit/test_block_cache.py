"""The operand-block cache both sides keep: least recently used first, held blocks last."""

from __future__ import annotations

from testbed.wire.cache import BlockCache


def filled(*keys: str, held: tuple[str, ...] = ()) -> BlockCache[str]:
    cache: BlockCache[str] = BlockCache(4 * 10)
    for key in keys:
        cache.put(key, 0, 10, key, key in held)
    return cache


def test_the_least_recently_used_block_goes_first() -> None:
    cache = filled("a", "b", "c", "d")
    assert cache.get("a") == "a"  # refreshed: b is now the oldest
    cache.put("e", 0, 10, "e")
    assert list(cache.keys()) == ["c", "d", "a", "e"] and cache.used_bytes == 40


def test_a_held_block_outlives_every_block_not_held() -> None:
    cache = filled("w", "x", "y", "z", held=("w",))  # w is the oldest, and held
    for key in "efg":
        cache.put(key, 0, 10, key)
    assert "w" in cache and list(cache.keys()) == ["e", "f", "g", "w"]
    cache.put("v", 0, 10, "v", held=True)  # with two held, the oldest loose block goes
    assert list(cache.keys()) == ["f", "g", "w", "v"]


def test_held_blocks_go_oldest_first_once_nothing_else_is_left() -> None:
    cache = filled("a", "b", "c", "d", held=("a", "b", "c", "d"))
    assert cache.get("a", held=True) == "a"
    cache.put("e", 0, 10, "e", held=True)
    assert list(cache.keys()) == ["c", "d", "a", "e"]


def test_a_use_that_holds_a_block_keeps_it_held_and_a_plain_use_does_not_release_it() -> None:
    cache = filled("a", "b", "c", "d")
    cache.get("a", held=True)
    cache.get("a")  # a later use by a GEMM that does not hold it: still held
    cache.put("a", 0, 10, "a")  # sent again (its value replaced): still held
    for key in "efgh":
        cache.put(key, 0, 10, key)
    assert list(cache.keys()) == ["f", "g", "h", "a"]


def test_a_block_not_held_that_does_not_fit_beside_the_held_ones_is_not_kept() -> None:
    cache = filled("a", "b", "c", held=("a", "b", "c"))
    cache.put("big", 0, 20, "big")  # 30 held + 20: it evicts itself, not a held block
    assert list(cache.keys()) == ["a", "b", "c"] and cache.used_bytes == 30


def test_invalidate_drops_held_and_loose_blocks_of_older_versions() -> None:
    cache: BlockCache[str] = BlockCache(100)
    cache.put("old-held", 0, 10, "", True)
    cache.put("old", 0, 10, "")
    cache.put("new-held", 1, 10, "", True)
    assert cache.invalidate(1) == 2
    assert list(cache.keys()) == ["new-held"] and cache.used_bytes == 10 and len(cache) == 1
