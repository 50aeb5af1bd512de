"""The batch types every layer of the engine shares: requests, and the batch of one step.

`Request` is one sequence's state (WAITING → RUNNING → FINISHED, or back to waiting if
preempted); `ScheduledSeq` and `SchedulerOutput` are the scheduler's decision for one step.
They live here, below `engine`, `runner` and beside `cache`, so that the runner and the cache
need not import the engine: the engine owns the loop, not the vocabulary.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from tokenmill.cache.cache_manager import SeqPages
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life; PREEMPTED requests wait again, keeping their tokens."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request ended; the value is what the OpenAI API calls it."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one candidate token and its rank among all tokens (1 = most likely)."""

    logprob: float
    rank: int


@dataclass(eq=False)
class Request:
    """Token ids and KV pages of one sequence, plus what the scheduler needs to place it.

    Tokens `[0, num_computed_tokens)` have KV in the pages of `pages` (the cache's handle); a step
    computes the next run of tokens and, once all known tokens are computed, samples one more.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    # Wall-clock timestamps (time.time()) of the request's life, for metrics and traces.
    arrival_time: float = field(default_factory=time.time)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Tokens sampled by launched steps the host has not read yet (overlap scheduling: up to 2).
    num_pending: int = 0
    pages: SeqPages = field(default_factory=SeqPages)
    generator: torch.Generator | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens `[start, end)` of prompt + output, without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.all_token_ids[start:end]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not computed yet, counting a pending token."""
        return self.num_tokens + self.num_pending - self.num_computed_tokens

    def finishes_with_pending(self) -> bool:
        """True if the pending tokens will end the request by length, whatever their values."""
        if not self.num_pending:
            return False
        limit = self.params.max_tokens
        if limit is not None and len(self.output_token_ids) + self.num_pending >= limit:
            return True
        return self.num_tokens + self.num_pending >= self.max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, logprobs: dict[int, Logprob] | None) -> None:
        """Record a sampled token and finish the request if it hit a stop condition."""
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.time()
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        reason = self._stop_reason(token_id)
        if reason is not None:
            self.finish(reason)

    def _stop_reason(self, token_id: int) -> FinishReason | None:
        params, num_out = self.params, len(self.output_token_ids)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return FinishReason.LENGTH
        if self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, reason: FinishReason) -> None:
        """Mark the request finished; the scheduler releases its pages."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.time()


@dataclass(frozen=True)
class ScheduledSeq:
    """A request's share of one step: `num_new_tokens` tokens from `start`.

    `samples`: the step reaches the end of the request's tokens, so the next one is sampled.
    """

    request: Request
    start: int
    num_new_tokens: int
    samples: bool

    @staticmethod
    def of(req: Request, num_new: int) -> ScheduledSeq:
        """Schedule `num_new` tokens of `req` from its computed ones."""
        samples = num_new == req.num_uncomputed_tokens
        return ScheduledSeq(req, req.num_computed_tokens, num_new, samples)


@dataclass
class SchedulerOutput:
    """One step's batch, in the order the runner lays it out."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)
