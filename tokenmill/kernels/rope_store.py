"""Fused per token: optional q/k RMSNorm, rotary embedding, and the K/V write to the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import pdl_options, pdl_wait


@triton.jit
def _load_heads(base_ptr, heads, offs_d, rot_d, D: tl.constexpr, mask):
    """Load `[H, D]` heads, and the same heads with their halves swapped (columns `rot_d`)."""
    x = tl.load(base_ptr + heads[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
    x_rot = tl.load(base_ptr + heads[:, None] * D + rot_d[None, :], mask=mask, other=0.0)
    return x, x_rot


@triton.jit
def _rotate(
    x, x_rot, offs_d, rot_d, half: tl.constexpr, D: tl.constexpr, cos, sin, norm_w_ptr, eps,
    QK_NORM: tl.constexpr,
):  # fmt: skip
    """RMS-normalise each head of `x` (optional), then rotate-half by (cos, sin)."""
    xf = x.to(tl.float32)
    xr = x_rot.to(tl.float32)
    if QK_NORM:
        inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
        w = tl.load(norm_w_ptr + offs_d).to(tl.float32)
        w_rot = tl.load(norm_w_ptr + rot_d).to(tl.float32)
        xf = xf * inv[:, None] * w[None, :]
        xr = xr * inv[:, None] * w_rot[None, :]
    sign = tl.where(offs_d < half, -1.0, 1.0)
    return xf * cos[None, :] + xr * sign[None, :] * sin[None, :]


@triton.jit
def _rope_store_kernel(
    qkv_ptr, positions_ptr, slots_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr, k_fresh_ptr, v_fresh_ptr, stride_qkv, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
    QK_NORM: tl.constexpr, FRESH: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # One program per (token, KV head): the head's K and V and the HQ / HKV query heads that
    # attend to it. (One program per token did a decode step's whole rotation on one SM: for
    # one token it was a chain of loads and arithmetic as long as a GEMV.) The same programs
    # for any batch size, so a token's result never depends on its batch (deterministic mode).
    # The step's positions and slots were written before the previous kernel (the q/k/v
    # projection) started, and the rotary tables are constant: read before the wait (see
    # `tokenmill.kernels.pdl`). After it, every load of the token's q, k and v goes out at once.
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    pos = tl.load(positions_ptr + t)
    slot = tl.load(slots_ptr + t)
    offs_d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    rot_d = (offs_d + half) % D  # rotate-half's partner column
    cos = tl.load(cos_ptr + pos * D + offs_d)
    sin = tl.load(sin_ptr + pos * D + offs_d)
    pdl_wait(USE_PDL)

    group: tl.constexpr = HQ // HKV
    row = qkv_ptr + t * stride_qkv
    hq = kvh * group + tl.arange(0, BLOCK_G)
    hk = kvh + tl.arange(0, 1)
    q_mask = (tl.arange(0, BLOCK_G) < group)[:, None]
    kv_mask = (slot >= 0) & (offs_d < D)[None, :]  # padded rows of a graph batch store nothing
    q, q_rot = _load_heads(row, hq, offs_d, rot_d, D, q_mask)
    k, k_rot = _load_heads(row + HQ * D, hk, offs_d, rot_d, D, kv_mask)
    v = tl.load(row + (HQ + HKV) * D + hk[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
    q = _rotate(q, q_rot, offs_d, rot_d, half, D, cos, sin, q_norm_ptr, eps, QK_NORM)
    k = _rotate(k, k_rot, offs_d, rot_d, half, D, cos, sin, k_norm_ptr, eps, QK_NORM)
    out = q_out_ptr + t * HQ * D + hq[:, None] * D + offs_d[None, :]
    tl.store(out, q.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    cache_off = slot * HKV * D + hk[:, None] * D + offs_d[None, :]
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(v_cache_ptr + cache_off, v, mask=kv_mask)
    if FRESH:  # the step's K and V, by token (zeros for a row that stores nothing)
        fresh_off = t * HKV * D + hk[:, None] * D + offs_d[None, :]
        tl.store(k_fresh_ptr + fresh_off, k.to(k_fresh_ptr.dtype.element_ty))
        tl.store(v_fresh_ptr + fresh_off, v)


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
) -> torch.Tensor:
    """Rotate q and k of `qkv` `[T, (Hq + 2 Hkv) D]`, store k and v at `slots`; returns q.

    `cos`/`sin` are `[max_positions, D]` float32; `qk_norm` is (q weight, k weight, eps) for
    models that RMS-normalise each head before the rotation. A negative slot skips the store.
    `fresh`: tensors of at least T rows `[Hkv, D]` the step's rotated k and its v are also
    written to, by token, in their first T rows (a negative slot's as zeros). `spare_rows`:
    rows of q's storage past its last, left unwritten (a dense attention reads its rows'
    queries padded).
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
    _rope_store_kernel[(tokens, num_kv_heads)](
        qkv, positions, slots, cos, sin, q_w, k_w, q, k_cache, v_cache, k_fresh, v_fresh,
        qkv.stride(0), eps, HQ=num_heads, HKV=num_kv_heads, D=head_dim,
        BLOCK_G=triton.next_power_of_2(group), QK_NORM=qk_norm is not None,
        FRESH=fresh is not None, num_warps=4 if group * head_dim >= 1024 else 2,
        **pdl_options(qkv.device),
    )  # fmt: skip
    return q
