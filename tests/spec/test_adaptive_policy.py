"""Adaptive speculation's policy, without a model: the acceptance estimate, the learned step
cost, and the drafts it chooses per request for the most expected tokens per second."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tokenmill.batch import (
    ACCEPTANCE_HALF_LIFE,
    ACCEPTANCE_PRIOR,
    DRAFT_PAUSE_TOKENS,
    MAX_DRAFT_PAUSE_TOKENS,
    AcceptanceEstimate,
    Request,
)
from tokenmill.bench.speculative import ideal_tokens_per_step
from tokenmill.cache.cache_manager import CacheManager
from tokenmill.config import SchedulerConfig
from tokenmill.engine.scheduler import DECLINE_STEPS, Scheduler
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.adaptive import (
    MIN_SPEEDUP,
    PLAIN_RECHECK_STEPS,
    RECENT_MEASUREMENTS,
    StepCost,
    choose_num_drafts,
    expected_tokens,
    step_seconds,
    token_bucket,
)
from tokenmill.spec.config import SpeculativeConfig
from tokenmill.spec.ngram import NgramProposer

K = 4


def _cost(seconds, sizes=tuple(2**i for i in range(14))) -> StepCost:
    """Plain and verify steps measured from `seconds(n)` at `sizes`."""
    cost = StepCost()
    for n, verify in itertools.product(sizes, (False, True)):
        cost.observe(n, seconds(n), verify)
    return cost


def _measured(rows: int, *steps: tuple[int, float]) -> StepCost:
    """Steps of `rows` rows measured: (query tokens, seconds); more tokens than rows: verify."""
    cost = StepCost()
    for n, seconds in steps:
        cost.observe(n, seconds, verify=n > rows)
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
    cost = _measured(8, (8, 1.0), (16, 1.9), (40, 3.2))
    assert not _choose([0.8] * 8, cost=cost).any()
    cost.observe(40, 2.0, verify=True)  # the verify gets cheaper: now it pays
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


@pytest.mark.parametrize("verify", [False, True])
def test_step_cost_interpolates_and_is_optimistic_outside_what_it_measured(verify: bool) -> None:
    cost = StepCost()
    assert cost.predict(np.array([1, 1000]), verify).tolist() == [1.0, 1.0]  # nothing yet
    cost.observe(8, 2.0, verify)
    cost.observe(64, 4.0, verify)
    predicted = cost.predict(np.array([4, 8, 36, 64, 500]), verify)
    assert predicted.tolist() == pytest.approx([1.0, 2.0, 3.0, 4.0, 4.0])
    assert cost.predict(np.array([8]), not verify).tolist() == [2.0]  # the other kind: as this
    cost.observe(8, 4.0, verify)  # the lower median of the recent measurements
    assert cost.predict(np.array([8]), verify)[0] == 2.0
    cost.observe(8, 3.0, verify)
    assert cost.table(verify) == {8: (3.0, 3), 64: (4.0, 1)}


def test_plain_and_verify_steps_of_one_size_are_priced_apart() -> None:
    cost = StepCost()
    cost.observe(64, 4.3e-3, verify=True)  # 16 rows verifying 4 drafts each, read first
    cost.observe(64, 2.2e-3, verify=False)  # 64 rows decoding, overlapped
    assert cost.predict(np.array([64]), verify=True)[0] == pytest.approx(4.3e-3)
    assert cost.predict(np.array([64]), verify=False)[0] == pytest.approx(2.2e-3)


def test_a_large_batch_decodes_plain_where_verifying_few_rows_was_dear() -> None:
    # B4, Qwen3-0.6B, batch 64, a = 0.6 on an H200 (what the policy measured): verifies of
    # 64 x 5 tokens cost 5.6 ms; at the end of a run, 16 rows verifying 4 drafts each (64
    # tokens) 4.3 ms; plain steps of 48 rows, overlapped, 2.2 ms. A plain step of 64 rows is
    # about as dear as one of 48, so at a = 0.62 drafting loses (a verify yields 2.4 tokens a
    # row for 2.6 plain steps' time); priced as the verify of 64 tokens it looked a gain.
    cost = _measured(64, (320, 5.6e-3), (48, 2.2e-3))
    cost.observe(64, 4.3e-3, verify=True)
    rates, available = np.full(64, 0.62), np.full(64, 4)
    pinned = np.zeros(64, dtype=bool)
    assert not choose_num_drafts(rates, available, pinned, 0, 0, cost, padded=True).any()
    rates = np.full(64, 0.85)  # 3.7 tokens a row: drafting pays
    assert choose_num_drafts(rates, available, pinned, 0, 0, cost, padded=True).all()


def test_step_sizes_are_measured_exactly_when_small_then_per_quarter_octave() -> None:
    assert [token_bucket(n) for n in (1, 5, 16)] == [1, 5, 16]
    buckets = {token_bucket(n) for n in range(17, 1025)}
    assert len(buckets) == 4 * 6 + 1  # 16 ... 1024: six doublings, four sizes each
    assert all(abs(token_bucket(n) - n) / n < 0.1 for n in range(17, 4096))


def _verify_at(estimate: AcceptanceEstimate, rate: float, rng, num_tokens: int) -> int:  # type: ignore[no-untyped-def]
    """One verify of K drafts, each right with probability `rate` after the ones before;
    returns the request's length after it."""
    right = rng.random(K) < rate
    accepted = int(np.argmin(right)) if not right.all() else K
    estimate.observe(K, accepted, num_tokens)
    return num_tokens + accepted + 1


