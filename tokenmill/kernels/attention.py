"""Paged attention: varlen causal prefill over a cached prefix, and split-KV decode.

K/V caches are `[num_pages * page_size, Hkv, D]` (flattened pages); a sequence's position p lives
in slot `page_table[seq, p // page_size] * page_size + p % page_size`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

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
def _attend_causal(
    q, q_pos, lo, hi, kv_len, window, k_cache_ptr, v_cache_ptr, page_row, kvh, offs_d, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HKV: tl.constexpr,
    D: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """Output rows of queries `q` (at positions `q_pos`) over key/value head `kvh`'s keys
    `lo .. hi`, causal (and windowed), folded in blocks of BLOCK_N."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < kv_len
        k = _kv_block(k_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
        v = _kv_block(v_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
        keep = (offs_n[None, :] <= q_pos[:, None]) & valid[None, :]
        if HAS_WINDOW:
            keep &= offs_n[None, :] > q_pos[:, None] - window
        m_i, l_i, acc = _attend_block(q, k, v, keep, m_i, l_i, acc, qk_scale)
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_q_ptr, kv_lens_ptr, page_table_ptr,
    stride_pt, qk_scale, window,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    seq = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if mblk * BLOCK_M >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
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
    if HAS_WINDOW:
        lo = tl.maximum(prefix + mblk * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    out = _attend_causal(
        q, q_pos, lo, hi, kv_len, window, k_cache_ptr, v_cache_ptr, page_row, kvh, offs_d,
        qk_scale, BLOCK_M, BLOCK_N, PAGE, HKV, D, HAS_WINDOW,
    )  # fmt: skip
    tl.store(
        out_ptr + rows[:, None] * (HQ * D) + h * D + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None],
    )


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
) -> torch.Tensor:
    """Causal attention for `q` `[T, Hq, D]` (sequences laid out by `cu_q`) over paged K/V.

    Each sequence's queries are its last `q_len` positions; its first `kv_len - q_len`
    positions are a cached prefix every query sees.
    """
    _tokens, hq, d = q.shape
    hkv = k_cache.shape[-2]
    out = torch.empty_like(q)
    num_seqs = kv_lens.shape[0]
    block_m = 64 if max_q_len > 32 else 16
    grid = (num_seqs, hq, triton.cdiv(max_q_len, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_q, kv_lens, page_table, page_table.stride(0),
        scale * _LOG2E, window or 0,
        HQ=hq, HKV=hkv, D=d, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=64,
        HAS_WINDOW=window is not None, num_warps=4, num_stages=2, **pdl_options(q.device),
    )  # fmt: skip
    return out


@triton.jit
def _block_state(q, k, v, keep, qk_scale):
    """The softmax state of one block of keys `k` / values `v` (where `keep`): its max, its
    normaliser and its unnormalised output (base-2 exponentials)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    s = tl.where(keep, s, float("-inf"))
    m = tl.max(s, axis=1)
    p = tl.math.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
    return m, tl.sum(p, axis=1), tl.dot(p.to(v.dtype), v, input_precision="ieee")


@triton.jit
def _merge(m, den, acc, m_c, l_c, acc_c):
    """Fold a softmax state `(m_c, l_c, acc_c)` (max, normaliser, unnormalised output) into
    `(m, den, acc)`. Products and sums are explicit FMAs, so every kernel that merges computes
    the same bits; an empty state (`m_c` -inf, zeros) changes nothing."""
    m_new = tl.maximum(m, m_c)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.math.exp2(m - m_safe)
    b = tl.math.exp2(m_c - m_safe)
    den = tl.fma(den, a, l_c * b)
    acc = tl.fma(acc, a[:, None], acc_c * b[:, None])
    return m_new, den, acc


@triton.jit(do_not_specialize=["split"])  # a split of 1 must not compile a kernel of its own
def _invariant_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_ml_ptr, cu_q_ptr, kv_lens_ptr,
    page_table_ptr, stride_pt, qk_scale, window, split,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_M (query token, head) rows of one key/value head, tokens major, so a
    # decode row's whole query-head group shares one read of its K/V (like split decode).
    # Each block of BLOCK_N keys is a softmax of its own, folded into part p = block % SPLITS;
    # the parts are then merged in order p = 0 .. SPLITS - 1. `split` (decode batches: one
    # query per sequence) gives each part its own program (grid axis 2), which stores the
    # part's state for `_invariant_merge_kernel`; else one program runs every part and merges.
    # One binary either way, so a part's state has the same bits in both.
    pdl_wait(USE_PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    group: tl.constexpr = HQ // HKV
    mblk = tl.where(split != 0, 0, tl.program_id(2))
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if mblk * BLOCK_M >= q_len * group:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    prefix = kv_len - q_len
    r = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = r // group
    heads = kvh * group + r % group
    offs_d = tl.arange(0, D)
    m_mask = tok < q_len
    q_offs = (q_start + tok).to(tl.int64)[:, None] * (HQ * D) + heads[:, None] * D + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=m_mask[:, None], other=0.0)
    q_pos = prefix + tok
    page_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    last_tok = tl.minimum((mblk * BLOCK_M + BLOCK_M - 1) // group, q_len - 1)
    hi = tl.minimum(kv_len, prefix + last_tok + 1)
    lo = 0
    if HAS_WINDOW:  # blocks before the tile's first query's window: masked for every row
        lo = tl.maximum(prefix + (mblk * BLOCK_M) // group - window + 1, 0) // BLOCK_N * BLOCK_N
    first_part = tl.where(split != 0, tl.program_id(2), 0)
    # Parts past the tile's last block are empty (no-ops) unless a program must store them.
    last_part = tl.where(split != 0, first_part + 1, tl.minimum(SPLITS, tl.cdiv(hi, BLOCK_N)))
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for part in range(first_part, last_part):
        m_p = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_p = tl.zeros([BLOCK_M], tl.float32)
        acc_p = tl.zeros([BLOCK_M, D], tl.float32)
        # The part's blocks from the window's start (earlier ones: empty states, no-ops).
        first = (lo // BLOCK_N + SPLITS - 1 - part) // SPLITS * SPLITS + part
        for start in range(first * BLOCK_N, hi, SPLITS * BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            valid = offs_n < kv_len
            k = _kv_block(k_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
            v = _kv_block(v_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
            keep = (offs_n[None, :] <= q_pos[:, None]) & valid[None, :]
            if HAS_WINDOW:
                keep &= offs_n[None, :] > q_pos[:, None] - window
            m_c, l_c, acc_c = _block_state(q, k, v, keep, qk_scale)
            m_p, l_p, acc_p = _merge(m_p, l_p, acc_p, m_c, l_c, acc_c)
        if split != 0:  # decode: one row per head of the group
            row = (seq.to(tl.int64) * HQ + heads) * SPLITS + part
            g_mask = r < group
            tl.store(mid_o_ptr + row[:, None] * D + offs_d[None, :], acc_p, mask=g_mask[:, None])
            tl.store(mid_ml_ptr + row * 2, m_p, mask=g_mask)
            tl.store(mid_ml_ptr + row * 2 + 1, l_p, mask=g_mask)
        else:
            m, den, acc = _merge(m, den, acc, m_p, l_p, acc_p)
    if split == 0:
        out = acc / tl.where(den == 0.0, 1.0, den)[:, None]
        tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit
def _invariant_merge_kernel(
    mid_o_ptr, mid_ml_ptr, out_ptr, HQ: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # The parts of each of a decode row's heads, merged in order as `_invariant_kernel` does.
    pdl_wait(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < HQ
    offs_d = tl.arange(0, D)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for part in range(0, SPLITS):
        row = (seq * HQ + heads) * SPLITS + part
        m_p = tl.load(mid_ml_ptr + row * 2, mask=h_mask, other=float("-inf"))
        l_p = tl.load(mid_ml_ptr + row * 2 + 1, mask=h_mask, other=0.0)
        acc_p = tl.load(mid_o_ptr + row[:, None] * D + offs_d[None, :], mask=h_mask[:, None],
                        other=0.0)  # fmt: skip
        m, den, acc = _merge(m, den, acc, m_p, l_p, acc_p)
    out = acc / tl.where(den == 0.0, 1.0, den)[:, None]
    offs = (seq * HQ + heads)[:, None] * D + offs_d[None, :]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])


# Rows of (query token, head) per program of `invariant_attention`: one size for every batch,
# so every row takes the same tensor-core instructions (16: below the 64 rows of Hopper's
# warp-group MMA, whatever the batch).
INVARIANT_BLOCK_M = 16
# Parts a context's key blocks are dealt into (block i to part i % 16), merged in order: a
# decode batch may give each part a program of its own; any other batch merges them in one.
INVARIANT_SPLITS = 16


def invariant_split_rows(device: torch.device, hkv: int) -> int:
    """Decode batches of up to this many sequences give each part a program of its own in
    `invariant_attention`: below two programs per SM otherwise. None on the CPU (Triton's
    interpreter runs programs one after another: more would only add a merge)."""
    if device.type != "cuda":
        return 0
    return max(1, 2 * _one_wave(device) // hkv)


def invariant_scratch(
    rows: int, hq: int, d: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 scratch of `invariant_attention` for decode batches of up to `rows` sequences:
    each part's output `[rows, Hq, INVARIANT_SPLITS, D]`, max and normaliser `[.., 2]`."""
    shape = (rows, hq, INVARIANT_SPLITS)
    return (
        torch.empty((*shape, d), dtype=torch.float32, device=device),
        torch.empty((*shape, 2), dtype=torch.float32, device=device),
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
    scratch: tuple[torch.Tensor, torch.Tensor],
    split: bool = False,
) -> torch.Tensor:
    """Causal attention over paged K/V, as `prefill_attention` (decode rows are sequences of one
    query), computed so that a query's output depends only on its own query, keys and values.

    Every (token, head) row takes each block of 64 keys as a softmax of its own (blocks past
    the row, there for other rows, are masked whole: empty states), folds block i into part
    i % INVARIANT_SPLITS in order, and merges the parts in order; programs have one fixed
    shape. So a token gets bitwise the same output decoded alone, in any batch, or in any
    prefill chunk, and its K/V (and with them later tokens) are the same whichever way they
    were computed. `split`, for a decode batch (one query per sequence, at most as many as
    `scratch` (`invariant_scratch`) holds): each part in a program of its own, then a merge —
    more programs for few sequences, the same bits. The scratch is passed either way, so both
    run one compiled kernel.
    """
    _tokens, hq, d = q.shape
    hkv = k_cache.shape[-2]
    out = torch.empty_like(q)
    group = hq // hkv
    batch = kv_lens.shape[0]
    mid_o, mid_ml = scratch
    if split and (max_q_len != 1 or group > INVARIANT_BLOCK_M or batch > mid_o.shape[0]):
        raise ValueError(
            f"invariant_attention splits decode batches of up to {mid_o.shape[0]} sequences "
            f"with at most {INVARIANT_BLOCK_M} heads per KV head; got {batch} sequences, "
            f"queries of up to {max_q_len}, {group} heads per KV head"
        )
    blocks = INVARIANT_SPLITS if split else triton.cdiv(max_q_len * group, INVARIANT_BLOCK_M)
    pdl = pdl_options(q.device)
    _invariant_kernel[(batch, hkv, blocks)](
        q, k_cache, v_cache, out, mid_o, mid_ml, cu_q, kv_lens, page_table, page_table.stride(0),
        scale * _LOG2E, window or 0, int(split),
        HQ=hq, HKV=hkv, D=d, PAGE=page_size, BLOCK_M=INVARIANT_BLOCK_M, BLOCK_N=64,
        SPLITS=INVARIANT_SPLITS, HAS_WINDOW=window is not None, num_warps=4, num_stages=2, **pdl,
    )  # fmt: skip
    if split:
        block_h = min(16, triton.next_power_of_2(hq))
        _invariant_merge_kernel[(batch, triton.cdiv(hq, block_h))](
            mid_o, mid_ml, out, HQ=hq, D=d, SPLITS=INVARIANT_SPLITS, BLOCK_H=block_h, **pdl,
        )  # fmt: skip
    return out


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, mid_o_ptr, mid_lse_ptr, kv_lens_ptr, page_table_ptr,
    stride_pt, qk_scale, window,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
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
    # log2-sum-exp of this split's scores; -inf when the split saw no position.
    lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    row = (seq64 * HQ + heads) * SPLITS + split
    tl.store(mid_o_ptr + row[:, None] * D + offs_d[None, :], out, mask=g_mask[:, None])
    tl.store(mid_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, HQ: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
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


@functools.cache
def _one_wave(device: torch.device) -> int:
    """Programs of the split-decode kernel that run at once: one per SM (on the CPU, any)."""
    if device.type != "cuda":
        return 1 << 30
    return torch.cuda.get_device_properties(device).multi_processor_count


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
) -> torch.Tensor:
    """One query per sequence (`q` `[B, Hq, D]`) attending to its whole paged context.

    The context is cut into `mid_o.shape[2]` splits processed in parallel, then merged by their
    log-sum-exp; `mid_o` `[>=B, Hq, S, D]` and `mid_lse` `[>=B, Hq, S]` are float32 scratch.
    Sequences with `kv_len == 0` (CUDA-graph padding) produce zeros. `early_kv` (default: when
    the grid fits in one wave of the GPU) loads each split's first K/V block before the PDL wait.
    """
    batch, hq, d = q.shape
    hkv = k_cache.shape[-2]
    splits = mid_o.shape[2]
    out = torch.empty_like(q)
    group = hq // hkv
    pdl = pdl_options(q.device)
    grid = (batch, hkv, splits)
    if early_kv is None:
        early_kv = batch * hkv * splits <= _one_wave(q.device)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, mid_o, mid_lse, kv_lens, page_table, page_table.stride(0),
        scale * _LOG2E, window or 0,
        HQ=hq, HKV=hkv, D=d, PAGE=page_size, SPLITS=splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=64,
        HAS_WINDOW=window is not None, EARLY_KV=early_kv, num_warps=4, num_stages=2, **pdl,
    )  # fmt: skip
    _decode_reduce_kernel[(batch, hq)](
        mid_o, mid_lse, out, HQ=hq, D=d, SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
        **pdl,
    )  # fmt: skip
    return out
