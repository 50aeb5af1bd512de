"""The conformance reference: transformers on the same checkpoint, scoring given token ids."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tokenmill.config import parse_dtype


class Reference:
    """A transformers model that gives the log-probabilities of every vocabulary token at the
    positions of a sequence's generated tokens (teacher-forced on the server's tokens)."""

    def __init__(self, model_dir: str, dtype: str = "float32", device: str | None = None) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = parse_dtype(dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=self.dtype, device_map=None
        ).to(self.device)
        self.model.eval()

    @torch.no_grad()
    def logprobs(self, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        """`[len(output_ids), vocab]` float32 log-softmax: row t is the distribution of the token
        after `prompt_ids + output_ids[:t]`, on the CPU."""
        n = len(output_ids)
        vocab = self.model.get_input_embeddings().num_embeddings
        if max(prompt_ids + output_ids, default=0) >= vocab:
            raise ValueError(
                f"model: the server's token ids go up to {max(prompt_ids + output_ids)}, beyond "
                f"this checkpoint's {vocab}-token vocabulary: is --model the served checkpoint?"
            )
        ids = torch.tensor([prompt_ids + output_ids[:-1]], device=self.device)
        logits = self.model(input_ids=ids, logits_to_keep=n).logits[0, -n:]
        return torch.log_softmax(logits.float(), dim=-1).cpu()
