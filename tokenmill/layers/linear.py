"""Linear layers: plain, and several checkpoint tensors stacked (fused q/k/v, gate/up)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.kernels import SKINNY_MAX_M, skinny_gemm
from tokenmill.observability.cuda_timing import median_cuda_seconds


class Linear(nn.Module):
    """`y = x W^T (+ b)`; on CUDA, decode-sized inputs may take the skinny-GEMM kernel.

    `use_skinny` is decided per weight shape at start-up by timing both kernels
    (`choose_gemm_kernels`), since which one wins depends on the shape and the GPU.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.use_skinny = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_skinny and x.shape[0] <= SKINNY_MAX_M and x.is_cuda and self.bias is None:
            return skinny_gemm(x, self.weight)
        return F.linear(x, self.weight, self.bias)


def choose_gemm_kernels(model: nn.Module, device: torch.device, repeats: int = 30) -> int:
    """Time cuBLAS and the skinny GEMM at M=1 for each weight shape; keep the faster.

    Returns how many layers use the skinny kernel.
    """
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.bias is None]
    faster: dict[tuple[int, ...], bool] = {}
    for layer in layers:
        shape = tuple(layer.weight.shape)
        if shape not in faster:
            faster[shape] = _skinny_is_faster(layer.weight, device, repeats)
        layer.use_skinny = faster[shape]
    return sum(layer.use_skinny for layer in layers)


def _skinny_is_faster(weight: torch.Tensor, device: torch.device, repeats: int) -> bool:
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=device)
    cublas = median_cuda_seconds(lambda: F.linear(x, weight), repeats)
    return median_cuda_seconds(lambda: skinny_gemm(x, weight), repeats) < cublas


class MergedLinear(Linear):
    """One matmul standing for several checkpoint projections concatenated along the output.

    `shard_sizes` maps each checkpoint shard name (e.g. "q", "k", "v") to its output size, in the
    order they are stacked. `weight_loader` copies one shard into its rows.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        """Copy checkpoint tensor `loaded` (weight or bias of `shard`) into its slice of `param`."""
        offset, size = self.shard_offsets[shard]
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"shard {shard!r} has shape {tuple(loaded.shape)}, expected "
                f"{(size, *param.shape[1:])}"
            )
        param.data[offset : offset + size].copy_(loaded)


class QKVLinear(MergedLinear):
    """The fused q/k/v projection of an attention layer."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        kv = num_kv_heads * head_dim
        super().__init__(hidden_size, {"q": num_heads * head_dim, "k": kv, "v": kv}, bias)
