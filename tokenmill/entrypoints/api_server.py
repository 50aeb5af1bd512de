"""The OpenAI-compatible HTTP server (FastAPI) and the launcher of its worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

import tokenmill
from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.entrypoints import openai_responses as oai
from tokenmill.entrypoints.engine_client import ChoiceOutput, EngineClient, RequestFailed
from tokenmill.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.entrypoints.supervisor import Supervisor, server_workers
from tokenmill.entrypoints.tool_parsers import ToolParser, ToolStream
from tokenmill.ipc import messages
from tokenmill.ipc.sockets import Addresses
from tokenmill.observability.metrics import ServerMetrics
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenization.tokenizer import apply_chat_template, encode_prompt, load_tokenizer

logger = logging.getLogger("tokenmill.server")

STARTUP_TIMEOUT_S = 900.0
DASHBOARD_HTML = Path(__file__).resolve().parent.parent / "dashboard" / "index.html"
DISCONNECT_POLL_S = 0.1
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


@dataclass(frozen=True)
class ServeArgs:
    """Server options on top of the engine's."""

    engine: EngineArgs
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    num_tokenizer_workers: int = 1
    log_level: str = "INFO"
    trace_file: str | None = None
    log_requests: bool = False
    enable_profiling: bool = False
    profile_dir: str = "tokenmill-profiles"
    restart_engine: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An OpenAI-style error body: `{"error": {"message", "type", "param", "code"}}`."""
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status)


@dataclass
class ServerState:
    """What the HTTP handlers share: the engine client, the tokenizer and the child processes."""

    args: ServeArgs
    config: EngineConfig
    client: EngineClient
    tokenizer: PreTrainedTokenizerBase | None
    supervisor: Supervisor | None = None
    shutting_down: bool = False

    @property
    def healthy(self) -> bool:
        return self.client.ready.is_set() and self.client.failure is None


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application; its lifespan waits for the engine and watches the children."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        reader = asyncio.create_task(state.client.run_output_loop())
        assert state.supervisor is not None
        watcher = asyncio.create_task(state.supervisor.watch())
        await _wait_ready(state)
        logger.info(
            "tokenmill %s ready: serving %r on http://%s:%d",
            tokenmill.__version__,
            state.args.model_name,
            state.args.host,
            state.args.port,
        )
        try:
            yield
        finally:
            reader.cancel()
            watcher.cancel()

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())[1:]]  # drop "body"
        param = loc[0] if loc else None
        return error_response(400, f"{'.'.join(loc) or 'body'}: {first.get('msg')}", param)

    @app.get("/health")
    async def health() -> Response:
        """Liveness and readiness: 200 when serving, 503 while starting, stopping or broken."""
        if state.healthy and not state.shutting_down:
            return Response(status_code=200)
        return Response(status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """The tokenmill version."""
        return {"version": tokenmill.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The served model (OpenAI `GET /v1/models`)."""
        card = {
            "id": state.args.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tokenmill",
            "root": state.config.model.path,
            "max_model_len": state.config.max_model_len,
            "vocab_size": state.config.model.vocab_size,
        }
        return {"object": "list", "data": [card]}

    @app.get("/load")
    async def load() -> dict[str, Any]:
        """Engine load for routers: queue lengths and KV-cache use."""
        stats = state.client.stats
        if stats is None:
            return {}
        return {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "kv_cache_used_pages": stats.kv_used_pages,
            "kv_cache_total_pages": stats.kv_total_pages,
            "kv_cache_usage": stats.kv_used_pages / stats.kv_total_pages,
            "requests_finished": stats.finished,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics (text exposition format)."""
        return Response(state.client.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/dashboard")
    async def dashboard() -> Response:
        """The live dashboard page."""
        return Response(DASHBOARD_HTML.read_text(), media_type="text/html")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """Drop cached prefixes (e.g. after changing what prompts look like)."""
        state.client.reset_prefix_cache()
        return Response(status_code=200)

    @app.post("/start_profile")
    async def start_profile() -> Response:
        """Start the engine core's torch profiler (needs --enable-profiling)."""
        return _profile(state, start=True)

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        """Stop the profiler and write its Chrome trace (needs --enable-profiling)."""
        return _profile(state, start=False)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        """Token ids of a prompt or of a chat rendered with the chat template."""
        if (failure := _check_model(state, body.model)) is not None:
            return failure
        try:
            if body.messages is not None:
                chat = [m.template_dict() for m in body.messages]
                ids = apply_chat_template(state.tokenizer, chat)
            elif body.prompt is not None:
                ids = encode_prompt(state.tokenizer, body.prompt, body.add_special_tokens)
            else:
                raise ValueError("give prompt or messages")
        except ValueError as exc:
            return error_response(400, str(exc))
        max_len = state.config.max_model_len
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": max_len})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        """Text of token ids."""
        if (failure := _check_model(state, body.model)) is not None:
            return failure
        if state.tokenizer is None:
            return error_response(400, "the model has no tokenizer")
        vocab = state.config.model.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            return error_response(400, f"tokens must be in [0, {vocab})", "tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        """OpenAI completions, streamed or not."""
        return await _serve_generation(state, raw, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        """OpenAI chat completions, streamed or not."""
        return await _serve_generation(state, raw, body, chat=True)

    return app


def _profile(state: ServerState, start: bool) -> Response:
    if not state.args.enable_profiling:
        return error_response(404, "profiling is off; start the server with --enable-profiling")
    directory = os.path.abspath(state.args.profile_dir)
    state.client.profile(start, directory)
    return JSONResponse({"profiling": start, "directory": directory})


def _check_model(state: ServerState, model: str | None) -> JSONResponse | None:
    if model is not None and model != state.args.model_name:
        return error_response(404, f"The model `{model}` does not exist.", "model")
    return None


async def _serve_generation(
    state: ServerState,
    raw: Request,
    body: CompletionRequest | ChatCompletionRequest,
    chat: bool,
) -> Response:
    if (failure := _check_model(state, body.model)) is not None:
        return failure
    if state.shutting_down or not state.healthy:
        return error_response(503, state.client.failure or "the server is not ready")
    try:
        params = body.sampling_params()
        requests = _tokenize_requests(body, params)
    except ValueError as exc:
        return error_response(400, str(exc), _param_of(str(exc)))
    response = oai.ResponseState(
        request_id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        model=state.args.model_name,
        n=params.n,
    )
    for i, r in enumerate(requests):
        r.request_id = f"{response.request_id}-{i}"
    outputs = state.client.generate(requests)
    top_n = params.logprobs or 0
    try:
        if not body.stream:
            if not await _collect(raw, response, outputs):
                return Response(status_code=499)  # the client is gone; nobody reads this
            if isinstance(body, ChatCompletionRequest):
                return JSONResponse(oai.chat_body(response, top_n, body.tool_parser))
            return JSONResponse(oai.completion_body(response, top_n))
        # Wait for the first output so that a bad request still gets a 400, not a broken stream.
        first = await anext(outputs)
    except RequestFailed as exc:
        return error_response(exc.error.status, exc.error.message, exc.error.param)
    parser = body.tool_parser if isinstance(body, ChatCompletionRequest) else None
    stream = _stream(response, first, outputs, chat, top_n, body.include_usage, parser)
    return StreamingResponse(stream, media_type="text/event-stream")


def _tokenize_requests(
    body: CompletionRequest | ChatCompletionRequest, params: SamplingParams
) -> list[messages.TokenizeRequest]:
    if isinstance(body, ChatCompletionRequest):
        chat = [m.template_dict() for m in body.messages]
        tools = body.template_tools()
        return [messages.TokenizeRequest("", params, messages=chat, tools=tools)]
    return [messages.TokenizeRequest("", params, prompt=p) for p in body.prompts()]


def _param_of(message: str) -> str | None:
    """The field a validation message names (SamplingParams messages start with it)."""
    word = message.split(" ", 1)[0]
    return word if word.isidentifier() else None


async def _collect(
    raw: Request, response: oai.ResponseState, outputs: AsyncIterator[ChoiceOutput]
) -> bool:
    """Gather a non-streamed response; False (and aborted) if the client disconnects meanwhile."""

    async def gather() -> None:
        async for item in outputs:
            response.add(item)

    task = asyncio.create_task(gather())
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await raw.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await _close(outputs)
            return False
    task.result()  # re-raises RequestFailed
    return True


async def _close(outputs: AsyncIterator[ChoiceOutput]) -> None:
    aclose: Callable[[], Awaitable[None]] | None = getattr(outputs, "aclose", None)
    if aclose is not None:
        await aclose()


async def _stream(
    response: oai.ResponseState,
    first: ChoiceOutput,
    outputs: AsyncIterator[ChoiceOutput],
    chat: bool,
    top_n: int,
    include_usage: bool,
    tool_parser: ToolParser | None = None,
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per output, an optional usage chunk, then `[DONE]`."""
    started: set[int] = set()
    tool_streams: dict[int, ToolStream] = {}

    def chunks(item: ChoiceOutput) -> list[dict[str, Any]]:
        index = response.index(item)
        response.add(item)
        out = item.output
        if not chat:
            return [oai.completion_chunk(response, index, out, top_n)]
        result = []
        if index not in started:
            started.add(index)
            role = {"role": "assistant", "content": ""}
            result.append(oai.chat_chunk(response, index, role, None, top_n))
        if tool_parser is not None:
            stream = tool_streams.setdefault(index, ToolStream(tool_parser))
            return result + oai.tool_chunks(response, index, stream, out, top_n)
        if out.text or out.finish_reason is not None or out.logprobs:
            delta = {"content": out.text} if out.text else {}
            result.append(oai.chat_chunk(response, index, delta, out, top_n))
        return result

    try:
        for chunk in chunks(first):
            yield _sse(chunk)
        async for item in outputs:
            for chunk in chunks(item):
                yield _sse(chunk)
        if include_usage:
            yield _sse(oai.usage_chunk(response, chat))
    except RequestFailed as exc:
        error = {"message": exc.error.message, "type": _ERROR_TYPES.get(exc.error.status)}
        yield _sse({"error": {**error, "param": exc.error.param, "code": exc.error.status}})
    finally:
        await _close(outputs)
    yield "data: [DONE]\n\n"


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _wait_ready(state: ServerState) -> None:
    """Block start-up until the engine has loaded the model (or a child died trying)."""
    try:
        await asyncio.wait_for(state.client.ready.wait(), STARTUP_TIMEOUT_S)
    except TimeoutError as exc:
        raise RuntimeError(f"engine not ready after {STARTUP_TIMEOUT_S:.0f} s") from exc
    if state.client.failure is not None:
        raise RuntimeError(state.client.failure)


class _Server(uvicorn.Server):
    """uvicorn, plus: on SIGTERM/SIGINT, stop taking requests and end in-flight ones first."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0

    def fail(self, message: str) -> None:
        """End the server with exit code 1 (a worker died for good)."""
        self.exit_code = 1
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.state.shutting_down:
            self.state.shutting_down = True
            logger.info("shutting down: aborting in-flight requests")
            self.state.client.abort_all()
        super().handle_exit(sig, frame)
        # uvicorn would re-raise the signal after its shutdown, killing us before the children
        # are stopped; the shutdown is graceful, so exit normally instead.
        self._captured_signals.clear()


def serve(args: ServeArgs) -> int:
    """Start the worker processes and serve HTTP until SIGTERM/SIGINT; returns an exit code."""
    if args.num_tokenizer_workers < 1:
        raise ValueError(f"num_tokenizer_workers must be >= 1, got {args.num_tokenizer_workers}")
    config = args.engine.create_engine_config()
    tokenizer_path = args.engine.tokenizer or args.engine.model
    tokenizer = load_tokenizer(tokenizer_path)
    addresses = Addresses.fresh(args.num_tokenizer_workers)
    try:
        metrics = ServerMetrics(args.model_name, args.trace_file, args.log_requests)
        client = EngineClient(addresses, metrics)
        state = ServerState(args=args, config=config, client=client, tokenizer=tokenizer)
        uv_config = uvicorn.Config(
            build_app(state),
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            timeout_graceful_shutdown=10,
        )
        server = _Server(uv_config, state)
        workers = server_workers(config, addresses, tokenizer_path, args.log_level)
        state.supervisor = Supervisor(workers, client, args.restart_engine, server.fail)
        state.supervisor.start()
        try:
            server.run()
        finally:
            state.supervisor.stop()
            client.close()
    finally:
        addresses.remove()
    return server.exit_code if server.started else 1
