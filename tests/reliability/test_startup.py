"""Start-up: the server listens before the engine is ready, answering /v1 routes with 503 and
Retry-After and /health with 503 "starting"; when the engine reports in it serves, logs its
start-up phases and exports them; an engine that dies or never gets ready ends it (exit code 1).

The server is the real one (its app, middleware, lifespan and uvicorn) on a real socket, in this
process; the engine core is played by the test, through the api server's real output socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import zmq

from tests.reliability.routes import server_state
from tokenmill.entrypoints import api_server
from tokenmill.entrypoints.engine_client import EngineClient
from tokenmill.entrypoints.server_options import ServerOptions
from tokenmill.entrypoints.supervisor import Supervisor, WorkerKind, WorkerSpec
from tokenmill.ipc.messages import ClientBatch, EngineStats
from tokenmill.ipc.sockets import Addresses, encode, push
from tokenmill.observability.metrics import ServerMetrics

RETRY_AFTER_S = 7
COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@dataclass
class StartingServer:
    http: httpx.AsyncClient
    server: api_server._Server
    serving: asyncio.Task[None]
    engine: zmq.Socket  # where the test, playing the engine core, sends what it would send


@contextlib.asynccontextmanager
async def starting_server(workers: list[WorkerSpec]) -> AsyncIterator[StartingServer]:
    """A server whose engine has not reported in, with `workers` under its supervisor."""
    addresses = Addresses.fresh(1)
    client = EngineClient(addresses, ServerMetrics("m", trace_file=None, log_requests=False))
    state = server_state(ServerOptions(retry_after_s=RETRY_AFTER_S), client)
    listener = api_server.bind_socket("127.0.0.1", 0)
    config = api_server._uvicorn_config(api_server.build_app(state), state.options)
    server = api_server._Server(config, state)
    state.supervisor = Supervisor(workers, client, restart_engine=False, on_fatal=server.fail)
    ctx = zmq.Context()
    try:
        serving = asyncio.create_task(server.serve(sockets=[listener]))
        async with asyncio.timeout(30):
            while not server.started and not serving.done():
                await asyncio.sleep(0.01)
        base_url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
            yield StartingServer(http, server, serving, push(ctx, addresses.api, bind=False))
        server.should_exit = True
        await serving
    finally:
        state.supervisor.stop()
        client.close()
        ctx.destroy(linger=0)
        listener.close()
        addresses.remove()


def _stats(startup_seconds: dict[str, float], ended_at: float = 0.0) -> EngineStats:
    """The engine core's first stats: an idle engine, its start-up phases and their end."""
    return EngineStats(
        num_running=0, num_waiting=0, kv_used_pages=0, kv_total_pages=8, prefix_cache_queries=0,
        prefix_cache_hits=0, num_preemptions=0, finished={}, prompt_tokens=0,
        generation_tokens=0, histograms={}, engine_pid=1, startup_seconds=startup_seconds,
        startup_ended_at=ended_at,
    )  # fmt: skip


async def _starting_then_ready() -> str:
    async with starting_server([]) as s:
        health = await s.http.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "starting"}
        for response in [
            await s.http.post("/v1/completions", json=COMPLETION),
            await s.http.post("/v1/chat/completions", json=CHAT),
            await s.http.post("/v1/completions", json={"prompt": 5}),  # refused before checked
            await s.http.get("/v1/models"),
        ]:
            assert response.status_code == 503
            assert response.headers["Retry-After"] == str(RETRY_AFTER_S)
            error = response.json()["error"]
            assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
            assert error["message"].startswith("the server is starting")
        assert (await s.http.get("/version")).status_code == 200
        metrics = await s.http.get("/metrics")
        assert metrics.status_code == 200 and "startup_seconds{" not in metrics.text
        # The engine core has loaded the model: its first stats say so, with its phases.
        engine_phases = {"engine_imports": 2.0, "load_weights": 1.5, "kv_cache": 0.25}
        # Ready a moment ago: its stats took that long to arrive (`ready_message`).
        ended = time.time() - 0.01
        s.engine.send(encode(ClientBatch([], [], stats=_stats(engine_phases, ended))))
        async with asyncio.timeout(10):
            while (await s.http.get("/health")).status_code != 200:
                await asyncio.sleep(0.02)
        # /v1 routes reach their handlers now: an unknown response id is the handler's 400.
        feedback = await s.http.post("/v1/feedback", json={"request_id": "cmpl-x", "rating": 1})
        assert feedback.status_code == 400 and feedback.json()["error"]["param"] == "request_id"
        return (await s.http.get("/metrics")).text


def test_the_server_answers_503_until_the_engine_is_ready_then_reports_its_startup(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tokenmill.server")
    metrics = asyncio.run(_starting_then_ready())
    for phase, seconds in {"engine_imports": 2.0, "load_weights": 1.5, "kv_cache": 0.25}.items():
        assert f'tokenmill:startup_seconds{{model_name="m",phase="{phase}"}} {seconds}' in metrics
    assert 'phase="waiting_for_engine"' in metrics and 'phase="total"' in metrics
    [message] = re.findall(r'phase="ready_message"\} ([\d.e-]+)', metrics)
    assert float(message) > 0
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up ")]
    assert "; engine core: engine_imports 2.00 s, load_weights 1.50 s, kv_cache 0.25 s)" in line
    assert "(server: " in line and "waiting_for_engine " in line
    assert any("ready: serving 'm'" in r.getMessage() for r in caplog.records)


async def _until_the_server_ends(
    workers: list[WorkerSpec], ask_health: bool = True
) -> tuple[int, int]:
    """The /health status seen while starting (0 without `ask_health`: a server whose engine
    dies at once may be gone before the request), and the exit code the server ends with."""
    async with starting_server(workers) as s:
        health = (await s.http.get("/health")).status_code if ask_health else 0
        async with asyncio.timeout(30):
            await asyncio.shield(s.serving)
        return health, s.server.exit_code


def test_an_engine_not_ready_in_time_ends_the_server_with_exit_code_1(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(api_server, "STARTUP_TIMEOUT_S", 1.0)
    assert asyncio.run(_until_the_server_ends([])) == (503, 1)
    assert "the engine was not ready after 1 s" in caplog.text


def test_an_engine_dying_while_it_loads_ends_the_server_with_exit_code_1(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dies = WorkerSpec("engine-core", WorkerKind.ENGINE, os._exit, (3,))  # a real process
    _, exit_code = asyncio.run(_until_the_server_ends([dies], ask_health=False))
    assert exit_code == 1
    assert "engine-core" in caplog.text and "died with exit code 3" in caplog.text
    assert "before the server was ready" in caplog.text
