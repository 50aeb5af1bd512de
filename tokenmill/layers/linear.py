"""Linear layers whose weight is several checkpoint tensors stacked (fused q/k/v, gate/up)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class MergedLinear(nn.Module):
    """One matmul standing for several checkpoint projections concatenated along the output.

    `shard_sizes` maps each checkpoint shard name (e.g. "q", "k", "v") to its output size, in the
    order they are stacked. `weight_loader` copies one shard into its rows.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__()
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.weight = nn.Parameter(torch.empty(offset, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(offset), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

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
