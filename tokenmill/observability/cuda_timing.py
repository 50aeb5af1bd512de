"""Timing GPU work with CUDA events: warm up, then the median of many runs (eager or graphed)."""

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


def median_graph_seconds(fn: Callable[[], object], replays: int = 20) -> float:
    """Median device time of `fn()` captured in a CUDA graph, as decode steps run it.

    Small kernels cost less in a graph than launched one by one, so choices between kernels
    that will run inside decode graphs are made on this number.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_cuda_seconds(graph.replay, replays, warmup=1)
