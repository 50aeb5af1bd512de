"""The api server's EngineClient against its real sockets, the workers played by the test."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from tokenmill.entrypoints import api_server
from tokenmill.entrypoints.engine_client import EngineClient, RequestFailed
from tokenmill.ipc.messages import ClientBatch, ClientOutput, RequestError, TokenizeRequest
from tokenmill.ipc.sockets import Addresses, encode, pull, push
from tokenmill.observability.metrics import ServerMetrics
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenization.tokenizer_worker import Inbox


def _finished(request_id: str) -> ClientOutput:
    return ClientOutput(request_id, "x", [1], None, "length", 1, 0)


@dataclass
class _PlayedWorkers:
    """An `EngineClient` on its real sockets, its output loop running (`reader`); the test
    plays the tokenizer worker (`tokenizer`: what the api server sends it) and every worker
    that answers the api server (`api`)."""

    client: EngineClient
    tokenizer: zmq.Socket
    api: zmq.Socket
    reader: asyncio.Task[None]


@contextlib.asynccontextmanager
async def _played_workers() -> AsyncIterator[_PlayedWorkers]:
    addresses = Addresses.fresh(1)
    ctx = zmq.Context()
    client = EngineClient(addresses, ServerMetrics("m", trace_file=None, log_requests=False))
    reader = asyncio.create_task(client.run_output_loop())
    try:
        yield _PlayedWorkers(
            client,
            pull(ctx, addresses.tokenizers[0], bind=True),
            push(ctx, addresses.api, bind=False),
            reader,
        )
    finally:
        reader.cancel()
        client.close()
        ctx.destroy(linger=0)
        addresses.remove()


async def _errors_after_the_request_ended() -> list[str]:
    """A two-prompt request whose prompts both fail, their errors in two batches (the second
    arrives after the first ended the request), then a request that should still be served."""
    decoder = msgspec.msgpack.Decoder(TokenizeRequest)
    params = SamplingParams(max_tokens=1)
    async with _played_workers() as workers:
        client, tokenizer, api = workers.client, workers.tokenizer, workers.api

        async def send_later(batch: ClientBatch) -> None:
            await asyncio.sleep(0.05)
            api.send(encode(batch))

        failing = [TokenizeRequest(f"cmpl-a-{i}", params, prompt="") for i in range(2)]
        first_error = RequestError("cmpl-a-0", "no tokens", status=400)
        sender = asyncio.create_task(send_later(ClientBatch([], [first_error])))
        with pytest.raises(RequestFailed):
            async with asyncio.timeout(10):
                async for _ in client.generate(failing):
                    pass
        await sender
        sent = [decoder.decode(tokenizer.recv()).request_id for _ in failing]
        assert sent == ["cmpl-a-0", "cmpl-a-1"]
        api.send(encode(ClientBatch([], [RequestError("cmpl-a-1", "no tokens", status=400)])))
        served = []
        sender = asyncio.create_task(send_later(ClientBatch([_finished("cmpl-b-0:0")], [])))
        async with asyncio.timeout(10):
            async for choice in client.generate([TokenizeRequest("cmpl-b-0", params, prompt="hi")]):
                served.append(choice.output.request_id)
        await sender
        assert not workers.reader.done()
        return served


def test_an_error_for_a_request_already_ended_is_dropped_and_serving_goes_on() -> None:
    assert asyncio.run(_errors_after_the_request_ended()) == ["cmpl-b-0:0"]


async def _fail_essential_task(client: EngineClient) -> None:
    async def broken() -> None:
        raise RuntimeError("boom")

    state = SimpleNamespace(client=client)
    task = api_server._essential_task(state, broken(), "output reader")  # type: ignore[arg-type]
    with contextlib.suppress(RuntimeError):
        await task
    await asyncio.sleep(0)  # done callbacks run on the next turn of the loop


def test_a_failed_essential_task_fails_requests_fast_instead_of_hanging(
    caplog: pytest.LogCaptureFixture,
) -> None:
    addresses = Addresses.fresh(1)
    client = EngineClient(addresses, ServerMetrics("m", trace_file=None, log_requests=False))
    try:
        asyncio.run(_fail_essential_task(client))
        assert client.failure == "internal error: the api server's output reader failed"
        assert "output reader failed" in caplog.text and "boom" in caplog.text
    finally:
        client.close()
        addresses.remove()


async def _next_handled(client: EngineClient, inbox: Inbox, api: zmq.Socket) -> str:
    """Serve a next request, "cmpl-b-0", and return the id the tokenizer worker's inbox hands
    out next (the next request's, unless the ended request's prompts are still queued)."""
    decoder = msgspec.msgpack.Decoder(TokenizeRequest)
    async with asyncio.timeout(10):
        params = SamplingParams(max_tokens=1)
        next_request = client.generate([TokenizeRequest("cmpl-b-0", params, prompt="hi")])
        second = asyncio.ensure_future(anext(next_request))
        await asyncio.sleep(0.05)
        handled = decoder.decode(inbox.next()).request_id
        api.send(encode(ClientBatch([_finished("cmpl-b-0:0")], [])))
        await second
        await next_request.aclose()
    return handled


async def _handled_after_a_refused_prompt() -> list[str]:
    """A three-prompt request whose first prompt is refused, then a one-prompt request: the
    ids a tokenizer worker's inbox hands out, in order."""
    decoder = msgspec.msgpack.Decoder(TokenizeRequest)
    params = SamplingParams(max_tokens=1)
    async with _played_workers() as workers:
        client, inbox, api = workers.client, Inbox(workers.tokenizer), workers.api
        prompts = [TokenizeRequest(f"cmpl-a-{i}", params, prompt="x" * 99) for i in range(3)]
        refused = client.generate(prompts)
        first = asyncio.ensure_future(anext(refused))
        await asyncio.sleep(0.05)  # all three sent to the worker
        handled = [decoder.decode(inbox.next()).request_id]
        api.send(encode(ClientBatch([], [RequestError("cmpl-a-0", "too long", status=400)])))
        with pytest.raises(RequestFailed):
            async with asyncio.timeout(10):
                await first
        await refused.aclose()
        handled.append(await _next_handled(client, inbox, api))
        return handled


