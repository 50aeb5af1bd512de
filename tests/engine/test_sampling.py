"""Sampling: seeds, temperature/top-k/top-p/min-p, penalties and logprobs, against references."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from tests.conftest import _hf_model, hf_greedy, hf_logprobs
from tokenmill import LLM, SamplingParams
from tokenmill.batch import SamplingRows
from tokenmill.runner.sampler import Sampler, SamplingBatch

PROMPT = list(range(30, 50))


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), device="cpu", seed=7)


def assert_seeded_request_is_batch_independent(llm: LLM, prompt: list[int]) -> None:
    """A seeded request gives the same tokens alone and in a busy batch, other tokens with
    another seed."""
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    busy_prompts = [list(range(5, 5 + k)) for k in (3, 40, 11)] + [prompt] + [[9, 8, 7]]
    busy_params = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 3
    busy_params += [seeded, SamplingParams(temperature=0, max_tokens=5)]
    busy = llm.generate(busy_prompts, busy_params, use_tqdm=False)[3].outputs[0].token_ids
    assert busy == alone
    other = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate([prompt], other, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_seeded_request_is_identical_alone_and_in_a_busy_batch(llm: LLM) -> None:
    assert_seeded_request_is_batch_independent(llm, PROMPT)


@pytest.mark.parametrize("overlap", [True, False])
def test_seeded_sampling_is_the_same_with_and_without_overlap(llama_dir: Path, overlap: bool):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=20, min_tokens=5, logprobs=1)
    reference = LLM(str(llama_dir), device="cpu", overlap_scheduling=False).generate(
        [PROMPT, PROMPT[:7]], params, use_tqdm=False
    )
    llm = LLM(str(llama_dir), device="cpu", overlap_scheduling=overlap)
    outputs = llm.generate([PROMPT, PROMPT[:7]], params, use_tqdm=False)
    for ours, ref in zip(outputs, reference, strict=True):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        assert ours.outputs[0].logprobs == ref.outputs[0].logprobs


def test_unseeded_requests_differ_between_samples(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=16, n=4, ignore_eos=True)
    outputs = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    assert [o.index for o in outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outputs}) > 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=12, ignore_eos=True),
        # Below float32's range: once sampled token 0 from NaN weights (logits / 1e-40 are
        # infinite; top_p 1e-46 rounds to 0 and kept no token).
        SamplingParams(temperature=1e-40, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-46, max_tokens=12, ignore_eos=True),
    ],
    ids=["top_k_1", "top_p_tiny", "min_p_1", "temperature_under_float32", "top_p_under_float32"],
)
def test_filters_that_keep_one_token_are_greedy(llm: LLM, llama_dir: Path, params) -> None:
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == hf_greedy(llama_dir, PROMPT, 12)


def test_sampled_tokens_follow_the_model_distribution(llm: LLM, llama_dir: Path) -> None:
    temperature, n = 0.5, 800
    probs = torch.softmax(hf_logprobs(llama_dir, PROMPT)[-1] / temperature, dim=-1)
    params = SamplingParams(temperature=temperature, max_tokens=1, n=n)
    outputs = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    ours = torch.tensor([o.token_ids[0] for o in outputs])

    def total_variation(draws: torch.Tensor) -> float:
        freq = torch.bincount(draws, minlength=len(probs)) / len(draws)
        return 0.5 * (freq - probs).abs().sum().item()

    # Compare with the spread of exact draws of the same size from the model distribution.
    gen = torch.Generator().manual_seed(0)
    exact = sorted(
        total_variation(torch.multinomial(probs, n, replacement=True, generator=gen))
        for _ in range(40)
    )
    assert total_variation(ours) < 1.2 * exact[-2], (total_variation(ours), exact)


def test_top_k_and_top_p_restrict_the_support(llm: LLM, llama_dir: Path) -> None:
    logprobs = hf_logprobs(llama_dir, PROMPT)[-1]
    top5 = set(logprobs.topk(5).indices.tolist())
    params = SamplingParams(temperature=2.0, top_k=5, max_tokens=1, n=60)
    sampled = {o.token_ids[0] for o in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs}
    assert sampled <= top5 and len(sampled) > 1
    sorted_probs, order = logprobs.exp().sort(descending=True)
    nucleus = set(order[: int((sorted_probs.cumsum(0) < 0.5).sum()) + 1].tolist())
    params = SamplingParams(temperature=1.0, top_p=0.5, max_tokens=1, n=60)
    sampled = {o.token_ids[0] for o in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs}
    assert sampled <= nucleus


class _OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence/frequency penalties over generated tokens, for transformers' generate."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def _hf_generate(path: Path, prompt: list[int], n: int, **kwargs) -> list[int]:
    out = _hf_model(path).generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        **kwargs,
    )
    return out[0, len(prompt) :].tolist()


def test_repetition_penalty_matches_transformers(llm: LLM, llama_dir: Path) -> None:
    prompt = [5, 6, 7] * 6
    params = SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=20, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == _hf_generate(llama_dir, prompt, 20, repetition_penalty=1.8)
    assert out != hf_greedy(llama_dir, prompt, 20)


def test_presence_and_frequency_penalties_match_a_reference(llm: LLM, llama_dir: Path) -> None:
    params = SamplingParams(
        temperature=0, presence_penalty=1.5, frequency_penalty=0.7, max_tokens=20, ignore_eos=True
    )
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    processor = _OpenAIPenalties(len(PROMPT), 1.5, 0.7)
    reference = _hf_generate(
        llama_dir, PROMPT, 20, logits_processor=LogitsProcessorList([processor])
    )
    assert out == reference
    assert out != hf_greedy(llama_dir, PROMPT, 20)


def test_logprobs_match_transformers(llm: LLM, llama_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    completion = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert len(completion.logprobs) == 8
    reference = hf_logprobs(llama_dir, PROMPT + completion.token_ids)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        ref = reference[len(PROMPT) - 1 + i]
        top = ref.topk(3)
        assert set(entry) == {token, *top.indices.tolist()}
        assert entry[token].rank == 1  # greedy picks the most likely token
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[tid].item(), abs=1e-4)
            assert lp.rank == int((ref > ref[tid]).sum()) + 1


def test_logprobs_zero_returns_only_the_sampled_token(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=4, logprobs=0, ignore_eos=True)
    completion = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert [list(e) for e in completion.logprobs] == [[t] for t in completion.token_ids]
    assert all(
        e[t].logprob <= 0 for e, t in zip(completion.logprobs, completion.token_ids, strict=True)
    )


def test_the_engine_core_keeps_no_logprobs_it_has_sent(llm: LLM) -> None:
    """Each output carries its step's logprobs and the request keeps none after it (it kept a
    whole output's: ~175 bytes an entry, 120 MB for 32k tokens of 21 entries)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    engine.add_request("kept", PROMPT, params)
    request = engine._requests["kept"]
    entries = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.new_logprobs is not None
            assert len(out.new_logprobs) == len(out.new_token_ids)
            entries += out.new_logprobs
        assert request.new_logprobs == []
    assert len(entries) == 12 and all(len(e) >= 5 for e in entries)


