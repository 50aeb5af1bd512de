"""Speculation in the step protocol, without a model: verify rows in the plan, acceptance
applied, rejected positions rolled back and their pages released."""

from __future__ import annotations

from tokenmill.batch import Request
from tokenmill.cache.cache_manager import CacheManager
from tokenmill.config import SchedulerConfig
from tokenmill.engine.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.config import SpeculativeConfig
from tokenmill.spec.rejection import PLACEHOLDER

PAGE = 2
NGRAM = SpeculativeConfig("ngram", 3, prompt_lookup_max=2, prompt_lookup_min=1)


def _scheduler(spec: SpeculativeConfig, budget: int = 64, draft_model: bool = False) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
    sched = Scheduler(config, CacheManager(32, PAGE, enable_prefix_caching=True), spec)
    if draft_model:
        sched.host_proposer = None  # as with method "draft_model": the runner drafts
    return sched


def _prefilled(sched: Scheduler, prompt: list[int], first: int, **params) -> Request:
    sampling = SamplingParams(**{"temperature": 0, "max_tokens": 20, **params})
    req = Request("r", prompt, sampling, eos_token_ids=(2,), max_model_len=64)
    sched.add_request(req)
    out = sched.schedule()
    sched.update(out, [first], [None])
    return req


def test_prompt_lookup_drafts_become_a_verify_row() -> None:
    sched = _scheduler(NGRAM)
    req = _prefilled(sched, [5, 6, 7, 8, 5, 6], first=7)  # "6 7" seen before: drafts 8 5 6
    out = sched.schedule()
    plan = out.plan
    assert plan is not None and plan.blocking
    assert plan.input_ids.tolist() == [7, 8, 5, 6]  # the newest token, then its drafts
    assert plan.query_lens.tolist() == [4] and plan.num_samples.tolist() == [4]
    assert plan.kv_lens.tolist() == [10]
    assert plan.sampling.token_index == [1, 2, 3, 4]
    assert plan.num_device_drafts is None
    assert req.num_computed_tokens == 10 and len(req.pages.page_ids) == 5
    # One draft accepted, then the target's own token: 2 tokens; 2 positions rolled back.
    touched = sched.update(out, [8, 9, PLACEHOLDER, PLACEHOLDER], [None] * 4)
    assert touched == [(req, 2)] and req.output_token_ids == [7, 8, 9]
    assert req.num_computed_tokens == 8 and req.num_tokens == 9
    assert len(req.pages.page_ids) == 4  # the page past the computed tokens is released
    stats = sched.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)


def test_the_draft_model_is_asked_for_k_drafts_within_max_tokens() -> None:
    sched = _scheduler(NGRAM, draft_model=True)
    _prefilled(sched, [1, 3, 4], first=9, max_tokens=3)  # 2 tokens left: at most 1 draft
    plan = sched.schedule().plan
    assert plan is not None
    assert plan.num_device_drafts is not None and plan.num_device_drafts.tolist() == [1]
    assert plan.input_ids.tolist() == [9, 0] and plan.num_samples.tolist() == [2]


def test_penalised_requests_are_drafted_for_by_the_draft_model() -> None:
    """Their drafts are counted on the device (`SpecDecoder.sample`); the host's histories
    hold none of them."""
    sched = _scheduler(NGRAM, draft_model=True)
    _prefilled(sched, [1, 3, 4], first=9, repetition_penalty=1.3)
    plan = sched.schedule().plan
    assert plan is not None and plan.num_device_drafts is not None
    assert plan.num_samples.tolist() == [1 + int(plan.num_device_drafts[0])] != [1]
    assert all(output == [9] for _, output in plan.sampling.history.values())


def test_a_stop_token_among_accepted_drafts_ends_the_request() -> None:
    sched = _scheduler(NGRAM)
    req = _prefilled(sched, [5, 6, 7, 8, 5, 6], first=7, stop_token_ids=[5])
    out = sched.schedule()
    sched.update(out, [8, 5, 6, PLACEHOLDER], [None] * 4)
    assert req.is_finished and req.output_token_ids == [7, 8, 5]
    assert sched.cache.num_used_pages == 0


