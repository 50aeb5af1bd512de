"""Evaluations of a deployment and user feedback, on one demo-model server: `tokenmill eval
tasks` scores a known file as known (with each request's id, token ids and timing); feedback is
stored with the request's trace, counted in /metrics, listed on the dashboard, and refused (400)
for unknown requests or bad ratings."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.e2e.server import MODEL_NAME, ServerHandle, run_server, wait_until
from tokenmill.config import DEMO_MODEL_DIR
from tokenmill.entrypoints.cli import main
from tokenmill.evals.options import ConformanceArgs, TaskEvalArgs
from tokenmill.evals.scorers import DEMO_TASKS
from tokenmill.observability.feedback import FeedbackLog, RecentRequests, response_id_of
from tokenmill.observability.metrics import ServerMetrics

# Answers the demo model does not give, or gives: each scorer both ways.
EXTRA = [
    {"id": "wrong-exact", "prompt": "from django.db import", "expected": "views", "stop": ["\n"],
     "max_tokens": 8},
    {"id": "near-number", "prompt": "for i in range(", "expected": 10.4, "scorer": "numeric",
     "tolerance": 0.5, "max_tokens": 6},
    {"id": "far-number", "prompt": "for i in range(", "expected": 11, "scorer": "numeric",
     "tolerance": 0.5, "max_tokens": 6},
    {"id": "not-json", "prompt": "from django.http import", "expected": "x",
     "scorer": "json_field", "field": "a", "max_tokens": 6},
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    tmp = tmp_path_factory.mktemp("evals")
    args = ["--max-model-len", "256", "--trace-file", str(tmp / "trace.jsonl")]
    with run_server(DEMO_MODEL_DIR, tmp / "server.log", *args) as handle:
        handle.tmp = tmp  # type: ignore[attr-defined]
        yield handle


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def test_known_task_file_is_scored_as_known(server: ServerHandle, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    lines = DEMO_TASKS.read_text().splitlines() + [json.dumps(t) for t in EXTRA]
    tasks.write_text("\n".join(lines) + "\n")
    out = tmp_path / "results.json"
    argv = ["eval", "tasks", "--base-url", server.base_url, str(tasks), "--output", str(out),
            "--no-progress", "--min-accuracy", "0.75"]  # fmt: skip
    assert main(argv) == 0  # 10 of 13 pass: above the minimum
    report = json.loads(out.read_text())
    passed = {r["id"]: r["passed"] for r in report["results"]}  # the built-in ones all pass
    assert [k for k, ok in passed.items() if not ok] == ["wrong-exact", "far-number", "not-json"]
    assert report["num_tasks"] == len(lines) and report["accuracy"] == 10 / 13
    by_id = {r["id"]: r for r in report["results"]}
    assert by_id["not-json"]["detail"].startswith("not JSON")
    models = by_id["django-models-import"]
    assert models["answer"].strip() == "models" and models["request_id"].startswith("cmpl-")
    assert by_id["chat-model-class"]["request_id"].startswith("chatcmpl-")
    # Token ids as the server saw and produced them, and timing.
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "from django.db import"})
    assert models["prompt_token_ids"] == ids.json()["tokens"]
    assert models["prompt_tokens"] == len(models["prompt_token_ids"])
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": models["output_token_ids"]})
    assert text.json()["prompt"].startswith(models["answer"])  # the stop string is cut from text
    assert 0 < models["ttft_s"] <= models["latency_s"]
    # A task's request id is what feedback rates.
    body = {"request_id": models["request_id"], "rating": 1}
    assert httpx.post(server.base_url + "/v1/feedback", json=body).status_code == 200


def test_accuracy_below_the_minimum_is_exit_status_1(server: ServerHandle, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(EXTRA[0]) + "\n")
    argv = ["eval", "tasks", "--base-url", server.base_url, str(tasks), "--no-progress"]
    assert main(argv) == 0  # no minimum: a wrong answer is a result, not a failure
    assert main([*argv, "--min-accuracy", "0.5"]) == 1


def test_an_unreachable_server_or_a_bad_timeout_is_a_one_line_error(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # nothing listens there
    for kind, flags in (("tasks", ["--no-progress"]), ("conformance", ["--model", str(llama_dir)])):
        assert main(["eval", kind, "--base-url", url, *flags]) == 2
        assert capsys.readouterr().err.startswith(f"tokenmill: error: {url}: ")
        assert main(["eval", kind, "--base-url", url, *flags, "--timeout", "0"]) == 2
        assert "timeout must be > 0" in capsys.readouterr().err


def _complete(client: httpx.Client, n: int = 1) -> dict:
    body = {"model": MODEL_NAME, "prompt": "Hello world", "max_tokens": 4, "n": n}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _feedback_count(client: httpx.Client, rating: int) -> float:
    pattern = rf'^tokenmill:feedback_total\{{[^}}]*rating="{rating}"[^}}]*\}} (\S+)$'
    match = re.search(pattern, client.get("/metrics").text, re.MULTILINE)
    assert match, "tokenmill:feedback_total is not exported"
    return float(match.group(1))


def test_feedback_round_trips_to_the_trace_and_the_metric(
    client: httpx.Client, server: ServerHandle
) -> None:
    completion = _complete(client, n=2)
    before = _feedback_count(client, -1)
    body = {"request_id": completion["id"], "rating": -1, "comment": "wrong answer ☹"}
    response = client.post("/v1/feedback", json=body)
    assert response.status_code == 200, response.text
    stored = response.json()
    assert stored["request_id"] == completion["id"] and stored["rating"] == -1
    assert stored["has_trace"] is True
    assert _feedback_count(client, -1) == before + 1
    # The trace file holds the request's lines (one per choice) and the feedback, joined by id.
    trace_file = server.tmp / "trace.jsonl"  # type: ignore[attr-defined]
    assert wait_until(lambda: stored["feedback_id"] in trace_file.read_text())
    records = [json.loads(line) for line in trace_file.read_text().splitlines()]
    lines = [r for r in records if r.get("response_id") == completion["id"]]
    assert len(lines) == 2 and all(r["event"] == "request" for r in lines)
    feedback = [r for r in records if r.get("event") == "feedback"]
    assert feedback[-1]["request_id"] == completion["id"]
    assert feedback[-1]["comment"] == "wrong answer ☹"
    # ... and the server reads them back for the dashboard's link.
    trace = client.get(f"/v1/traces/{completion['id']}").json()
    assert sorted(r["request_id"] for r in trace["lines"]) == sorted(r["request_id"] for r in lines)
    assert all(len(r["output_token_ids"]) == 4 for r in trace["lines"])
    assert trace["feedback"][-1]["feedback_id"] == stored["feedback_id"]
    negative = client.get("/v1/feedback", params={"max_rating": -1}).json()["data"]
    assert negative[0]["feedback_id"] == stored["feedback_id"]
    good = client.post("/v1/feedback", json={"request_id": completion["id"], "rating": 1})
    assert good.status_code == 200
    assert all(f["rating"] == -1 for f in client.get("/v1/feedback?max_rating=-1").json()["data"])


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"request_id": "cmpl-never-issued"}, "request_id"),
        ({"request_id": ""}, "request_id"),
        ({"rating": 2}, "rating"),
        ({"rating": -2}, "rating"),
        ({"rating": True}, "rating"),
        ({"rating": "1"}, "rating"),
        ({"rating": 1.0}, "rating"),
        ({"comment": "x" * 10_001}, "comment"),
        ({"comment": 5}, "comment"),
    ],
)
def test_bad_feedback_is_400_naming_the_field(client: httpx.Client, patch, param) -> None:
    completion = _complete(client)
    before = _feedback_count(client, 1)
    body = {"request_id": completion["id"], "rating": 1, **patch}
    response = client.post("/v1/feedback", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error
    assert _feedback_count(client, 1) == before


def test_trace_of_an_unknown_request_is_404(client: httpx.Client) -> None:
    response = client.get("/v1/traces/cmpl-never-issued")
    assert response.status_code == 404
    assert "no trace" in response.json()["error"]["message"]


def test_recent_requests_forget_the_oldest_first() -> None:
    recent = RecentRequests(capacity=2)
    recent.add("a", 0)
    recent.add("b", 10)
    recent.add("a", 20)  # a second choice of "a" refreshes it
    recent.add("c", None)
    assert "b" not in recent and "a" in recent and "c" in recent
    assert recent.trace_offsets("a") == (0, 20) and recent.trace_offsets("c") == ()


def test_trace_of_a_request_whose_trace_file_was_rotated_away_is_none(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"response_id": "cmpl-a"}) + "\n")
    log = FeedbackLog("m", CollectorRegistry(), 10, str(trace), lambda record: None)
    log.requests.add("cmpl-a", 0)
    assert log.read_trace("cmpl-a") == [{"response_id": "cmpl-a"}]
    trace.rename(tmp_path / "trace.jsonl.1")  # logrotate: GET /v1/traces/ID is a 404, not a 500
    assert log.read_trace("cmpl-a") == []


def test_trace_offsets_hold_when_replicas_append_to_one_trace_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"  # --replicas: every replica's server gets --trace-file
    a, b = ServerMetrics("m", str(path), False), ServerMetrics("m", str(path), False)
    written = [(m.write_trace({"n": i}), i) for i in range(3) for m in (a, b)]
    with path.open("rb") as f:
        for offset, n in written:
            f.seek(offset)
            assert json.loads(f.readline()) == {"n": n}


def test_response_id_is_the_engine_request_id_without_prompt_and_choice() -> None:
    assert response_id_of("chatcmpl-0a1b-0:3") == "chatcmpl-0a1b"
    assert response_id_of("cmpl-9f-12:0") == "cmpl-9f"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (see .ci/run)")
def test_dashboard_lists_recent_negative_feedback_with_trace_links(
    client: httpx.Client, server: ServerHandle, tmp_path: Path
) -> None:
    completion = _complete(client)
    body = {"request_id": completion["id"], "rating": -1, "comment": "<b>not html</b>"}
    assert client.post("/v1/feedback", json=body).status_code == 200
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000", "--dump-dom",
    ]  # fmt: skip
    dom = subprocess.run(
        [CHROMIUM, *flags, server.base_url + "/dashboard"],
        capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    rows = int(re.search(r'id="feedback" data-rows="(\d+)"', dom).group(1))
    assert rows >= 1, dom[-2000:]
    assert f'href="v1/traces/{completion["id"]}"' in dom  # relative: works under a root path
    assert "&lt;b&gt;not html&lt;/b&gt;" in dom  # a comment is shown as text


# Answers of a server that is not (quite) OpenAI's, by route: a proxy's HTML page, another API's
# JSON, a stream that stops mid-answer. Each route answers 200.
MISSHAPEN: dict[str, dict[str, bytes]] = {
    "models not JSON": {"/v1/models": b"<html>a proxy</html>"},
    "models a list": {"/v1/models": b"[1, 2]"},
    "model without id": {"/v1/models": b'{"data": [{"object": "model"}]}'},
    "tokens missing": {"/tokenize": b"{}"},
    "chunk not JSON": {"/v1/completions": b"data: {not json\n\n"},
    "logprobs misshapen": {"/v1/completions": b'data: {"choices": [{"logprobs": {}}]}\n\n'},
    "error chunk a string": {"/v1/completions": b'data: {"error": "overloaded"}\n\n'},
    "stream cut short": {"/v1/completions": b'data: {"choices": [{"text": "10"}]}\n\n'},
}
_GOOD = {
    "/v1/models": b'{"data": [{"id": "m", "max_model_len": 256}]}',
    "/tokenize": b'{"tokens": [1, 2]}',
    "/v1/completions": b'data: {"choices": [{"text": "10", "finish_reason": "stop"}]}\n\n',
}


@contextmanager
def _fake_server(answers: dict[str, bytes]) -> Iterator[str]:
    """An HTTP server answering each route with `answers`' bytes (else a good answer); its URL."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = answers.get(self.path, _GOOD[self.path])
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _one_task(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "range(", "expected": 10, "scorer": "numeric"}) + "\n")
    return tasks


