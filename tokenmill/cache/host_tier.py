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

The pages of one prefix lie scattered over the device pool, so a copy page by page would be one
small transfer (a page of one layer: 32 KB for llama-3.1-8b) per page and tensor, each costing a
few microseconds: 64,000 of them for a 16,000-token prefix ran at 5.5 GB/s on the H200. Instead
the copies go through a staging buffer on the device, a chunk of pages at a time: the device side
is gathered (`index_select`) or scattered (`index_copy_`) by one kernel per tensor, and the host
side moves in one transfer per run of consecutive host pages (host pages are taken in order, so a
prefix written out together is mostly one run).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.cache.page_pool import PagePool

STAGING_BYTES = 256 << 20  # device memory for staged copies: transfers of MBs, not KBs


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

    def __init__(
        self,
        device_kv: list[torch.Tensor],
        num_pages: int,
        device: torch.device,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
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
        self.chunk_pages = max(1, min(num_pages, staging_bytes // max(self.bytes_per_page, 1)))
        self._staging: list[torch.Tensor] | None = None  # allocated on the first copy

    def write(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages out to host pages (the device pages may be reused right after)."""
        self._copy(device_pages, host_pages, to_host=True, timed=False)
        self.stats.bytes_written += len(device_pages) * self.bytes_per_page

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages back into device pages, before any later step reads them."""
        start = time.perf_counter()
        self._copy(device_pages, host_pages, to_host=False, timed=True)
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
        self, device_pages: list[int], host_pages: list[int], to_host: bool, timed: bool
    ) -> None:
        if len(device_pages) != len(host_pages):
            raise ValueError(f"copying {len(device_pages)} device pages to {len(host_pages)}")
        if not device_pages:
            return
        if self.copies is None:
            self._staged_copy(device_pages, host_pages, to_host)
            return
        with self.copies.ordered(timed):
            self._staged_copy(device_pages, host_pages, to_host)

    def _staged_copy(self, device_pages: list[int], host_pages: list[int], to_host: bool) -> None:
        """The copy, a chunk of pages at a time through the staging buffer (on the stream
        current when called: the copy stream on CUDA, so the chunks reuse it in order)."""
        staging = self._staging_buffers()
        device = self.device_kv[0].device
        for lo in range(0, len(device_pages), self.chunk_pages):
            chunk = device_pages[lo : lo + self.chunk_pages]
            index = torch.tensor(chunk, dtype=torch.long).to(device, non_blocking=True)
            runs = page_runs(host_pages[lo : lo + self.chunk_pages])
            for dev, host, stage in zip(self.device_kv, self.host_kv, staging, strict=True):
                part = stage[: len(chunk)]
                if to_host:
                    torch.index_select(dev, 0, index, out=part)
                for at, first, n in runs:
                    if to_host:
                        host[first : first + n].copy_(part[at : at + n], non_blocking=True)
                    else:
                        part[at : at + n].copy_(host[first : first + n], non_blocking=True)
                if not to_host:
                    dev.index_copy_(0, index, part)

    def _staging_buffers(self) -> list[torch.Tensor]:
        if self._staging is None:
            self._staging = [
                torch.empty((self.chunk_pages, *t.shape[1:]), dtype=t.dtype, device=t.device)
                for t in self.device_kv
            ]
        return self._staging


def page_runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """Split page ids into runs `(position, first_page, length)` of consecutive ids, so that each
    run is one contiguous transfer per tensor."""
    if not pages:
        return []
    ids = np.asarray(pages)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(ids)]))
    return [(int(s), int(ids[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


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
