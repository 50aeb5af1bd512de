"""Prompt logprobs (`SamplingParams.prompt_logprobs`) equal transformers' log-softmax of the
prompt's logits, for every family, through chunked prefill, beside plain requests, with a
cached prefix present (which such a request must not read), after preemption, with speculative
decoding, on two tensor-parallel ranks and in deterministic mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import FAMILIES, assert_prompt_logprobs_match, hf_logprobs
from tokenmill import LLM, SamplingParams
from tokenmill.cache.kv_cache import KVCache
from tokenmill.config import ModelConfig
from tokenmill.runner.prompt_logprobs import slice_rows

PROMPT = list(range(20, 70))  # 50 tokens: several 16-token chunks
SHARED = [*PROMPT[:40], 7, 8, 9]  # 40 tokens (10 pages of 4) in common with PROMPT
K = 3  # the alternatives asked for; assert_prompt_logprobs_match checks 3
SCORED = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=K)
PLAIN = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
CHUNKED = {"max_num_batched_tokens": 16, "page_size": 4}


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_match_transformers_in_chunks_beside_plain_requests(
    family: str, checkpoints: dict[str, Path]
) -> None:
    path = checkpoints[family]
    llm = LLM(str(path), device="cpu", **CHUNKED)
    outputs = llm.generate([SHARED, PROMPT, [5, 6, 7]], [PLAIN, SCORED, PLAIN], use_tqdm=False)
    assert_prompt_logprobs_match(outputs[1].prompt_logprobs, hf_logprobs(path, PROMPT), PROMPT)
    assert outputs[0].prompt_logprobs is None and outputs[2].prompt_logprobs is None
    assert len(outputs[1].outputs[0].token_ids) == 3


def test_a_cached_prefix_is_not_read_by_a_request_scoring_its_prompt(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), device="cpu", **CHUNKED)
    llm.generate([SHARED], PLAIN, use_tqdm=False)  # caches 40 tokens of PROMPT
    scored, plain = llm.generate([PROMPT, PROMPT], [SCORED, PLAIN], use_tqdm=False)
    assert scored.num_cached_tokens == 0
    assert plain.num_cached_tokens >= 40  # the prefix stayed cached for the others
    assert_prompt_logprobs_match(scored.prompt_logprobs, hf_logprobs(llama_dir, PROMPT), PROMPT)
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids[:3]


def test_preempted_request_keeps_one_score_per_prompt_token(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), device="cpu", page_size=4, num_pages=24, max_model_len=96,
              max_num_batched_tokens=8)  # fmt: skip
    prompts = [PROMPT, list(range(100, 140)), list(range(200, 230))]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=K)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_prompt_logprobs_match(out.prompt_logprobs, hf_logprobs(llama_dir, prompt), prompt)


def test_zero_alternatives_and_a_one_token_prompt(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), device="cpu")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, logprobs=0)
    long, short = llm.generate([PROMPT, [42]], params, use_tqdm=False)
    assert short.prompt_logprobs == [None]
    reference = hf_logprobs(llama_dir, PROMPT)
    assert long.prompt_logprobs is not None
    for i, entry in enumerate(long.prompt_logprobs[1:], 1):
        assert entry is not None
        # The prompt token itself, and the most likely one only where they are the same.
        assert list(entry) == [PROMPT[i]]
        assert entry[PROMPT[i]].logprob == pytest.approx(reference[i - 1, PROMPT[i]].item(), 1e-4)


def test_scores_are_sliced_across_the_vocabulary(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk's positions go through the LM head a slice at a time (here 4 rows a slice)."""
    vocab = LLM(str(llama_dir), device="cpu").config.model.vocab_size
    monkeypatch.setattr("tokenmill.runner.prompt_logprobs.SLICE_BYTES", 4 * 4 * vocab + 5)
    assert slice_rows(vocab) == 4
    llm = LLM(str(llama_dir), device="cpu", **CHUNKED)
    (out,) = llm.generate([PROMPT], SCORED, use_tqdm=False)
    assert_prompt_logprobs_match(out.prompt_logprobs, hf_logprobs(llama_dir, PROMPT), PROMPT)


def test_speculative_decoding_keeps_prompt_logprobs_and_tokens(llama_dir: Path) -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(str(llama_dir), device="cpu", speculative_config=ngram, **CHUNKED)
    plain = LLM(str(llama_dir), device="cpu").generate([PROMPT], PLAIN, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=K)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert out.outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert_prompt_logprobs_match(out.prompt_logprobs, hf_logprobs(llama_dir, PROMPT), PROMPT)


