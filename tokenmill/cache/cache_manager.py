"""CacheManager: gives sequences KV pages, reusing and recording cached prefixes on the way.

It knows token ids and page lists, not requests: each sequence's pages are a `SeqPages` the
caller keeps (the engine's `Request` holds one as an opaque handle).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.cache.host_tier import HostKVTier
from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix_cache import RadixCache, RadixNode


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and how many of them were found there."""

    queries: int = 0
    hits: int = 0


@dataclass(eq=False)
class SeqPages:
    """The KV pages of one sequence, token i in page `page_ids[i // page_size]`.

    The leading `num_tree_pages` are owned by the radix tree (locked through `prefix_node`); the
    rest are owned by this sequence alone. Only `CacheManager` changes it.
    """

    page_ids: list[int] = field(default_factory=list)
    prefix_node: RadixNode | None = None  # deepest locked radix node of the shared prefix
    num_tree_pages: int = 0


class CacheManager:
    """Owns the page pool, the optional radix prefix cache and its optional host tier; every
    page move goes through here.

    Every device page is exactly one of: free, owned by the tree, or owned by one sequence.
    Every host page is free or owned by the tree (sequences only ever hold device pages).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool,
        host: HostKVTier | None = None,
    ) -> None:
        if host is not None and not enable_prefix_caching:
            raise ValueError("host_kv_cache_bytes needs enable_prefix_caching")
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.host = host
        self.radix = RadixCache(self.pool, page_size, host) if enable_prefix_caching else None
        self.stats = PrefixCacheStats()

    @property
    def num_used_pages(self) -> int:
        """Pages held by sequences or cached prefixes that are still referenced."""
        return self.pool.num_pages - self.num_available_pages

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation can take: free ones and cached prefixes no sequence references
        (evicted on demand)."""
        evictable = self.radix.num_evictable_pages if self.radix is not None else 0
        return self.pool.num_free + evictable

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def cached_length(self, token_ids: list[int]) -> int:
        """Leading tokens of `token_ids` a prefix match would find now (read-only; 0 without
        caching)."""
        if self.radix is None:
            return 0
        return self.radix.cached_length(token_ids)

    def match_prefix(self, seq: SeqPages, token_ids: list[int]) -> int:
        """Give a sequence with no pages the longest cached prefix of `token_ids`; returns how
        many tokens it covers (whole pages). The part of it on the host tier is loaded back
        onto the device first (queued before any later step reads it)."""
        assert not seq.page_ids
        if self.radix is None:
            return 0
        match = self.radix.match_prefix(token_ids)
        seq.page_ids = list(match.pages)
        seq.prefix_node = match.node
        seq.num_tree_pages = match.num_pages
        return match.num_pages * self.page_size

    def record_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Count an admitted sequence's prefix lookup: `num_cached` of `num_tokens` found."""
        self.stats.queries += num_tokens
        self.stats.hits += num_cached

    def allocate(self, seq: SeqPages, num_tokens: int) -> bool:
        """Ensure `seq` has pages for `num_tokens` tokens, evicting cached prefixes if needed."""
        needed = self.pages_needed(num_tokens) - len(seq.page_ids)
        if needed <= 0:
            return True
        shortfall = needed - self.pool.num_free
        if shortfall > 0 and self.radix is not None:
            self.radix.evict(shortfall)
        if needed > self.pool.num_free:
            return False
        seq.page_ids.extend(self.pool.alloc(needed))
        return True

    def trim(self, seq: SeqPages, num_computed: int) -> None:
        """Release the pages of `seq` past its first `num_computed` tokens (a verify's rejected
        drafts): a sequence holds pages for its computed tokens and one step's reservation."""
        keep = max(self.pages_needed(num_computed), seq.num_tree_pages)
        if len(seq.page_ids) > keep:
            self.pool.free(seq.page_ids[keep:])
            del seq.page_ids[keep:]

    def has_uncached_pages(self, seq: SeqPages, num_computed: int) -> bool:
        """Whether `num_computed` tokens fill pages of `seq` the tree does not share yet."""
        return self.radix is not None and num_computed // self.page_size > seq.num_tree_pages

    def cache_computed(self, seq: SeqPages, computed_token_ids: list[int]) -> None:
        """Share the full pages holding `computed_token_ids` (the sequence's leading tokens
        whose KV is computed) through the tree while the sequence keeps running."""
        if not self.has_uncached_pages(seq, len(computed_token_ids)):
            return
        assert self.radix is not None
        node, tree_pages = self.radix.insert(computed_token_ids, seq.page_ids)
        seq.page_ids[: len(tree_pages)] = tree_pages
        self.radix.lock(node)
        if seq.prefix_node is not None:
            self.radix.unlock(seq.prefix_node)
        seq.prefix_node = node
        seq.num_tree_pages = len(tree_pages)

    def release(self, seq: SeqPages, computed_token_ids: list[int]) -> None:
        """Take back a finished or preempted sequence's pages, caching its computed prefix."""
        self.cache_computed(seq, computed_token_ids)
        self.pool.free(seq.page_ids[seq.num_tree_pages :])
        if seq.prefix_node is not None:
            assert self.radix is not None
            self.radix.unlock(seq.prefix_node)
        seq.page_ids = []
        seq.prefix_node = None
        seq.num_tree_pages = 0

    def flush(self) -> int:
        """Drop every cached prefix no sequence is using; returns pages freed."""
        return self.radix.flush() if self.radix is not None else 0
