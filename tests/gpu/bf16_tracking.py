"""bf16 engine output against the float32 transformers reference, next to transformers' own bf16
forward of the same sequences (the peer): what bf16 rounding alone costs on that model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tokenmill.outputs import RequestOutput

# A position is "clear" where the reference's top-2 margin exceeds this (nats): bf16 rounding
# may flip nearer ties.
CLEAR_MARGIN = 0.1


@dataclass
class Tracking:
    """Per generated position: whether the reference's top-1 is the engine's token (and the
    peer's), where the reference is clear, and |logprob - reference| of the engine's token for
    the engine and for the peer."""

    total: int = 0
    agree: int = 0
    peer_agree: int = 0
    clear: int = 0
    clear_agree: int = 0
    peer_clear_agree: int = 0
    errors: list[float] = field(default_factory=list)
    peer_errors: list[float] = field(default_factory=list)

    @property
    def median_error(self) -> float:
        return sorted(self.errors)[len(self.errors) // 2]

    @property
    def peer_median_error(self) -> float:
        return sorted(self.peer_errors)[len(self.peer_errors) // 2]


def track(path: Path, prompts: list[list[int]], outputs: list[RequestOutput]) -> Tracking:
    """Score greedy `outputs` (with logprobs) of `prompts` against the float32 and bf16
    transformers forwards of the same sequences, on the GPU."""
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    peer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    t = Tracking()
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = out.outputs[0].token_ids
        ids = torch.tensor([prompt + tokens], device="cuda")
        with torch.no_grad():
            ref = torch.log_softmax(ref_model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
            bf16 = torch.log_softmax(peer(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        for i, token in enumerate(tokens):
            top2 = ref[i].topk(2).values
            best = int(ref[i].argmax())
            t.total += 1
            t.agree += best == token
            t.peer_agree += best == int(bf16[i].argmax())
            if top2[0] - top2[1] > CLEAR_MARGIN:
                t.clear += 1
                t.clear_agree += best == token
                t.peer_clear_agree += best == int(bf16[i].argmax())
            t.errors.append(abs(out.outputs[0].logprobs[i][token].logprob - ref[i, token].item()))
            t.peer_errors.append(abs(bf16[i, token].item() - ref[i, token].item()))
    return t
