"""EngineCore: the single point of control; owns requests, pages and the batch, steps the model.

The step protocol
-----------------
Every step is one record, a `StepPlan` (tokenmill/batch.py), built by the scheduler and read
by the runner; the runner sees no requests. Per row it says which query tokens are known on
the host (`input_ids`) and which were sampled by the previous step and are still on the device
(`input_src`: their entry among that step's sampled tokens), how many query tokens the row runs
(`query_lens`: a prefill chunk, 1 for decode, 1 + k to verify k draft tokens), its context
(`kv_lens`, `page_table`), and how many tokens it samples (`num_samples`: from the logits of its
last positions, into consecutive entries of the step's sampled tokens, rows in order).

This class is the one place where host and device meet. With overlap scheduling, `step()`:

1. schedules step N+1 while step N runs: a request N sampled for has its token unread, so
   `InFlight.unread` (built once from N's plan) tells the scheduler where that token will be,
   and N+1's row takes it from the device (`input_src`) instead of the host;
2. launches N+1 (the runner keeps the last launched step's sampled tokens on the device, where
   N+1's `input_src` points);
3. only then waits for N's tokens and applies them to the requests (append, stop, cache).

A step that samples under a grammar (structured outputs) needs step N's tokens for its masks,
so 3 moves into the launch: the runner queues N+1's forward pass, then calls back here to read
N's tokens and advance the grammars, and a background thread fills N+1's masks while the GPU
runs the forward pass and this thread schedules N+2 (xgrammar fills without the GIL). N+1's
sampling, which waits for the masks, is queued by the runner when it launches N+2, before
N+2's forward pass (which reads N+1's tokens on the device), or when N+1 is read.

So at most two steps are launched and one is unread when the scheduler runs. A plan marked
`blocking` (a penalty counts every generated token; a verify decides how many tokens it
emits) is read before the next step is scheduled, and so, with speculative decoding, is the
step before one that may draft (`Scheduler.may_draft`: drafts continue the newest token;
adaptive speculation lets the steps it keeps plain overlap). Such a step is still read at the
start of the next `step()`, not at the end of its own, and only its tokens are applied before
the next launch: making its outputs, and what the caller does with them (detokenize, send),
runs while the GPU computes the next step. Without overlap every
step is read right after its launch. A request preempted while its
token is unread waits until the token lands. Scheduling counts a row's tokens as computed
(its KV is being written); a speculative row whose drafts are rejected gives back the rejected
positions after reading (its KV slots stay allocated and are overwritten).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.batch import FinishReason, Logprob, Request, SchedulerOutput, StepPlan
from tokenmill.cache.cache_manager import CacheManager
from tokenmill.cache.host_tier import HostKVTier
from tokenmill.config import EngineConfig
from tokenmill.engine.scheduler import Scheduler
from tokenmill.intake import ContextLimits, check_prompt, truncate_prompt
from tokenmill.ipc.messages import STEP_KINDS
from tokenmill.observability.histogram import (
    STEP_SECONDS_BUCKETS,
    TOKEN_COUNT_BUCKETS,
    Histogram,
)
from tokenmill.observability.request_metrics import RequestMetrics
from tokenmill.runner.model_runner import LaunchedStep, ModelRunner
from tokenmill.runner.sampler import GrammarMask
from tokenmill.runner.spec_decode import drafting_row_of
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.adaptive import step_seconds
from tokenmill.spec.rejection import PLACEHOLDER
from tokenmill.vision.inputs import ImageInput, MultimodalPrompt, multimodal_prompt

if TYPE_CHECKING:
    from tokenmill.runner.cuda_graphs import GraphKey
    from tokenmill.structured.compiler import GrammarCompiler
    from tokenmill.structured.matcher import BitmaskFiller, RequestGrammar

logger = logging.getLogger(__name__)

# The GIL switch interval once grammar masks are filled on a thread (see `_start_masks`).
MASK_THREAD_SWITCH_INTERVAL_S = 2e-4
# How long an idle engine blocks for a grammar compile before it looks at its inputs again.
COMPILE_WAIT_S = 0.01


@dataclass(frozen=True)
class EngineOutput:
    """What one step produced for one request: its new tokens and, at the end, why it stopped."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics | None = None  # set when finished
    # With the first token of a request asking for them (`SamplingParams.prompt_logprobs`):
    # one entry per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set when the request failed on its own input after it was accepted (a constraint that
    # compiles to a grammar no token can start): the message for the client, a 400.
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def step_kind(batch: SchedulerOutput) -> str:
    """The kind (`STEP_KINDS`) of a step: a row is a prefill row when it computes more tokens
    than it samples (a prompt chunk), a decode row otherwise (a decode, a verify)."""
    prefill = sum(1 for s in batch.seqs if s.num_new_tokens > s.num_samples)
    if prefill == len(batch.seqs):
        return "prefill"
    return "mixed" if prefill else "decode"