class _BiasAndAllowed(LogitsProcessor):
    """OpenAI's `logit_bias` (added to the logits) and vLLM's `allowed_token_ids` (every other
    token at -inf), for transformers' generate."""

    def __init__(self, bias: dict[int, float], allowed: list[int] | None = None) -> None:
        self.bias, self.allowed = bias, allowed

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for token, value in self.bias.items():
            scores[:, token] += value
        if self.allowed is not None:
            kept = scores[:, self.allowed]
            scores.fill_(float("-inf"))
            scores[:, self.allowed] = kept
        return scores


def test_logit_bias_and_allowed_token_ids_match_a_reference(llm: LLM, llama_dir: Path) -> None:
    """Greedy rows with a bias, with allowed ids, and plain ones, in one batch: each as
    transformers with the same processing; logprobs stay the model's (as OpenAI's)."""
    greedy = hf_greedy(llama_dir, PROMPT, 12)
    bias = {greedy[0]: -100.0, 77: 5.0, 3: 2.5}
    allowed = [11, 12, 13, 200, greedy[1]]
    common = dict(temperature=0, max_tokens=12, ignore_eos=True)
    params = [
        SamplingParams(**common, logit_bias=bias, logprobs=2),
        SamplingParams(**common, allowed_token_ids=allowed),
        SamplingParams(**common),
    ]
    biased, only_allowed, plain = (
        o.outputs[0] for o in llm.generate([PROMPT] * 3, params, use_tqdm=False)
    )
    assert biased.token_ids == _hf_generate(
        llama_dir, PROMPT, 12, logits_processor=LogitsProcessorList([_BiasAndAllowed(bias)])
    )
    assert biased.token_ids[0] != greedy[0]
    assert only_allowed.token_ids == _hf_generate(
        llama_dir, PROMPT, 12, logits_processor=LogitsProcessorList([_BiasAndAllowed({}, allowed)])
    )
    assert set(only_allowed.token_ids) <= set(allowed)
    assert plain.token_ids == greedy
    reference = hf_logprobs(llama_dir, PROMPT + biased.token_ids)
    for i, (token, entry) in enumerate(zip(biased.token_ids, biased.logprobs, strict=True)):
        assert entry[token].logprob == pytest.approx(reference[len(PROMPT) - 1 + i][token].item(),
                                                     abs=1e-4)  # fmt: skip


