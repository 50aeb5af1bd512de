"""Timing GPU work with CUDA events: warm up once, then the median of many runs."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_cuda_seconds(fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
    """Median device time of `fn()` in seconds (each run bracketed by its own events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)
