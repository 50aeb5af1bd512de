"""RadixCache: longest whole-page prefix match, sharing, splitting, locking, LRU eviction."""

from __future__ import annotations

import pytest

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix_cache import RadixCache

PS = 4


@pytest.fixture
def cache() -> RadixCache:
    return RadixCache(PagePool(32), PS)


def _insert(cache: RadixCache, tokens: list[int]) -> list[int]:
    """Insert `tokens` with freshly allocated pages, as a finished request would."""
    pages = cache.pool.alloc(len(tokens) // PS)
    _, tree_pages = cache.insert(tokens, pages)
    return tree_pages


def test_match_finds_longest_whole_page_prefix(cache: RadixCache) -> None:
    pages = _insert(cache, list(range(12)))
    match = cache.match_prefix([*range(10), 99, 98, 97])
    assert match.pages == pages[:2]  # 10 shared tokens = 2 whole pages
    cache.unlock(match.node)
    assert cache.match_prefix(list(range(3))).pages == []


def test_divergence_splits_node_and_shares_common_pages(cache: RadixCache) -> None:
    first = _insert(cache, list(range(12)))
    second = _insert(cache, [*range(8), 50, 51, 52, 53])
    assert second[:2] == first[:2] and second[2] != first[2]
    assert cache.num_cached_pages == 4
    assert cache.cached_length([*range(8), 50, 51, 52, 53, 1]) == 12
    assert cache.cached_length(list(range(12))) == 12


def test_reinserting_cached_tokens_frees_the_duplicate_pages(cache: RadixCache) -> None:
    first = _insert(cache, list(range(8)))
    free_before = cache.pool.num_free
    duplicate = cache.pool.alloc(2)
    _, tree_pages = cache.insert(list(range(8)), duplicate)
    assert tree_pages == first
    assert cache.pool.num_free == free_before
    assert all(cache.pool.is_free(p) for p in duplicate)


def test_eviction_is_lru_and_spares_locked_paths(cache: RadixCache) -> None:
    old = _insert(cache, [1] * 8)
    new = _insert(cache, [2] * 8)
    locked = cache.match_prefix([3] * 8 + [0])  # nothing cached yet: locks the root only
    cache.unlock(locked.node)
    pinned = _insert(cache, [3] * 8)
    match = cache.match_prefix([3] * 8 + [0])
    assert match.pages == pinned
    assert cache.num_evictable_pages == 4
    assert cache.evict(2) == 2
    assert all(cache.pool.is_free(p) for p in old) and not any(cache.pool.is_free(p) for p in new)
    assert cache.evict(10) == 2  # the locked path stays
    assert cache.cached_pages() == pinned
    cache.unlock(match.node)
    assert cache.flush() == 2 and cache.num_cached_pages == 0


def test_evicting_a_leaf_exposes_its_parent(cache: RadixCache) -> None:
    _insert(cache, list(range(8)))
    _insert(cache, [*range(4), 9, 9, 9, 9])
    assert cache.num_cached_pages == 3
    assert cache.evict(3) == 3
    assert cache.pool.num_free == 32


def test_eviction_follows_use_without_walking_the_tree(
    cache: RadixCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Candidates are kept as nodes change (insert, unlock, a hit that makes a leaf recent, a
    leaf evicted exposing its parent), so eviction never rescans the tree."""
    a = _insert(cache, [1] * 8)
    b = _insert(cache, [2] * 8)
    c = _insert(cache, [*[2] * 4, 5, 5, 5, 5])  # splits b's node: [2]*4 is their parent
    hit = cache.match_prefix([1] * 8 + [0])  # a is now the most recently used
    cache.unlock(hit.node)

    def walk() -> None:
        raise AssertionError("eviction walked the tree")

    monkeypatch.setattr(cache, "_nodes", walk)
    assert cache.evict(1) == 1 and cache.pool.is_free(b[1])  # b's leaf, older than c's
    assert cache.evict(1) == 1 and cache.pool.is_free(c[1])
    assert cache.evict(1) == 1 and cache.pool.is_free(c[0])  # their parent, a leaf now
    assert not any(cache.pool.is_free(p) for p in a)
    assert cache.evict(8) == 2 and cache.num_cached_pages == 0


def test_salted_keys_lie_below_every_image_key() -> None:
    """A salted first key never equals a token id (>= 0) or an image's key (-1 - a 62-bit
    hash), and differs by salt and by the key it replaces."""
    from tokenmill.batch import salted_key

    keys = {salted_key(salt, first) for salt in ("a", "b") for first in (0, 7, -5)}
    assert len(keys) == 6
    assert all(-(1 << 63) <= k < -(1 << 62) for k in keys)
