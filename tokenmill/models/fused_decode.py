"""A dense Llama-family model's decoder layers in one launch, for steps of a few query tokens of
one sequence (decode, speculative verify; `kernels/decode_layer.py`; `--fused-decode-layer`)."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.triton_backend import TritonAttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.kernels.decode_layer import (
    MAX_TOKENS,
    DecodeLayerKernel,
    DecodeLayerWeights,
    DecodeStep,
    LayerDims,
)


def fused_decode_refusal(model: torch.nn.Module, backend: AttentionBackend) -> str | None:
    """Why `model` served by `backend` cannot run fused decode layers, or None if it can."""
    from tokenmill.models.llama import LlamaForCausalLM, LlamaMLP

    cfg: ModelConfig = model.config
    reasons = {
        "the model is not a dense Llama-family text model": type(model) is not LlamaForCausalLM
        or not all(isinstance(layer.mlp, LlamaMLP) for layer in model.model.layers),
        "it needs the triton attention backend": not isinstance(backend, TritonAttentionBackend),
        "it is not batch-invariant (deterministic mode)": backend.deterministic,
        "the model has a sliding window": cfg.sliding_window is not None,
        "the model's o projection has a bias": cfg.o_proj_bias,
        "it runs on one device": model.model.layers[0].self_attn.tp.size > 1,
    }
    return next((reason for reason, refused in reasons.items() if refused), None)


class FusedDecodeLayers:
    """Every decoder layer of a `LlamaModel` through `DecodeLayerKernel` (`programs` programs),
    for a step whose attention backend planned one decoding sequence."""

    def __init__(
        self, model: torch.nn.Module, backend: TritonAttentionBackend, programs: int
    ) -> None:
        cfg: ModelConfig = model.config
        self.backend = backend
        self.rotary = model.model.rotary
        layers = [
            _layer_weights(layer, *backend.layer_cache(index))
            for index, layer in enumerate(model.model.layers)
        ]
        dims = LayerDims(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.rms_norm_eps, backend.kv_cache.page_size,
        )  # fmt: skip
        self.kernel = DecodeLayerKernel(dims, layers, programs)

    def serves(self, input_ids: torch.Tensor) -> bool:
        """Whether the step computes 1 to MAX_TOKENS query tokens of one sequence (a decode
        step, a speculative verify step, a short chunk; else the layers run as modules)."""
        inputs = self.backend.one_sequence_step(MAX_TOKENS)
        return inputs is not None and input_ids.shape[0] == inputs.query_lens_cpu[0]

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x, residual)` after every layer, as the modules would return them, for the
        embedded query tokens `x` `[M, H]` at `positions` `[M]` of a step `serves` took."""
        inputs = self.backend.one_sequence_step(MAX_TOKENS)
        assert inputs is not None
        step = DecodeStep(
            positions=positions, slots=inputs.slot_mapping, kv_lens=inputs.kv_lens,
            page_table=inputs.page_table, cos=self.rotary.cos, sin=self.rotary.sin,
        )  # fmt: skip
        return self.kernel.run(x, step)


def _layer_weights(
    layer: torch.nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> DecodeLayerWeights:
    attn = layer.self_attn
    q_norm = attn.q_norm.weight if attn.qk_norm else None
    k_norm = attn.k_norm.weight if attn.qk_norm else None
    return DecodeLayerWeights(
        qkv=attn.qkv_proj.weight, qkv_bias=attn.qkv_proj.bias, o=attn.o_proj.weight,
        gate_up=layer.mlp.gate_up_proj.weight, down=layer.mlp.down_proj.weight,
        input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
        q_norm=q_norm, k_norm=k_norm, k_cache=k_cache, v_cache=v_cache,
    )  # fmt: skip