def test_a_refused_prompt_drops_its_requests_other_prompts_from_the_tokenizer_queue() -> None:
    """The request is answered at its first refused prompt; its other prompts, still queued at
    the tokenizer worker, are dropped, not tokenized ahead of the next request (34 prompts of
    462 kB, each refused after ~0.3 s of tokenizing, held the next request 11 s)."""
    assert asyncio.run(_handled_after_a_refused_prompt()) == ["cmpl-a-0", "cmpl-b-0"]


async def _an_unread_stream() -> tuple[list[str], int, str]:
    """A request whose handler takes its first output, then stops taking (a streaming client
    that does not read); the engine keeps sending its choice's outputs (one token and 20
    alternatives each). Returns the ids the engine was asked to abort, the entries held once
    500 outputs were sent, and the error the handler meets when it resumes."""
    ctx = zmq.Context()
    async with _played_workers() as workers:
        client, api = workers.client, workers.api
        engine = pull(ctx, _engine_address(client), bind=True)
        client.max_backlog = 2_500
        request = TokenizeRequest("cmpl-a-0", SamplingParams(max_tokens=9999), prompt="hi")
        outputs = client.generate([request])
        first = asyncio.ensure_future(anext(outputs))
        await asyncio.sleep(0.05)
        alternatives = [[(t, "x", -1.0, t) for t in range(21)]]
        for i in range(500):
            out = ClientOutput("cmpl-a-0:0", "x", [i], alternatives, None, 1, 0)
            api.send(encode(ClientBatch([out], [])))
            if i == 0:
                async with asyncio.timeout(10):
                    await first
                backlog = client._in_flight["cmpl-a-0"].outputs
        await asyncio.sleep(0.2)  # the output loop reads all 500
        held = backlog.held + backlog.queue.qsize() - 1  # the error alone is queued
        aborted = msgspec.msgpack.decode(engine.recv(zmq.NOBLOCK))["request_ids"]
        with pytest.raises(RequestFailed) as failed:
            async with asyncio.timeout(10):
                await anext(outputs)
        engine.close()
    ctx.destroy(linger=0)
    return aborted, held, failed.value.error.message


