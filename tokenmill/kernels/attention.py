"""Paged attention: varlen causal prefill over a cached prefix, and split-KV decode.

K/V caches are `[num_pages * page_size, Hkv, D]` (flattened pages); a sequence's position p lives
in slot `page_table[seq, p // page_size] * page_size + p % page_size`.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels.launch import cdiv, direct_launch, next_power_of_2
from tokenmill.kernels.pdl import pdl_options, pdl_wait

_LOG2E = 1.4426950408889634


@triton.jit
def _kv_block(
    cache_ptr, page_row_ptr, offs_n, valid, kvh, offs_d, PAGE: tl.constexpr, HKV: tl.constexpr,
    D: tl.constexpr,
):  # fmt: skip
    page = tl.load(page_row_ptr + offs_n // PAGE, mask=valid, other=0)
    slot = page.to(tl.int64) * PAGE + offs_n % PAGE
    ptrs = cache_ptr + slot[:, None] * (HKV * D) + kvh * D + offs_d[None, :]
    return tl.load(ptrs, mask=valid[:, None], other=0.0)


@triton.jit
def _attend_block(q, k, v, keep, m_i, l_i, acc, qk_scale):
    """One online-softmax step: fold the block of keys `k` / values `v` (where `keep`) into the
    running max `m_i`, normaliser `l_i` and output `acc` (base-2 exponentials)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _attend_causal_parts(
    q, q_pos, lo, masked_lo, hi, kv_len, window, k_cache_ptr, v_cache_ptr, page_row, kvh, offs_d,
    qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HKV: tl.constexpr, D: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """Rows of queries `q` (at positions `q_pos`) over key/value head `kvh`'s keys `lo .. hi`,
    causal (and windowed; blocks before `masked_lo` whole for every row), before normalising:
    the running max, normaliser and unnormalised output (a split of the keys, merged with the
    others by the reduce kernel)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    return _fold_causal_from(
        m_i, l_i, acc, q, q_pos, lo, masked_lo, hi, kv_len, window, k_cache_ptr, v_cache_ptr,
        page_row, kvh, offs_d, qk_scale, BLOCK_N, PAGE, HKV, D, HAS_WINDOW,
    )  # fmt: skip


@triton.jit
def _fold_causal(
    m_i, l_i, acc, q, q_pos, lo, hi, kv_len, window, k_cache_ptr, v_cache_ptr, page_row, kvh,
    offs_d, qk_scale, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HKV: tl.constexpr,
    D: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """Fold key blocks `lo .. hi` (causal, windowed) into the softmax state (`m_i`, `l_i`,
    `acc`)."""
    return _fold_causal_from(
        m_i, l_i, acc, q, q_pos, lo, lo, hi, kv_len, window, k_cache_ptr, v_cache_ptr, page_row,
        kvh, offs_d, qk_scale, BLOCK_N, PAGE, HKV, D, HAS_WINDOW,
    )  # fmt: skip


@triton.jit
def _fold_causal_from(
    m_i, l_i, acc, q, q_pos, lo, masked_lo, hi, kv_len, window, k_cache_ptr, v_cache_ptr,
    page_row, kvh, offs_d, qk_scale, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HKV: tl.constexpr, D: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """`_fold_causal`, the blocks `lo .. masked_lo` seen whole by every query (none masked: the
    same bits, fewer instructions) before the masked ones `masked_lo .. hi`."""
    for start in range(lo, masked_lo, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _kv_block(k_cache_ptr, page_row, offs_n, offs_n < hi, kvh, offs_d, PAGE, HKV, D)
        v = _kv_block(v_cache_ptr, page_row, offs_n, offs_n < hi, kvh, offs_d, PAGE, HKV, D)
        m_i, l_i, acc = _attend_block(q, k, v, True, m_i, l_i, acc, qk_scale)
    for start in range(masked_lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < kv_len
        k = _kv_block(k_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
        v = _kv_block(v_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
        keep = (offs_n[None, :] <= q_pos[:, None]) & valid[None, :]
        if HAS_WINDOW:
            keep &= offs_n[None, :] > q_pos[:, None] - window
        m_i, l_i, acc = _attend_block(q, k, v, keep, m_i, l_i, acc, qk_scale)
    return m_i, l_i, acc


@triton.jit
def _group_rows(
    q_ptr, q_start, q_len, prefix, kvh, r, offs_d, HQ: tl.constexpr, D: tl.constexpr,
    group: tl.constexpr,
):  # fmt: skip
    """Rows `r` of a program that serves every query head of key/value head `kvh` for a
    sequence's `q_len` query tokens (from `q_start`, after `prefix` cached positions), tokens
    major: row r is token r // group, head r % group of the group. Returns their queries
    (zeros past the last token), positions, (token, head) indices and mask."""
    tok = r // group
    rows = (q_start + tok).to(tl.int64) * HQ + kvh * group + r % group
    mask = tok < q_len
    q = tl.load(q_ptr + rows[:, None] * D + offs_d[None, :], mask=mask[:, None], other=0.0)
    return q, prefix + tok, rows, mask


@triton.jit
def _split_result(m_i, l_i, acc):
    """A split's normalised output and base-2 log-sum-exp of its scores (-inf where a row saw
    no position in it), as the reduce kernel merges them."""
    lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    return lse, acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]


@triton.jit
def _store_split(
    out, lse, rows, r_mask, split, SPLITS, out_ptr, mid_o_ptr, mid_lse_ptr, offs_d,
    D: tl.constexpr,
):  # fmt: skip
    """A split's result for its (token, head) `rows`: the output itself when it is the only
    split (the reduce kernel would return it bitwise), else the scratch the reduce kernel
    merges."""
    if SPLITS == 1:
        out_offs = rows[:, None] * D + offs_d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None])
    else:
        row = rows * SPLITS + split
        tl.store(mid_o_ptr + row[:, None] * D + offs_d[None, :], out, mask=r_mask[:, None])
        tl.store(mid_lse_ptr + row, lse, mask=r_mask)


# Arguments that change from step to step are plain, never specialised: a value of 1, or one
# divisible by 16, would otherwise compile a kernel of its own inside a serving run (short_q_len,
# dense_min_len; stride_pt, the page table's width: the most pages any sequence of the batch
# needs).
@direct_launch
@triton.jit(do_not_specialize=["short_q_len", "dense_min_len", "stride_pt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_q_ptr, kv_lens_ptr, page_table_ptr,
    stride_pt, qk_scale, window, short_q_len, dense_min_len,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SHORT_R: tl.constexpr,
    HAS_WINDOW: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    seq = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.num_programs(2) - 1 - tl.program_id(2)  # the longest query tiles start first
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    # A launch with SHORT_R > 0 attends the rows of at most short_q_len query tokens, one
    # program per KV head (split-KV with one split); one without, the other rows.
    if q_len <= short_q_len:
        if SHORT_R > 0:
            _verify_program(
                q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, out_ptr, out_ptr, kv_lens_ptr,
                page_table_ptr, stride_pt, qk_scale, window, seq, q_start, q_len, h, 0, 1, HQ,
                HKV, D, PAGE, SHORT_R, BLOCK_N, HAS_WINDOW,
            )  # fmt: skip
        return
    if SHORT_R > 0 or mblk * BLOCK_M >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    if dense_min_len > 0 and q_len >= dense_min_len and kv_len == q_len:
        return  # a whole prompt attended elsewhere (`attention.dense_rows`)
    prefix = kv_len - q_len
    kvh = h // (HQ // HKV)
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    m_mask = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * (HQ * D) + h * D + offs_d[None, :], mask=m_mask[:, None])
    q_pos = prefix + offs_m
    page_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    hi = tl.minimum(kv_len, prefix + (mblk + 1) * BLOCK_M)
    lo = 0
    # blocks before it are whole for every query of the tile (with a window: none)
    masked_lo = (prefix + mblk * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    if HAS_WINDOW:
        lo = tl.maximum(prefix + mblk * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        masked_lo = lo
    _, l_i, acc = _attend_causal_parts(
        q, q_pos, lo, masked_lo, hi, kv_len, window, k_cache_ptr, v_cache_ptr, page_row, kvh,
        offs_d, qk_scale, BLOCK_M, BLOCK_N, PAGE, HKV, D, HAS_WINDOW,
    )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + rows[:, None] * (HQ * D) + h * D + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None],
    )


class PrefillTiles(NamedTuple):
    """The prefill kernel's tile: query rows and keys per block, warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Measured on the H200 (benchmarks/prefill_attention.py, docs/perf-notes.md session 21): 128 x
