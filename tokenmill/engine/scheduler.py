"""Scheduler: picks each step's batch under the token budget, admits, preempts and finishes."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from tokenmill.batch import (
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

logger = logging.getLogger(__name__)

# How many waiting requests the cache-aware policy compares per admission.
CACHE_AWARE_SCAN = 128


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

    def __init__(self, config: SchedulerConfig, cache: CacheManager) -> None:
        self.config = config
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()

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
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            unread = in_flight.get(req)
            num_unread = len(unread) if unread else 0
            if num_unread and req.finishes_with(num_unread):
                i += 1  # its in-flight token is its last: nothing more to compute
                continue
            uncomputed = req.num_uncomputed_tokens(num_unread)
            num_new = min(uncomputed, budget)
            while not self.cache.allocate(req.pages, req.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.seqs.append(_row(req, num_new, uncomputed, unread))
                budget -= num_new
                i += 1
        return budget

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
            num_new = min(uncomputed, budget)
            if not self.cache.allocate(req.pages, req.num_computed_tokens + num_new):
                self._release(req)
                req.num_computed_tokens = 0
                return
            self.waiting.remove(req)
            self.cache.record_lookup(req.num_tokens, req.num_computed_tokens)
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
            if req.scheduled_time is None:
                req.scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.seqs.append(_row(req, num_new, uncomputed, None))
            budget -= num_new

    def _next_waiting(self) -> Request:
        """The waiting request to admit next under the configured policy.

        `fcfs`: arrival order (preempted requests first). `cache-aware`: the longest cached prefix
        among the first `CACHE_AWARE_SCAN` waiting requests, except that a request waiting longer
        than `cache_aware_max_wait` seconds is taken in arrival order, so none starves.
        """
        head = self.waiting[0]
        if self.config.policy == "fcfs":
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
    ) -> list[Request]:
        """Apply a launched step's sampled tokens: append them, finish requests, cache pages.

        `token_ids` has one entry per sampled position, in batch order (`num_samples` per row).
        Returns the requests that received a token or finished.
        """
        touched: list[Request] = []
        sampled = zip(token_ids, logprobs, strict=True)
        for seq in out.seqs:
            req = seq.request
            results = list(itertools.islice(sampled, seq.num_samples))
            if req.is_finished:  # aborted, or finished by the previous step, while this one ran
                continue
            for result in results:
                req.append_token(*result)
                if req.is_finished:
                    break
            if results:
                touched.append(req)
            if req.is_finished:
                self._remove_finished(req)
                continue
            if self.cache.has_uncached_pages(req.pages, req.num_computed_tokens):
                self.cache.cache_computed(req.pages, req.token_slice(0, req.num_computed_tokens))
        return touched

    def _remove_finished(self, req: Request) -> None:
        if req in self.waiting:  # preempted while its last token was in flight
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        self.cache.release(req.pages, req.token_slice(0, req.num_computed_tokens))

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


def _prefix_key(req: Request) -> list[int]:
    """The tokens a prefix match may cover: all but the last, which is always computed (its
    logits give the next token)."""
    return req.token_slice(0, req.num_tokens - 1)


def _row(req: Request, num_new: int, uncomputed: int, unread: range | None) -> ScheduledSeq:
    """`num_new` of the `uncomputed` tokens of `req`, from its computed ones; the last
    `len(unread)` of those were sampled by the previous step (entries `unread` of its sampled
    tokens). The row samples when it reaches the end of the request's tokens."""
    if num_new < uncomputed:  # a prefill chunk: every token on the host, nothing sampled
        return ScheduledSeq(req, req.num_computed_tokens, num_new, 0)
    return ScheduledSeq(req, req.num_computed_tokens, num_new, 1, unread or range(0))
