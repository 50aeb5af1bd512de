"""The batch types every layer of the engine shares: requests, and the record of one step.

`Request` is one sequence's state (WAITING → RUNNING → FINISHED, or back to waiting if
preempted). `ScheduledSeq` and `SchedulerOutput` are the scheduler's decision for one step, on
the host, holding requests; `StepPlan` is the same step as plain arrays, all the runner reads
(and what a tensor-parallel rank 0 would broadcast). They live here, below `engine` and
`runner` and above `cache` only, so that the runner need not import the engine: the engine owns
the loop, not the vocabulary. The step protocol itself is explained in `engine.engine_core`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.cache.cache_manager import SeqPages
from tokenmill.sampling_params import SamplingParams
from tokenmill.vision.inputs import MultimodalPrompt, StepImage, step_images

if TYPE_CHECKING:
    from tokenmill.structured.matcher import RequestGrammar


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


# Adaptive speculation's belief about a request's drafts (`AcceptanceEstimate`). The prior,
# Beta(1.4, 0.6), is worth two judged drafts: an untried request's bound is 0.97, so it is
# tried wherever drafting could pay, and its own verifies soon outweigh the prior. (Simulated
# against fixed k = 4 at 128 tokens: worth one draft, a CPU request at a = 0.8 ran x1.85 vs
# x1.91; worth four, x1.87 but batch 64 at a = 0.3 x0.94, its rows tried longer; worth two,
# x1.89 and x0.96.)
ACCEPTANCE_PRIOR = 0.7
PRIOR_WEIGHT = 2.0
# Evidence halves in weight every this many of the request's tokens, drafted or not. At a = 0.8
# and k = 4 (2.95 drafts judged per 3.36 tokens) that is ~160 judged drafts at steady state:
# the posterior's standard deviation is 0.03, where a decay of 0.8 per verify (~15 drafts) let
# two verifies that accepted nothing (p = 0.04) pull it from 0.8 to 0.42 and turn drafting off.
# A request whose drafting was turned off is retried once its bound has widened back past what
# pays: at a = 0.6 where only a >= 0.88 pays (qwen3-0.6b on the H200: a verify costs 3.4
# decodes), about once per 100 tokens, x0.98 of plain decoding (simulated: fixed k runs x0.68).
ACCEPTANCE_HALF_LIFE = 128
# The policy reads the posterior mean plus this many standard deviations, divided by the square
# root of the rows it decides for (optimism in the face of uncertainty: an untried request is
# tried, a verified one is judged by its record; a batch by its total). At
# steady state (a = 0.6, k = 4: ~170 judged drafts) that adds 0.037 to `a` and 7% to the
# expected tokens of a verify, within `spec.adaptive.MIN_SPEEDUP`'s 10%: a step the policy
# chooses at >= 1.1x plain decoding's rate runs at >= 1.03x in truth.
ACCEPTANCE_OPTIMISM = 1.0
# A request whose step could have drafted but drafted nothing (prompt lookup found nothing, or
# the policy declined) skips drafting for this many of its tokens, twice as many after each
# further such step, up to the most; a step that drafts resets it. Prompt lookup that keeps
# finding nothing then costs a synchronous step once in up to 65 tokens.
DRAFT_PAUSE_TOKENS = 4
MAX_DRAFT_PAUSE_TOKENS = 64


@dataclass
class AcceptanceEstimate:
    """A request's chance `a` that the target accepts a draft, given it accepted the ones
    before: a Beta posterior.

    A verify of k drafts that accepts m is m acceptances and, when m < k, one rejection (the
    likelihood `a^m (1 - a)` is conjugate to the Beta prior). Evidence counts by how recent
    it is in the request's own text (`ACCEPTANCE_HALF_LIFE`), so a request that stopped
    drafting drifts back towards its prior and is tried again (its text may have turned
    repetitive).
    """

    accepted: float = 0.0  # weighted accepted drafts, as of `num_tokens`
    rejected: float = 0.0  # weighted rejected drafts, as of `num_tokens`
    num_tokens: int = 0  # the request's length at the last verify

    def observe(self, num_drafted: int, num_accepted: int, num_tokens: int) -> None:
        """Count one verify of the request at `num_tokens` tokens: `num_accepted` of
        `num_drafted` drafts accepted."""
        weight = self._weight(num_tokens)
        self.accepted = weight * self.accepted + num_accepted
        self.rejected = weight * self.rejected + (num_accepted < num_drafted)
        self.num_tokens = num_tokens

    def mean(self, num_tokens: int) -> float:
        """The posterior mean of `a` once the request has `num_tokens` tokens."""
        alpha, beta = self._posterior(num_tokens)
        return alpha / (alpha + beta)

    def bound(self, num_tokens: int, optimism: float = ACCEPTANCE_OPTIMISM) -> float:
        """What the policy reads: the posterior mean plus `optimism` standard deviations,
        below 1."""
        alpha, beta = self._posterior(num_tokens)
        total = alpha + beta
        mean = alpha / total
        deviation = math.sqrt(mean * (1 - mean) / (total + 1))
        return min(mean + optimism * deviation, 1 - 1e-6)

    def _posterior(self, num_tokens: int) -> tuple[float, float]:
        weight = self._weight(num_tokens)
        alpha = ACCEPTANCE_PRIOR * PRIOR_WEIGHT + weight * self.accepted
        beta = (1 - ACCEPTANCE_PRIOR) * PRIOR_WEIGHT + weight * self.rejected
        return alpha, beta

    def _weight(self, num_tokens: int) -> float:
        return 0.5 ** (max(num_tokens - self.num_tokens, 0) / ACCEPTANCE_HALF_LIFE)


@dataclass
class DraftPause:
    """Tokens a request skips drafting for after a step that could have drafted but did not
    (`DRAFT_PAUSE_TOKENS`): counted in the request's own tokens, so neither other requests'
    steps nor steps without decoding (prefills) shorten it."""

    until: int = 0  # the request drafts again once it has this many tokens
    length: int = DRAFT_PAUSE_TOKENS  # the next pause

    def active(self, num_tokens: int) -> bool:
        """Whether the request, at `num_tokens` tokens, skips drafting."""
        return num_tokens < self.until

    def start(self, num_tokens: int) -> None:
        """A step of the request at `num_tokens` tokens drafted nothing though it could: the
        `length` steps after it decode plain."""
        self.until = num_tokens + 1 + self.length
        self.length = min(2 * self.length, MAX_DRAFT_PAUSE_TOKENS)

    def reset(self) -> None:
        """A step of the request drafted."""
        self.length = DRAFT_PAUSE_TOKENS


@dataclass(eq=False)
class Request:
    """Token ids and KV pages of one sequence, plus what the scheduler needs to place it.

    Tokens `[0, num_computed_tokens)` have KV in the pages of `pages` (the cache's handle) or
    are being computed by a launched step; a step computes the next run of tokens and, once all
    known tokens are computed, samples one more. Tokens a launched step sampled that the host
    has not read yet are not here: the engine core tracks them (`InFlight`).
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
    # Logprobs of the tokens appended since the engine core last sent them out
    # (`take_new_logprobs`); none kept after that (a 32k-token output's 21 entries a token,
    # ~175 bytes each, were 120 MB of the engine core's for the request's lifetime).
    new_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # `params.prompt_logprobs`: entry i scores prompt token i + 1 given the tokens before it;
    # emptied when they go out with the first output (`take_prompt_logprobs`: an 8k-token
    # prompt's 20 alternatives are some 25 MB, held no longer than that).
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs_taken: bool = False
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    waited_whole: bool = False  # the scheduler let it wait a step rather than split it
    pages: SeqPages = field(default_factory=SeqPages)
    grammar: RequestGrammar | None = None  # structured outputs: has accepted every output token
    # Speculative decoding: tokens a host proposer drafted to follow the newest token, how
    # often the target accepts this request's drafts, and how long it skips drafting
    # (adaptive speculation reads both).
    draft_token_ids: list[int] = field(default_factory=list)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    draft_pause: DraftPause = field(default_factory=DraftPause)
    mm: MultimodalPrompt | None = None  # the prompt's images and their rotary positions
    # `token_array`'s buffer: tokens [0, its filled length) copied so far (prompt + output).
    _token_buffer: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64),
                                      repr=False)  # fmt: skip
    _token_buffer_len: int = field(default=0, repr=False)

    def token_array(self) -> np.ndarray:
        """Prompt + output as an int64 array (a view, valid until the next call): a host
        proposer reads every request's tokens every step, so they are copied once each, as
        they come, not per step."""
        num, done = self.num_tokens, self._token_buffer_len
        if num > len(self._token_buffer):
            grown = np.zeros(max(num, 2 * len(self._token_buffer)), dtype=np.int64)
            grown[:done] = self._token_buffer[:done]
            self._token_buffer = grown
        if done < num:
            self._token_buffer[done:num] = self.token_slice(done, num)
            self._token_buffer_len = num
        return self._token_buffer[:num]

    def prefix_keys(self, end: int) -> list[int]:
        """The prefix cache's keys of tokens `[0, end)`: the token ids, with an image's
        placeholder tokens keyed by the image's content (`MultimodalPrompt.cache_keys`), and
        the first keyed by the request's `cache_salt` too (`salted_key`)."""
        tokens = self.token_slice(0, end)
        keys = tokens if self.mm is None else self.mm.cache_keys(tokens)
        salt = self.params.cache_salt
        if salt is not None and keys:
            keys[0] = salted_key(salt, keys[0])  # a new list either way: no one else's
        return keys

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

    def num_uncomputed_tokens(self, num_in_flight: int) -> int:
        """Tokens whose KV is not computed yet, counting `num_in_flight` sampled tokens the host
        has not read."""
        return self.num_tokens + num_in_flight - self.num_computed_tokens

    def finishes_with(self, num_in_flight: int) -> bool:
        """True if `num_in_flight` unread sampled tokens end the request by length, whatever
        their values."""
        if not num_in_flight:
            return False
        limit = self.params.max_tokens
        if limit is not None and len(self.output_token_ids) + num_in_flight >= limit:
            return True
        return self.num_tokens + num_in_flight >= self.max_model_len

    def max_drafts(self, k: int) -> int:
        """Drafts worth verifying after the newest token: at most `k`, and no more than the
        request may still emit minus the target's own token (max_tokens, context window)."""
        left = self.max_model_len - self.num_tokens - 1
        if self.params.max_tokens is not None:
            left = min(left, self.params.max_tokens - len(self.output_token_ids) - 1)
        return max(0, min(k, left))

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def scores_prompt(self) -> bool:
        """Whether the request's prompt logprobs are still to be computed (asked for, and not
        yet gone out: a request preempted after its first output scores nothing again)."""
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_taken

    def add_prompt_logprobs(self, first: int, entries: list[dict[int, Logprob]]) -> None:
        """Record the scores of prompt tokens `first`, `first + 1`, ...; those recorded
        already (a preempted request computes its prompt again) are kept as they are, and
        none once they went out."""
        if self.prompt_logprobs_taken:
            return
        skip = len(self.prompt_logprobs) + 1 - first
        if skip < 0:
            raise ValueError(f"prompt logprobs from token {first} leave a gap before it")
        self.prompt_logprobs += entries[skip:]

    def take_prompt_logprobs(self) -> list[dict[int, Logprob] | None]:
        """The prompt logprobs for the first output, None for the first prompt token; the
        request keeps none of them."""
        taken: list[dict[int, Logprob] | None] = [None, *self.prompt_logprobs]
        self.prompt_logprobs, self.prompt_logprobs_taken = [], True
        return taken

    def take_new_logprobs(self) -> list[dict[int, Logprob]]:
        """The logprobs of the tokens appended since the last call, forgotten here."""
        taken, self.new_logprobs = self.new_logprobs, []
        return taken

    def append_token(self, token_id: int, logprobs: dict[int, Logprob] | None) -> None:
        """Record a sampled token and finish the request if it hit a stop condition."""
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.time()
        if logprobs is not None:
            self.new_logprobs.append(logprobs)
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


