"""Fused per token: optional q/k RMSNorm, rotary embedding, and the K/V write to the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import pdl_options, pdl_wait


@triton.jit
def _load_rotated(
    base_ptr, heads, offs_d, half: tl.constexpr, D: tl.constexpr, head_mask, cos, sin, norm_w_ptr,
    eps, QK_NORM: tl.constexpr,
):  # fmt: skip
    """Load `[H, D]` heads, RMS-normalise each (optional) and rotate-half by (cos, sin)."""
    x = tl.load(base_ptr + heads[:, None] * D + offs_d[None, :], mask=head_mask[:, None], other=0.0)
    rot_d = (offs_d + half) % D
    x_rot = tl.load(
        base_ptr + heads[:, None] * D + rot_d[None, :], mask=head_mask[:, None], other=0.0
    )
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
    q_out_ptr, k_cache_ptr, v_cache_ptr, stride_qkv, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, QK_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    slot = tl.load(slots_ptr + t)
    offs_d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    cos = tl.load(cos_ptr + pos * D + offs_d)
    sin = tl.load(sin_ptr + pos * D + offs_d)
    row = qkv_ptr + t * stride_qkv

    hq = tl.arange(0, BLOCK_HQ)
    q = _load_rotated(row, hq, offs_d, half, D, hq < HQ, cos, sin, q_norm_ptr, eps, QK_NORM)
    out = q_out_ptr + t * HQ * D + hq[:, None] * D + offs_d[None, :]
    tl.store(out, q.to(q_out_ptr.dtype.element_ty), mask=(hq < HQ)[:, None])

    if slot >= 0:  # padded rows of a CUDA-graph batch write nothing
        hk = tl.arange(0, BLOCK_HKV)
        kmask = (hk < HKV)[:, None]
        k_row = row + HQ * D
        k = _load_rotated(k_row, hk, offs_d, half, D, hk < HKV, cos, sin, k_norm_ptr, eps, QK_NORM)
        cache_off = slot * HKV * D + hk[:, None] * D + offs_d[None, :]
        tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=kmask)
        v = tl.load(k_row + HKV * D + hk[:, None] * D + offs_d[None, :], mask=kmask, other=0.0)
        tl.store(v_cache_ptr + cache_off, v, mask=kmask)


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
) -> torch.Tensor:
    """Rotate q and k of `qkv` `[T, (Hq + 2 Hkv) D]`, store k and v at `slots`; returns q.

    `cos`/`sin` are `[max_positions, D]` float32; `qk_norm` is (q weight, k weight, eps) for
    models that RMS-normalise each head before the rotation. A negative slot skips the store.
    """
    tokens = qkv.shape[0]
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    q_w, k_w, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    _rope_store_kernel[(tokens,)](
        qkv, positions, slots, cos, sin, q_w, k_w, q, k_cache, v_cache, qkv.stride(0), eps,
        HQ=num_heads, HKV=num_kv_heads, D=head_dim,
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        QK_NORM=qk_norm is not None, **pdl_options(qkv.device),
    )  # fmt: skip
    return q
