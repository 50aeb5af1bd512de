"""Metrics move as requests flow; traces record what the API returned; profiling; dashboard."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server import MODEL_NAME, ServerHandle, run_server, wait_until
from tokenmill.ipc.messages import STEP_KINDS

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    tmp = tmp_path_factory.mktemp("obs")
    args = [
        "--page-size", "4", "--num-pages", "40", "--max-model-len", "96",
        "--trace-file", str(tmp / "trace.jsonl"), "--log-requests",
        "--enable-profiling", "--profile-dir", str(tmp / "profiles"),
    ]  # fmt: skip
    with run_server(llama_dir, tmp / "server.log", *args) as handle:
        handle.tmp = tmp  # type: ignore[attr-defined]
        yield handle


def scrape(server: ServerHandle) -> dict[str, float]:
    """Metric samples without the model label, e.g. 'tokenmill:num_preemptions_total'."""
    text = httpx.get(server.base_url + "/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            key = re.sub(r',?model_name="[^"]*"', "", key).replace("{,", "{").replace("{}", "")
            samples[key] = float(value)
    return samples


def _client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def test_metrics_follow_a_known_sequence_of_requests(server: ServerHandle) -> None:
    client = _client(server)
    before = scrape(server)
    prompt = list(range(10, 50))  # 40 tokens: 10 full pages of 4
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    # Six long requests at once overflow 40 pages of 4 tokens: preemptions. One completion of
    # six prompts, so that they reach the engine together (six clients of their own, on a
    # loaded machine, sometimes arrived one after another's end, and none was preempted).
    batch = threading.Thread(
        target=client.completions.create,
        kwargs={
            "model": MODEL_NAME,
            "prompt": [[100 + i] * 30 for i in range(6)],
            "max_tokens": 50,
            "extra_body": {"ignore_eos": True},
        },
    )
    batch.start()
    # An aborted stream, beside the six: alone on an idle engine, its 80 tokens could all be
    # generated before the server saw the client leave (a full run counted it as finished).
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "x", "max_tokens": 80, "stream": True, "ignore_eos": True,
    }) as r:  # fmt: skip
        next(r.iter_lines())
    batch.join()
    assert wait_until(lambda: scrape(server)["tokenmill:num_requests_running"] == 0)
    time.sleep(0.6)  # one idle stats interval
    after = scrape(server)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    # Per-request histograms cover the 8 requests whose clients stayed; the aborted one got its
    # first token, so it counts for TTFT, and as an abort.
    finished = 8
    assert delta("tokenmill:e2e_request_latency_seconds_count") == finished
    assert delta("tokenmill:time_to_first_token_seconds_count") == finished + 1
    assert delta("tokenmill:request_generation_tokens_count") == finished
    assert delta('tokenmill:request_success_total{finished_reason="length"}') == 8
    assert delta('tokenmill:request_success_total{finished_reason="abort"}') == 1
    assert (
        delta("tokenmill:prefix_cache_hits_total")
        >= second.usage.prompt_tokens_details.cached_tokens
    )
    assert delta("tokenmill:prefix_cache_queries_total") >= 2 * len(prompt)
    assert delta("tokenmill:num_preemptions_total") > 0
    generated = first.usage.completion_tokens + second.usage.completion_tokens + 6 * 50
    assert delta("tokenmill:generation_tokens_total") >= generated
    assert delta("tokenmill:inter_token_latency_seconds_count") >= generated - 8
    assert delta("tokenmill:request_queue_time_seconds_count") == finished
    assert delta("tokenmill:scheduler_step_seconds_count") > 0
    assert delta("tokenmill:model_forward_seconds_count") > 0
    by_kind = [f"tokenmill:model_forward_seconds_{k}_steps_count" for k in STEP_KINDS]
    assert sum(map(delta, by_kind)) == delta("tokenmill:model_forward_seconds_count")
    assert delta(by_kind[0]) > 0 and delta(by_kind[2]) > 0  # prefill-only, decode-only
    # the host time of the engine steps that launched each kind: one observation a launch
    launches = [f"tokenmill:scheduler_step_seconds_{k}_steps_count" for k in STEP_KINDS]
    assert sum(map(delta, launches)) == delta("tokenmill:model_forward_seconds_count")
    assert delta("tokenmill:scheduler_step_seconds_decode_steps_sum") > 0
    assert after["tokenmill:kv_cache_usage_perc"] == 0.0
    assert after["tokenmill:num_requests_waiting"] == 0


def test_startup_phases_are_logged_and_exported(server: ServerHandle) -> None:
    samples = scrape(server)
    phases = {
        re.search(r'phase="(\w+)"', key)[1]: seconds
        for key, seconds in samples.items()
        if key.startswith("tokenmill:startup_seconds{")
    }
    # The CPU's phases: GEMV tuning and CUDA-graph capture are the GPU's. The api server's
    # add up to the total; the engine core's ran beside them.
    server_phases = {"server_imports", "server_setup", "waiting_for_engine", "ready_message"}
    engine = {"engine_imports", "engine_config", "load_weights", "kv_cache", "engine_setup"}
    assert set(phases) == {*server_phases, *engine, "total"}
    assert all(phases[p] > 0 for p in ("server_imports", "engine_imports", "load_weights"))
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases[p] for p in server_phases) == pytest.approx(phases["total"], abs=0.01)
    [line] = re.findall(r"start-up ([\d.]+) s \((.*)\)", server.log)
    assert float(line[0]) == pytest.approx(phases["total"], abs=0.01)
    logged = dict(re.findall(r"(\w+) ([\d.]+) s", line[1]))
    expected = {p: s for p, s in phases.items() if p != "total"}
    assert {name: float(s) for name, s in logged.items()} == pytest.approx(expected, abs=0.006)


def test_trace_token_ids_match_what_the_api_returned(server: ServerHandle) -> None:
    client = _client(server)
    response = client.completions.create(
        model=MODEL_NAME, prompt="Hello world", max_tokens=7, temperature=0, user="trace-me"
    )
    trace_file = server.tmp / "trace.jsonl"  # type: ignore[attr-defined]
    assert wait_until(lambda: response.id in trace_file.read_text())
    record = next(
        json.loads(line) for line in trace_file.read_text().splitlines()
        if json.loads(line)["request_id"].startswith(response.id)
    )  # fmt: skip
    tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert record["prompt_token_ids"] == tokens["tokens"]
    assert len(record["output_token_ids"]) == response.usage.completion_tokens == 7
    text = httpx.post(
        server.base_url + "/detokenize", json={"tokens": record["output_token_ids"]}
    ).json()["prompt"]
    assert text == response.choices[0].text
    assert record["finish_reason"] == "length"
    assert record["sampling_params"]["max_tokens"] == 7
    assert record["arrival_time"] <= record["first_token_time"] <= record["finish_time"]
    assert "request " + record["request_id"] in server.log  # --log-requests


def test_profiling_writes_a_chrome_trace(server: ServerHandle) -> None:
    assert httpx.post(server.base_url + "/start_profile").status_code == 200
    _client(server).completions.create(model=MODEL_NAME, prompt="profile me", max_tokens=4)
    assert httpx.post(server.base_url + "/stop_profile").status_code == 200
    directory = server.tmp / "profiles"  # type: ignore[attr-defined]
    assert wait_until(lambda: any(directory.glob("*.json")), timeout=30)
    trace = json.loads(next(directory.glob("*.json")).read_text())
    assert trace["traceEvents"]


def test_profiling_endpoints_are_off_by_default(llama_dir: Path, tmp_path: Path) -> None:
    with run_server(llama_dir, tmp_path / "log") as plain:
        assert httpx.post(plain.base_url + "/start_profile").status_code == 404


def test_a_trace_that_can_not_be_written_leaves_the_server_serving(
    llama_dir: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"  # --profile-dir names a file: the trace cannot be written
    flags = ("--enable-profiling", "--profile-dir", str(blocker))
    with run_server(llama_dir, tmp_path / "log", *flags) as server:
        blocker.write_text("")  # after the start-up, which refuses a file there
        assert httpx.post(server.base_url + "/start_profile").status_code == 200
        assert httpx.post(server.base_url + "/stop_profile").status_code == 200
        assert wait_until(lambda: "profiler trace not written" in server.log, timeout=30)
        completion = _client(server).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert completion.choices[0].text and server.proc.poll() is None


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (see .ci/run)")
def test_dashboard_renders_live_charts_under_load(server: ServerHandle, tmp_path: Path) -> None:
    stop = threading.Event()

    def load() -> None:
        client = _client(server)
        while not stop.is_set():
            threads = [
                threading.Thread(
                    target=client.completions.create,
                    kwargs={"model": MODEL_NAME, "prompt": [200 + i] * 20, "max_tokens": 40},
                )
                for i in range(12)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    loader = threading.Thread(target=load)
    loader.start()
    try:
        time.sleep(2)
        flags = [
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,900",
            "--virtual-time-budget=8000",
        ]  # fmt: skip
        url = server.base_url + "/dashboard"
        dom = subprocess.run(
            [CHROMIUM, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120
        ).stdout
        # TOKENMILL_UPDATE_DOCS=1 refreshes the README's screenshot; otherwise keep the tree clean.
        shot = (DOCS if os.environ.get("TOKENMILL_UPDATE_DOCS") else tmp_path) / "dashboard.png"
        subprocess.run(
            [CHROMIUM, *flags, f"--screenshot={shot}", url], capture_output=True, timeout=120
        )
    finally:
        stop.set()
        loader.join()
    samples = int(re.search(r'id="status" data-samples="(\d+)"', dom).group(1))
    assert samples >= 3, dom[-2000:]
    points = {
        chart: int(n)
        for chart, n in re.findall(r'<canvas id="chart-(\w+)"[^>]*data-points="(\d+)"', dom)
    }
    assert len(points) == 9, points
    # Gauges and rates plot from the first sample; percentiles and hit rate need observations
    # inside a window, so they may start later.
    gauges = ("rate", "queue", "kv", "tokens", "replicas")
    assert all(points[c] >= samples - 1 for c in gauges), points
    assert points["ttft"] >= 1 and points["itl"] >= 1, points
    assert "tokenmill:" not in dom.split('id="grid"')[0]  # no raw metric dump above the charts
    assert shot.is_file() and shot.stat().st_size > 10_000
