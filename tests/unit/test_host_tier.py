"""RadixCache over a host tier: eviction writes pages out, a match loads them back with their
contents, LRU spans both tiers, and a recomputed prefix replaces its host copy."""

from __future__ import annotations

import pytest
import torch

from tokenmill.cache.host_tier import HostKVTier, page_runs
from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix_cache import RadixCache

PS = 4


def _cache(device_pages: int, host_pages: int) -> tuple[RadixCache, torch.Tensor]:
    """A radix cache whose one KV tensor holds, per page, a value naming its tokens."""
    kv = torch.zeros(device_pages, PS, 1, 1)
    host = HostKVTier([kv], host_pages, torch.device("cpu"))
    return RadixCache(PagePool(device_pages), PS, host), kv


def _insert(cache: RadixCache, kv: torch.Tensor, tokens: list[int]) -> None:
    """As a finished request would: compute pages (each filled with its first token) and
    hand them to the tree."""
    pages = cache.pool.alloc(len(tokens) // PS)
    for i, page in enumerate(pages):
        kv[page] = tokens[i * PS]
    node, _ = cache.insert(tokens, pages)
    assert node is not None


def _contents(kv: torch.Tensor, pages: list[int]) -> list[float]:
    return [kv[p, 0, 0, 0].item() for p in pages]


def test_evicted_pages_come_back_with_their_contents() -> None:
    cache, kv = _cache(device_pages=4, host_pages=8)
    _insert(cache, kv, list(range(100, 108)))  # 2 pages
    assert cache.evict(2) == 2
    assert cache.pool.num_free == 4 and cache.num_host_pages == 2
    kv.fill_(-1)  # the device pages are reused by others
    match = cache.match_prefix([*range(100, 108), 0])
    assert match.num_loaded_pages == 2
    assert _contents(kv, match.pages) == [100, 104]
    assert cache.num_host_pages == 0 and cache.host is not None
    assert cache.host.pool.num_free == 8
    cache.unlock(match.node)


def test_match_loads_what_fits_and_stops_at_the_device_part() -> None:
    cache, kv = _cache(device_pages=3, host_pages=8)
    _insert(cache, kv, list(range(12)))  # 3 pages: the whole device pool
    cache.evict(3)
    hog = cache.pool.alloc(2)  # a running request holds two pages: one is left to load into
    match = cache.match_prefix([*range(12), 0])
    assert match.num_loaded_pages == 0  # the one node needs 3 pages
    assert match.pages == [] and match.node is cache.root
    cache.unlock(match.node)
    cache.pool.free(hog)


def test_host_makes_room_by_dropping_its_least_recently_used_nodes() -> None:
    cache, kv = _cache(device_pages=2, host_pages=4)
    for first in (100, 200, 300, 400):  # each insert pushes the previous one to the host
        if cache.pool.num_free < 2:
            cache.evict(2)
        _insert(cache, kv, list(range(first, first + 8)))
    assert cache.cached_length([*range(100, 108), 0]) == 0  # the oldest left the host
    assert cache.cached_length([*range(200, 208), 0]) == 8
    assert cache.cached_length([*range(300, 308), 0]) == 8
    assert cache.num_host_pages == 4 and cache.num_cached_pages == 2


def test_a_device_node_older_than_the_host_is_dropped_not_written_out() -> None:
    cache, kv = _cache(device_pages=4, host_pages=2)
    _insert(cache, kv, list(range(100, 108)))
    old = cache.match_prefix([*range(100, 108), 0])  # used first, then held by a request
    _insert(cache, kv, list(range(200, 208)))
    cache.evict(2)  # 100 is locked: 200 goes to the host
    cache.unlock(old.node)
    cache.evict(2)  # 100 was used before everything on the host
    assert cache.cached_length([*range(100, 108), 0]) == 0
    assert cache.cached_length([*range(200, 208), 0]) == 8
    assert cache.num_host_pages == 2 and cache.pool.num_free == 4


def test_reinserting_a_host_prefix_adopts_the_new_device_pages() -> None:
    cache, kv = _cache(device_pages=4, host_pages=4)
    _insert(cache, kv, list(range(8)))
    cache.evict(2)
    pages = cache.pool.alloc(2)
    _, tree_pages = cache.insert(list(range(8)), pages)
    assert tree_pages == pages  # the recomputed copy is kept, the host copy dropped
    assert cache.num_host_pages == 0 and cache.num_cached_pages == 2
    assert cache.num_evictable_pages == 2


def test_flush_drops_both_tiers() -> None:
    cache, kv = _cache(device_pages=4, host_pages=4)
    _insert(cache, kv, list(range(8)))
    cache.evict(2)
    _insert(cache, kv, list(range(50, 58)))
    assert cache.flush() == 2
    assert cache.num_host_pages == 0 and cache.host is not None
    assert cache.host.pool.num_free == 4 and cache.pool.num_free == 4


def test_page_runs_merge_consecutive_pages() -> None:
    assert page_runs([3, 4, 5, 9, 7, 8]) == [(0, 3, 3), (3, 9, 1), (4, 7, 2)]
    assert page_runs([]) == []


@pytest.mark.parametrize("staging_pages", [1, 3, 64])
def test_scattered_pages_round_trip_through_a_staging_buffer_of_any_size(
    staging_pages: int,
) -> None:
    """Pages scattered on both sides, in chunks smaller than, across and larger than the
    copy: each page lands where it was asked to, in every tensor (two tensors of different
    shapes, as a target's and a draft's KV), and no other page changes."""
    shapes = [(PS, 2, 3), (PS, 1, 5)]
    device_kv = [torch.randn(12, *shape) for shape in shapes]
    page_bytes = sum(torch.Size(shape).numel() * 4 for shape in shapes)
    host = HostKVTier(device_kv, 10, torch.device("cpu"), staging_bytes=staging_pages * page_bytes)
    assert host.chunk_pages == min(staging_pages, 10)
    device_pages, host_pages = [7, 2, 3, 11, 0], [4, 5, 6, 1, 9]
    before = [t.clone() for t in device_kv]
    host.write(device_pages, host_pages)
    for dev, out in zip(before, host.host_kv, strict=True):
        assert torch.equal(out[host_pages], dev[device_pages])
    for t in device_kv:
        t.zero_()
    back = [10, 4, 5, 1, 8]
    host.load(host_pages, back)
    for dev, old in zip(device_kv, before, strict=True):
        assert torch.equal(dev[back], old[device_pages])
        untouched = [p for p in range(12) if p not in back]
        assert not dev[untouched].any()
    with pytest.raises(ValueError, match="copying 1 device pages to 2"):
        host.write([1], [1, 2])


def test_a_full_host_drops_its_oldest_leaf_without_walking_the_tree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache, kv = _cache(device_pages=8, host_pages=2)
    for first in (10, 20, 30):
        _insert(cache, kv, [first] * PS)
    assert cache.evict(2) == 2  # 10 and 20 to the host: full
    hit = cache.match_prefix([10] * PS + [0])  # 10 comes back to the device, used now
    cache.unlock(hit.node)

    def walk() -> None:
        raise AssertionError("eviction walked the tree")

    monkeypatch.setattr(cache, "_nodes", walk)
    assert cache.evict(1) == 1  # 30, the oldest on the device, joins 20 on the host: full
    assert cache.cached_length([20] * PS) == PS and cache.cached_length([30] * PS) == PS
    assert cache.evict(1) == 1  # 10 goes down too: the host drops its oldest, 20
    assert cache.cached_length([20] * PS) == 0 and cache.num_host_pages == 2
    assert cache.cached_length([10] * PS) == PS and cache.cached_length([30] * PS) == PS
