"""Split-K GEMV for decode: `x [M, K] @ W[N, K]^T` with M <= 8 rows, streaming W once.

cuBLAS runs these skinny products below memory bandwidth for the 4–12 MB matrices of small models
(too few loads in flight). Here a grid of (column blocks x K splits) programs each read one
`BLOCK_N x K / SPLIT_K` slab of W; with SPLIT_K > 1 the partial sums go to an fp32 workspace and
the last program of each column block to arrive (an atomic ticket) adds them up and writes the
output, then resets its ticket — one launch, no memset, safe to capture in a CUDA graph.
With `gated=True` the input is `[M, 2K]` (gate | up) and SwiGLU `silu(gate) * up` is applied as
it is loaded, so an MLP's down projection needs no separate activation kernel.

Two kernels share that frame: `_gemv_kernel` multiplies on the CUDA cores (one row's products
take as long as its weights' bytes at most), and `_gemv_dot_kernel` (`GemvConfig.dot`, for 2-8
rows: a verify step's 1 + k tokens) on the tensor cores with the operands swapped: W's rows are
the MMA's tall side and the input rows, padded to 16, its narrow side (`out^T = W x^T`), so
slabs of W stream from memory through shared memory into the MMA in Triton's software pipeline
without passing through registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.gemv_config import GemvConfig, InputNorm
from tokenmill.kernels.launch import cdiv, direct_launch, next_power_of_2
from tokenmill.kernels.pdl import pdl_options, pdl_wait
from tokenmill.kernels.tickets import last_to_arrive, reset_ticket, ticket_buffer

MAX_M = 8
# A `dot` config's rows are padded to a tensor-core tile's narrow side.
DOT_ROWS = 16


@triton.jit
def _w_slab(w_rows, k, k_hi, n_mask, BLOCK_K: tl.constexpr):
    """Columns `k .. k + BLOCK_K` (those below `k_hi`) of the program's rows of W."""
    offs = k + tl.arange(0, BLOCK_K)
    return tl.load(w_rows + offs[None, :], mask=n_mask[:, None] & (offs < k_hi)[None, :], other=0.0)


@triton.jit
def _x_slab(x_ptr, res_ptr, x_offs, mask, K, GATED: tl.constexpr, HAS_RES: tl.constexpr):
    """The input at `x_offs` (a slab of its rows' columns, either way round): (x, up half,
    residual); the last two only where GATED / HAS_RES, else `x` again."""
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    up = x
    r = x
    if GATED:  # the up half follows K columns after the gate
        up = tl.load(x_ptr + x_offs + K, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + x_offs, mask=mask, other=0.0)
    return x, up, r