def test_sampled_rows_draw_only_allowed_tokens_and_follow_the_bias(llm: LLM) -> None:
    """Sampled choices: only allowed ids; a +100 bias on one token makes it (almost) certain."""
    allowed = [40, 41, 42, 43]
    params = SamplingParams(temperature=1.5, allowed_token_ids=allowed, max_tokens=6, n=20)
    outputs = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    drawn = {t for o in outputs for t in o.token_ids}
    assert drawn <= set(allowed) and len(drawn) > 1
    params = SamplingParams(temperature=1.0, logit_bias={99: 100.0}, max_tokens=5, n=8)
    outputs = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    assert all(o.token_ids == [99] * 5 for o in outputs)


def test_truncate_prompt_tokens_generates_from_the_last_tokens(llm: LLM, llama_dir: Path) -> None:
    """A prompt longer than the context runs on its last `truncate_prompt_tokens` ids (vLLM's
    left truncation), as transformers does on those ids alone."""
    long_prompt = [5 + i % 400 for i in range(llm.engine.config.max_model_len + 50)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=20)
    out = llm.generate([long_prompt], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == long_prompt[-20:]
    assert out.outputs[0].token_ids == hf_greedy(llama_dir, long_prompt[-20:], 6)
    with pytest.raises(ValueError, match="context window"):
        llm.generate([long_prompt], SamplingParams(max_tokens=6), use_tqdm=False)


def test_bad_words_match_transformers_bad_words_ids(llm: LLM, llama_dir: Path) -> None:
    """A bad word of one token is never drawn; one of two tokens never completed (its last
    token banned right after its first), as transformers' `bad_words_ids` in one batch."""
    greedy = hf_greedy(llama_dir, PROMPT, 12)
    assert greedy[3] != PROMPT[-1]  # transformers also matches words against the prompt
    words = {"one": [[greedy[0]]], "two": [[greedy[3], greedy[4]]]}
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words_token_ids=ids)
        for ids in words.values()
    ]
    outputs = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    for out, ids in zip(outputs, words.values(), strict=True):
        tokens = out.outputs[0].token_ids
        assert tokens == _hf_generate(llama_dir, PROMPT, 12, bad_words_ids=ids) != greedy
    two = outputs[1].outputs[0].token_ids
    assert two[:4] == greedy[:4] and all(two[i : i + 2] != greedy[3:5] for i in range(11))


def test_bad_words_are_tokenized_as_vllm_does(llm: LLM) -> None:
    """Text bad words become token sequences with and without a leading space; a request's
    output then holds neither."""
    from tokenmill.tokenization.tokenizer import with_bad_words

    params = with_bad_words(llm.tokenizer, SamplingParams(bad_words=["hello", " world"]))
    tok = llm.tokenizer
    assert tok.encode("hello", add_special_tokens=False) in params.bad_words_token_ids
    assert tok.encode("world", add_special_tokens=False) in params.bad_words_token_ids
    text = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    first = text[0].outputs[0].token_ids[0]
    banned = SamplingParams(temperature=0, max_tokens=8, bad_words=[tok.decode([first])])
    out = llm.generate(["hello"], banned, use_tqdm=False)[0].outputs[0].token_ids
    assert first not in out


