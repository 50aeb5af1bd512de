"""Architecture name (config.json `architectures`) → model class."""

from __future__ import annotations

from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.qwen3_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    """The implementation of `cfg.architecture`."""
    if cfg.architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported architecture {cfg.architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[cfg.architecture]
