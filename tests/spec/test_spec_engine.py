"""Speculative decoding in the engine: greedy output is the target's, token for token, under
every engine setting and with adaptive speculation; pages never leak; acceptance is counted."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import hf_greedy
from tests.engine.test_prefix_cache import assert_pages_partitioned, run_traffic, traffic_ops
from tokenmill import LLM, SamplingParams
from tokenmill.batch import AcceptanceEstimate, Request, StepPlan
from tokenmill.engine.engine_core import EngineCore
from tokenmill.spec.adaptive import StepCost

PROMPTS = [
    list(range(3, 10)),
    [11, 12, 13, 14, 11, 12, 13, 14, 11, 12],  # repeats: prompt lookup finds drafts
    list(range(20, 77)),
    [7] * 33 + [9],
    [42],
]
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def references(llama_dir: Path) -> list[list[int]]:
    return [hf_greedy(llama_dir, p, MAX_TOKENS) for p in PROMPTS]


def _spec(method: str, k: int, draft: Path | None = None) -> str:
    """k drafts whenever there are drafts (not adaptive: every k's shapes are exercised)."""
    if method == "ngram":
        return json.dumps({"method": "ngram", "num_speculative_tokens": k, "adaptive": False,
                           "prompt_lookup_min": 1, "prompt_lookup_max": 3})  # fmt: skip
    return json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
                       "adaptive": False})  # fmt: skip


def _proposers(llama_dir: Path, draft_dir: Path) -> dict[str, tuple[str, Path | None]]:
    # The target as its own draft accepts (nearly) everything: bonus tokens, page boundaries.
    return {"ngram": ("ngram", None), "self_draft": ("draft_model", llama_dir),
            "other_draft": ("draft_model", draft_dir)}  # fmt: skip


def _greedy_tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    ("proposer", "k"),
    [("ngram", 1), ("ngram", 2), ("ngram", 5), ("self_draft", 1), ("self_draft", 3),
     ("self_draft", 4), ("other_draft", 2), ("other_draft", 5)],
)  # fmt: skip
def test_greedy_with_speculation_equals_greedy_without(
    proposer: str, k: int, llama_dir: Path, draft_dir: Path, references: list[list[int]]
) -> None:
    method, draft = _proposers(llama_dir, draft_dir)[proposer]
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_spec(method, k, draft))
    assert _greedy_tokens(llm) == references
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 0
    # Prompt lookup and the target as its own draft get drafts accepted; the other draft
    # mostly proposes what the target rejects.
    assert stats.num_accepted_tokens > 0 or proposer == "other_draft"
    assert stats.num_accepted_tokens < stats.num_draft_tokens or proposer == "self_draft"
    if proposer == "self_draft":
        assert stats.acceptance_rate > 0.9
    assert llm.engine.cache.num_used_pages == 0


SETTINGS = {
    "chunked_prefill_budget_3": {"max_num_batched_tokens": 3},  # fewer drafts than k fit
    "page_size_1": {"page_size": 1},
    "page_size_16": {"page_size": 16},
    "tiny_pool_preempts": {"page_size": 4, "num_pages": 24, "max_model_len": 96},
    "tiny_pool_chunked": {
        "page_size": 2, "num_pages": 48, "max_model_len": 96, "max_num_batched_tokens": 5,
    },
    "no_prefix_cache": {"enable_prefix_caching": False},
}  # fmt: skip


# Each setting with the proposers whose paths it stresses (CPU time is short).
CASES = [
    ("chunked_prefill_budget_3", "self_draft"),
    ("chunked_prefill_budget_3", "ngram"),
    ("page_size_1", "other_draft"),
    ("page_size_16", "ngram"),
    ("tiny_pool_preempts", "self_draft"),
    ("tiny_pool_preempts", "other_draft"),
    ("tiny_pool_chunked", "ngram"),
    ("no_prefix_cache", "other_draft"),
]


@pytest.mark.parametrize(("setting", "proposer"), CASES)
def test_constrained_engine_with_speculation_matches(
    proposer: str,
    setting: str,
    llama_dir: Path,
    draft_dir: Path,
    references: list[list[int]],
) -> None:
    method, draft = _proposers(llama_dir, draft_dir)[proposer]
    spec = _spec(method, 3, draft)
    llm = LLM(str(llama_dir), device="cpu", speculative_config=spec, **SETTINGS[setting])
    assert _greedy_tokens(llm) == references
    if "preempts" in setting:
        assert llm.engine.scheduler.stats.num_preemptions > 0
    if "tiny_pool" not in setting and SETTINGS[setting].get("enable_prefix_caching", True):
        # Again: every prompt's prefix is cached now (target and draft K/V in the same pages).
        assert _greedy_tokens(llm) == references
        assert llm.engine.cache.stats.hits > 0
    assert llm.engine.cache.num_used_pages == 0


