"""Fused per token: optional q/k RMSNorm, rotary embedding, and the K/V write to the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.launch import cdiv, direct_launch, next_power_of_2
from tokenmill.kernels.pdl import pdl_options, pdl_wait

# Prefill steps of at least ROPE_BLOCK_MIN_TOKENS tokens rotate ROPE_BLOCK_TOKENS tokens a
# program: a program per (token, KV head) was 65,536 programs of ~8 KB each for an 8,192-token
# step of Qwen3-0.6B, at about 40% of the copy rate (docs/perf-notes.md, session 28). Decode
# steps keep a program per token (a batch of a few tokens needs the programs).
ROPE_BLOCK_TOKENS = 4
ROPE_BLOCK_MIN_TOKENS = 512
# ... for query groups of at most this many values a KV head (Qwen3-0.6B's 2 x 128 and
# Llama-3.1-8B's 4 x 128 measured; 4 tokens of a larger group are tiles of 4K+ values a tile).
ROPE_BLOCK_MAX_GROUP = 512


@triton.jit
def _rotate(
    x, x_rot, offs_d, rot_d, half: tl.constexpr, D: tl.constexpr, cos, sin, norm_w_ptr, eps,
    QK_NORM: tl.constexpr,
):  # fmt: skip
    """RMS-normalise each row (a head) of `x` (optional), then rotate-half by its row of
    (cos, sin)."""
    xf = x.to(tl.float32)
    xr = x_rot.to(tl.float32)
    if QK_NORM:
        inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
        w = tl.load(norm_w_ptr + offs_d).to(tl.float32)
        w_rot = tl.load(norm_w_ptr + rot_d).to(tl.float32)
        xf = xf * inv[:, None] * w[None, :]
        xr = xr * inv[:, None] * w_rot[None, :]
    sign = tl.where(offs_d < half, -1.0, 1.0)
    return xf * cos + xr * sign[None, :] * sin


@direct_launch
@triton.jit(do_not_specialize=["tokens"])
def _rope_store_kernel(
    qkv_ptr, positions_ptr, slots_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr, k_fresh_ptr, v_fresh_ptr, stride_qkv, eps, tokens,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr, QK_NORM: tl.constexpr, FRESH: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # One program per (BLOCK_T tokens, KV head): the head's K and V and the HQ / HKV query
    # heads that attend to it, of each token. (One program per token did a decode step's whole
    # rotation on one SM: for one token it was a chain of loads and arithmetic as long as a
    # GEMV.) A query row is a (token, head) pair, a K/V row a token. With BLOCK_T = 1 the
    # programs are the same for any batch size, so a token's result never depends on its batch
    # (deterministic mode). The step's positions and slots were written before the previous
    # kernel (the q/k/v projection) started, and the rotary tables are constant: read before
    # the wait (see `tokenmill.kernels.pdl`). After it, every load of the tokens' q, k and v
    # goes out at once.
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    kvh = tl.program_id(1)
    offs_d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    rot_d = (offs_d + half) % D  # rotate-half's partner column
    group: tl.constexpr = HQ // HKV
    rows_q = tl.arange(0, BLOCK_T * BLOCK_G)
    tq = t0 + rows_q // BLOCK_G
    hq = kvh * group + rows_q % BLOCK_G
    tk = t0 + tl.arange(0, BLOCK_T)
    pos_q = tl.load(positions_ptr + tq, mask=tq < tokens, other=0)
    pos_k = tl.load(positions_ptr + tk, mask=tk < tokens, other=0)
    slot = tl.load(slots_ptr + tk, mask=tk < tokens, other=-1)
    cos_q = tl.load(cos_ptr + pos_q[:, None] * D + offs_d[None, :])
    sin_q = tl.load(sin_ptr + pos_q[:, None] * D + offs_d[None, :])
    cos_k = tl.load(cos_ptr + pos_k[:, None] * D + offs_d[None, :])
    sin_k = tl.load(sin_ptr + pos_k[:, None] * D + offs_d[None, :])
    pdl_wait(USE_PDL)

    q_mask = ((tq < tokens) & (rows_q % BLOCK_G < group))[:, None]
    # padded rows of a graph batch store nothing; (a program's rows past the step: no row)
    kv_mask = ((slot >= 0) & (tk < tokens))[:, None]
    q_rows = qkv_ptr + tq[:, None] * stride_qkv + hq[:, None] * D
    q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)
    q_rot = tl.load(q_rows + rot_d[None, :], mask=q_mask, other=0.0)
    k_rows = qkv_ptr + tk[:, None] * stride_qkv + (HQ + kvh) * D
    k = tl.load(k_rows + offs_d[None, :], mask=kv_mask, other=0.0)
    k_rot = tl.load(k_rows + rot_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(k_rows + HKV * D + offs_d[None, :], mask=kv_mask, other=0.0)
    q = _rotate(q, q_rot, offs_d, rot_d, half, D, cos_q, sin_q, q_norm_ptr, eps, QK_NORM)
    k = _rotate(k, k_rot, offs_d, rot_d, half, D, cos_k, sin_k, k_norm_ptr, eps, QK_NORM)
    out = q_out_ptr + tq[:, None] * HQ * D + hq[:, None] * D + offs_d[None, :]
    tl.store(out, q.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    cache_off = slot[:, None] * HKV * D + kvh * D + offs_d[None, :]
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(v_cache_ptr + cache_off, v, mask=kv_mask)
    if FRESH:  # the step's K and V, by token (zeros for a row that stores nothing)
        fresh_off = tk[:, None] * HKV * D + kvh * D + offs_d[None, :]
        in_step = (tk < tokens)[:, None]
        tl.store(k_fresh_ptr + fresh_off, k.to(k_fresh_ptr.dtype.element_ty), mask=in_step)
        tl.store(v_fresh_ptr + fresh_off, v, mask=in_step)


def rope_block_tokens(tokens: int, group: int, head_dim: int) -> int:
    """The tokens a program of `rope_and_store` takes by default in a step of `tokens`, for
    `group` query heads a KV head: ROPE_BLOCK_TOKENS from ROPE_BLOCK_MIN_TOKENS tokens when
    the group's values (padded to a power of two) are at most ROPE_BLOCK_MAX_GROUP, else 1."""
    small = next_power_of_2(group) * head_dim <= ROPE_BLOCK_MAX_GROUP
    return ROPE_BLOCK_TOKENS if tokens >= ROPE_BLOCK_MIN_TOKENS and small else 1


