"""Batch-invariant matmul for CUDA: `x @ W^T (+ b)` where a row's result does not depend on M.

cuBLAS (and the split-K GEMV of `kernels/gemv.py`) pick their kernel, tile and K split by the
row count M, so a row rounds differently alone and in a batch — measured on an H200 even with
split-K off. Here every output element is reduced in an order fixed by (N, K), the dtype and the
device alone:

- One tile shape for every M (`InvariantMatmulConfig`: BLOCK_M x BLOCK_N x BLOCK_K, num_warps),
  so every row goes through the same tensor-core instruction (a BLOCK_M of 64 on Hopper is one
  warp-group MMA; a smaller one would be `mma.sync`: BLOCK_M never changes with M). Rows past M
  are zeros in the tile and change nothing in the others.
- K is cut into slices of whole BLOCK_K blocks and the slices into groups, by (N, K) and the
  SM count alone (`invariant_config`: enough programs for a decode step, M = 1..8 and
  memory-bound, to cover the GPU). Every element is `((0 + g_0) + g_1) + ...` over its groups,
  each group `((0 + s_0) + s_1) + ...` over its slices, each slice the MMA chain of its blocks
  from zero: fp32 additions only between programs, so no multiply-add contraction can differ.
- Three schedules give that tree bit for bit, picked by M: a program per slice (decode: the
  most programs; fp32 partials, added by the tile's last program to arrive — an integer ticket
  decides who adds, not the order), a program per group (fewer partials when all slices' would
  outgrow W), or a program per output tile running the whole tree in one loop (enough tiles to
  fill the GPU, prefill: no scratch). `tests/kernels/test_invariant_matmul.py` checks them
  against each other and rows alone against rows in batches.

One launch, no host synchronisation, scratch from the caching allocator (the graph pool under
CUDA graphs): safe to capture.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import pdl_options, pdl_wait
from tokenmill.kernels.tickets import ticket_buffer


@dataclass(frozen=True)
class InvariantMatmulConfig:
    """The fixed schedule of one weight shape: tile shape, K slices, slices per group."""

    split_k: int
    groups: int = 4
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for field in fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(f"{field.name} must be >= 1, got {getattr(self, field.name)}")

    def blocks_per_slice(self, k: int) -> int:
        return triton.cdiv(triton.cdiv(k, self.block_k), self.split_k)

    def slices(self, k: int) -> int:
        """Slices K is cut into (fewer than `split_k` where whole blocks do not spread)."""
        return triton.cdiv(triton.cdiv(k, self.block_k), self.blocks_per_slice(k))

    def slices_per_group(self, k: int) -> int:
        return triton.cdiv(self.slices(k), self.groups)


# Programs a decode product (one row tile) aims for: two per SM, so each SM has several slabs
# of W in flight. More slices than MAX_SPLIT_K cost more in partial sums than they add.
PROGRAMS_PER_SM = 2
MAX_SPLIT_K = 32
# The order of reduction levels a program's result stands for (see `invariant_matmul`).
SLICE, GROUP, TOTAL = 0, 1, 2


def invariant_config(n: int, k: int, sms: int) -> InvariantMatmulConfig:
    """The schedule of a `[N, K]` weight on a GPU of `sms` SMs: a function of these alone."""
    base = InvariantMatmulConfig(split_k=1)
    column_tiles = triton.cdiv(n, base.block_n)
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, column_tiles)
    split = max(1, min(wanted, MAX_SPLIT_K, triton.cdiv(k, base.block_k)))
    return InvariantMatmulConfig(split_k=split)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # Triton's interpreter: any fixed count
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr, M, N, K, blocks_per_slice,
    slices_per_group, num_slices, num_groups, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LEVEL: tl.constexpr,
    PARTIALS: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # M is not specialised: an M of 1 would otherwise compile (and could round) on its own.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    num_blocks = tl.cdiv(K, BLOCK_K)
    group_blocks = blocks_per_slice * slices_per_group
    # This program's blocks of K: one slice (LEVEL 0), one group of slices (1) or all (2).
    span = num_blocks
    if LEVEL == 0:
        span = blocks_per_slice
    elif LEVEL == 1:
        span = group_blocks
    b_lo = pid_k * span
    b_hi = tl.minimum(b_lo + span, num_blocks)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # the running slice's sum
    grp = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # the running group's sum
    tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in range(b_lo, b_hi):
        ks = b * BLOCK_K + offs_k
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision="ieee")
        if LEVEL > 0:  # a slice ends: into its group (the where keeps one loop to pipeline)
            slice_end = ((b + 1) % blocks_per_slice == 0) | (b + 1 == num_blocks)
            grp = tl.where(slice_end, grp + acc, grp)
            acc = tl.where(slice_end, 0.0, acc)
            if LEVEL == 2:
                group_end = ((b + 1) % group_blocks == 0) | (b + 1 == num_blocks)
                tot = tl.where(group_end, tot + grp, tot)
                grp = tl.where(group_end, 0.0, grp)
    tile_mask = m_mask[:, None] & n_mask[None, :]
    if PARTIALS:  # several programs per tile (LEVEL 0 or 1): the tile's last one adds them
        part_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        mine = acc if LEVEL == 0 else grp
        tl.store(part_ptr + pid_k * M * N + part_offs, mine, mask=tile_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        tile = pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel")
        if ticket != tl.num_programs(2) - 1:
            return
        for g in range(0, num_groups):
            grp = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if LEVEL == 0:  # the group's slices, in order
                s_hi = tl.minimum((g + 1) * slices_per_group, num_slices)
                for s in range(g * slices_per_group, s_hi):
                    grp += tl.load(
                        part_ptr + s * M * N + part_offs, mask=tile_mask, other=0.0,
                        cache_modifier=".cg",
                    )  # fmt: skip
            else:
                grp += tl.load(
                    part_ptr + g * M * N + part_offs, mask=tile_mask, other=0.0,
                    cache_modifier=".cg",
                )  # fmt: skip
            tot += grp
        tl.atomic_xchg(ticket_ptr + tile, 0)
    elif LEVEL == 0:  # one slice: the whole sum
        grp += acc
        tot += grp
    elif LEVEL == 1:  # one group
        tot += grp
    if HAS_BIAS:
        tot += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptr + out_offs, tot.to(out_ptr.dtype.element_ty), mask=tile_mask)


def invariant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: InvariantMatmulConfig | None = None,
    level: int | None = None,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for `x` `[..., K]`, `weight` `[N, K]`, each row's result bitwise
    independent of the other rows and of how many there are.

    Every output element is `((0 + g_0) + g_1) + ...` over groups of K slices, each group
    `((0 + s_0) + s_1) + ...` over its slices, each slice the tensor-core sum of its K blocks
    from zero, in order. `config` (default: `invariant_config` of the weight's shape on its
    device) fixes that tree. `level` (default: by M) picks what a program computes: one slice
    (decode: the most programs; partials in fp32 scratch), one group (fewer partials), or the
    whole sum (enough output tiles to fill the GPU: no scratch). The bits do not depend on it.
    """
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
    slices, per_group = cfg.slices(k), cfg.slices_per_group(k)
    groups = triton.cdiv(slices, per_group)
    grid_n, grid_m = triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)
    if level is None:
        small = m * slices * 4 <= k * weight.element_size()  # partials no larger than W
        level = _level(grid_n * grid_m, slices, groups, small, x.device)
    programs_k = (slices, groups, 1)[level]
    part = tickets = out
    if programs_k > 1:
        part = torch.empty((programs_k, m, n), dtype=torch.float32, device=x.device)
        tickets = ticket_buffer(x.device, grid_n * grid_m)
    _invariant_matmul_kernel[(grid_n, grid_m, programs_k)](
        flat, weight, bias if bias is not None else weight, out, part, tickets, m, n, k,
        cfg.blocks_per_slice(k), per_group, slices, groups,
        flat.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, LEVEL=level,
        PARTIALS=programs_k > 1, HAS_BIAS=bias is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_options(x.device),
    )  # fmt: skip
    return out.view(*lead, n)


def _level(tiles: int, slices: int, groups: int, small_partials: bool, device: torch.device) -> int:
    """What one program computes for a product of `tiles` output tiles: the whole sum when the
    tiles fill the GPU (or K is one slice); else a slice when the fp32 partials of all slices
    (`small_partials`) cost less than reading W, or a group when that saves partials."""
    if slices == 1:
        return SLICE  # the plain loop, nothing to add
    if tiles >= _sm_count(device):
        return TOTAL
    if small_partials or groups == slices:
        return SLICE
    return GROUP if groups > 1 else TOTAL
