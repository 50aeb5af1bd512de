"""SiLU-and-mul (SwiGLU) in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.launch import cdiv, direct_launch, next_power_of_2
from tokenmill.kernels.pdl import pdl_options, pdl_wait


@triton.jit
def silu_mul(gate, up):
    """`silu(gate) * up` in float32 as `silu_and_mul` rounds it: the SiLU taken in float32 and
    rounded to `up`'s dtype, then the product (the caller rounds it to its output's dtype)."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(up.dtype)
    return silu.to(tl.float32) * up.to(tl.float32)


@direct_launch
@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    out = silu_mul(gate, up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[:, :d]) * x[:, d:]` for a 2-D `x` of width `2 d`."""
    n_rows, width = x.shape
    d = width // 2
    out = torch.empty((n_rows, d), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return out
    block = min(next_power_of_2(d), 1024)
    _silu_and_mul_kernel[(n_rows, cdiv(d, block))](
        x, out, x.stride(0), out.stride(0), d, BLOCK=block, **pdl_options(x.device)
    )
    return out
