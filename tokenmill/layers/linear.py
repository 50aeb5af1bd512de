"""Linear layers: plain, and several checkpoint tensors stacked (fused q/k/v, gate/up).

On CUDA, decode-sized inputs may take the split-K GEMV kernel instead of cuBLAS, per weight shape
and row bucket, where `choose_gemv_kernels` measured it correct and faster at start-up. The
kernel can also absorb the layer's input transform: SwiGLU for a down projection
(`input_kind="gated"`), or residual-add + RMSNorm for a projection behind a norm
(`input_kind="normed"`, called through `forward_normed`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.kernels import GemvConfig, InputNorm, gemv, norm_gemv
from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.norm import RMSNorm
from tokenmill.observability.cuda_timing import median_graph_seconds

logger = logging.getLogger(__name__)

InputKind = Literal["plain", "gated", "normed"]

# Inputs of M rows use the choice made for the smallest bucket >= M; larger M use cuBLAS.
GEMV_BUCKETS = (1, 4)
# The configs of `benchmarks/gemv_sweep.py` that came within a few percent of the best on the
# decode shapes of qwen3-0.6b and llama-3.1-8b on an H200 (docs/perf-notes.md, v9), plus split-K
# ones for M > 1, where each program's product is M times the work.
GEMV_CANDIDATES = (
    GemvConfig(4, 512, 1, num_warps=2, defer=True),
    GemvConfig(4, 256, 1, num_warps=2, prefetch=2, defer=True),
    GemvConfig(4, 1024, 1, num_warps=4, prefetch=2, defer=True),
    GemvConfig(2, 1024, 1, num_warps=4, defer=True),
    GemvConfig(2, 512, 1, num_warps=2, defer=True),
    GemvConfig(2, 1024, 1, num_warps=2),
    GemvConfig(4, 1024, 1, num_warps=4),
    GemvConfig(8, 512, 1),
    GemvConfig(8, 512, 2),
    GemvConfig(8, 512, 4),
)
# A candidate must beat cuBLAS by this factor to be chosen (timing noise is a few percent).
_MARGIN = 0.97


def gemv_bucket(m: int) -> int | None:
    """The row bucket whose kernel choice serves an input of `m` rows (None: too many rows)."""
    return next((b for b in GEMV_BUCKETS if m <= b), None)


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
        # Row bucket -> GEMV config, filled by `choose_gemv_kernels` (empty: always cuBLAS).
        self.gemv_configs: dict[int, GemvConfig] = {}

    def _gemv_config(self, x: torch.Tensor) -> GemvConfig | None:
        bucket = gemv_bucket(x.shape[0]) if self.gemv_configs and x.dim() == 2 else None
        return self.gemv_configs.get(bucket) if bucket is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = self.input_kind == "gated"
        config = self._gemv_config(x) if self.input_kind != "normed" else None
        if config is not None:
            return gemv(x, self.weight, config, gated)
        return F.linear(silu_and_mul(x) if gated else x, self.weight, self.bias)

    def forward_normed(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(self(norm(x + residual)), x + residual)`; without a residual, `x` is the next one."""
        config = self._gemv_config(x)
        if config is not None:
            return norm_gemv(x, self.weight, config, InputNorm(norm.weight, norm.eps, residual))
        if residual is None:
            residual, h = x, norm(x)
        else:
            h, residual = norm.add_forward(x, residual)
        return F.linear(h, self.weight, self.bias), residual


def choose_gemv_kernels(model: nn.Module) -> int:
    """For each half-precision CUDA weight shape, input kind and row bucket, keep the GEMV
    config that matches cuBLAS's result and beats its time, timed in a CUDA graph over every
    layer of that shape (weights streamed from memory, as in a decode step). Returns how many
    (layer, bucket) pairs took a GEMV kernel."""
    groups: dict[tuple[int, int, InputKind], list[Linear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, Linear) and module.bias is None and _half_on_cuda(module.weight):
            n, k = module.weight.shape
            groups[(n, k, module.input_kind)].append(module)
    chosen = 0
    for (n, k, kind), layers in groups.items():
        for bucket in GEMV_BUCKETS:
            best = _fastest_gemv([layer.weight for layer in layers], bucket, kind)
            logger.info("GEMM %dx%d (%s input), M<=%d: %s", n, k, kind, bucket, best or "cuBLAS")
            if best is not None:
                for layer in layers:
                    layer.gemv_configs[bucket] = best
                chosen += len(layers)
    return chosen


def _half_on_cuda(weight: torch.Tensor) -> bool:
    return weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)


def _fastest_gemv(weights: list[torch.Tensor], rows: int, kind: InputKind) -> GemvConfig | None:
    """The candidate that runs `rows` x every weight fastest, if its first product matches
    cuBLAS's and it beats cuBLAS by the margin. cuBLAS's time includes the separate input
    kernel (SwiGLU, or add + RMSNorm) that the GEMV absorbs."""
    w0 = weights[0]
    width = w0.shape[1] * (2 if kind == "gated" else 1)
    x, residual = (torch.randn(rows, width, dtype=w0.dtype, device=w0.device) for _ in range(2))
    norm = RMSNorm(w0.shape[1], 1e-6).to(w0.device, w0.dtype)

    def reference(w: torch.Tensor) -> torch.Tensor:
        if kind == "normed":
            return F.linear(norm(x + residual), w)
        return F.linear(silu_and_mul(x) if kind == "gated" else x, w)

    def candidate(w: torch.Tensor, config: GemvConfig) -> torch.Tensor:
        if kind == "normed":
            return norm_gemv(x, w, config, InputNorm(norm.weight, norm.eps, residual))[0]
        return gemv(x, w, config, kind == "gated")

    scratch = residual.clone()

    def cublas() -> None:  # each layer runs its own input kernel before its product
        for w in weights:
            if kind == "normed":  # the fused add + RMSNorm kernel updates `scratch` in place
                h, _ = norm.add_forward(x, scratch)
            else:
                h = silu_and_mul(x) if kind == "gated" else x
            F.linear(h, w)

    expected = reference(w0).float()
    best_s = _MARGIN * median_graph_seconds(cublas)
    best: GemvConfig | None = None
    for config in (c for c in GEMV_CANDIDATES if c.serves(rows)):
        if not _matches(lambda c=config: candidate(w0, c), expected, config):
            continue
        seconds = median_graph_seconds(lambda c=config: [candidate(w, c) for w in weights])
        if seconds < best_s:
            best_s, best = seconds, config
    return best


def _matches(run: Callable[[], torch.Tensor], expected: torch.Tensor, config: GemvConfig) -> bool:
    """Whether the candidate's product is cuBLAS's to bf16 rounding (a GPU-specific fault in a
    candidate, wrong results or a kernel that does not build here, must cost speed, never
    correctness or the start-up)."""
    try:
        got = run().float()
    except Exception as exc:  # e.g. triton's CompilationError / OutOfResources on this GPU
        logger.warning("GEMV %s failed here (%s); not used", config, exc)
        return False
    ok = bool(torch.allclose(got, expected, rtol=0.02, atol=0.02 * expected.abs().max().item()))
    if not ok:
        logger.warning("GEMV %s disagrees with cuBLAS (max error %.3g); not used", config,
                       (got - expected).abs().max().item())  # fmt: skip
    return ok


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
