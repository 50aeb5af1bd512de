"""Batch-invariant matmul for deterministic mode: `x [M, K] @ W[N, K]^T (+ b)` where a row's
result does not depend on M.

A row's output element is one accumulator chain: `acc = 0`, then `acc = mma(a[k:k+16],
w[k:k+16], acc)` for k = 0, 16, 32, ... in order, over the whole of K, then the bias, then one
rounding to the output dtype. Nothing else is ever done to it: no split of K (cuBLAS and the
decode GEMV split K by the row count, and adding partial sums rounds differently from the
chain), no reduction across programs. The tile shape (BLOCK_M, BLOCK_N, BLOCK_K) only decides
which rows and columns a program holds and how many 16-wide steps of the chain one `tl.dot`
issues, so it can follow M for speed (small tiles for decode, which is weight-bandwidth-bound;
large ones for prefill) without changing any row's bits. That the tensor cores' MMA of one
16-wide step rounds alike in every instruction shape Triton picks for these tiles (`mma.sync`
for 16-row tiles, `wgmma` for 64 rows and more on Hopper) is checked on the GPU by
`tests/gpu/determinism_cases.py linear`. float32 inputs use IEEE products (no TF32): FMAs
in the same k order.

Epilogues and prologues keep that property because they are per element or per row:
`invariant_norm_matmul` folds an RMSNorm in (its weight into the input as it loads, the row's
scale onto the finished chain, the row's sum of squares as one more MMA chain), and `swiglu`
pairs interleaved gate/up columns into `silu(gate) * up` before the store.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels.gemv_config import InputNorm
from tokenmill.kernels.pdl import pdl_options, pdl_wait


class MatmulTile(NamedTuple):
    """One program's tile and launch shape."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def choose_tile(m: int, n: int) -> MatmulTile:
    """The tile for M rows and N columns (only speed depends on it, never a row's result).

    Measured on the H200 at the product shapes of Qwen3-0.6B and Llama-3.1-8B (M = 1 to
    8,192, up to sixteen tiles each; docs/perf-notes.md, session 16): up to 16 rows a product
    reads each weight once and is bandwidth-bound, so tiles of 16 rows with columns narrow
    enough for about one program per SM or more; from 17 rows on, tiles grow with M and N
    (fewer re-reads of W) while there are still enough of them to fill the GPU."""
    if m <= 16:
        if n <= 2048:
            return MatmulTile(16, 16, 256, 4, 4)
        return MatmulTile(16, 32, 128, 4, 4) if n <= 8192 else MatmulTile(16, 64, 64, 4, 3)
    if n <= 2048 and m <= 512:  # few column tiles: short row tiles
        return MatmulTile(16, 32, 128, 4, 4) if m <= 64 else MatmulTile(64, 64, 128, 4, 3)
    if m <= 64 or (m <= 128 and n <= 16384):
        return MatmulTile(64, 64, 128, 4, 3)
    if m <= 512 and n <= 16384:
        return MatmulTile(128, 64, 64, 8, 4)
    return MatmulTile(128, 128, 64, 8, 3)


