"""Fused mixture-of-experts: routing + token→expert sort in one kernel, then two grouped GEMMs.

`fused_moe` runs an MoE feed-forward in two launches for a batch of up to `GEMV_MAX_TOKENS`
tokens (`experts_gemv`: GEMVs per token, each program reading the same rows of all of its
token's experts, for gate/up and for down, which also sums the token's top k; each program
routes its token itself, from the router logits, and the gate/up kernel may apply the RMSNorm
in front of the layer), and in four for a batch of up to `ROUTE_ALIGN_MAX_TOKENS` tokens:
`_route_align_kernel` (softmax, top-k, renormalisation and the padded sort of
`moe_routing.SortedPairs`, in one program), `_gate_up_kernel` (each row block is one expert's
pairs: x @ W_gate^T and x @ W_up^T, then SiLU(gate) * up), `_down_kernel` (the product with
W_down, scaled by the pair's routing weight) and the sum over the top-k slots. Each program of
a GEMM reads only its block's expert, so a decode step reads the weights of the experts its
tokens chose and nothing else. Larger batches route and sort with torch ops (`moe_routing`),
which spread over the GPU. Every shape depends on the token count alone (no host syncs), so the
whole of it runs inside CUDA graphs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.gemv_config import InputNorm
from tokenmill.kernels.launch import cdiv, direct_launch, next_power_of_2
from tokenmill.kernels.moe_routing import (
    GEMV_MAX_TOKENS,
    MOE_GEMV_CONFIG,
    MoeGemvConfig,
    MoeKernelConfig,
    SortedPairs,
    align_block_size,
    max_padded_pairs,
    moe_config_for,
    select_experts,
)
from tokenmill.kernels.norm import rms_norm
from tokenmill.kernels.pdl import pdl_options, pdl_wait

# Batches up to this many tokens route and sort in one single-program kernel (decode steps and
# short prefills); larger ones use torch's multi-block sort.
ROUTE_ALIGN_MAX_TOKENS = 512
_ROUTE_ROWS = 16  # tokens per step of the routing loop
# Batch-invariant mode takes this batch size's tiles for every batch (see `fused_moe`).
INVARIANT_TILES_TOKENS = 128
_SORT_PAIRS = 64  # pairs per step of the sorting loop


@triton.jit
def _route_rows(
    logits_ptr, weights_ptr, ids_ptr, t0, num_tokens, num_experts, stride_logits,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, EXPERTS: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Softmax and top-k of tokens `t0 .. t0 + ROWS`: stores their weights and expert ids;
    returns the `[ROWS, EXPERTS]` mask of the pairs chosen."""
    experts = tl.arange(0, EXPERTS)
    tokens = t0 + tl.arange(0, ROWS)
    token_ok = tokens < num_tokens
    ptrs = logits_ptr + tokens[:, None].to(tl.int64) * stride_logits + experts[None, :]
    mask = token_ok[:, None] & (experts < num_experts)[None, :]
    x = tl.load(ptrs, mask=mask, other=float("-inf"))
    x = tl.where(token_ok[:, None], x.to(tl.float32), 0.0)  # no NaN from rows past the end
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = tl.where(token_ok[:, None], p / tl.sum(p, axis=1)[:, None], 0.0)
    # Pick the top k one by one (the lowest expert id among equal probabilities, as
    # torch.topk keeps them), holding each pick's probability and slot in place.
    rest = p
    picked = tl.zeros((ROWS, EXPERTS), dtype=tl.float32)
    slots = tl.full((ROWS, EXPERTS), -1, tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(rest, axis=1)
        pick = tl.min(tl.where(rest == best[:, None], experts[None, :], EXPERTS), axis=1)
        chosen = experts[None, :] == pick[:, None]
        picked = tl.where(chosen, best[:, None], picked)
        slots = tl.where(chosen, slot, slots)
        rest = tl.where(chosen, -1.0, rest)
    if RENORMALIZE:
        picked = picked / tl.where(token_ok, tl.sum(picked, axis=1), 1.0)[:, None]
    chosen = (slots >= 0) & token_ok[:, None]
    out = tokens[:, None] * TOP_K + slots
    tl.store(weights_ptr + out, picked, mask=chosen)
    tl.store(ids_ptr + out, tl.zeros((ROWS, EXPERTS), tl.int32) + experts[None, :], mask=chosen)
    return chosen


@direct_launch
@triton.jit
def _route_align_kernel(
    logits_ptr, weights_ptr, ids_ptr, pair_ids_ptr, block_experts_ptr, num_padded_ptr,
    num_tokens, num_experts, stride_logits, num_rows, num_blocks,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    EXPERTS: tl.constexpr, ROWS: tl.constexpr, PAIRS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    experts = tl.arange(0, EXPERTS)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    # 1. Route each token; count the pairs of each expert.
    for t0 in range(0, num_tokens, ROWS):
        chosen = _route_rows(
            logits_ptr, weights_ptr, ids_ptr, t0, num_tokens, num_experts, stride_logits,
            TOP_K, RENORMALIZE, EXPERTS, ROWS,
        )  # fmt: skip
        counts += tl.sum(chosen.to(tl.int32), axis=0)
    # 2. Lay out each expert's run, padded to BLOCK_M rows; name each block's expert.
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    for b0 in range(0, num_blocks, PAIRS):
        blocks = b0 + tl.arange(0, PAIRS)
        row = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        expert = tl.minimum(expert, num_experts)  # unused blocks (beyond the last run)
        tl.store(block_experts_ptr + blocks, expert, mask=blocks < num_blocks)
    num_pairs = num_tokens * TOP_K
    padding = tl.full((PAIRS,), 0, tl.int32) + num_pairs
    for r0 in range(0, num_rows, PAIRS):
        rows = r0 + tl.arange(0, PAIRS)
        tl.store(pair_ids_ptr + rows, padding, mask=rows < num_rows)
    tl.debug_barrier()  # the ids stored in step 1 and the padding above, seen by every thread
    # 3. Place each pair after the earlier pairs of its expert.
    seen = tl.zeros((EXPERTS,), dtype=tl.int32)
    for p0 in range(0, num_pairs, PAIRS):
        pairs = p0 + tl.arange(0, PAIRS)
        pair_ok = pairs < num_pairs
        ids = tl.load(ids_ptr + pairs, mask=pair_ok, other=EXPERTS)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the same expert here
        dest = tl.sum(onehot * (before + starts[None, :] + seen[None, :]), axis=1)
        tl.store(pair_ids_ptr + dest, pairs, mask=pair_ok)
        seen += tl.sum(onehot, axis=0)


@direct_launch
@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, pair_ids_ptr, block_experts_ptr, num_padded_ptr,
    num_pairs, hidden, inter, stride_x, stride_we, stride_wn, stride_out,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, HALF_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """out[pair, cols] = silu(x[token] @ W_gate[e, cols]^T) * (x[token] @ W_up[e, cols]^T), for
    `HALF_N` columns: the program's output tile is `2 HALF_N` columns of the gate|up product."""
    pdl_wait(USE_PDL)
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * HALF_N + tl.arange(0, HALF_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_x + ks[None, :]
    g_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    u_ptrs = g_ptrs + inter * stride_wn
    gate = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = ks < hidden - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate = tl.dot(a, tl.load(g_ptrs, mask=w_mask, other=0.0), gate, input_precision="ieee")
        up = tl.dot(a, tl.load(u_ptrs, mask=w_mask, other=0.0), up, input_precision="ieee")
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@direct_launch
@triton.jit
def _down_kernel(
    h_ptr, w_ptr, out_ptr, weights_ptr, pair_ids_ptr, block_experts_ptr, num_padded_ptr,
    num_pairs, hidden, inter, stride_h, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """out[pair, cols] = weight[pair] * (h[pair] @ W_down[e, cols]^T)."""
    pdl_wait(USE_PDL)
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + pairs[:, None].to(tl.int64) * stride_h + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = ks < inter - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision="ieee")
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _top_experts(
    logits_ptr, token, num_experts, stride_logits,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, EXPERTS: tl.constexpr, SLOTS: tl.constexpr,
):  # fmt: skip
    """One token's routing: the softmax of its router logits, then its top k as (expert ids,
    weights) `[SLOTS]` in `select_experts`' order (most probable first; equal probabilities
    by expert id, as `_route_rows` picks them), the weights renormalised when RENORMALIZE;
    slots from TOP_K on hold expert 0 with weight 0.

    Each expert's probability and id are packed into one int64 key (a non-negative float's
    bits order as its value; below them the id's complement, so the lowest id wins a tie):
    one max per pick instead of a max and an argmin, and a vector of one key per expert (a
    rank count over all pairs of experts held 128 x 128 values, ~250 registers a thread)."""
    experts = tl.arange(0, EXPERTS)
    row = logits_ptr + token.to(tl.int64) * stride_logits
    x = tl.load(row + experts, mask=experts < num_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)  # padding experts: 0, below every real one (higher ids)
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)
    key = bits * 65536 + (EXPERTS - 1 - experts)
    slots = tl.arange(0, SLOTS)
    ids = tl.zeros((SLOTS,), dtype=tl.int32)
    weights = tl.zeros((SLOTS,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        pick = (EXPERTS - 1 - best % 65536).to(tl.int32)
        weight = (best // 65536).to(tl.int32).to(tl.float32, bitcast=True)
        ids = tl.where(slots == slot, pick, ids)
        weights = tl.where(slots == slot, weight, weights)
        key = tl.where(key == best, -1, key)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    return ids, weights


@direct_launch
@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, w_ptr, out_ptr, logits_ptr, norm_w_ptr, eps, hidden, inter, num_experts,
    stride_x, stride_we, stride_wn, stride_out, stride_logits,
    TOP_K: tl.constexpr, EXPERTS: tl.constexpr, SLOTS: tl.constexpr, NORM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Small batches, one token per program row: routes its token (`_top_experts`), then
    out[pair, cols] = silu(W_gate[e] x) * W_up[e] x for `BLOCK_N` columns of each of the
    token's k experts e (pair = token * k + slot), as products summed over K slabs (no
    tensor-core tiles to fill). Each step loads the same rows of all k experts (`SLOTS` = k
    rounded up to a power of 2), the next step's loads issued before this one is summed: one
    (token, expert) pair per program, routing in each, ran 21.4 us a layer against 17.7 (H200,
    qwen3-30b-a3b, one token). NORM: `x` is an RMSNorm's input; the norm weight is applied as x
    is loaded and the row's RMS scale to the finished sums (the normed input is never written
    out). Unlike the down kernel it cannot load before its wait: the router logits come from
    the kernel just before."""
    pdl_wait(USE_PDL)  # the router logits and x come from the kernels just before
    token = tl.program_id(0)
    ids, _ = _top_experts(
        logits_ptr, token, num_experts, stride_logits, TOP_K, False, EXPERTS, SLOTS
    )
    slots = tl.arange(0, SLOTS)
    slot_ok = slots < TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    g_ptrs = (w_ptr + ids.to(tl.int64)[:, None, None] * stride_we
              + cols[None, :, None].to(tl.int64) * stride_wn + ks[None, None, :])  # fmt: skip
    u_ptrs = g_ptrs + inter * stride_wn
    rows_ok = slot_ok[:, None, None] & col_ok[None, :, None]
    g_next = tl.load(g_ptrs, mask=rows_ok & (ks < hidden)[None, None, :], other=0.0)
    u_next = tl.load(u_ptrs, mask=rows_ok & (ks < hidden)[None, None, :], other=0.0)
    x_row = x_ptr + token.to(tl.int64) * stride_x
    gate = tl.zeros((SLOTS, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((SLOTS, BLOCK_N), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        g = g_next
        u = u_next
        k_next = k0 + BLOCK_K
        next_ok = rows_ok & (ks < hidden - k_next)[None, None, :]
        g_next = tl.load(g_ptrs + k_next, mask=next_ok, other=0.0)
        u_next = tl.load(u_ptrs + k_next, mask=next_ok, other=0.0)
        k_ok = ks < hidden - k0
        x = tl.load(x_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:
            sumsq += x * x
            x = x * tl.load(norm_w_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        gate += tl.sum(g.to(tl.float32) * x[None, None, :], axis=2)
        up += tl.sum(u.to(tl.float32) * x[None, None, :], axis=2)
    if NORM:
        scale = tl.rsqrt(tl.sum(sumsq, axis=0) / hidden + eps)
        gate *= scale
        up *= scale
    h = gate / (1.0 + tl.exp(-gate)) * up
    out = out_ptr + (token * TOP_K + slots)[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out, h.to(out_ptr.dtype.element_ty), mask=slot_ok[:, None] & col_ok[None, :])


@direct_launch
@triton.jit
def _down_gemv_kernel(
    h_ptr, w_ptr, out_ptr, logits_ptr, hidden, inter, num_experts,
    stride_h, stride_we, stride_wn, stride_out, stride_logits,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, EXPERTS: tl.constexpr,
    SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Small batches, one token per program row: out[token, cols] = sum over its k pairs of
    weight * W_down[e] h[pair], the top-k sum included (no separate reduction). Each step loads
    the `BLOCK_N` rows of all k experts at once (`SLOTS` = k rounded up to a power of 2): k
    times the bytes in flight of one expert at a time, which left the loads latency-bound.

    The token's routing is computed again here, before the wait: the router logits come from
    the kernel before the gate/up kernel, so (`pdl.py`) they may be read before it, and so may
    the chosen experts' weights: the first slab streams while the gate/up kernel ends."""
    token = tl.program_id(0)
    ids, weights = _top_experts(
        logits_ptr, token, num_experts, stride_logits, TOP_K, RENORMALIZE, EXPERTS, SLOTS
    )
    experts = ids.to(tl.int64)
    slots = tl.arange(0, SLOTS)
    slot_ok = slots < TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    pairs = token * TOP_K + slots
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = (w_ptr + experts[:, None, None] * stride_we
              + cols[None, :, None].to(tl.int64) * stride_wn + ks[None, None, :])  # fmt: skip
    h_ptrs = h_ptr + pairs[:, None].to(tl.int64) * stride_h + ks[None, :]
    rows_ok = slot_ok[:, None, None] & col_ok[None, :, None]
    w_next = tl.load(w_ptrs, mask=rows_ok & (ks < inter)[None, None, :], other=0.0)
    pdl_wait(USE_PDL)
    acc = tl.zeros((SLOTS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        w = w_next  # the next slab's loads are issued before this one is summed
        k_next = k0 + BLOCK_K
        w_next = tl.load(
            w_ptrs + k_next, mask=rows_ok & (ks < inter - k_next)[None, None, :], other=0.0
        )
        h = tl.load(h_ptrs + k0, mask=slot_ok[:, None] & (ks < inter - k0)[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * h.to(tl.float32)[:, None, :], axis=2)
    total = tl.sum(acc * weights[:, None], axis=0)
    out = out_ptr + token.to(tl.int64) * stride_out + cols
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=col_ok)


def experts_gemv(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    config: MoeGemvConfig,
    norm: InputNorm | None = None,
) -> torch.Tensor:
    """The MoE feed-forward of a few tokens in two launches, routing included and no sort:
    each program of the gate/up kernel routes its token by `router_logits` `[T, E]` (softmax,
    top-k, renormalised when `renormalize`) and reads its (token, expert) pairs' rows; the
    down kernel routes again and sums each token's top k. With `norm` (an RMSNorm's weight
    and eps, no residual), `x` is the norm's input and the gate/up kernel applies it."""
    h = experts_gate_up_gemv(x, gate_up, router_logits, top_k, config, norm)
    return experts_down_gemv(h, down, router_logits, top_k, renormalize, config)


def experts_gate_up_gemv(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    config: MoeGemvConfig,
    norm: InputNorm | None = None,
) -> torch.Tensor:
    """`experts_gemv`'s first launch: `silu(gate) * up` of each (token, expert) pair, `[T *
    top_k, I]`, row `t * top_k + j` for token t's j-th expert."""
    _check_rows_contiguous(x, gate_up)
    num_tokens, hidden = x.shape
    num_experts = router_logits.shape[1]
    inter = gate_up.shape[1] // 2
    if norm is not None and norm.residual is not None:
        raise ValueError("experts_gemv norms x itself: add the residual to x before")
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return h
    _gate_up_gemv_kernel[(num_tokens, cdiv(inter, config.block_n))](
        x, gate_up, h, router_logits, norm.weight if norm is not None else x,
        norm.eps if norm is not None else 0.0, hidden, inter, num_experts, x.stride(0),
        gate_up.stride(0), gate_up.stride(1), h.stride(0), router_logits.stride(0),
        TOP_K=top_k, EXPERTS=next_power_of_2(num_experts),
        SLOTS=next_power_of_2(top_k), NORM=norm is not None, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, **pdl_options(x.device),
    )  # fmt: skip
    return h


def experts_down_gemv(
    h: torch.Tensor,
    down: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    config: MoeGemvConfig,
) -> torch.Tensor:
    """`experts_gemv`'s second launch: each token's top-k weighted sum of `W_down[e] h[pair]`
    over its pairs' rows of `h` (`experts_gate_up_gemv`'s output), `[T, H]`."""
    num_tokens, num_experts = router_logits.shape
    hidden, inter = down.shape[1], down.shape[2]
    _check_rows_contiguous(h, down)
    if h.shape != (num_tokens * top_k, inter):
        raise ValueError(f"h must be [tokens * top_k, I] = {(num_tokens * top_k, inter)}, got "
                         f"{tuple(h.shape)}")  # fmt: skip
    out = torch.empty(num_tokens, hidden, dtype=h.dtype, device=h.device)
    if num_tokens == 0:
        return out
    _down_gemv_kernel[(num_tokens, cdiv(hidden, config.down_block_n))](
        h, down, out, router_logits, hidden, inter, num_experts, h.stride(0), down.stride(0),
        down.stride(1), out.stride(0), router_logits.stride(0), TOP_K=top_k,
        RENORMALIZE=renormalize, EXPERTS=next_power_of_2(num_experts),
        SLOTS=next_power_of_2(top_k), BLOCK_N=config.down_block_n,
        BLOCK_K=config.down_block_k, num_warps=config.down_num_warps, **pdl_options(h.device),
    )  # fmt: skip
    return out


def _check_rows_contiguous(x: torch.Tensor, *weights: torch.Tensor) -> None:
    if x.stride(1) != 1 or any(w.stride(2) != 1 for w in weights):
        raise ValueError("the MoE kernels need x and the expert weights contiguous in their rows")


def route_and_align(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, SortedPairs]:
    """`moe_routing.select_experts` and `align_block_size` in one single-program launch:
    (weights `[T, top_k]` float32, expert ids `[T, top_k]` int32, the sorted pairs)."""
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    rows = max_padded_pairs(num_tokens * top_k, num_experts, block_m)
    num_blocks = cdiv(rows, block_m)
    pair_ids = torch.empty(rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    if num_tokens:
        _route_align_kernel[(1,)](
            router_logits, weights, ids, pair_ids, block_experts, num_padded,
            num_tokens, num_experts, router_logits.stride(0), rows, num_blocks,
            TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_M=block_m,
            EXPERTS=next_power_of_2(num_experts), ROWS=_ROUTE_ROWS, PAIRS=_SORT_PAIRS,
            num_warps=4, **pdl_options(device),
        )  # fmt: skip
    return weights, ids, SortedPairs(pair_ids, block_experts, num_padded, block_m)


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_pairs: SortedPairs,
    config: MoeKernelConfig,
    sum_top_k: bool = True,
) -> torch.Tensor:
    """`sum_j topk_weights[t, j] * down[e_j] @ (silu(gate[e_j] @ x[t]) * up[e_j] @ x[t])` for
    each token `t` of `x` `[T, H]`, over the pairs in `sorted_pairs` (from the same routing as
    `topk_weights` `[T, top_k]`); `gate_up` `[E, 2I, H]` (gate rows, then up), `down`
    `[E, H, I]`. `sum_top_k=False` returns the weighted products per pair, `[T * top_k, H]`,
    unsummed."""
    num_tokens, hidden = x.shape
    top_k = topk_weights.shape[1]
    inter = down.shape[2]
    num_pairs = num_tokens * top_k
    if sorted_pairs.block_m != config.block_m:
        raise ValueError(
            f"pairs sorted for block_m={sorted_pairs.block_m}, config has {config.block_m}"
        )
    _check_rows_contiguous(x, gate_up, down)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    blocks = sorted_pairs.block_experts.numel()
    meta = {"BLOCK_M": config.block_m, "BLOCK_K": config.block_k, "num_warps": config.num_warps,
            "num_stages": config.num_stages, **pdl_options(x.device)}  # fmt: skip
    s = sorted_pairs
    half = config.block_n // 2
    _gate_up_kernel[(blocks, cdiv(inter, half))](
        x, gate_up, h, s.pair_ids, s.block_experts, s.num_padded,
        num_pairs, hidden, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        TOP_K=top_k, HALF_N=half, **meta,
    )  # fmt: skip
    _down_kernel[(blocks, cdiv(hidden, config.block_n))](
        h, down, out, topk_weights, s.pair_ids, s.block_experts, s.num_padded,
        num_pairs, hidden, inter, h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_N=config.block_n, **meta,
    )  # fmt: skip
    if not sum_top_k or top_k == 1:
        return out
    return out.view(num_tokens, top_k, hidden).sum(dim=1)


def _sum_top_k_in_order(per_pair: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's `top_k` rows of `per_pair` `[T * top_k, H]` added one after the other in
    float32: the same order for any T (torch's reduction may split a short sum across threads
    differently as T changes)."""
    slots = per_pair.view(-1, top_k, per_pair.shape[-1])
    total = slots[:, 0].float()
    for j in range(1, top_k):
        total += slots[:, j]
    return total.to(per_pair.dtype)


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    config: MoeKernelConfig | None = None,
    batch_invariant: bool = False,
    norm: InputNorm | None = None,
) -> torch.Tensor:
    """The MoE feed-forward of `x` `[T, H]`: route by `router_logits` `[T, E]` (softmax top-k,
    renormalised when `renormalize`), then the experts: `experts_gemv` for up to
    `GEMV_MAX_TOKENS` tokens (unless a grouped-GEMM `config` is given), else `fused_experts`
    with `config` or the table entry for T tokens (`moe_routing.moe_config_for`). With `norm`
    (weight and eps of an RMSNorm, no residual) `x` is the norm's input: `experts_gemv`
    applies it as it loads x, the other paths run the norm kernel first.

    `batch_invariant`: a token's output does not depend on T: one routing (torch's), one tile
    configuration and the grouped GEMMs for every T (a row of a GEMM tile is reduced over K
    in the same order whatever the other rows), and the top-k sum in a fixed order."""
    num_tokens, num_experts = router_logits.shape
    gemv_path = not batch_invariant and config is None and num_tokens <= GEMV_MAX_TOKENS
    if gemv_path:
        return experts_gemv(x, gate_up, down, router_logits, top_k, renormalize,
                            MOE_GEMV_CONFIG, norm)  # fmt: skip
    if norm is not None:
        if norm.residual is not None:
            raise ValueError("fused_moe norms x itself: add the residual to x before")
        x = rms_norm(x, norm.weight, norm.eps)
    if batch_invariant:
        config = moe_config_for(INVARIANT_TILES_TOKENS, x.dtype)
        weights, ids = select_experts(router_logits, top_k, renormalize)
        pairs = align_block_size(ids, num_experts, config.block_m)
        per_pair = fused_experts(x, gate_up, down, weights, pairs, config, sum_top_k=False)
        return _sum_top_k_in_order(per_pair, top_k)
    config = config or moe_config_for(num_tokens, x.dtype)
    if num_tokens <= ROUTE_ALIGN_MAX_TOKENS:
        weights, _, pairs = route_and_align(router_logits, top_k, renormalize, config.block_m)
    else:
        weights, ids = select_experts(router_logits, top_k, renormalize)
        pairs = align_block_size(ids, num_experts, config.block_m)
    return fused_experts(x, gate_up, down, weights, pairs, config)
