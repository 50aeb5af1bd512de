"""Linear layers: plain, and several checkpoint tensors stacked (fused q/k/v, gate/up).

On CUDA, decode-sized inputs may take the split-K GEMV kernel instead of cuBLAS, per weight shape
and row bucket, where the start-up tuning (`kernels/gemv_tuning.py`, applied by
`choose_gemv_kernels`) measured it correct and faster. The kernel can also absorb the layer's
input transform: SwiGLU for a down projection (`input_kind="gated"`), or residual-add + RMSNorm
for a projection behind a norm (`input_kind="normed"`, called through `forward_normed`).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.kernels import InputNorm, gemv, norm_gemv
from tokenmill.kernels.gemv_tuning import (
    GemvChoice,
    InputKind,
    choose_gemv_configs,
    gemv_bucket,
)
from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.norm import RMSNorm
from tokenmill.tuning_cache import TuningCache

logger = logging.getLogger(__name__)


class Linear(nn.Module):
    """`y = x W^T (+ b)`, with an optional per-bucket GEMV kernel for decode-sized inputs.

    `input_kind="gated"`: `x` is `[..., 2 * in_features]` (gate | up) and the layer computes
    `silu(gate) * up` first (an MLP's down projection). `input_kind="normed"`: the layer is
    called through `forward_normed`, with the RMSNorm in front of it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        input_kind: InputKind = "plain",
    ) -> None:
        super().__init__()
        self.input_kind = input_kind
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # Row bucket -> GEMV kernel, filled by `choose_gemv_kernels` (empty: always cuBLAS).
        self.gemv_choices: dict[int, GemvChoice] = {}

    def _gemv_choice(self, x: torch.Tensor) -> GemvChoice | None:
        bucket = gemv_bucket(x.shape[0]) if self.gemv_choices and x.dim() == 2 else None
        return self.gemv_choices.get(bucket) if bucket is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = self.input_kind == "gated"
        choice = self._gemv_choice(x) if self.input_kind != "normed" else None
        if choice is not None and choice.fused:
            return gemv(x, self.weight, choice.config, gated)
        return self._product(silu_and_mul(x) if gated else x, choice)

    def forward_normed(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(self(norm(x + residual)), x + residual)`; without a residual, `x` is the next one."""
        choice = self._gemv_choice(x)
        if choice is not None and choice.fused:
            inputs = InputNorm(norm.weight, norm.eps, residual)
            return norm_gemv(x, self.weight, choice.config, inputs)
        if residual is None:
            residual, h = x, norm(x)
        else:
            h, residual = norm.add_forward(x, residual)
        return self._product(h, choice), residual

    def _product(self, h: torch.Tensor, choice: GemvChoice | None) -> torch.Tensor:
        """`h W^T (+ b)` of an already transformed input: the chosen GEMV, else cuBLAS."""
        if choice is None:
            return F.linear(h, self.weight, self.bias)
        return gemv(h, self.weight, choice.config)


def choose_gemv_kernels(model: nn.Module, cache: TuningCache | None = None) -> int:
    """Give every half-precision CUDA `Linear` of `model` the GEMV kernels the start-up tuning
    (`kernels.gemv_tuning`, reading and filling `cache`) chose for its weight shape and input
    kind. Returns how many (layer, bucket) pairs took a GEMV kernel."""
    groups: dict[tuple[int, int, InputKind], list[Linear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, Linear) and module.bias is None and _half_on_cuda(module.weight):
            n, k = module.weight.shape
            groups[(n, k, module.input_kind)].append(module)
    weights = {key: [layer.weight for layer in layers] for key, layers in groups.items()}
    chosen = 0
    for key, choices in choose_gemv_configs(weights, cache).items():
        for layer in groups[key]:
            layer.gemv_choices.update(choices)
        chosen += len(groups[key]) * len(choices)
    return chosen


def _half_on_cuda(weight: torch.Tensor) -> bool:
    return weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)


class MergedLinear(Linear):
    """One matmul standing for several checkpoint projections concatenated along the output.

    `shard_sizes` maps each checkpoint shard name (e.g. "q", "k", "v") to its output size, in the
    order they are stacked. `weight_loader` copies one shard into its rows.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
        input_kind: InputKind = "plain",
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, input_kind)
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
    """The fused q/k/v projection of an attention layer, behind the layer's input norm."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        kv = num_kv_heads * head_dim
        shards = {"q": num_heads * head_dim, "k": kv, "v": kv}
        super().__init__(hidden_size, shards, bias, input_kind="normed")
