"""Skinny GEMM for decode: `x [M, K] @ W[N, K]^T` with M <= 8, streaming W once at full bandwidth.

cuBLAS runs these shapes (M = batch of 1..8 decode tokens) well below memory bandwidth for the
small matrices of small models; here every program owns a few output columns and walks K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import SKINNY_MAX_M


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` for 2-D `x` with at most `MAX_M` rows (contiguous last dims)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= SKINNY_MAX_M and weight.shape[1] == k
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = max(1, triton.next_power_of_2(m))
    block_n = 8 if block_m <= 2 else 4
    block_k = 256 if block_m <= 2 else 128
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4,
    )  # fmt: skip
    return out
