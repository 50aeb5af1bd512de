"""Paged attention: varlen causal prefill over a cached prefix, and split-KV decode.

K/V caches are `[num_pages * page_size, Hkv, D]` (flattened pages); a sequence's position p lives
in slot `page_table[seq, p // page_size] * page_size + p % page_size`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import pdl_options, pdl_wait
from tokenmill.kernels.tickets import ticket_buffer

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
def _softmax_step(s, m_i, l_i):
    """Fold scores `s` `[rows, keys]` (base 2, -inf where masked) into the running max `m_i`
    and normaliser `l_i`; returns the new max and normaliser, the keys' weights `p` and the
    factor `alpha` that rescales the output accumulated so far."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(p, axis=1), p, alpha


@triton.jit
def _attend_block(q, k, v, keep, m_i, l_i, acc, qk_scale):
    """One online-softmax step: fold the block of keys `k` / values `v` (where `keep`) into the
    running max `m_i`, normaliser `l_i` and output `acc` (base-2 exponentials)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    m_i, l_i, p, alpha = _softmax_step(tl.where(keep, s, float("-inf")), m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_i, l_i, acc


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

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    hi = tl.minimum(kv_len, prefix + (mblk + 1) * BLOCK_M)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + mblk * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < kv_len
        k = _kv_block(k_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
        v = _kv_block(v_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
        keep = (offs_n[None, :] <= q_pos[:, None]) & valid[None, :]
        if HAS_WINDOW:
            keep &= offs_n[None, :] > q_pos[:, None] - window
        m_i, l_i, acc = _attend_block(q, k, v, keep, m_i, l_i, acc, qk_scale)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
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
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, ticket_ptr, kv_lens_ptr,
    page_table_ptr, stride_pt, qk_scale, window,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (seq, KV head, split) attends its group of q heads to one slice of the context.

    Before its PDL wait it reads only what no kernel of this step writes — the KV length and
    page table (filled before the step) and its first block of cached K/V, positions before the
    new token's (earlier steps stored them) — so those loads overlap the kernel before it. The
    new token, stored by that kernel, is folded in after the wait. The last split of each
    (seq, KV head) to finish merges all splits by log-sum-exp (an arrival ticket)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    group: tl.constexpr = HQ // HKV
    kv_len = tl.load(kv_lens_ptr + seq)
    new = kv_len - 1  # the new token's position
    split_len = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)
    has_new = (lo <= new) & (new < hi)
    hi = tl.minimum(hi, new)  # the loop reads positions before the new one
    if HAS_WINDOW:
        lo = tl.maximum(lo, kv_len - window)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    heads = kvh * group + offs_g
    g_mask = offs_g < group
    seq64 = seq.to(tl.int64)
    page_row = page_table_ptr + seq64 * stride_pt
    offs_n = lo + tl.arange(0, BLOCK_N)
    valid = offs_n < hi
    k = _kv_block(k_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
    v = _kv_block(v_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
    new_n = new + tl.arange(0, 1)
    new_page = tl.load(page_row + new_n // PAGE, mask=has_new, other=0)

    pdl_wait(USE_PDL)
    q = tl.load(
        q_ptr + seq64 * (HQ * D) + heads[:, None] * D + offs_d[None, :], mask=g_mask[:, None]
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale)
        offs_n = start + BLOCK_N + tl.arange(0, BLOCK_N)
        valid = offs_n < hi
        k = _kv_block(k_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
        v = _kv_block(v_cache_ptr, page_row, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
    # The new token (in the split whose range holds it), read back as the cache holds it.
    new_off = (new_page.to(tl.int64) * PAGE + new_n % PAGE)[:, None] * (HKV * D) + kvh * D
    k_new = tl.load(k_cache_ptr + new_off + offs_d[None, :], mask=has_new, other=0.0)
    v_new = tl.load(v_cache_ptr + new_off + offs_d[None, :], mask=has_new, other=0.0)
    s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1)[:, None] * qk_scale  # [G, 1]
    m_i, l_i, p, alpha = _softmax_step(tl.where(has_new, s, float("-inf")), m_i, l_i)
    p_v = p.to(v_new.dtype).to(tl.float32) * v_new.to(tl.float32)  # as tl.dot would round p
    acc = acc * alpha[:, None] + p_v
    # log2-sum-exp of this split's scores; -inf when the split saw no position.
    lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    rows = (seq64 * HQ + heads) * SPLITS
    tl.store(mid_o_ptr + (rows + split)[:, None] * D + offs_d[None, :],
             acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], mask=g_mask[:, None])  # fmt: skip
    tl.store(mid_lse_ptr + rows + split, lse, mask=g_mask)
    tl.debug_barrier()  # every thread's partial is written before the ticket is taken
    ticket_at = ticket_ptr + seq * HKV + kvh
    if tl.atomic_add(ticket_at, 1, sem="acq_rel") == SPLITS - 1:
        _merge_splits(
            mid_o_ptr,
            mid_lse_ptr,
            out_ptr + seq64 * (HQ * D),
            rows,
            heads,
            g_mask,
            D,
            SPLITS,
            BLOCK_G,
        )
        tl.atomic_xchg(ticket_at, 0)


@triton.jit
def _merge_splits(
    mid_o_ptr, mid_lse_ptr, out_ptr, rows, heads, g_mask, D: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
):  # fmt: skip
    """out[heads] = the splits' outputs weighted by their share of the softmax mass (`rows`:
    each head's first split in the scratch). Loads bypass L1: other programs wrote them."""
    lse_at = mid_lse_ptr + rows
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        m = tl.maximum(
            m, tl.load(lse_at + s, mask=g_mask, other=float("-inf"), cache_modifier=".cg")
        )
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    offs_d = tl.arange(0, D)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for s in tl.static_range(SPLITS):
        lse = tl.load(lse_at + s, mask=g_mask, other=float("-inf"), cache_modifier=".cg")
        w = tl.math.exp2(lse - m_safe)
        part_at = mid_o_ptr + (rows + s)[:, None] * D + offs_d[None, :]
        part = tl.load(part_at, mask=g_mask[:, None], other=0.0, cache_modifier=".cg")
        total += w
        acc += w[:, None] * part
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    out_offs = heads[:, None] * D + offs_d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


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
) -> torch.Tensor:
    """One query per sequence (`q` `[B, Hq, D]`) attending to its whole paged context, whose
    last position (`kv_lens - 1`) is the query's own token, already in the cache.

    The context is cut into `mid_o.shape[2]` splits processed in parallel, and the last split
    of each sequence and KV head to finish merges them by their log-sum-exp — one launch;
    `mid_o` `[>=B, Hq, S, D]` and `mid_lse` `[>=B, Hq, S]` are float32 scratch. Sequences with
    `kv_len == 0` (CUDA-graph padding) produce zeros.
    """
    batch, hq, d = q.shape
    hkv = k_cache.shape[-2]
    splits = mid_o.shape[2]
    out = torch.empty_like(q)
    tickets = ticket_buffer(q.device, batch * hkv)
    _decode_kernel[(batch, hkv, splits)](
        q, k_cache, v_cache, out, mid_o, mid_lse, tickets, kv_lens, page_table,
        page_table.stride(0), scale * _LOG2E, window or 0,
        HQ=hq, HKV=hkv, D=d, PAGE=page_size, SPLITS=splits,
        BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)), BLOCK_N=64,
        HAS_WINDOW=window is not None, num_warps=4, num_stages=2, **pdl_options(q.device),
    )  # fmt: skip
    return out
