"""Sampling with speculation keeps the target's distribution: chi-square tests of the first
three sampled tokens against exact marginals computed with transformers; seeded requests give
the same tokens alone and in a busy batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from tests.conftest import _hf_model
from tests.engine.test_sampling import assert_seeded_request_is_batch_independent
from tokenmill import LLM, SamplingParams

PROMPT = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
# Every token id once, then the prompt: whatever is sampled, prompt lookup finds it and drafts
# the tokens after it (mostly rejected: this checks the residual draws of one-hot drafts).
LOOKUP_PROMPT = [*torch.randperm(512, generator=torch.Generator().manual_seed(0)).tolist(),
                 *PROMPT]  # fmt: skip
TEMPERATURE, TOP_K = 0.8, 8
SAMPLES = 800
ALPHA = 1e-4


def _spec(proposer: str, llama_dir: Path, draft_dir: Path, adaptive: bool = True) -> str:
    if proposer == "ngram":
        return json.dumps({"method": "ngram", "num_speculative_tokens": 3, "adaptive": adaptive,
                           "prompt_lookup_min": 1, "prompt_lookup_max": 3})  # fmt: skip
    draft = llama_dir if proposer == "self_draft" else draft_dir
    return json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                       "adaptive": adaptive})  # fmt: skip


def _next_token_probs(
    path: Path, contexts: list[list[int]], generated: int, frequency: float
) -> torch.Tensor:
    """`[C, V]` the sampling distribution after each context (frequency penalty on its last
    `generated` tokens, temperature, top-k), float64."""
    with torch.no_grad():
        logits = _hf_model(path)(torch.tensor(contexts)).logits[:, -1].double()
    for row, context in zip(logits, contexts, strict=True):
        for token in context[len(context) - generated :]:
            row[token] -= frequency
    logits = logits / TEMPERATURE
    top = logits.topk(TOP_K, dim=-1)
    probs = torch.zeros_like(logits)
    return probs.scatter_(1, top.indices, top.values.softmax(dim=-1))


def _exact_marginals(path: Path, prompt: list[int], frequency: float = 0.0) -> list[torch.Tensor]:
    """Marginal distributions of the first three sampled tokens, summing over earlier ones."""
    p1 = _next_token_probs(path, [prompt], 0, frequency)[0]
    first = p1.nonzero()[:, 0].tolist()
    p2 = _next_token_probs(path, [[*prompt, a] for a in first], 1, frequency)  # [8, V]
    pairs = [(a, b) for i, a in enumerate(first) for b in p2[i].nonzero()[:, 0].tolist()]
    p3 = _next_token_probs(path, [[*prompt, a, b] for a, b in pairs], 2, frequency)
    weight2 = p1[first]
    weight3 = torch.tensor([p1[a] * p2[first.index(a), b] for a, b in pairs], dtype=torch.float64)
    return [p1, weight2 @ p2, weight3 @ p3]


def _assert_follows(tokens: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside top-k was sampled"
    expected = probs[support] / probs[support].sum() * len(tokens)
    result = chisquare(counts[support].numpy(), expected.numpy())
    assert result.pvalue > ALPHA, (counts[support].tolist(), expected.tolist(), result)


@pytest.mark.parametrize(
    ("proposer", "frequency"), [("ngram", 0.0), ("other_draft", 0.0), ("self_draft", -2.0)]
)
def test_sampled_tokens_keep_the_target_distribution(
    proposer: str, frequency: float, llama_dir: Path, draft_dir: Path
) -> None:
    """(With a frequency penalty, a verify position counts the draft model's drafts before it,
    made on the device, as generated.)"""
    # Not adaptive: every sample verifies drafts.
    llm = LLM(str(llama_dir), device="cpu", max_num_seqs=256, seed=1,
              speculative_config=_spec(proposer, llama_dir, draft_dir, adaptive=False))  # fmt: skip
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=3, n=SAMPLES,
                            ignore_eos=True, frequency_penalty=frequency)  # fmt: skip
    prompt = LOOKUP_PROMPT if proposer == "ngram" else PROMPT
    outputs = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_draft_tokens >= SAMPLES
    if proposer != "ngram":
        assert stats.num_accepted_tokens > 0
    for position, marginal in enumerate(_exact_marginals(llama_dir, prompt, frequency)):
        _assert_follows([o.token_ids[position] for o in outputs], marginal)


@pytest.mark.parametrize("proposer", ["ngram", "self_draft", "other_draft"])
def test_seeded_request_is_identical_alone_and_in_a_busy_batch(
    proposer: str, llama_dir: Path, draft_dir: Path
) -> None:
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_spec(proposer, llama_dir,
              draft_dir))  # fmt: skip
    assert_seeded_request_is_batch_independent(llm, PROMPT)


@pytest.mark.parametrize("adaptive", [False, True])
def test_seeded_requests_keep_their_tokens_when_the_budget_cuts_their_prompts(
    adaptive: bool, llama_dir: Path, draft_dir: Path
) -> None:
    """A 24-token budget full of verify rows prefills the seeded requests in chunks; one was
    cut one token short of its end, and that last prompt token then verified drafts: its first
    token was drawn by verification, not plain as when its prompt is prefilled at once, and
    every later draw moved (the first token differed from the request's alone)."""
    prompts = [list(range(3, 10)), [11, 12, 13, 14, 11, 12, 13, 14, 11, 12], list(range(20, 77))]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, ignore_eos=True)
              for s in range(3)]  # fmt: skip
    spec = _spec("other_draft", llama_dir, draft_dir, adaptive=adaptive)
    busy_prompts = [*prompts, [7] * 33 + [9], [42], *prompts]
    busy = LLM(str(llama_dir), device="cpu", max_num_batched_tokens=24, speculative_config=spec)
    outputs = busy.generate(busy_prompts, [greedy] * 5 + seeded, use_tqdm=False)
    alone = LLM(str(llama_dir), device="cpu", max_num_batched_tokens=24, speculative_config=spec)
    for prompt, params, out in zip(prompts, seeded, outputs[5:], strict=True):
        by_itself = alone.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert out.outputs[0].token_ids == by_itself
    assert busy.engine.scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("proposer", ["self_draft", "other_draft"])
def test_seeded_requests_keep_their_tokens_through_preemption(
    proposer: str, llama_dir: Path, draft_dir: Path
) -> None:
    """A seeded sampled request draws each token from the step that verifies it, so a request
    preempted mid-decode must resume with the verify row it would have had: a recompute that
    sampled its newest token plain changed the tokens after it (issue 30's server bursts)."""
    prompts = [[5 + i, *PROMPT, 20 + i] for i in range(6)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40 + 4 * i, ignore_eos=True)
              for i in range(6)]  # fmt: skip
    spec = _spec(proposer, llama_dir, draft_dir, adaptive=False)
    roomy = LLM(str(llama_dir), device="cpu", speculative_config=spec)
    alone = [roomy.generate([p], s, use_tqdm=False)[0].outputs[0].token_ids
             for p, s in zip(prompts, params, strict=True)]  # fmt: skip
    tight = LLM(
        str(llama_dir),
        device="cpu",
        speculative_config=spec,
        page_size=4,
        num_pages=40,
        max_model_len=96,
    )
    crowded = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.stats.num_preemptions > 2
    assert [o.outputs[0].token_ids for o in crowded] == alone
