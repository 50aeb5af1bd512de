"""Deterministic mode: a request's tokens and logprobs are bitwise the same alone, in any batch,
under any prefill chunking, with or without a prefix-cache hit, after preemption (bfloat16,
CPU). Each run carries the target twice: greedy, and sampled with a seed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.outputs import CompletionOutput

# Batch sizes tried: two of 1..63 drawn once per run (CI time), and the largest, 64.
BATCH_SIZES = sorted({*random.Random(30).sample(range(1, 64), 2), 64})
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True,
                        logprobs=3)  # fmt: skip


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(5, 500) for _ in range(length)]


TARGET = _prompt(random.Random(1), 150)  # spans several key blocks and prefill chunks of 16


def _engine(path: Path, budget: int = 8192, dtype: str = "bfloat16", **options: object) -> LLM:
    return LLM(str(path), device="cpu", dtype=dtype, deterministic=True,
               max_num_batched_tokens=budget, **options)  # fmt: skip


def _run(llm: LLM, others: list[list[int]]) -> list[CompletionOutput]:
    """The target's greedy and seeded completions, run first among `others` (greedy)."""
    prompts = [TARGET, TARGET, *others]
    params = [GREEDY, SEEDED, *[GREEDY] * len(others)]
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)[:2]]


def _same(got: list[CompletionOutput], want: list[CompletionOutput]) -> None:
    """Token ids, then every position's logprobs (chosen and top), bitwise."""
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logprobs is not None and w.logprobs is not None
        for position, (gp, wp) in enumerate(zip(g.logprobs, w.logprobs, strict=True)):
            values = {t: (lp.logprob, lp.rank) for t, lp in gp.items()}
            assert values == {t: (lp.logprob, lp.rank) for t, lp in wp.items()}, position


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> list[CompletionOutput]:
    """The two targets alone, prefilled in one chunk, on an engine caching nothing."""
    return _run(_engine(llama_dir, enable_prefix_caching=False), [])


@pytest.mark.parametrize("size", BATCH_SIZES)
def test_output_is_the_same_in_a_batch_of_any_size(
    size: int, llama_dir: Path, reference: list[CompletionOutput]
) -> None:
    rng = random.Random(size)
    others = [_prompt(rng, rng.randrange(1, 120)) for _ in range(size)]
    _same(_run(_engine(llama_dir, budget=512, enable_prefix_caching=False), others), reference)


def test_float32_output_is_the_same_in_a_batch(llama_dir: Path) -> None:
    """In float32 the CPU's BLAS (MKL) rounds a row differently for every batch size, the
    default mode's products with it: deterministic mode's are not."""
    rng = random.Random(64)
    others = [_prompt(rng, rng.randrange(1, 120)) for _ in range(40)]
    alone = _run(_engine(llama_dir, dtype="float32", enable_prefix_caching=False), [])
    batched = _engine(llama_dir, budget=512, dtype="float32", enable_prefix_caching=False)
    _same(_run(batched, others), alone)


@pytest.mark.parametrize("budget", [16, 512, 8192])
def test_output_is_the_same_under_any_prefill_chunking(
    budget: int, llama_dir: Path, reference: list[CompletionOutput]
) -> None:
    rng = random.Random(budget)
    others = [_prompt(rng, rng.randrange(1, 200)) for _ in range(5)]
    _same(_run(_engine(llama_dir, budget=budget, enable_prefix_caching=False), others), reference)


def test_output_is_the_same_after_a_prefix_cache_hit(
    llama_dir: Path, reference: list[CompletionOutput]
) -> None:
    llm = _engine(llama_dir, budget=64)
    # A request sharing the target's first 100 tokens (6 full pages) caches them.
    llm.generate([[*TARGET[:100], 3, 4]], GREEDY, use_tqdm=False)
    _same(_run(llm, []), reference)
    assert llm.engine.cache.stats.hits > 0
    _same(_run(llm, []), reference)  # the whole prompt cached this time


def test_prefix_written_by_decode_steps_serves_a_prefill(
    llama_dir: Path, reference: list[CompletionOutput]
) -> None:
    """A finished request caches the KV its decode steps wrote; a prompt extending its prompt +
    output reuses that KV and gets what an engine prefilling everything gets."""
    extended = [*TARGET, *reference[0].token_ids]
    fresh = _engine(llama_dir, enable_prefix_caching=False)
    want = fresh.generate([extended], GREEDY, use_tqdm=False)[0].outputs[0]
    llm = _engine(llama_dir, budget=64)
    llm.generate([TARGET], GREEDY, use_tqdm=False)
    hits = llm.engine.cache.stats.hits
    got = llm.generate([extended], GREEDY, use_tqdm=False)[0].outputs[0]
    assert llm.engine.cache.stats.hits > hits
    _same([got], [want])


def test_preempted_request_recomputes_the_same_output(
    llama_dir: Path, reference: list[CompletionOutput]
) -> None:
    """Recomputing after preemption prefills positions that were decoded: same values. Pages
    of 4 tokens: a 40-token request, then the two targets (38 pages each) fill 86 of 90 pages;
    as they decode, the last admitted (the seeded target) is preempted and recomputed."""
    llm = _engine(
        llama_dir, budget=512, enable_prefix_caching=False, page_size=4, num_pages=90,
        max_model_len=200,
    )  # fmt: skip
    prompts = [_prompt(random.Random(5), 40), TARGET, TARGET]
    outs = llm.generate(prompts, [GREEDY, GREEDY, SEEDED], use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    _same([out.outputs[0] for out in outs[1:]], reference)


def test_a_seeded_drafting_request_keeps_its_output_through_preemption(
    llama_dir: Path, draft_dir: Path
) -> None:
    """With a draft model a seeded request's tokens follow the drafts it verifies: preempted
    mid-decode, it resumes with the verify row it would have had, and its tokens and logprobs
    are those it gets alone (the server bursts of issue 30 differed in 53 of 80 without)."""
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    seeded = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=24 + 4 * i,
                             ignore_eos=True, logprobs=2) for i in range(6)]  # fmt: skip
    prompts = [_prompt(random.Random(i), 20 + 7 * i) for i in range(6)]
    alone_llm = _engine(llama_dir, speculative_config=spec)
    alone = [alone_llm.generate([p], s, use_tqdm=False)[0].outputs[0]
             for p, s in zip(prompts, seeded, strict=True)]  # fmt: skip
    llm = _engine(llama_dir, speculative_config=spec, page_size=4, num_pages=30,
                  max_model_len=120)  # fmt: skip
    outs = llm.generate(prompts, seeded, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 2
    _same([out.outputs[0] for out in outs], alone)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_mixture_of_experts_output_is_the_same_in_a_batch(family: str, checkpoints) -> None:
    """Experts (and Qwen2-MoE's gated shared expert) under batching and chunking."""
    path = checkpoints[family]
    alone = _run(_engine(path, enable_prefix_caching=False), [])
    rng = random.Random(2)
    others = [_prompt(rng, rng.randrange(1, 120)) for _ in range(24)]
    _same(_run(_engine(path, budget=48, enable_prefix_caching=False), others), alone)
