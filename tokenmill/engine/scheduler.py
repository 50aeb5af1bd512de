"""Scheduler: picks each step's batch under the token budget, admits, preempts and finishes."""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tokenmill.batch import (
    ACCEPTANCE_OPTIMISM,
    FinishReason,
    Logprob,
    Request,
    RequestStatus,
    ScheduledSeq,
    SchedulerOutput,
    StepPlan,
)
from tokenmill.cache.cache_manager import CacheManager
from tokenmill.config import SchedulerConfig
from tokenmill.spec.adaptive import PLAIN_RECHECK_STEPS, StepCost, choose_num_drafts
from tokenmill.spec.config import SpeculativeConfig
from tokenmill.spec.proposer import HostProposer
from tokenmill.spec.rejection import PLACEHOLDER
from tokenmill.spec.stats import SpecDecodeStats

logger = logging.getLogger(__name__)

# How many waiting requests the cache-aware policy compares per admission.
CACHE_AWARE_SCAN = 128
# A prompt that waits a step whole lets the next this many waiting prompts fill the step, each
# that fits it whole (`Scheduler._admit_whole`).
WHOLE_FILL_SCAN = 16
# Once adaptive speculation declines to draft for the running batch, `may_draft` repeats that
# answer for this many calls before asking the policy again (unless requests joined): at batch
# 64 the policy's host time, spent on every plain step, made plain steps under adaptive
# speculation 17% slower than plain decoding's (3.15 vs 2.69 ms, Qwen3-0.6B on an H200).
DECLINE_STEPS = 4


@dataclass
class SchedulerStats:
    """Counters the metrics endpoint reads."""

    num_preemptions: int = 0


