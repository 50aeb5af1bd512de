"""The server's routes, listed from an app built in-process (no engine) with the server's code."""

from __future__ import annotations

from concurrent.futures import Future

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.routing import Route

from tokenmill.config import EngineArgs
from tokenmill.entrypoints.api_server import ServerState, build_app
from tokenmill.entrypoints.engine_client import EngineClient
from tokenmill.entrypoints.protocol import RequestLimits
from tokenmill.entrypoints.server_options import ServerOptions


def server_state(
    options: ServerOptions | None = None, client: EngineClient | None = None
) -> ServerState:
    """The state of a server of model "m" without an engine configuration or a tokenizer (and
    without an engine client, unless given): what routes that need neither run on."""
    limits = RequestLimits(
        model_name="m", vocab_size=512, max_model_len=128, max_prompt_bytes=4096, max_n=8,
        max_stop=4, max_stop_chars=16, max_chat_messages=128,
    )  # fmt: skip
    no_tokenizer: Future[None] = Future()
    no_tokenizer.set_result(None)
    return ServerState(
        options=options or ServerOptions(), engine=EngineArgs(), config=None, client=client,
        tokenizer=no_tokenizer, model_name="m", limits=limits,
    )  # type: ignore[arg-type]  # fmt: skip


def offline_app(options: ServerOptions | None = None) -> FastAPI:
    """The server's app with no engine behind it: routes, middleware, schema and validation."""
    return build_app(server_state(options))


def app_routes(options: ServerOptions | None = None) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, HEAD and OPTIONS aside."""
    return sorted(
        (method, route.path)
        for route in offline_app(options).routes
        if isinstance(route, APIRoute | Route)
        for method in (route.methods or ())
        if method not in ("HEAD", "OPTIONS")
    )


def schema_operations() -> list[tuple[str, str]]:
    """(method, path) of every operation the OpenAPI schema documents."""
    paths = offline_app().openapi()["paths"]
    return sorted((method.upper(), path) for path, ops in paths.items() for method in ops)
