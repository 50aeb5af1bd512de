"""EngineClient: the api server's handle on the tokenizer, engine and detokenizer processes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

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


class EngineClient:
    """Sends tokenize requests and aborts; routes outputs back to the waiting HTTP handlers.

    Outgoing sockets are synchronous (a PUSH send only queues the message), so aborts can be
    sent from `finally` blocks of cancelled handlers; the output socket is read by one task.
    """

    def __init__(self, addresses: Addresses, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._to_tokenizer = push(self._sync_ctx, addresses.tokenizer, bind=True)
        self._to_engine = push(self._sync_ctx, addresses.engine, bind=False)
        for sock in (self._to_tokenizer, self._to_engine):
            sock.setsockopt(zmq.SNDHWM, 0)
        self._outputs = pull(self._async_ctx, addresses.api, bind=True)
        self._decoder = msgspec.msgpack.Decoder(ClientBatch)
        # sub-request id → (its HTTP request's queue, its number of choices)
        self._queues: dict[str, tuple[asyncio.Queue[ClientOutput | RequestError], int]] = {}
        self.ready = asyncio.Event()
        self.failure: str | None = None

    @property
    def stats(self) -> EngineStats | None:
        """The engine's latest stats (None until the engine has loaded the model)."""
        return self.metrics.engine.stats

    async def run_output_loop(self) -> None:
        """Forever: read client batches and hand each output to its request's queue."""
        while True:
            batch = self._decoder.decode(await self._outputs.recv())
            if batch.stats is not None:
                self.metrics.engine.stats = batch.stats
                self.ready.set()
            for item in [*batch.outputs, *batch.errors]:
                entry = self._queues.get(item.request_id.rsplit(":", 1)[0])
                if entry is not None:
                    entry[0].put_nowait(item)

    async def generate(self, requests: list[TokenizeRequest]) -> AsyncIterator[ChoiceOutput]:
        """Submit the sub-requests of one HTTP request and yield their outputs as they come.

        Raises `RequestFailed` on the first error. If the caller stops early (client gone, error,
        shutdown), the unfinished choices are aborted in the engine, freeing their pages.
        """
        if self.failure is not None:
            raise RequestFailed(RequestError("", self.failure, status=503))
        queue: asyncio.Queue[ClientOutput | RequestError] = asyncio.Queue()
        index = {r.request_id: i for i, r in enumerate(requests)}
        unfinished = {f"{r.request_id}:{c}" for r in requests for c in range(r.params.n)}
        trackers = {
            f"{r.request_id}:{c}": ChoiceTracker(f"{r.request_id}:{c}", r.params.for_choice(c))
            for r in requests
            for c in range(r.params.n)
        }
        for r in requests:
            self._queues[r.request_id] = (queue, r.params.n)
        try:
            for r in requests:
                self._to_tokenizer.send(encode(r))
            while unfinished:
                item = await queue.get()
                if isinstance(item, RequestError):
                    raise RequestFailed(item)
                sub_id, choice = item.request_id.rsplit(":", 1)
                self.metrics.on_output(trackers[item.request_id], item)
                if item.finish_reason is not None:
                    unfinished.discard(item.request_id)
                yield ChoiceOutput(index[sub_id], int(choice), item)
        finally:
            for r in requests:
                self._queues.pop(r.request_id, None)
            if unfinished:
                self.abort(sorted(unfinished))

    def abort(self, engine_request_ids: list[str]) -> None:
        """Ask the engine to finish these requests now (finish reason "abort")."""
        self._to_engine.send(encode(AbortRequest(engine_request_ids)))

    def abort_all(self) -> None:
        """Abort every request in flight (used on shutdown)."""
        ids = [f"{sub}:{c}" for sub, (_, n) in self._queues.items() for c in range(n)]
        if ids:
            self.abort(ids)

    def fail_all(self, message: str) -> None:
        """Fail every waiting request and refuse new ones (a child process died)."""
        self.failure = message
        for sub_id, (queue, _) in list(self._queues.items()):
            queue.put_nowait(RequestError(sub_id, message, status=500))

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
