"""Architecture name (config.json `architectures`) → model class."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: tokenmill.config reads this registry at import time
    from torch import nn

    from tokenmill.config import ModelConfig

# Architecture -> "module:class" of its implementation, imported on first use, so that this table
# (the one list of supported architectures) is importable from `tokenmill.config` without the
# model code.
MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "tokenmill.models.qwen3_moe:Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM": "tokenmill.models.qwen3_moe:Qwen2MoeForCausalLM",
    "Qwen3VLForConditionalGeneration": "tokenmill.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration": (
        "tokenmill.models.qwen3_vl:Qwen3VLMoeForConditionalGeneration"
    ),
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    """The implementation of `cfg.architecture`."""
    if cfg.architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported architecture {cfg.architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        )
    module, name = MODEL_REGISTRY[cfg.architecture].split(":")
    return getattr(importlib.import_module(module), name)