@triton.jit
def _row_slab(
    x_ptr, res_ptr, offs_m, m_mask, stride_xm, k, k_hi, K, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """`_x_slab` of columns `k .. k + BLOCK_K` (below `k_hi`), rows first."""
    offs = k + tl.arange(0, BLOCK_K)
    x_offs = offs_m[:, None] * stride_xm + offs[None, :]
    mask = m_mask[:, None] & (offs < k_hi)[None, :]
    return _x_slab(x_ptr, res_ptr, x_offs, mask, K, GATED, HAS_RES)


@triton.jit
def _transformed(
    x, up, r, new_res_ptr, x_offs, mask, store_residual,
    GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """An input slab after SwiGLU (GATED) or the residual add (NORM with HAS_RES: the sum
    rounded to the activation dtype, as an eager add does, and stored as the new residual
    where `store_residual`), in float32; the norm itself is the caller's."""
    if GATED:  # x is the gate
        x = x.to(tl.float32)
        x = x * tl.sigmoid(x) * up.to(tl.float32)
    if NORM and HAS_RES:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # r: the activations' dtype
        if store_residual:
            tl.store(new_res_ptr + x_offs, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _rms_scaled(acc, sumsq, K, eps, ROWS_FIRST: tl.constexpr):
    """`acc` with each input row's RMS scale (from its `sumsq` over K) applied."""
    scale = tl.rsqrt(sumsq / K + eps)
    return acc * scale[:, None] if ROWS_FIRST else acc * scale[None, :]


@triton.jit
def _store_sums(
    acc, sumsq, out_ptr, part_ptr, ss_ptr, ticket_ptr, out_offs, part_offs, out_mask, offs_m,
    m_mask, pid_n, pid_k, M, N, K, eps,
    SPLIT_K: tl.constexpr, NORM: tl.constexpr, ROWS_FIRST: tl.constexpr,
):  # fmt: skip
    """Write a program's sums `acc` (rows x columns where ROWS_FIRST, else columns x rows) as
    the output, or, split over K, as a partial that the column block's last program adds up
    (with the rows' partial sums of squares, for NORM)."""
    if SPLIT_K == 1:
        if NORM:
            acc = _rms_scaled(acc, sumsq, K, eps, ROWS_FIRST)
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(part_ptr + pid_k * M * N + part_offs, acc, mask=out_mask)
        if NORM:  # every column block stores the same value for this slice
            tl.store(ss_ptr + pid_k * M + offs_m, sumsq, mask=m_mask)
        if last_to_arrive(ticket_ptr, pid_n, SPLIT_K):
            total = tl.zeros_like(acc)
            total_ss = tl.zeros_like(sumsq)
            for s in range(SPLIT_K):
                total += tl.load(
                    part_ptr + s * M * N + part_offs, mask=out_mask, other=0.0, cache_modifier=".cg"
                )
                if NORM:
                    total_ss += tl.load(
                        ss_ptr + s * M + offs_m, mask=m_mask, other=0.0, cache_modifier=".cg"
                    )
            if NORM:
                total = _rms_scaled(total, total_ss, K, eps, ROWS_FIRST)
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            reset_ticket(ticket_ptr, pid_n)


@triton.jit
def _program_slice(
    w_ptr, M, N, K, k_per_split, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    """This program's part of the product: its column block `pid_n` (`offs_n`, W's rows
    `w_rows`), its K split `pid_k` (columns `k_lo .. k_hi`), and the input rows `offs_m`,
    with the masks of real columns and rows."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    return pid_n, pid_k, offs_n, offs_m, offs_n < N, offs_m < M, k_lo, k_hi, w_rows


@direct_launch
@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, ticket_ptr, res_ptr, new_res_ptr, norm_w_ptr, ss_ptr, eps,
    M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, PREFETCH: tl.constexpr,
    DEFER: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pid_n, pid_k, offs_n, offs_m, n_mask, m_mask, k_lo, k_hi, w_rows = _program_slice(
        w_ptr, M, N, K, k_per_split, stride_wn, BLOCK_M, BLOCK_N
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # DEFER: products summed element-wise, reduced over K once after the loop.
    if DEFER:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        if NORM:
            sumsq2 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)  # NORM: this K slice's sum of squares
    # Slabs of W are loaded PREFETCH iterations ahead; the first ones before waiting for the
    # previous kernel (weights are constant), so under PDL they stream while that kernel ends.
    w_next = _w_slab(w_rows, k_lo, k_hi, n_mask, BLOCK_K)
    w_after = w_next
    if PREFETCH == 2:
        w_after = _w_slab(w_rows, k_lo + BLOCK_K, k_hi, n_mask, BLOCK_K)
    pdl_wait(USE_PDL)
    # The input is loaded one slab ahead too, so each slab's loads are in flight while the
    # previous one is summed (one load latency after the wait, not one per slab).
    x_next, up_next, r_next = _row_slab(
        x_ptr, res_ptr, offs_m, m_mask, stride_xm, k_lo, k_hi, K, BLOCK_K, GATED, HAS_RES
    )
    for k in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w_cur = w_next  # the next loads are issued before this slab is used
        if PREFETCH == 2:
            w_next = w_after
            w_after = _w_slab(w_rows, k + 2 * BLOCK_K, k_hi, n_mask, BLOCK_K)
        else:
            w_next = _w_slab(w_rows, k + BLOCK_K, k_hi, n_mask, BLOCK_K)
        x, up, r = x_next, up_next, r_next
        x_next, up_next, r_next = _row_slab(
            x_ptr, res_ptr, offs_m, m_mask, stride_xm, k + BLOCK_K, k_hi, K, BLOCK_K, GATED,
            HAS_RES,
        )  # fmt: skip
        x_offs = offs_m[:, None] * stride_xm + offs_k[None, :]
        x_mask = m_mask[:, None] & k_mask[None, :]
        x = _transformed(x, up, r, new_res_ptr, x_offs, x_mask, pid_n == 0, GATED, NORM, HAS_RES)
        if NORM:
            if DEFER:
                sumsq2 += x * x
            else:
                sumsq += tl.sum(x * x, axis=1)
            x = x * tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w = w_cur.to(tl.float32)
        if DEFER:
            acc3 += x[:, None, :] * w[None, :, :]
        else:
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if DEFER:
        acc = tl.sum(acc3, axis=2)
        if NORM:
            sumsq = tl.sum(sumsq2, axis=1)
    _store_sums(
        acc, sumsq, out_ptr, part_ptr, ss_ptr, ticket_ptr,
        offs_m[:, None] * stride_om + offs_n[None, :], offs_m[:, None] * N + offs_n[None, :],
        m_mask[:, None] & n_mask[None, :], offs_m, m_mask, pid_n, pid_k, M, N, K, eps,
        SPLIT_K, NORM, True,
    )  # fmt: skip


@direct_launch
@triton.jit
def _gemv_dot_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, ticket_ptr, res_ptr, new_res_ptr, norm_w_ptr, ss_ptr, eps,
    M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, STAGES: tl.constexpr,
    IEEE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """`_gemv_kernel` on the tensor cores, transposed: each program sums `W[BLOCK_N, slab] @
    x[slab, BLOCK_M]^T` over its K slice in a `STAGES`-deep pipeline of slabs."""
    pid_n, pid_k, offs_n, offs_m, n_mask, m_mask, k_lo, k_hi, w_rows = _program_slice(
        w_ptr, M, N, K, k_per_split, stride_wn, BLOCK_M, BLOCK_N
    )
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)  # NORM: this K slice's sum of squares
    pdl_wait(USE_PDL)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x_offs = offs_m[None, :] * stride_xm + offs_k[:, None]
        x_mask = m_mask[None, :] & k_mask[:, None]
        x, up, r = _x_slab(x_ptr, res_ptr, x_offs, x_mask, K, GATED, HAS_RES)
        x = _transformed(x, up, r, new_res_ptr, x_offs, x_mask, pid_n == 0, GATED, NORM, HAS_RES)
        if NORM:
            sumsq += tl.sum(x * x, axis=0)
            x = x * tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)[:, None]
        # The transformed input rounded to W's dtype, as the unfused kernels store it.
        if IEEE:  # float32 weights: no TF32 rounding
            acc = tl.dot(w, x.to(w.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x.to(w.dtype), acc)
    _store_sums(
        acc, sumsq, out_ptr, part_ptr, ss_ptr, ticket_ptr,
        offs_m[None, :] * stride_om + offs_n[:, None], offs_m[None, :] * N + offs_n[:, None],
        m_mask[None, :] & n_mask[:, None], offs_m, m_mask, pid_n, pid_k, M, N, K, eps,
        SPLIT_K, NORM, False,
    )  # fmt: skip


def dot_normed_ok(dtype: torch.dtype) -> bool:
    """Whether a `dot` config may norm an input of `dtype`: it rounds `(x + residual) * g` to
    the weights' dtype before the row's RMS scale is known (applied to the finished sums), so
    float16's range (65,504) would overflow where a large activation meets a large norm weight
    (3,000 x 30: every output of the row inf or NaN); bfloat16 and float32 have float32's."""
    return dtype != torch.float16


def gemv(
    x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, gated: bool = False
) -> torch.Tensor:
    """`x @ weight.T` for a 2-D `x` of at most MAX_M rows; both with contiguous last dims.

    With `gated`, `x` is `[M, 2K]` (gate | up) and the product is `silu(gate) * up @ weight.T`.
    """
    return _launch(x, weight, config, gated, None)[0]


def norm_gemv(
    x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, norm: InputNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rmsnorm(x + residual) @ weight.T, x + residual)` in one launch (`x` itself stands for
    the sum when `norm.residual` is None). Each row's RMS scale is applied to the finished dot
    products, so the input is read once; the new residual is a new tensor."""
    out, new_residual = _launch(x, weight, config, False, norm)
    return out, x if new_residual is None else new_residual


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig,
    gated: bool,
    norm: InputNorm | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    m, k = x.shape
    k = k // 2 if gated else k
    n = weight.shape[0]
    if m > MAX_M or weight.shape[1] != k or (gated and x.shape[1] != 2 * k):
        x_shape = f"[M <= {MAX_M}, {'2K' if gated else 'K'}]"
        raise ValueError(f"gemv takes x {x_shape}, W [N, K]; got {x.shape}, {weight.shape}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid_n = cdiv(n, config.block_n)
    k_per_split = cdiv(cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = cdiv(k, k_per_split)
    part = sumsq = out
    if split_k > 1:
        part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        sumsq = torch.empty((split_k, m), dtype=torch.float32, device=x.device)
    residual = norm.residual if norm is not None else None
    if norm is not None and config.dot and not dot_normed_ok(x.dtype):
        raise ValueError(f"a dot GemvConfig cannot norm a {x.dtype} input (see dot_normed_ok)")
    if norm is not None and not x.is_contiguous():
        raise ValueError("norm_gemv needs a contiguous x")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous()
    ):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must be contiguous, shaped and "
            "typed as x"
        )
    new_residual = torch.empty_like(x) if residual is not None else None
    args = (
        x, weight, out, part, ticket_buffer(x.device, grid_n if split_k > 1 else 0),
        residual if residual is not None else x, new_residual if new_residual is not None else x,
        norm.weight if norm is not None else x, sumsq, norm.eps if norm is not None else 0.0,
        m, n, k, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
    )  # fmt: skip
    shared = dict(
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split_k, GATED=gated,
        NORM=norm is not None, HAS_RES=residual is not None, num_warps=config.num_warps,
        **pdl_options(x.device),
    )  # fmt: skip
    if config.dot:
        _gemv_dot_kernel[(grid_n, split_k)](
            *args, BLOCK_M=max(DOT_ROWS, next_power_of_2(m)), STAGES=config.prefetch + 1,
            IEEE=weight.dtype == torch.float32, **shared,
        )  # fmt: skip
    else:
        _gemv_kernel[(grid_n, split_k)](
            *args, BLOCK_M=max(1, next_power_of_2(m)), PREFETCH=config.prefetch, DEFER=config.defer,
            **shared,
        )  # fmt: skip
    return out, new_residual
