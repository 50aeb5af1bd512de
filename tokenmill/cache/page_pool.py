"""PagePool: O(1) allocation of fixed-size KV-cache pages, tracked by id."""

from __future__ import annotations


class PagePool:
    """A free list of page ids in `[0, num_pages)`.

    Pages are plain integers; the KV tensors they index live in the model runner. Allocation and
    release are O(1) per page. Double frees and foreign ids raise, because a page owned twice would
    silently corrupt another request's KV cache.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        """Pages available for allocation right now."""
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take `n` pages; raises `RuntimeError` if fewer are free (callers check `num_free`)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} pages, only {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool."""
        for page in pages:
            if not 0 <= page < self.num_pages or self._is_free[page]:
                raise RuntimeError(f"page {page} freed twice or not from this pool")
            self._is_free[page] = True
            self._free.append(page)

    def is_free(self, page: int) -> bool:
        """Whether `page` is currently unallocated."""
        return self._is_free[page]
