"""Host time of one `RadixCache.evict(1)` in a tree of many cached prefixes (CPU only).

    PYTHONPATH=$PWD python benchmarks/radix_evict.py --sequences 1000 10000

Each sequence caches 4 pages of 16 tokens: a first page shared by groups of 10, then 3 of its
own; then `evict(1)` is timed (the case of a full pool, where every allocation evicts).
"""

from __future__ import annotations

import argparse
import random
import time

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix_cache import RadixCache

PAGE_SIZE = 16


def time_evict(num_sequences: int, repeats: int = 20) -> tuple[int, float]:
    """(nodes in the tree, seconds per `evict(1)`)."""
    pool = PagePool(num_sequences * 4 + 16)
    cache = RadixCache(pool, PAGE_SIZE)
    rng = random.Random(0)
    for i in range(num_sequences):
        own = [rng.randrange(1 << 30) for _ in range(3 * PAGE_SIZE)]
        cache.insert([i // 10] * PAGE_SIZE + own, pool.alloc(4))
    start = time.perf_counter()
    for _ in range(repeats):
        cache.evict(1)
    return len(cache._nodes()), (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=[1000, 10000])
    for n in parser.parse_args().sequences:
        nodes, seconds = time_evict(n)
        print(f"{n} sequences, {nodes} nodes: evict(1) {seconds * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
