"""A Llama-family model's decoder layers (dense, or Qwen3-MoE's experts) in one launch, for steps
of a few query tokens of one sequence (decode, speculative verify; `kernels/decode_layer.py`;
`--fused-decode-layer`)."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionInputs
from tokenmill.attention.triton_backend import TritonAttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.kernels.decode_layer import (
    MAX_TOKENS,
    DecodeLayerKernel,
    DecodeLayerWeights,
    DecodeStep,
    LayerDims,
)
from tokenmill.kernels.pdl import interpreted


def fused_decode_refusal(model: torch.nn.Module, backend: AttentionBackend) -> str | None:
    """Why `model` served by `backend` cannot run fused decode layers, or None if it can."""
    cfg: ModelConfig = model.config
    reasons = {
        "the model is neither a dense Llama-family text model nor a Qwen3-MoE whose every "
        "layer is sparse": _feed_forward(model) is None,
        "it needs the triton attention backend": not isinstance(backend, TritonAttentionBackend),
        "it is not batch-invariant (deterministic mode)": backend.deterministic,
        "the model has a sliding window": cfg.sliding_window is not None,
        "the model's o projection has a bias": cfg.o_proj_bias,
        "it needs tensor_parallel_size=1": model.model.layers[0].self_attn.tp.size > 1,
        "it needs a CUDA device (or Triton's interpreter, TRITON_INTERPRET=1)": (
            next(model.parameters()).device.type != "cuda" and not interpreted()
        ),
    }
    return next((reason for reason, refused in reasons.items() if refused), None)


def _feed_forward(model: torch.nn.Module) -> str | None:
    """ "dense" (every layer a SwiGLU MLP), "experts" (every layer a mixture of experts
    without a shared expert) or None (another model or mix)."""
    from tokenmill.models.llama import LlamaForCausalLM, LlamaMLP
    from tokenmill.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock

    mlps = [layer.mlp for layer in model.model.layers]
    if type(model) is LlamaForCausalLM and all(isinstance(m, LlamaMLP) for m in mlps):
        return "dense"
    sparse = all(isinstance(m, SparseMoeBlock) and m.shared_expert is None for m in mlps)
    return "experts" if type(model) is Qwen3MoeForCausalLM and sparse else None


class FusedDecodeLayers:
    """Every decoder layer of a `LlamaModel` through `DecodeLayerKernel` (`programs` programs),
    for a step whose attention backend planned a few query tokens of one sequence (one, for
    a mixture of experts)."""

    def __init__(
        self, model: torch.nn.Module, backend: TritonAttentionBackend, programs: int
    ) -> None:
        cfg: ModelConfig = model.config
        self.backend = backend
        self.rotary = model.model.rotary
        self.experts = _feed_forward(model) == "experts"
        layers = [
            _layer_weights(layer, *backend.layer_cache(index), self.experts)
            for index, layer in enumerate(model.model.layers)
        ]
        moe = cfg.moe if self.experts else None
        dims = LayerDims(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            moe.intermediate_size if moe else cfg.intermediate_size, cfg.rms_norm_eps,
            backend.kv_cache.page_size, moe.num_experts if moe else 0, moe.top_k if moe else 0,
            moe.norm_topk_prob if moe else False,
        )  # fmt: skip
        self.kernel = DecodeLayerKernel(dims, layers, programs)

    def step_inputs(self, input_ids: torch.Tensor) -> AttentionInputs | None:
        """The planned step's inputs if it computes 1 to MAX_TOKENS query tokens of one
        sequence (a decode step, a speculative verify step, a short chunk; one for a mixture
        of experts), else None (the layers run as modules)."""
        inputs = self.backend.one_sequence_step(1 if self.experts else MAX_TOKENS)
        served = inputs is not None and input_ids.shape[0] == inputs.query_lens_cpu[0]
        return inputs if served else None

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, inputs: AttentionInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x, residual)` after every layer, as the modules would return them, for the
        embedded query tokens `x` `[M, H]` at `positions` `[M]` of a step whose `inputs`
        `step_inputs` returned."""
        step = DecodeStep(
            positions=positions, slots=inputs.slot_mapping, kv_lens=inputs.kv_lens,
            page_table=inputs.page_table, cos=self.rotary.cos, sin=self.rotary.sin,
        )  # fmt: skip
        return self.kernel.run(x, step)


def _layer_weights(
    layer: torch.nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor, experts: bool
) -> DecodeLayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    q_norm = attn.q_norm.weight if attn.qk_norm else None
    k_norm = attn.k_norm.weight if attn.qk_norm else None
    if experts:
        gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj
        router = mlp.gate.weight
    else:
        gate_up, down, router = mlp.gate_up_proj.weight, mlp.down_proj.weight, None
    return DecodeLayerWeights(
        qkv=attn.qkv_proj.weight, qkv_bias=attn.qkv_proj.bias, o=attn.o_proj.weight,
        gate_up=gate_up, down=down, input_norm=layer.input_layernorm.weight,
        post_norm=layer.post_attention_layernorm.weight, q_norm=q_norm, k_norm=k_norm,
        k_cache=k_cache, v_cache=v_cache, router=router,
    )  # fmt: skip
