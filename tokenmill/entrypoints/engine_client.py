"""EngineClient: the api server's handle on the tokenizer, engine and detokenizer processes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from tokenmill.intake import fan_out, owner_request_id, split_child_request_id
from tokenmill.ipc.messages import (
    AbortRequest,
    ClientBatch,
    ClientOutput,
    EngineStats,
    ProfileRequest,
    RequestError,
    ResetPrefixCacheRequest,
    ShutdownRequest,
    TokenizeRequest,
)
from tokenmill.ipc.sockets import Addresses, encode, pull, push
from tokenmill.observability.metrics import ChoiceTracker, ServerMetrics

logger = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A request ended in an error (bad input found by a worker, or a dead engine)."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True)
class ChoiceOutput:
    """One output of one choice: which prompt and which of its `n` samples it belongs to."""

    prompt_index: int
    choice: int
    output: ClientOutput


# What a queued output counts toward a request's backlog besides its logprob entries: the
# output itself (~4 entries' worth of memory: its struct, text and token list).
OUTPUT_ENTRIES = 4


def backlog_entries(item: ClientOutput | RequestError) -> int:
    """What `item` counts toward its request's backlog (`Backlog`), in logprob entries."""
    if isinstance(item, RequestError):
        return 0
    size = OUTPUT_ENTRIES + len(item.token_ids)
    if item.logprobs is not None:
        size += sum(map(len, item.logprobs))
    if item.prompt_logprobs is not None:
        size += sum(map(len, item.prompt_logprobs.entries))
    return size