def test_two_tensor_parallel_ranks_score_alike(llama_dir: Path) -> None:
    """Every rank computes the scores (the logits are gathered by a collective); rank 0 reads."""
    threads = torch.get_num_threads()  # rank 0 runs here and takes its share of the cores
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=2, **CHUNKED)
    try:
        outputs = llm.generate([SHARED, PROMPT], [PLAIN, SCORED], use_tqdm=False)
    finally:
        llm.close()
        torch.set_num_threads(threads)
    assert_prompt_logprobs_match(outputs[1].prompt_logprobs, hf_logprobs(llama_dir, PROMPT), PROMPT)


def test_deterministic_mode_scores_alike_alone_and_in_any_batch(llama_dir: Path) -> None:
    alone = LLM(str(llama_dir), device="cpu", deterministic=True)
    (reference,) = alone.generate([PROMPT], SCORED, use_tqdm=False)
    mixed = LLM(str(llama_dir), device="cpu", deterministic=True, **CHUNKED)
    outputs = mixed.generate([SHARED, PROMPT, [5, 6]], [PLAIN, SCORED, PLAIN], use_tqdm=False)
    assert outputs[1].prompt_logprobs == reference.prompt_logprobs  # bitwise


def test_a_running_request_keeps_no_prompt_logprobs_after_its_first_output(
    llama_dir: Path,
) -> None:
    """The prompt's scores go out with the first output and the request drops them (a long
    prompt's are megabytes, for as long as it generates); a preemption after that scores no
    prompt token again, and the request may read its cached prefix."""
    engine = LLM(str(llama_dir), device="cpu", **CHUNKED).engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=K)
    engine.add_request("scored", PROMPT, params)
    first = []
    while not first:
        first = [out for out in engine.step() if out.new_token_ids]
    assert first[0].prompt_logprobs is not None and len(first[0].prompt_logprobs) == len(PROMPT)
    (req,) = engine.scheduler.running
    assert req.prompt_logprobs == [] and not req.scores_prompt
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert all(out.prompt_logprobs is None for out in outputs)


@pytest.fixture(scope="module")
def tight_and_alone(llama_dir: Path) -> tuple[LLM, LLM]:
    """An engine that preempts (24 pages of 4 tokens for up to 8 requests of up to 82), with a
    prefix cache and a host tier under it; and one that runs each request alone, uncached."""
    host = 64 * KVCache.bytes_per_page(ModelConfig.from_pretrained(llama_dir), 4)
    tight = LLM(str(llama_dir), device="cpu", page_size=4, num_pages=24, max_model_len=96,
                max_num_batched_tokens=8, host_kv_cache_bytes=host)  # fmt: skip
    return tight, LLM(str(llama_dir), device="cpu", enable_prefix_caching=False)


_BASE = [(17 * i) % 490 + 5 for i in range(40)]
_request = st.tuples(
    st.integers(1, 40),  # how much of the shared prefix
    st.lists(st.integers(3, 499), max_size=12),  # a tail of its own
    st.integers(1, 30),  # max_tokens
    st.none() | st.integers(0, 3),  # prompt_logprobs
    st.dictionaries(st.integers(0, 511), st.floats(-10, 10), max_size=3),  # logit_bias
)


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=st.lists(_request, min_size=6, max_size=8))
def test_prompt_logprobs_and_tokens_hold_through_preemption_and_both_cache_tiers(
    tight_and_alone: tuple[LLM, LLM], requests
) -> None:
    """Requests sharing prefixes, some scoring their prompts, in an engine that preempts them
    and caches on the device and the host: each gets the tokens and prompt logprobs it gets
    alone."""
    tight, alone = tight_and_alone
    prompts = [[*_BASE[:cut], *tail] for cut, tail, *_ in requests]
    params = [
        SamplingParams(
            temperature=0, max_tokens=m, ignore_eos=True, prompt_logprobs=k, logit_bias=bias or None
        )
        for _, _, m, k, bias in requests
    ]
    outputs = tight.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        (expected,) = alone.generate([prompt], p, use_tqdm=False)
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert out.prompt_logprobs is not None and expected.prompt_logprobs is not None
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for ours, theirs in zip(out.prompt_logprobs[1:], expected.prompt_logprobs[1:], strict=True):
            assert ours is not None and theirs is not None and ours.keys() == theirs.keys()
            for token, lp in ours.items():
                assert lp.rank == theirs[token].rank
                assert lp.logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
