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

from tokenmill.distributed.group import TPGroup
from tokenmill.kernels import InputNorm, gemv, norm_gemv
from tokenmill.kernels.gemv_tuning import (
    GemvChoice,
    InputKind,
    ShippedChoices,
    choose_gemv_configs,
    gemv_bucket,
)
from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.invariant import invariant_linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.sharding import TensorSource, copy_shard, set_tp_dim
from tokenmill.tuning_cache import TuningCache

logger = logging.getLogger(__name__)


class Linear(nn.Module):
    """`y = x W^T (+ b)`, with an optional per-bucket GEMV kernel for decode-sized inputs.

    `input_kind="gated"`: `x` is `[..., 2 * in_features]` (gate | up) and the layer computes
    `silu(gate) * up` first (an MLP's down projection). `input_kind="normed"`: the layer is
    called through `forward_normed`, with the RMSNorm in front of it.

    Under tensor parallelism the sizes are this rank's: `tp_dim=0` (column-parallel) holds a
    slice of the outputs, `tp_dim=1` (row-parallel) a slice of the inputs, whose partial
    products the model sums over the ranks; a row-parallel layer's bias is left out of its
    product and added once to the sum (`add_bias`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        input_kind: InputKind = "plain",
        tp_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.input_kind = input_kind
        weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight = set_tp_dim(weight, tp_dim)
        self.bias = None
        if bias:  # a row-parallel layer's bias is whole on every rank
            bias_dim = 0 if tp_dim == 0 else None
            self.bias = set_tp_dim(
                nn.Parameter(torch.empty(out_features), requires_grad=False), bias_dim
            )
        self._bias_after_sum = bias and tp_dim == 1
        # Row bucket -> GEMV kernel, filled by `choose_gemv_kernels` (empty: always cuBLAS).
        self.gemv_choices: dict[int, GemvChoice] = {}
        # Deterministic mode (`layers.invariant.make_batch_invariant`): one product for any
        # number of rows, never a GEMV chosen by row count; `swiglu`: rows interleave gate and
        # up, and the product applies SiLU-and-mul (`LlamaMLP.fuse_swiglu`).
        self.batch_invariant = False
        self.swiglu = False

    def _gemv_choice(self, x: torch.Tensor) -> GemvChoice | None:
        if self.batch_invariant:
            return None
        bucket = gemv_bucket(x.shape[0]) if self.gemv_choices and x.dim() == 2 else None
        return self.gemv_choices.get(bucket) if bucket is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = self.input_kind == "gated"
        choice = self._gemv_choice(x) if self.input_kind != "normed" else None
        if choice is not None and choice.fused:
            return gemv(x, self.weight, choice.config, gated)
        return self._product(silu_and_mul(x, self.batch_invariant) if gated else x, choice)

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
        """`h W^T (+ b)` of an already transformed input: the chosen GEMV, else cuBLAS (or,
        batch-invariant, `invariant_linear`)."""
        if choice is None:
            if self.batch_invariant:
                return invariant_linear(h, self.weight, self._product_bias, self.swiglu)
            return F.linear(h, self.weight, self._product_bias)
        return gemv(h, self.weight, choice.config)

    @property
    def _product_bias(self) -> torch.Tensor | None:
        """The bias the product adds (a row-parallel layer's is added to the ranks' sum)."""
        return None if self._bias_after_sum else self.bias

    def add_bias(self, summed: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output summed over the ranks, plus its bias (if any)."""
        return summed + self.bias if self._bias_after_sum else summed


def choose_gemv_kernels(
    model: nn.Module,
    cache: TuningCache | None = None,
    threads: int = 1,
    shipped: ShippedChoices | None = None,
) -> int:
    """Give every half-precision CUDA `Linear` of `model` the GEMV kernels the start-up tuning
    (`kernels.gemv_tuning`, reading and filling `cache`, else taking the `shipped` choices that
    hold here, compiling candidates on `threads` threads) chose for its weight shape and input
    kind. Returns how many (layer, bucket) pairs took a GEMV kernel."""
    groups: dict[tuple[int, int, InputKind], list[Linear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, Linear) and module.bias is None and _half_on_cuda(module.weight):
            n, k = module.weight.shape
            groups[(n, k, module.input_kind)].append(module)
    weights = {key: [layer.weight for layer in layers] for key, layers in groups.items()}
    chosen = 0
    configs = choose_gemv_configs(weights, cache, threads=threads, shipped=shipped)
    for key, choices in configs.items():
        for layer in groups[key]:
            layer.gemv_choices.update(choices)
        chosen += len(groups[key]) * len(choices)
    return chosen


def _half_on_cuda(weight: torch.Tensor) -> bool:
    return weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)


class MergedLinear(Linear):
    """One matmul standing for several checkpoint projections concatenated along the output.

    `shard_sizes` maps each checkpoint shard name (e.g. "q", "k", "v") to its output size, in the
    order they are stacked (this rank's size, under tensor parallelism `tp`: rank r holds rows
    `r * size ..` of each checkpoint tensor). `weight_loader` copies one shard into its rows.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
        input_kind: InputKind = "plain",
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, input_kind, tp_dim=0)
        self.tp = tp or TPGroup.single()
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded: TensorSource, shard: str) -> None:
        """Copy this rank's rows of checkpoint tensor `loaded` (weight or bias of `shard`)
        into its slice of `param`."""
        offset, size = self.shard_offsets[shard]
        start = self._first_row(loaded, shard, size)
        what = f"shard {shard!r}"
        copy_shard(param.data[offset : offset + size], loaded, 0, self.tp, what, start)

    def _first_row(self, loaded: TensorSource, shard: str, size: int) -> int | None:
        """The first checkpoint row of this rank's slice of `shard` (None: an even split)."""
        return None


class QKVLinear(MergedLinear):
    """The fused q/k/v projection of an attention layer, behind the layer's input norm.

    Under tensor parallelism each rank has `num_heads` query heads and `num_kv_heads` key/value
    heads of its own; when the model has fewer key/value heads than ranks, each rank holds the
    one its query heads attend to (a head is replicated on `tp / kv_heads` ranks).
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
        tp: TPGroup | None = None,
    ) -> None:  # fmt: skip
        kv = num_kv_heads * head_dim
        shards = {"q": num_heads * head_dim, "k": kv, "v": kv}
        super().__init__(hidden_size, shards, bias, input_kind="normed", tp=tp)
        self.head_dim = head_dim

    def _first_row(self, loaded: TensorSource, shard: str, size: int) -> int | None:
        if shard == "q" or not loaded.shape:
            return None
        # Rank r's key/value heads start at head r * kv_heads / tp (rounded down): the rank's
        # own heads when they divide, else the one head its query heads share.
        tp, heads = self.tp.size, loaded.shape[0] // self.head_dim
        fits = loaded.shape[0] == heads * self.head_dim and (
            heads * self.head_dim == size * tp or (tp % heads == 0 and size == self.head_dim)
        )
        return self.tp.rank * heads // tp * self.head_dim if fits else None
