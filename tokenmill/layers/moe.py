"""Mixture-of-experts feed-forward: E SwiGLU experts held as two stacked weights.

`FusedMoE` takes the router's logits and returns the weighted sum of each token's top-k
experts. On CUDA Triton kernels do it (`kernels/fused_moe.py`: for decode batches of a few
tokens two GEMV kernels that route each token themselves and apply the RMSNorm in front of the
layer as they load its input, else a sort by expert and two grouped GEMMs); elsewhere a torch
reference loops over the experts that have tokens. Checkpoints store each
expert's projections separately (`experts.N.gate_proj`, ...); the loader copies them into the
stacked weights through `weight_loader`, with shards named `"<gate|up|down>:<N>"`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.distributed.group import TPGroup
from tokenmill.kernels import InputNorm, fused_moe
from tokenmill.kernels.moe_routing import GEMV_MAX_TOKENS, select_experts
from tokenmill.layers.invariant import invariant_linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.sharding import SourceRange, TensorSource, TransposedSource, copy_shard

EXPERT_PROJECTIONS = ("gate", "up", "down")


class FusedMoE(nn.Module):
    """`num_experts` SwiGLU MLPs `hidden → intermediate → hidden`: `gate_up_proj`
    `[E, 2 I, H]` (each expert's gate rows, then its up rows) and `down_proj` `[E, H, I]` (the
    layout of transformers' fused `Qwen3MoeExperts`, so such checkpoints load as they are).
    Tokens go to their `top_k` most probable experts (softmax over the router logits; the
    chosen probabilities renormalised to sum to 1 when `renormalize`).

    Under tensor parallelism `tp`, `intermediate_size` is this rank's slice of every expert's
    (rank r holds entries `r * intermediate_size ..`), and the output is this rank's part of
    the sum."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int,
        renormalize: bool, tp: TPGroup | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size, self.tp = intermediate_size, tp or TPGroup.single()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.batch_invariant = False  # deterministic mode: see `fused_moe`, `invariant_linear`

    def forward(
        self, x: torch.Tensor, router_logits: torch.Tensor, norm: RMSNorm | None = None
    ) -> torch.Tensor:
        """The experts' weighted output `[T, H]` for `x` `[T, H]` and `router_logits` `[T, E]`;
        with `norm`, of `norm(x)` (applied inside the expert kernels where `norms_input`)."""
        if x.is_cuda:
            inputs = InputNorm(norm.weight, norm.eps, None) if norm is not None else None
            return fused_moe(
                x, self.gate_up_proj, self.down_proj, router_logits, self.top_k, self.renormalize,
                batch_invariant=self.batch_invariant, norm=inputs,
            )  # fmt: skip
        h = norm(x) if norm is not None else x
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        linear = invariant_linear if self.batch_invariant else F.linear
        return experts_reference(h, self.gate_up_proj, self.down_proj, weights, ids, linear)

    def norms_input(self, x: torch.Tensor) -> bool:
        """Whether `forward(x, logits, norm)` applies the norm inside its expert kernels (CUDA
        batches of the GEMV path), so that the normed input need not be written out."""
        return x.is_cuda and not self.batch_invariant and x.shape[0] <= GEMV_MAX_TOKENS

    def checkpoint_shards(self, param_name: str) -> list[str]:
        """The shards a checkpoint provides for one of the stacked weights, one per expert
        and projection (`weight_loader`'s names)."""
        kinds = ("gate", "up") if param_name == "gate_up_proj" else ("down",)
        return [f"{kind}:{e}" for kind in kinds for e in range(self.num_experts)]

    def weight_loader(self, param: nn.Parameter, loaded: TensorSource, shard: str) -> None:
        """Copy this rank's slice of one expert's projection (`shard` = `"gate:3"`, `"up:3"`,
        `"down:3"`) into the stacked `param`."""
        kind, _, index = shard.partition(":")
        expert = int(index)
        if kind not in EXPERT_PROJECTIONS or not 0 <= expert < self.num_experts:
            raise ValueError(f"no expert shard {shard!r} in a layer of {self.num_experts} experts")
        i = self.intermediate_size
        target = {"gate": param.data[expert, :i], "up": param.data[expert, i:]}.get(
            kind, param.data[expert]
        )
        dim = 1 if kind == "down" else 0  # down: [H, I], gate and up: [I, H]
        copy_shard(target, loaded, dim, self.tp, f"expert shard {shard!r}")

    def load_stacked(self, param: nn.Parameter, loaded: TensorSource) -> None:
        """Copy this rank's slice of a checkpoint's already stacked `gate_up_proj` `[E, 2I, H]`
        or `down_proj` `[E, H, I]` (transformers' fused layout) into `param`; the hub's
        Qwen3-VL-MoE checkpoints hold them transposed (`[E, H, 2I]`, `[E, I, H]`)."""
        i, hidden = self.intermediate_size, self.down_proj.shape[1]
        hidden_dim = 2 if param is self.gate_up_proj else 1  # where ours keeps the hidden size
        shape = loaded.shape
        if len(shape) == 3 and shape[hidden_dim] != hidden and shape[3 - hidden_dim] == hidden:
            loaded = TransposedSource(loaded)
        if param is self.down_proj:
            copy_shard(param.data, loaded, 2, self.tp, "down_proj")
            return
        full = loaded.shape[1] // 2 if len(loaded.shape) == 3 else 0
        gate, up = SourceRange(loaded, 1, 0, full), SourceRange(loaded, 1, full, 2 * full)
        copy_shard(param.data[:, :i], gate, 1, self.tp, "gate_up_proj (gate)")
        copy_shard(param.data[:, i:], up, 1, self.tp, "gate_up_proj (up)")


def experts_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> torch.Tensor:
    """The experts' weighted sum in torch, one matmul pair per expert that has tokens (the CPU
    path; like transformers', each product is rounded to `x`'s dtype); `linear` computes the
    products (`invariant_linear` in deterministic mode). A token's experts are added in
    expert order, whatever the batch."""
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    weights = topk_weights.reshape(-1).to(x.dtype)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // topk_ids.shape[1]
        gate, up = linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, down[expert]) * weights[pairs, None]
        out.index_add_(0, tokens, y)
    return out
