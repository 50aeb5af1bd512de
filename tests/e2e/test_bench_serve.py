"""`tokenmill bench serve`: metric definitions on a server with known timings, and real runs."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from tests.e2e.server import MODEL_NAME, ServerHandle, _free_port, run_server
from tokenmill.bench.serve import ServeBenchArgs, run_serve_bench
from tokenmill.bench.workloads import WORKLOADS, WorkloadSpec, build_workload
from tokenmill.entrypoints.cli import main

FIRST_DELAY, GAP, CHUNKS = 0.2, 0.05, 6


def _stand_in_app() -> FastAPI:
    """Another OpenAI-compatible server: streams CHUNKS fixed tokens with fixed delays."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def events() -> Iterator[str]:
            await asyncio.sleep(FIRST_DELAY)
            for i in range(CHUNKS):
                if i:
                    await asyncio.sleep(GAP)
                chunk = {"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": 8, "completion_tokens": CHUNKS, "total_tokens": 8 + CHUNKS}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def stand_in() -> Iterator[str]:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(_stand_in_app(), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _args(base_url: str, workload: WorkloadSpec, **kw) -> ServeBenchArgs:
    return ServeBenchArgs(base_url=base_url, model="stand-in", workload=workload, progress=False,
                          **kw)  # fmt: skip


def test_metric_definitions_on_a_server_with_known_timings(stand_in: str) -> None:
    spec = WorkloadSpec("random", num_sessions=4, input_len=8, output_len=CHUNKS)
    report = asyncio.run(run_serve_bench(_args(stand_in, spec, slo_ttft=1.0, slo_itl=0.5)))
    assert report["completed"] == 4 and report["failed"] == 0
    # TTFT ends at the first chunk: at least the chunks' gaps before the end (a bound that a
    # loaded machine, delaying the stand-in's first chunk, does not break; 0.79 s seen).
    assert report["ttft_s"]["p50"] >= FIRST_DELAY
    assert GAP * 0.9 <= report["itl_s"]["p50"] < GAP + 0.1
    assert len([g for r in report["records"] for g in r["itl"]]) == 4 * (CHUNKS - 1)
    for r in report["records"]:
        assert r["output_tokens"] == CHUNKS
        assert r["e2e"] >= FIRST_DELAY + (CHUNKS - 1) * GAP
        assert r["ttft"] <= r["e2e"] - (CHUNKS - 1) * GAP * 0.9
        tpot = (r["e2e"] - r["ttft"]) / (CHUNKS - 1)
        assert GAP * 0.9 <= tpot < GAP + 0.1
    assert report["output_throughput"] == pytest.approx(4 * CHUNKS / report["elapsed_s"])
    assert report["goodput"] == pytest.approx(report["request_throughput"])
    # the stand-in exports no /metrics
    assert report["prefix_cache_hit_rate"] is None and report["engine"] is None
    strict = asyncio.run(run_serve_bench(_args(stand_in, spec, slo_ttft=0.1)))
    assert strict["goodput"] == 0


def test_concurrency_cap_serialises_requests(stand_in: str) -> None:
    spec = WorkloadSpec("random", num_sessions=3, input_len=8, output_len=CHUNKS)
    report = asyncio.run(run_serve_bench(_args(stand_in, spec, max_concurrency=1)))
    starts = sorted(r["start"] for r in report["records"])
    assert all(b - a >= FIRST_DELAY for a, b in itertools.pairwise(starts))


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    log = tmp_path_factory.mktemp("bench") / "server.log"
    with run_server(llama_dir, log, "--max-model-len", "1024") as handle:
        yield handle


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_request_of_each_workload_is_accounted_for(server: ServerHandle, workload: str):
    # Scaled down to fit the tiny server's 1,024-token context (agent: 100-token prefix).
    spec = WorkloadSpec(workload, num_sessions=3, vocab_size=500, input_len=64, output_len=8,
                        prefix_len=2000, length_scale=0.05)  # fmt: skip
    expected = sum(len(s.turns) for s in build_workload(spec))
    # A later session hits the shared prefix only once the first one's prefill is done: at 20
    # sessions/s a loaded 2-core machine may admit all three before that (no hits), so 5/s.
    args = ServeBenchArgs(server.base_url, MODEL_NAME, spec, request_rate=5.0, progress=False)
    report = asyncio.run(run_serve_bench(args))
    assert report["requests"] == expected == report["completed"]
    assert all(r["output_tokens"] == r["max_tokens"] for r in report["records"])
    if workload in ("chatbot", "agent", "shared-prefix"):
        assert report["prefix_cache_hit_rate"] > 0
    engine = report["engine"]  # the server's steps during the run, from its /metrics
    assert engine["forwards"] == sum(k["steps"] for k in engine["steps_by_kind"].values()) > 0
    assert engine["steps"] >= engine["forwards"]  # (steps that only read a forward's tokens)
    assert all(k["host_ms"] > 0 for k in engine["steps_by_kind"].values())
    assert engine["host_ms_per_step"] > 0 and 0 < engine["device_busy_fraction"] <= 1


def test_cli_writes_json_and_plots(server: ServerHandle, tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    code = main([
        "bench", "serve", "--base-url", server.base_url, "--model", MODEL_NAME,
        "--workload", "random", "--num-requests", "4", "--input-len", "16", "--output-len", "4",
        "--slo", "ttft:5000,itl:1000", "--output", str(out), "--plot", str(png),
    ])  # fmt: skip
    assert code == 0
    assert "TTFT" in capsys.readouterr().out
    assert json.loads(out.read_text())["completed"] == 4
    assert png.stat().st_size > 10_000
    sweep = tmp_path / "sweep.png"
    code = main([
        "bench", "serve", "--base-url", server.base_url, "--model", MODEL_NAME,
        "--num-requests", "3", "--input-len", "16", "--output-len", "4",
        "--sweep-rates", "5,50", "--plot", str(sweep),
    ])  # fmt: skip
    assert code == 0 and sweep.stat().st_size > 10_000
