"""The OpenAI-compatible HTTP server (FastAPI) and the launcher of its worker processes.

The edge: every request is validated by the pydantic models of `protocol` (strict types, ranges,
this model's vocabulary and context, the `--max-*` limits) before any work is queued; every error
is a JSON body in OpenAI's shape; load is shed with 503 beyond `--max-waiting-requests`; an api
key, when set, guards every route but /health (and /metrics).

Start-up: the server listens from its first second; until the engine has loaded the model, /v1
routes answer 503 with Retry-After and /health answers 503 "starting". When it is ready, one log
line lists each start-up phase's seconds (`tokenmill:startup_seconds{phase}` in /metrics).
"""

# No `from __future__ import annotations`: the routes take request classes built per server
# (`protocol.request_models`), and FastAPI reads handler annotations as real objects.

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tokenmill
from tokenmill.config import EngineArgs, ServedModel
from tokenmill.entrypoints import openai_responses as oai
from tokenmill.entrypoints.early_start import EarlyStart
from tokenmill.entrypoints.engine_client import ChoiceOutput, EngineClient, RequestFailed
from tokenmill.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    FeedbackRequest,
    RequestLimits,
    RequestModels,
    error_param,
    request_models,
)
from tokenmill.entrypoints.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream
from tokenmill.entrypoints.server_options import ServerOptions
from tokenmill.entrypoints.supervisor import Supervisor, server_workers
from tokenmill.entrypoints.tool_parsers import ToolParser, ToolStream
from tokenmill.ipc import messages
from tokenmill.ipc.sockets import Addresses
from tokenmill.observability.metrics import ServerMetrics
from tokenmill.observability.startup import StartupTimer, process_age, startup_line
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenization.tokenizer import (
    PromptBounds,
    apply_chat_template,
    encode_prompt,
    load_tokenizer,
    read_chat_template,
)
from tokenmill.vision.images import without_image_data

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")
logger = logging.getLogger("tokenmill.server")