def test_acceptance_estimate_learns_and_drifts_back_to_its_prior() -> None:
    estimate = AcceptanceEstimate()
    assert estimate.mean(0) == pytest.approx(ACCEPTANCE_PRIOR)
    assert estimate.bound(0) > 0.95  # untried: optimistic
    tokens = 10
    for _ in range(10):
        estimate.observe(num_drafted=4, num_accepted=0, num_tokens=tokens)  # one judged
    assert estimate.mean(tokens) == pytest.approx(1.4 / 12) and estimate.bound(tokens) < 0.25
    # Evidence halves every ACCEPTANCE_HALF_LIFE of the request's tokens, drafting or not.
    later = tokens + ACCEPTANCE_HALF_LIFE
    assert estimate.mean(later) == pytest.approx(2 * ACCEPTANCE_PRIOR / (2 + 5.0), rel=1e-3)
    assert estimate.mean(tokens + 20 * ACCEPTANCE_HALF_LIFE) == pytest.approx(ACCEPTANCE_PRIOR,
                                                                              abs=1e-3)  # fmt: skip
    for _ in range(10):
        estimate.observe(num_drafted=4, num_accepted=4, num_tokens=tokens)  # none rejected
    assert estimate.mean(tokens) > 0.75


def test_two_verifies_that_accept_nothing_leave_good_drafts_on_at_cpu_cost() -> None:
    """The CPU's case, measured by B4's probe on the demo model: a step of 1, 2 and 5 tokens
    cost 17, 24 and 28 ms (a verify is synchronous). The first two verifies of a request with
    a = 0.8 accept nothing (p = 0.04). Its drafts stay on: two judged drafts are weak
    evidence (the old estimate, 0.8 worth two drafts and a decay of 0.8 per verify, fell to
    0.42, and drafting turned off). Ten more such verifies do turn it off."""
    cost = _measured(1, (1, 17.0), (2, 24.0), (5, 28.0))
    assert _choose([0.42], cost=cost).tolist() == [0]
    estimate = AcceptanceEstimate()
    for tokens in (0, 1):
        estimate.observe(num_drafted=K, num_accepted=0, num_tokens=tokens)
    assert _choose([estimate.bound(2)], cost=cost)[0] >= K - 1  # bound 0.57
    for tokens in range(2, 12):
        estimate.observe(num_drafted=K, num_accepted=0, num_tokens=tokens)
    assert _choose([estimate.bound(12)], cost=cost).tolist() == [0]


@pytest.mark.parametrize(("rate", "drafts"), [(0.6, False), (0.95, True)])
def test_where_a_verify_costs_many_decodes_only_high_acceptance_drafts(
    rate: float, drafts: bool
) -> None:
    """qwen3-0.6b on the H200 (a verify step costs 3.4 plain ones: fixed k = 4 ran x0.68 at
    a = 0.6): after a request's first verifies, a = 0.6 stops drafting and a = 0.95 keeps
    it. Stopped, it is retried now and then, as its evidence ages, not every step."""
    cost = _cost(lambda n: 1.0 if n == 1 else 3.4, sizes=range(1, 6))
    rng = np.random.default_rng(0)
    estimate, tokens, verifies = AcceptanceEstimate(), 0, 0
    for _ in range(512):
        if _choose([estimate.bound(tokens)], cost=cost).any():
            tokens = _verify_at(estimate, rate, rng, tokens)
            verifies += 1
        else:
            tokens += 1
        if tokens >= 512:
            break
    drafted_tokens = verifies * expected_tokens(np.array(rate), np.array(K))
    if drafts:
        assert drafted_tokens > 0.9 * 512
    else:
        assert 3 <= verifies < 20  # tried, then retried a few times in 512 tokens