@pytest.mark.parametrize("proposer", ["ngram", "self_draft"])
def test_stop_conditions_apply_to_each_accepted_token(
    proposer: str, llama_dir: Path, draft_dir: Path, references: list[list[int]]
) -> None:
    method, draft = _proposers(llama_dir, draft_dir)[proposer]
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_spec(method, 4, draft))
    plain = LLM(str(llama_dir), device="cpu")
    stop = references[1][6]
    cases = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop], min_tokens=8),
        *(SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5, 7)),
    ]
    ours = llm.generate([PROMPTS[1]] * len(cases), cases, use_tqdm=False)
    ref = plain.generate([PROMPTS[1]] * len(cases), cases, use_tqdm=False)
    for a, b in zip(ours, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert ours[0].outputs[0].token_ids[-1] == stop
    assert len(ours[0].outputs[0].token_ids) < MAX_TOKENS
    # A stop string: the tokens a step accepted after the one that completes it are dropped.
    text = plain.tokenizer.decode(references[1][:7])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0,
                            stop=[text[-3:]])  # fmt: skip
    (a,), (b,) = (m.generate([PROMPTS[1]], params, use_tqdm=False) for m in (llm, plain))
    assert a.outputs[0].finish_reason == b.outputs[0].finish_reason == "stop"
    ours_stopped, ref_stopped = a.outputs[0], b.outputs[0]
    assert (ours_stopped.text, ours_stopped.token_ids) == (ref_stopped.text, ref_stopped.token_ids)
    assert len(ours_stopped.logprobs) == len(ours_stopped.token_ids) <= 7


def test_context_window_caps_speculation(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), device="cpu", max_model_len=20, speculative_config=_spec(
        "draft_model", 5, llama_dir))  # fmt: skip
    plain = LLM(str(llama_dir), device="cpu", max_model_len=20)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    ours = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    ref = plain.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert ours.token_ids == ref.token_ids and len(ours.token_ids) == 20 - len(PROMPTS[0])


@pytest.mark.parametrize("proposer", ["ngram", "self_draft"])
def test_random_traffic_with_speculation_never_leaks_a_page(
    proposer: str, llama_dir: Path, draft_dir: Path
) -> None:
    method, draft = _proposers(llama_dir, draft_dir)[proposer]
    llm = LLM(str(llama_dir), device="cpu", page_size=4, num_pages=40, max_model_len=96,
              max_num_batched_tokens=24, speculative_config=_spec(method, 4, draft))  # fmt: skip
    engine = llm.engine
    for i in range(12):
        prompt = [*PROMPTS[i % len(PROMPTS)], i]
        params = SamplingParams(max_tokens=10 + 3 * i, seed=i, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
        if i % 4 == 3:
            engine.abort_request(f"r{i - 2}")
        engine.step()
        assert_pages_partitioned(engine.cache, engine)
    while engine.has_unfinished():
        engine.step()
        assert_pages_partitioned(engine.cache, engine)
    assert engine.cache.num_used_pages == 0
    assert engine.scheduler.stats.num_preemptions > 0


# Adaptive speculation: drafts per request change from step to step, some rows verify drafts
# while others decode plain in the same step, plain steps overlap.


class LinearCost(StepCost):
    """A step costs `1 + slope * tokens`, whatever the CPU measures: the policy's choices then
    depend on the requests' acceptance alone, so the test is deterministic."""

    def __init__(self, slope: float) -> None:
        super().__init__()
        self.slope = slope

    def observe(self, num_tokens: int, seconds: float, verify: bool) -> None:
        pass

    def predict(self, num_tokens: np.ndarray, verify: bool) -> np.ndarray:
        return 1 + self.slope * np.asarray(num_tokens, dtype=np.float64)


def _adaptive(method: str, draft: Path | None = None, k: int = 4) -> str:
    """Adaptive speculation (the default): up to k drafts, chosen per request and step."""
    return json.dumps({**json.loads(_spec(method, k, draft)), "adaptive": True})


def _record_plans(llm: LLM) -> list[StepPlan]:
    """Every plan the engine launches, in order (a spy on the runner's launch)."""
    plans: list[StepPlan] = []
    launch = llm.engine.runner.launch

    def recording(plan, grammar_mask=None):  # type: ignore[no-untyped-def]
        plans.append(plan)
        return launch(plan, grammar_mask)

    llm.engine.runner.launch = recording  # type: ignore[method-assign]
    return plans


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_greedy_with_adaptive_speculation_equals_greedy_without(
    proposer: str, llama_dir: Path, draft_dir: Path, references: list[list[int]]
) -> None:
    """With the real, measured cost: whatever the policy chooses, the tokens are the target's."""
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_adaptive(proposer, draft_dir))
    assert _greedy_tokens(llm) == references
    assert llm.engine.scheduler.spec_stats.chosen_drafts.count > 0
    assert llm.engine.cache.num_used_pages == 0