def test_a_row_whose_drafts_do_not_fit_waits_rather_than_drafting_fewer() -> None:
    sched = _scheduler(NGRAM, budget=5)
    a = _prefilled(sched, [5, 6, 7, 5, 6], first=7)  # 3 drafts (5 6 7): 4 tokens
    assert a.output_token_ids == [7]  # prefilled in one step
    b = Request("b", [11, 12, 13], SamplingParams(temperature=0), (2,), max_model_len=64)
    sched.running.insert(0, b)  # b is prefilling ahead of a, 3 of the 5 tokens
    b.status = a.status
    out = sched.schedule()
    assert [s.request for s in out.seqs] == [b]


def test_a_preempted_seeded_request_resumes_with_the_verify_row_it_would_have_had() -> None:
    """Its recompute stops before the newest token (no plain draw of it); when the prefix cache
    holds all of that, it joins the batch without a row and verifies in the next step."""
    sched = _scheduler(NGRAM, draft_model=True)
    req = _prefilled(sched, [5, 6, 7, 8, 5, 6], first=7, seed=3, temperature=1.0)
    sched.update(sched.schedule(), [8, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER], [None] * 4)
    assert req.num_tokens == 8 and req.num_computed_tokens == 7
    sched.running.remove(req)
    sched._preempt(req)  # its 7 computed tokens: 3 full pages cached, 1 token not
    out = sched.schedule()
    assert [(s.num_new_tokens, s.num_samples) for s in out.seqs] == [(1, 0)]  # the 7th token
    sched.update(out, [], [])
    plan = sched.schedule().plan
    assert plan is not None and plan.num_samples.tolist() == [4]  # newest token + 3 drafts
    assert plan.sampling.token_index == [2, 3, 4, 5]


def test_a_resumed_seeded_request_whose_prefix_is_cached_joins_without_a_row() -> None:
    sched = _scheduler(NGRAM, draft_model=True)
    req = _prefilled(sched, [5, 6, 7, 8, 5], first=7, seed=3, temperature=1.0)
    sched.update(sched.schedule(), [8, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER], [None] * 4)
    assert req.num_tokens == 7 and req.num_computed_tokens == 6
    sched.running.remove(req)
    sched._preempt(req)  # its 6 computed tokens: 3 full pages, all cached
    out = sched.schedule()
    assert out.plan is None and sched.running == [req] and req.num_computed_tokens == 6
    plan = sched.schedule().plan
    assert plan is not None and plan.num_samples.tolist() == [4]
    assert plan.sampling.token_index == [2, 3, 4, 5]


def test_a_resumed_seeded_request_is_admitted_only_with_the_page_of_its_next_row() -> None:
    """Joining without a row, it still needs a page for its newest token: admitted without
    one, its verify row preempted the prompt admitted after it (found in review)."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    sched = Scheduler(config, CacheManager(2, 8, enable_prefix_caching=True), NGRAM)
    sched.host_proposer = None  # draft-model drafting
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20)
    r = Request("r", list(range(10, 18)), params, eos_token_ids=(2,), max_model_len=64)
    sched.add_request(r)
    sched.update(sched.schedule(), [7], [None])  # 9 tokens: 1 full page cached, 1 more held
    sched.running.remove(r)
    sched._preempt(r)
    w = Request("w", [40, 41, 42, 43, 44, 45], SamplingParams(temperature=0, max_tokens=5),
                eos_token_ids=(2,), max_model_len=64)  # fmt: skip
    sched.add_request(w)
    out = sched.schedule()
    assert [s.request for s in out.seqs] == [] and sched.running == [r]  # w waits
    sched.update(out, [], [])
    out = sched.schedule()
    assert not out.preempted and [s.num_samples for s in out.seqs] == [4]
