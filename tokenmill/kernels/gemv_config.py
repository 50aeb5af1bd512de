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


@dataclass(frozen=True)
class RopeStore:
    """What `rope_and_store` does after a q/k/v projection, for a GEMV that fuses it: q/k RMSNorm
    (`qk_norm`: q weight, k weight, eps), rotary by `positions` (`cos`/`sin` tables
    `[max_positions, D]`), and K/V into `k_cache`/`v_cache` `[slots, Hkv, D]` at `slots`."""

    positions: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None