@functools.lru_cache(maxsize=4096)
def salted_key(salt: str, first: int) -> int:
    """The prefix cache's key of a salted request's first token (or image key): a negative
    key below every image's (`image_key`: 62 bits, keys -1 - key), from a hash of the salt and
    the key it replaces, so that only requests of the same salt share any cached page."""
    digest = hashlib.blake2b(salt.encode(), digest_size=8)
    digest.update(first.to_bytes(8, "little", signed=True))
    return -(1 << 62) - 1 - (int.from_bytes(digest.digest(), "little") >> 2)


@dataclass(frozen=True)
class ScheduledSeq:
    """A request's row in one step: `num_new_tokens` query tokens from position `start`.

    The last `len(device_tokens)` of them were sampled by the previous step and are not on the
    host yet: they are rows `device_tokens` of that step's sampled tokens, on the device. The
    row samples `num_samples` tokens, from the logits of its last `num_samples` positions (0
    for a prefill chunk that does not reach the end of the known tokens, 1 otherwise; 1 + k
    when a speculative row verifies k draft tokens).

    A verify row's query tokens are the request's newest token and its drafts: `drafts` known
    on the host (prompt lookup), or `num_device_drafts` the runner's draft model makes at
    launch.
    """

    request: Request
    start: int
    num_new_tokens: int
    num_samples: int
    device_tokens: range = range(0)
    drafts: tuple[int, ...] = ()
    num_device_drafts: int = 0


