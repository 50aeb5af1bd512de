"""Gated activations."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from tokenmill.kernels import fused_silu_and_mul


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: `silu(gate) * up` where `x` is `[..., 2 * d]` holding gate then up."""
    if x.is_cuda:
        return fused_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