def test_optimism_at_steady_evidence_stays_within_the_policys_margin() -> None:
    """The policy reads the bound, not the mean. With a request's steady evidence at
    a = 0.6 (k = 4), the bound's expected tokens exceed the mean's by less than
    MIN_SPEEDUP: a step chosen for >= MIN_SPEEDUP x plain decoding's rate (at batch 64,
    where a verify costs what its tokens do) is not slower than plain decoding."""
    rng = np.random.default_rng(1)
    estimate, tokens = AcceptanceEstimate(), 0
    while tokens < 20 * ACCEPTANCE_HALF_LIFE:
        tokens = _verify_at(estimate, 0.6, rng, tokens)
    bound = estimate.bound(tokens)
    assert bound > estimate.mean(tokens)
    mean = estimate.mean(tokens)
    assert mean == pytest.approx(0.6, abs=0.06)
    optimism = expected_tokens(np.array(bound), np.array(K)) / expected_tokens(
        np.array(mean), np.array(K)
    )
    assert optimism < MIN_SPEEDUP


def test_a_new_request_is_tried_and_its_verifies_decide() -> None:
    """A verify costs 2.5 decodes (a synchronous step's host time, say): good drafts pay, poor
    ones do not. A request starts untried, so it is tried; its rejections stop it."""
    cost = _measured(1, (1, 1.0), (2, 2.5), (5, 2.5))
    estimate = AcceptanceEstimate()
    assert _choose([estimate.bound(0)], cost=cost).tolist() == [K]
    for tokens in range(6):
        estimate.observe(num_drafted=K, num_accepted=0, num_tokens=tokens)
    assert _choose([estimate.bound(6)], cost=cost).tolist() == [0]


# The scheduler with the policy.

NGRAM = SpeculativeConfig("ngram", 3, prompt_lookup_max=2, prompt_lookup_min=1)


def _decoding(sched: Scheduler, rid: str, first: int = 7, **params) -> Request:  # type: ignore[no-untyped-def]
    sampling = SamplingParams(temperature=params.pop("temperature", 0), max_tokens=20, **params)
    req = Request(rid, [5, 6, 7, 8, 5, 6], sampling, eos_token_ids=(2,), max_model_len=64)
    sched.add_request(req)
    out = sched.schedule()
    sched.update(out, [first], [None])
    return req


