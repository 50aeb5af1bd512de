"""Linear layers: plain, and several checkpoint tensors stacked (fused q/k/v, gate/up).

On CUDA, decode-sized inputs may take the split-K GEMV kernel instead of cuBLAS, per weight shape
and row bucket, where `choose_gemv_kernels` measured it faster at start-up.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.kernels import GemvConfig, gemv
from tokenmill.layers.activation import silu_and_mul
from tokenmill.observability.cuda_timing import median_graph_seconds

logger = logging.getLogger(__name__)

# Inputs of M rows use the choice made for the smallest bucket >= M; larger M use cuBLAS.
GEMV_BUCKETS = (1, 4)
GEMV_CANDIDATES = tuple(
    GemvConfig(block_n, 512, split_k)
    for block_n, split_k in ((4, 1), (8, 1), (8, 2), (8, 4), (8, 8), (16, 1), (16, 2))
)
# A candidate must beat cuBLAS by this factor to be chosen (timing noise is a few percent).
_MARGIN = 0.97


def gemv_bucket(m: int) -> int | None:
    """The row bucket whose kernel choice serves an input of `m` rows (None: too many rows)."""
    return next((b for b in GEMV_BUCKETS if m <= b), None)


class Linear(nn.Module):
    """`y = x W^T (+ b)`, with an optional per-bucket GEMV kernel for decode-sized inputs.

    With `gated_input`, `x` is `[..., 2 * in_features]` (gate | up) and the layer computes
    `silu(gate) * up` first (an MLP's down projection): the GEMV kernel fuses that activation.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, gated_input: bool = False
    ) -> None:
        super().__init__()
        self.gated_input = gated_input
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # Row bucket -> GEMV config, filled by `choose_gemv_kernels` (empty: always cuBLAS).
        self.gemv_configs: dict[int, GemvConfig] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv_configs and x.dim() == 2:
            bucket = gemv_bucket(x.shape[0])
            config = self.gemv_configs.get(bucket) if bucket is not None else None
            if config is not None:
                return gemv(x, self.weight, config, self.gated_input)
        if self.gated_input:
            x = silu_and_mul(x)
        return F.linear(x, self.weight, self.bias)


def choose_gemv_kernels(model: nn.Module) -> int:
    """For each half-precision CUDA weight shape and row bucket, keep the GEMV config that beats
    cuBLAS, timed in a CUDA graph over every layer of that shape (weights streamed from memory,
    as in a decode step). Returns how many (layer, bucket) pairs took a GEMV kernel."""
    groups: dict[tuple[int, int, bool], list[Linear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, Linear) and module.bias is None and _half_on_cuda(module.weight):
            n, k = module.weight.shape
            groups[(n, k, module.gated_input)].append(module)
    chosen = 0
    for (n, k, gated), layers in groups.items():
        for bucket in GEMV_BUCKETS:
            best = _fastest_gemv([layer.weight for layer in layers], bucket, gated)
            logger.info("GEMM %dx%d%s, M<=%d: %s", n, k, " gated" * gated, bucket, best or "cuBLAS")
            if best is not None:
                for layer in layers:
                    layer.gemv_configs[bucket] = best
                chosen += len(layers)
    return chosen


def _half_on_cuda(weight: torch.Tensor) -> bool:
    return weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)


def _fastest_gemv(weights: list[torch.Tensor], rows: int, gated: bool) -> GemvConfig | None:
    """The candidate that runs `rows` x every weight fastest, if it beats cuBLAS by the margin
    (for a gated layer, cuBLAS's time includes the separate activation kernel)."""
    w0 = weights[0]
    x = torch.randn(rows, w0.shape[1] * (2 if gated else 1), dtype=w0.dtype, device=w0.device)

    def cublas() -> None:
        h = silu_and_mul(x) if gated else x
        for w in weights:
            F.linear(h, w)

    best_s = _MARGIN * median_graph_seconds(cublas)
    best: GemvConfig | None = None
    for config in GEMV_CANDIDATES:
        seconds = median_graph_seconds(lambda c=config: [gemv(x, w, c, gated) for w in weights])
        if seconds < best_s:
            best_s, best = seconds, config
    return best


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
