"""Adaptive speculation's policy, without a model: the acceptance estimate, the learned step
cost, and the drafts it chooses per request for the most expected tokens per second."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.batch import ACCEPTANCE_PRIOR, AcceptanceEstimate, Request
from tokenmill.bench.speculative import ideal_tokens_per_step
from tokenmill.cache.cache_manager import CacheManager
from tokenmill.config import SchedulerConfig
from tokenmill.engine.scheduler import PLAIN_STEPS_AFTER_NO_DRAFTS, Scheduler
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.adaptive import StepCost, choose_num_drafts, expected_tokens, token_bucket
from tokenmill.spec.config import SpeculativeConfig
from tokenmill.spec.ngram import NgramProposer

K = 4


def _cost(seconds, sizes=tuple(2**i for i in range(14))) -> StepCost:
    """A cost table measured from `seconds(n)` at `sizes`."""
    cost = StepCost()
    for n in sizes:
        cost.observe(n, seconds(n))
    return cost


def _roofline(knee: int):  # type: ignore[no-untyped-def]
    """A step reads the weights (1 unit) until `knee` tokens, then is compute-bound."""
    return lambda n: max(1.0, n / knee)


def _choose(  # type: ignore[no-untyped-def]
    rates, available=None, pinned=None, cost=None, other_tokens=0, other_rows=0, padded=False
):
    rates = np.asarray(rates, dtype=np.float64)
    available = np.full(len(rates), K) if available is None else np.asarray(available)
    pinned = np.zeros(len(rates), dtype=bool) if pinned is None else np.asarray(pinned)
    cost = cost if cost is not None else _cost(_roofline(128))
    return choose_num_drafts(rates, available, pinned, other_tokens, other_rows, cost, padded)


def test_expected_tokens_is_the_geometric_ideal() -> None:
    for a in (0.0, 0.3, 0.8, 0.999999):
        for k in range(6):
            assert expected_tokens(np.array(a), np.array(k)) == pytest.approx(
                ideal_tokens_per_step(a, k), rel=1e-6
            )


def test_high_acceptance_in_a_small_batch_drafts_k() -> None:
    assert _choose([0.8, 0.9, 0.6]).tolist() == [K, K, K]


def test_low_acceptance_turns_drafting_off() -> None:
    # A step whose cost grows a little with its tokens: drafts that are rarely right lose.
    cost = _cost(lambda n: 1 + 0.05 * n)
    assert _choose([0.05, 0.02], cost=cost).tolist() == [0, 0]
    assert _choose([0.9, 0.9], cost=cost).tolist() == [K, K]


def test_a_near_tie_decodes_plain() -> None:
    """Drafts right 80% of the time at a cost that makes every k a gain of 7% at most on
    paper (k = 4: 3.36 tokens for 3.2 decodes), within the noise of measured costs."""
    cost = StepCost()
    for n, seconds in ((8, 1.0), (16, 1.9), (40, 3.2)):
        cost.observe(n, seconds)
    assert not _choose([0.8] * 8, cost=cost).any()
    cost.observe(40, 2.0)  # the verify gets cheaper: now it pays
    assert _choose([0.8] * 8, cost=cost).any()


def test_large_batch_turns_speculation_off() -> None:
    """Past the knee a drafted token costs what a decode does and yields less than one."""
    assert not _choose([0.9] * 256).any()
    assert not _choose([0.99] * 512, cost=_cost(_roofline(256))).any()
    # Near the knee, fewer drafts fit before the step turns compute-bound.
    near = _choose([0.8] * 64)
    assert 0 < near.max() < K


def test_each_row_drafts_by_its_own_acceptance() -> None:
    cost = _cost(lambda n: 1 + 0.03 * n)
    chosen = _choose([0.95, 0.1, 0.9, 0.05], cost=cost)
    assert chosen[0] > 0 and chosen[2] > 0
    assert chosen[1] == 0 and chosen[3] == 0


def test_with_cuda_graphs_every_row_pays_for_the_longest() -> None:
    """A verify graph computes every row at the longest row's length: rows drafting fewer
    save nothing, and one drafting row among many costs them all."""
    cost = _cost(lambda n: 1 + 0.03 * n)
    rates = [0.95, 0.1, 0.9, 0.05]
    assert _choose(rates, cost=cost).tolist() == [K, 0, K, 0]  # eager: doubtful rows save
    assert _choose(rates, cost=cost, padded=True).tolist() == [K] * 4  # graphs: free drafts
    # Four rows that can draft beside 100 whose tokens are on the device: 120 tokens, or with
    # graphs at least 104 x 2, past the knee.
    beside_decodes = {"other_tokens": 100, "other_rows": 100, "cost": _cost(_roofline(128))}
    assert _choose([0.99] * 4, **beside_decodes).tolist() == [K] * 4
    assert not _choose([0.99] * 4, **beside_decodes, padded=True).any()


def test_rows_draft_no_more_than_they_can_and_pinned_rows_keep_theirs() -> None:
    chosen = _choose([0.9, 0.9, 0.01], available=[2, 0, 3], pinned=[False, False, True])
    assert chosen.tolist() == [2, 0, 3]
    # A compute-bound batch still verifies a pinned row's drafts (its tokens must not
    # depend on its batch).
    chosen = _choose([0.9] * 300, pinned=[True] + [False] * 299)
    assert chosen[0] == K and not chosen[1:].any()


def test_other_rows_of_the_step_count_towards_its_cost() -> None:
    """Rows whose token is still on the device fill the step up to the knee: drafts for the
    rest no longer pay."""
    alone = _choose([0.8] * 8)
    beside_decodes = _choose([0.8] * 8, other_tokens=120, other_rows=120)
    assert alone.tolist() == [K] * 8 and not beside_decodes.any()


def test_step_cost_interpolates_and_is_optimistic_outside_what_it_measured() -> None:
    cost = StepCost()
    assert cost.predict(np.array([1, 1000])).tolist() == [1.0, 1.0]  # nothing measured yet
    cost.observe(8, 2.0)
    cost.observe(64, 4.0)
    predicted = cost.predict(np.array([4, 8, 36, 64, 500]))
    assert predicted.tolist() == pytest.approx([1.0, 2.0, 3.0, 4.0, 4.0])
    cost.observe(8, 4.0)  # a weighted mean: the newest measurement moves it part way
    assert 2.0 < cost.predict(np.array([8]))[0] < 4.0


def test_step_sizes_are_measured_exactly_when_small_then_per_quarter_octave() -> None:
    assert [token_bucket(n) for n in (1, 5, 16)] == [1, 5, 16]
    buckets = {token_bucket(n) for n in range(17, 1025)}
    assert len(buckets) == 4 * 6 + 1  # 16 ... 1024: six doublings, four sizes each
    assert all(abs(token_bucket(n) - n) / n < 0.1 for n in range(17, 4096))


def test_acceptance_estimate_learns_and_drifts_back_to_its_prior() -> None:
    estimate = AcceptanceEstimate()
    assert estimate.rate == ACCEPTANCE_PRIOR
    for _ in range(10):
        estimate.observe(num_drafted=4, num_accepted=0)  # one draft judged each time
    assert estimate.rate < 0.3
    for _ in range(30):
        estimate.fade()
    assert estimate.rate == pytest.approx(ACCEPTANCE_PRIOR, abs=0.01)
    for _ in range(10):
        estimate.observe(num_drafted=4, num_accepted=4)  # none rejected: nothing but success
    assert estimate.rate > 0.9


def test_a_new_request_is_tried_and_its_verifies_decide() -> None:
    """A verify costs 2.5 decodes (a synchronous step's host time, say): good drafts pay, poor
    ones do not. A request starts as a good draft, so it is tried; its rejections stop it."""
    cost = StepCost()
    for n, seconds in ((1, 1.0), (2, 2.5), (5, 2.5)):
        cost.observe(n, seconds)
    estimate = AcceptanceEstimate()
    assert _choose([estimate.rate], cost=cost).tolist() == [K]
    for _ in range(3):
        estimate.observe(num_drafted=K, num_accepted=0)
    assert _choose([estimate.rate], cost=cost).tolist() == [0]


# The scheduler with the policy.

NGRAM = SpeculativeConfig("ngram", 3, prompt_lookup_max=2, prompt_lookup_min=1)


def _decoding(sched: Scheduler, rid: str, first: int = 7, **params) -> Request:  # type: ignore[no-untyped-def]
    sampling = SamplingParams(temperature=params.pop("temperature", 0), max_tokens=20, **params)
    req = Request(rid, [5, 6, 7, 8, 5, 6], sampling, eos_token_ids=(2,), max_model_len=64)
    sched.add_request(req)
    out = sched.schedule()
    sched.update(out, [first], [None])
    return req


def _scheduler(cost: StepCost) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    sched = Scheduler(config, CacheManager(64, 2, enable_prefix_caching=True), NGRAM)
    sched.step_cost = cost
    return sched


def test_scheduler_drafts_while_steps_are_memory_bound() -> None:
    sched = _scheduler(_cost(_roofline(128)))
    _decoding(sched, "a")
    assert sched.may_draft()
    plan = sched.schedule().plan
    assert plan is not None and plan.num_samples.tolist() == [4]
    assert sched.spec_stats.chosen_drafts.counts[3] == 1  # 3 drafts chosen, once


def test_scheduler_decodes_plain_and_overlapped_when_compute_bound() -> None:
    sched = _scheduler(_cost(_roofline(1)))  # every extra token costs a whole step
    req = _decoding(sched, "a")
    assert not sched.may_draft()
    out = sched.schedule()
    assert out.plan is not None and out.plan.num_samples.tolist() == [1]
    assert not out.plan.blocking
    sched.update(out, [9], [None])
    assert sched.spec_stats.chosen_drafts.counts[0] == 1
    assert req.acceptance.judged == 0  # nothing verified, nothing learned
    # Drafting nothing keeps the next steps plain (overlapped) without asking the policy,
    # twice as many after each further step that drafts nothing, until one drafts.
    sched.step_cost = _cost(_roofline(128))
    assert _plain_steps_before_drafting(sched) == PLAIN_STEPS_AFTER_NO_DRAFTS
    sched.host_proposer = NgramProposer(3, min_n=3, max_n=3)  # "6 7 9" occurred nowhere
    sched.update(sched.schedule(), [11], [None])
    assert _plain_steps_before_drafting(sched) == 2 * PLAIN_STEPS_AFTER_NO_DRAFTS


def _plain_steps_before_drafting(sched: Scheduler) -> int:
    """How many times `may_draft` says no before it says yes."""
    steps = 0
    while not sched.may_draft():
        steps += 1
    return steps


def test_a_seeded_sampled_request_keeps_its_drafts_in_any_batch() -> None:
    sched = _scheduler(_cost(_roofline(1)))
    _decoding(sched, "seeded", temperature=0.8, seed=3)
    assert sched.may_draft()  # its drafts must not depend on the batch: never overlapped
    plan = sched.schedule().plan
    assert plan is not None and plan.num_samples.tolist() == [4]


def test_verified_rows_update_their_acceptance() -> None:
    sched = _scheduler(_cost(_roofline(128)))
    req = _decoding(sched, "a")
    out = sched.schedule()  # drafts 8 5 6
    sched.update(out, [8, 9, -1, -1], [None] * 4)  # one accepted, the second rejected
    assert (req.acceptance.accepted, req.acceptance.judged) == (1, 2)
