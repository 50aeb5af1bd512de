"""`tokenmill eval dummy-checkpoint`: random weights that transformers and tokenmill both load."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill.config import ModelConfig
from tokenmill.entrypoints.cli import main
from tokenmill.models.loader import load_model


def test_dummy_checkpoint_loads_in_transformers_and_tokenmill(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "dummy"
    argv = ["eval", "dummy-checkpoint", "--config", str(llama_dir), "--output", str(out),
            "--dtype", "bfloat16", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    params = dict(model.named_parameters())
    assert torch.all(params["model.norm.weight"] == 1)
    std = float(params["model.layers.0.mlp.up_proj.weight"].detach().float().std())
    assert abs(std - 0.1) < 0.01  # the config's initializer_range
    assert len(AutoTokenizer.from_pretrained(out)) > 0  # the demo model's tokenizer, copied
    ours = load_model(ModelConfig.from_pretrained(out), torch.device("cpu"), "auto", seed=0)
    embed = dict(ours.named_parameters())["model.embed_tokens.weight"]
    assert torch.equal(embed, params["model.embed_tokens.weight"])
