"""Speculative decoding on a CUDA GPU: greedy equality with plain decoding in float32 (CUDA
graphs for the plain steps, triton attention for the verifies), both proposers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [list(range(3, 10)), [11, 12, 13, 14] * 3, list(range(20, 77)), [7] * 33 + [9]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _spec(method: str, k: int, draft: Path | None) -> str:
    if method == "ngram":
        return json.dumps({"method": "ngram", "num_speculative_tokens": k,
                           "prompt_lookup_min": 1, "prompt_lookup_max": 3})  # fmt: skip
    return json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": k})


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(("method", "k"), [("ngram", 3), ("draft_model", 1), ("draft_model", 4)])
@pytest.mark.parametrize("setting", [{}, {"page_size": 1}, {"enforce_eager": True}])
def test_float32_greedy_with_speculation_equals_plain_on_gpu(
    checkpoints: dict[str, Path], family: str, method: str, k: int, setting: dict
) -> None:
    path = checkpoints[family]
    plain = LLM(str(path), device="cuda", dtype="float32", **setting)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # The target drafts for itself: nearly every draft is accepted.
    llm = LLM(str(path), device="cuda", dtype="float32",
              speculative_config=_spec(method, k, path), **setting)  # fmt: skip
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0
    if method == "draft_model":
        assert stats.acceptance_rate > 0.9
    assert llm.engine.cache.num_used_pages == 0