def _engine_address(client: EngineClient) -> str:
    return client._to_engine.getsockopt_string(zmq.LAST_ENDPOINT)


def test_a_stream_left_unread_is_aborted_once_its_backlog_passes_the_bound() -> None:
    """Its queued outputs are dropped, its choices aborted in the engine, and the handler
    meets a 400 naming the bound if it resumes; nothing more is held for it."""
    aborted, held, message = asyncio.run(_an_unread_stream())
    assert aborted == ["cmpl-a-0:0"]
    assert held == 0
    assert "--max-response-logprobs" in message and "stopped reading" in message


async def _handled_after_an_overflow() -> list[str]:
    """A two-prompt request whose first prompt's outputs pass the bound unread while its
    second prompt is still queued at the tokenizer worker, then a one-prompt request: the ids
    the worker's inbox hands out, in order."""
    decoder = msgspec.msgpack.Decoder(TokenizeRequest)
    params = SamplingParams(max_tokens=9999)
    async with _played_workers() as workers:
        client, inbox, api = workers.client, Inbox(workers.tokenizer), workers.api
        client.max_backlog = 100
        prompts = [TokenizeRequest(f"cmpl-a-{i}", params, prompt="hi") for i in range(2)]
        outputs = client.generate(prompts)
        first = asyncio.ensure_future(anext(outputs))
        await asyncio.sleep(0.05)  # both sent to the worker
        handled = [decoder.decode(inbox.next()).request_id]
        for i in range(50):  # the handler takes the first, then no more
            out = ClientOutput("cmpl-a-0:0", "x", [i], None, None, 1, 0)
            api.send(encode(ClientBatch([out], [], started=["cmpl-a-0:0"] if i == 0 else [])))
            if i == 0:
                async with asyncio.timeout(10):
                    await first
        await asyncio.sleep(0.2)  # the output loop reads all 50: the bound is passed
        with pytest.raises(RequestFailed):
            async with asyncio.timeout(10):
                await anext(outputs)
        await outputs.aclose()
        handled.append(await _next_handled(client, inbox, api))
        return handled


def test_an_overflow_drops_the_requests_other_prompts_from_the_tokenizer_queue() -> None:
    """The request aborted for its unread backlog has its prompts still queued at the
    tokenizer worker dropped there, as a request ended by its handler has: they were
    tokenized (and sent to the engine, to be dropped as aborted) ahead of the next request."""
    assert asyncio.run(_handled_after_an_overflow()) == ["cmpl-a-0", "cmpl-b-0"]


def test_one_output_alone_is_no_backlog() -> None:
    """An output past the bound is queued when nothing waits (its handler takes it next: a
    large prompt_logprobs output of a response being read is not an unread stream); a second
    one behind it is refused."""
    from tokenmill.entrypoints.engine_client import Backlog

    async def put_two() -> list[bool]:
        backlog = Backlog(limit=10)
        big = ClientOutput("r:0", "x", list(range(20)), None, None, 1, 0)
        return [backlog.put(big), backlog.put(_finished("r:0"))]

    assert asyncio.run(put_two()) == [True, False]


def test_requests_a_tokenizer_worker_dropped_count_as_aborted(llama_dir: Path) -> None:
    """The engine core never sees them: the worker's report counts each choice as aborted
    (`request_success{finished_reason="abort"}`), and forgets the abort it holds for it."""
    from tokenmill.config import EngineArgs
    from tokenmill.engine.core_process import EngineCoreLoop
    from tokenmill.ipc.messages import AbortRequest, DroppedRequests
    from tokenmill.observability.startup import StartupTimer

    addresses = Addresses.fresh(1)
    config = EngineArgs(model=str(llama_dir), device="cpu").create_engine_config()
    loop = EngineCoreLoop(config, addresses, StartupTimer())
    try:
        loop._handle(AbortRequest(["r-0:0", "r-0:1"]))  # the api server's, before the drop
        assert list(loop.early_aborts) == ["r-0:0", "r-0:1"]
        loop._handle(DroppedRequests(["r-0:0", "r-0:1"]))
        assert loop.engine.stats.finished["abort"] == 2 and not loop.early_aborts
    finally:
        loop.ctx.destroy(linger=0)
        addresses.remove()
