"""Gated activations."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from tokenmill.kernels import fused_silu_and_mul
from tokenmill.layers.invariant import invariant_swiglu


def silu_and_mul(x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """SwiGLU: `silu(gate) * up` where `x` is `[..., 2 * d]` holding gate then up;
    `batch_invariant`: each element's SiLU independent of the tensor's size
    (`invariant_pointwise`; the CUDA kernel is)."""
    if x.is_cuda:
        return fused_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    if batch_invariant:
        return invariant_swiglu(gate, up)
    return F.silu(gate) * up