class Scheduler:
    """Continuous batching with chunked prefill and mixed prefill/decode batches.

    Each step serves running requests first (one decode token each, or their next prefill chunk),
    then admits waiting requests while the token budget, the sequence cap and free pages allow.
    When a running request cannot get a page, the most recently admitted request is preempted
    (its pages are released and it is recomputed later, keeping its generated tokens).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheManager,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.speculative = speculative
        # Replaceable: B4's oracle proposer stands in for prompt lookup.
        self.host_proposer = _host_proposer(speculative)
        self.spec_stats = SpecDecodeStats()
        # Adaptive speculation: the measured seconds of a step by its size (the engine core
        # reports each step it measures).
        self.step_cost = StepCost()
        # With CUDA graphs, decode/verify steps of up to this many rows compute every row at
        # the longest row's length (the engine core sets it from the runner; 0: no padding).
        self.padded_verify_rows = 0
        # Prompts of at least this many tokens attend faster whole than in chunks (the engine
        # core sets it from the attention backend; 0: split any prompt to fill a step).
        self.whole_prompt_min_tokens = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._admissions = 0  # requests admitted into `running`, ever
        # `may_draft`'s last "no": the admissions it saw, and the steps it still stands for.
        self._declined: tuple[int, int] = (0, 0)

    def add_request(self, req: Request) -> None:
        """Queue a request at the back of the waiting queue."""
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self, in_flight: Mapping[Request, range] | None = None) -> SchedulerOutput:
        """Build the next batch and its plan, and count its tokens as computed (the caller
        launches it).

        `in_flight`: for each request the previous (launched, unread) step sampled for, that
        token's entries among its sampled tokens; the batch feeds them back from the device.
        """
        in_flight = in_flight or {}
        out = SchedulerOutput()
        if self.config.policy == "priority":
            # Higher priority first: scheduled first, admitted first, preempted last.
            self.running.sort(key=_priority)
            self.waiting = deque(sorted(self.waiting, key=_priority))
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget, in_flight)
        if not out.preempted:
            self._admit_waiting(out, budget, in_flight)
        if out.seqs:
            out.plan = StepPlan.build(out.seqs, self.cache.page_size)
        for seq in out.seqs:
            seq.request.num_computed_tokens += seq.num_new_tokens
        return out

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, in_flight: Mapping[Request, range]
    ) -> int:
        num_drafts = self._plan_drafts(in_flight)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            unread = in_flight.get(req)
            num_unread = len(unread) if unread else 0
            if num_unread and req.finishes_with(num_unread):
                i += 1  # its in-flight token is its last: nothing more to compute
                continue
            uncomputed = req.num_uncomputed_tokens(num_unread)
            verify = self._verify_row(req, num_drafts.get(req, 0))
            if verify is not None and verify.num_new_tokens > budget:
                i += 1  # waits for a step with room for all its drafts (see _verify_row)
                continue
            if verify is not None:
                num_new = verify.num_new_tokens
            elif uncomputed > 1:  # a prefill chunk
                num_new = min(uncomputed - self._held_back(req), budget)
            else:
                num_new = min(uncomputed, budget)
            while not self.cache.allocate(req.pages, req.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.seqs.append(verify or _row(req, num_new, uncomputed, unread))
                budget -= num_new
                i += 1
        return budget

    def may_draft(self) -> bool:
        """Whether the next step may verify drafts, and so must be scheduled with every
        generated token read (drafts continue the newest token).

        Adaptive speculation says no when it expects to draft nothing for the running batch
        even if every request had drafts to offer; a request whose drafting is paused
        (`Request.draft_pause`: its last step could have drafted but did not) offers none.
        Plain decoding then keeps overlap scheduling. A seeded sampled request that can
        draft always makes it yes: its drafts must not depend on its batch. The policy's "no"
        to requests that could draft is the answer for `DECLINE_STEPS` calls (one a step)
        unless a request joins the batch.
        """
        spec = self.speculative
        if spec is None or not spec.adaptive:
            return spec is not None
        decoding = [r for r in self.running if r.num_uncomputed_tokens(0) <= 1]
        k = self._max_drafts()
        if any(_pinned(r) and self._max_offer(r, k) for r in decoding):
            return True
        admissions, steps = self._declined
        if steps and admissions == self._admissions:  # no request joined since the last "no"
            self._declined = (admissions, steps - 1)
            return False
        # Optimistic for prompt lookup: as if every request found k drafts.
        available = np.array([self._max_offer(r, k) for r in decoding], dtype=np.int64)
        drafts = bool(self._adaptive_drafts(decoding, available, {}).any())
        # Only the policy's own "no" stands (a pause ends at a request's token, exactly).
        declined = not drafts and bool(available.any())
        self._declined = (self._admissions, DECLINE_STEPS - 1 if declined else 0)
        return drafts

    def _plan_drafts(self, in_flight: Mapping[Request, range]) -> dict[Request, int]:
        """How many tokens each decoding request drafts this step (absent: none).

        A host proposer drafts first (up to k each), so each request's offer is known; then
        adaptive speculation chooses how many of them to verify (`spec/adaptive.py`). Without
        it a request drafts all it can. The number of drafts depends on the request alone
        where its tokens must not depend on its batch (a seeded sampled request).
        """
        if self.speculative is None:
            return {}
        ready = [r for r in self.running if _decoding(r, in_flight)]
        if not ready:
            return {}
        k = self._max_drafts()
        adaptive = self.speculative.adaptive
        # What each may draft: within max_tokens and the context, none while paused.
        offers = np.array([self._max_offer(r, k) if adaptive else r.max_drafts(k)
                           for r in ready], dtype=np.int64)  # fmt: skip
        available = offers
        if self.host_proposer is not None:
            drafts = self.host_proposer.propose([r.token_array() for r in ready], offers)
            for row, req in enumerate(ready):
                proposed = drafts.token_ids[row, : drafts.num_drafts[row]].tolist()
                if req.grammar is not None:  # only drafts the grammar allows can be accepted
                    proposed = proposed[: req.grammar.valid_prefix(proposed)]
                req.draft_token_ids = proposed
            available = np.array([len(r.draft_token_ids) for r in ready], dtype=np.int64)
        chosen = available
        if adaptive:
            chosen = self._adaptive_drafts(ready, available, in_flight)
            if self._recheck_plain(ready, chosen, in_flight):
                chosen = np.zeros_like(chosen)  # one plain step, not a decline: no pause
            else:
                _pause_after(ready, offers, chosen)
        num_drafts = {}
        for req, offered, n in zip(ready, available.tolist(), chosen.tolist(), strict=True):
            req.draft_token_ids = req.draft_token_ids[:n]
            if offered:
                self.spec_stats.chosen_drafts.observe(n)
            if n:
                num_drafts[req] = n
        return num_drafts

    def _adaptive_drafts(
        self, ready: list[Request], available: np.ndarray, in_flight: Mapping[Request, range]
    ) -> np.ndarray:
        """Adaptive speculation's drafts for the decoding requests `ready`, which can draft
        `available` tokens each, given the rest of the running batch."""
        drafting = set(ready)
        others = [r for r in self.running if r not in drafting]
        budget = self.config.max_num_batched_tokens
        unread = [len(in_flight.get(r) or ()) for r in others]
        other_tokens = sum(min(r.num_uncomputed_tokens(n), budget)
                           for r, n in zip(others, unread, strict=True))  # fmt: skip
        # Only decode and verify rows (no prefill chunk) run a verify graph.
        padded = other_tokens == len(others) and len(self.running) <= self.padded_verify_rows
        # A step is judged by its rows' total expected gain, whose uncertainty grows as the
        # square root of the rows: each row is read at mean + 1 / sqrt(rows) sd (B4 at batch
        # 64, a = 0.6: every row read at mean + 1 sd kept 64 rows verifying for ~40 steps).
        optimism = ACCEPTANCE_OPTIMISM / math.sqrt(max(len(ready), 1))
        return choose_num_drafts(
            np.array([r.acceptance.bound(r.num_tokens, optimism) for r in ready]),
            available,
            np.array([_pinned(r) for r in ready], dtype=bool),
            other_tokens,
            len(others),
            self.step_cost,
            padded,
        )

    def _recheck_plain(
        self, ready: list[Request], chosen: np.ndarray, in_flight: Mapping[Request, range]
    ) -> bool:
        """Whether this step, where the policy drafts, decodes plain instead to measure what
        a plain step costs now (`PLAIN_RECHECK_STEPS`): the last plain step measured is that
        many measured steps old. Never with a seeded sampled row drafting (its drafts must
        not depend on the batch) or a prefill chunk in the step (not measured); measured, the
        plain step ends the recheck whatever its size."""
        if not chosen.any() or any(_pinned(r) for r, n in zip(ready, chosen, strict=True) if n):
            return False
        if any(r.num_uncomputed_tokens(len(in_flight.get(r) or ())) > 1 for r in self.running):
            return False
        age = self.step_cost.plain_age()
        return age is not None and age >= PLAIN_RECHECK_STEPS

    def _max_offer(self, req: Request, k: int) -> int:
        """The most drafts `req` can verify this step under adaptive speculation: what the
        draft model will make, none while its drafting is paused (`_pause_after`); with
        prompt lookup, an upper bound."""
        if req.draft_pause.active(req.num_tokens):
            return 0
        return req.max_drafts(k)

    def _max_drafts(self) -> int:
        """Drafts per verify: k, within the step's token budget."""
        assert self.speculative is not None
        k = self.speculative.num_speculative_tokens
        return min(k, self.config.max_num_batched_tokens - 1)

    def _verify_row(self, req: Request, num_drafts: int) -> ScheduledSeq | None:
        """A decoding request's row when it drafts `num_drafts` tokens: its newest token and
        its drafts (the host proposer's, or the draft model's at launch).

        The number of drafts never depends on the budget left by the rest of the batch, so a
        seeded request draws the same tokens in any batch; a row that does not fit waits for
        the next step.
        """
        if not num_drafts:
            return None
        drafts = tuple(req.draft_token_ids)
        req.draft_token_ids = []
        num_device = 0 if self.host_proposer is not None else num_drafts
        return ScheduledSeq(req, req.num_computed_tokens, 1 + num_drafts, 1 + num_drafts,
                            drafts=drafts, num_device_drafts=num_device)  # fmt: skip

    def _held_back(self, req: Request) -> int:
        """1 when the recompute of preempted `req` stops short of its newest token, else 0.

        A seeded sampled request (`_pinned`) under speculation draws each token from the step
        that verifies it: as a draft accepted or replaced, or after the drafts, from other
        draws than a plain step's. Its steps must therefore follow its tokens alone, so a
        recompute after preemption computes every token but the newest, which then continues
        in a decode or verify row, as it would have without the preemption (a recompute that
        ends sampling would draw that token plain)."""
        resumes = self.speculative is not None and bool(req.output_token_ids)
        return int(resumes and _pinned(req))

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s at %d tokens", req.request_id, req.num_tokens)

    def _admit_waiting(
        self, out: SchedulerOutput, budget: int, in_flight: Mapping[Request, range]
    ) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._next_waiting()
            if req in in_flight:
                return  # preempted while its last token was in flight: admit once it lands
            req.num_computed_tokens = self.cache.match_prefix(req.pages, _prefix_key(req))
            uncomputed = req.num_uncomputed_tokens(0)
            held = self._held_back(req)
            num_new = min(uncomputed - held, budget)
            # A recompute that ends in this step covers all its tokens, the newest's slot too
            # (as `_admit_whole`'s): its next row needs it (admitted without it, that row
            # preempted a request admitted after it, or the request itself, step after step).
            ends = num_new == uncomputed - held
            end = req.num_tokens if ends else req.num_computed_tokens + num_new
            waits = self._waits_whole(out, req, uncomputed, budget)
            if waits or not self.cache.allocate(req.pages, end):
                self._release(req)
                req.num_computed_tokens = 0
                if waits:
                    self._admit_whole(out, budget, in_flight, req)
                return
            self._admit(out, req, num_new, uncomputed)
            budget -= num_new

    def _admit(self, out: SchedulerOutput, req: Request, num_new: int, uncomputed: int) -> None:
        """Move waiting `req` (its pages allocated) to running with a row of `num_new` tokens."""
        self.waiting.remove(req)
        self.cache.record_lookup(req.num_tokens, req.num_computed_tokens)
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens
        if req.scheduled_time is None:
            req.scheduled_time = time.time()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._admissions += 1
        if num_new:  # none: a resumed request whose newest token waits for its verify row
            out.seqs.append(_row(req, num_new, uncomputed, None))

    def _admit_whole(
        self,
        out: SchedulerOutput,
        budget: int,
        in_flight: Mapping[Request, range],
        waiter: Request,
    ) -> None:
        """Fill what the rows before `waiter`, a prompt that waits whole (`_waits_whole`), left
        of the step's `budget` with those of the next `WHOLE_FILL_SCAN` waiting prompts (in
        line, under either policy) that fit it whole, while the waiter keeps what it needs to
        run whole in the next step: a sequence slot, its pages, and its tokens beside a row for
        every running request. The waiter keeps its place in line."""
        need = self.cache.pages_needed(waiter.num_tokens)
        for req in list(itertools.islice(self.waiting, WHOLE_FILL_SCAN + 1)):
            if budget <= 0 or len(self.running) + 1 >= self.config.max_num_seqs:
                return
            if waiter.num_tokens > self._room_next_step(len(self.running) + 1):
                return
            if req is waiter or req in in_flight:
                continue
            # read-only checks first: a prefix match locks and may load the host tier's pages
            key = _prefix_key(req)
            if req.num_tokens - self.cache.cached_length(key) > budget:
                continue
            if self.cache.num_available_pages - self.cache.pages_needed(req.num_tokens) < need:
                return
            req.num_computed_tokens = self.cache.match_prefix(req.pages, key)
            uncomputed = req.num_uncomputed_tokens(0)
            num_new = uncomputed - self._held_back(req)
            if num_new > budget or not self.cache.allocate(req.pages, req.num_tokens):
                self._release(req)
                req.num_computed_tokens = 0
                return
            self._admit(out, req, num_new, uncomputed)
            budget -= num_new

    def _waits_whole(
        self, out: SchedulerOutput, req: Request, uncomputed: int, budget: int
    ) -> bool:
        """Whether `req` waits for the next step rather than have its first chunk in this
        one: a prompt of at least `whole_prompt_min_tokens` uncomputed tokens and no cached
        prefix that does not fit what other prompts left of this step but fits the next whole,
        beside a row for every running request, when no prompt of this step continues into
        the next. Then its first token comes in the same step as its last chunk's would, this
        step is shorter (or filled by prompts that fit whole, `_admit_whole`), and the whole
        prompt attends faster (cuDNN's dense rows: 4k-8k tokens at 56-72% of the matmul rate,
        against 42-45% for the paged kernel that a chunk after its prefix takes). Once per
        request, so none waits twice."""
        least = self.whole_prompt_min_tokens
        if not least or req.waited_whole or req.num_computed_tokens:
            return False
        if not budget < uncomputed <= self._room_next_step(len(self.running)):
            return False
        if uncomputed < least or any(not seq.num_samples for seq in out.seqs):
            return False  # (a chunk that does not end its prompt takes more of the next step)
        if not any(seq.num_new_tokens > max(seq.num_samples, 1) for seq in out.seqs):
            return False  # only decodes here: the next step has no more room
        req.waited_whole = True
        return True

    def _room_next_step(self, num_running: int) -> int:
        """Tokens of the next step's budget left once `num_running` requests have a decode
        row each (1 + `_max_drafts()` tokens with speculation)."""
        row = 1 + (self._max_drafts() if self.speculative is not None else 0)
        return self.config.max_num_batched_tokens - row * num_running

    def _next_waiting(self) -> Request:
        """The waiting request to admit next under the configured policy.

        `fcfs`: arrival order (preempted requests first). `priority`: the waiting queue in
        `_priority` order (sorted by `schedule`). `cache-aware`: the longest cached prefix
        among the first `CACHE_AWARE_SCAN` waiting requests, except that a request waiting longer
        than `cache_aware_max_wait` seconds is taken in arrival order, so none starves.
        """
        head = self.waiting[0]
        if self.config.policy != "cache-aware":
            return head
        if time.time() - head.arrival_time > self.config.cache_aware_max_wait:
            return head
        candidates = itertools.islice(self.waiting, CACHE_AWARE_SCAN)
        return max(candidates, key=lambda r: self.cache.cached_length(_prefix_key(r)))

    def update(
        self,
        out: SchedulerOutput,
        token_ids: list[int],
        logprobs: list[dict[int, Logprob] | None],
    ) -> list[tuple[Request, int]]:
        """Apply a launched step's sampled tokens: append them, finish requests, cache pages.

        `token_ids` has one entry per sampled position, in batch order (`num_samples` per row);
        a verify row's entries are its accepted drafts, the token after them, then
        `PLACEHOLDER`s. Tokens after one that ends the request are dropped. A verify's rejected
        positions stop counting as computed and the pages past the computed tokens are
        released. Returns the requests that received tokens or finished, with how many tokens.
        """
        touched: list[tuple[Request, int]] = []
        sampled = zip(token_ids, logprobs, strict=True)
        verified: list[tuple[int, int]] = []
        for seq in out.seqs:
            req = seq.request
            results = list(itertools.islice(sampled, seq.num_samples))
            verifies = seq.num_samples > 1
            if verifies:  # its accepted drafts and the token after them, then placeholders
                results = [r for r in results if r[0] != PLACEHOLDER]
                verified.append((seq.num_samples - 1, len(results) - 1))
                req.acceptance.observe(*verified[-1], req.num_tokens)
            if req.is_finished:  # aborted, or finished by the previous step, while this one ran
                continue
            appended = 0
            for result in results:
                req.append_token(*result)
                appended += 1
                if req.is_finished:
                    break
            if results:
                touched.append((req, appended))
            if verifies:
                req.num_computed_tokens -= seq.num_samples - len(results)
            if req.is_finished:
                self._remove_finished(req)
                continue
            if verifies:
                self.cache.trim(req.pages, req.num_computed_tokens)
            if self.cache.has_uncached_pages(req.pages, req.num_computed_tokens):
                self.cache.cache_computed(req.pages, req.prefix_keys(req.num_computed_tokens))
        if verified:
            drafted, accepted = zip(*verified, strict=True)
            self.spec_stats.observe(drafted, accepted)
        return touched

    def _remove_finished(self, req: Request) -> None:
        if req in self.waiting:  # preempted while its last token was in flight
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        self.cache.release(req.pages, req.prefix_keys(req.num_computed_tokens))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Finish a waiting or running request now; returns it, or None if unknown or finished."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                self._release(req)
                req.finish(reason)
                return req
        for req in self.running:
            if req.request_id == request_id:
                req.finish(reason)
                self._remove_finished(req)
                return req
        return None