STARTUP_TIMEOUT_S = 900.0
DASHBOARD_HTML = Path(__file__).resolve().parent.parent / "dashboard" / "index.html"
DISCONNECT_POLL_S = 0.1
# Routes anyone may call: orchestrators probe /health without credentials; /metrics (and the
# dashboard page, which only reads /metrics) unless --metrics-require-auth.
PUBLIC_ROUTES = frozenset({"/health"})
METRICS_ROUTES = frozenset({"/metrics", "/dashboard"})
# Polled every second by dashboards and orchestrators: never written to the access log.
QUIET_ROUTES = frozenset({"/metrics", "/health"})
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def _errors_doc(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses (FastAPI would document 422 instead)."""
    return {s: {"model": ErrorResponse, "description": _ERROR_TYPES[s]} for s in statuses}


# Every route may answer 401 (api key); those that take a body also these; /v1 routes also 503
# (while the server starts, and for generation when it is overloaded or a worker died).
_BODY_ERRORS = _errors_doc(400, 404, 413)
_V1_ERRORS = _errors_doc(503)
_V1_BODY_ERRORS = _errors_doc(400, 404, 413, 503)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    # A message may quote client text; keep it encodable whatever the client sent.
    safe = message.encode("utf-8", "backslashreplace").decode("utf-8")
    error = {"message": safe, "type": _ERROR_TYPES.get(status, "Error"), "param": param}
    return {"error": {**error, "code": status}}


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An OpenAI-style error response."""
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


@dataclass
class ServerState:
    """What the HTTP handlers share: options, the engine client, the tokenizer, the workers.

    `waiting` counts the sequences this server has submitted that have not produced their first
    token yet (tokenizing, queued or prefilling): the queue that `--max-waiting-requests` bounds.
    `startup` times the server's start-up phases, the engine's added when it is ready.
    """

    options: ServerOptions
    engine: EngineArgs
    config: ServedModel
    client: EngineClient
    # Loaded on a thread while the server starts (/tokenize and /detokenize wait for it).
    tokenizer: "Future[PreTrainedTokenizerBase | None]"
    model_name: str
    limits: RequestLimits
    log_level: str = "INFO"
    supervisor: Supervisor | None = None
    shutting_down: bool = False
    waiting: int = 0
    rejected: int = 0
    startup: StartupTimer = field(default_factory=StartupTimer)

    @property
    def starting(self) -> bool:
        """The engine has not loaded the model yet (nor has a worker died trying)."""
        return not self.client.ready.is_set()

    @property
    def healthy(self) -> bool:
        return self.client.ready.is_set() and self.client.failure is None


def request_limits(
    model_name: str, options: ServerOptions, config: ServedModel, bounds: PromptBounds | None
) -> RequestLimits:
    """The limits requests are validated against: the model's, then the options'; `bounds`:
    the tokenizer's (None: the model has none)."""
    max_prompt_bytes = options.max_prompt_bytes
    if max_prompt_bytes is None:
        # A prompt of more bytes than max_model_len tokens of the longest token cannot fit;
        # x2 because a normalizer (NFC, NFKC) may fold a few input bytes into fewer.
        longest = bounds.longest_token_bytes if bounds is not None else 1
        max_prompt_bytes = 2 * config.max_model_len * longest
    return RequestLimits(
        model_name=model_name,
        vocab_size=config.vocab_size,
        max_model_len=config.max_model_len,
        max_prompt_bytes=max_prompt_bytes,
        max_n=options.max_n,
        max_stop=options.max_stop,
        max_stop_chars=options.max_stop_chars,
        min_prompt_chars=int(bounds is not None and not bounds.empty_prompt_has_tokens),
        images=config.vision is not None,
        tool_parser=options.tool_call_parser,
        max_chat_messages=options.max_chat_messages or config.max_model_len,
    )


def _essential_task(
    state: ServerState, work: Coroutine[Any, Any, None], name: str
) -> asyncio.Task[None]:
    """Run `work` for the server's lifetime; should it ever fail, the failure is logged and every
    request, waiting or new, fails fast (503, /health too) instead of waiting forever."""

    def ended(task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        logger.error("the api server's %s failed", name, exc_info=task.exception())
        state.client.fail_all(f"internal error: the api server's {name} failed")

    task = asyncio.create_task(work, name=name)
    task.add_done_callback(ended)
    return task


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application; its lifespan reads the engine's outputs, starts and watches the
    workers and waits for the engine to be ready, without holding up the server."""
    models: RequestModels = request_models(state.limits)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        reader = _essential_task(state, state.client.run_output_loop(), "output reader")
        assert state.supervisor is not None
        watcher = _essential_task(state, state.supervisor.run(), "worker watcher")
        starter = asyncio.create_task(_await_engine(state), name="start-up")
        try:
            yield
        finally:
            for task in (reader, watcher, starter):
                task.cancel()

    app = FastAPI(
        title="tokenmill",
        version=tokenmill.__version__,
        lifespan=lifespan,
        responses=_errors_doc(401),
    )
    _add_error_handlers(app)
    _add_middleware(app, state)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    @app.get("/health")
    async def health() -> Response:
        """Liveness and readiness: 200 when serving; 503 while starting, stopping or broken,
        its body `{"status": "starting" | "stopping" | "unavailable"}`."""
        if state.healthy and not state.shutting_down:
            return Response(status_code=200)
        status = "stopping" if state.shutting_down else "starting" if state.starting else None
        return JSONResponse({"status": status or "unavailable"}, status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """The tokenmill version."""
        return {"version": tokenmill.__version__}

    @app.get("/v1/models", responses=_V1_ERRORS)
    async def list_models() -> dict[str, Any]:
        """The served model (OpenAI `GET /v1/models`)."""
        card = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tokenmill",
            "root": state.config.path,
            "max_model_len": state.config.max_model_len,
            "vocab_size": state.config.vocab_size,
        }
        return {"object": "list", "data": [card]}

    @app.get("/load")
    async def load() -> dict[str, Any]:
        """Load for routers: queue lengths, KV-cache use, and requests refused as overload."""
        edge = {
            "num_sequences_waiting_first_token": state.waiting,
            "num_requests_rejected": state.rejected,
        }
        stats = state.client.stats
        if stats is None:
            return edge
        return {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "kv_cache_used_pages": stats.kv_used_pages,
            "kv_cache_total_pages": stats.kv_total_pages,
            "kv_cache_usage": stats.kv_used_pages / stats.kv_total_pages,
            "requests_finished": stats.finished,
            **edge,
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

    @app.post("/tokenize", responses=_BODY_ERRORS)
    async def tokenize(body: models.tokenize) -> Response:  # type: ignore[valid-type]
        """Token ids of a prompt or of a chat rendered with the chat template."""
        if (failure := _check_model(state, body.model)) is not None:
            return failure
        try:
            options = body.chat_options()
        except ValueError as exc:
            return error_response(400, str(exc), messages.param_of(str(exc)))

        def encode(tokenizer: "PreTrainedTokenizerBase | None") -> list[int]:
            if body.messages is not None:
                if any(m.has_images() for m in body.messages):
                    raise ValueError(
                        "messages: /tokenize takes text only (an image's token count depends "
                        "on its preprocessing)"
                    )
                chat = [m.template_dict() for m in body.messages]
                return apply_chat_template(tokenizer, chat, options=options)
            return encode_prompt(tokenizer, body.prompt, body.add_special_tokens)

        tokenizer = await _tokenizer(state)
        if isinstance(tokenizer, Response):
            return tokenizer
        try:
            # Off the event loop: a long prompt takes seconds (the tokenizer releases the GIL).
            ids = await asyncio.to_thread(encode, tokenizer)
        except ValueError as exc:
            return error_response(400, str(exc), "messages" if body.messages else "prompt")
        max_len = state.config.max_model_len
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": max_len})

    @app.post("/detokenize", responses=_BODY_ERRORS)
    async def detokenize(body: models.detokenize) -> Response:  # type: ignore[valid-type]
        """Text of token ids."""
        if (failure := _check_model(state, body.model)) is not None:
            return failure
        tokenizer = await _tokenizer(state)
        if isinstance(tokenizer, Response):
            return tokenizer
        if tokenizer is None:
            return error_response(400, "the model has no tokenizer", "tokens")
        text = await asyncio.to_thread(tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    @app.post("/v1/completions", responses=_V1_BODY_ERRORS)
    async def completions(body: models.completion, raw: Request) -> Response:  # type: ignore[valid-type]
        """OpenAI completions, streamed or not."""
        return await _serve_generation(state, raw, body, chat=False)

    @app.post("/v1/chat/completions", responses=_V1_BODY_ERRORS)
    async def chat_completions(body: models.chat, raw: Request) -> Response:  # type: ignore[valid-type]
        """OpenAI chat completions, streamed or not."""
        return await _serve_generation(state, raw, body, chat=True)

    _add_feedback_routes(app, state)
    return app


def _add_feedback_routes(app: FastAPI, state: ServerState) -> None:
    """User feedback on finished requests, and their traces (`observability/feedback.py`)."""

    @app.post("/v1/feedback", responses=_V1_BODY_ERRORS)
    async def feedback(body: FeedbackRequest) -> Response:
        """Rate a finished request's response: `request_id` is the response's `id`; `rating`
        -1 (bad), 0 (neutral) or 1 (good); stored with the request's trace."""
        log = state.client.metrics.feedback
        if (unknown := log.unknown_request_message(body.request_id)) is not None:
            return error_response(400, unknown, "request_id")
        record = log.add(body.request_id, body.rating, body.comment)
        return JSONResponse({"object": "feedback", **record.to_json()})

    @app.get("/v1/feedback", responses=_V1_ERRORS)
    async def list_feedback(
        max_rating: int | None = Query(None, ge=-1, le=1), limit: int = Query(50, ge=1, le=1000)
    ) -> dict[str, Any]:
        """Recent feedback, newest first (`max_rating=-1`: the negative only)."""
        recent = state.client.metrics.feedback.recent(max_rating, limit)
        return {"object": "list", "data": [f.to_json() for f in recent]}

    @app.get("/v1/traces/{request_id}", responses=_errors_doc(404, 503))
    async def trace(request_id: str) -> Response:
        """A recent request's trace lines (token ids, timings; one per choice) and its feedback,
        read back from --trace-file."""
        log = state.client.metrics.feedback
        lines = await asyncio.to_thread(log.read_trace, request_id)
        if not lines:
            why = "no --trace-file" if log.trace_path is None else "none among the recent requests"
            return error_response(404, f"no trace of request {request_id!r} ({why})")
        feedback = [f.to_json() for f in log.for_request(request_id)]
        return JSONResponse({"request_id": request_id, "lines": lines, "feedback": feedback})


def _add_error_handlers(app: FastAPI) -> None:
    """Every error FastAPI or Starlette raises, as OpenAI's error body."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = error_param(exc.errors()[0])
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 413:
            return _too_large()
        return error_response(exc.status_code, message, headers=headers)


def _add_middleware(app: FastAPI, state: ServerState) -> None:
    """Innermost first: 503 on /v1 while starting, HEAD as GET, internal errors as 500s, the
    body limit, the api key, then CORS (outermost, so that browsers' preflight requests need no
    key)."""
    app.add_middleware(_Starting, state=state)
    app.add_middleware(_HeadAsGet)
    app.add_middleware(_InternalErrors)
    app.add_middleware(_BodyLimit, max_bytes=state.options.max_request_body_bytes)
    key = state.options.resolved_api_key
    if key is not None:
        public = PUBLIC_ROUTES | (set() if state.options.metrics_require_auth else METRICS_ROUTES)
        app.add_middleware(_ApiKey, key=key, public=frozenset(public))
    if state.options.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.options.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )


class _Starting:
    """Until the engine has loaded the model, every /v1 route answers 503 in OpenAI's shape with
    Retry-After (the server listens meanwhile: clients see it starting, not refusing)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        v1 = scope["type"] == "http" and _route_path(scope).startswith("/v1/")
        if v1 and self.state.starting:
            retry = str(self.state.options.retry_after_s)
            message = f"the server is starting: the model is loading; retry after {retry} s"
            response = error_response(503, message, headers={"Retry-After": retry})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _HeadAsGet:
    """HEAD on a GET route (load balancers' health checks) is answered as GET without the body,
    as HTTP says, rather than 405."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class _InternalErrors:
    """Any exception a handler lets escape becomes a 500 in OpenAI's shape.

    Starlette's own handler answers plain text and re-raises, and uvicorn then closes the
    connection without `Connection: close`, breaking the client's next kept-alive request.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            logger.exception("internal error in %s %s", scope.get("method"), scope.get("path"))
            if started:  # the status is out; all we can do is end the body
                raise
            body = error_body(500, "internal server error; the request was not completed")
            await JSONResponse(body, status_code=500)(scope, receive, send)


class _BodyLimit:
    """413 for a body over `max_bytes`: at once when Content-Length says so (nothing is read),
    else as soon as the chunks received pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            await _too_large()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413)  # answered by the HTTPException handler
            return message

        await self.app(scope, limited_receive, send)


def _too_large() -> JSONResponse:
    return error_response(
        413,
        "request body is larger than this server's limit (--max-request-body-bytes)",
        # The rest of the body stays unread: this connection cannot carry another request.
        headers={"Connection": "close"},
    )


class _ApiKey:
    """Bearer-token check on every route but the public ones (constant-time comparison)."""

    def __init__(self, app: ASGIApp, key: str, public: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) in self.public:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            await self.app(scope, receive, send)
            return
        response = error_response(
            401,
            "missing or wrong api key; send the header `Authorization: Bearer <key>`",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The request's path inside the app (without --root-path)."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})


def _integral_bounds(node: Any) -> Any:
    """FastAPI's schema model stores bounds as floats (`"maximum": 128.0`), which leads schema
    fuzzers to send `5.0` for integers; write whole bounds as integers again."""
    if isinstance(node, dict):
        return {
            k: int(v) if k in _BOUNDS and isinstance(v, float) and v.is_integer() else
            _integral_bounds(v)
            for k, v in node.items()
        }  # fmt: skip
    if isinstance(node, list):
        return [_integral_bounds(v) for v in node]
    return node


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The schema, with errors documented as they are answered: 400, never 422."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, routes=app.routes, description=__doc__
        )
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = _integral_bounds(schema)
    return app.openapi_schema


def _profile(state: ServerState, start: bool) -> Response:
    if not state.options.enable_profiling:
        return error_response(404, "profiling is off; start the server with --enable-profiling")
    directory = os.path.abspath(state.options.profile_dir)
    state.client.profile(start, directory)
    return JSONResponse({"profiling": start, "directory": directory})


# The most characters of a client's text an error message repeats.
MAX_ECHOED_CHARS = 256


def _check_model(state: ServerState, model: str | None) -> JSONResponse | None:
    if model is not None and model != state.model_name:
        name = model if len(model) <= MAX_ECHOED_CHARS else model[:MAX_ECHOED_CHARS] + "..."
        return error_response(404, f"The model `{name}` does not exist.", "model")
    return None


def _shed(state: ServerState, sequences: int) -> JSONResponse | None:
    """503 + Retry-After when admitting `sequences` more would overfill the waiting queue.

    A request larger than the whole limit is admitted when nothing waits, so it cannot starve.
    """
    limit = state.options.max_waiting_requests
    if limit is None or state.waiting == 0 or state.waiting + sequences <= limit:
        return None
    state.rejected += 1
    state.client.metrics.rejected.inc()
    retry = str(state.options.retry_after_s)
    return error_response(
        503,
        f"the server is overloaded: {state.waiting} sequences wait for their first token "
        f"(limit {limit}); retry after {retry} s",
        headers={"Retry-After": retry},
    )


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
        # Off the event loop: a structured-output constraint is parsed here (xgrammar, without
        # the GIL), up to half a second for the largest one allowed.
        params = await asyncio.to_thread(body.sampling_params, state.config.sampling_defaults)
        requests = _tokenize_requests(body, params)
    except ValueError as exc:
        return error_response(400, str(exc), messages.param_of(str(exc)))
    sequences = params.n * len(requests)
    if (overloaded := _shed(state, sequences)) is not None:
        return overloaded
    echo = None
    if isinstance(body, CompletionRequest) and body.echo:
        echo = await _echo(state, body)
        if isinstance(echo, Response):
            return echo
    response = oai.ResponseState(
        request_id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        model=state.model_name,
        n=params.n,
        tokens_as_ids=body.return_tokens_as_token_ids,
        echo=echo,
        prompt_top_n=body.prompt_logprobs,
    )
    for i, r in enumerate(requests):
        r.request_id = f"{response.request_id}-{i}"
    if state.options.log_requests:
        _log_arrival(state, response.request_id, requests)
    outputs = _count_waiting(state, state.client.generate(requests), len(requests), params.n)
    top_n = params.logprobs or 0
    reasoning = _reasoning_parser(state, params) if chat else None
    try:
        if not body.stream:
            limit = state.options.max_response_logprobs
            if not await _collect(raw, response, outputs, limit):
                return Response(status_code=499)  # the client is gone; nobody reads this
            build: Callable[[], dict[str, Any]] = functools.partial(
                oai.completion_body, response, top_n
            )
            if isinstance(body, ChatCompletionRequest):
                build = functools.partial(
                    oai.chat_body, response, top_n, body.tool_parser, reasoning
                )
            # Off the event loop: with logprobs of many long choices a body is hundreds of MB
            # (64 prompts of 2,000 tokens, echo: 257 MB, built and encoded in 8.4 s).
            content = await asyncio.to_thread(lambda: _json_body(build()))
            return Response(content, media_type="application/json")
        # Wait for the first output so that a bad request still gets a 400, not a broken stream.
        first = await _first(raw, outputs)
        if first is None:
            return Response(status_code=499)  # the client left while the request was queued
    except RequestFailed as exc:
        return error_response(exc.error.status, exc.error.message, exc.error.param)
    parser = body.tool_parser if isinstance(body, ChatCompletionRequest) else None
    parsers = (parser, reasoning)
    usage = (body.include_usage, body.continuous_usage)
    stream = _stream(response, first, outputs, chat, top_n, usage, parsers)
    return StreamingResponse(stream, media_type="text/event-stream")


def _json_body(body: dict[str, Any]) -> bytes:
    """`body` as `JSONResponse` encodes it (its `choices` any iterable, consumed once), but
    one encoder call per choice, each choice encoded before the next is made: the encoder
    holds the GIL for a whole call (one call on a body of hundreds of MB held up the event
    loop, even from another thread, for seconds), and the choices' dicts of a body with many
    logprobs, made whole, took 3.3x the body's size beside the outputs they came from."""
    parts = []
    for key, value in body.items():
        parts.append(b"," if parts else b"{")
        parts.append(_json_text(key).encode() + b":")
        if key == "choices":
            parts.append(b"[")
            for i, choice in enumerate(value):
                parts.append(b"," if i else b"")
                parts.append(_json_text(choice).encode("utf-8"))
            parts.append(b"]")
        else:
            parts.append(_json_text(value).encode("utf-8"))
    return b"".join([*parts, b"}"])


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _reasoning_parser(state: ServerState, params: SamplingParams) -> ReasoningParser | None:
    """The server's reasoning parser, unless a grammar shapes the output from its first token
    (structured outputs, a required tool call): such an output holds no reasoning."""
    name = state.options.reasoning_parser
    if name is None or params.structured_outputs is not None:
        return None
    return REASONING_PARSERS[name]


async def _echo(state: ServerState, body: CompletionRequest) -> oai.Echo | Response:
    """What `echo` puts before each choice: its prompt's text (token ids decoded, off the event
    loop, by the server's tokenizer; a 503 if it failed to load)."""
    prompts, keep = body.prompts(), body.truncate_prompt_tokens
    if all(isinstance(p, str) for p in prompts) and keep is None:
        texts = [str(p) for p in prompts]
    else:
        tokenizer = await _tokenizer(state)
        if isinstance(tokenizer, Response):
            return tokenizer
        texts = await asyncio.to_thread(_prompt_texts, tokenizer, prompts, keep)
    return oai.Echo(texts, logprobs=body.logprobs is not None, only=body.echo_only)


def _prompt_texts(
    tokenizer: "PreTrainedTokenizerBase | None",
    prompts: list[str | list[int]],
    keep: int | None = None,
) -> list[str]:
    """Each prompt as text: token ids decoded (special tokens kept, as vLLM's echo); with
    `truncate_prompt_tokens` (`keep`), the text of the tokens the model reads: a prompt longer
    than that is cut to its last `keep` tokens (`intake.truncate_prompt`)."""
    if tokenizer is None:
        return [p if isinstance(p, str) else "" for p in prompts]
    texts = []
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt) if keep is not None else prompt
        if keep is not None and len(ids) > keep:
            texts.append(tokenizer.decode(ids[-keep:]))
        else:
            texts.append(prompt if isinstance(prompt, str) else tokenizer.decode(prompt))
    return texts


def _count_waiting(
    state: ServerState, outputs: AsyncIterator[ChoiceOutput], num_prompts: int, n: int
) -> AsyncIterator[ChoiceOutput]:
    """`outputs`, keeping `state.waiting` = sequences without their first output yet.

    Counted from the call (so a burst sees itself at once), not from the first iteration.
    """
    pending = {(p, c) for p in range(num_prompts) for c in range(n)}
    state.waiting += len(pending)

    async def tracked() -> AsyncIterator[ChoiceOutput]:
        try:
            async for item in outputs:
                key = (item.prompt_index, item.choice)
                if key in pending:
                    pending.discard(key)
                    state.waiting -= 1
                yield item
        finally:
            state.waiting -= len(pending)
            pending.clear()
            await _close(outputs)

    return tracked()


def _log_arrival(
    state: ServerState, request_id: str, requests: list[messages.TokenizeRequest]
) -> None:
    """One line per arriving request: its prompt (cut to --max-log-len) and its params."""
    limit = state.options.max_log_len
    for r in requests:
        chat = None if r.messages is None else without_image_data(r.messages)
        prompt = r.prompt if chat is None else json.dumps(chat, ensure_ascii=False)
        shown = prompt if limit is None else prompt[:limit]
        logger.info("request %s: prompt %r, params %s", r.request_id, shown, r.params)


def _tokenize_requests(
    body: CompletionRequest | ChatCompletionRequest, params: SamplingParams
) -> list[messages.TokenizeRequest]:
    if isinstance(body, ChatCompletionRequest):
        chat = [m.template_dict() for m in body.messages]
        tools, options = body.template_tools(), body.chat_options()
        return [
            messages.TokenizeRequest("", params, messages=chat, tools=tools, chat_options=options)
        ]
    return [messages.TokenizeRequest("", params, prompt=p) for p in body.prompts()]


async def _collect(
    raw: Request,
    response: oai.ResponseState,
    outputs: AsyncIterator[ChoiceOutput],
    max_logprobs: int,
) -> bool:
    """Gather a non-streamed response; False (and aborted) if the client disconnects meanwhile.
    Raises `RequestFailed` (a 400, the request aborted) once it holds more than `max_logprobs`
    logprob entries (`--max-response-logprobs`)."""

    async def gather() -> bool:
        async for item in outputs:
            response.add(item)
            if response.num_logprobs > max_logprobs:
                await _close(outputs)
                message = (
                    f"logprobs: the response would hold more than the {max_logprobs} logprob "
                    "entries a non-streamed response may (--max-response-logprobs); stream it, "
                    "or ask for fewer prompts, choices, tokens or alternatives"
                )
                raise RequestFailed(messages.RequestError("", message, 400, "logprobs"))
        return True

    return await _unless_client_leaves(raw, outputs, gather()) is not None


async def _first(raw: Request, outputs: AsyncIterator[ChoiceOutput]) -> ChoiceOutput | None:
    """The first output of a streamed request; None (and aborted) if the client disconnects
    before it, e.g. while the request waits in the queue (no response has started yet)."""
    return await _unless_client_leaves(raw, outputs, anext(outputs))


async def _unless_client_leaves(
    raw: Request, outputs: AsyncIterator[ChoiceOutput], work: Awaitable[T]
) -> T | None:
    """`work`'s result (re-raising `RequestFailed`), or None if the client disconnects first:
    then `work` is cancelled and `outputs` closed, which aborts the request."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await raw.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await _close(outputs)
            return None
    return task.result()


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
    usage: tuple[bool, bool],
    parsers: tuple[ToolParser | None, ReasoningParser | None] = (None, None),
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per output, an optional usage chunk, then `[DONE]`;
    `usage`: (a usage chunk at the end, the usage so far in every chunk). A chat's text goes
    through the reasoning parser (reasoning as `delta.reasoning_content`), then the rest
    through the tool parser, where given."""
    tool_parser, reasoning = parsers
    include_usage, continuous_usage = usage
    started: set[int] = set()
    tool_streams: dict[int, ToolStream] = {}
    reasoning_streams: dict[int, ReasoningStream] = {}

    def chunks(item: ChoiceOutput) -> list[dict[str, Any]]:
        index = response.index(item)
        response.add(item, hold=False)  # the chunks carry the text and logprobs
        out = item.output
        first = index not in started
        started.add(index)
        if not chat:
            return [oai.completion_chunk(response, index, out, top_n, first)]
        result = []
        if first:
            role = {"role": "assistant", "content": ""}
            result.append(oai.chat_chunk(response, index, role, None, top_n))
        thought = ""
        if reasoning is not None:
            split = reasoning_streams.setdefault(index, ReasoningStream(reasoning))
            thought, text = split.feed(out.text, final=out.finish_reason is not None)
            out = msgspec.structs.replace(out, text=text)
        if tool_parser is not None:
            stream = tool_streams.setdefault(index, tool_parser.stream())
            rest = oai.tool_chunks(response, index, stream, out, top_n)
        elif out.text or out.finish_reason is not None or out.logprobs:
            delta = {"content": out.text} if out.text else {}
            rest = [oai.chat_chunk(response, index, delta, out, top_n)]
        else:
            rest = []
        if thought:  # in the step's (first) chunk, beside its logprobs, as vLLM's
            if not rest:
                rest = [oai.chat_chunk(response, index, {}, None, top_n)]
            choice = rest[0]["choices"][0]
            choice["delta"] = {"reasoning_content": thought, **choice["delta"]}
        return result + rest

    def events(item: ChoiceOutput) -> list[str]:
        made = chunks(item)
        if continuous_usage:
            usage_so_far = response.usage()
            made = [{**chunk, "usage": usage_so_far} for chunk in made]
        return [_sse(chunk) for chunk in made]

    try:
        for event in events(first):
            yield event
        async for item in outputs:
            for event in events(item):
                yield event
        if include_usage:
            yield _sse(oai.usage_chunk(response, chat))
    except RequestFailed as exc:
        yield _sse(error_body(exc.error.status, exc.error.message, exc.error.param))
    except Exception:
        # The status line is sent: end the stream with an error event, not a torn connection.
        logger.exception("internal error while streaming %s", response.request_id)
        yield _sse(error_body(500, "internal server error; the stream was cut short"))
    finally:
        await _close(outputs)
    yield "data: [DONE]\n\n"


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _await_engine(state: ServerState) -> None:
    """Wait until the engine has loaded the model, then log the ready line and the start-up's
    phases (the server's and the engine core's) and count them in /metrics.

    A worker that dies meanwhile ends the server (`Supervisor.check`); so does an engine not
    ready after `STARTUP_TIMEOUT_S`.
    """
    assert state.supervisor is not None
    try:
        await asyncio.wait_for(state.client.ready.wait(), STARTUP_TIMEOUT_S)
    except TimeoutError:
        state.supervisor.fail(f"the engine was not ready after {STARTUP_TIMEOUT_S:.0f} s")
        return
    if state.client.failure is not None:
        return  # a worker died: the supervisor has said so and is ending the server
    stats = state.client.stats
    engine_phases = stats.startup_seconds if stats is not None else {}
    # The engine core starts beside the server (`early_start`): after its own set-up, the
    # server waits for it, and the engine's phases say where that time went; the last part,
    # from the engine's ready to its first stats here (through the detokenizer), is its own.
    state.startup.rest("waiting_for_engine")
    if stats is not None and stats.startup_ended_at:
        delay = state.client.first_stats_at - stats.startup_ended_at
        state.startup.split("waiting_for_engine", "ready_message", delay)
    total = state.startup.elapsed
    phases = {**state.startup.phases, **engine_phases, "total": total}
    state.client.metrics.on_ready(phases)
    logger.info(
        "tokenmill %s ready: serving %r on %s://%s:%d%s",
        tokenmill.__version__,
        state.model_name,
        "https" if state.options.ssl_certfile else "http",
        state.options.host,
        state.options.port,
        state.options.root_path,
    )
    processes = {"server": state.startup.phases, "engine core": engine_phases}
    logger.info("%s", startup_line(total, processes))


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
            if self.state.supervisor is not None:  # a group-wide signal may reach the workers
                self.state.supervisor.stopping = True
            logger.info("shutting down: aborting in-flight requests")
            self.state.client.abort_all()
        super().handle_exit(sig, frame)
        # uvicorn would re-raise the signal after its shutdown, killing us before the children
        # are stopped; the shutdown is graceful, so exit normally instead.
        self._captured_signals.clear()


async def _tokenizer(state: ServerState) -> "PreTrainedTokenizerBase | Response | None":
    """The server's tokenizer once loaded; a 503 if it failed to load (the tokenizer workers
    fail alike, so the server is not ready either)."""
    try:
        return await asyncio.wrap_future(state.tokenizer)
    except Exception as exc:
        logger.error("the tokenizer failed to load: %s", exc)
        return error_response(503, "the tokenizer failed to load", None)


def serve(
    engine: EngineArgs, options: ServerOptions, log_level: str = "INFO",
    early: EarlyStart | None = None,
) -> int:  # fmt: skip
    """Start the worker processes and serve HTTP until SIGTERM/SIGINT; returns an exit code.

    The port is bound first, so that a port in use fails in a second, not after the model loads;
    the server answers from before the model loads (503 until it is ready). `early`: the engine
    core and the detokenizer, started already from `engine` (with the addresses of the other
    processes), which the server adopts instead of starting them.

    The server imports no torch: it resolves only the part of the engine's configuration it
    needs (`EngineArgs.create_served_model`); the engine core checks the other options, and an
    error there ends it with the reason logged, and the server with exit code 1.
    """
    startup = StartupTimer(started_ago=process_age())
    startup.rest("server_imports")  # Python, FastAPI, pydantic, uvicorn (not torch)
    listener = bind_socket(options.host, options.port)
    try:
        with startup.phase("server_setup"):
            config = engine.create_served_model()
            tokenizer_path = engine.tokenizer or engine.model
            chat_template = read_chat_template(options.chat_template)
            # The tokenizer loads beside the rest of the start-up (importing transformers takes
            # seconds); the request limits need only its bounds, read from tokenizer.json
            # first: the `tokenizers` import they make, beside the loader's (through
            # transformers), met a partly initialised `tokenizers.pre_tokenizers` once (the
            # server exited with an ImportError).
            bounds = PromptBounds.read(tokenizer_path)
            loader = ThreadPoolExecutor(1, thread_name_prefix="load-tokenizer")
            tokenizer = loader.submit(load_tokenizer, tokenizer_path, chat_template)
            loader.shutdown(wait=False)  # the thread ends with the load
            if bounds is None and (loaded := tokenizer.result()) is not None:
                bounds = PromptBounds.of(loaded)
    except BaseException:
        listener.close()
        raise
    model_name = options.model_name(engine.model)
    addresses = early.addresses if early else Addresses.fresh(options.num_tokenizer_workers)
    try:
        metrics = ServerMetrics(
            model_name, options.trace_file, options.log_requests, options.max_recent_requests
        )
        state = ServerState(
            options=options,
            engine=engine,
            config=config,
            client=EngineClient(addresses, metrics, options.max_response_logprobs),
            tokenizer=tokenizer,
            model_name=model_name,
            limits=request_limits(model_name, options, config, bounds),
            log_level=log_level,
            startup=startup,
        )
        server = _Server(_uvicorn_config(build_app(state), options), state)
        workers = server_workers(
            engine, config, addresses, tokenizer_path, log_level, chat_template
        )
        started = early.processes if early else None
        state.supervisor = Supervisor(
            workers, state.client, options.restart_engine, server.fail, started
        )
        try:
            server.run(sockets=[listener])
        finally:
            state.supervisor.stop()
            state.client.close()
            listener.close()
    finally:
        addresses.remove()
    return server.exit_code if server.started else 1


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), or ValueError saying why it cannot be."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


class _QuietRoutes(logging.Filter):
    """Drops access-log lines of polled routes (dashboards scrape /metrics every second)."""

    def __init__(self, root_path: str) -> None:
        super().__init__()
        self.quiet = {root_path + route for route in QUIET_ROUTES}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) > 2 else ""
        return str(path).split("?", 1)[0] not in self.quiet


def _uvicorn_config(app: FastAPI, options: ServerOptions) -> uvicorn.Config:
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.uvicorn_log_level,
        access_log=options.uvicorn_access_log,
        root_path=options.root_path,
        ssl_keyfile=options.ssl_keyfile,
        ssl_certfile=options.ssl_certfile,
        timeout_graceful_shutdown=10,
    )
    logging.getLogger("uvicorn.access").addFilter(_QuietRoutes(options.root_path))
    return config
