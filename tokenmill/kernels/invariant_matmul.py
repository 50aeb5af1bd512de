"""Batch-invariant matmul for CUDA: `x @ W^T (+ b)` where a row's result does not depend on M.

cuBLAS (and the split-K GEMV of `kernels/gemv.py`) pick their kernel, tile and K split by the
row count M, so a row rounds differently alone and in a batch — measured on an H200 even with
split-K off. Here every output element is reduced in an order fixed by (N, K), the dtype and the
device alone:

- One tile shape for every M (`InvariantMatmulConfig`: BLOCK_M x BLOCK_N x BLOCK_K, num_warps),
  so every row goes through the same tensor-core instruction (a BLOCK_M of 64 on Hopper is one
  warp-group MMA; a smaller one would be `mma.sync`: BLOCK_M never changes with M). Rows past M
  are zeros in the tile and change nothing in the others.
- K is cut into `split_k` slices of whole BLOCK_K blocks, chosen from (N, K) and the SM count:
  enough programs for a decode step (M = 1..8, memory-bound) to cover the GPU. Each slice is
  summed block by block from zero; the slices' sums are then added in slice order, from zero.
- Two schedules, both giving that order bit for bit: while the output tiles alone do not fill
  the GPU, the slices run in parallel programs writing fp32 partials, and the last program of
  each tile to arrive (an integer ticket: it decides who adds, not the order) adds them up;
  with more output tiles (prefill), one program runs a tile's slices one after another and adds
  each slice's sum as it finishes — no workspace. Which schedule runs depends on M; the bits do
  not (`tests/kernels/test_invariant_matmul.py` checks both against each other).

One launch, no host synchronisation, scratch from the caching allocator (the graph pool under
CUDA graphs): safe to capture.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import pdl_options, pdl_wait
from tokenmill.kernels.tickets import ticket_buffer


@dataclass(frozen=True)
class InvariantMatmulConfig:
    """The fixed schedule of one weight shape. `max_split_tiles`: up to this many output tiles,
    the K slices run in parallel programs (either way the result is the same)."""

    split_k: int
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    max_split_tiles: int = 132

    def __post_init__(self) -> None:
        for name in ("split_k", "block_m", "block_n", "block_k", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def k_per_split(self, k: int) -> int:
        """Columns of K per slice: whole BLOCK_K blocks."""
        blocks = triton.cdiv(k, self.block_k)
        return triton.cdiv(blocks, self.split_k) * self.block_k

    def splits(self, k: int) -> int:
        """Slices K is actually cut into (the last ones may be empty otherwise)."""
        return triton.cdiv(k, self.k_per_split(k))


# Programs a decode product (one row tile) aims for: two per SM, so each SM has several slabs
# of W in flight. More slices than MAX_SPLIT_K cost more in partial sums than they add.
PROGRAMS_PER_SM = 2
MAX_SPLIT_K = 32


def invariant_config(n: int, k: int, sms: int) -> InvariantMatmulConfig:
    """The schedule of a `[N, K]` weight on a GPU of `sms` SMs: a function of these alone."""
    base = InvariantMatmulConfig(split_k=1, max_split_tiles=sms)
    column_tiles = triton.cdiv(n, base.block_n)
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, column_tiles)
    split = max(1, min(wanted, MAX_SPLIT_K, triton.cdiv(k, base.block_k)))
    return InvariantMatmulConfig(split_k=split, max_split_tiles=sms)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # Triton's interpreter: any fixed count
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _slice_sum(
    x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, k_lo, k_per_split, K, stride_xm, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Sum over the K slice from `k_lo` (whole BLOCK_K blocks, cut at K) of x's rows times W's
    rows, block by block from zero: `[BLOCK_M, BLOCK_N]` fp32."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    for k in range(k_lo, k_lo + k_per_split, BLOCK_K):
        ks = k + offs_k
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SERIAL: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # M is not specialised (an M of 1 would otherwise compile a kernel of its own).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    pdl_wait(USE_PDL)
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SERIAL:  # every slice here, added as it finishes
        for s in range(SPLIT_K):
            total += _slice_sum(
                x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, s * k_per_split, k_per_split, K,
                stride_xm, stride_wn,
                BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    else:  # this program's slice; the tile's last program to finish adds them all, in order
        acc = _slice_sum(
            x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, pid_k * k_per_split, k_per_split, K,
            stride_xm, stride_wn,
            BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        if SPLIT_K == 1:
            total += acc
        else:
            tile_mask = m_mask[:, None] & n_mask[None, :]
            part_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(part_ptr + pid_k * M * N + part_offs, acc, mask=tile_mask)
            tl.debug_barrier()  # every thread's partial is written before the ticket is taken
            tile = pid_m * tl.num_programs(0) + pid_n
            ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel")
            if ticket != SPLIT_K - 1:
                return
            for s in range(SPLIT_K):
                total += tl.load(
                    part_ptr + s * M * N + part_offs, mask=tile_mask, other=0.0,
                    cache_modifier=".cg",
                )  # fmt: skip
            tl.atomic_xchg(ticket_ptr + tile, 0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(
        out_ptr + out_offs, total.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )  # fmt: skip


def invariant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: InvariantMatmulConfig | None = None,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for `x` `[..., K]`, `weight` `[N, K]`, each row's result bitwise
    independent of the other rows and of how many there are. `config`: the schedule (default:
    `invariant_config` of the weight's shape on its device)."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"invariant_matmul: x {tuple(x.shape)} does not match W {(n, k)}")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    lead = x.shape[:-1]
    flat = x.reshape(-1, k)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    cfg = config or invariant_config(n, k, _sm_count(x.device))
    k_per_split = cfg.k_per_split(k)
    split_k = cfg.splits(k)
    grid_n, grid_m = triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)
    serial = split_k > 1 and grid_n * grid_m > cfg.max_split_tiles
    part = tickets = out
    if split_k > 1 and not serial:
        part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        tickets = ticket_buffer(x.device, grid_n * grid_m)
    _invariant_matmul_kernel[(grid_n, grid_m, 1 if serial else split_k)](
        flat, weight, bias if bias is not None else weight, out, part, tickets, m, n, k,
        k_per_split, flat.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_k,
        SERIAL=serial, HAS_BIAS=bias is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_options(x.device),
    )  # fmt: skip
    return out.view(*lead, n)