def _seconds_histogram() -> Histogram:
    return Histogram.new(STEP_SECONDS_BUCKETS)


@dataclass
class EngineCounters:
    """Cumulative engine-side statistics (the metrics endpoint reads them)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter[str] = field(default_factory=Counter)  # requests, by finish reason
    step_seconds: Histogram = field(default_factory=_seconds_histogram)
    forward_seconds: Histogram = field(default_factory=_seconds_histogram)
    # The same device time by the step's kind (`step_kind`): what mixed steps cost beside
    # prefill-only and decode-only ones.
    forward_seconds_by_kind: dict[str, Histogram] = field(
        default_factory=lambda: {kind: _seconds_histogram() for kind in STEP_KINDS}
    )
    # Host time (`step_seconds`) of the engine steps that launched a step of each kind: where
    # the host, not the device, sets a kind's pace (e.g. short decode-only steps).
    step_seconds_by_kind: dict[str, Histogram] = field(
        default_factory=lambda: {kind: _seconds_histogram() for kind in STEP_KINDS}
    )
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram.new(TOKEN_COUNT_BUCKETS))


@dataclass(frozen=True)
class InFlight:
    """A launched step whose sampled tokens the host has not read yet.

    `unread`: for each request it samples for, its entries among the step's sampled tokens.
    """

    batch: SchedulerOutput
    plan: StepPlan
    launched: LaunchedStep
    unread: dict[Request, range]
    launched_at: float  # time.perf_counter() when its launch began
    # Sampled positions after a drafted stop token that ended their grammar (`GrammarMask`):
    # their tokens are dropped when the step is read.
    ended: frozenset[int] = frozenset()

    @staticmethod
    def of(
        batch: SchedulerOutput,
        plan: StepPlan,
        launched: LaunchedStep,
        launched_at: float,
        ended: frozenset[int] = frozenset(),
    ) -> InFlight:
        offsets = plan.sample_offsets.tolist()
        unread = {
            s.request: range(offsets[i], offsets[i] + s.num_samples)
            for i, s in enumerate(batch.seqs)
            if s.num_samples
        }
        return InFlight(batch, plan, launched, unread, launched_at, ended)


def _add_prompt_logprobs(step: InFlight) -> None:
    """Wait for a launched step's prompt logprobs (if it scored any) and give each row's to
    its request."""
    rows = step.plan.prompt_logprobs
    if rows is None:
        return
    entries = step.launched.read_prompt_logprobs()
    at = 0
    for row, first, count in rows.rows:
        step.batch.seqs[row].request.add_prompt_logprobs(first, entries[at : at + count])
        at += count


def _grammars(batch: SchedulerOutput) -> tuple[list[RequestGrammar | None], list[tuple[int, ...]]]:
    """The grammar of each sampled position of the batch (None: unconstrained), and the drafts
    it comes after (a verify row's position j follows its first j drafts)."""
    grammars: list[RequestGrammar | None] = []
    ahead: list[tuple[int, ...]] = []
    for s in batch.seqs:
        grammars += [s.request.grammar] * s.num_samples
        ahead += [s.drafts[:j] for j in range(s.num_samples)]
    return grammars, ahead


def _past_device_drafts(
    batch: SchedulerOutput, ahead: list[tuple[int, ...]], drafts: np.ndarray
) -> list[tuple[int, ...]]:
    """`ahead` (`_grammars`) with the draft model's drafts in: row i of `drafts` `[rows, k]`
    is the batch's i-th row that drafts on the device."""
    ahead, at, row = list(ahead), 0, 0
    for s in batch.seqs:
        if s.num_device_drafts:
            made = tuple(drafts[row, : s.num_device_drafts].tolist())
            ahead[at : at + s.num_samples] = [made[:j] for j in range(s.num_samples)]
            row += 1
        at += s.num_samples
    return ahead


class EngineCore:
    """Accepts requests and aborts, and advances every running request by one step per `step()`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        host = None
        if self.runner.num_host_pages:
            host = HostKVTier(
                self.runner.kv_tensors(), self.runner.num_host_pages, self.runner.device
            )
            logger.info("host KV tier of %d pages", self.runner.num_host_pages)
        self.cache = CacheManager(
            self.runner.num_pages,
            config.cache.page_size,
            config.cache.enable_prefix_caching,
            host,
        )
        self.scheduler = Scheduler(config.scheduler, self.cache, config.speculative)
        self.scheduler.padded_verify_rows = self.runner.padded_verify_rows
        self.scheduler.whole_prompt_min_tokens = self.runner.attention.whole_prompt_min_tokens()
        self._requests: dict[str, Request] = {}
        self._in_flight: InFlight | None = None
        self.stats = EngineCounters()
        self._waited = 0.0  # seconds the current step spent waiting for the GPU
        # The newest launched step (None after a step that launched nothing) and, until
        # measured, the one launched before it with whether it was read before that launch.
        self._newest: InFlight | None = None
        self._before_newest: tuple[InFlight, bool] | None = None
        # Structured outputs: requests wait here, outside the scheduler, while their grammar
        # compiles on a background thread; made by the first constrained request.
        self._compiling: list[tuple[Request, Future]] = []
        self._grammar_compiler: GrammarCompiler | None = None
        self._bitmasks: BitmaskFiller | None = None
        self._mask_filler: ThreadPoolExecutor | None = None

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: tuple[ImageInput, ...] = (),
        checked: bool = False,
    ) -> None:
        """Queue one choice (n = 1) of a request; raises `ValueError` if it can never run.

        Callers go through `intake.prepare` first; the check is repeated here because the
        engine must never hold a request that can not run, unless `checked` says that
        `intake.prepare` made this request in this process, from these very ids and params
        (`LLM` does: it checks every prompt before it queues any, and a second pass over
        512 long prompts' ids idled the GPU for ~0.2 s). `images` (vision-language models)
        fill the prompt's image placeholder tokens, in order.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if params.n != 1:
            raise ValueError(
                f"n must be 1 for one engine request (see intake.prepare), got {params.n}"
            )
        if not checked:
            prompt_token_ids = truncate_prompt(prompt_token_ids, params, bool(images))
            params = check_prompt(prompt_token_ids, params, self.limits)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.config.model.eos_token_ids,
            max_model_len=self.config.max_model_len,
            mm=self._multimodal(prompt_token_ids, images),
        )
        if params.structured_outputs is None:
            self._requests[request_id] = req
            self.scheduler.add_request(req)
            return
        # Admitted by the next step, at once if this grammar was compiled before.
        compiled = self.grammar_compiler.submit(params.structured_outputs)
        self._requests[request_id] = req
        self._compiling.append((req, compiled))

    def _multimodal(
        self, prompt_token_ids: list[int], images: tuple[ImageInput, ...]
    ) -> MultimodalPrompt | None:
        """The prompt's images and rotary positions (None for a text-only model or prompt)."""
        vision = self.config.model.vision
        if vision is None:
            if images:
                raise ValueError(f"images: {self.config.model.architecture} takes no images")
            return None
        if not images and vision.image_token_id not in prompt_token_ids:
            return None
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        return multimodal_prompt(
            prompt_token_ids, images, vision.image_token_id, vision.spatial_merge_size, patch
        )

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar to compile (not yet in the scheduler's queue)."""
        return len(self._compiling)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output grammars off this thread (made by the first use)."""
        if self._grammar_compiler is None:
            from tokenmill.structured.compiler import GrammarCompiler  # xgrammar only if used

            model = self.config.model
            self._grammar_compiler = GrammarCompiler(
                self.config.tokenizer or model.path, model.vocab_size, model.eos_token_ids
            )
        return self._grammar_compiler

    def _admit_compiled(self) -> list[EngineOutput]:
        """Queue the requests whose grammar is compiled; fail those whose compile failed."""
        if not self._compiling:
            return []
        from tokenmill.structured.matcher import RequestGrammar

        outputs, still = [], []
        for req, future in self._compiling:
            if not future.done():
                still.append((req, future))
            elif (exc := future.exception()) is not None:
                req.finish(FinishReason.ERROR)
                out = self._retire(req)
                if isinstance(exc, ValueError):  # the constraint's own fault: the client's
                    logger.info("request %s refused: %s", req.request_id, exc)
                    out = replace(out, error=str(exc))
                else:
                    logger.error("grammar of %s failed: %s", req.request_id, exc)
                outputs.append(out)
            else:
                req.grammar = RequestGrammar(future.result())
                self.scheduler.add_request(req)
        self._compiling = still
        return outputs

    def _retire(self, req: Request) -> EngineOutput:
        """The final output of a request that finished outside a step."""
        del self._requests[req.request_id]
        assert req.finish_reason is not None
        self.stats.finished[req.finish_reason.value] += 1
        return self._output(req, [], None)

    @property
    def limits(self) -> ContextLimits:
        """What a request must fit: the vocabulary and the context window."""
        return self.config.context_limits

    def abort_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> EngineOutput | None:
        """Finish a request now with `reason`; returns its final output, or None if unknown."""
        for i, (compiling, _) in enumerate(self._compiling):
            if compiling.request_id == request_id:
                del self._compiling[i]
                compiling.finish(reason)
                return self._retire(compiling)
        req = self.scheduler.abort(request_id, reason)
        if req is None:
            return None
        return self._retire(req)

    def request_ids(self) -> list[str]:
        """Ids of every request not yet finished."""
        return list(self._requests)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running, or has a token in flight."""
        in_flight = self._in_flight
        return (
            self.scheduler.has_unfinished()
            or bool(self._compiling)
            or (
                in_flight is not None
                and any(not s.request.is_finished for s in in_flight.batch.seqs)
            )
        )

    @property
    def step_in_flight(self) -> bool:
        """Whether a launched step is still unread: also one whose requests all finished while
        it ran (aborted), which `has_unfinished` leaves out. The next `step` reads it (its
        device time counted, as every launched step's is)."""
        return self._in_flight is not None

    def step(self) -> list[EngineOutput]:
        """Launch the next batch, then apply the previous one's tokens; returns new tokens.

        With overlap scheduling the host schedules and prepares step N+1 while the GPU runs
        step N, and reads step N's tokens only after N+1 is queued, so the GPU never waits for
        Python (the protocol: this module's docstring). A step N+1 needs N's tokens for
        (blocking, or one that may draft) reads N first; either way the outputs are returned
        after N+1 is launched.
        """
        start = time.perf_counter()
        self._waited = 0.0
        outputs: list[EngineOutput] = self._admit_compiled()
        previous, self._in_flight = self._in_flight, None
        # A step read before this launch: its tokens are applied now (scheduling needs them),
        # its outputs made after the launch (the device waits for this thread until then).
        applied: list[tuple[Request, int]] = []
        read_first = previous is not None and previous.plan.blocking
        if read_first:
            assert previous is not None
            applied, previous = self._apply(previous), None
        # Drafts continue the newest token: a step that may draft is scheduled after every
        # generated token is read (adaptive speculation lets plain steps overlap). Asked only
        # while a step is unread: after a verify step, read above, the answer changes nothing.
        overlap = self.config.runner.overlap_scheduling
        if previous is not None and (not overlap or self.scheduler.may_draft()):
            applied, previous = self._apply(previous), None
            read_first = True
        batch = self.scheduler.schedule(previous.unread if previous is not None else None)
        capture = self._graph_to_capture(batch) if self.runner.graphs_pending else None
        if capture is not None:  # it needs the device idle: the step in flight is read first
            if previous is not None:
                outputs += self._finish(previous)
                previous = None
            captured = time.perf_counter()
            self.runner.capture_pending_graph(capture)
            self._waited += time.perf_counter() - captured  # not the step's host time
            self._newest = None  # nor any step's cost
        launched: LaunchedStep | None = None
        if batch.plan is not None:
            grammar_mask = None
            masks: list[Future[GrammarMask | None]] = []  # the step's, once its launch made them
            # (Checked per row first: listing every sampled position costs at batch 64.)
            if any(s.request.grammar is not None and s.num_samples for s in batch.seqs):
                grammars, ahead = _grammars(batch)

                def grammar_mask(
                    device_drafts: Callable[[], np.ndarray] | None,
                ) -> Future[GrammarMask | None]:
                    # The masks need the previous step's tokens: read them while the GPU runs
                    # this step's forward pass, then fill the masks (the runner samples once
                    # they are done).
                    nonlocal previous
                    if previous is not None:
                        outputs.extend(self._finish(previous))
                        previous = None
                    assert batch.plan is not None
                    past, sampling = ahead, batch.plan.sampling
                    if device_drafts is not None:  # the masks and bans follow the drafts
                        drafts = device_drafts()
                        past = _past_device_drafts(batch, ahead, drafts)
                        if sampling.past_device_drafts:
                            sampling = sampling.ban_past_drafts(drafts, drafting_row_of(batch.plan))
                    masks.append(self._start_masks(grammars, past, sampling.suppressed))
                    return masks[-1]

            # The newest step is unread here iff it is `previous` (a grammar's read of it
            # during the launch overlaps the launch).
            newest_read = previous is None
            launch_start = time.perf_counter()
            launched = self.runner.launch(batch.plan, grammar_mask)
            ended: frozenset[int] = frozenset()
            if masks and self.config.speculative is not None:  # filled already (`_start_masks`)
                mask = masks[-1].result()
                ended = mask.ended if mask is not None else ended
            self._in_flight = InFlight.of(batch, batch.plan, launched, launch_start, ended)
            if self._newest is not None:
                self._before_newest = (self._newest, newest_read)
            self._newest = self._in_flight
            self.stats.iteration_tokens.observe(batch.num_tokens)
        elif previous is None and self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError("scheduler could not admit a request into an idle engine")
        elif previous is None and self._compiling:
            # Idle but for grammars still compiling: block briefly instead of spinning.
            wait([f for _, f in self._compiling], COMPILE_WAIT_S, FIRST_COMPLETED)
        outputs += self._outputs(applied)
        if previous is not None:
            outputs += self._finish(previous)
        if self._in_flight is not None and not overlap:
            outputs += self._finish(self._in_flight)
            self._in_flight = None
        # Host time of the step: everything but waiting for the GPU.
        host = time.perf_counter() - start - self._waited
        self.stats.step_seconds.observe(host)
        if batch.plan is not None:
            self.stats.step_seconds_by_kind[step_kind(batch)].observe(host)
        if launched is None:
            self._newest = None  # idle: the time until the next launch is no step's cost
        elif self._before_newest is not None:  # read by now, in this call or before
            self._measure(*self._before_newest, self._newest)
            self._before_newest = None
        return outputs

    def _graph_to_capture(self, batch: SchedulerOutput) -> GraphKey | None:
        """Background capture (`RunnerConfig.cuda_graph_capture`): the pending CUDA graph
        `batch` would run, captured before it launches; idle, the next pending one; else None
        (a step of a size whose graph is not captured runs eagerly)."""
        if batch.plan is not None:
            return self.runner.pending_graph_for(batch.plan)
        return None if self._compiling else self.runner.next_pending_graph()

    def _measure(self, step: InFlight, sync: bool, following: InFlight | None) -> None:
        """Tell adaptive speculation what a decode or verify step of its size (the query tokens
        its forward computed, padding included) cost (`spec.adaptive.step_seconds`): the time
        from its launch to the launch of the step `following` it, everything the engine and
        its caller did in between included (on the CPU the forward pass runs inside the
        launch). `sync`: it was read before that launch, so the device waited for the host; a
        plain step on the GPU then counts as overlapped, as it runs once drafting stops."""
        spec, plan = self.config.speculative, step.plan
        if spec is None or not spec.adaptive or following is None:
            return
        if not plan.samples_every_token:
            return  # a prefill chunk's cost says nothing about decoding
        plain = int(plan.query_lens.max()) == 1
        seconds = step_seconds(
            step.launched.forward_seconds(),
            following.launched_at - step.launched_at,
            sync,
            plain=plain,
            overlaps=self.runner.device.type == "cuda",
        )
        self.scheduler.step_cost.observe(step.launched.num_computed_tokens, seconds, not plain)

    def _finish(self, step: InFlight) -> list[EngineOutput]:
        """Wait for a launched step's tokens, apply them, and return its outputs."""
        return self._outputs(self._apply(step))

    def _apply(self, step: InFlight) -> list[tuple[Request, int]]:
        """Wait for a launched step's tokens and apply them to its requests (all that the
        next step's scheduling needs); returns the requests touched, with their new tokens."""
        wait_start = time.perf_counter()
        sampled = step.launched.read()
        self._waited += time.perf_counter() - wait_start
        seconds = step.launched.forward_seconds()
        self.stats.forward_seconds.observe(seconds)
        self.stats.forward_seconds_by_kind[step_kind(step.batch)].observe(seconds)
        _add_prompt_logprobs(step)
        tokens = sampled.token_ids if sampled is not None else []
        logprobs = sampled.logprobs if sampled is not None else []
        if step.ended:  # nothing follows a stop token that ended the grammar
            tokens = [PLACEHOLDER if i in step.ended else t for i, t in enumerate(tokens)]
        touched = self.scheduler.update(step.batch, tokens, logprobs)
        self._advance_grammars(touched)
        return touched

    def _outputs(self, touched: list[tuple[Request, int]]) -> list[EngineOutput]:
        """The outputs of the requests an applied step touched (`_apply`), counted in the
        stats; finished requests are forgotten."""
        outputs = []
        for req, num_new in touched:
            self.stats.generation_tokens += num_new
            if len(req.output_token_ids) == num_new:
                self.stats.prompt_tokens += len(req.prompt_token_ids)
            logprobs = req.take_new_logprobs() if req.params.logprobs is not None else None
            first = len(req.output_token_ids) == num_new
            output = self._output(req, req.output_token_ids[-num_new:], logprobs)
            if first and req.params.prompt_logprobs is not None:
                output = replace(output, prompt_logprobs=req.take_prompt_logprobs())
            outputs.append(output)
            if req.is_finished:
                del self._requests[req.request_id]
                assert req.finish_reason is not None
                self.stats.finished[req.finish_reason.value] += 1
        return outputs

    def _start_masks(
        self,
        grammars: list[RequestGrammar | None],
        ahead: list[tuple[int, ...]],
        suppressed: Mapping[int, tuple[int, ...]],
    ) -> Future[GrammarMask | None]:
        """Fill the batch's grammar masks on a background thread (xgrammar fills them without
        the GIL, while this thread schedules the next step). With speculative decoding they are
        filled here and now: scheduling checks drafts against the same grammars."""
        if self._bitmasks is None:
            from tokenmill.structured.matcher import BitmaskFiller

            pin = self.runner.device.type == "cuda"
            # Every grammar comes from one compiler, so they share its vocabulary.
            vocab_size = next(g for g in grammars if g is not None).vocab_size
            self._bitmasks = BitmaskFiller(vocab_size, pin=pin)
            self._mask_filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            # A thread waiting for the GIL gets it once the holder has run this long: at
            # Python's default (5 ms) the filler started and returned up to a step late while
            # this thread scheduled (1.5 ms per step of waiting for masks, H200, 256 rows).
            sys.setswitchinterval(MASK_THREAD_SWITCH_INTERVAL_S)
        if self.config.speculative is None:
            assert self._mask_filler is not None
            return self._mask_filler.submit(self._fill_masks, grammars, ahead, suppressed)
        done: Future[GrammarMask | None] = Future()
        done.set_result(self._fill_masks(grammars, ahead, suppressed))
        return done

    def _fill_masks(
        self,
        grammars: list[RequestGrammar | None],
        ahead: list[tuple[int, ...]],
        suppressed: Mapping[int, tuple[int, ...]],
    ) -> GrammarMask | None:
        """The grammar masks of a step's sampled positions, from each grammar's state now
        (past the drafts a position comes after), without the ids `suppressed` bans there."""
        assert self._bitmasks is not None
        banned = {i: list(ids) for i, ids in suppressed.items() if grammars[i] is not None}
        bitmask = self._bitmasks.fill(grammars, banned, ahead)
        if bitmask is None:
            return None
        rows = frozenset(i for i, g in enumerate(grammars) if g is not None)
        return GrammarMask(bitmask, rows, frozenset(self._bitmasks.ended))

    def _advance_grammars(self, touched: list[tuple[Request, int]]) -> None:
        """Feed each constrained request's new tokens to its grammar; end it when the grammar
        is complete (a stop token it accepted was not the request's end, e.g. ignore_eos)."""
        rows = [(req, req.grammar, req.output_token_ids[-num_new:]) for req, num_new in touched
                if req.grammar is not None and not req.is_finished]  # fmt: skip
        if not rows:
            return
        accept_batch = rows[0][1].accept_batch
        ok = [True] * len(rows)
        for at in range(max(len(new) for _, _, new in rows)):  # each position, all rows at once
            live = [i for i, (_, _, new) in enumerate(rows) if ok[i] and at < len(new)]
            accepted = accept_batch([rows[i][1] for i in live], [rows[i][2][at] for i in live])
            for i, accepted_one in zip(live, accepted, strict=True):
                ok[i] = accepted_one
        for (req, grammar, _), accepted_all in zip(rows, ok, strict=True):
            if not accepted_all:
                # Sampling applied the grammar's mask, so this is a bug, not bad input.
                logger.error("grammar of %s rejected a sampled token", req.request_id)
                self.scheduler.abort(req.request_id, FinishReason.ERROR)
            elif grammar.is_terminated:
                self.scheduler.abort(req.request_id, FinishReason.STOP)

    def _output(
        self, req: Request, new_tokens: list[int], logprobs: list[dict[int, Logprob]] | None
    ) -> EngineOutput:
        metrics = None
        if req.is_finished:
            metrics = RequestMetrics(
                arrival_time=req.arrival_time,
                scheduled_time=req.scheduled_time,
                first_token_time=req.first_token_time,
                finish_time=req.finish_time or time.time(),
                num_preemptions=req.num_preemptions,
                prompt_token_ids=req.prompt_token_ids,
            )
        return EngineOutput(
            request_id=req.request_id,
            new_token_ids=new_tokens,
            new_logprobs=logprobs,
            finish_reason=req.finish_reason,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=req.num_cached_tokens,
            metrics=metrics,
        )