@dataclass(frozen=True)
class SamplingRows:
    """How each of a step's S sampled positions draws its token, as plain values (no tensors,
    no generators; a list per field rather than an object per position, built every step).

    `token_index[s]`: how many tokens the request generated before this one, unread ones
    included; it numbers the seeded draws and decides `min_tokens`. `suppressed`: position ->
    token ids banned there (end-of-sequence and stop ids before `min_tokens`, unless they are
    all the allowed ids; the last token of each bad word whose other tokens were just
    generated). `history`: position -> (prompt, generated) token ids, where a penalty counts
    them; `watched`: the positions whose bad words are longer than a token (both make the step
    blocking, so no generated token is unread).
    """

    params: list[SamplingParams] = field(default_factory=list)
    token_index: list[int] = field(default_factory=list)
    suppressed: dict[int, tuple[int, ...]] = field(default_factory=dict)
    history: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    # Positions whose bans follow the tokens before them (a bad word of several tokens).
    watched: list[int] = field(default_factory=list)
    # Such positions of rows the draft model drafts for, past j >= 1 of its drafts (made at
    # launch): position -> (the output before the drafts, j, its other bans), whose bans the
    # runner completes once the drafts are on the host (`ban_past_drafts`).
    past_device_drafts: dict[int, tuple[tuple[int, ...], int, tuple[int, ...]]] = field(
        default_factory=dict
    )

    def __len__(self) -> int:
        return len(self.params)

    def add_row(
        self,
        req: Request,
        num_in_flight: int,
        num_samples: int,
        drafts: Sequence[int] = (),
        num_device_drafts: int = 0,
    ) -> None:
        """Append a row's `num_samples` draws: the next draw of `req`, which has
        `num_in_flight` sampled tokens the host has not read, and the draws after it (a
        verify row's position j draws as if drafts [:j] had been generated: `drafts`, or
        `num_device_drafts` the draft model makes at launch). One call per row, not per
        position: this runs for every sampled row of every step."""
        p, first = req.params, len(self.params)
        index = len(req.output_token_ids) + num_in_flight
        self.params.extend([p] * num_samples)
        self.token_index.extend(range(index, index + num_samples))
        if index < p.min_tokens:
            banned = (*req.eos_token_ids, *p.stop_token_ids)
            # Allowed ids that are all stop tokens keep their place (as a grammar's do).
            if _leaves_an_allowed_id(p.allowed_token_ids, banned):
                for j in range(min(num_samples, p.min_tokens - index)):
                    self.suppressed[first + j] = banned
        # Penalties count the tokens so far (one test, inlined).
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1:
            for j in range(num_samples):
                ahead = drafts[:j]
                output = [*req.output_token_ids, *ahead] if ahead else req.output_token_ids
                self.history[first + j] = (req.prompt_token_ids, output)
        if p.bad_words_token_ids:
            self._ban_bad_words(req, first, num_samples, drafts, num_device_drafts)

    def _ban_bad_words(
        self,
        req: Request,
        first: int,
        num_samples: int,
        drafts: Sequence[int],
        num_device_drafts: int,
    ) -> None:
        """Ban at each of the row's positions what `bad_word_bans` bans after the output so
        far; positions past the draft model's drafts are completed by the runner."""
        p = req.params
        for j in range(num_samples):
            prior = self.suppressed.get(first + j, ())
            if p.watches_output and j and num_device_drafts:
                tail = tuple(req.output_token_ids[-p.max_bad_word_len :])
                self.past_device_drafts[first + j] = (tail, j, prior)
            banned = bad_word_bans(p, [*req.output_token_ids, *drafts[:j]], prior)
            if banned is not None:
                self.suppressed[first + j] = banned
            if p.watches_output:
                self.watched.append(first + j)

    def ban_past_drafts(self, drafts: np.ndarray, row_of: Callable[[int], int]) -> SamplingRows:
        """These rows with the bans of `past_device_drafts` positions completed, from the
        draft model's drafts (`drafts[row_of(position), :j]` come before a position)."""
        suppressed = dict(self.suppressed)
        for position, (tail, j, prior) in self.past_device_drafts.items():
            output = [*tail, *drafts[row_of(position), :j].tolist()]
            banned = bad_word_bans(self.params[position], output, prior)
            if banned is not None:
                suppressed[position] = banned
            elif prior:
                suppressed[position] = prior
            else:
                suppressed.pop(position, None)
        return dataclasses.replace(self, suppressed=suppressed, past_device_drafts={})