# 128 tiles prefill long prompts fastest, but a batch that also holds decode rows or short
# chunks pads each of them to a whole tile over its whole context (the data workload ran 10%
# slower with them than with 64 x 64); a tile of 64 rows is mostly padding for queries of at
# most 32 tokens.
WIDE_PREFILL_TILES = PrefillTiles(128, 128, 8, 2)
PREFILL_TILES = PrefillTiles(64, 64, 4, 3)
SHORT_PREFILL_TILES = PrefillTiles(16, 64, 4, 2)
WIDE_MIN_Q_LEN = 128
# ... and only for batches of this many query tokens: a 512-token prompt alone would give 16
# heads 64 programs of 128 rows, half the SMs (the measured batches had 8k-32k tokens).
WIDE_MIN_TOKENS = 4096


# The wide tile's K/V stages take 128 keys x head_dim x the element size each: within a Hopper
# SM's shared memory (227 KiB) for up to 128 x 2 bytes a row (bf16 with head_dim 128: 160 KiB);
# bf16 with head_dim 256, or float32 with 128, would need 320 / 256 KiB.
WIDE_MAX_ROW_BYTES = 256


def _narrow_tiles(max_q_len: int) -> PrefillTiles:
    """The tile by the longest query alone: 64 rows, or 16 for queries of at most 32 tokens."""
    return PREFILL_TILES if max_q_len > 32 else SHORT_PREFILL_TILES


