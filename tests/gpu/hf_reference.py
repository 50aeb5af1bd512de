"""transformers' greedy continuations on a device: the reference the GPU tests compare with."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def hf_greedy_on(
    path: Path,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cuda",
) -> list[list[int]]:
    """transformers `generate` of each prompt on `device`, greedy, EOS ignored: the tokens
    after the prompt."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False)  # fmt: skip
        outs.append(out[0, len(p) :].tolist())
    return outs