def _scheduler(cost: StepCost, num_pages: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    cache = CacheManager(num_pages, 2, enable_prefix_caching=True)
    sched = Scheduler(config, cache, NGRAM)
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
    assert (req.acceptance.accepted, req.acceptance.rejected) == (0, 0)  # nothing verified


def test_a_stale_plain_price_is_measured_again_while_drafting() -> None:
    """While the policy drafts it measures verify steps only: the plain price it drafts
    against is measured again (one plain step, no pause) once PLAIN_RECHECK_STEPS steps old."""
    cost = _cost(_roofline(128))

    def first_step() -> tuple[list[int], Request]:
        sched = _scheduler(cost)
        req = _decoding(sched, "a")
        plan = sched.schedule().plan
        assert plan is not None
        return plan.num_samples.tolist(), req

    for _ in range(PLAIN_RECHECK_STEPS - 1 - (cost.plain_age() or 0)):
        cost.observe(4, 1.0, verify=True)
    assert first_step()[0] == [4]  # still fresh: drafts
    cost.observe(4, 1.0, verify=True)  # now PLAIN_RECHECK_STEPS old
    assert cost.plain_age() == PLAIN_RECHECK_STEPS
    samples, req = first_step()
    assert samples == [1]
    assert not req.draft_pause.active(req.num_tokens + 1)  # a recheck is not a decline
    # Measured at another size (a CUDA graph pads the rows), the plain step ends it all the
    # same: keyed by the rows' own size, the recheck had repeated on every step.
    cost.observe(2, 1.0, verify=False)
    assert first_step()[0] == [4]


def test_the_policys_no_stands_for_a_few_calls_unless_a_request_joins() -> None:
    """At batch 64 the policy's host time on every plain step slowed plain decoding: its "no"
    to requests that could draft is repeated for DECLINE_STEPS calls of `may_draft`."""
    sched = _scheduler(_cost(_roofline(1)))  # drafting does not pay
    _decoding(sched, "a")
    assert not sched.may_draft()
    sched.step_cost = _cost(_roofline(128))  # now it would
    assert [sched.may_draft() for _ in range(DECLINE_STEPS)] == [False] * (DECLINE_STEPS - 1) + [
        True
    ]
    sched.step_cost = _cost(_roofline(1))
    assert not sched.may_draft()
    sched.step_cost = _cost(_roofline(128))
    _decoding(sched, "b")  # a request joins: the policy is asked again at once
    assert sched.may_draft()


FRESH = iter(range(100, 10_000))  # tokens that never repeat: prompt lookup finds nothing


def _decode_plain(sched: Scheduler, num_steps: int) -> None:
    """`num_steps` steps, each appending a token that occurred nowhere before."""
    for _ in range(num_steps):
        out = sched.schedule()
        assert out.plan is not None and (out.plan.num_samples == 1).all()
        sched.update(out, [next(FRESH) for _ in out.seqs], [None] * len(out.seqs))


def _paused_tokens(sched: Scheduler) -> int:
    """How many plain steps, each finding nothing to draft, pass before `may_draft` says
    yes again (asking it twice a step: asking does not shorten a pause)."""
    steps = 0
    while not (sched.may_draft() or sched.may_draft()):
        _decode_plain(sched, 1)
        steps += 1
    return steps


def test_a_request_whose_lookup_finds_nothing_pauses_for_its_own_tokens() -> None:
    """Drafting pays, but prompt lookup finds nothing: the request skips drafting (plain,
    overlapped steps) for DRAFT_PAUSE_TOKENS of its tokens, twice as many after each
    further step that finds nothing, up to MAX_DRAFT_PAUSE_TOKENS."""
    sched = _scheduler(_cost(_roofline(128)), num_pages=256)
    sched.host_proposer = NgramProposer(3, min_n=3, max_n=3)
    req = _decoding(sched, "a", first=next(FRESH))
    req.params = SamplingParams(temperature=0, max_tokens=1000)
    req.max_model_len = 1000
    pauses = []
    for _ in range(6):
        assert sched.may_draft()  # as if the request found drafts: try
        _decode_plain(sched, 1)  # it found none
        pauses.append(_paused_tokens(sched))
    assert pauses == [min(DRAFT_PAUSE_TOKENS * 2**i, MAX_DRAFT_PAUSE_TOKENS) for i in range(6)]


def test_a_pause_is_the_requests_own() -> None:
    """A pause is counted in its request's tokens: asking `may_draft` (as every engine step
    does, prefill-only steps included) does not shorten it, and it does not pass on to the
    next request."""
    sched = _scheduler(_cost(_roofline(128)))
    sched.host_proposer = NgramProposer(3, min_n=3, max_n=3)
    first = _decoding(sched, "a", first=next(FRESH))
    _decode_plain(sched, 1)  # nothing found: paused
    for _ in range(10):
        assert not sched.may_draft()
    assert _paused_tokens(sched) == DRAFT_PAUSE_TOKENS
    _decode_plain(sched, 1)  # found nothing again: paused for longer
    assert first.draft_pause.active(first.num_tokens)
    sched.abort("a")
    second = _decoding(sched, "b", first=7)  # "5 6 7" occurred: drafts "8 5 6"
    assert sched.may_draft()
    out = sched.schedule()
    assert [(s.request, s.num_samples) for s in out.seqs] == [(second, 4)]


def test_a_request_at_its_last_token_does_not_pause_drafting() -> None:
    """A request whose drafts are limited to none by max_tokens (its last token) decodes
    plain without starting a pause: the pause is for prompt lookup finding nothing (B4's
    warm-up request started one, which then delayed the measured request)."""
    sched = _scheduler(_cost(_roofline(128)))
    req = _decoding(sched, "a")
    req.params = SamplingParams(temperature=0, max_tokens=2)  # one token left: no drafts
    out = sched.schedule()
    assert out.plan is not None and out.plan.num_samples.tolist() == [1]
    assert not req.draft_pause.active(req.num_tokens)
    assert req.draft_pause.length == DRAFT_PAUSE_TOKENS


def test_a_seeded_sampled_request_keeps_its_drafts_in_any_batch() -> None:
    sched = _scheduler(_cost(_roofline(1)))
    _decoding(sched, "seeded", temperature=0.8, seed=3)
    assert sched.may_draft()  # its drafts must not depend on the batch: never overlapped
    plan = sched.schedule().plan
    assert plan is not None and plan.num_samples.tolist() == [4]


def test_a_seeded_sampled_request_is_never_paused() -> None:
    """Its drafts must not depend on its batch, and whether its newest token is read when
    `may_draft` asks does: prompt lookup finding nothing leaves it drafting next step."""
    sched = _scheduler(_cost(_roofline(128)))
    sched.host_proposer = NgramProposer(3, min_n=3, max_n=3)
    req = _decoding(sched, "seeded", first=next(FRESH), temperature=0.8, seed=3)
    _decode_plain(sched, 1)  # nothing found
    assert not req.draft_pause.active(req.num_tokens)
    assert sched.may_draft()


def test_verified_rows_update_their_acceptance() -> None:
    sched = _scheduler(_cost(_roofline(128)))
    req = _decoding(sched, "a")
    out = sched.schedule()  # drafts 8 5 6
    sched.update(out, [8, 9, -1, -1], [None] * 4)  # one accepted, the second rejected
    assert (req.acceptance.accepted, req.acceptance.rejected) == (1, 1)
    assert req.acceptance.num_tokens == 7  # its length when verified


def test_a_step_costs_its_launch_interval_except_a_synchronous_plain_one_on_the_gpu() -> None:
    # 3 ms of device time, 5 ms from its launch to the next: a verify step (read before the
    # next launch, or overlapped) cost the interval; so did any step on the CPU.
    assert step_seconds(3.0, 5.0, synchronous=True, plain=False, overlaps=True) == 5.0
    assert step_seconds(3.0, 3.2, synchronous=False, plain=True, overlaps=True) == 3.2
    assert step_seconds(3.0, 5.0, synchronous=True, plain=True, overlaps=False) == 5.0
    # A plain step on the GPU read first counts as overlapped (device and host's 2 ms): that is
    # how plain steps run once nothing drafts, and what a verify step must beat.
    assert step_seconds(3.0, 5.0, synchronous=True, plain=True, overlaps=True) == 3.0
    assert step_seconds(3.0, 9.0, synchronous=True, plain=True, overlaps=True) == 6.0


def test_a_plain_step_measured_synchronously_does_not_make_drafting_look_cheap() -> None:
    # Batch 64 at a = 0.64: a verify of 64 x 5 tokens costs 8.9 ms, a plain step 2.6 ms of
    # device time with 1.5 ms of host work. Counted overlapped, the plain step wins.
    rates, available = np.full(64, 0.64), np.full(64, 4)
    pinned = np.zeros(64, dtype=bool)
    for overlaps, drafting in [(True, False), (False, True)]:
        cost = StepCost()
        plain = step_seconds(2.6e-3, 4.1e-3, True, plain=True, overlaps=overlaps)
        cost.observe(64, plain, verify=False)
        cost.observe(320, 8.9e-3, verify=True)
        chosen = choose_num_drafts(rates, available, pinned, 0, 0, cost, padded=True)
        assert chosen.any() == drafting


def test_a_step_is_priced_no_dearer_than_a_larger_one() -> None:
    # B4, llama-3.1-8b, batch 256, a = 0.6 on an H200 (what the policy measured): the one
    # plain step of 256 rows it measured took 62 ms (plain decoding ran 14 ms a step), verifies
    # of 256 x 1 and 256 x 3 tokens 14.4 and 31.7 ms, one of 256 x 2 tokens (no graph) 50 ms.
    cost = _measured(256, (256, 62e-3), (512, 50e-3), (724, 31.7e-3))
    cost.observe(256, 14.4e-3, verify=True)
    assert cost.predict(np.array([256]), verify=False)[0] == pytest.approx(14.4e-3)
    assert cost.predict(np.array([512]), verify=True)[0] == pytest.approx(31.7e-3)
    assert cost.predict(np.array([100]), verify=True)[0] <= 14.4e-3
    rates, available = np.full(256, 0.62), np.full(256, 4)
    pinned = np.zeros(256, dtype=bool)
    assert not choose_num_drafts(rates, available, pinned, 0, 0, cost, padded=True).any()
    # A verify is not capped by plain steps: read first, it carries the host's work.
    cost = _measured(64, (64, 2.0e-3), (80, 3.0e-3))
    cost.observe(40, 3.0e-3, verify=True)
    assert cost.predict(np.array([40]), verify=True)[0] == pytest.approx(3.0e-3)


def test_steps_measured_far_too_dear_do_not_turn_drafting_on() -> None:
    """B4 on an H200, Qwen3-0.6B, batch 64, a = 0.6 (the costs the policy learnt: a plain step
    of 64 rows 2.84 ms, verifies of 64 x 2 / 64 x 4 / 64 x 5 tokens 6.63 / 6.88 / 7.43 ms):
    a plain step held up 20x (a garbage collection) moved an averaged price far enough that
    the policy drafted, and, drafting, never measured a plain step again (x0.92 of plain
    decoding). A size's price is the lower median of its recent measurements: outliers among
    fewer than half of them do not move it; a steady new cost takes over."""
    cost = _measured(64, *[(64, 2.84e-3)] * RECENT_MEASUREMENTS)
    for n, seconds in ((128, 6.63e-3), (256, 6.88e-3), (320, 7.43e-3)):
        cost.observe(n, seconds, verify=True)
    outliers = (RECENT_MEASUREMENTS - 1) // 2
    for _ in range(outliers):
        cost.observe(64, 20 * 2.84e-3, verify=False)
        assert cost.predict(np.array([64]), verify=False)[0] == pytest.approx(2.84e-3)
    rates, available = np.full(64, 0.6), np.full(64, 4)
    pinned = np.zeros(64, dtype=bool)
    assert not choose_num_drafts(rates, available, pinned, 0, 0, cost, padded=True).any()
    for _ in range(RECENT_MEASUREMENTS):
        cost.observe(64, 4e-3, verify=False)
    assert cost.predict(np.array([64]), verify=False)[0] == pytest.approx(4e-3)
    assert cost.table(verify=False)[64] == (4e-3, 2 * RECENT_MEASUREMENTS + outliers)


def test_a_verify_is_capped_by_the_plain_steps_it_is_priced_between() -> None:
    cost = _measured(16, (8, 5.0), (16, 2.0), (40, 10.0))  # plain 8 and 16, a verify of 40
    assert cost.predict(np.array([8]), verify=False)[0] == pytest.approx(2.0)
    assert cost.predict(np.array([8]), verify=True)[0] == pytest.approx(2.0)


def test_a_batch_is_judged_by_its_total_not_by_every_rows_optimism() -> None:
    """64 requests, each verified 10 times at a = 0.6, costs as measured on an H200 for
    Qwen3-0.6B (a plain step of 64 rows 2.78 ms, verifies of 64 x 2 and 64 x 5 tokens 5.4
    and 6.43 ms: drafting pays only from a ~ 0.65). Each row's own bound (mean + 1 sd, ~0.69
    after 10 verifies) would draft; the batch's total gain is uncertain by sqrt(64) sds, not
    64, so the policy reads each row at mean + 1/8 sd and decodes plain (B4 at batch 64,
    a = 0.6: adaptive speculation spent the first ~40 steps of a run verifying)."""
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024)
    sched = Scheduler(config, CacheManager(1024, 16, enable_prefix_caching=False), NGRAM)
    sched.host_proposer = None  # every row offers k drafts
    sched.step_cost = _measured(64, (64, 2.78e-3), (128, 5.4e-3), (320, 6.43e-3))
    sched.padded_verify_rows = 64
    params = SamplingParams(temperature=0, max_tokens=200)
    rows = [Request(str(i), [5, 6, 7, 8], params, eos_token_ids=(2,), max_model_len=512)
            for i in range(64)]  # fmt: skip
    for req in rows:
        sched.add_request(req)
    out = sched.schedule()  # every prompt in one step
    sched.update(out, [9] * len(out.seqs), [None] * len(out.seqs))
    rng = np.random.default_rng(0)
    for req in rows:
        tokens = 0
        for _ in range(10):
            tokens = _verify_at(req.acceptance, 0.6, rng, tokens)
        req.acceptance.num_tokens = req.num_tokens  # the evidence is fresh
    own = np.array([r.acceptance.bound(r.num_tokens) for r in rows])
    k = np.full(64, NGRAM.num_speculative_tokens)
    assert choose_num_drafts(own, k, np.zeros(64, dtype=bool), 0, 0, sched.step_cost,
                             padded=True).any()  # fmt: skip
    assert not sched.may_draft()
    for req in rows:  # at a = 0.9 the batch drafts (once the standing "no" runs out)
        tokens = req.num_tokens
        for _ in range(30):
            tokens = _verify_at(req.acceptance, 0.9, rng, tokens)
        req.acceptance.num_tokens = req.num_tokens
    assert [sched.may_draft() for _ in range(DECLINE_STEPS)][-1]