def _group_rows_block(q_len: int, num_heads: int, num_kv_heads: int) -> int:
    """Rows of a program that takes `q_len` query tokens x a KV head's group of query heads."""
    return max(16, next_power_of_2(q_len * (num_heads // num_kv_heads)))


def prefill_tiles(query_lens: list[int], head_dim: int, itemsize: int) -> PrefillTiles:
    """The prefill kernel's tile for a batch whose sequences have `query_lens` query tokens,
    heads of `head_dim` elements of `itemsize` bytes: wide when every sequence fills most of
    one, there are enough of them and its stages fit in shared memory; narrow when no sequence
    has more than 32."""
    wide_fits = head_dim * itemsize <= WIDE_MAX_ROW_BYTES
    if wide_fits and min(query_lens) >= WIDE_MIN_Q_LEN and sum(query_lens) >= WIDE_MIN_TOKENS:
        return WIDE_PREFILL_TILES
    return _narrow_tiles(max(query_lens))


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_q_len: int,
    page_size: int,
    scale: float,
    window: int | None,
    tiles: PrefillTiles | None = None,
    short_q_len: int = 0,
    dense_min_len: int = 0,
    out: torch.Tensor | None = None,
    launches: Literal["both", "short", "long"] = "both",
) -> torch.Tensor:
    """Causal attention for `q` `[T, Hq, D]` (sequences laid out by `cu_q`) over paged K/V.

    Each sequence's queries are its last `q_len` positions; its first `kv_len - q_len`
    positions are a cached prefix every query sees. `tiles`: `prefill_tiles` of the batch
    (default: by the longest query alone). Sequences of at most `short_q_len` query tokens (a
    mixed batch's decodes and short chunks) get, instead of a tile per query head over their
    whole context, one program per KV head whose rows are all their query tokens and heads of
    the group, as `verify_attention`'s with one split, in a launch of their own before the
    other rows' (in one launch, beside the long rows' tiles and in their shape, they streamed
    K/V at two thirds of the rate they reach alone). `dense_min_len` > 0: rows of at least that
    many query tokens and no cached prefix are left out (their outputs are not written).
    `out`: the output's tensor (default: a new one). `launches`: "short" makes only the short
    rows' launch, "long" only the other rows' (the short rows left out as with both), so that
    the caller can put them on different streams.
    """
    if tiles is None:
        tiles = _narrow_tiles(max_q_len)
    _tokens, hq, d = q.shape
    hkv = k_cache.shape[-2]
    out = torch.empty_like(q) if out is None else out
    common = (q, k_cache, v_cache, out, cu_q, kv_lens, page_table, page_table.stride(0),
              scale * _LOG2E, window or 0, short_q_len, dense_min_len)  # fmt: skip
    shape = dict(HQ=hq, HKV=hkv, D=d, PAGE=page_size, HAS_WINDOW=window is not None,
                 **pdl_options(q.device))  # fmt: skip
    seqs = kv_lens.shape[0]
    if launches not in ("both", "short", "long"):
        raise ValueError(f"launches must be 'both', 'short' or 'long', not {launches!r}")
    if short_q_len and launches != "long":
        short = SHORT_PREFILL_TILES
        _prefill_kernel[(seqs, hkv, 1)](
            *common, **shape, BLOCK_M=short.block_m, BLOCK_N=short.block_n,
            SHORT_R=_group_rows_block(short_q_len, hq, hkv), num_warps=short.num_warps,
            num_stages=short.num_stages,
        )  # fmt: skip
    if max_q_len > short_q_len and launches != "short":
        _prefill_kernel[(seqs, hq, cdiv(max_q_len, tiles.block_m))](
            *common, **shape, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, SHORT_R=0,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )  # fmt: skip
    return out


@triton.jit
def _merge_parts(m, den, acc, m_p, l_p, acc_p):
    """Fold a part's softmax state (`m_p`, `l_p`, `acc_p`) into the running one, with explicit
    FMAs so the one-program path (parts in registers) and `_invariant_merge_kernel` (parts read
    back from the scratch) round alike. An empty part (max -inf, sums 0) leaves the running
    state bitwise as it was; into an empty running state a part comes in bitwise as it is."""
    m_new = tl.maximum(m, m_p)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.math.exp2(m - m_safe)
    b = tl.math.exp2(m_p - m_safe)
    den = tl.fma(den, a, l_p * b)
    acc = tl.fma(acc, a[:, None], acc_p * b[:, None])
    return m_new, den, acc


@direct_launch
@triton.jit(do_not_specialize=["stride_pt"])
def _invariant_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_ml_ptr, cu_q_ptr, kv_lens_ptr,
    page_table_ptr, stride_pt, qk_scale, window, split,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PARTS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_M (query token, head) rows of one key/value head, tokens major, so a
    # decode row's whole query-head group shares one read of its K/V (like split decode). Keys
    # come in chunks of CHUNK blocks; chunk c belongs to part c % PARTS; each part is folded on
    # its own, chunk after chunk, the parts merged in order. With `split` (decode batches),
    # program (seq, kvh, p) folds part p only and stores its state for
    # `_invariant_merge_kernel`.
    pdl_wait(USE_PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    mblk = tl.where(split != 0, 0, tl.program_id(2))
    group: tl.constexpr = HQ // HKV
    span: tl.constexpr = CHUNK * BLOCK_N
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if mblk * BLOCK_M >= q_len * group:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    prefix = kv_len - q_len
    offs_d = tl.arange(0, D)
    q, q_pos, rows, m_mask = _group_rows(
        q_ptr, q_start, q_len, prefix, kvh, mblk * BLOCK_M + tl.arange(0, BLOCK_M), offs_d, HQ, D,
        group,
    )  # fmt: skip
    page_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    last_tok = tl.minimum((mblk * BLOCK_M + BLOCK_M - 1) // group, q_len - 1)
    hi = tl.minimum(kv_len, prefix + last_tok + 1)
    lo = 0
    if HAS_WINDOW:  # blocks before the tile's first query's window: masked for every row
        lo = tl.maximum(prefix + (mblk * BLOCK_M) // group - window + 1, 0) // BLOCK_N * BLOCK_N
    # Skipped blocks (masked for every row) and parts without a chunk below `hi` would leave the
    # state bitwise as it is.
    first_part = tl.where(split != 0, tl.program_id(2), 0)
    last_part = tl.where(split != 0, first_part + 1, tl.minimum(PARTS, tl.cdiv(hi, span)))
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for part in range(first_part, last_part):
        m_p = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_p = tl.zeros([BLOCK_M], tl.float32)
        acc_p = tl.zeros([BLOCK_M, D], tl.float32)
        first = (lo // span + PARTS - 1 - part) // PARTS * PARTS + part  # its first chunk >= lo
        for start in range(first * span, hi, PARTS * span):
            m_p, l_p, acc_p = _fold_causal(
                m_p, l_p, acc_p, q, q_pos, tl.maximum(start, lo), tl.minimum(start + span, hi),
                kv_len, window, k_cache_ptr, v_cache_ptr, page_row, kvh, offs_d, qk_scale,
                BLOCK_N, PAGE, HKV, D, HAS_WINDOW,
            )  # fmt: skip
        if split != 0:  # a decode row: its group's heads' part state
            row = rows * PARTS + part
            tl.store(mid_o_ptr + row[:, None] * D + offs_d[None, :], acc_p, mask=m_mask[:, None])
            tl.store(mid_ml_ptr + row * 2, m_p, mask=m_mask)
            tl.store(mid_ml_ptr + row * 2 + 1, l_p, mask=m_mask)
        else:
            m, den, acc = _merge_parts(m, den, acc, m_p, l_p, acc_p)
    if split == 0:
        out = acc / tl.where(den == 0.0, 1.0, den)[:, None]
        out_offs = rows[:, None] * D + offs_d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


@direct_launch
@triton.jit
def _invariant_merge_kernel(
    mid_o_ptr, mid_ml_ptr, out_ptr, HQ: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr,
    BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # A decode row's heads' parts merged in order, as `_invariant_kernel` merges them.
    pdl_wait(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < HQ
    offs_d = tl.arange(0, D)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for part in tl.static_range(PARTS):  # unrolled: every part's loads issued at once
        row = (seq * HQ + heads) * PARTS + part
        m_p = tl.load(mid_ml_ptr + row * 2, mask=h_mask, other=float("-inf"))
        l_p = tl.load(mid_ml_ptr + row * 2 + 1, mask=h_mask, other=0.0)
        acc_p = tl.load(mid_o_ptr + row[:, None] * D + offs_d[None, :], mask=h_mask[:, None],
                        other=0.0)  # fmt: skip
        m, den, acc = _merge_parts(m, den, acc, m_p, l_p, acc_p)
    out = acc / tl.where(den == 0.0, 1.0, den)[:, None]
    offs = (seq * HQ + heads)[:, None] * D + offs_d[None, :]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])


# Rows of (query token, head) per program of `invariant_attention`: one size for every batch,
# so every row takes the same tensor-core instructions (16: below the 64 rows of Hopper's
# warp-group MMA, whatever the batch).
INVARIANT_BLOCK_M = 16
# A row's keys in `invariant_attention`: chunks of INVARIANT_CHUNK blocks of 64 keys, chunk c
# in part c % INVARIANT_PARTS (so contexts up to 16 x 256 keys have contiguous parts, and a
# part's blocks are folded in runs of 4, which keeps loads in flight); a decode row can spread
# over INVARIANT_PARTS programs per key/value head.
INVARIANT_CHUNK = 4
INVARIANT_PARTS = 16


def invariant_scratch(
    sequences: int, num_heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Part states for split `invariant_attention` of decode batches of up to `sequences`:
    outputs `[sequences * heads * parts, head_dim]`, (max, sum) pairs `[..., 2]`."""
    rows = sequences * num_heads * INVARIANT_PARTS
    return (
        torch.empty((rows, head_dim), dtype=torch.float32, device=device),
        torch.empty((rows, 2), dtype=torch.float32, device=device),
    )


def invariant_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_q_len: int,
    page_size: int,
    scale: float,
    window: int | None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention over paged K/V, as `prefill_attention` (decode rows are sequences of one
    query), computed so that a query's output depends only on its own query, keys and values.

    Every (token, head) row folds chunk c of its keys (INVARIANT_CHUNK blocks of 64, from
    position 0) into part c % INVARIANT_PARTS, in order, and merges the parts in order (blocks
    past the row, there for other rows, are masked whole and change nothing; so do empty
    parts); programs have one fixed shape. So a token gets bitwise the same output decoded
    alone, in any batch, or in any prefill chunk, and its K/V (and with them later tokens) are
    the same whichever way they were computed. With `scratch` (`invariant_scratch`, for a
    decode batch: one query per sequence, no more sequences than it holds) each part runs in a
    program of its own and a second kernel merges them: more programs for few sequences, the
    same bits.
    """
    _tokens, hq, d = q.shape
    hkv = k_cache.shape[-2]
    group = hq // hkv
    batch = kv_lens.shape[0]
    mid_o, mid_ml = scratch if scratch is not None else (q, q)
    split = scratch is not None
    if split and (max_q_len != 1 or group > INVARIANT_BLOCK_M or batch * hq * INVARIANT_PARTS
                  > mid_o.shape[0]):  # fmt: skip
        raise ValueError(
            f"invariant_attention splits decode batches whose scratch holds them, with at most "
            f"{INVARIANT_BLOCK_M} heads per KV head; got {batch} sequences, queries of up to "
            f"{max_q_len}, {group} heads per KV head"
        )
    blocks = INVARIANT_PARTS if split else cdiv(max_q_len * group, INVARIANT_BLOCK_M)
    out = torch.empty_like(q)
    pdl = pdl_options(q.device)
    _invariant_kernel[(batch, hkv, blocks)](
        q, k_cache, v_cache, out, mid_o, mid_ml, cu_q, kv_lens, page_table, page_table.stride(0),
        scale * _LOG2E, window or 0, int(split),
        HQ=hq, HKV=hkv, D=d, PAGE=page_size, BLOCK_M=INVARIANT_BLOCK_M, BLOCK_N=64,
        CHUNK=INVARIANT_CHUNK, PARTS=INVARIANT_PARTS, HAS_WINDOW=window is not None,
        num_warps=4, num_stages=2, **pdl,
    )  # fmt: skip
    if split:
        block_h = min(2, next_power_of_2(hq))  # rows merge alone: many small programs
        _invariant_merge_kernel[(batch, cdiv(hq, block_h))](
            mid_o, mid_ml, out, HQ=hq, D=d, PARTS=INVARIANT_PARTS, BLOCK_H=block_h, **pdl,
        )  # fmt: skip
    return out


# SPLITS is a plain argument, never specialised: the split count follows the batch size
# (`attention.triton_backend.decode_splits`), and a compile per count cost seconds of start-up;
# stride_pt as in the prefill kernel.
@direct_launch
@triton.jit(do_not_specialize=["SPLITS", "stride_pt"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, kv_lens_ptr,
    page_table_ptr, stride_pt, qk_scale, window, SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    EARLY_KV: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # The step's KV lengths and page table were written before the previous kernel started (see
    # `tokenmill.kernels.pdl`): read before the wait. With EARLY_KV (for grids of one wave) the
    # splits cover the positions cached by earlier steps, each loads its first K/V block before
    # the wait too (held in registers), and the last split folds in the new token's K/V (stored
    # by the previous kernel) after it. Without, all K/V is loaded in the loop, after the wait,
    # which the compiler pipelines through shared memory (fewer registers: more programs per SM).
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    group: tl.constexpr = HQ // HKV
    kv_len = tl.load(kv_lens_ptr + seq)
    n = tl.maximum(kv_len - 1, 0) if EARLY_KV else kv_len  # positions the splits cover
    split_len = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, n)
    if HAS_WINDOW:
        lo = tl.maximum(lo, kv_len - window)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    seq64 = seq.to(tl.int64)
    page_row = page_table_ptr + seq64 * stride_pt
    if EARLY_KV:
        offs_n = lo + tl.arange(0, BLOCK_N)
        valid = offs_n < hi
        k = _kv_block(k_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
        v = _kv_block(v_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
        fold_new = (split == SPLITS - 1) & (kv_len > 0)
        new_page = tl.load(page_row + n // PAGE, mask=fold_new, other=0)
        new_at = (new_page.to(tl.int64) * PAGE + n % PAGE) * (HKV * D) + kvh * D + offs_d
    pdl_wait(USE_PDL)

    heads = kvh * group + offs_g
    g_mask = offs_g < group
    q = tl.load(
        q_ptr + seq64 * (HQ * D) + heads[:, None] * D + offs_d[None, :], mask=g_mask[:, None]
    )
    if EARLY_KV:
        k_new = tl.load(k_cache_ptr + new_at, mask=fold_new & (offs_d < D), other=0.0)
        v_new = tl.load(v_cache_ptr + new_at, mask=fold_new & (offs_d < D), other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        if not EARLY_KV:
            offs_n = start + tl.arange(0, BLOCK_N)
            valid = offs_n < hi
            k = _kv_block(k_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
            v = _kv_block(v_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
        m_i, l_i, acc = _attend_block(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale)
        if EARLY_KV:  # the next block, loaded while this one's scores are summed
            offs_n = start + BLOCK_N + tl.arange(0, BLOCK_N)
            valid = offs_n < hi
            k = _kv_block(k_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
            v = _kv_block(v_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
    if EARLY_KV:  # the new token, as one more key (-inf score: not this split's)
        s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale
        s = tl.where(fold_new, s, float("-inf"))
        m_new = tl.maximum(m_i, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe)
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
        m_i = m_new
    lse, out = _split_result(m_i, l_i, acc)
    _store_split(
        out, lse, seq64 * HQ + heads, g_mask, split, SPLITS, out_ptr, mid_o_ptr, mid_lse_ptr,
        offs_d, D,
    )  # fmt: skip


@direct_launch
@triton.jit(do_not_specialize=["SPLITS"])
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, SPLITS, HQ: tl.constexpr, D: tl.constexpr,
    BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    row = (seq * HQ + h) * SPLITS + offs_s
    lse = tl.load(mid_lse_ptr + row, mask=offs_s < SPLITS, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_safe)
    parts = tl.load(
        mid_o_ptr + row[:, None] * D + offs_d[None, :], mask=(offs_s < SPLITS)[:, None], other=0.0
    )
    total = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + (seq * HQ + h) * D + offs_d, out.to(out_ptr.dtype.element_ty))


@direct_launch
@triton.jit(do_not_specialize=["SPLITS", "stride_pt"])
def _verify_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, cu_q_ptr, kv_lens_ptr,
    page_table_ptr, stride_pt, qk_scale, window, SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # One program per (sequence, KV head, split).
    pdl_wait(USE_PDL)
    seq = tl.program_id(0)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    _verify_program(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, kv_lens_ptr,
        page_table_ptr, stride_pt, qk_scale, window, seq, q_start, q_len, tl.program_id(1),
        tl.program_id(2), SPLITS, HQ, HKV, D, PAGE, BLOCK_R, BLOCK_N, HAS_WINDOW,
    )  # fmt: skip


@triton.jit
def _verify_program(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, kv_lens_ptr,
    page_table_ptr, stride_pt, qk_scale, window, seq, q_start, q_len, kvh, split, SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """Split `split` of sequence `seq`'s keys for KV head `kvh`: its rows are every (query
    token, head of the KV head's group) of the sequence, so each K/V block is read once for
    all of them (`_store_split` writes the result)."""
    group: tl.constexpr = HQ // HKV
    kv_len = tl.load(kv_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)
    if HAS_WINDOW:  # the first query's window, down to a block (the mask does the rest)
        lo = tl.maximum(lo, (kv_len - q_len - window + 1) // BLOCK_N * BLOCK_N)
    offs_d = tl.arange(0, D)
    q, q_pos, rows, r_mask = _group_rows(
        q_ptr, q_start, q_len, kv_len - q_len, kvh, tl.arange(0, BLOCK_R), offs_d, HQ, D, group
    )
    page_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    m_i, l_i, acc = _attend_causal_parts(
        q, q_pos, lo, lo, hi, kv_len, window, k_cache_ptr, v_cache_ptr, page_row, kvh, offs_d,
        qk_scale, BLOCK_R, BLOCK_N, PAGE, HKV, D, HAS_WINDOW,
    )  # fmt: skip
    lse, out = _split_result(m_i, l_i, acc)
    _store_split(out, lse, rows, r_mask, split, SPLITS, out_ptr, mid_o_ptr, mid_lse_ptr, offs_d, D)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA `device`: programs of the split-decode kernel that run
    at once, one per SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count


# The reduce kernel's block of splits: one compile serves every split count up to it.
MAX_SPLITS_BLOCK = 16


def decode_blocks(head_dim: int, itemsize: int, early_kv: bool) -> tuple[int, int]:
    """The split-decode kernel's key block and pipeline stages: 64 keys in 2 stages with
    `early_kv` (its first block is held in registers across the PDL wait); else, where a head's
    row is at most WIDE_MAX_ROW_BYTES (K and V stages within an SM's shared memory), 128 keys
    in 3 stages: 7% / 4% faster at batch 143 / 256 over B2's context lengths (H200, session
    23's sweep of key blocks, stages and warps), the same at batch 32."""
    if early_kv or head_dim * itemsize > WIDE_MAX_ROW_BYTES:
        return 64, 2
    return 128, 3


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    early_kv: bool | None = None,
    blocks: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """One query per sequence (`q` `[B, Hq, D]`) attending to its whole paged context.

    The context is cut into `mid_o.shape[2]` splits processed in parallel, then merged by their
    log-sum-exp; `mid_o` `[>=B, Hq, S, D]` and `mid_lse` `[>=B, Hq, S]` are float32 scratch.
    Sequences with `kv_len == 0` (CUDA-graph padding) produce zeros. `early_kv` (default: when
    the grid fits in one wave of the GPU) loads each split's first K/V block before the PDL wait.
    `blocks`: (key block, stages, warps) instead of `decode_blocks`' choice (a sweep's).
    """
    batch, hq, d = q.shape
    hkv = k_cache.shape[-2]
    splits = mid_o.shape[2]
    out = torch.empty_like(q)
    group = hq // hkv
    pdl = pdl_options(q.device)
    grid = (batch, hkv, splits)
    if early_kv is None:
        early_kv = q.device.type != "cuda" or batch * hkv * splits <= sm_count(q.device)
    block_n, stages, warps = blocks or (*decode_blocks(d, q.element_size(), early_kv), 4)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, out, mid_o, mid_lse, kv_lens, page_table, page_table.stride(0),
        scale * _LOG2E, window or 0, splits,
        HQ=hq, HKV=hkv, D=d, PAGE=page_size,
        BLOCK_G=max(16, next_power_of_2(group)), BLOCK_N=block_n,
        HAS_WINDOW=window is not None, EARLY_KV=early_kv, num_warps=warps, num_stages=stages,
        **pdl,
    )  # fmt: skip
    return _merge_splits(mid_o, mid_lse, out)


def verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_q_len: int,
    page_size: int,
    scale: float,
    window: int | None,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of a few query tokens per sequence (a speculative verify step: 1 + k
    each, at most `max_q_len`), laid out by `cu_q`, over the paged context: what
    `prefill_attention` computes, split-KV as decoding is.

    The prefill kernel gives a sequence one program per query head, each reading the whole
    context alone; here a program per (sequence, KV head, split) reads its K/V blocks once for
    every query token and head of the group, and the splits (`mid_o.shape[2]`) are merged as in
    `decode_attention`. `mid_o` `[>=T, Hq, S, D]` / `mid_lse` `[>=T, Hq, S]`: float32 scratch
    (untouched with one split). Tokens in no sequence (CUDA-graph padding) are left undefined.
    """
    _, hq, d = q.shape
    hkv = k_cache.shape[-2]
    splits = mid_o.shape[2]
    out = torch.empty_like(q)
    pdl = pdl_options(q.device)
    rows = _group_rows_block(max_q_len, hq, hkv)
    _verify_split_kernel[(kv_lens.shape[0], hkv, splits)](
        q, k_cache, v_cache, out, mid_o, mid_lse, cu_q, kv_lens, page_table,
        page_table.stride(0), scale * _LOG2E, window or 0, splits,
        HQ=hq, HKV=hkv, D=d, PAGE=page_size, BLOCK_R=rows, BLOCK_N=64,
        HAS_WINDOW=window is not None, num_warps=4, num_stages=2, **pdl,
    )  # fmt: skip
    return _merge_splits(mid_o, mid_lse, out)


def _merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Merge each (query token, head)'s split results in `mid_o` / `mid_lse` into `out`
    `[T, Hq, D]` by their log-sum-exp (the second kernel of decode and verify attention; with
    one split the split kernel wrote `out` itself)."""
    tokens, hq, d = out.shape
    splits = mid_o.shape[2]
    if splits == 1:
        return out
    _decode_reduce_kernel[(tokens, hq)](
        mid_o, mid_lse, out, splits, HQ=hq, D=d,
        BLOCK_S=max(MAX_SPLITS_BLOCK, next_power_of_2(splits)), **pdl_options(out.device),
    )  # fmt: skip
    return out
