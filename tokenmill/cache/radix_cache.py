"""RadixCache: a prefix tree of page-aligned token runs whose KV pages can be reused.

With a host tier (`HostKVTier`) a node lives on the device or on the host. The device-resident
nodes form the top of the tree (a device node's parent is on the device too); eviction moves an
unreferenced device leaf's pages to the host instead of dropping them, and a prefix match that
reaches host nodes loads them back onto the device (`match_prefix`). One clock orders both
tiers: the host makes room by dropping host leaves used before the node coming down, and a node
older than all of them is dropped rather than written out.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.cache.host_tier import HostKVTier
from tokenmill.cache.page_pool import PagePool


@dataclass(eq=False)
class RadixNode:
    """A run of whole pages: `tokens` (a multiple of page_size long) and the pages holding them
    (device pages, or host pages when `on_host`)."""

    tokens: tuple[int, ...] = ()
    pages: list[int] = field(default_factory=list)
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    ref_count: int = 0
    last_access: int = 0
    on_host: bool = False


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a token sequence: its device pages, the (locked) deepest
    node, and how many of the pages were loaded back from the host tier for it."""

    pages: list[int]
    node: RadixNode
    num_loaded_pages: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class _Leaves:
    """One tier's eviction candidates, least recently used first: `(last_access, id, node)`
    offered whenever a node may have become an unreferenced leaf of the tier (`is_leaf`), and
    checked when taken (an entry whose node has moved on is dropped, or goes back at its newer
    access), so that eviction does not walk the whole tree on every call. `nodes` walks the
    tree, for a rebuild; `bound` is the tier's page count, past twice which (mostly stale)
    entries a rebuild starts afresh."""

    def __init__(
        self,
        is_leaf: Callable[[RadixNode], bool],
        nodes: Callable[[], list[RadixNode]],
        bound: Callable[[], int],
    ) -> None:
        self._is_leaf, self._nodes, self._bound = is_leaf, nodes, bound
        self._heap: list[tuple[int, int, RadixNode]] = []

    def offer(self, node: RadixNode) -> None:
        """Make `node` a candidate if it is an unreferenced leaf of the tier now."""
        if self._is_leaf(node):
            heapq.heappush(self._heap, (node.last_access, id(node), node))
            if len(self._heap) > 2 * self._bound() + 64:
                self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(n.last_access, id(n), n) for n in self._nodes() if self._is_leaf(n)]
        heapq.heapify(self._heap)

    def take(self, older_than: float, any_left: bool) -> RadixNode | None:
        """The least recently used leaf, if used before `older_than`, taken off the candidates;
        else None. Should the candidates run dry while `any_left` says the tier holds pages
        (a path that made a leaf without offering it), they are rebuilt once from the tree."""
        rebuilt = False
        while True:
            if not self._heap:
                if rebuilt or not any_left:
                    return None
                self._rebuild()
                rebuilt = True
                continue
            if self._heap[0][0] >= older_than:
                return None
            access, _, node = heapq.heappop(self._heap)
            if node.parent is None or not self._is_leaf(node):
                continue  # removed, referenced, moved to the other tier, or not a leaf now
            if access != node.last_access:  # used since it was offered: later in the order
                heapq.heappush(self._heap, (node.last_access, id(node), node))
                continue
            return node


