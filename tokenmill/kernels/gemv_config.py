"""The GEMV kernel's launch settings and fused input norm: plain data, importable without triton
(the layers hold them on CPU-only installs too)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GemvConfig:
    """Tile sizes and K split of one launch; `prefetch`: slabs of W loaded ahead of the one
    being multiplied (1 or 2; up to 3 with `dot`); `defer`: sum products element-wise and
    reduce over K once at the end (more registers, fewer shuffles per slab); `dot`: multiply
    each slab on the tensor cores (`tl.dot`, W's `block_n` rows by the input rows padded to
    16) instead of the CUDA cores, whose multiply-adds at 5-8 rows take about as long as
    streaming the weights."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    prefetch: int = 1
    defer: bool = False
    dot: bool = False

    def __post_init__(self) -> None:
        most = 3 if self.dot else 2
        if not 1 <= self.prefetch <= most:
            raise ValueError(f"GemvConfig.prefetch must be 1..{most}, got {self.prefetch}")
        if self.dot and (self.defer or min(self.block_n, self.block_k) < 16):
            raise ValueError("a GemvConfig with dot needs block_n, block_k >= 16 and no defer")

    def serves(self, rows: int) -> bool:
        """Whether the config is worth running for inputs of up to `rows` rows: deferred sums
        hold rows x tile values per thread, so they are kept to at most two rows; tensor-core
        tiles are for more than one."""
        if self.dot:
            return rows > 1
        return rows <= 2 or not self.defer


@dataclass(frozen=True)
class InputNorm:
    """An RMSNorm (`weight`, `eps`) applied to `x + residual` (or `x`) before the product."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None
