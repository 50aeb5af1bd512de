"""Split-K GEMV for decode: `x [M, K] @ W[N, K]^T` with M <= 8 rows, streaming W once.

cuBLAS runs these skinny products below memory bandwidth for the 4–12 MB matrices of small models
(too few loads in flight). Here a grid of (column blocks x K splits) programs each read one
`BLOCK_N x K / SPLIT_K` slab of W; with SPLIT_K > 1 the partial sums go to an fp32 workspace and
the last program of each column block to arrive (an atomic ticket) adds them up and writes the
output, then resets its ticket — one launch, no memset, safe to capture in a CUDA graph.
With `gated=True` the input is `[M, 2K]` (gate | up) and SwiGLU `silu(gate) * up` is applied as
it is loaded, so an MLP's down projection needs no separate activation kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.tickets import ticket_buffer

MAX_M = 8


@dataclass(frozen=True)
class GemvConfig:
    """Tile sizes and K split of one launch."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, ticket_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GATED: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        x_mask = m_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
        if GATED:  # x is the gate; the up half follows K columns later
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
            x = x * tl.sigmoid(x) * up
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    out_offs = offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part_offs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + part_offs, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(
                    part_ptr + s * M * N + part_offs, mask=out_mask, other=0.0, cache_modifier=".cg"
                )
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(ticket_ptr + pid_n, 0)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, gated: bool = False
) -> torch.Tensor:
    """`x @ weight.T` for a 2-D `x` of at most MAX_M rows; both with contiguous last dims.

    With `gated`, `x` is `[M, 2K]` (gate | up) and the product is `silu(gate) * up @ weight.T`.
    """
    m, k = x.shape
    k = k // 2 if gated else k
    n = weight.shape[0]
    if m > MAX_M or weight.shape[1] != k or (gated and x.shape[1] != 2 * k):
        x_shape = f"[M <= {MAX_M}, {'2K' if gated else 'K'}]"
        raise ValueError(f"gemv takes x {x_shape}, W [N, K]; got {x.shape}, {weight.shape}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid_n = triton.cdiv(n, config.block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(k, k_per_split)
    part = out
    if split_k > 1:
        part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    _gemv_kernel[(grid_n, split_k)](
        x, weight, out, part, ticket_buffer(x.device, grid_n if split_k > 1 else 0),
        m, n, k, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, SPLIT_K=split_k, GATED=gated, num_warps=config.num_warps,
    )  # fmt: skip
    return out
