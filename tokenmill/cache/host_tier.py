"""HostKVTier: KV pages evicted from the device, kept in host memory and copied back on a hit.

The radix tree decides *which* pages move (`RadixCache`: a node is on the device or on the
host); this class owns the host pool and does the copies. Its tensors mirror the device's KV
tensors (the target's K and V of every layer, and a draft model's, which live in the same page
ids): host page `h` of tensor `i` holds what device page `d` of tensor `i` held when it was
written out. So a draft model's KV moves with the target's and stays valid wherever the
target's is.

On the CPU device the host tier is plain memory and the copies are synchronous. On CUDA
(`CudaCopies`) the host memory is pinned, the copies run on a copy stream after the work
already queued on the compute stream, and the compute stream waits for them through an event:
the host never waits, and a page is not reused by a later step before its copy is done.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.cache.page_pool import PagePool


@dataclass
class HostTierStats:
    """What moved between the tiers, cumulative (the metrics endpoint reads them)."""

    hit_tokens: int = 0  # tokens loaded back into the device for a prefix match
    bytes_loaded: int = 0  # host → device
    bytes_written: int = 0  # device → host
    load_seconds: float = 0.0  # time the loads took (device time on CUDA, once done)


class HostKVTier:
    """A pool of host pages with the same layout as the device's KV tensors, and the copies
    between the two (`write`: device → host, `load`: host → device)."""

    def __init__(self, device_kv: list[torch.Tensor], num_pages: int, device: torch.device) -> None:
        self.pool = PagePool(num_pages)
        self.device_kv = device_kv
        self.copies = CudaCopies(device) if device.type == "cuda" else None
        pin = self.copies is not None
        self.host_kv = [
            torch.empty((num_pages, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in device_kv
        ]
        self.bytes_per_page = sum(t[0].numel() * t.element_size() for t in device_kv)
        self.page_size = device_kv[0].shape[1] if device_kv else 0
        self.stats = HostTierStats()

    def write(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages out to host pages (the device pages may be reused right after)."""
        self._copy(self.device_kv, self.host_kv, device_pages, host_pages, timed=False)
        self.stats.bytes_written += len(device_pages) * self.bytes_per_page

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages back into device pages, before any later step reads them."""
        start = time.perf_counter()
        self._copy(self.host_kv, self.device_kv, host_pages, device_pages, timed=True)
        if self.copies is None:
            self.stats.load_seconds += time.perf_counter() - start
        self.stats.bytes_loaded += len(host_pages) * self.bytes_per_page
        self.stats.hit_tokens += len(host_pages) * self.page_size

    def poll(self) -> HostTierStats:
        """The stats, with the device time of every finished load on CUDA added."""
        if self.copies is not None:
            self.stats.load_seconds += self.copies.finished_seconds()
        return self.stats

    def _copy(
        self,
        src: list[torch.Tensor],
        dst: list[torch.Tensor],
        src_pages: list[int],
        dst_pages: list[int],
        timed: bool,
    ) -> None:
        runs = page_runs(src_pages, dst_pages)
        if self.copies is None:
            _copy_runs(src, dst, runs, non_blocking=False)
            return
        with self.copies.ordered(timed):
            _copy_runs(src, dst, runs, non_blocking=True)


def page_runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """Split a page-to-page copy into runs `(src_start, dst_start, length)` of consecutive ids
    on both sides, so that each run is one contiguous copy per tensor."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"copying {len(src_pages)} pages into {len(dst_pages)}")
    if not src_pages:
        return []
    src, dst = np.asarray(src_pages), np.asarray(dst_pages)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(src)]))
    return [(int(src[s]), int(dst[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def _copy_runs(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    runs: list[tuple[int, int, int]],
    non_blocking: bool,
) -> None:
    for s, d in zip(src, dst, strict=True):
        for src_start, dst_start, n in runs:
            src_run = s[src_start : src_start + n]
            d[dst_start : dst_start + n].copy_(src_run, non_blocking=non_blocking)


class CudaCopies:
    """The CUDA half of the host tier: a copy stream ordered against the compute stream.

    `ordered()`: the copies inside start after everything already queued on the compute stream
    (a page written out may still be being filled by the step in flight), and the compute
    stream's later work waits for them (an event, on the device): a freed page is not
    overwritten, nor a loaded page read, before its copy is done. The host does not wait.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def ordered(self, timed: bool) -> Iterator[None]:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        start = torch.cuda.Event(enable_timing=True) if timed else None
        if start is not None:
            start.record(self.stream)
        with torch.cuda.stream(self.stream):
            yield
        done = torch.cuda.Event(enable_timing=timed)
        done.record(self.stream)
        compute.wait_event(done)
        if start is not None:
            self._timings.append((start, done))

    def finished_seconds(self) -> float:
        """Device seconds of the timed copies that have finished since the last call."""
        total, pending = 0.0, []
        for start, done in self._timings:
            if done.query():
                total += start.elapsed_time(done) / 1e3
            else:
                pending.append((start, done))
        self._timings = pending
        return total
