"""CacheManager: gives requests KV pages, reusing and recording cached prefixes on the way."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix_cache import RadixCache
from tokenmill.engine.request import Request


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and how many of them were found there."""

    queries: int = 0
    hits: int = 0


class CacheManager:
    """Owns the page pool and the optional radix prefix cache; every page move goes through here.

    A request's `page_ids` start with the pages of its matched prefix (owned by the tree, locked
    through `request.prefix_node`) followed by pages it owns alone. Every page is exactly one of:
    free, owned by the tree, or owned by one request.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool) -> None:
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.radix = RadixCache(self.pool, page_size) if enable_prefix_caching else None
        self.stats = PrefixCacheStats()

    @property
    def num_used_pages(self) -> int:
        """Pages held by requests or cached prefixes that are still referenced."""
        evictable = self.radix.num_evictable_pages if self.radix is not None else 0
        return self.pool.num_pages - self.pool.num_free - evictable

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def cached_length(self, req: Request) -> int:
        """Tokens of `req` a prefix match would find now (read-only; 0 without caching)."""
        if self.radix is None:
            return 0
        return self.radix.cached_length(req.all_token_ids[: req.num_tokens - 1])

    def match_prefix(self, req: Request) -> None:
        """Give a request with no pages the longest cached prefix of its tokens."""
        assert not req.page_ids and req.num_computed_tokens == 0
        if self.radix is None:
            return
        # The last token is always computed: its logits give the next token.
        tokens = req.all_token_ids[: req.num_tokens - 1]
        match = self.radix.match_prefix(tokens)
        req.page_ids = list(match.pages)
        req.prefix_node = match.node
        req.num_tree_pages = match.num_pages
        req.num_computed_tokens = match.num_pages * self.page_size

    def record_admission(self, req: Request) -> None:
        """Count an admitted request's prefix lookup; first admission sets `num_cached_tokens`."""
        self.stats.queries += req.num_tokens
        self.stats.hits += req.num_computed_tokens
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Ensure pages for `num_new_tokens` more tokens, evicting cached prefixes if needed."""
        needed = self.pages_needed(req.num_computed_tokens + num_new_tokens) - len(req.page_ids)
        if needed <= 0:
            return True
        shortfall = needed - self.pool.num_free
        if shortfall > 0 and self.radix is not None:
            self.radix.evict(shortfall)
        if needed > self.pool.num_free:
            return False
        req.page_ids.extend(self.pool.alloc(needed))
        return True

    def cache_computed(self, req: Request) -> None:
        """Share a request's newly completed pages through the tree while it keeps running."""
        if (
            self.radix is not None
            and req.num_computed_tokens // self.page_size > req.num_tree_pages
        ):
            self._insert(req)

    def _insert(self, req: Request) -> None:
        assert self.radix is not None
        tokens = req.all_token_ids[: req.num_computed_tokens]
        node, tree_pages = self.radix.insert(tokens, req.page_ids)
        req.page_ids[: len(tree_pages)] = tree_pages
        self.radix.lock(node)
        if req.prefix_node is not None:
            self.radix.unlock(req.prefix_node)
        req.prefix_node = node
        req.num_tree_pages = len(tree_pages)

    def release(self, req: Request) -> None:
        """Take back a finished or preempted request's pages, caching its computed prefix."""
        self.cache_computed(req)
        self.pool.free(req.page_ids[req.num_tree_pages :])
        if req.prefix_node is not None:
            assert self.radix is not None
            self.radix.unlock(req.prefix_node)
        req.page_ids = []
        req.prefix_node = None
        req.num_tree_pages = 0

    def flush(self) -> int:
        """Drop every cached prefix no request is using; returns pages freed."""
        return self.radix.flush() if self.radix is not None else 0
