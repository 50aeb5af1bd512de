"""Speculative decoding on a CUDA GPU: greedy equality with plain decoding in float32, both
proposers, k = 1..5, verify steps and greedy drafting through CUDA graphs (and eager)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [list(range(3, 10)), [11, 12, 13, 14] * 3, list(range(20, 77)), [7] * 33 + [9]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _spec(method: str, k: int, draft: Path | None, adaptive: bool = False) -> str:
    """k drafts whenever there are drafts unless `adaptive` (every k's graphs are exercised)."""
    if method == "ngram":
        return json.dumps({"method": "ngram", "num_speculative_tokens": k, "adaptive": adaptive,
                           "prompt_lookup_min": 1, "prompt_lookup_max": 3})  # fmt: skip
    return json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
                       "adaptive": adaptive})  # fmt: skip


CASES = [(m, k, {}) for m in ("ngram", "draft_model") for k in range(1, 6)]
SETTINGS = ({"page_size": 1}, {"enforce_eager": True})
CASES += [(m, 3, s) for m in ("ngram", "draft_model") for s in SETTINGS]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(("method", "k", "setting"), CASES)
def test_float32_greedy_with_speculation_equals_plain_on_gpu(
    checkpoints: dict[str, Path], family: str, method: str, k: int, setting: dict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from tokenmill.runner.cuda_graphs import CudaGraphRunner, DraftLoopGraphs

    replays = {"verify": 0, "loop": 0}
    run_verify, run_loop = CudaGraphRunner.run_verify, DraftLoopGraphs.run

    def count_verify(self, key, num_tokens):  # type: ignore[no-untyped-def]
        replays["verify"] += self.with_logits  # the target's, not the draft's mirror
        return run_verify(self, key, num_tokens)

    def count_loop(self, batch):  # type: ignore[no-untyped-def]
        replays["loop"] += 1
        return run_loop(self, batch)

    monkeypatch.setattr(CudaGraphRunner, "run_verify", count_verify)
    monkeypatch.setattr(DraftLoopGraphs, "run", count_loop)
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
    if not setting.get("enforce_eager"):
        assert replays["verify"] > 0
        assert replays["loop"] > 0 or method == "ngram"


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_float32_greedy_with_adaptive_speculation_equals_plain_on_gpu(
    checkpoints: dict[str, Path], method: str
) -> None:
    """Adaptive speculation with the cost measured on the GPU (CUDA graphs): rows with
    different numbers of drafts share verify graphs, plain steps overlap; tokens unchanged."""
    path = checkpoints["llama"]
    prompts = PROMPTS * 8  # a batch of 32: larger steps too
    plain = LLM(str(path), device="cuda", dtype="float32")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(str(path), device="cuda", dtype="float32",
              speculative_config=_spec(method, 4, path, adaptive=True))  # fmt: skip
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.scheduler.spec_stats.chosen_drafts.count > 0
    assert llm.engine.cache.num_used_pages == 0


def test_float32_greedy_with_penalties_bad_words_and_the_draft_model_equals_plain_on_gpu(
    checkpoints: dict[str, Path],
) -> None:
    """The draft model drafts for penalised requests in the loop graph; each verify position
    counts the drafts before it on the device, so the tokens are plain decoding's."""
    path = checkpoints["llama"]
    plain = LLM(str(path), device="cuda", dtype="float32")
    free = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # The last row: a bad word of two tokens inside its first verify window (its bans follow
    # the drafts, copied to the host behind the draft loop graph).
    settings = [{"repetition_penalty": 2.0}, {"frequency_penalty": 1.5},
                {"presence_penalty": 1.0, "repetition_penalty": 1.3},
                {"bad_words_token_ids": [free[3][2:4]]}]  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, **s)
              for s in settings]  # fmt: skip
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert expected[3][2:4] != free[3][2:4]
    llm = LLM(str(path), device="cuda", dtype="float32",
              speculative_config=_spec("draft_model", 3, path))  # fmt: skip
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