@pytest.mark.parametrize("proposer", ["ngram", "self_draft"])
def test_drafts_per_row_change_between_steps_and_mix_within_a_step(
    proposer: str, llama_dir: Path, references: list[list[int]]
) -> None:
    """One request starts with a record of rejected drafts: it decodes plain beside rows that
    draft, until its record fades; the others' drafts follow their acceptance."""
    method = "ngram" if proposer == "ngram" else "draft_model"
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_adaptive(method, llama_dir))
    scheduler = llm.engine.scheduler
    scheduler.step_cost = LinearCost(0.02)
    add = scheduler.add_request

    def add_doubted(req: Request) -> None:
        if req.prompt_token_ids == PROMPTS[2]:
            req.acceptance = AcceptanceEstimate(accepted=0.0, rejected=50.0)
        add(req)

    scheduler.add_request = add_doubted  # type: ignore[method-assign]
    plans = _record_plans(llm)
    assert _greedy_tokens(llm) == references
    decode_steps = [p for p in plans if np.array_equal(p.num_samples, p.query_lens)]
    drafts = [p.num_samples - 1 for p in decode_steps]
    assert len({int(n) for d in drafts for n in d if n}) > 1  # k varies from step to step
    # Some step verifies drafts beside rows decoding plain.
    assert any((d > 0).any() and (d == 0).any() for d in drafts)
    assert llm.engine.cache.num_used_pages == 0


def test_a_compute_bound_batch_decodes_plain_and_overlapped(
    llama_dir: Path, references: list[list[int]]
) -> None:
    """When drafting never pays, the engine decodes exactly as without speculation: no
    verify rows, and steps overlap (a step is launched before the previous one is read)."""
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_adaptive("ngram"))
    llm.engine.scheduler.step_cost = LinearCost(10.0)  # every token costs ten steps
    plans = _record_plans(llm)
    overlapped = 0
    step = llm.engine.step

    def counting_step():  # type: ignore[no-untyped-def]
        nonlocal overlapped
        outputs = step()
        overlapped += llm.engine._in_flight is not None
        return outputs

    llm.engine.step = counting_step  # type: ignore[method-assign]
    assert _greedy_tokens(llm) == references
    assert all((p.num_samples <= 1).all() for p in plans)
    assert llm.engine.scheduler.spec_stats.num_drafts == 0
    assert overlapped > MAX_TOKENS // 2


def test_the_policy_is_asked_once_per_step_after_a_verify(
    llama_dir: Path, references: list[list[int]]
) -> None:
    """After a verify step (blocking: read before the next is scheduled) the engine does not
    ask `may_draft` whether to read it: the policy runs once for the next step, in its
    schedule, not twice on the path where the device waits for the host."""
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_adaptive("ngram"))
    scheduler = llm.engine.scheduler
    scheduler.step_cost = LinearCost(0.0001)  # drafts are free: every request that can drafts
    plans = _record_plans(llm)
    asked_after: list[int] = []  # how many steps were launched when may_draft was asked
    may_draft = scheduler.may_draft

    def counting() -> bool:
        asked_after.append(len(plans))
        return may_draft()

    scheduler.may_draft = counting  # type: ignore[method-assign]
    assert _greedy_tokens(llm) == references
    assert any(p.blocking for p in plans)
    assert not [n for n in asked_after if n and plans[n - 1].blocking]


@pytest.fixture(scope="module")
def adaptive_llm(llama_dir: Path) -> LLM:
    llm = LLM(str(llama_dir), device="cpu", page_size=4, num_pages=40, max_model_len=96,
              max_num_batched_tokens=24, speculative_config=_adaptive("ngram"))  # fmt: skip
    llm.engine.scheduler.step_cost = LinearCost(0.4)
    return llm


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(ops=st.lists(traffic_ops(), min_size=1, max_size=20))
@example(ops=[("add", i % 4, 40, 12) for i in range(8)] + [("abort", 3), ("step", 3)] * 6)
def test_random_traffic_with_adaptive_speculation_never_leaks_a_page(
    adaptive_llm: LLM, ops: list[tuple]
) -> None:
    """Greedy and unseeded sampled requests (those the policy adapts), prefixes that repeat
    (prompt lookup drafts), a small pool (preemption), aborts."""
    prefixes = [[5, 6, 7, 8] * 15, list(range(30, 90)), [5] * 60, list(range(200, 260))]

    def sampling(i: int, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0 if i % 2 else 0.8, max_tokens=max_tokens)

    def check(engine: EngineCore) -> None:
        assert_pages_partitioned(engine.cache, engine)

    run_traffic(adaptive_llm.engine, ops, prefixes, check, sampling)


