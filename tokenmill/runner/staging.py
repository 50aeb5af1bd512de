"""Host→device copies of a step's small int64 arrays without waiting for the GPU.

A plain `torch.from_numpy(a).to("cuda")` copies from pageable memory, which makes the host
wait until the GPU has finished everything queued before it: one such copy per step undoes
overlap scheduling, and a speculative step has several. `HostStaging` writes the arrays one
after another into a pinned buffer and queues a single non-blocking copy. Buffers are used in
turn from a small ring; each remembers the event recorded after its copy, and is refilled only
once that copy has run (by then it nearly always has: the wait costs nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

RING = 4
# Each array starts a multiple of this many int64s into a block: 16 bytes, the alignment Triton
# specialises pointer arguments on (an array starting anywhere would compile a step's kernels
# again for each alignment its views happen to get: seconds inside a serving run).
ALIGN = 2


class HostStaging:
    """Uploads int64 host arrays to `device` in one copy each call (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._buffers = [torch.empty(0, dtype=torch.int64) for _ in range(RING)]
        self._copied: list[torch.cuda.Event | None] = [None] * RING
        self._next = 0

    def to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """The arrays on the device, as views of one copied block, each in its own shape."""
        flat, starts = self.stage(arrays)
        if self._cuda:
            flat = flat.to(self.device, non_blocking=True)
            self._record()
        else:  # the "copy" would be the buffer itself, which the ring reuses
            flat = flat.clone()
        return [flat[s : s + a.size].view(a.shape) for s, a in zip(starts, arrays, strict=True)]

    def upload(self, array: np.ndarray, dst: torch.Tensor) -> None:
        """An int64 host array into the start of the device tensor `dst`, in one copy."""
        dst[: array.size].copy_(self.stage([array])[0][: array.size], non_blocking=True)
        if self._cuda:
            self._record()

    def stage(self, arrays: Sequence[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
        """The arrays flattened one after another (each from a multiple of `ALIGN` elements)
        into the next buffer of the ring (pinned on CUDA), once the copy that last read it has
        run; and each array's start in it."""
        starts, total = _layout(arrays)
        i = self._next = (self._next + 1) % RING
        event = self._copied[i]
        if event is not None:
            event.synchronize()
        buffer = self._buffers[i]
        if buffer.numel() < total:
            buffer = torch.empty(max(total, 2 * buffer.numel()), dtype=torch.int64)
            if self._cuda:
                buffer = buffer.pin_memory()
            self._buffers[i] = buffer
        staging = buffer.numpy()
        for start, a in zip(starts, arrays, strict=True):
            staging[start : start + a.size] = a.reshape(-1)
        return buffer[:total], starts

    def _record(self) -> None:
        event = torch.cuda.Event()
        event.record()
        self._copied[self._next] = event


def _layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Each array's start in a block (a multiple of `ALIGN` elements) and the block's size."""
    starts, end = [], 0
    for a in arrays:
        starts.append(end)
        end += -(-a.size // ALIGN) * ALIGN
    return starts, end
