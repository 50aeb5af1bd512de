"""RMSNorm, with the residual add fused in front of it."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as transformers does, then scaled by `weight`."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view_as(x)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(norm(x + residual), x + residual)`: the next input and the next residual.

        On CUDA one fused kernel does both, updating `residual` in place.
        """
        if x.is_cuda:
            return rms_norm(x, self.weight, self.eps, residual), residual
        residual = x + residual
        return self.forward(residual), residual