def bad_word_bans(
    params: SamplingParams, output: Sequence[int], prior: tuple[int, ...]
) -> tuple[int, ...] | None:
    """What a position after `output` bans: `prior` (`min_tokens`') and the last token of
    every bad word whose other tokens end `output` (a one-token word: always), as vLLM does;
    None (`prior` stands) where that would leave none of the request's allowed ids (they win,
    as over `min_tokens`)."""
    words = params.bad_words_token_ids or []
    banned = (*prior, *(w[-1] for w in words if len(w) == 1 or _ends_with(output, w[:-1])))
    if banned and _leaves_an_allowed_id(params.allowed_token_ids, banned):
        return banned
    return None


def _leaves_an_allowed_id(allowed: list[int] | None, banned: tuple[int, ...]) -> bool:
    """Whether banning `banned` leaves a request with allowed ids (`allowed`: each once; None:
    all) one to draw: a ban of every one would leave the row no token at all."""
    return allowed is None or len(allowed) > len(banned) or not set(allowed).issubset(banned)


def _ends_with(tokens: Sequence[int], suffix: Sequence[int]) -> bool:
    n = len(suffix)
    return len(tokens) >= n and list(tokens[len(tokens) - n :]) == list(suffix)


@dataclass(frozen=True)
class PromptLogprobRows:
    """The query tokens of a step whose logits score the prompt token after them
    (`SamplingParams.prompt_logprobs`), P of them, rows in order.

    `rows`: (row, first prompt token scored, how many) for each row that scores any; its
    scores are the next `how many` of the P, in order.
    """

    token_index: np.ndarray  # [P] indices among the step's T query tokens
    target_ids: np.ndarray  # [P] the prompt token each scores (the one after it)
    num_top: list[int]  # [P] how many most likely alternatives each reports
    rows: list[tuple[int, int, int]]

    @staticmethod
    def build(
        seqs: Sequence[ScheduledSeq], asking: list[tuple[int, int]]
    ) -> PromptLogprobRows | None:
        """The scored tokens of the rows `asking` (row, its first query token's index) of
        `seqs`: a row's query tokens before its prompt's last (whose logits give the first
        output token). None when they score none."""
        index: list[np.ndarray] = []
        targets: list[int] = []
        num_top: list[int] = []
        rows: list[tuple[int, int, int]] = []
        for row, offset in asking:
            s = seqs[row]
            req = s.request
            end = min(s.start + s.num_new_tokens, len(req.prompt_token_ids) - 1)
            if end <= s.start:
                continue
            count = end - s.start
            index.append(np.arange(offset, offset + count))
            targets += req.prompt_token_ids[s.start + 1 : end + 1]
            num_top += [req.params.prompt_logprobs or 0] * count
            rows.append((row, s.start + 1, count))
        if not rows:
            return None
        ids = np.array(targets, dtype=np.int64)
        return PromptLogprobRows(np.concatenate(index), ids, num_top, rows)