class RadixCache:
    """Prefix tree keyed by token runs at page granularity, sharing one `PagePool`.

    A node with `ref_count > 0` is on the path of a running request and cannot be evicted.
    Unreferenced leaves are evicted least-recently-used first (to the host tier, if there is
    one). A divergence inside a page is not shared: the diverging request recomputes that
    partial page (fewer than `page_size` tokens).
    """

    def __init__(self, pool: PagePool, page_size: int, host: HostKVTier | None = None) -> None:
        self.pool = pool
        self.page_size = page_size
        self.host = host
        self.root = RadixNode()
        self.root.ref_count = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self._num_cached_pages = 0
        self._num_evictable_pages = 0
        self._num_host_pages = 0
        # Eviction candidates of each tier (`_nodes` looked up when called: tests replace it).
        self._device_leaves = _Leaves(
            self._is_device_leaf, lambda: self._nodes(), lambda: self._num_cached_pages
        )
        self._host_leaves = _Leaves(
            self._is_host_leaf, lambda: self._nodes(), lambda: self._num_host_pages
        )

    @property
    def num_cached_pages(self) -> int:
        """Device pages owned by the tree (referenced or not)."""
        return self._num_cached_pages

    @property
    def num_host_pages(self) -> int:
        """Host pages owned by the tree."""
        return self._num_host_pages

    def _key(self, tokens: tuple[int, ...] | list[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def match_prefix(self, tokens: list[int]) -> PrefixMatch:
        """Find the longest cached whole-page prefix of `tokens` and lock its path.

        Host-resident nodes on the path are loaded back onto the device, top down, as long as
        device pages can be found for them (evicting other unreferenced nodes); the match ends
        at the last node on the device.
        """
        path = self._walk(tokens)
        deepest = path[-1] if path else self.root
        self.lock(deepest)  # the whole path: no eviction below may touch it
        loaded = self._load(path) if self.host is not None else 0
        on_device = [n for n in path if not n.on_host]  # a leading run: loads go top down
        node = on_device[-1] if on_device else self.root
        if node is not deepest:
            self.lock(node)
            self.unlock(deepest)
        pages = [p for n in on_device for p in n.pages]
        return PrefixMatch(pages=pages, node=node, num_loaded_pages=loaded)

    def _load(self, path: list[RadixNode]) -> int:
        """Bring the host nodes of a locked path back onto the device; returns pages loaded."""
        assert self.host is not None
        loaded = 0
        for node in path:
            if not node.on_host:
                continue
            n = len(node.pages)
            if self.pool.num_free < n:
                self.evict(n - self.pool.num_free)
            if self.pool.num_free < n:
                break
            device_pages = self.pool.alloc(n)
            self.host.load(node.pages, device_pages)
            self.host.pool.free(node.pages)
            node.pages, node.on_host = device_pages, False
            self._num_host_pages -= n
            self._num_cached_pages += n  # locked: not evictable until unlocked
            loaded += n
        return loaded

    def _walk(self, tokens: list[int]) -> list[RadixNode]:
        """The nodes along `tokens` (on either tier), cutting a partially matched node so that
        a node ends there."""
        now = next(self._clock)
        node, path, pos = self.root, [], 0
        while pos + self.page_size <= len(tokens):
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                break
            matched = self._common_pages(child, tokens, pos)
            if matched < len(child.pages):
                child = self._split(child, matched)
            child.last_access = now
            path.append(child)
            pos += len(child.tokens)
            node = child
        return path

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
        """Tokens of the longest cached whole-page prefix of `tokens` (either tier), without
        touching the tree."""
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
        """Cut `node` after `num_pages` pages; returns the new upper half (same tier)."""
        cut = num_pages * self.page_size
        parent = node.parent
        assert parent is not None
        upper = RadixNode(
            tokens=node.tokens[:cut],
            pages=node.pages[:num_pages],
            parent=parent,
            ref_count=node.ref_count,
            last_access=node.last_access,
            on_host=node.on_host,
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
        Where the tree held them on the host only, the node takes the caller's device pages and
        its host copy is dropped.
        """
        num_pages = min(len(tokens) // self.page_size, len(pages))
        tokens = tokens[: num_pages * self.page_size]
        path = self._walk(tokens)
        tree_pages: list[int] = []
        for node in path:
            mine = pages[len(tree_pages) : len(tree_pages) + len(node.pages)]
            if node.on_host:
                self._adopt(node, mine)
            else:
                self.pool.free([p for p, t in zip(mine, node.pages, strict=True) if p != t])
            tree_pages.extend(node.pages)
        node = path[-1] if path else self.root
        existing = len(tree_pages)
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
            self._device_leaves.offer(child)
        return node, tree_pages

    def _adopt(self, node: RadixNode, device_pages: list[int]) -> None:
        """A host node takes device pages holding the same tokens; its host pages are freed."""
        assert self.host is not None and len(device_pages) == len(node.pages)
        self.host.pool.free(node.pages)
        self._num_host_pages -= len(node.pages)
        node.pages, node.on_host = list(device_pages), False
        self._num_cached_pages += len(node.pages)
        if node.ref_count == 0:
            self._num_evictable_pages += len(node.pages)
            self._device_leaves.offer(node)

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction (from either tier)."""
        while node is not None:
            if node.ref_count == 0 and not node.on_host:
                self._num_evictable_pages -= len(node.pages)
            node.ref_count += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock` of `node`."""
        while node is not None:
            node.ref_count -= 1
            assert node.ref_count >= 0, "radix node unlocked more often than locked"
            if node.ref_count == 0 and not node.on_host:
                self._num_evictable_pages += len(node.pages)
                self._device_leaves.offer(node)
            elif node.ref_count == 0:
                self._host_leaves.offer(node)
            node = node.parent

    @property
    def num_evictable_pages(self) -> int:
        """Device pages that `evict` could free now (those in unreferenced subtrees)."""
        return self._num_evictable_pages

    def evict(self, num_pages: int, write_back: bool = True) -> int:
        """Free up to `num_pages` device pages from unreferenced leaves, LRU first; returns
        pages freed. With a host tier (and `write_back`) a leaf's pages are written out to the
        host and the node stays in the tree, on the host."""
        freed = 0
        while freed < num_pages:
            leaf = self._device_leaves.take(float("inf"), self._num_evictable_pages > 0)
            if leaf is None:
                break
            parent = leaf.parent
            assert parent is not None
            n = len(leaf.pages)
            self._num_cached_pages -= n
            self._num_evictable_pages -= n
            offloaded = False
            if write_back and self.host is not None:
                offloaded = self._offload(leaf)
            if not offloaded:
                self.pool.free(leaf.pages)
                self._remove(leaf)
            freed += n
            self._device_leaves.offer(parent)
        return freed

    def _offload(self, leaf: RadixNode) -> bool:
        """Move an unreferenced device leaf's pages to the host; False if the host has no room
        for it without dropping nodes used more recently."""
        assert self.host is not None
        n, pool = len(leaf.pages), self.host.pool
        if pool.num_free < n:
            self._evict_host(n - pool.num_free, leaf.last_access)
        if pool.num_free < n:
            return False
        host_pages = pool.alloc(n)
        self.host.write(leaf.pages, host_pages)
        self.pool.free(leaf.pages)
        leaf.pages, leaf.on_host = host_pages, True
        self._num_host_pages += n
        self._host_leaves.offer(leaf)
        return True

    def _evict_host(self, num_pages: int, older_than: float) -> int:
        """Drop host leaves last used before `older_than`, LRU first; returns host pages freed."""
        freed = 0
        while freed < num_pages:
            leaf = self._host_leaves.take(older_than, self._num_host_pages > 0)
            if leaf is None:
                break
            parent = leaf.parent
            assert parent is not None
            freed += len(leaf.pages)
            self._remove(leaf)
            self._host_leaves.offer(parent)
        return freed

    def _remove(self, node: RadixNode) -> None:
        """Take `node` (its own device pages already freed, if any) and its host-resident
        subtree out of the tree, freeing their host pages; removed nodes have no parent."""
        parent = node.parent
        assert parent is not None
        del parent.children[self._key(node.tokens, 0)]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.parent = None
            if n.on_host:
                assert self.host is not None and n.ref_count == 0
                self.host.pool.free(n.pages)
                self._num_host_pages -= len(n.pages)

    def _is_device_leaf(self, node: RadixNode) -> bool:
        """An unreferenced device node with no child on the device."""
        return (
            node is not self.root
            and not node.on_host
            and node.ref_count == 0
            and all(c.on_host for c in node.children.values())
        )

    def _is_host_leaf(self, node: RadixNode) -> bool:
        return node.on_host and not node.children and node.ref_count == 0

    def flush(self) -> int:
        """Drop every unreferenced node, from both tiers; returns device pages freed."""
        freed = self.evict(self._num_cached_pages, write_back=False)
        self._evict_host(self._num_host_pages, float("inf"))
        return freed

    def _nodes(self) -> list[RadixNode]:
        nodes, stack = [], [self.root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def cached_pages(self) -> list[int]:
        """Every device page the tree owns (for invariant checks)."""
        return [p for n in self._nodes() if not n.on_host for p in n.pages]

    def host_pages(self) -> list[int]:
        """Every host page the tree owns (for invariant checks)."""
        return [p for n in self._nodes() if n.on_host for p in n.pages]