@dataclass
class Backlog:
    """One HTTP request's outputs that its handler has not taken yet, bounded.

    A streaming client that stops reading leaves its handler waiting on the socket while the
    engine goes on generating: without a bound its outputs piled up here (two such clients
    of 128 choices with 20 alternatives: +150 MB in 110 s). Past `limit` logprob entries'
    worth (`backlog_entries`), the queued outputs are dropped and the request is aborted
    (`EngineClient`); the handler, if it ever resumes, meets the error.
    """

    limit: int
    queue: asyncio.Queue[ClientOutput | RequestError] = field(default_factory=asyncio.Queue)
    held: int = 0

    def put(self, item: ClientOutput | RequestError) -> bool:
        """Queue `item`; False (nothing queued) if that would pass the limit with outputs
        already waiting (one output alone is no backlog: its handler takes it next)."""
        size = backlog_entries(item)
        if self.held and self.held + size > self.limit:
            return False
        self.held += size
        self.queue.put_nowait(item)
        return True

    async def get(self) -> ClientOutput | RequestError:
        """The oldest output (waits for one)."""
        item = await self.queue.get()
        self.held -= backlog_entries(item)
        return item

    def overflow(self, error: RequestError) -> None:
        """Drop every queued output and queue `error` alone."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.held = 0
        self.queue.put_nowait(error)


@dataclass
class _InFlight:
    """One sub-request (one prompt of an HTTP request) between submission and its last output."""

    outputs: Backlog  # shared by the HTTP request's sub-requests
    child_ids: list[str]
    tokenizer: int  # the worker it was sent to
    unstarted: set[str]  # choices the engine core has not accepted yet


class EngineClient:
    """Sends tokenize requests and aborts; routes outputs back to the waiting HTTP handlers.

    Outgoing sockets are synchronous (a PUSH send only queues the message), so aborts can be
    sent from `finally` blocks of cancelled handlers; the output socket is read by one task.
    Each tokenizer worker has a socket of its own, so that when one dies the requests it held
    (those whose choices the engine has not accepted yet) are known and failed.
    """

    def __init__(
        self, addresses: Addresses, metrics: ServerMetrics, max_backlog: int = 1 << 22
    ) -> None:
        self.metrics = metrics
        self.max_backlog = max_backlog  # `Backlog.limit` (--max-response-logprobs)
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._to_tokenizers = [
            push(self._sync_ctx, address, bind=False) for address in addresses.tokenizers
        ]
        self._to_engine = push(self._sync_ctx, addresses.engine, bind=False)
        for sock in (*self._to_tokenizers, self._to_engine):
            sock.setsockopt(zmq.SNDHWM, 0)
        self._next_tokenizer = 0
        self._outputs = pull(self._async_ctx, addresses.api, bind=True)
        self._decoder = msgspec.msgpack.Decoder(ClientBatch)
        self._in_flight: dict[str, _InFlight] = {}  # by sub-request id
        self.ready = asyncio.Event()
        self.first_stats_at = 0.0  # when (`time.time()`) the engine's first stats arrived
        self.failure: str | None = None
        self._awaited_engine_pid: int | None = None

    @property
    def stats(self) -> EngineStats | None:
        """The engine's latest stats (None until the engine has loaded the model)."""
        return self.metrics.engine.stats

    async def run_output_loop(self) -> None:
        """Forever: read client batches and hand each output to its request's queue."""
        while True:
            batch = self._decoder.decode(await self._outputs.recv())
            if batch.stats is not None:
                self._on_stats(batch.stats)
            for child_id in batch.started:
                entry = self._in_flight.get(owner_request_id(child_id))
                if entry is not None:
                    entry.unstarted.discard(child_id)
            for item in [*batch.outputs, *batch.errors]:
                # Tokenizer errors carry the sub-request's id, engine outputs a choice's id; an
                # item of a request already ended (its first error ended it) is dropped.
                entry = self._in_flight.get(owner_request_id(item.request_id))
                if entry is not None and not entry.outputs.put(item):
                    self._overflow(entry.outputs)

    def _overflow(self, outputs: Backlog) -> None:
        """End the request whose handler left `outputs` unread past their bound: abort its
        choices, drop what is queued (its prompts still at a tokenizer worker too: its handler,
        which finds them gone from `_in_flight`, cannot), and leave the error for the
        handler."""
        ended = {sub_id: e for sub_id, e in self._in_flight.items() if e.outputs is outputs}
        for sub_id in ended:
            del self._in_flight[sub_id]
        self.abort(sorted(cid for e in ended.values() for cid in e.child_ids))
        self._drop_queued(ended)
        logger.warning("aborted %s: its client left more than %d logprob entries' worth of "
                       "outputs unread", ", ".join(ended), outputs.limit)  # fmt: skip
        message = (
            f"the response's unsent outputs passed {outputs.limit} logprob entries' worth "
            "(--max-response-logprobs): the client stopped reading its stream"
        )
        outputs.overflow(RequestError(next(iter(ended), ""), message, status=400))

    def _on_stats(self, stats: EngineStats) -> None:
        if not self.first_stats_at:
            self.first_stats_at = time.time()
        self.metrics.engine.stats = stats
        if self._awaited_engine_pid is not None and stats.engine_pid == self._awaited_engine_pid:
            logger.info("engine core (pid %d) is ready again", stats.engine_pid)
            self._awaited_engine_pid = None
            self.failure = None
        self.ready.set()

    async def generate(self, requests: list[TokenizeRequest]) -> AsyncIterator[ChoiceOutput]:
        """Submit the sub-requests of one HTTP request and yield their outputs as they come.

        Raises `RequestFailed` on the first error. If the caller stops early (client gone, error,
        shutdown), the unfinished choices are aborted in the engine, freeing their pages.
        """
        if self.failure is not None:
            raise RequestFailed(RequestError("", self.failure, status=503))
        outputs = Backlog(self.max_backlog)
        index = {r.request_id: i for i, r in enumerate(requests)}
        choices = {r.request_id: fan_out(r.request_id, r.params) for r in requests}
        trackers = {cid: ChoiceTracker(cid, p) for cs in choices.values() for cid, p in cs}
        unfinished = set(trackers)
        try:
            for r in requests:
                child_ids = [cid for cid, _ in choices[r.request_id]]
                worker = self._next_tokenizer
                self._next_tokenizer = (worker + 1) % len(self._to_tokenizers)
                try:
                    payload = encode(r)
                except (OverflowError, UnicodeEncodeError) as exc:  # TokenizeRequest checks these
                    raise RequestFailed(RequestError(r.request_id, str(exc), status=400)) from exc
                self._in_flight[r.request_id] = _InFlight(
                    outputs, child_ids, worker, set(child_ids)
                )
                self._to_tokenizers[worker].send(payload)
            while unfinished:
                item = await outputs.get()
                if isinstance(item, RequestError):
                    raise RequestFailed(item)
                sub_id, choice = split_child_request_id(item.request_id)
                self.metrics.on_output(trackers[item.request_id], item)
                if item.finish_reason is not None:
                    unfinished.discard(item.request_id)
                yield ChoiceOutput(index[sub_id], choice, item)
        finally:
            ended = {r.request_id: self._in_flight.pop(r.request_id, None) for r in requests}
            if unfinished:
                self.abort(sorted(unfinished))
                self._drop_queued(ended)

    def _drop_queued(self, entries: dict[str, _InFlight | None]) -> None:
        """Tell each tokenizer worker to drop the sub-requests (id → entry) of an ended
        request that it may still hold (the engine has not accepted all their choices), rather
        than tokenize them while other requests wait; named by their choices' engine request
        ids, which a worker reports to the engine for what it drops (`DroppedRequests`)."""
        by_worker: dict[int, list[str]] = {}
        for entry in entries.values():
            if entry is not None and entry.unstarted:
                by_worker.setdefault(entry.tokenizer, []).extend(entry.child_ids)
        for worker, child_ids in by_worker.items():
            self._to_tokenizers[worker].send(encode(AbortRequest(child_ids)))

    def abort(self, engine_request_ids: list[str]) -> None:
        """Ask the engine to finish these requests now (finish reason "abort")."""
        self._to_engine.send(encode(AbortRequest(engine_request_ids)))

    def abort_all(self) -> None:
        """Abort every request in flight (used on shutdown)."""
        ids = [cid for entry in self._in_flight.values() for cid in entry.child_ids]
        if ids:
            self.abort(ids)

    @property
    def num_in_flight(self) -> int:
        """Sub-requests submitted and not yet ended."""
        return len(self._in_flight)

    def fail_in_flight(self, message: str, status: int, tokenizer: int | None = None) -> int:
        """Fail the requests in flight (only those still with `tokenizer`, if given); their
        handlers then abort them in the engine. Returns how many were failed."""
        failed = 0
        for sub_id, entry in list(self._in_flight.items()):
            if tokenizer is None or (entry.tokenizer == tokenizer and entry.unstarted):
                entry.outputs.queue.put_nowait(RequestError(sub_id, message, status=status))
                failed += 1
        return failed

    def fail_all(self, message: str) -> None:
        """Fail every request in flight and refuse new ones (the engine core died)."""
        self.failure = message
        self.fail_in_flight(message, status=500)

    @property
    def awaiting_engine(self) -> bool:
        """True while a restarted engine core loads its model."""
        return self._awaited_engine_pid is not None

    def engine_restarting(self, message: str, pid: int) -> None:
        """Fail every request in flight and refuse new ones until engine `pid` reports in."""
        self.fail_all(message)
        self._awaited_engine_pid = pid

    def shutdown_engine(self) -> None:
        """Ask the engine core to abort what it still runs and exit."""
        self._to_engine.send(encode(ShutdownRequest()))

    def reset_prefix_cache(self) -> None:
        """Ask the engine to drop every cached prefix no request is using."""
        self._to_engine.send(encode(ResetPrefixCacheRequest()))

    def profile(self, start: bool, directory: str) -> None:
        """Start, or stop and write, the engine core's profiler trace."""
        self._to_engine.send(encode(ProfileRequest(start, directory)))

    def close(self) -> None:
        self.metrics.close()
        self._sync_ctx.destroy(linger=0)
        self._async_ctx.destroy(linger=0)
