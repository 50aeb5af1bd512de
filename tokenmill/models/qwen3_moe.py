"""Qwen3-MoE (the Qwen3 decoder, q/k norm, with a mixture of experts in its sparse layers) and
Qwen2-MoE (the Qwen2 decoder, q/k/v bias, whose experts come with a gated shared expert)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tokenmill.config import ModelConfig, MoeConfig
from tokenmill.distributed.group import TPGroup
from tokenmill.layers.invariant import invariant_pointwise
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe import FusedMoE
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.llama import LlamaForCausalLM, LlamaMLP


class SparseMoeBlock(nn.Module):
    """Router (`gate`: hidden → one logit per expert) and the experts it routes to; with
    `moe.shared_expert_intermediate_size`, also a shared expert every token passes, scaled by
    `sigmoid(shared_expert_gate(h))`. Under tensor parallelism every rank routes every token
    and holds a slice of each expert's intermediate size (`moe` is this rank's); the partial
    outputs are added over the ranks once, at the end."""

    def __init__(self, cfg: ModelConfig, moe: MoeConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        # Without a shared expert (which needs the normed input) small batches run the router
        # behind the layer's norm (`forward`): its GEMV may add the residual and norm.
        router_input = "plain" if moe.shared_expert_intermediate_size else "normed"
        self.gate = Linear(cfg.hidden_size, moe.num_experts, input_kind=router_input)
        self.experts = FusedMoE(
            moe.num_experts, cfg.hidden_size, moe.intermediate_size, moe.top_k,
            moe.norm_topk_prob, tp,
        )  # fmt: skip
        self.shared_expert: LlamaMLP | None = None
        if moe.shared_expert_intermediate_size:
            size = moe.shared_expert_intermediate_size
            self.shared_expert = LlamaMLP(cfg, tp, size, input_kind="plain")
            self.shared_expert_gate = Linear(cfg.hidden_size, 1)
        self.batch_invariant = False  # deterministic mode: the gate's sigmoid at any size

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(moe(norm(x + residual)), x + residual)`, as `LlamaMLP`. Decode batches on the GPU
        never write the normed input out: the router's GEMV adds the residual and norms as it
        reads (`Linear.forward_normed`), the experts' gate/up kernel norms the sum again as it
        loads it. Otherwise (and with a shared expert) the add + norm runs once, on its own,
        and the router and the experts read its output."""
        if self.gate.input_kind == "normed" and self.experts.norms_input(x):
            logits, residual = self.gate.forward_normed(x, residual, norm)
            return self.tp.all_reduce(self.experts(residual, logits, norm)), residual
        if residual is None:
            h, residual = norm(x), x
        else:
            h, residual = norm.add_forward(x, residual)
        out = self.experts(h, self.gate(h))
        if self.shared_expert is not None:
            shared = self.shared_expert.product(h)
            logit = self.shared_expert_gate(h)
            if self.batch_invariant:
                scale = invariant_pointwise(torch.sigmoid, logit)
            else:
                scale = torch.sigmoid(logit)
            out = out + scale * shared
        return self.tp.all_reduce(out), residual


def sparse_or_dense_mlp(cfg: ModelConfig, layer: int, tp: TPGroup) -> nn.Module:
    """A sparse layer's mixture of experts, or the dense MLP of an `mlp_only_layers` entry (or
    a layer skipped by `decoder_sparse_step`)."""
    if cfg.moe is None:
        raise ValueError(f"{cfg.architecture} needs the mixture-of-experts fields in config.json")
    return SparseMoeBlock(cfg, cfg.moe, tp) if cfg.moe.is_sparse(layer) else LlamaMLP(cfg, tp)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3 with `mlp.experts.N.{gate,up,down}_proj` experts and an `mlp.gate` router."""

    expert_params: ClassVar[dict[str, str]] = {
        "gate_proj": "gate",
        "up_proj": "up",
        "down_proj": "down",
    }
    make_mlp = staticmethod(sparse_or_dense_mlp)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2-MoE: the same checkpoint names, plus `mlp.shared_expert.{gate,up,down}_proj` and
    `mlp.shared_expert_gate` (the architecture differs in config only: q/k/v bias, no q/k
    norm, a shared expert size)."""