def _priority(req: Request) -> tuple[int, float]:
    """The `priority` policy's order: the request's priority (lower first), then arrival."""
    return req.params.priority, req.arrival_time


def _prefix_key(req: Request) -> list[int]:
    """The tokens a prefix match may cover: all but the last, which is always computed (its
    logits give the next token); an image's placeholders are keyed by its content. No token for a
    request still to score its prompt (`Request.scores_prompt`): a cached prefix would skip the
    positions that score it (as in vLLM, such a request reads no cached prefix; it writes its
    own)."""
    if req.scores_prompt:
        return []
    return req.prefix_keys(req.num_tokens - 1)


def _row(req: Request, num_new: int, uncomputed: int, unread: range | None) -> ScheduledSeq:
    """`num_new` of the `uncomputed` tokens of `req`, from its computed ones; the last
    `len(unread)` of those were sampled by the previous step (entries `unread` of its sampled
    tokens). The row samples when it reaches the end of the request's tokens."""
    if num_new < uncomputed:  # a prefill chunk: every token on the host, nothing sampled
        return ScheduledSeq(req, req.num_computed_tokens, num_new, 0)
    return ScheduledSeq(req, req.num_computed_tokens, num_new, 1, unread or range(0))


def _decoding(req: Request, in_flight: Mapping[Request, range]) -> bool:
    """Whether the request's next row is one decode token (all else computed, none unread).

    Not the last token of a prompt left over by chunked prefill: its first token is drawn
    plain, as when the prompt is prefilled at once. Verifying drafts there moved every later
    verify window of a seeded sampled request by where the budget cut its prompt, so its
    tokens depended on its batch."""
    return req not in in_flight and req.num_uncomputed_tokens(0) == 1 and bool(req.output_token_ids)


