"""PagePool hands out each page once and refuses double frees."""

from __future__ import annotations

import pytest

from tokenmill.cache.page_pool import PagePool


def test_alloc_and_free_round_trip() -> None:
    pool = PagePool(8)
    pages = pool.alloc(5)
    assert len(set(pages)) == 5 and pool.num_free == 3
    pool.free(pages[:2])
    assert pool.num_free == 5
    again = pool.alloc(5)
    assert not set(again) & set(pages[2:])


def test_over_allocation_and_double_free_raise() -> None:
    pool = PagePool(2)
    pages = pool.alloc(2)
    with pytest.raises(RuntimeError, match="only 0 free"):
        pool.alloc(1)
    pool.free(pages[:1])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(pages[:1])
    with pytest.raises(RuntimeError, match="not from this pool"):
        pool.free([7])


def test_zero_pages_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(0)