def test_random_traffic_covers_preemption_and_mixed_drafting(adaptive_llm: LLM) -> None:
    """The explicit example above overflows the pool while rows draft and others do not."""
    test_random_traffic_with_adaptive_speculation_never_leaks_a_page(adaptive_llm)
    scheduler = adaptive_llm.engine.scheduler
    assert scheduler.stats.num_preemptions > 0
    chosen = scheduler.spec_stats.chosen_drafts
    assert chosen.counts[0] > 0 and sum(chosen.counts[1:]) > 0


def test_a_greedy_verify_step_samples_as_a_decode_step_and_verifies_on_the_host(
    llama_dir: Path, references: list[list[int]]
) -> None:
    """Greedy verification costs no kernels of its own: the step takes one argmax per sampled
    position (as a decode step) and the host decides, once it reads them, which it emits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tokenmill.runner.spec_decode import SpecDecoder

    class CountOps(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            CountOps.count += 1
            return func(*args, **(kwargs or {}))

    calls = 0
    sample = SpecDecoder.sample

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        with CountOps():
            return sample(self, *args, **kwargs)

    llm = LLM(str(llama_dir), device="cpu", speculative_config=_spec("ngram", 3))
    SpecDecoder.sample = counted  # type: ignore[method-assign]
    try:
        assert _greedy_tokens(llm) == references
    finally:
        SpecDecoder.sample = sample  # type: ignore[method-assign]
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert calls > 0 and CountOps.count <= calls  # the argmax, nothing else


def test_greedy_settings_with_speculation_equal_plain(llama_dir: Path) -> None:
    """Greedy rows with logprobs, penalties or min_tokens verify from the same argmax the plain
    sampler takes (a verify position counts the drafts before it as generated). B4's oracle
    drafts the plain run's tokens (penalties keep prompt lookup from finding any)."""
    from tokenmill.bench.speculative import OracleProposer

    prompts = [list(range(3, 10)), [11, 12, 13, 14, 11, 12, 13], [7] * 6 + [9]]  # one length
    settings = [{"logprobs": 2}, {"repetition_penalty": 1.3, "presence_penalty": 0.5},
                {"min_tokens": 12}]  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **s)
              for s in settings]  # fmt: skip
    plain = LLM(str(llama_dir), device="cpu").generate(prompts, params, use_tqdm=False)
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_spec("ngram", 3))
    continuations = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain,
                                                                      strict=True)}  # fmt: skip
    vocab = llm.config.model.vocab_size
    llm.engine.scheduler.host_proposer = OracleProposer(3, continuations, 0.7, vocab, seed=0)
    spec = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for want, got in zip(plain, spec, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    logprobs = zip(plain[0].outputs[0].logprobs, spec[0].outputs[0].logprobs, strict=True)
    for want_step, got_step in logprobs:
        assert want_step.keys() == got_step.keys()
        for token, want in want_step.items():
            assert got_step[token].rank == want.rank
            assert got_step[token].logprob == pytest.approx(want.logprob, abs=1e-4)


@pytest.mark.parametrize("proposer", ["self_draft", "other_draft"])
def test_penalties_count_the_draft_models_drafts(
    proposer: str, llama_dir: Path, draft_dir: Path
) -> None:
    """The draft model drafts for requests with penalties (its drafts know none); a verify
    position counts the drafts before it as generated, on the device, so greedy output is
    plain decoding's."""
    settings = [{"repetition_penalty": 2.0}, {"frequency_penalty": 1.5},
                {"presence_penalty": 1.0, "repetition_penalty": 1.3}, {}]  # fmt: skip
    prompts = PROMPTS[1:]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **s)
              for s in settings]  # fmt: skip
    plain = LLM(str(llama_dir), device="cpu").generate(prompts, params, use_tqdm=False)
    method, draft = _proposers(llama_dir, draft_dir)[proposer]
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_spec(method, 3, draft))
    spec = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0
    for want, got in zip(plain, spec, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_synchronous_step_returns_its_tokens_after_launching_the_next(llama_dir: Path) -> None:
    """A verify step is read, applied and followed by the next step's launch before `step()`
    returns its tokens: the caller's work on them (detokenizing, sending) overlaps the GPU."""
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_spec("ngram", 3))
    engine = llm.engine
    engine.add_request("r", PROMPTS[1], GREEDY)
    req = engine._requests["r"]
    launch = engine.runner.launch
    applied_at_launch: list[int] = []

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        applied_at_launch.append(len(req.output_token_ids))
        return launch(*args, **kwargs)

    engine.runner.launch = recording  # type: ignore[method-assign]
    checked = 0
    while engine.has_unfinished():
        applied_at_launch.clear()
        for out in engine.step():
            if out.finished or len(req.output_token_ids) == len(out.new_token_ids):
                continue  # the last step launches nothing; the first follows the prefill
            assert applied_at_launch == [len(req.output_token_ids)]
            checked += 1
    assert checked > 3 and engine.scheduler.spec_stats.num_accepted_tokens > 0


