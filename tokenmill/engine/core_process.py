"""The engine-core process: receives requests and aborts, steps the engine, streams its outputs."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import OrderedDict

import msgspec
import torch
import zmq

from tokenmill.batch import FinishReason, Logprob
from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.engine.engine_core import EngineCore, EngineOutput
from tokenmill.intake import IntakeError
from tokenmill.ipc.messages import (
    AbortRequest,
    DroppedRequests,
    EngineInput,
    EngineRequest,
    EngineStats,
    EngineStep,
    HostKVCacheCounts,
    NewRequest,
    ProfileRequest,
    RequestDelta,
    RequestError,
    ResetPrefixCacheRequest,
    ShutdownRequest,
    SpecDecodeCounts,
    TokenLogprobs,
    VisionEncoderCounts,
    param_of,
)
from tokenmill.ipc.process import init_child
from tokenmill.ipc.sockets import Addresses, encode, pull, push, request_id_of
from tokenmill.observability.histogram import Histogram
from tokenmill.observability.startup import StartupTimer, process_age

logger = logging.getLogger(__name__)

IDLE_STATS_INTERVAL_S = 0.5
# Aborts that arrive before their request (still in a tokenizer) are remembered this long.
_MAX_EARLY_ABORTS = 4096


def run_engine_core(
    config: EngineConfig | EngineArgs, addresses: Addresses, log_level: str, server_pid: int
) -> None:
    """Process entry point: load the model, then serve until a ShutdownRequest.

    Given `EngineArgs`, the process resolves them into its configuration itself (`tokenmill
    serve` starts it before the server has imported torch and resolved them: the same
    arguments on the same machine give the same configuration)."""
    init_child(log_level, "engine_core", server_pid)
    startup = StartupTimer(started_ago=process_age())
    startup.rest("engine_imports")  # the process's start: Python, torch, tokenmill
    try:
        if isinstance(config, EngineArgs):
            with startup.phase("engine_config"):  # CUDA's driver starts here (device detection)
                config = config.for_server().create_engine_config()
        loop = EngineCoreLoop(config, addresses, startup)
    except ValueError as exc:  # an option refused, as resolved or as the caches are sized
        logger.error("engine core exits: %s", exc)
        logger.debug("where it was refused", exc_info=True)
        sys.exit(1)
    loop.run()


def _exit_engine(reason: str) -> None:
    """End the engine-core process now (a tensor-parallel rank is gone: no step can run); the
    server sees the engine exit and fails its requests (or restarts it)."""
    logger.critical("engine core exits: %s", reason)
    logging.shutdown()
    os._exit(1)


class EngineCoreLoop:
    """Drains the input socket, steps the engine while it has work, and publishes each step."""

    def __init__(self, config: EngineConfig, addresses: Addresses, startup: StartupTimer) -> None:
        """`startup` times the process's start-up; the model's loading is added to it."""
        self.engine = EngineCore(config)
        if self.engine.runner.workers is not None:
            self.engine.runner.workers.on_lost = _exit_engine
        startup.add(self.engine.runner.startup.phases)
        startup.rest("engine_setup")  # the scheduler, the cache manager, the host KV tier
        self.startup_seconds = startup.phases
        self.startup_ended_at = time.time()
        self.ctx = zmq.Context()
        self.inputs = pull(self.ctx, addresses.engine, bind=True)
        self.outputs = push(self.ctx, addresses.detokenizer, bind=False)
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.early_aborts: OrderedDict[str, None] = OrderedDict()
        self.running = True
        self.profiler: torch.profiler.profile | None = None
        self._reset_step()

    def _reset_step(self) -> None:
        self.new_requests: list[NewRequest] = []
        self.deltas: list[RequestDelta] = []
        self.errors: list[RequestError] = []

    def run(self) -> None:
        self._publish()  # the first stats tell the api server the model is loaded
        last_publish = time.monotonic()
        while self.running:
            busy = self._has_work()
            if self.inputs.poll(0 if busy else int(IDLE_STATS_INTERVAL_S * 1000)):
                self._drain_inputs()
            if self.running and self._has_work():
                self._step()
            if (
                self.deltas
                or self.errors
                or time.monotonic() - last_publish > IDLE_STATS_INTERVAL_S
            ):
                self._publish()
                last_publish = time.monotonic()
        self._publish()
        self.engine.runner.close()
        self.ctx.destroy(linger=1000)

    def _has_work(self) -> bool:
        """Requests to step, a launched step to read (its requests aborted while it ran), or
        CUDA graphs still to capture (background capture: an idle step captures one)."""
        engine = self.engine
        return engine.has_unfinished() or engine.step_in_flight or engine.runner.graphs_pending > 0

    def _drain_inputs(self) -> None:
        while True:
            try:
                raw = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self.decoder.decode(raw)
            except msgspec.DecodeError as exc:  # a bug upstream; fail that request, if any
                logger.error("undecodable engine input: %s", exc)
                if (request_id := request_id_of(raw)) is not None:
                    self.errors.append(RequestError(request_id, str(exc), status=500))
                continue
            self._handle(msg)

    def _handle(self, msg: EngineInput) -> None:
        if isinstance(msg, EngineRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            for rid in msg.request_ids:
                self._abort(rid, FinishReason(msg.reason))
        elif isinstance(msg, DroppedRequests):
            for rid in msg.request_ids:
                self.early_aborts.pop(rid, None)
                self.engine.stats.finished[FinishReason.ABORT.value] += 1
        elif isinstance(msg, ProfileRequest):
            self._profile(msg)
        elif isinstance(msg, ResetPrefixCacheRequest):
            logger.info("prefix cache reset: %d pages freed", self.engine.cache.flush())
        elif isinstance(msg, ShutdownRequest):
            for rid in list(self.engine.request_ids()):
                self._abort(rid, FinishReason.ABORT)
            self.running = False

    def _profile(self, msg: ProfileRequest) -> None:
        if msg.start and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, with_stack=True)
            self.profiler.start()
            logger.info("profiler started")
        elif not msg.start and self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.stop()
            path = os.path.join(msg.directory, f"engine-core-{int(time.time())}.json")
            try:  # --profile-dir may name a file, or a folder this process cannot write
                os.makedirs(msg.directory, exist_ok=True)
                profiler.export_chrome_trace(path)
            except OSError as exc:
                logger.error("profiler trace not written (--profile-dir): %s", exc)
                return
            logger.info("profiler trace written to %s", path)

    def _add(self, msg: EngineRequest) -> None:
        if msg.request_id in self.early_aborts:
            # The client left before its request got here (an abort can overtake its request:
            # they come through different pipes). It ends as aborted all the same.
            del self.early_aborts[msg.request_id]
            self.engine.stats.finished[FinishReason.ABORT.value] += 1
            return
        try:
            images = tuple(payload.image() for payload in msg.images)
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params, images)
        except IntakeError as exc:
            self.errors.append(RequestError(msg.request_id, str(exc), param=exc.param))
            return
        except ValueError as exc:
            self.errors.append(RequestError(msg.request_id, str(exc)))
            return
        self.new_requests.append(NewRequest(msg.request_id, msg.prompt_token_ids, msg.params))

    def _abort(self, request_id: str, reason: FinishReason) -> None:
        out = self.engine.abort_request(request_id, reason)
        if out is not None:
            self.deltas.append(_delta(out))
            return
        self.early_aborts[request_id] = None
        while len(self.early_aborts) > _MAX_EARLY_ABORTS:
            self.early_aborts.popitem(last=False)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # A bug, not bad input: fail every request loudly instead of hanging the clients.
            logger.exception("engine step failed; failing all running requests")
            for rid in list(self.engine.request_ids()):
                self.engine.abort_request(rid, FinishReason.ERROR)
                self.errors.append(RequestError(rid, "internal engine error", status=500))
            return
        for out in outputs:
            if out.error is None:
                self.deltas.append(_delta(out))
            else:  # refused after it was accepted: a 400 for the client, not a finish
                error = RequestError(out.request_id, out.error, param=param_of(out.error))
                self.errors.append(error)

    def _publish(self) -> None:
        step = EngineStep(self.new_requests, self.deltas, self.errors, self._stats())
        self.outputs.send(encode(step))
        self._reset_step()

    def _stats(self) -> EngineStats:
        return engine_stats(self.engine, self.startup_seconds, self.startup_ended_at)


def engine_stats(
    engine: EngineCore, startup_seconds: dict[str, float], startup_ended_at: float
) -> EngineStats:
    """A snapshot of `engine`'s load and counters, as the api server's metrics read it."""
    cache = engine.cache
    return EngineStats(
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting) + engine.num_compiling,
        kv_used_pages=cache.num_used_pages,
        kv_total_pages=cache.pool.num_pages,
        prefix_cache_queries=cache.stats.queries,
        prefix_cache_hits=cache.stats.hits,
        num_preemptions=engine.scheduler.stats.num_preemptions,
        finished=dict(engine.stats.finished),
        prompt_tokens=engine.stats.prompt_tokens,
        generation_tokens=engine.stats.generation_tokens,
        histograms=_histograms(engine),
        engine_pid=os.getpid(),
        spec_decode=_spec_counts(engine),
        host_kv_cache=_host_counts(engine),
        vision_encoder=_encoder_counts(engine),
        startup_seconds=startup_seconds,
        startup_ended_at=startup_ended_at,
        graphs_pending=engine.runner.graphs_pending,
    )


def _histograms(engine: EngineCore) -> dict[str, Histogram]:
    histograms = {
        "scheduler_step_seconds": engine.stats.step_seconds,
        "model_forward_seconds": engine.stats.forward_seconds,
        "iteration_tokens_total": engine.stats.iteration_tokens,
    }
    for kind, histogram in engine.stats.forward_seconds_by_kind.items():
        histograms[f"model_forward_seconds_{kind}_steps"] = histogram
    for kind, histogram in engine.stats.step_seconds_by_kind.items():
        histograms[f"scheduler_step_seconds_{kind}_steps"] = histogram
    if engine.config.speculative is not None:
        histograms["spec_decode_chosen_drafts"] = engine.scheduler.spec_stats.chosen_drafts
    return histograms


def _spec_counts(engine: EngineCore) -> SpecDecodeCounts | None:
    if engine.config.speculative is None:
        return None
    spec = engine.scheduler.spec_stats
    return SpecDecodeCounts(
        num_drafts=spec.num_drafts,
        num_draft_tokens=spec.num_draft_tokens,
        num_accepted_tokens=spec.num_accepted_tokens,
        accepted_per_position=list(spec.accepted_per_position),
    )


def _encoder_counts(engine: EngineCore) -> VisionEncoderCounts | None:
    cache = engine.runner.encoder_cache
    if cache is None:
        return None
    return VisionEncoderCounts(
        cache.stats.images_encoded, cache.stats.cache_hits, cache.encoder_seconds()
    )


def _host_counts(engine: EngineCore) -> HostKVCacheCounts | None:
    cache = engine.cache
    if cache.host is None or cache.radix is None:
        return None
    stats = cache.host.poll()
    return HostKVCacheCounts(
        hit_tokens=stats.hit_tokens,
        bytes_loaded=stats.bytes_loaded,
        bytes_written=stats.bytes_written,
        load_seconds=stats.load_seconds,
        used_pages=cache.radix.num_host_pages,
        total_pages=cache.host.pool.num_pages,
    )


def _wire_logprobs(entry: dict[int, Logprob]) -> TokenLogprobs:
    return [(tid, lp.logprob, lp.rank) for tid, lp in entry.items()]


def _delta(out: EngineOutput) -> RequestDelta:
    logprobs = None
    if out.new_logprobs is not None:
        logprobs = [_wire_logprobs(entry) for entry in out.new_logprobs]
    prompt_logprobs = None
    if out.prompt_logprobs is not None:
        prompt_logprobs = [None if e is None else _wire_logprobs(e) for e in out.prompt_logprobs]
    return RequestDelta(
        request_id=out.request_id,
        new_token_ids=out.new_token_ids,
        logprobs=logprobs,
        finish_reason=out.finish_reason.value if out.finish_reason else None,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        metrics=out.metrics,
        prompt_logprobs=prompt_logprobs,
    )
