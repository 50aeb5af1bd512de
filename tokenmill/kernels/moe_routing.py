"""Mixture-of-experts routing in torch: top-k selection, the token→expert sort padded to the
expert kernel's row blocks, and the kernel's tile table. No triton import: the CPU reference
path and the large-batch GPU path both use these.

The sorted layout (`SortedPairs`) is the contract between routing and the grouped-GEMM kernels
in `fused_moe.py`: pair `p = token * top_k + slot` is one (token, chosen expert) product; pairs
are grouped by expert, each expert's run padded to a multiple of `block_m` with the sentinel
`num_pairs`, so that every block of `block_m` rows belongs to one expert. Its sizes depend only
on the number of tokens (never on the routing), so a CUDA graph can hold it.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

import torch

# Batches up to this many tokens skip the sort: GEMV kernels per token
# (`fused_moe.experts_gemv`), as the dense layers' GEMV for decode batches of 1-4 rows
# (`benchmarks/moe_sweep.py` compares). Here, without triton, for the layer to ask.
GEMV_MAX_TOKENS = 4


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts, the `top_k` largest probabilities (renormalised to sum to 1
    when `renormalize`): float32 weights and int32 expert ids, each `[T, top_k]`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound of the sorted buffer's length: every pair, plus at most `block_m - 1`
    padding rows for each expert that has pairs (at most `min(E, num_pairs)` of them)."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


@dataclass(frozen=True)
class SortedPairs:
    """The pairs grouped by expert: `pair_ids` `[P]` (int32; `num_pairs` marks padding),
    `block_experts` `[P / block_m]` (int32, each block's expert; blocks at or past
    `num_padded` are unused and hold `num_experts`), `num_padded` `[1]` (int32, the rows in use)."""

    pair_ids: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedPairs:
    """Group the pairs of `topk_ids` `[T, top_k]` by expert (in pair order within an expert),
    each expert's run padded to a multiple of `block_m`: torch ops of static shapes, no host
    sync."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    first = counts.cumsum(0) - counts  # index in `order` of each expert's first pair
    rows = (ends - padded)[expert_of] + torch.arange(n, device=device) - first[expert_of]
    total = max_padded_pairs(n, num_experts, block_m)
    pair_ids = torch.full((total,), n, dtype=torch.int32, device=device)
    pair_ids[rows] = order.to(torch.int32)
    block_starts = torch.arange(0, total, block_m, device=device)
    block_experts = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return SortedPairs(pair_ids, block_experts, ends[-1:].to(torch.int32), block_m)


@dataclass(frozen=True)
class MoeKernelConfig:
    """Tiles of the expert kernels: `block_m` rows (pairs) of one expert, `block_n` output
    columns (for the gate/up kernel, `block_n / 2` of gate and the same of up), `block_k` of
    the reduction per step; Triton's `num_warps` and `num_stages`. Tiles are powers of two,
    at least 16 (`tl.dot`'s smallest), `block_n` at least 32."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name, size, least in (
            ("block_m", self.block_m, 16), ("block_n", self.block_n, 32),
            ("block_k", self.block_k, 16),
        ):  # fmt: skip
            if size < least or size & (size - 1):
                raise ValueError(
                    f"MoeKernelConfig.{name} must be a power of 2 >= {least}, got {size}"
                )


@dataclass(frozen=True)
class MoeGemvConfig:
    """Tiles of the small-batch expert kernels (`fused_moe.experts_gemv`), each program one
    token's: gate/up `block_n` rows of each of its experts, `block_k` of the reduction per
    step; down `down_block_n` rows of each, `down_block_k` per step. `num_warps` /
    `down_num_warps`: Triton's, per kernel."""

    block_n: int
    block_k: int
    num_warps: int = 4
    down_block_n: int = 4
    down_block_k: int = 128
    down_num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps", "down_block_k", "down_block_n",
                     "down_num_warps"):  # fmt: skip
            size = getattr(self, name)
            if size < 1 or size & (size - 1):
                raise ValueError(f"MoeGemvConfig.{name} must be a power of 2, got {size}")


# Gate/up: 2 rows of each of a token's 8 experts per program, 256 of the reduction per step;
# down: 8 rows of each per program, 128 per step, 8 warps. `benchmarks/moe_sweep.py` on the
# H200, qwen3-30b-a3b, session 19: gate/up alone 17.7 us a layer at one token (21.4 for
# session 11's kernel, one (token, expert) pair and 4 rows of 1,024 per program); the down
# tiles 4 x 128 and 8 x 128 within noise alone (10.6-11.2 us), both kernels 28.1 us with 8 x
# 128 vs 28.6 with 4 x 128 (30.8 before); 86.0 vs 96.3 at four tokens. Reading one expert at
# a time, the down kernel was latency-bound (B1 3.51 ms per token; 3.33 ms with all of a
# token's experts at once, session 11).
MOE_GEMV_CONFIG = MoeGemvConfig(
    block_n=2, block_k=256, down_block_n=8, down_block_k=128, down_num_warps=8
)


# Tiles by batch size (tokens): the smallest entry >= the batch applies (the last one beyond).
# Small batches read few rows per expert, so short blocks and many programs keep the weights
# streaming; large ones reuse each weight tile over many rows. Starting points: the published
# H200 tunings of E=128, N=768 expert GEMMs (vLLM's fused_moe config tables, which tile the
# same gate|up product); `benchmarks/moe_sweep.py` measures the candidates here.
MOE_CONFIGS: dict[int, MoeKernelConfig] = {
    2: MoeKernelConfig(16, 64, 64, num_warps=4, num_stages=4),
    16: MoeKernelConfig(16, 64, 128, num_warps=4, num_stages=3),
    48: MoeKernelConfig(16, 128, 128, num_warps=4, num_stages=3),
    128: MoeKernelConfig(16, 128, 128, num_warps=4, num_stages=2),
    256: MoeKernelConfig(32, 256, 128, num_warps=4, num_stages=2),
    512: MoeKernelConfig(64, 128, 64, num_warps=4, num_stages=3),
    1 << 62: MoeKernelConfig(128, 256, 64, num_warps=8, num_stages=4),
}
_BOUNDS = sorted(MOE_CONFIGS)


def moe_config_for(num_tokens: int, dtype: torch.dtype = torch.bfloat16) -> MoeKernelConfig:
    """The tiles for a batch of `num_tokens` tokens (`MOE_CONFIGS`). Float32 operands take
    twice the shared memory per tile: their K tiles and pipeline are cut to fit (float32 runs
    are for checking correctness, not speed)."""
    config = MOE_CONFIGS[_BOUNDS[bisect.bisect_left(_BOUNDS, num_tokens)]]
    if dtype.itemsize > 2:
        config = dataclasses.replace(
            config, block_k=min(config.block_k, 32), num_stages=min(config.num_stages, 2)
        )
    return config
