"""Fused residual-add + RMSNorm, one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.launch import direct_launch, next_power_of_2
from tokenmill.kernels.pdl import pdl_options, pdl_wait


@direct_launch
@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_res,
    stride_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype, as an eager `x + residual` does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`weight * normalize(x [+ residual])` over the last dim of a 2-D `x`.

    With `residual`, the sum `x + residual` is written back into `residual` (in place).
    """
    assert x.dim() == 2 and x.stride(-1) == 1
    out = torch.empty_like(x)
    n_rows, n_cols = x.shape
    if n_rows == 0:
        return out
    res = residual if residual is not None else x
    block = next_power_of_2(n_cols)
    _add_rms_norm_kernel[(n_rows,)](
        x,
        res,
        weight,
        out,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
        **pdl_options(x.device),
    )
    return out