@pytest.mark.parametrize("case", list(MISSHAPEN))
def test_an_answer_not_in_openais_shape_is_a_one_line_error(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    with _fake_server(MISSHAPEN[case]) as url:
        argv = ["eval", "tasks", "--base-url", url, str(_one_task(tmp_path)), "--no-progress"]
        status = main([*argv, "--output", str(out)])
    route = next(iter(MISSHAPEN[case]))
    if route == "/v1/models":  # no model to ask: the whole run is refused
        assert status == 2
        assert capsys.readouterr().err.startswith(f"tokenmill: error: {url}: GET /v1/models: ")
    else:  # the task is a request error, not a score of half an answer
        assert status == 1
        [result] = json.loads(out.read_text())["results"]
        assert not result["passed"] and route in result["error"], result


def test_the_fake_server_is_scored_when_it_answers_well(tmp_path: Path) -> None:
    with _fake_server({}) as url:
        argv = ["eval", "tasks", "--base-url", url, str(_one_task(tmp_path)), "--no-progress"]
        assert main([*argv, "--min-accuracy", "1"]) == 0


@pytest.mark.parametrize("url", ["http://[::1", "http://", "127.0.0.1:8000", "ftp://host"])
def test_a_base_url_that_is_no_http_url_is_refused_naming_it(url: str) -> None:
    with pytest.raises(ValueError, match="^base_url"):
        TaskEvalArgs(base_url=url)
    with pytest.raises(ValueError, match="^base_url"):
        ConformanceArgs(model="m", base_url=url)


def test_conformance_of_a_folder_without_a_causal_lm_config_is_refused_naming_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text('{"text_config": {"vocab_size": 8}}')
    for model, why in ((tmp_path / "none", "cannot read"), (tmp_path / "vl", "no vocab_size")):
        assert main(["eval", "conformance", "--model", str(model), "--base-url", "http://x"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tokenmill: error: model: ") and why in err, err