@dataclass(frozen=True)
class StepPlan:
    """One step as plain data: the runner's whole input (see `engine.engine_core` for the
    protocol). B rows, T query tokens, S sampled positions; arrays are int64.

    Row b runs `query_lens[b]` query tokens at positions `kv_lens[b] - query_lens[b]` ..
    `kv_lens[b] - 1`, over KV pages `page_table[b]`, and samples from the logits of its last
    `num_samples[b]` positions; its sampled tokens are entries `sample_offsets[b]` ..
    `sample_offsets[b] + num_samples[b] - 1` of the step's sampled tokens, in row order. Query
    token t is `input_ids[t]`, or, where `input_src[t] >= 0`, entry `input_src[t]` of the
    sampled tokens of the step launched just before this one (still on the device).
    """

    input_ids: np.ndarray  # [T]
    input_src: np.ndarray  # [T]
    query_lens: np.ndarray  # [B]
    kv_lens: np.ndarray  # [B]
    num_samples: np.ndarray  # [B]
    page_table: np.ndarray  # [B, W], W = most pages any row needs
    sampling: SamplingRows  # [S]
    # [B] a verify row's last query tokens that the runner's draft model drafts at launch
    # (their `input_ids` are placeholders); None: no row has any.
    num_device_drafts: np.ndarray | None = None
    # Multimodal rows: [3, T] every query token's rotary positions (temporal, height, width),
    # None when no row's request has images; and the images whose features the query tokens
    # take.
    rope_positions: np.ndarray | None = None
    images: tuple[StepImage, ...] = ()
    # The query tokens whose logits score the prompt token after them (None: no row asks).
    prompt_logprobs: PromptLogprobRows | None = None

    @property
    def blocking(self) -> bool:
        """The next step must not be scheduled before this one's tokens are on the host: a
        penalty counts every generated token, a bad word of several tokens the newest ones; a
        verify decides how many tokens it emits."""
        sampling = self.sampling
        return bool(sampling.history or sampling.watched) or bool((self.num_samples > 1).any())

    @property
    def samples_every_token(self) -> bool:
        """Every query token is sampled: decode and verify rows only, no prefill chunk."""
        return bool(np.array_equal(self.num_samples, self.query_lens))

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_sampled(self) -> int:
        return len(self.sampling)

    @property
    def sample_offsets(self) -> np.ndarray:
        """[B] where each row's sampled tokens start in the step's sampled tokens."""
        return np.cumsum(self.num_samples) - self.num_samples

    @property
    def has_device_tokens(self) -> bool:
        return bool((self.input_src >= 0).any())

    @staticmethod
    def build(seqs: list[ScheduledSeq], page_size: int) -> StepPlan:
        """The plan of a scheduled batch (each request's tokens and pages read as they are
        now, before the scheduler advances `num_computed_tokens`)."""
        # One pass over the rows, plain lists (this runs every step, for every row).
        ids: list[int] = []
        device_at: list[int] = []  # input positions taken from the previous step's samples
        device_src: list[int] = []
        q_lens: list[int] = []
        kv_lens: list[int] = []
        num_samples: list[int] = []
        pages: list[list[int]] = []
        sampling = SamplingRows()
        any_device_drafts = False
        multimodal = any(s.request.mm is not None for s in seqs)
        rope: list[np.ndarray] = []
        images: list[StepImage] = []
        scoring: list[tuple[int, int]] = []  # rows asking for prompt logprobs, and their offset
        for row, s in enumerate(seqs):
            req, num_new, num_device = s.request, s.num_new_tokens, len(s.device_tokens)
            if req.scores_prompt:
                scoring.append((row, len(ids)))
            num_drafted = len(s.drafts) + s.num_device_drafts
            if multimodal:
                rope.append(_rope_positions(req, s.start, s.start + num_new))
                if req.mm is not None:
                    images += step_images(req.mm, s.start, s.start + num_new, len(ids))
            ids += req.token_slice(s.start, s.start + num_new - num_device - num_drafted)
            if num_device:
                device_at += range(len(ids), len(ids) + num_device)
                device_src += s.device_tokens
                ids += [0] * num_device
            if num_drafted:  # a verify row: the drafts follow the newest token
                ids += s.drafts
                ids += [0] * s.num_device_drafts
                any_device_drafts |= s.num_device_drafts > 0
            q_lens.append(num_new)
            kv_lens.append(s.start + num_new)
            num_samples.append(s.num_samples)
            pages.append(req.pages.page_ids)
            sampling.add_row(req, num_device, s.num_samples, s.drafts, s.num_device_drafts)
        input_src = np.full(len(ids), -1, dtype=np.int64)
        input_src[device_at] = device_src
        kv = np.array(kv_lens, dtype=np.int64)
        return StepPlan(
            input_ids=np.array(ids, dtype=np.int64),
            input_src=input_src,
            query_lens=np.array(q_lens, dtype=np.int64),
            kv_lens=kv,
            num_samples=np.array(num_samples, dtype=np.int64),
            page_table=_page_table(pages, kv, page_size),
            sampling=sampling,
            num_device_drafts=(
                np.array([s.num_device_drafts for s in seqs], dtype=np.int64)
                if any_device_drafts
                else None
            ),
            rope_positions=np.concatenate(rope, axis=1) if multimodal else None,
            images=tuple(images),
            prompt_logprobs=PromptLogprobRows.build(seqs, scoring) if scoring else None,
        )


def _rope_positions(req: Request, start: int, end: int) -> np.ndarray:
    """[3, end - start] rotary positions of a request's tokens `[start, end)`."""
    if req.mm is not None:
        return req.mm.rope_positions(start, end)
    return np.broadcast_to(np.arange(start, end), (3, end - start))


def _page_table(pages: list[list[int]], kv_lens: np.ndarray, page_size: int) -> np.ndarray:
    """[B, W] the pages holding each row's `kv_lens` tokens, zero-padded to the widest row."""
    width = int(-(-kv_lens.max() // page_size)) if len(kv_lens) else 0
    table = np.zeros((len(pages), width), dtype=np.int64)
    for i, row in enumerate(pages):
        row = row[:width]
        table[i, : len(row)] = row
    return table


@dataclass
class SchedulerOutput:
    """One step's batch: its rows in the order the runner lays them out, and its plan."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    plan: StepPlan | None = None  # None when no row is scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)