class RecordedCost(LinearCost):
    """LinearCost's choices, and every measurement the engine reports."""

    def __init__(self, slope: float) -> None:
        super().__init__(slope)
        self.observed: list[tuple[int, float]] = []
        self.kinds: list[tuple[int, bool]] = []  # (query tokens, verify) of each measured step

    def observe(self, num_tokens: int, seconds: float, verify: bool) -> None:
        self.observed.append((num_tokens, seconds))
        self.kinds.append((num_tokens, verify))


def test_a_step_costs_the_time_from_its_launch_to_the_next_caller_time_included(
    llama_dir: Path,
) -> None:
    # The caller's work between steps (the server sending outputs, the offline API's
    # detokenization) is part of what a step costs: 40 ms of it every step must show in
    # every decode and verify step's measured cost.
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_adaptive("ngram"))
    engine = llm.engine
    engine.scheduler.step_cost = cost = RecordedCost(0.0001)  # drafting looks free: it drafts
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
        time.sleep(0.04)
    sizes = {n for n, _ in cost.observed}
    assert len(cost.observed) > 1 and max(sizes) > 2  # decode steps and verify steps
    assert all(seconds >= 0.04 for _, seconds in cost.observed)
    # Plain steps (a token per row, two rows at most) and verify steps are reported apart.
    assert {verify for _, verify in cost.kinds} == {False, True}
    assert all(n <= 2 for n, verify in cost.kinds if not verify)


@pytest.mark.parametrize("proposer", ["ngram", "self_draft"])
def test_bad_words_hold_across_accepted_drafts(
    proposer: str, llama_dir: Path, draft_dir: Path, references: list[list[int]]
) -> None:
    """A bad word of two tokens is never completed inside a run of accepted drafts: greedy
    with speculation equals greedy without, with the same bad words."""
    method, draft = _proposers(llama_dir, draft_dir)[proposer]
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_spec(method, 4, draft))
    plain = LLM(str(llama_dir), device="cpu")
    ref = references[1]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            bad_words_token_ids=[ref[5:7], [ref[9]]])  # fmt: skip
    ours = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    expected = plain.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == expected and expected[:5] == ref[:5] and expected[5:7] != ref[5:7]
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("start", [2, 3])
def test_bad_words_hold_past_the_draft_models_drafts(
    start: int, llama_dir: Path, references: list[list[int]]
) -> None:
    """A bad word of two tokens inside the first verify window (the target as its own draft
    drafts the reference): the position after its first token, a draft made at launch, bans
    its second (`SamplingRows.ban_past_drafts`), as plain decoding does."""
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_spec("draft_model", 4, llama_dir))
    plain = LLM(str(llama_dir), device="cpu")
    ref = references[1]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            bad_words_token_ids=[ref[start : start + 2]])  # fmt: skip
    ours = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    expected = plain.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert expected[start : start + 2] != ref[start : start + 2]
    assert ours == expected
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_deterministic_mode_makes_the_draft_model_batch_invariant(
    llama_dir: Path, draft_dir: Path
) -> None:
    """A seeded sampled request's tokens depend on the drafts it verifies, so under
    `deterministic=True` the draft model's products and attention must be batch-invariant
    too (else the demo model's seeded request alone and in a crowd diverged at token 73)."""
    llm = LLM(str(llama_dir), device="cpu", deterministic=True,
              speculative_config=_spec("draft_model", 2, draft_dir))  # fmt: skip
    try:
        spec = llm.engine.runner.spec
        assert spec is not None and spec.drafter is not None
        layers = [m for m in spec.drafter.model.modules() if hasattr(m, "batch_invariant")]
        assert layers and all(m.batch_invariant for m in layers)
        assert spec.drafter.attention.deterministic
    finally:
        llm.close()