def test_a_bias_is_added_before_the_repetition_penalty_as_in_vllm(
    llm: LLM, llama_dir: Path
) -> None:
    """vLLM adds `logit_bias` before the penalties: a seen token's positive logit l becomes
    (l + b) / r under a repetition penalty r, not l / r + b. The bias is one where the two
    orders pick different first tokens."""
    prompt, r = [5, 6, 7] * 6, 1.8
    with torch.no_grad():
        logits = _hf_model(llama_dir)(torch.tensor([prompt])).logits[0, -1].double()
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[prompt] = True

    def penalize(x: torch.Tensor) -> torch.Tensor:
        return torch.where(seen, torch.where(x > 0, x / r, x * r), x)

    def first(token: int, b: float, bias_first: bool) -> int:
        bias = torch.zeros_like(logits)
        bias[token] = b
        return int((penalize(logits + bias) if bias_first else penalize(logits) + bias).argmax())

    token, b = next(
        (t, b / 4)
        for b in range(1, 400)
        for t in (5, 6, 7)
        if first(t, b / 4, True) != first(t, b / 4, False)
    )
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=r, logit_bias={token: b}
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    processors = LogitsProcessorList(
        [_BiasAndAllowed({token: b}), RepetitionPenaltyLogitsProcessor(r)]
    )
    assert out[0] == first(token, b, True)
    assert out == _hf_generate(llama_dir, prompt, 6, logits_processor=processors)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_never_bans_every_allowed_token(llm: LLM, temperature: float) -> None:
    """Where every allowed id is a stop token, min_tokens' ban would leave a row no token at
    all (all -inf: token 0 came out): the allowed ids win, as a grammar does; the request still
    runs for min_tokens tokens and stops at the first stop token after them."""
    common = dict(temperature=temperature, seed=3, max_tokens=6, min_tokens=3)
    stops = SamplingParams(**common, allowed_token_ids=[40, 41], stop_token_ids=[40, 41])
    partly = SamplingParams(**common, allowed_token_ids=[40, 41, 42], stop_token_ids=[40, 41])
    out, mixed = (
        o.outputs[0] for o in llm.generate([PROMPT, PROMPT], [stops, partly], use_tqdm=False)
    )
    assert set(out.token_ids) <= {40, 41} and len(out.token_ids) == 3
    assert out.finish_reason == "stop"
    assert mixed.token_ids[:3] == [42, 42, 42]  # the ban holds where a token is left
    eos = llm.config.model.eos_token_ids[0]
    params = SamplingParams(temperature=temperature, max_tokens=4, min_tokens=2,
                            allowed_token_ids=[eos])  # fmt: skip
    (only_eos,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert only_eos.outputs[0].token_ids == [eos, eos]


def test_a_batch_of_large_bias_maps_is_built_in_milliseconds() -> None:
    """256 rows of 4,096-entry `logit_bias` maps (the most a request may send) and 200k
    allowed ids: a step's sampling settings come from each request's tables, built once (the
    maps as Python objects took 1.2 s a step); the biases still land on their rows."""
    vocab, cpu = 1 << 18, torch.device("cpu")
    bias = SamplingParams(temperature=0, logit_bias={i: i % 100 + 0.5 for i in range(4096)})
    allowed = SamplingParams(temperature=0, allowed_token_ids=list(range(1000, 201_000)))
    params = [bias] * 255 + [allowed]
    rows = SamplingRows(params=params, token_index=[0] * len(params))
    SamplingBatch.from_rows(rows, vocab, cpu)  # the tables are built on the first step
    start = time.perf_counter()
    batch = SamplingBatch.from_rows(rows, vocab, cpu)
    assert time.perf_counter() - start < 0.25
    assert batch.bias is not None and len(batch.bias.ids) == 255 * 4096
    two = SamplingBatch.from_rows(SamplingRows(params=params[-2:], token_index=[0, 0]), vocab, cpu)
    logits = torch.zeros(2, vocab)
    logits[1, 0] = 1.0  # not an allowed id
    tokens = Sampler(cpu, seed=0)(logits, two).to_host().token_ids
    assert tokens == [99, 1000]  # the largest bias; the first allowed id (all tie)


def test_bad_words_never_ban_every_allowed_token(llm: LLM) -> None:
    """Bad words covering all of a request's allowed ids are not applied (the allowed ids
    win, as over min_tokens): its tokens stay inside the allowed set."""
    banned = [[40], [41]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                            allowed_token_ids=[40, 41], bad_words_token_ids=banned)  # fmt: skip
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert set(out) <= {40, 41}
