"""The GEMV kernel's launch settings and fused input norm: plain data, importable without triton
(the layers hold them on CPU-only installs too)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GemvConfig:
    """Tile sizes and K split of one launch; `prefetch` (1 or 2): slabs of W loaded ahead of
    the one being multiplied; `defer`: sum products element-wise and reduce over K once at the
    end (more registers, fewer shuffles per slab)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    prefetch: int = 1
    defer: bool = False

    def __post_init__(self) -> None:
        if self.prefetch not in (1, 2):
            raise ValueError(f"GemvConfig.prefetch must be 1 or 2, got {self.prefetch}")

    def serves(self, rows: int) -> bool:
        """Whether the config is worth running for inputs of up to `rows` rows: deferred sums
        hold rows x tile values per thread, so they are kept to at most two rows."""
        return rows <= 2 or not self.defer


@dataclass(frozen=True)
class InputNorm:
    """An RMSNorm (`weight`, `eps`) applied to `x + residual` (or `x`) before the product."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None