@triton.jit
def _normed_slab(
    x_ptrs, res_ptrs, g_ptr, offs_k, mask, k_mask, new_res_ptrs, STORE_RES, HAS_RES: tl.constexpr
):  # fmt: skip
    """A slab of an RMSNorm's input `x (+ residual)` (rounded to x's dtype, stored to the new
    residual where STORE_RES) and of `x * weight` (rounded): what the product multiplies."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if STORE_RES:
            tl.store(new_res_ptrs, x, mask=mask)
    g = tl.load(g_ptr + offs_k, mask=k_mask, other=0.0)
    return x, (x.to(tl.float32) * g.to(tl.float32)[None, :]).to(x.dtype)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """`acc + a @ b`, one more step of each element's accumulator chain (IEEE FMAs for
    float32, no TF32)."""
    return tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)


@triton.jit
def _rms_scale(squares, K, eps, BLOCK_M: tl.constexpr):
    """Each row's `rsqrt(mean(x^2) + eps)` from the diagonal of `x @ x^T` (`squares`): the sum
    of a row's squares as one MMA chain over K, so it rounds alike in every program shape."""
    rows = tl.arange(0, BLOCK_M)
    ss = tl.sum(tl.where(rows[:, None] == rows[None, :], squares, 0.0), axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, res_ptr, new_res_ptr, g_ptr, scale_ptr, eps,
    M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr,
    HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # NORM: 0 plain; 1 an RMSNorm of x (+ residual) in the product (its weight folded into x
    # as it loads, the row scale after the chain); 2 the row scale read from `scale_ptr` (x
    # holds `norm input * weight` already, `_rms_rows_kernel`).
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Programs go down GROUP_M row tiles before the next column tile: W's tiles stay in L2.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_offs = offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    squares = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k
        mask = m_mask[:, None] & k_mask[None, :]
        if NORM == 1:  # the first column of programs writes the new residual
            xn, a = _normed_slab(
                x_ptr + x_offs + k, res_ptr + x_offs + k, g_ptr + k, offs_k, mask, k_mask,
                new_res_ptr + x_offs + k, pid_n == 0, HAS_RES,
            )  # fmt: skip
            squares = _dot(xn, tl.trans(xn), squares, IEEE)
        else:
            a = tl.load(x_ptr + x_offs + k, mask=mask, other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _dot(a, b, acc, IEEE)
        w_ptrs += BLOCK_K
    if NORM == 1:
        acc = acc * _rms_scale(squares, K, eps, BLOCK_M)[:, None]
    if NORM == 2:
        acc = acc * tl.load(scale_ptr + offs_m, mask=m_mask, other=1.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    if SWIGLU:  # columns (2j, 2j + 1) are (gate_j, up_j): SiLU-and-mul as `silu_and_mul` does
        gate, up = tl.split(tl.reshape(out, [BLOCK_M, BLOCK_N // 2, 2]))
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(up.dtype)
        out = (silu.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_mask = offs_n < N // 2
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _rms_rows_kernel(
    x_ptr, res_ptr, new_res_ptr, g_ptr, xg_ptr, scale_ptr, eps, M, K, stride_xm,
    IEEE: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # For products of more than NORM_FUSED_ROWS rows: each row's `x * weight` and scale, as the
    # fused form (NORM 1, tiles of the same BLOCK_M) computes them, for NORM 2 to use.
    pdl_wait(USE_PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    x_offs = offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    squares = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k
        mask = m_mask[:, None] & k_mask[None, :]
        xn, xg = _normed_slab(
            x_ptr + x_offs + k, res_ptr + x_offs + k, g_ptr + k, offs_k, mask, k_mask,
            new_res_ptr + x_offs + k, True, HAS_RES,
        )  # fmt: skip
        tl.store(xg_ptr + x_offs + k, xg, mask=mask)
        squares = _dot(xn, tl.trans(xn), squares, IEEE)
    tl.store(scale_ptr + offs_m, _rms_scale(squares, K, eps, BLOCK_M), mask=m_mask)


def invariant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: MatmulTile | None = None,
    swiglu: bool = False,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for a 2-D `x` `[M, K]` and `weight` `[N, K]` (last dims
    contiguous), each row's bits independent of M and of `tile` (default: `choose_tile`).

    `swiglu`: W's rows interleave an MLP's gate and up projections (gate j, up j, ...), and the
    result is `silu(gate) * up` `[M, N / 2]`: bitwise `silu_and_mul` of the plain product with
    de-interleaved rows, without writing and reading that product."""
    _check(x, weight, bias, swiglu)
    return _launch(x, weight, bias, tile or choose_tile(x.shape[0], weight.shape[0]), swiglu)


# Up to this many rows an RMSNorm in front of the product runs inside it (tiles of 16 rows: the
# squares' product is 16 x 16 a step); above, `_rms_rows_kernel` runs first, on tiles of the
# same 16 rows (so the same bits), and the product reads its output.
NORM_FUSED_ROWS = 16
_NORM_ROWS_TILE = (16, 128)  # (rows, K columns) per program of `_rms_rows_kernel`


def invariant_norm_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm: InputNorm,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rmsnorm(x + residual) @ weight.T (+ bias), x + residual)` (`x` itself stands for the
    sum when `norm.residual` is None; the new residual is a new tensor), each row independent of
    M: the norm's weight is folded into the product's input as it loads (rounded to x's
    dtype), each row's RMS scale multiplies the finished chain, and a row's sum of squares is
    one more MMA chain (the diagonal of `x @ x^T`), not a reduction whose order follows the
    program's shape. `swiglu` as in `invariant_matmul`."""
    _check(x, weight, bias, swiglu)
    x, residual = x.contiguous(), norm.residual
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must be shaped as x {x.shape}")
        residual = residual.contiguous()
    new_residual = torch.empty_like(x) if residual is not None else x
    m, k = x.shape
    tile = choose_tile(m, weight.shape[0])
    if m <= NORM_FUSED_ROWS:
        out = _launch(x, weight, bias, tile, swiglu, 1, residual, new_residual, norm)
        return out, new_residual
    products = torch.empty_like(x)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    rows, cols = _NORM_ROWS_TILE
    _rms_rows_kernel[(triton.cdiv(m, rows),)](
        x, residual if residual is not None else x, new_residual, norm.weight, products, scale,
        norm.eps, m, k, x.stride(0),
        IEEE=x.dtype == torch.float32, HAS_RES=residual is not None, BLOCK_M=rows,
        BLOCK_K=cols, num_warps=4, **pdl_options(x.device),
    )  # fmt: skip
    return _launch(products, weight, bias, tile, swiglu, 2, scale=scale), new_residual


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, swiglu: bool) -> None:
    k, n = x.shape[1], weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"invariant_matmul takes x [M, K], W [N, K] with contiguous rows; "
            f"got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if swiglu and (n % 2 or bias is not None):
        raise ValueError(f"swiglu takes an even number of rows and no bias; got N = {n}")


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tile: MatmulTile,
    swiglu: bool,
    norm_mode: int = 0,
    residual: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None,
    norm: InputNorm | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One `_invariant_matmul_kernel` launch (`norm_mode`: its NORM)."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n // 2 if swiglu else n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n),)
    _invariant_matmul_kernel[grid](
        x, weight, bias if bias is not None else x, out,
        residual if residual is not None else x, new_residual if new_residual is not None else x,
        norm.weight if norm is not None else x, scale if scale is not None else x,
        norm.eps if norm is not None else 0.0, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, SWIGLU=swiglu,
        NORM=norm_mode, HAS_RES=residual is not None, BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=8,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_options(x.device),
    )  # fmt: skip
    return out
