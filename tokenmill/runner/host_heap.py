"""Bounds on the native memory a CPU engine's process keeps over a long run.

Measured on the demo model (docs/perf-notes.md, sessions 35-36): a CPU engine serving random
prompt and batch sizes grew from ~600 MiB to ~1.2 GiB resident in a dozen rounds of 100
requests, with Python's own objects flat. Two native caches grow with every new shape:

- oneDNN (torch's CPU matmuls) keeps a compiled primitive per shape, up to 1,024 of them
  (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, read when oneDNN makes its first primitive);
- glibc keeps freed heap memory, and raises its mmap threshold as large tensors are freed, so
  later ones come from a heap that fragments instead of from mappings given back on free.

A CPU engine caps the first (unless the environment sets it) and hands the heap's free memory
back to the OS (`malloc_trim`) at most once per `TRIM_INTERVAL_S`: flat at ~760 MiB from the
13th round, and no slower (a trim takes ~5 ms). A fixed mmap threshold bounded it too, but
made each round ~40% slower (a mapping per large tensor).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable

# oneDNN primitives kept; a decode step reuses a handful of shapes (no slower than 1,024).
ONEDNN_CACHE_CAPACITY = 8
TRIM_INTERVAL_S = 1.0


def bound_onednn_cache() -> None:
    """Cap oneDNN's primitive cache for this process, unless the environment already sets
    it; takes effect only before oneDNN's first primitive (call before the first matmul)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim` among the process's own symbols, or None where the C library
    has none (musl, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    """Calling it gives the C heap's free memory back to the OS, at most once per
    `interval_s` of `clock` (a no-op where the C library cannot)."""

    def __init__(
        self, interval_s: float = TRIM_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._trim = _malloc_trim()
        self._next = 0.0
        self.trims = 0

    def __call__(self) -> None:
        if self._trim is None:
            return
        if self._clock() < self._next:
            return
        self._trim(0)
        self.trims += 1
        self._next = self._clock() + self.interval_s
