"""RadixCache: a prefix tree of page-aligned token runs whose KV pages can be reused."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from tokenmill.cache.page_pool import PagePool


@dataclass(eq=False)
class RadixNode:
    """A run of whole pages: `tokens` (a multiple of page_size long) and the pages holding them."""

    tokens: tuple[int, ...] = ()
    pages: list[int] = field(default_factory=list)
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    ref_count: int = 0
    last_access: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a token sequence: its pages and the (locked) deepest node."""

    pages: list[int]
    node: RadixNode

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class RadixCache:
    """Prefix tree keyed by token runs at page granularity, sharing one `PagePool`.

    A node with `ref_count > 0` is on the path of a running request and cannot be evicted.
    Unreferenced leaves are evicted least-recently-used first. A divergence inside a page is not
    shared: the diverging request recomputes that partial page (fewer than `page_size` tokens).
    """

    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self.root = RadixNode()
        self.root.ref_count = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self._num_cached_pages = 0
        self._num_evictable_pages = 0

    @property
    def num_cached_pages(self) -> int:
        """Pages owned by the tree (referenced or not)."""
        return self._num_cached_pages

    def _key(self, tokens: tuple[int, ...] | list[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def match_prefix(self, tokens: list[int]) -> PrefixMatch:
        """Find the longest cached whole-page prefix of `tokens` and lock its path."""
        node, pages = self._walk(tokens)
        self.lock(node)
        return PrefixMatch(pages=pages, node=node)

    def _walk(self, tokens: list[int]) -> tuple[RadixNode, list[int]]:
        """Descend along `tokens`, cutting a partially matched node so that a node ends there."""
        now = next(self._clock)
        node, pages, pos = self.root, [], 0
        while pos + self.page_size <= len(tokens):
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                break
            matched = self._common_pages(child, tokens, pos)
            if matched < len(child.pages):
                child = self._split(child, matched)
            child.last_access = now
            pages.extend(child.pages)
            pos += len(child.tokens)
            node = child
        return node, pages

    def _common_pages(self, child: RadixNode, tokens: list[int], pos: int) -> int:
        """How many of `child`'s pages match `tokens` from `pos` (the first always does)."""
        ps, matched = self.page_size, 1
        while (
            matched < len(child.pages)
            and pos + (matched + 1) * ps <= len(tokens)
            and self._key(child.tokens, matched * ps) == self._key(tokens, pos + matched * ps)
        ):
            matched += 1
        return matched

    def cached_length(self, tokens: list[int]) -> int:
        """Tokens of the longest cached whole-page prefix of `tokens`, without touching the tree."""
        node, pos, ps = self.root, 0, self.page_size
        while pos + ps <= len(tokens):
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                break
            matched = self._common_pages(child, tokens, pos)
            pos += matched * ps
            if matched < len(child.pages):
                break
            node = child
        return pos

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut `node` after `num_pages` pages; returns the new upper half."""
        cut = num_pages * self.page_size
        parent = node.parent
        assert parent is not None
        upper = RadixNode(
            tokens=node.tokens[:cut],
            pages=node.pages[:num_pages],
            parent=parent,
            ref_count=node.ref_count,
            last_access=node.last_access,
        )
        parent.children[self._key(node.tokens, 0)] = upper
        node.tokens = node.tokens[cut:]
        node.pages = node.pages[num_pages:]
        node.parent = upper
        upper.children[self._key(node.tokens, 0)] = node
        return upper

    def insert(self, tokens: list[int], pages: list[int]) -> tuple[RadixNode, list[int]]:
        """Add the whole pages of `tokens` (held in `pages`) to the tree.

        Returns the deepest node of the inserted path and the tree's pages for the whole prefix.
        Where the tree already held a page for the same tokens, the caller's copy is freed and the
        tree's page is returned in its place, so the caller should adopt the returned list.
        """
        num_pages = min(len(tokens) // self.page_size, len(pages))
        tokens = tokens[: num_pages * self.page_size]
        node, tree_pages = self._walk(tokens)
        existing = len(tree_pages)
        duplicates = [p for p, t in zip(pages[:existing], tree_pages, strict=True) if p != t]
        self.pool.free(duplicates)
        if existing < num_pages:
            new_pages = pages[existing:num_pages]
            child = RadixNode(
                tokens=tuple(tokens[existing * self.page_size :]),
                pages=list(new_pages),
                parent=node,
                last_access=next(self._clock),
            )
            node.children[self._key(child.tokens, 0)] = child
            self._num_cached_pages += len(new_pages)
            self._num_evictable_pages += len(new_pages)
            tree_pages = tree_pages + new_pages
            node = child
        return node, tree_pages

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction."""
        while node is not None:
            if node.ref_count == 0:
                self._num_evictable_pages -= len(node.pages)
            node.ref_count += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock` of `node`."""
        while node is not None:
            node.ref_count -= 1
            assert node.ref_count >= 0, "radix node unlocked more often than locked"
            if node.ref_count == 0:
                self._num_evictable_pages += len(node.pages)
            node = node.parent

    @property
    def num_evictable_pages(self) -> int:
        """Pages that `evict` could free now (those in unreferenced subtrees)."""
        return self._num_evictable_pages

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages from unreferenced leaves, LRU first; returns pages freed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            self.pool.free(leaf.pages)
            freed += len(leaf.pages)
            self._num_cached_pages -= len(leaf.pages)
            self._num_evictable_pages -= len(leaf.pages)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._key(leaf.tokens, 0)]
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node is not self.root and not node.children and node.ref_count == 0

    def flush(self) -> int:
        """Evict every unreferenced page; returns pages freed."""
        return self.evict(self._num_cached_pages)

    def _nodes(self) -> list[RadixNode]:
        nodes, stack = [], [self.root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def cached_pages(self) -> list[int]:
        """Every page the tree owns (for invariant checks)."""
        return [p for n in self._nodes() for p in n.pages]
