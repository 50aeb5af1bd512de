"""Linear layers: plain, and several checkpoint tensors stacked (fused q/k/v, gate/up).

On CUDA, decode-sized inputs may take the split-K GEMV kernel instead of cuBLAS, per weight shape
and row bucket, where `choose_gemv_kernels` measured it correct and faster at start-up. The
kernel can also absorb the layer's input transform: SwiGLU for a down projection
(`input_kind="gated"`), or residual-add + RMSNorm for a projection behind a norm
(`input_kind="normed"`, called through `forward_normed`); the start-up check also times the
GEMV behind the transform's own kernel, and keeps whichever of the three is fastest.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class GemvChoice:
    """The GEMV kernel a layer runs for one row bucket; `fused`: a gated or normed layer's
    input transform (SwiGLU, add + RMSNorm) runs inside it, else as its own kernel before."""

    config: GemvConfig
    fused: bool = True


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
            best, seconds, cublas = _fastest_gemv([layer.weight for layer in layers], bucket, kind)
            logger.info(
                "GEMM %dx%d (%s input), M<=%d: %s, %.1f us per layer (cuBLAS %.1f us)",
                n, k, kind, bucket, best or "cuBLAS", 1e6 * seconds / len(layers),
                1e6 * cublas / len(layers),
            )  # fmt: skip
            if best is not None:
                for layer in layers:
                    layer.gemv_choices[bucket] = best
                chosen += len(layers)
    return chosen


def _half_on_cuda(weight: torch.Tensor) -> bool:
    return weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)


def _fastest_gemv(
    weights: list[torch.Tensor], rows: int, kind: InputKind
) -> tuple[GemvChoice | None, float, float]:
    """The candidate (None: cuBLAS) that runs `rows` x every weight fastest, with its seconds
    and cuBLAS's: one whose first product matches cuBLAS's and beats it by the margin. Each
    layer runs its input kernel (SwiGLU, or add + RMSNorm) before cuBLAS or an unfused GEMV."""
    w0 = weights[0]
    width = w0.shape[1] * (2 if kind == "gated" else 1)
    x, residual = (torch.randn(rows, width, dtype=w0.dtype, device=w0.device) for _ in range(2))
    norm = RMSNorm(w0.shape[1], 1e-6).to(w0.device, w0.dtype)

    def run(w: torch.Tensor, choice: GemvChoice | None, res: torch.Tensor) -> torch.Tensor:
        if choice is not None and choice.fused:
            if kind == "normed":
                return norm_gemv(x, w, choice.config, InputNorm(norm.weight, norm.eps, res))[0]
            return gemv(x, w, choice.config, kind == "gated")
        if kind == "normed":  # the fused add + RMSNorm kernel updates `res` in place
            h, _ = norm.add_forward(x, res)
        else:
            h = silu_and_mul(x) if kind == "gated" else x
        return F.linear(h, w) if choice is None else gemv(h, w, choice.config)

    scratch = residual.clone()

    def seconds(choice: GemvChoice | None) -> float:
        return median_graph_seconds(lambda: [run(w, choice, scratch) for w in weights])

    expected = run(w0, None, residual.clone()).float()
    cublas_s = seconds(None)
    best, best_s = None, _MARGIN * cublas_s
    fusions = (True,) if kind == "plain" else (True, False)
    for choice in (
        GemvChoice(c, fused) for c in GEMV_CANDIDATES if c.serves(rows) for fused in fusions
    ):
        if not _matches(lambda c=choice: run(w0, c, residual.clone()), expected, choice):
            continue
        if (s := seconds(choice)) < best_s:
            best, best_s = choice, s
    return best, (best_s if best else cublas_s), cublas_s


def _matches(run: Callable[[], torch.Tensor], expected: torch.Tensor, choice: GemvChoice) -> bool:
    """Whether the candidate's product is cuBLAS's to bf16 rounding (a GPU-specific fault in a
    candidate, wrong results or a kernel that does not build here, must cost speed, never
    correctness or the start-up)."""
    try:
        got = run().float()
    except Exception as exc:  # e.g. triton's CompilationError / OutOfResources on this GPU
        logger.warning("GEMV %s failed here (%s); not used", choice, exc)
        return False
    ok = bool(torch.allclose(got, expected, rtol=0.02, atol=0.02 * expected.abs().max().item()))
    if not ok:
        logger.warning("GEMV %s disagrees with cuBLAS (max error %.3g); not used", choice,
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