def _pause_after(ready: list[Request], offers: np.ndarray, chosen: np.ndarray) -> None:
    """Pause drafting for requests whose step could have drafted (`offers`: room within
    max_tokens and the context, not paused) but drafts nothing (prompt lookup found nothing,
    or the policy declined); a step that drafts ends a request's run of pauses. A request
    limited by max_tokens or its context is not paused, and a seeded sampled request never
    is: its drafts must not depend on its batch, and whether `may_draft` sees its newest
    token read does."""
    for req, offer, n in zip(ready, offers.tolist(), chosen.tolist(), strict=True):
        if n:
            req.draft_pause.reset()
        elif offer and not _pinned(req):
            req.draft_pause.start(req.num_tokens)


def _pinned(req: Request) -> bool:
    """A seeded sampled request: adaptive speculation leaves its drafts alone, since the tokens
    it draws depend on how many drafts it verifies, and must not depend on its batch."""
    return req.params.seed is not None and not req.params.greedy


def _host_proposer(speculative: SpeculativeConfig | None) -> HostProposer | None:
    """The proposer that drafts on the host before each batch is built (prompt lookup)."""
    if speculative is None or speculative.method != "ngram":
        return None
    from tokenmill.spec.ngram import NgramProposer

    assert speculative.prompt_lookup_min is not None and speculative.prompt_lookup_max is not None
    return NgramProposer(
        speculative.num_speculative_tokens,
        speculative.prompt_lookup_min,
        speculative.prompt_lookup_max,
    )
