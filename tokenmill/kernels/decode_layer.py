"""A Llama-family model's decoder layers in one launch, for 1 to MAX_TOKENS query tokens of one
sequence (a decode step, a speculative verify step).

At batch 1 every kernel of a small model's layer is latency-bound: Qwen3-0.6B spent ~25 us a
layer in seven kernels carrying ~7.4 us of weight bytes (`docs/perf-notes.md`), most of it at
the kernel boundaries (a grid's tail, the next grid's wait, its first loads). Here one grid of
`programs` programs (one per SM, all resident at once) runs every layer's stages, separated by
grid barriers instead of kernel boundaries, and each program loads the first two weight tiles
of its next stage before it waits at the barrier (weights do not depend on the activations),
so the weight stream does not stop at a stage's end:

1. q/k/v: residual add + RMSNorm (each program over the whole rows, program 0 storing the new
   residual) and the fused q/k/v product, `R_QKV` rows a program.
2. attention: a program per (KV head, split of the cached positions), its rows the step's
   (token, query head of the group) pairs: q/k norm and rotary, the step's keys and values
   stored by split 0, the split's keys attended (its first block loaded before the barrier:
   K/V of earlier steps), the step's own keys folded in, causally, by the last split from
   registers (so no program reads a key another program stores in this stage). The last
   split of each KV head to finish (an arrival ticket a KV head) merges its rows' splits by
   their log-sum-exp into the o product's input.
3. o: the o product.
4. gate/up: residual add + RMSNorm, `R_GU` (gate, up) row pairs a program, SiLU-and-mul of each
   pair stored.
5. down: the down product, the layer's output, which the next layer's stage 1 takes.

A mixture of experts' layer (every layer sparse, one token) replaces 4-5 by a router stage,
then the chosen experts' gate/up pairs (each program routing the token itself), then their
down rows, summed (MOE_STAGES). One token's products run on the CUDA cores, several tokens'
on the tensor cores (`BLOCK_M` = DOT_ROWS).

With L2 (a model whose largest stage fits a third of the L2 cache), as each program loads its
next stage's first tiles it also asks for the stage after next's rows to be pulled into L2
(one bulk prefetch a weight), so the weights stream from HBM while the programs meet at the
barriers, and the stages read them from L2.

Each layer's tensors come from a pointer table (`_COLUMNS`, one row a layer). The barrier
(`_grid_barrier`) counts arrivals with an atomic and releases the waiters by advancing a
generation word, resetting the count first, so it needs no reset between launches (one pair of
words serves every barrier and step). Data a program reads after a barrier was written by other
programs of the same launch: it is loaded past L1 (`.cg`), which is not coherent across SMs.
Under PDL the kernel waits for the previous kernel before it reads anything: once a step.

Triton's interpreter runs programs one after another, so a barrier there opens only for a grid
of one program: off a GPU each stage of each layer is a launch of its own (`STAGE`), the same
code without the barriers (the CPU tests; the GPU tests compare the one launch with those, bit
for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.attention import (
    _LOG2E,
    _attend_block,
    _fold_key,
    _kv_block,
    _split_result,
)
from tokenmill.kernels.launch import cdiv, direct_launch, next_power_of_2
from tokenmill.kernels.pdl import interpreted, pdl_options, pdl_wait
from tokenmill.kernels.rope_store import _rotate
from tokenmill.kernels.tickets import last_to_arrive, reset_ticket

NUM_STAGES = 5
# A split of the attention stage attends at least this many cached positions by default
# (fewer splits for short contexts: each split adds a partial result to write and merge).
SPLIT_KEYS = 128
# Keys of an attention block.
ATTN_BLOCK_N = 64
# Most splits of a KV head's positions (128 x 128 float32 partials to merge spilled registers).
MAX_SPLITS = 32
# Most query tokens of a step (a speculative verify step of up to 7 drafts), and the rows a
# tensor-core tile pads them to (one token runs on the CUDA cores).
MAX_TOKENS = 8
DOT_ROWS = 16
MAX_POLLS = tl.constexpr(1 << 24)
# The barrier buffer (int32): the arrival count, the generation word and a ticket a KV head,
# each on a 128-byte line of its own.
GENERATION = tl.constexpr(32)
TICKETS = tl.constexpr(64)
TICKET_STRIDE = tl.constexpr(32)
# A layer's row of the pointer table: q/k/v weight, its bias, o, gate/up, down, the input and
# post-attention norms, the q and k norms, the K and V caches, a mixture of experts' router
# (absent ones: the q/k/v weight).
_COLUMNS = ("qkv", "qkv_bias", "o", "gate_up", "down", "input_norm", "post_norm", "q_norm",
            "k_norm", "k_cache", "v_cache", "router")  # fmt: skip
NUM_COLUMNS = tl.constexpr(len(_COLUMNS))
(W_QKV, B_QKV, W_O, W_GATE_UP, W_DOWN, LN_INPUT, LN_POST, Q_NORM, K_NORM, K_CACHE, V_CACHE,
 W_ROUTER) = (tl.constexpr(column) for column in range(len(_COLUMNS)))  # fmt: skip
# Timer stamps a layer with TIMING: the start and end of each of its stages (a mixture of
# experts' layer has one more: MOE_STAGES).
MOE_STAGES = 6
STAMPS = tl.constexpr(2 * MOE_STAGES)
# Elements of a weight tile a program loads at once (two in flight).
TILE_ELEMENTS = 8192


@triton.jit
def _grid_barrier(count_ptr, gen_ptr, programs):
    """Wait until every one of `programs` programs has arrived; what each stored before is
    then visible to all (loaded with `.cg`). The last to arrive resets the count and advances
    the generation the others spin on. A wait of MAX_POLLS polls (seconds: a program that
    never arrives, as when not all of them are resident) traps, which fails the launch."""
    tl.debug_barrier()  # every thread's stores precede the arrival
    gen = tl.atomic_add(gen_ptr, 0, sem="relaxed", scope="gpu")
    if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == programs - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(gen_ptr, 1, sem="release", scope="gpu")
    else:
        seen = tl.atomic_add(gen_ptr, 0, sem="acquire", scope="gpu")
        polls = 0
        while (seen == gen) & (polls < MAX_POLLS):
            seen = tl.atomic_add(gen_ptr, 0, sem="acquire", scope="gpu")
            polls += 1
        if seen == gen:
            tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def _program_id(OPAQUE: tl.constexpr):
    """The program's index; with OPAQUE (compiled for a GPU) read so that the compiler cannot
    reuse it across the layer loop: each stage then recomputes its row offsets and masks
    instead of holding every stage's in registers through the loop (255 registers with
    spills -> 245 without, for Qwen3-0.6B's shapes)."""
    if OPAQUE:
        return tl.inline_asm_elementwise(
            "mov.u32 $0, %ctaid.x;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
    return tl.program_id(0)


@triton.jit
def _prefetch_rows(w_ptr, first, R: tl.constexpr, N, K: tl.constexpr, ON: tl.constexpr):
    """With ON, pull rows `first .. first + R` (those below N) of a row-major `[N, K]` weight
    into L2: one bulk prefetch (sm_90), from the program's first thread, which does not wait
    for it. Rows are contiguous, so a program's share of a stage is one range of bytes."""
    if ON:
        count = tl.minimum(R, tl.maximum(N - first, 0))
        nbytes = count * (K * w_ptr.dtype.element_ty.primitive_bitwidth // 8)
        start = (w_ptr + first.to(tl.int64) * K).to(tl.uint64, bitcast=True)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "setp.ne.and.u32 p, $2, 0, p; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [start, nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _stamp(timing_ptr, pid, layer, layers, index, TIMING: tl.constexpr):
    """With TIMING, the GPU's global timer (ns) into `timing[pid, layer, index]` (`STAMPS` a
    layer: each stage's start, after its barrier, and end, before the next one's)."""
    if TIMING:
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
        tl.store(timing_ptr + (pid * layers + layer) * STAMPS + index, now)


@triton.jit
def _rows(item, R: tl.constexpr, N, BLOCK_R: tl.constexpr):
    """Rows `item * R ..` (R of them, below N) of a stage's weight, and their mask."""
    offs = tl.arange(0, BLOCK_R)
    rows = item * R + offs
    return rows, (offs < R) & (rows < N)


@triton.jit
def _pair_rows(item, R: tl.constexpr, N, BLOCK_R: tl.constexpr):
    """Gate/up rows of pairs `item * R ..` (R of them, below N) of a `[2 N, K]` gate/up
    weight, interleaved (gate j, up j, ...), and their mask."""
    offs = tl.arange(0, 2 * BLOCK_R)
    pair = item * R + offs // 2
    return pair + (offs % 2) * N, (offs // 2 < R) & (pair < N)


@triton.jit
def _w_tile(w_ptr, rows, row_mask, k, K, BLOCK_K: tl.constexpr):
    """Columns `k .. k + BLOCK_K` (below K) of `rows` of a row-major `[N, K]` weight."""
    offs = k + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + rows[:, None].to(tl.int64) * K + offs[None, :]
    return tl.load(ptrs, mask=row_mask[:, None] & (offs < K)[None, :], other=0.0)


@triton.jit
def _slab(ptr, k, K, M, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, CG: tl.constexpr):
    """Columns `k .. k + BLOCK_K` (below K) of the M rows of a row-major `[M, K]` activation
    (past L1 with CG: another program's): a vector for BLOCK_M 1, else `[BLOCK_M, BLOCK_K]`
    (rows past M zero)."""
    offs = k + tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        ptrs = ptr + offs
        mask = offs < K
    else:
        offs_m = tl.arange(0, BLOCK_M)
        ptrs = ptr + offs_m[:, None] * K + offs[None, :]
        mask = (offs_m < M)[:, None] & (offs < K)[None, :]
    if CG:
        x = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def _accumulate(acc, w, x, BLOCK_M: tl.constexpr):
    """`acc += x @ w^T` for a weight tile `w` `[BR, BK]`: one row on the CUDA cores, several
    through the tensor cores (`x` rounded to W's dtype first; float32 without TF32)."""
    if BLOCK_M == 1:
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    elif w.dtype == tl.float32:
        acc += tl.dot(x.to(w.dtype), tl.trans(w), input_precision="ieee")
    else:
        acc += tl.dot(x.to(w.dtype), tl.trans(w))
    return acc


@triton.jit
def _store_rows(ptr, acc, rows, mask, N, M, BLOCK_M: tl.constexpr):
    """Store `acc` (`[BR]`, or `[BLOCK_M, BR]` for M rows) to columns `rows` of a row-major
    `[M, N]` output, in its dtype."""
    if BLOCK_M == 1:
        tl.store(ptr + rows, acc.to(ptr.dtype.element_ty), mask=mask)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        ptrs = ptr + offs_m[:, None] * N + rows[None, :]
        tl.store(ptrs, acc.to(ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & mask[None, :])


# The products below load W two tiles ahead and their input two slabs ahead, and use a
# loaded value only in the iteration that consumes it: a use right after its load would wait
# for it there (each iteration is shorter than a load's latency). They take M rows: one
# (`BLOCK_M` 1, a vector) or several (`BLOCK_M` 16, tiles of the tensor cores).


@triton.jit
def _normed_product(
    w_ptr, rows, row_mask, w_first, w_second, x_ptr, res_ptr, g_ptr, new_res_ptr, eps, K, M,
    HAS_RES: tl.constexpr, STORE_RES, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """`rmsnorm(x + residual) @ W[rows]^T` in float32 (each row's RMS scale applied to the
    finished sums, as `norm_gemv` does; the sum rounded to the activation dtype, as an eager
    add), `w_first` / `w_second` being W's first two tiles (loaded by the caller, before its
    wait); with STORE_RES the sum is stored to `new_res_ptr` as it is made."""
    if BLOCK_M == 1:
        acc = tl.zeros([w_first.shape[0]], dtype=tl.float32)
        sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, w_first.shape[0]], dtype=tl.float32)
        sumsq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    w_cur, w_next = w_first, w_second
    x_cur = _slab(x_ptr, 0, K, M, BLOCK_M, BLOCK_K, True)
    x_next = _slab(x_ptr, BLOCK_K, K, M, BLOCK_M, BLOCK_K, True)
    r_cur, r_next = x_cur, x_next
    if HAS_RES:
        r_cur = _slab(res_ptr, 0, K, M, BLOCK_M, BLOCK_K, True)
        r_next = _slab(res_ptr, BLOCK_K, K, M, BLOCK_M, BLOCK_K, True)
    g_cur = _slab(g_ptr, 0, K, 1, 1, BLOCK_K, False)
    g_next = _slab(g_ptr, BLOCK_K, K, 1, 1, BLOCK_K, False)
    for k in range(0, K, BLOCK_K):
        w_after = _w_tile(w_ptr, rows, row_mask, k + 2 * BLOCK_K, K, BLOCK_K)
        x_after = _slab(x_ptr, k + 2 * BLOCK_K, K, M, BLOCK_M, BLOCK_K, True)
        r_after = x_after
        if HAS_RES:
            r_after = _slab(res_ptr, k + 2 * BLOCK_K, K, M, BLOCK_M, BLOCK_K, True)
        g_after = _slab(g_ptr, k + 2 * BLOCK_K, K, 1, 1, BLOCK_K, False)
        x = x_cur
        if HAS_RES:
            x = (x.to(tl.float32) + r_cur.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if STORE_RES:
            _store_rows(new_res_ptr, x, k + tl.arange(0, BLOCK_K), k + tl.arange(0, BLOCK_K) < K,
                        K, M, BLOCK_M)  # fmt: skip
        xf = x.to(tl.float32)
        sumsq += xf * xf
        g = g_cur.to(tl.float32)
        if BLOCK_M > 1:
            g = g[None, :]
        acc = _accumulate(acc, w_cur, xf * g, BLOCK_M)
        w_cur, w_next = w_next, w_after
        x_cur, x_next = x_next, x_after
        r_cur, r_next = r_next, r_after
        g_cur, g_next = g_next, g_after
    if BLOCK_M == 1:
        acc = acc * tl.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
    else:
        acc = acc * tl.rsqrt(tl.sum(sumsq, axis=1) / K + eps)[:, None]
    return acc


@triton.jit
def _plain_product(
    w_ptr, rows, row_mask, w_first, w_second, x_ptr, K, M, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """`x @ W[rows]^T` in float32, `w_first` / `w_second` being W's first two tiles."""
    if BLOCK_M == 1:
        acc = tl.zeros([w_first.shape[0]], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, w_first.shape[0]], dtype=tl.float32)
    w_cur, w_next = w_first, w_second
    x_cur = _slab(x_ptr, 0, K, M, BLOCK_M, BLOCK_K, True)
    x_next = _slab(x_ptr, BLOCK_K, K, M, BLOCK_M, BLOCK_K, True)
    for k in range(0, K, BLOCK_K):
        w_after = _w_tile(w_ptr, rows, row_mask, k + 2 * BLOCK_K, K, BLOCK_K)
        x_after = _slab(x_ptr, k + 2 * BLOCK_K, K, M, BLOCK_M, BLOCK_K, True)
        acc = _accumulate(acc, w_cur, x_cur, BLOCK_M)
        w_cur, w_next = w_next, w_after
        x_cur, x_next = x_next, x_after
    return acc


@triton.jit
def _merge_group(
    kvh, splits, M, mid_o_ptr, mid_lse_ptr, attn_ptr, HQ: tl.constexpr, HKV: tl.constexpr,
    D: tl.constexpr, S_MAX: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """KV head `kvh`'s query heads, for each of the M query tokens: their `splits` partial
    outputs merged by log-sum-exp, stored in the activation dtype (as the unfused merge
    stores them)."""
    group: tl.constexpr = HQ // HKV
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    s_mask = offs_s < splits
    for t in range(0, M):
        for g in tl.static_range(group):
            head_row = t * HQ + kvh * group + g  # (token, head)
            row = head_row * S_MAX + offs_s
            lse = tl.load(mid_lse_ptr + row, mask=s_mask, other=float("-inf"),
                          cache_modifier=".cg")  # fmt: skip
            parts = tl.load(
                mid_o_ptr + row[:, None] * D + offs_d[None, :], mask=s_mask[:, None],
                other=0.0, cache_modifier=".cg",
            )  # fmt: skip
            m = tl.max(lse, axis=0)
            w = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
            total = tl.sum(w, axis=0)
            out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
            tl.store(attn_ptr + head_row * D + offs_d, out.to(attn_ptr.dtype.element_ty))


@triton.jit
def _split_bounds(kv_lens_ptr, split, M, S_MAX: tl.constexpr, SPLIT_KEYS: tl.constexpr,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """(context length, splits, first and past-last cached position of split `split`): the
    positions cached by earlier steps (all but the step's M query tokens) cut into splits of
    at least SPLIT_KEYS (at most S_MAX splits), each a whole number of key blocks."""
    kv_len = tl.load(kv_lens_ptr)
    n = tl.maximum(kv_len - M, 0)
    splits = tl.minimum(S_MAX, tl.maximum(tl.cdiv(n, SPLIT_KEYS), 1))
    split_len = tl.cdiv(tl.cdiv(n, splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    return kv_len, splits, lo, tl.minimum(lo + split_len, n)


@triton.jit
def _step_rows(
    ptr, tokens, M, positions_ptr, cos_ptr, sin_ptr, norm_ptr, eps, HEAD, NQKV: tl.constexpr,
    D: tl.constexpr, QK_NORM: tl.constexpr,
):  # fmt: skip
    """Rows of the q/k/v buffer `[M, NQKV]`: token `tokens[r]`'s head `HEAD[r]` (rows past M
    zero), normed (QK_NORM) and rotated at the token's position, in float32."""
    half: tl.constexpr = D // 2
    offs_d = tl.arange(0, D)
    rot_d = (offs_d + half) % D
    mask = (tokens < M)[:, None]
    pos = tl.load(positions_ptr + tokens, mask=tokens < M, other=0)
    cos = tl.load(cos_ptr + pos[:, None] * D + offs_d[None, :])
    sin = tl.load(sin_ptr + pos[:, None] * D + offs_d[None, :])
    rows = ptr + tokens[:, None] * NQKV + HEAD[:, None] * D
    x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    x_rot = tl.load(rows + rot_d[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    return _rotate(x, x_rot, offs_d, rot_d, half, D, cos, sin, norm_ptr, eps, QK_NORM)


@triton.jit
def _attention_split(
    item, kb, vb, qkv_ptr, positions_ptr, slots_ptr, kv_lens_ptr, page_table_ptr, cos_ptr,
    sin_ptr, q_norm_ptr, k_norm_ptr, eps, k_cache_ptr, v_cache_ptr, mid_o_ptr, mid_lse_ptr,
    attn_ptr, ticket_ptr, qk_scale, M, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, S_MAX: tl.constexpr, SPLIT_KEYS: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_NORM: tl.constexpr,
):  # fmt: skip
    """Item `item` = (KV head, split) of the attention stage (see the module's docstring),
    `kb` / `vb` being its first key block (`_first_kv_block`, loaded before the barrier);
    splits past those the context needs do nothing. Its rows are (query token, head of the
    KV head's group) pairs, token major (BLOCK_R of them); the M query tokens' own keys
    (BLOCK_T rows) are held in registers and folded in, causally, by the last split. The
    rows' output goes to `attn_ptr` `[M, Hq D]`: from the only split, or merged by the last
    split of the KV head to finish (an arrival ticket a KV head, `ticket_ptr`)."""
    kvh = item // S_MAX
    split = item % S_MAX
    kv_len, splits, lo, hi = _split_bounds(kv_lens_ptr, split, M, S_MAX, SPLIT_KEYS, BLOCK_N)
    if split < splits:
        group: tl.constexpr = HQ // HKV
        NQKV: tl.constexpr = (HQ + 2 * HKV) * D
        offs_d = tl.arange(0, D)
        # the second key block goes out before the q/k/v loads (the first came before the
        # barrier), each later one as the block two before it is summed
        offs_n = lo + BLOCK_N + tl.arange(0, BLOCK_N)
        kb_next = _kv_block(
            k_cache_ptr, page_table_ptr, offs_n, offs_n < hi, kvh, offs_d, PAGE, HKV, D
        )
        vb_next = _kv_block(
            v_cache_ptr, page_table_ptr, offs_n, offs_n < hi, kvh, offs_d, PAGE, HKV, D
        )
        r = tl.arange(0, BLOCK_R)
        t_r = r // group  # each row's query token
        heads = kvh * group + r % group
        r_mask = t_r < M
        t_k = tl.arange(0, BLOCK_T)  # the step's tokens, as keys
        k_mask = t_k < M
        q = _step_rows(qkv_ptr, t_r, M, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, eps, heads,
                       NQKV, D, QK_NORM)  # fmt: skip
        kv_head = tl.full([BLOCK_T], HQ, tl.int32) + kvh
        k = _step_rows(qkv_ptr, t_k, M, positions_ptr, cos_ptr, sin_ptr, k_norm_ptr, eps,
                       kv_head, NQKV, D, QK_NORM)  # fmt: skip
        v_rows = qkv_ptr + t_k[:, None] * NQKV + (HQ + HKV + kvh) * D + offs_d[None, :]
        v = tl.load(v_rows, mask=k_mask[:, None], other=0.0, cache_modifier=".cg")
        q = q.to(k_cache_ptr.dtype.element_ty)
        k = k.to(k_cache_ptr.dtype.element_ty)
        v = v.to(v_cache_ptr.dtype.element_ty)
        if split == 0:
            slot = tl.load(slots_ptr + t_k, mask=k_mask, other=-1)
            at = slot[:, None].to(tl.int64) * (HKV * D) + kvh * D + offs_d[None, :]
            tl.store(k_cache_ptr + at, k, mask=(slot >= 0)[:, None])
            tl.store(v_cache_ptr + at, v, mask=(slot >= 0)[:, None])
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            valid = start + tl.arange(0, BLOCK_N) < hi
            m_i, l_i, acc = _attend_block(q, kb, vb, valid[None, :], m_i, l_i, acc, qk_scale)
            offs_n = start + 2 * BLOCK_N + tl.arange(0, BLOCK_N)
            valid = offs_n < hi
            kb = kb_next
            vb = vb_next
            kb_next = _kv_block(
                k_cache_ptr, page_table_ptr, offs_n, valid, kvh, offs_d, PAGE, HKV, D
            )
            vb_next = _kv_block(
                v_cache_ptr, page_table_ptr, offs_n, valid, kvh, offs_d, PAGE, HKV, D
            )
        # the step's tokens, as keys of the last split (from registers), each seen by the
        # rows of its own and later tokens
        fold = (split == splits - 1) & (kv_len > 0)
        if BLOCK_T == 1:
            m_i, l_i, acc = _fold_key(q, k, v, fold, m_i, l_i, acc, qk_scale)
        else:
            keep = fold & (t_k[None, :] <= t_r[:, None]) & k_mask[None, :]
            m_i, l_i, acc = _attend_block(q, k, v, keep, m_i, l_i, acc, qk_scale)
        lse, out = _split_result(m_i, l_i, acc)
        head_rows = t_r * HQ + heads  # (token, head)
        if splits == 1:  # the output itself (what merging one split would store, bitwise)
            at = attn_ptr + head_rows[:, None] * D + offs_d[None, :]
            tl.store(at, out.to(attn_ptr.dtype.element_ty), mask=r_mask[:, None])
        else:  # the last split of the KV head to finish merges its query heads' splits
            row = head_rows * S_MAX + split
            tl.store(mid_o_ptr + row[:, None] * D + offs_d[None, :], out, mask=r_mask[:, None])
            tl.store(mid_lse_ptr + row, lse, mask=r_mask)
            if last_to_arrive(ticket_ptr, kvh * TICKET_STRIDE, splits):
                _merge_group(kvh, splits, M, mid_o_ptr, mid_lse_ptr, attn_ptr, HQ, HKV, D,
                             S_MAX, BLOCK_S)  # fmt: skip
                reset_ticket(ticket_ptr, kvh * TICKET_STRIDE)


@triton.jit
def _first_kv_block(
    item, kv_lens_ptr, page_table_ptr, k_cache_ptr, v_cache_ptr, M, HKV: tl.constexpr,
    D: tl.constexpr, PAGE: tl.constexpr, S_MAX: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The first key and value block of attention item `item`: positions cached by earlier
    steps, read before the barrier that ends the q/k/v stage."""
    kvh = item // S_MAX
    _, _, lo, hi = _split_bounds(kv_lens_ptr, item % S_MAX, M, S_MAX, SPLIT_KEYS, BLOCK_N)
    offs_n = lo + tl.arange(0, BLOCK_N)
    valid = (offs_n < hi) & (kvh < HKV)
    offs_d = tl.arange(0, D)
    kb = _kv_block(k_cache_ptr, page_table_ptr, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
    vb = _kv_block(v_cache_ptr, page_table_ptr, offs_n, valid, kvh, offs_d, PAGE, HKV, D)
    return kb, vb


@triton.jit
def _route(logits_ptr, E: tl.constexpr, TOPK: tl.constexpr, RENORM: tl.constexpr,
           BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The token's experts (`[BLOCK_K]` ids, the first TOPK valid) and their weights: the
    softmax of the router's logits (float32), its TOPK largest in order (ties to the lower
    id), renormalised to sum 1 with RENORM (`norm_topk_prob`)."""
    offs = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + offs, mask=offs < E, other=float("-inf"), cache_modifier=".cg")
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.argmax(p, axis=0)
        ids = tl.where(slots == j, best, ids)
        weights = tl.where(slots == j, tl.max(p, axis=0), weights)
        p = tl.where(offs == best, -1.0, p)
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    return ids, weights


@triton.jit
def _pick(values, slots, j):
    """`values[j]` for each index of `j` (a gather from a small vector indexed by `slots`)."""
    return tl.sum(tl.where(slots[None, :] == j[:, None], values[None, :], 0), axis=1)


@triton.jit
def _expert_pair_rows(item, ids, slots, R: tl.constexpr, FF: tl.constexpr,
                      TOPK: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """Rows of the stacked experts' gate/up weight `[E * 2 FF, H]` for pairs `item * R ..`
    (R of them) of the chosen experts' `TOPK * FF` (gate, up) pairs, interleaved (gate j,
    up j, ...); their mask, and each pair's index (its slot's activation)."""
    offs = tl.arange(0, 2 * BLOCK_R)
    pair = item * R + offs // 2
    expert = _pick(ids, slots, pair // FF)
    rows = expert * (2 * FF) + (offs % 2) * FF + pair % FF
    return rows, (offs // 2 < R) & (pair < TOPK * FF)


@triton.jit
def _expert_down_tile(w_ptr, ids, slots, rows, row_mask, k, H: tl.constexpr, FF: tl.constexpr,
                      TOPK: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Columns `k .. k + BLOCK_K` of the down product's `[H, TOPK * FF]` input side: slot
    `k // FF`'s expert's rows of the stacked `[E, H, FF]` down weight (BLOCK_K divides FF)."""
    slot = k // FF
    expert = tl.sum(tl.where(slots == slot, ids, 0), axis=0)
    offs = k % FF + tl.arange(0, BLOCK_K)
    base = w_ptr + (expert.to(tl.int64) * H + rows[:, None].to(tl.int64)) * FF
    mask = row_mask[:, None] & (slot < TOPK)
    return tl.load(base + offs[None, :], mask=mask, other=0.0)


@triton.jit
def _expert_down_product(w_ptr, ids, slots, rows, row_mask, act_ptr, H: tl.constexpr,
                         FF: tl.constexpr, TOPK: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """`act @ down^T` over the chosen experts: the weighted activations `[TOPK * FF]` against
    each slot's expert's down rows (two tiles ahead, as the other products)."""
    K: tl.constexpr = TOPK * FF
    acc = tl.zeros([rows.shape[0]], dtype=tl.float32)
    w_cur = _expert_down_tile(w_ptr, ids, slots, rows, row_mask, 0, H, FF, TOPK, BLOCK_K)
    w_next = _expert_down_tile(w_ptr, ids, slots, rows, row_mask, BLOCK_K, H, FF, TOPK, BLOCK_K)
    x_cur = _slab(act_ptr, 0, K, 1, 1, BLOCK_K, True)
    x_next = _slab(act_ptr, BLOCK_K, K, 1, 1, BLOCK_K, True)
    for k in range(0, K, BLOCK_K):
        w_after = _expert_down_tile(
            w_ptr, ids, slots, rows, row_mask, k + 2 * BLOCK_K, H, FF, TOPK, BLOCK_K
        )
        x_after = _slab(act_ptr, k + 2 * BLOCK_K, K, 1, 1, BLOCK_K, True)
        acc = _accumulate(acc, w_cur, x_cur, 1)
        w_cur, w_next = w_next, w_after
        x_cur, x_next = x_next, x_after
    return acc


@triton.jit
def _ptr(table_ptr, layer, column, like):
    """Layer `layer`'s pointer `column` (`_COLUMNS`) of the pointer table, typed as `like`."""
    ptr = tl.load(table_ptr + layer * NUM_COLUMNS + column).to(like.dtype, bitcast=True)
    return tl.multiple_of(ptr, 16)  # (tensors start 16-byte aligned: vector loads)


@triton.jit
def _first_tiles(w_ptr, rows, mask, K: tl.constexpr, BK: tl.constexpr):
    """A stage's first two weight tiles of `rows` (loaded before its barrier)."""
    return _w_tile(w_ptr, rows, mask, 0, K, BK), _w_tile(w_ptr, rows, mask, BK, K, BK)


@triton.jit
def _qkv_stage(
    w0, w1, table_ptr, layer, pid, x_ptr, res_ptr, mid_res_ptr, qkv_ptr, eps, M,
    H: tl.constexpr, NQKV: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_RES: tl.constexpr, QKV_BIAS: tl.constexpr,
):  # fmt: skip
    """Stage 1: `x + residual` (program 0 stores it), RMSNorm, the q/k/v product's rows."""
    rows, mask = _rows(pid, R, NQKV, BR)
    acc = _normed_product(
        _ptr(table_ptr, layer, W_QKV, x_ptr), rows, mask, w0, w1, x_ptr, res_ptr,
        _ptr(table_ptr, layer, LN_INPUT, x_ptr), mid_res_ptr, eps, H, M, HAS_RES, pid == 0, BLOCK_M,
        BK,
    )  # fmt: skip
    if QKV_BIAS:
        bias = tl.load(_ptr(table_ptr, layer, B_QKV, x_ptr) + rows, mask=mask, other=0.0)
        if BLOCK_M == 1:
            acc += bias.to(tl.float32)
        else:
            acc += bias.to(tl.float32)[None, :]
    _store_rows(qkv_ptr, acc, rows, mask, NQKV, M, BLOCK_M)


# `programs`, `layers` and `M` (the step's query tokens) are plain arguments: Triton would
# compile a kernel of its own for a value of 1 or a multiple of 16 (a launch a layer would not
# run the whole model's code).
@direct_launch
@triton.jit(do_not_specialize=["programs", "layers", "M"])
def _decode_layers_kernel(
    x_ptr, res_ptr, out_ptr, new_res_ptr, mid_res_ptr, qkv_ptr, mid_o_ptr, mid_lse_ptr,
    attn_ptr, o_ptr, act_ptr, router_ptr, barrier_ptr, table_ptr, cos_ptr, sin_ptr, positions_ptr,
    slots_ptr, kv_lens_ptr, page_table_ptr, timing_ptr, eps, qk_scale, programs, layers, M,
    H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, FF: tl.constexpr,
    PAGE: tl.constexpr, S_MAX: tl.constexpr, SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr,
    R_QKV: tl.constexpr, BR_QKV: tl.constexpr, BK_QKV: tl.constexpr,
    R_O: tl.constexpr, BR_O: tl.constexpr, BK_O: tl.constexpr,
    R_GU: tl.constexpr, BR_GU: tl.constexpr, BK_GU: tl.constexpr,
    R_DN: tl.constexpr, BR_DN: tl.constexpr, BK_DN: tl.constexpr,
    MOE: tl.constexpr, E: tl.constexpr, TOPK: tl.constexpr, RENORM: tl.constexpr,
    R_RT: tl.constexpr, BR_RT: tl.constexpr, BK_RT: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr, HAS_RES: tl.constexpr, QKV_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
    STAGE: tl.constexpr, OPAQUE: tl.constexpr, L2: tl.constexpr, TIMING: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # `layers` decoder layers from the table's first row: the first takes (x, residual, or x
    # alone without HAS_RES), each later one the previous one's (out, new residual). With
    # STAGE >= 0 (one layer) only that stage runs.
    ALL: tl.constexpr = STAGE < 0
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    act_dtype = x_ptr.dtype.element_ty
    count_ptr = barrier_ptr
    gen_ptr = barrier_ptr + GENERATION

    # Under PDL nothing is read before the wait: a launch of all the layers waits once a step.
    pdl_wait(USE_PDL)
    for layer in range(0, layers):
        pid = _program_id(OPAQUE)
        # 1. residual add + RMSNorm + q/k/v product: the first layer's on (x, residual), the
        # others' on the previous layer's output and residual
        if ALL or STAGE == 0:
            rows, mask = _rows(pid, R_QKV, NQKV, BR_QKV)
            qkv0, qkv1 = _first_tiles(_ptr(table_ptr, layer, W_QKV, x_ptr), rows, mask, H, BK_QKV)
            _prefetch_rows(_ptr(table_ptr, layer, W_O, x_ptr), pid * R_O, R_O, H, HQ * D, L2)
            if layer == 0:
                _stamp(timing_ptr, pid, layer, layers, 0, TIMING)
                _qkv_stage(
                    qkv0, qkv1, table_ptr, layer, pid, x_ptr, res_ptr if HAS_RES else x_ptr,
                    mid_res_ptr, qkv_ptr, eps, M, H, NQKV, R_QKV, BR_QKV, BK_QKV, BLOCK_M,
                    HAS_RES, QKV_BIAS,
                )  # fmt: skip
            else:
                _grid_barrier(count_ptr, gen_ptr, programs)
                _stamp(timing_ptr, pid, layer, layers, 0, TIMING)
                _qkv_stage(
                    qkv0, qkv1, table_ptr, layer, pid, out_ptr, new_res_ptr, mid_res_ptr,
                    qkv_ptr, eps, M, H, NQKV, R_QKV, BR_QKV, BK_QKV, BLOCK_M, True, QKV_BIAS,
                )  # fmt: skip
            _stamp(timing_ptr, pid, layer, layers, 1, TIMING)
        k_cache_ptr = _ptr(table_ptr, layer, K_CACHE, x_ptr)
        v_cache_ptr = _ptr(table_ptr, layer, V_CACHE, x_ptr)
        pid = _program_id(OPAQUE)
        # 2. attention, a program per (KV head, split) (programs >= HKV * S_MAX)
        if ALL or STAGE == 1:
            kb, vb = _first_kv_block(
                pid, kv_lens_ptr, page_table_ptr, k_cache_ptr, v_cache_ptr, M, HKV, D, PAGE,
                S_MAX, SPLIT_KEYS, BLOCK_N,
            )  # fmt: skip
            w_gu = _ptr(table_ptr, layer, W_GATE_UP, x_ptr)
            _prefetch_rows(w_gu, pid * R_GU, R_GU, FF, H, L2)
            _prefetch_rows(w_gu + FF * H, pid * R_GU, R_GU, FF, H, L2)
        if ALL:
            _grid_barrier(count_ptr, gen_ptr, programs)
        _stamp(timing_ptr, pid, layer, layers, 2, TIMING)
        if ALL or STAGE == 1:  # noqa: SIM102 (a constexpr test, then a runtime one)
            if pid < HKV * S_MAX:
                _attention_split(
                    pid, kb, vb, qkv_ptr, positions_ptr, slots_ptr, kv_lens_ptr,
                    page_table_ptr, cos_ptr, sin_ptr, _ptr(table_ptr, layer, Q_NORM, x_ptr),
                    _ptr(table_ptr, layer, K_NORM, x_ptr), eps, k_cache_ptr, v_cache_ptr, mid_o_ptr,
                    mid_lse_ptr, attn_ptr, barrier_ptr + TICKETS, qk_scale, M, HQ, HKV, D,
                    PAGE, S_MAX, SPLIT_KEYS, BLOCK_R, BLOCK_T, BLOCK_S, BLOCK_N, QK_NORM,
                )  # fmt: skip
        _stamp(timing_ptr, pid, layer, layers, 3, TIMING)

        pid = _program_id(OPAQUE)
        # 3. o product
        if ALL or STAGE == 2:
            rows, mask = _rows(pid, R_O, H, BR_O)
            o0, o1 = _first_tiles(_ptr(table_ptr, layer, W_O, x_ptr), rows, mask, HQ * D, BK_O)
            _prefetch_rows(_ptr(table_ptr, layer, W_DOWN, x_ptr), pid * R_DN, R_DN, H, FF, L2)
        if ALL:
            _grid_barrier(count_ptr, gen_ptr, programs)
        _stamp(timing_ptr, pid, layer, layers, 4, TIMING)
        if ALL or STAGE == 2:
            rows, mask = _rows(pid, R_O, H, BR_O)
            acc = _plain_product(
                _ptr(table_ptr, layer, W_O, x_ptr), rows, mask, o0, o1, attn_ptr, HQ * D, M,
                BLOCK_M, BK_O,
            )  # fmt: skip
            _store_rows(o_ptr, acc, rows, mask, H, M, BLOCK_M)
        _stamp(timing_ptr, pid, layer, layers, 5, TIMING)

        if not MOE:
            pid = _program_id(OPAQUE)
            # 4. residual add + RMSNorm + gate/up product (rows interleaved), SiLU-and-mul
            if ALL or STAGE == 3:
                rows, mask = _pair_rows(pid, R_GU, FF, BR_GU)
                gu0, gu1 = _first_tiles(
                    _ptr(table_ptr, layer, W_GATE_UP, x_ptr), rows, mask, H, BK_GU
                )
                if layer + 1 < layers:
                    w_qkv = _ptr(table_ptr, layer + 1, W_QKV, x_ptr)
                    _prefetch_rows(w_qkv, pid * R_QKV, R_QKV, NQKV, H, L2)
            if ALL:
                _grid_barrier(count_ptr, gen_ptr, programs)
            _stamp(timing_ptr, pid, layer, layers, 6, TIMING)
            if ALL or STAGE == 3:
                rows, mask = _pair_rows(pid, R_GU, FF, BR_GU)
                acc = _normed_product(
                    _ptr(table_ptr, layer, W_GATE_UP, x_ptr), rows, mask, gu0, gu1, o_ptr,
                    mid_res_ptr, _ptr(table_ptr, layer, LN_POST, x_ptr), new_res_ptr, eps, H, M,
                    True, pid == 0, BLOCK_M, BK_GU,
                )  # fmt: skip
                # each rounded to the activation dtype, as the unfused product stores them
                acc = acc.to(act_dtype).to(tl.float32)
                if BLOCK_M == 1:
                    gate, up = tl.split(tl.reshape(acc, [BR_GU, 2]))
                else:
                    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BR_GU, 2]))
                rows, mask = _rows(pid, R_GU, FF, BR_GU)
                _store_rows(act_ptr, gate * tl.sigmoid(gate) * up, rows, mask, FF, M, BLOCK_M)
            _stamp(timing_ptr, pid, layer, layers, 7, TIMING)

            pid = _program_id(OPAQUE)
            # 5. down product
            if ALL or STAGE == 4:
                rows, mask = _rows(pid, R_DN, H, BR_DN)
                dn0, dn1 = _first_tiles(
                    _ptr(table_ptr, layer, W_DOWN, x_ptr), rows, mask, FF, BK_DN
                )
            if ALL:
                _grid_barrier(count_ptr, gen_ptr, programs)
            _stamp(timing_ptr, pid, layer, layers, 8, TIMING)
            if ALL or STAGE == 4:
                rows, mask = _rows(pid, R_DN, H, BR_DN)
                acc = _plain_product(
                    _ptr(table_ptr, layer, W_DOWN, x_ptr), rows, mask, dn0, dn1, act_ptr, FF, M,
                    BLOCK_M, BK_DN,
                )  # fmt: skip
                _store_rows(out_ptr, acc, rows, mask, H, M, BLOCK_M)
            _stamp(timing_ptr, pid, layer, layers, 9, TIMING)
        else:
            pid = _program_id(OPAQUE)
            # 4. residual add + RMSNorm + router (a mixture of experts' feed-forward)
            if ALL or STAGE == 3:
                rows, mask = _rows(pid, R_RT, E, BR_RT)
                rt0, rt1 = _first_tiles(
                    _ptr(table_ptr, layer, W_ROUTER, x_ptr), rows, mask, H, BK_RT
                )
            if ALL:
                _grid_barrier(count_ptr, gen_ptr, programs)
            _stamp(timing_ptr, pid, layer, layers, 6, TIMING)
            if ALL or STAGE == 3:
                rows, mask = _rows(pid, R_RT, E, BR_RT)
                acc = _normed_product(
                    _ptr(table_ptr, layer, W_ROUTER, x_ptr), rows, mask, rt0, rt1, o_ptr,
                    mid_res_ptr, _ptr(table_ptr, layer, LN_POST, x_ptr), new_res_ptr, eps, H, M,
                    True, pid == 0, 1, BK_RT,
                )  # fmt: skip
                # rounded to the activation dtype, as the router's output
                tl.store(router_ptr + rows, acc.to(act_dtype).to(tl.float32), mask=mask)
            _stamp(timing_ptr, pid, layer, layers, 7, TIMING)

            pid = _program_id(OPAQUE)
            # 5. routing (every program), the chosen experts' gate/up rows, SiLU-and-mul
            # scaled by the expert's weight
            if ALL:
                _grid_barrier(count_ptr, gen_ptr, programs)
            _stamp(timing_ptr, pid, layer, layers, 8, TIMING)
            if ALL or STAGE == 4:
                ids, weights = _route(router_ptr, E, TOPK, RENORM, BLOCK_E, BLOCK_K)
                slots = tl.arange(0, BLOCK_K)
                w_gu = _ptr(table_ptr, layer, W_GATE_UP, x_ptr)
                rows, mask = _expert_pair_rows(pid, ids, slots, R_GU, FF, TOPK, BR_GU)
                gu0, gu1 = _first_tiles(w_gu, rows, mask, H, BK_GU)
                acc = _normed_product(
                    w_gu, rows, mask, gu0, gu1, new_res_ptr, new_res_ptr,
                    _ptr(table_ptr, layer, LN_POST, x_ptr), new_res_ptr, eps, H, M, False, False, 1,
                    BK_GU,
                )  # fmt: skip
                gate, up = tl.split(tl.reshape(acc.to(act_dtype).to(tl.float32), [BR_GU, 2]))
                pairs, mask = _rows(pid, R_GU, TOPK * FF, BR_GU)
                act = gate * tl.sigmoid(gate) * up * _pick(weights, slots, pairs // FF)
                tl.store(act_ptr + pairs, act.to(act_dtype), mask=mask)
            _stamp(timing_ptr, pid, layer, layers, 9, TIMING)

            pid = _program_id(OPAQUE)
            # 6. the chosen experts' down rows, summed
            if ALL:
                _grid_barrier(count_ptr, gen_ptr, programs)
            _stamp(timing_ptr, pid, layer, layers, 10, TIMING)
            if ALL or STAGE == 5:
                ids, weights = _route(router_ptr, E, TOPK, RENORM, BLOCK_E, BLOCK_K)
                rows, mask = _rows(pid, R_DN, H, BR_DN)
                acc = _expert_down_product(
                    _ptr(table_ptr, layer, W_DOWN, x_ptr), ids, tl.arange(0, BLOCK_K), rows, mask,
                    act_ptr, H, FF, TOPK, BK_DN,
                )  # fmt: skip
                tl.store(out_ptr + rows, acc.to(act_dtype), mask=mask)
            _stamp(timing_ptr, pid, layer, layers, 11, TIMING)


@dataclass(frozen=True)
class DecodeLayerWeights:
    """One decoder layer's tensors, as the model holds them (row-major, contiguous, all of one
    dtype): the fused q/k/v weight `[(Hq + 2 Hkv) D, H]` (and its bias, or None), o `[H, Hq
    D]`, gate/up `[2 I, H]` (gate rows first), down `[H, I]`, the two RMSNorm weights, the q/k
    norms (or None) and the layer's K and V caches `[slots, Hkv, D]`. A mixture of experts'
    layer has its router `[E, H]` and its experts stacked: gate/up `[E, 2 I, H]`, down `[E,
    H, I]`."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    router: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeStep:
    """The sequence's inputs of a step of M query tokens: their positions and the slots their
    K/V go to (< 0: none), `[M]` each, its context length (the step's tokens included) and its
    page-table row, and the rotary tables `[max_positions, D]` (float32)."""

    positions: torch.Tensor
    slots: torch.Tensor
    kv_lens: torch.Tensor
    page_table: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass(frozen=True)
class LayerDims:
    """A decoder layer's sizes; with `experts`, a mixture of experts' feed-forward (every
    layer's): `top_k` experts a token, each of `intermediate` rows, their weights renormalised
    to sum 1 with `renormalize` (`norm_topk_prob`)."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    page_size: int
    experts: int = 0
    top_k: int = 0
    renormalize: bool = False


def _tile_k(block_rows: int, k: int) -> int:
    """The K width of a stage's weight tile: about TILE_ELEMENTS elements, at most K."""
    return max(16, min(next_power_of_2(k), next_power_of_2(max(1, TILE_ELEMENTS // block_rows))))


_layers_per_launch: int | None = None
_l2_prefetch: bool | None = None


def set_layers_per_launch(layers: int | None) -> None:
    """Launch the fused layers `layers` at a time from now on (None: all of a model's in one
    launch, the default; for A/B measurements of the launch boundaries)."""
    global _layers_per_launch
    _layers_per_launch = layers


def set_l2_prefetch(enabled: bool | None) -> None:
    """Turn the L2 prefetch of the stage after next on (where the GPU and shapes allow it,
    whatever their size) or off for kernels made from now on (None: `l2_prefetch_fits`'
    rule; for A/B measurements)."""
    global _l2_prefetch
    _l2_prefetch = enabled


def l2_prefetch_fits(
    dims: LayerDims, itemsize: int, device: torch.device, sized: bool = True
) -> bool:
    """Whether the fused layers pull the stage after next into L2 on `device`: a GPU with
    bulk prefetches (compute capability 9.0+), rows of whole 16-byte units, and (`sized`) the
    largest stage's weights within a third of its L2 (else they would evict each other before
    use: Llama-3.1-8B's gate/up is 235 MB)."""
    if device.type != "cuda" or interpreted() or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    d = dims
    widths = (d.hidden, d.num_heads * d.head_dim, d.intermediate)
    if any(k * itemsize % 16 for k in widths):
        return False
    if not sized:
        return True
    nqkv = (d.num_heads + 2 * d.num_kv_heads) * d.head_dim
    largest = max(nqkv, d.num_heads * d.head_dim, 2 * d.intermediate) * d.hidden
    return largest * itemsize * 3 <= torch.cuda.get_device_properties(device).L2_cache_size


class DecodeLayerKernel:
    """Runs the decoder layers `layers` (of sizes `dims`) for the query tokens of one
    sequence (1, a decode step, up to MAX_TOKENS, a speculative verify step) on `programs`
    programs: on a GPU every layer in one launch (its SM count of programs, all resident at
    once; at least one a KV head), off it one launch a stage and layer. Holds the scratch, the
    layers' pointer table and the barrier's words, so one instance serves one stream.
    `split_keys`: the fewest cached positions an attention split takes."""

    def __init__(
        self, dims: LayerDims, layers: list[DecodeLayerWeights], programs: int,
        num_warps: int = 8, split_keys: int = SPLIT_KEYS,
    ) -> None:  # fmt: skip
        d = dims
        if d.num_heads % d.num_kv_heads or d.head_dim != next_power_of_2(d.head_dim):
            raise ValueError("the decode layer kernel needs grouped heads of a power-of-2 size")
        if programs < d.num_kv_heads:
            raise ValueError(f"{programs} programs cannot attend {d.num_kv_heads} KV heads")
        first = layers[0].qkv
        dtype, device = first.dtype, first.device
        self.table = torch.tensor(
            [[_address(getattr(w, c), first, dtype) for c in _COLUMNS] for w in layers],
            dtype=torch.int64, device=device,
        )  # fmt: skip
        self._layers = layers  # (the table holds their addresses, not references)
        self.l2_prefetch = _l2_prefetch is not False and l2_prefetch_fits(
            dims, first.element_size(), device, sized=_l2_prefetch is None
        )
        self.num_layers = len(layers)
        self.qkv_bias = layers[0].qkv_bias is not None
        self.qk_norm = layers[0].q_norm is not None
        self.dims, self.programs, self.num_warps = dims, programs, num_warps
        self.split_keys = split_keys
        # (KV head, split) attention items: at most one a program, at most MAX_SPLITS a head
        # (the merge holds a head's splits in registers)
        self.s_max = min(MAX_SPLITS, programs // d.num_kv_heads)
        nqkv = (d.num_heads + 2 * d.num_kv_heads) * d.head_dim

        def empty(n: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.empty(MAX_TOKENS * n, dtype=dt, device=device)

        self.hidden, self.residual, self.mid_res = empty(d.hidden), empty(d.hidden), empty(d.hidden)
        self.qkv, self.o = empty(nqkv), empty(d.hidden)
        self.act = empty(d.intermediate * max(1, d.top_k))
        self.router = torch.empty(max(1, d.experts), dtype=torch.float32, device=device)
        self.attn = empty(d.num_heads * d.head_dim)
        self.mid_o = empty(d.num_heads * self.s_max * d.head_dim, torch.float32)
        self.mid_lse = empty(d.num_heads * self.s_max, torch.float32)
        self.barrier = torch.zeros(
            TICKETS + d.num_kv_heads * TICKET_STRIDE, dtype=torch.int32, device=device
        )
        self.tiles = {rows: _tiles(d, programs, rows) for rows in (1, DOT_ROWS)}

    def run(
        self, x: torch.Tensor, step: DecodeStep, staged: bool | None = None,
        timing: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """`(output, residual)` `[M, H]` after every layer (as `LlamaDecoderLayer`s return
        them) for the embedded query tokens `x` `[M, H]` (M <= MAX_TOKENS), the first layer's
        residual being `x` itself; both are views of this instance's buffers. `staged`
        (default: off a GPU, where a barrier of more than one program cannot open): each stage
        of each layer a launch of its own. `timing` (int64 `[programs, layers, STAMPS]`, one
        launch of every layer on a GPU): each program's global-timer stamps (ns) at the start
        and end of each stage (`benchmarks/fused_decode_timeline.py`)."""
        m = x.shape[0]
        if not 1 <= m <= MAX_TOKENS:
            raise ValueError(f"the decode layer kernel takes 1 to {MAX_TOKENS} tokens, got {m}")
        residual: torch.Tensor | None = None
        if staged is None:
            staged = x.device.type != "cuda"
        if staged:
            for layer in range(self.num_layers):
                for stage in range(MOE_STAGES if self.dims.experts else NUM_STAGES):
                    self._launch(x, residual, m, step, layer, 1, stage, None)
                x, residual = self.hidden, self.residual
        else:
            per_launch = _layers_per_launch or self.num_layers
            if timing is not None and per_launch != self.num_layers:
                raise ValueError("timing stamps need every layer in one launch")
            for layer in range(0, self.num_layers, per_launch):
                count = min(per_launch, self.num_layers - layer)
                self._launch(x, residual, m, step, layer, count, -1, timing)
                x, residual = self.hidden, self.residual
        h = self.dims.hidden
        return self.hidden[: m * h].view(m, h), self.residual[: m * h].view(m, h)

    def _launch(
        self, x: torch.Tensor, residual: torch.Tensor | None, m: int, step: DecodeStep,
        layer: int, count: int, stage: int, timing: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """Layers `layer .. layer + count` (one launch), or one stage of one layer, for the
        `m` rows of `x`."""
        d = self.dims
        block_m = 1 if m == 1 else DOT_ROWS
        group = d.num_heads // d.num_kv_heads
        tokens = 1 if m == 1 else MAX_TOKENS
        _decode_layers_kernel[(self.programs,)](
            x, residual if residual is not None else x, self.hidden, self.residual, self.mid_res,
            self.qkv, self.mid_o, self.mid_lse, self.attn, self.o, self.act, self.router,
            self.barrier,
            self.table[layer],
            step.cos, step.sin, step.positions, step.slots, step.kv_lens, step.page_table,
            timing if timing is not None else self.table, d.eps, d.head_dim**-0.5 * _LOG2E,
            self.programs, count, m,
            H=d.hidden, HQ=d.num_heads, HKV=d.num_kv_heads, D=d.head_dim, FF=d.intermediate,
            PAGE=d.page_size, S_MAX=self.s_max, SPLIT_KEYS=self.split_keys, BLOCK_N=ATTN_BLOCK_N,
            **self.tiles[block_m], MOE=d.experts > 0, E=max(1, d.experts), TOPK=max(1, d.top_k),
            RENORM=d.renormalize, BLOCK_E=next_power_of_2(max(1, d.experts)),
            BLOCK_K=next_power_of_2(max(1, d.top_k)), BLOCK_M=block_m,
            BLOCK_R=max(16, next_power_of_2(tokens * group)),
            BLOCK_T=1 if m == 1 else max(16, MAX_TOKENS), BLOCK_S=next_power_of_2(self.s_max),
            HAS_RES=residual is not None, QKV_BIAS=self.qkv_bias, QK_NORM=self.qk_norm,
            STAGE=stage, OPAQUE=not interpreted(), L2=self.l2_prefetch and stage < 0,
            TIMING=timing is not None, num_warps=self.num_warps,
            **pdl_options(x.device, wanted=stage < 0),
        )  # fmt: skip


def _tiles(d: LayerDims, programs: int, block_m: int) -> dict[str, int]:
    """Each weight stage's rows a program (R), their block (BR: at least 16 for the tensor
    cores' tiles when `block_m` rows go through them) and its K width (BK). A mixture of
    experts' gate/up rows are pairs of the chosen experts' `top_k * I`, its router's rows
    experts (RT), and its down tiles lie within one expert (BK divides I)."""
    nqkv = (d.num_heads + 2 * d.num_kv_heads) * d.head_dim
    r_qkv, r_h = cdiv(nqkv, programs), cdiv(d.hidden, programs)
    r_gu = cdiv(d.intermediate * max(1, d.top_k), programs)
    r_rt = cdiv(max(1, d.experts), programs)
    least = 1 if block_m == 1 else DOT_ROWS

    def block(rows: int, pairs: bool = False) -> int:
        return max(next_power_of_2(rows), least // 2 if pairs else least)

    br_qkv, br_h, br_gu, br_rt = block(r_qkv), block(r_h), block(r_gu, pairs=True), block(r_rt)
    bk_dn = _tile_k(br_h, d.intermediate)
    if d.experts:
        while d.intermediate % bk_dn:
            bk_dn //= 2
    return {
        "R_QKV": r_qkv, "BR_QKV": br_qkv, "BK_QKV": _tile_k(br_qkv, d.hidden),
        "R_O": r_h, "BR_O": br_h, "BK_O": _tile_k(br_h, d.num_heads * d.head_dim),
        "R_GU": r_gu, "BR_GU": br_gu, "BK_GU": _tile_k(2 * br_gu, d.hidden),
        "R_DN": r_h, "BR_DN": br_h, "BK_DN": bk_dn,
        "R_RT": r_rt, "BR_RT": br_rt, "BK_RT": _tile_k(br_rt, d.hidden),
    }  # fmt: skip


def _address(t: torch.Tensor | None, fallback: torch.Tensor, dtype: torch.dtype) -> int:
    """A pointer-table entry: `t`'s address (`fallback`'s where absent). The kernel reads
    every entry as `dtype`, contiguous and 16-byte aligned (vector loads)."""
    t = fallback if t is None else t
    if t.dtype != dtype:
        raise ValueError(f"the decode layer kernel needs every tensor in {dtype}, got {t.dtype}")
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError("the decode layer kernel needs contiguous tensors on 16-byte addresses")
    return t.data_ptr()
