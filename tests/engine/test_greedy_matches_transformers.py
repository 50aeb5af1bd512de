"""Greedy decoding equals transformers' `generate`, token for token, under every engine setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FAMILIES, hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.testing.checkpoints import build_checkpoint

PROMPTS = [
    list(range(3, 10)),
    list(range(20, 77)),
    [100, 200, 300],
    [7] * 33 + [9],
    [42],
]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {f: [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS] for f, path in checkpoints.items()}


def _greedy_tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_prompts_matches_transformers(
    family: str, checkpoints: dict[str, Path], references: dict[str, list[list[int]]]
) -> None:
    llm = LLM(str(checkpoints[family]), device="cpu")
    assert _greedy_tokens(llm) == references[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_batch_size_matches_transformers(
    family: str, checkpoints: dict[str, Path], references: dict[str, list[list[int]]]
) -> None:
    llm = LLM(str(checkpoints[family]), device="cpu")
    for size in range(1, len(PROMPTS) + 1):
        outputs = llm.generate(PROMPTS[:size], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == references[family][:size]


CONSTRAINED = {
    "no_overlap_scheduling": {"overlap_scheduling": False},
    "no_overlap_tiny_pool_preempts": {
        "overlap_scheduling": False,
        "page_size": 4,
        "num_pages": 24,
        "max_model_len": 96,
    },
    "chunked_prefill_budget_8": {"max_num_batched_tokens": 8},
    "chunked_prefill_budget_1": {"max_num_batched_tokens": 1},
    "page_size_1": {"page_size": 1},
    "page_size_16": {"page_size": 16},
    "one_seq_at_a_time": {"max_num_seqs": 1},
    "tiny_pool_preempts": {"page_size": 4, "num_pages": 24, "max_model_len": 96},
    "tiny_pool_preempts_no_prefix_cache": {
        "page_size": 4,
        "num_pages": 24,
        "max_model_len": 96,
        "enable_prefix_caching": False,
    },
    "tiny_pool_chunked": {
        "page_size": 2,
        "num_pages": 48,
        "max_model_len": 96,
        "max_num_batched_tokens": 5,
    },
}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("setting", list(CONSTRAINED))
def test_constrained_engine_matches_transformers(
    family: str,
    setting: str,
    checkpoints: dict[str, Path],
    references: dict[str, list[list[int]]],
) -> None:
    llm = LLM(str(checkpoints[family]), device="cpu", **CONSTRAINED[setting])
    assert _greedy_tokens(llm) == references[family]
    if "preempts" in setting:
        assert llm.engine.scheduler.stats.num_preemptions > 0


def test_preempted_request_resumes_with_same_tokens(
    llama_dir: Path, references: dict[str, list[list[int]]]
) -> None:
    llm = LLM(str(llama_dir), device="cpu", page_size=4, num_pages=24, max_model_len=96)
    assert _greedy_tokens(llm) == references["llama"]
    preempted = llm.engine.scheduler.stats.num_preemptions
    assert preempted > 0
    # Nothing leaked: every page is free or cached without a user.
    cache = llm.engine.cache
    assert cache.num_used_pages == 0


@pytest.mark.parametrize("setting", ["default", "chunked_prefill_budget_8", "page_size_1"])
def test_sliding_window_matches_transformers(tmp_path_factory, setting: str) -> None:
    path = build_checkpoint(tmp_path_factory.mktemp("sw") / "mistral", "mistral", sliding_window=8)
    llm = LLM(str(path), device="cpu", **CONSTRAINED.get(setting, {}))
    assert _greedy_tokens(llm) == [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_attention_biases_match_transformers(tmp_path_factory, family: str) -> None:
    """`attention_bias`: q/k/v and, in these families, o_proj biases (non-zero)."""
    path = build_checkpoint(tmp_path_factory.mktemp("bias") / family, family, attention_bias=True)
    llm = LLM(str(path), device="cpu")
    assert _greedy_tokens(llm) == [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]
