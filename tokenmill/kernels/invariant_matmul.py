"""Batch-invariant matmul for deterministic mode: `x [M, K] @ W[N, K]^T (+ b)` where a row's
result does not depend on M.

K is cut into chunks by the weight's shape alone (`k_chunks`, never by M). In each chunk a
row's output element is one accumulator chain: `acc = 0`, then `acc = mma(a[k:k+16], w[k:k+16],
acc)` for k = chunk start, +16, +32, ... in order; the chunks' sums are added in chunk order to
a zero float32 total, then the bias, then one rounding to the output dtype. Nothing else is
ever done to it (cuBLAS and the decode GEMV split K by the row count, and partial sums added
another way round differently). Where the chunks run is free: while the tiles are too few to
fill the GPU, a program per (tile, chunk) writes its float32 sums and the tile's last program
to finish adds them in order (decode, and up to a few hundred rows: a large weight with few
column tiles, Llama-3.1-8B's o and down have 128 at 32 columns, streams through 2x the
programs); otherwise each program loops over its tile's chunks, the same additions. The tile
shape (BLOCK_M, BLOCK_N, BLOCK_K) only decides which rows and columns a program holds and how
many 16-wide steps of the chain one `tl.dot` issues (chunk lengths are multiples of every
BLOCK_K), so it can follow M for speed (small tiles for decode, which is weight-bandwidth-
bound; large ones for prefill) without changing any row's bits. That the tensor cores' MMA of
one 16-wide step rounds alike in every instruction shape Triton picks for these tiles
(`mma.sync` for 16-row tiles, `wgmma` for 64 rows and more on Hopper) is checked on the GPU by
`tests/gpu/determinism_cases.py linear`. float32 inputs use IEEE products (no TF32): FMAs in
the same k order.

The `swiglu` epilogue keeps that property because it is per element: it pairs interleaved
gate/up columns into `silu(gate) * up` before the store. Products of more than TMA_MIN_ROWS
rows load their x and W blocks through tensor descriptors (TMA, Hopper) instead of pointers:
the same blocks into the same MMAs, so the same bits (checked on the GPU against pointer loads).

A product is launched with PDL (`kernels/pdl.py`) only when its weight is at most
PDL_MAX_WEIGHT_BYTES: a small product is latency-bound and gains from starting while the kernel
before it ends, while Llama-3.1-8B's products (34-235 MB) ran a deterministic decode step at
7.08 ms under PDL against 4.93 ms without (H200, session 19).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tokenmill.kernels.activation import silu_mul
from tokenmill.kernels.launch import cdiv, direct_launch
from tokenmill.kernels.pdl import pdl_options, pdl_wait
from tokenmill.kernels.tickets import last_to_arrive, reset_ticket, ticket_buffer

# The largest weight whose product launches with PDL (see the module docstring): Qwen3-0.6B's
# layers' are 4-13 MB (o 4, q/k/v 8, down 6.3, gate/up 12.6), Llama-3.1-8B's 34 MB and more.
PDL_MAX_WEIGHT_BYTES = 16 << 20
# K's chunks of a larger weight (`k_chunks`): enough for about two programs an SM of an H200
# (132) at decode, each chunk at least MIN_CHUNK columns; chunk lengths a multiple of
# CHUNK_ALIGN.
DECODE_PROGRAMS = 256
MIN_CHUNK = 512
CHUNK_ALIGN = 256
# Products of more than this many rows (prefill) load x and W through the tensor memory
# accelerator where the GPU has one (`tma_operands`): Llama-3.1-8B's B2 mixed steps 9% faster
# (H200, session 32); its 256-row decode steps were 5% slower through it.
TMA_MIN_ROWS = 512


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
def _dot(a, b, acc, IEEE: tl.constexpr):
    """`acc + a @ b`, one more step of each element's accumulator chain (IEEE FMAs for
    float32, no TF32)."""
    return tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)


@triton.jit
def _chain(
    x_ptr, w_ptr, pid_m, pid_n, M, N, k_lo, k_hi, stride_xm, stride_wn, IEEE: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One accumulator chain per element of tile (pid_m, pid_n) over K's columns [k_lo, k_hi),
    from zero. TMA: `x_ptr` and `w_ptr` are tensor descriptors of blocks [BLOCK_M | BLOCK_N,
    BLOCK_K] (zero past M, N and K; a chunk ends on a whole block): the same MMAs in the same
    order."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TMA:
        for k in range(k_lo, k_hi, BLOCK_K):
            a = x_ptr.load([pid_m * BLOCK_M, k])
            b = w_ptr.load([pid_n * BLOCK_N, k])
            acc = _dot(a, tl.trans(b), acc, IEEE)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask, n_mask = offs_m < M, offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        for k in range(k_lo, k_hi, BLOCK_K):
            k_mask = offs_k < k_hi - k
            a = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs + k, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = _dot(a, b, acc, IEEE)
    return acc


@triton.jit
def _finish(
    acc, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, pid_n, N, stride_om,
    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The bias, one rounding to the output dtype, the SwiGLU epilogue, the store."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    if SWIGLU:  # columns (2j, 2j + 1) are (gate_j, up_j): SiLU-and-mul as `silu_and_mul` does
        gate, up = tl.split(tl.reshape(out, [BLOCK_M, BLOCK_N // 2, 2]))
        out = silu_mul(gate, up).to(out_ptr.dtype.element_ty)
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_mask = offs_n < N // 2
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out, mask=m_mask[:, None] & n_mask[None, :])


@direct_launch
@triton.jit
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr, M, N, K, k_chunk, stride_xm,
    stride_wn, stride_om, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SWIGLU: tl.constexpr,
    CHUNKS: tl.constexpr, ACROSS: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """CHUNKS > 1: K in chunks of `k_chunk` columns, a chain each, added in chunk order to a
    zero total; ACROSS: a program per (tile, chunk), partial sums to `part_ptr` and the tile's
    last program to finish (an atomic ticket) adds them, else one program runs them all.
    TMA: `x_ptr` and `w_ptr` are tensor descriptors (`_chain`)."""
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
    m_mask = offs_m < M
    n_mask = offs_n < N
    pdl_wait(USE_PDL)
    if CHUNKS == 1:
        acc = _chain(x_ptr, w_ptr, pid_m, pid_n, M, N, 0, K, stride_xm, stride_wn, IEEE, TMA,
                     BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        _finish(acc, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, pid_n, N, stride_om,
                HAS_BIAS, SWIGLU, BLOCK_M, BLOCK_N)  # fmt: skip
    elif ACROSS:
        chunk = tl.program_id(1)
        k_lo = chunk * k_chunk
        acc = _chain(x_ptr, w_ptr, pid_m, pid_n, M, N, k_lo, tl.minimum(K, k_lo + k_chunk),
                     stride_xm, stride_wn, IEEE, TMA, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        part_offs = offs_m[:, None] * N + offs_n[None, :]
        tile_mask = m_mask[:, None] & n_mask[None, :]
        tl.store(part_ptr + chunk * M * N + part_offs, acc, mask=tile_mask)
        if last_to_arrive(ticket_ptr, pid, CHUNKS):
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for c in range(CHUNKS):
                total += tl.load(part_ptr + c * M * N + part_offs, mask=tile_mask, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            _finish(total, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, pid_n, N,
                    stride_om, HAS_BIAS, SWIGLU, BLOCK_M, BLOCK_N)  # fmt: skip
            reset_ticket(ticket_ptr, pid)
    else:
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c in range(CHUNKS):
            k_hi = tl.minimum(K, (c + 1) * k_chunk)
            total += _chain(x_ptr, w_ptr, pid_m, pid_n, M, N, c * k_chunk, k_hi, stride_xm,
                            stride_wn, IEEE, TMA, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        _finish(total, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, pid_n, N, stride_om,
                HAS_BIAS, SWIGLU, BLOCK_M, BLOCK_N)  # fmt: skip


def k_chunks(n: int, k: int, itemsize: int) -> int:
    """How many chunks of K a product with a weight `[n, k]` of `itemsize`-byte elements sums
    separately (`chunk_length` columns each, the last one shorter): set by the weight alone,
    never by M. A weight of at most PDL_MAX_WEIGHT_BYTES is one chunk: its product is
    latency-bound, and more programs with a reduction after them did not help it (Qwen3-0.6B's,
    B1 832 tok/s split vs 850 whole, H200). Larger ones double their chunks while the decode
    tile (`choose_tile(1, n)`) leaves fewer than DECODE_PROGRAMS programs and each chunk keeps
    at least MIN_CHUNK columns (Llama-3.1-8B's B1: 216 tok/s, 202 whole in session 19)."""
    if n * k * itemsize <= PDL_MAX_WEIGHT_BYTES:
        return 1
    programs = cdiv(n, choose_tile(1, n).block_n)
    chunks = 1
    while programs * chunks < DECODE_PROGRAMS and k >= 2 * chunks * MIN_CHUNK:
        chunks *= 2
    return chunks


def chunk_length(k: int, chunks: int) -> int:
    """Columns per chunk when K is cut into `chunks`: K / chunks rounded up to CHUNK_ALIGN, a
    multiple of every tile's BLOCK_K, so every tile's chain steps stop at the chunks' ends."""
    return cdiv(cdiv(k, chunks), CHUNK_ALIGN) * CHUNK_ALIGN


def invariant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: MatmulTile | None = None,
    swiglu: bool = False,
    chunks: int | None = None,
    across: bool | None = None,
    tma: bool | None = None,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for a 2-D `x` `[M, K]` and `weight` `[N, K]` (last dims
    contiguous), each row's bits independent of M and of `tile` (default: `choose_tile`).

    `swiglu`: W's rows interleave an MLP's gate and up projections (gate j, up j, ...), and the
    result is `silu(gate) * up` `[M, N / 2]`: bitwise `silu_and_mul` of the plain product with
    de-interleaved rows, without writing and reading that product.

    `chunks`: K's chunks (default `k_chunks`; a row's bits depend on it, so pass the same for
    every M). `across`: each chunk in programs of its own, the tile's last one adding them
    (default: while the tiles are fewer than DECODE_PROGRAMS), else all of a tile's chunks in
    one program; the same bits either way. `tma`: load through tensor descriptors where
    `tma_operands` allows (default: for more than TMA_MIN_ROWS rows), the same bits."""
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"invariant_matmul takes x [M, K], W [N, K] with contiguous rows; "
            f"got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if swiglu and (n % 2 or bias is not None):
        raise ValueError(f"swiglu takes an even number of rows and no bias; got N = {n}")
    out = torch.empty((m, n // 2 if swiglu else n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tile = tile or choose_tile(m, n)
    if CHUNK_ALIGN % tile.block_k:
        raise ValueError(f"a tile's block_k must divide {CHUNK_ALIGN}, got {tile.block_k}")
    k_chunk = chunk_length(k, chunks or k_chunks(n, k, weight.element_size()))
    num_chunks = cdiv(k, k_chunk)
    tiles = cdiv(m, tile.block_m) * cdiv(n, tile.block_n)
    across = num_chunks > 1 and (tiles < DECODE_PROGRAMS if across is None else across)
    part = torch.empty((num_chunks, m, n), dtype=torch.float32, device=x.device) if across else out
    wanted = m > TMA_MIN_ROWS if tma is None else tma
    descriptors = tma_operands(x, weight, tile) if wanted else None
    _invariant_matmul_kernel[(tiles, num_chunks if across else 1)](
        *(descriptors or (x, weight)), bias if bias is not None else x, out, part,
        ticket_buffer(x.device, tiles if across else 0), m, n, k, k_chunk,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, SWIGLU=swiglu,
        CHUNKS=num_chunks, ACROSS=across, TMA=descriptors is not None, BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=8, num_warps=tile.num_warps,
        num_stages=tile.num_stages, **product_pdl_options(weight),
    )  # fmt: skip
    return out


def tma_operands(
    x: torch.Tensor, weight: torch.Tensor, tile: MatmulTile
) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """Tensor descriptors of `x` and `weight` in blocks of `tile`, or None where the product
    loads through pointers: tiles of fewer than 64 rows (mma.sync; TMA was measured with the
    wgmma tiles only), GPUs before Hopper, float32, bases or row strides not 16-byte aligned."""
    if (
        not x.is_cuda
        or tile.block_m < 64
        or x.dtype not in (torch.bfloat16, torch.float16)
        or not _has_tma(x.device)
        or any(t.data_ptr() % 16 or t.stride(0) * t.element_size() % 16 for t in (x, weight))
    ):
        return None
    return (
        TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [tile.block_m, tile.block_k]),
        TensorDescriptor(
            weight, list(weight.shape), [weight.stride(0), 1], [tile.block_n, tile.block_k]
        ),
    )


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def product_pdl_options(weight: torch.Tensor) -> dict[str, bool]:
    """`pdl_options` for a product with `weight`: off above PDL_MAX_WEIGHT_BYTES."""
    return pdl_options(
        weight.device, weight.numel() * weight.element_size() <= PDL_MAX_WEIGHT_BYTES
    )
