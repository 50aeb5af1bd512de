"""The GEMV kernel's launch settings and fused input norm: plain data, importable without triton
(the layers hold them on CPU-only installs too)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GemvConfig:
    """Tile sizes and K split of one launch."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4


@dataclass(frozen=True)
class InputNorm:
    """An RMSNorm (`weight`, `eps`) applied to `x + residual` (or `x`) before the product."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None
