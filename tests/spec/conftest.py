"""Draft checkpoints for speculative decoding: tiny models sharing the target's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="session")
def draft_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `llama_dir` target without its last layer: another model that agrees with the
    target on some tokens, not all (drafts are both accepted and rejected)."""
    path = tmp_path_factory.mktemp("draft") / "llama"
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:-1]
    model.config.num_hidden_layers = len(model.model.layers)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (llama_dir / name).exists():
            shutil.copy(llama_dir / name, path / name)
    return path
