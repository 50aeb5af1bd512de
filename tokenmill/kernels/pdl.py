"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

On Hopper and newer GPUs a kernel launched with PDL may start while the kernel before it in the
stream is still finishing (also inside CUDA graphs): its programs are placed early, do whatever
does not depend on the previous kernel — a GEMV loads its first slab of weights — and then wait
(`griddepcontrol.wait`) until the previous kernel has finished and its writes are visible.
Each kernel launched this way must therefore wait before it writes anything, and before it
reads what the previous kernel writes (activations, scratch, the K/V it stores). Because every
kernel here lets the next one launch only after its own wait (`pdl_wait`), all kernels before
the previous one have finished when a kernel starts: it may read before its wait what was
written earlier than that — weights and tables, the step's inputs (positions, slots, KV
lengths, page table: written before the step's first layer), and K/V cached by earlier steps.
Every kernel in `tokenmill/kernels` takes a `USE_PDL` constexpr, calls `pdl_wait` before its
first store and its first read of the previous kernel's output, and is launched with
`**pdl_options(device)` — or with both off together (`wanted=False`), as the deterministic
mode's large products are (`invariant_matmul.product_pdl_options`). That keeps the rule: a
kernel launched without PDL starts once the one before it has finished, and the next starts
only after it has.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_enabled = True


def set_pdl_enabled(enabled: bool) -> None:
    """Turn PDL launches on or off for kernels launched from now on (for A/B measurements)."""
    global _enabled
    _enabled = enabled


def pdl_options(device: torch.device, wanted: bool = True) -> dict[str, bool]:
    """Launch options for a kernel on `device`: `USE_PDL` (its wait) and `launch_pdl` always
    together. On for CUDA compute capability >= 9.0 with compiled kernels (not Triton's
    interpreter), unless turned off, for all kernels or (`wanted`) for this one."""
    on = wanted and _enabled and device.type == "cuda" and _supports_pdl(device)
    return {"USE_PDL": on, "launch_pdl": on}


@functools.cache
def _supports_pdl(device: torch.device) -> bool:  # cached: asked at every kernel launch
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return not interpreted and torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel (its writes visible), then let the next kernel launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