def rope_and_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
    spare_rows: int = 0,
    tokens_per_program: int | None = None,
) -> torch.Tensor:
    """Rotate q and k of `qkv` `[T, (Hq + 2 Hkv) D]`, store k and v at `slots`; returns q.

    `cos`/`sin` are `[max_positions, D]` float32; `qk_norm` is (q weight, k weight, eps) for
    models that RMS-normalise each head before the rotation. A negative slot skips the store.
    `fresh`: tensors of at least T rows `[Hkv, D]` the step's rotated k and its v are also
    written to, by token, in their first T rows (a negative slot's as zeros). `spare_rows`:
    rows of q's storage past its last, left unwritten (a dense attention reads its rows'
    queries padded). `tokens_per_program` (a power of two): the tokens each program rotates
    and stores (default: `rope_block_tokens`); 1 for results that never depend on the batch
    (deterministic mode: a token's q/k norm is reduced in the same layout at any batch size).
    """
    tokens = qkv.shape[0]
    shape = (tokens + spare_rows, num_heads, head_dim)
    q = torch.empty(shape, dtype=qkv.dtype, device=qkv.device)[:tokens]
    if tokens == 0:
        return q
    q_w, k_w, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    k_fresh, v_fresh = fresh if fresh is not None else (k_cache, v_cache)
    block_g = next_power_of_2(group)
    block_t = tokens_per_program or rope_block_tokens(tokens, group, head_dim)
    _rope_store_kernel[(cdiv(tokens, block_t), num_kv_heads)](
        qkv, positions, slots, cos, sin, q_w, k_w, q, k_cache, v_cache, k_fresh, v_fresh,
        qkv.stride(0), eps, tokens, HQ=num_heads, HKV=num_kv_heads, D=head_dim,
        BLOCK_G=block_g, BLOCK_T=block_t, QK_NORM=qk_norm is not None, FRESH=fresh is not None,
        num_warps=4 if block_t * block_g * head_dim >= 1024 else 2, **pdl_options(qkv.device),
    )  # fmt: skip
    return q
