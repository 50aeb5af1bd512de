"""The Llama family: Llama (incl. 3.x rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.distributed.group import TPGroup
from tokenmill.layers.linear import InputKind, Linear, MergedLinear, QKVLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.sharding import VocabParallelEmbedding


class LlamaAttention(nn.Module):
    """Self-attention: fused q/k/v projection, optional q/k norm, rotary, paged attention.

    Under tensor parallelism `cfg` is this rank's (`ModelConfig.shard`: its heads) and the
    output projection's partial sums are added over the ranks."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.layer, self.tp = layer, tp
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv_proj = QKVLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias,
            tp,
        )  # fmt: skip
        self.o_proj = Linear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, tp_dim=1
        )
        self.rotary = rotary
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        attn: AttentionBackend,
        rotary: RotaryEmbedding | None = None,
    ) -> torch.Tensor:
        """Attention output (after `o_proj`) of the projected `qkv` of every token, rotated by
        `rotary` (a step's own rows, e.g. multimodal positions) or the model's table."""
        qk_norm = (self.q_norm, self.k_norm) if self.qk_norm else None
        rotary = self.rotary if rotary is None else rotary
        q = attn.store_qkv(qkv, positions, self.layer, rotary, qk_norm)
        out = attn.attend(q, self.layer)
        partial = self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))
        return self.o_proj.add_bias(self.tp.all_reduce(partial))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward of `intermediate_size` (default: the model's): fused gate/up
    projection behind the decoder layer's post-attention norm (or, `input_kind="plain"`, of an
    input normed already: `product`), then the down projection, which applies SiLU-and-mul to
    its input. Under tensor parallelism the sizes are this rank's and `forward` adds the
    ranks' partial outputs (`product` leaves that to its caller)."""

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, intermediate_size: int | None = None,
        input_kind: InputKind = "normed",
    ) -> None:  # fmt: skip
        super().__init__()
        self.tp = tp
        size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size, {"gate": size, "up": size}, input_kind=input_kind, tp=tp
        )
        self.down_proj = Linear(size, cfg.hidden_size, input_kind="gated", tp_dim=1)

    def fuse_swiglu(self) -> None:
        """Deterministic mode: interleave the gate/up rows (gate j, up j, ...) so the
        batch-invariant gate/up product applies SiLU-and-mul itself (on CUDA as it stores its
        result: bitwise what `silu_and_mul` of the plain product gives, one kernel fewer a
        layer); the down projection then takes its input as it is."""
        weight = self.gate_up_proj.weight
        size = weight.shape[0] // 2
        weight.data = weight.data.view(2, size, -1).transpose(0, 1).reshape(2 * size, -1)
        self.gate_up_proj.swiglu = True
        self.down_proj.input_kind = "plain"

    def product(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP of `h`, normed already (this rank's part of it)."""
        return self.down_proj(self.gate_up_proj(h))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(mlp(norm(x + residual)), x + residual)`; the add + norm runs inside the gate/up
        projection (`Linear.forward_normed`)."""
        gate_up, residual = self.gate_up_proj.forward_normed(x, residual, norm)
        return self.tp.all_reduce(self.down_proj(gate_up)), residual


# The feed-forward of decoder layer `layer` on one rank: called as `mlp(x, residual, norm)`,
# returning `(mlp(norm(x + residual)), x + residual)` like `LlamaMLP`.
MlpFactory = Callable[[ModelConfig, int, TPGroup], nn.Module]


def dense_mlp(cfg: ModelConfig, layer: int, tp: TPGroup) -> nn.Module:
    """Every layer of a dense model has the same SwiGLU MLP."""
    return LlamaMLP(cfg, tp)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block; each residual add + norm is fused into the projection after it
    (`Linear.forward_normed`: one GEMV kernel where chosen, else the fused add+norm kernel).
    The feed-forward is `mlp` (a `LlamaMLP`, or a mixture of experts)."""

    def __init__(
        self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, mlp: nn.Module, tp: TPGroup
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer, rotary, tp)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        attn: AttentionBackend,
        rotary: RotaryEmbedding | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn_in = self.self_attn.qkv_proj
        qkv, residual = attn_in.forward_normed(x, residual, self.input_layernorm)
        x = self.self_attn(positions, qkv, attn, rotary)
        return self.mlp(x, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    """Embedding, decoder layers (feed-forward `make_mlp(cfg, layer, tp)`) and final norm."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPGroup,
        make_mlp: MlpFactory = dense_mlp,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        if rotary is None:
            rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        self.rotary = rotary
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, rotary, make_mlp(cfg, i, tp), tp)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, attn)
        x, _ = self.norm.add_forward(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder over a flattened batch of tokens with paged attention.

    Subclasses change the feed-forward through `make_mlp` (e.g. a mixture of experts). Under
    tensor parallelism (`tp` of several ranks) `cfg` is this rank's share (`ModelConfig.shard`),
    the vocabulary is split by rows and every rank gets the whole logits.
    """

    # checkpoint name fragment → (our parameter fragment, shard id)
    stacked_params: ClassVar[dict[str, tuple[str, str]]] = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", "gate"),
        ".up_proj.": (".gate_up_proj.", "up"),
    }
    # checkpoint name of an expert's projection → our shard kind (mixture-of-experts models)
    expert_params: ClassVar[dict[str, str]] = {}
    make_mlp: ClassVar[MlpFactory] = staticmethod(dense_mlp)

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup | None = None, rotary: RotaryEmbedding | None = None
    ) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        self.config = cfg
        self.model = LlamaModel(cfg, tp, self.make_mlp, rotary)
        if cfg.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` of the flattened batch `input_ids` `[T]`."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits for the selected hidden states."""
        return self.lm_head.logits(hidden)
