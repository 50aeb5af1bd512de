"""The HTTP edge under attack: the issue-17 reproducers, limits, api key, load shedding, CORS.

One real server (tiny checkpoint) with every edge option switched on; each test says which.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import MODEL_NAME, ServerHandle, run_server, wait_until
from tests.reliability.routes import app_routes
from tokenmill.sampling_params import SamplingParams

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 128
MAX_PROMPT_BYTES = 3_000_000
MAX_BODY = 8 * 1024 * 1024
ORIGIN = "http://dashboard.example"
TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    flags = [
        "--max-model-len", str(MAX_MODEL_LEN), "--api-key", KEY,
        # One running sequence at a time, so that others visibly wait (load shedding).
        "--max-num-seqs", "1", "--max-waiting-requests", "2",
        "--max-prompt-bytes", str(MAX_PROMPT_BYTES), "--max-request-body-bytes", str(MAX_BODY),
        "--max-n", "8", "--max-stop", "4", "--max-stop-chars", "16",
        "--allowed-origins", ORIGIN, "--chat-template", TEMPLATE,
    ]  # fmt: skip
    with run_server(llama_dir, log, *flags) as handle:
        yield handle


@pytest.fixture
def client(server: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as c:
        yield c


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


def _post(client: httpx.Client, path: str, body: object) -> httpx.Response:
    """POST JSON with non-ASCII escaped, so that unpaired surrogates travel as `\\udXXX`."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def _healthy(server: ServerHandle) -> bool:
    return httpx.get(server.base_url + "/health", timeout=10).status_code == 200


HUGE = 2**64
DEEP_SCHEMA: dict = {"type": "string"}
for _ in range(40):
    DEEP_SCHEMA = {"type": "object", "properties": {"a": DEEP_SCHEMA}}
MANY_OPTIONAL = {f"p{i}": {"type": "integer"} for i in range(2000)}
BAD_COMPLETIONS = [
    # integers outside what the engine represents (were HTTP 500s)
    ({"max_tokens": HUGE}, "max_tokens"),
    ({"seed": HUGE}, "seed"),
    ({"seed": -1}, "seed"),
    ({"top_k": HUGE}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"stop_token_ids": [1, HUGE]}, "stop_token_ids"),
    ({"prompt": [1, HUGE]}, "prompt"),
    ({"prompt": [[1, 2], [3, -(2**70)]]}, "prompt"),
    # token ids within the vocabulary, of the right JSON type
    ({"prompt": [1, 512]}, "prompt"),
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": [1.0, 2.0]}, "prompt"),
    ({"prompt": [[1, 2], "mixed"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    # strict types
    ({"stream": "yes"}, "stream"),
    ({"n": 2.5}, "n"),
    ({"seed": True}, "seed"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"temperature": True}, "temperature"),
    # beyond the sampler's float32 range: NaN weights sampled token 0 (were HTTP 200s)
    ({"temperature": 1e39}, "temperature"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty"),
    # unpaired surrogates (were HTTP 500s)
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": ["ok", "\udfff"]}, "prompt"),
    ({"stop": "a\ud800"}, "stop"),
    ({"stop": ["x", "\ud800"]}, "stop"),
    ({"model": "\ud800"}, "model"),
    # limits of this server
    ({"n": 9}, "n"),
    ({"prompt": ["a", "b", "c"], "n": 3}, "n"),
    ({"best_of": 9, "n": 9}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": "x" * 17}, "stop"),
    ({"stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
    ({"max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),
    ({"min_tokens": 10**9}, "min_tokens"),
    ({"min_tokens": 8, "max_tokens": 4}, "min_tokens"),
    # echo and prompt logprobs (vLLM's rules)
    ({"max_tokens": 0}, "max_tokens"),  # only with echo
    ({"max_tokens": 0, "echo": "yes"}, "echo"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's whole vocabulary: not offered
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    # structured output that cannot be built
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "response_format",
    ),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    # vLLM's older guided_* fields: one constraint, named by the field sent
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_json": {"type": "?"}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_grammar": 'root ::= "a"', "structured_outputs": {"regex": "a"}}, "guided_grammar"),
    # an invalid schema names the field the client sent (was `structured_outputs`)
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "?"}},
            }
        },
        "response_format",
    ),
    # constraints whose parsing cost is unbounded (a 1,000-deep schema blocked the event loop
    # for minutes): too deep, too long
    (
        {"structured_outputs": {"json": '{"type": "array", "items": ' * 100 + "{}" + "}" * 100}},
        "structured_outputs",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": DEEP_SCHEMA},
            }
        },
        "response_format",
    ),
    ({"structured_outputs": {"regex": "a" * 200_000}}, "structured_outputs"),
    # a pattern's repetition count costs its square to parse: 60 bytes held every process the
    # request crossed for 19 s each, and stalled the engine core's other requests
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a{20000}"}},
            }
        },
        "response_format",
    ),
    # an object's optional properties cost their square to compile: 2,000 held the engine's
    # grammar compiler (and every structured request behind it) for a minute
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": MANY_OPTIONAL},
                },
            }
        },
        "response_format",
    ),
]


@pytest.mark.parametrize(("patch", "param"), BAD_COMPLETIONS, ids=lambda v: str(v)[:40])
def test_bad_completion_is_400_naming_the_field(client: httpx.Client, patch, param) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, **patch}
    _assert_error(_post(client, "/v1/completions", body), 400, param)


@pytest.mark.parametrize(
    ("field", "value"),
    [("guided_choice", ["yes", "no"]), ("guided_regex", "[ab]{3}"),
     ("guided_json", {"type": "object", "properties": {"a": {"type": "boolean"}},
                      "required": ["a"], "additionalProperties": False}),
     ("guided_grammar", 'root ::= "x" | "y"')],
)  # fmt: skip
def test_guided_fields_constrain_as_structured_outputs_does(
    client: httpx.Client, field: str, value: object
) -> None:
    """vLLM's older names constrain the output (they were ignored: unconstrained text)."""
    base = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 40, "temperature": 0}
    kind = field.removeprefix("guided_")
    guided = _post(client, "/v1/completions", {**base, field: value})
    assert guided.status_code == 200, guided.text
    same = _post(client, "/v1/completions", {**base, "structured_outputs": {kind: value}})
    text = guided.json()["choices"][0]["text"]
    assert text == same.json()["choices"][0]["text"]
    if field == "guided_choice":
        assert text in value  # type: ignore[operator]
    elif field == "guided_json":
        assert isinstance(json.loads(text)["a"], bool)


BIG_ARGS = json.dumps({"x": "y" * MAX_PROMPT_BYTES})
PATTERNED = {"type": "object", "properties": {"a": {"type": "string", "pattern": "a{20000}"}}}
BAD_CHATS = [
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * (MAX_PROMPT_BYTES + 1)}]}, "messages"),
    # text a chat template renders besides the contents counts too (it was tokenized first,
    # seconds per megabyte while the tokenizer worker's other requests waited)
    ({"messages": [{"role": "user", "content": "hi", "name": "x" * MAX_PROMPT_BYTES}]}, "messages"),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": BIG_ARGS}}],
                },
            ]
        },
        "messages",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "description": "x" * MAX_PROMPT_BYTES},
                }
            ]
        },
        "tools",
    ),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
    ),
    # JSON the chat template renders, nested deeper than a constraint may be: tool-call
    # arguments and tools' parameters (RecursionError in json.loads or the template: HTTP 500s)
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
                    ],
                },
            ]
        },
        "messages",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP_SCHEMA}}]},
        "tools",
    ),
    # a function's parameters that are no JSON schema name `tools` (was `structured_outputs`)
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "?"}}}],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": PATTERNED}}],
            "tool_choice": "required",
        },
        "tools",
    ),
]


@pytest.mark.parametrize(("patch", "param"), BAD_CHATS, ids=lambda v: str(v)[:40])
def test_bad_chat_is_400_naming_the_field(client: httpx.Client, patch, param) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **patch}
    _assert_error(_post(client, "/v1/chat/completions", body), 400, param)


def test_bad_bodies_get_openai_errors(client: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    for content in (b'{"prompt": "\xff\xfe"}', b"[" * 100_000 + b"]" * 100_000, b"{not json"):
        _assert_error(client.post("/v1/completions", content=content, headers=headers), 400)
    _assert_error(client.post("/v1/completions", json=["a list"]), 400)
    _assert_error(_post(client, "/tokenize", {"prompt": "\ud800"}), 400, "prompt")
    _assert_error(client.post("/tokenize", json={}), 400, "prompt")
    _assert_error(client.post("/tokenize", json={"messages": []}), 400, "messages")  # was prompt
    _assert_error(client.post("/detokenize", json={"tokens": [512]}), 400, "tokens")
    deep_call = {"function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
    chat = [{"role": "assistant", "tool_calls": [deep_call]}]
    _assert_error(client.post("/tokenize", json={"messages": chat}), 400, "messages")
    _assert_error(client.get("/v1/feedback", params={"limit": 0}), 400, "limit")  # was `query`
    _assert_error(client.post("/detokenize", json={"tokens": [True]}), 400, "tokens")
    # no sequence the model runs is longer (millions of ids held the api server for seconds)
    too_long = {"tokens": [5] * (MAX_MODEL_LEN + 1)}
    _assert_error(client.post("/detokenize", json=too_long), 400, "tokens")
    assert client.post("/detokenize", json={"tokens": []}).status_code == 200
    assert _assert_error(client.get("/v1/nothing"), 404)["type"] == "NotFoundError"
    _assert_error(client.delete("/v1/completions"), 405)


def _engine_wraps_seeds() -> bool:
    """The engine side (SamplingParams.for_choice) keeps choice seeds within 64 bits."""
    try:
        seed = SamplingParams(seed=2**64 - 1, n=2).for_choice(1).seed
    except (ValueError, OverflowError):
        return False
    return seed is not None and 0 <= seed < 2**64


@pytest.mark.skipif(not _engine_wraps_seeds(), reason="needs choice seeds wrapped below 2^64")
def test_largest_seed_with_n_2_completes_and_server_stays_up(
    client: httpx.Client, server: ServerHandle
) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "n": 2, "seed": 2**64 - 1}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2
    assert _healthy(server)


def _http(sock: socket.socket, method: str, path: str, body: bytes, extra: str = "") -> bytes:
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    )
    sock.sendall(head.encode() + body)
    return _read_response(sock)


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(
        next(
            h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
        )
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    return head + b"\r\n\r\n" + rest


def test_errors_keep_the_kept_alive_connection_usable(server: ServerHandle) -> None:
    port = int(server.base_url.rsplit(":", 1)[1])
    good = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}).encode()
    bad_bodies = [b'{"prompt": "a\\ud800b"}', b'{"prompt": [1, 18446744073709551616]}', b"{x"]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for bad in bad_bodies:
            response = _http(sock, "POST", "/v1/completions", bad)
            assert response.startswith(b"HTTP/1.1 400"), response[:200]
            assert b"connection: close" not in response.lower()
            assert _http(sock, "POST", "/v1/completions", good).startswith(b"HTTP/1.1 200")


def test_oversized_body_is_413_before_it_is_read(server: ServerHandle) -> None:
    port = int(server.base_url.rsplit(":", 1)[1])
    size = 50 * 1024 * 1024
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt": "' + b"a" * 65536)  # then stop sending
        response = _read_response(sock)
    assert time.monotonic() - started < 5
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert b"connection: close" in response.lower()
    error = json.loads(response.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == 413 and "max-request-body-bytes" in error["message"]
    assert _healthy(server)


def test_prompt_over_the_byte_limit_is_refused_before_tokenizing(client: httpx.Client) -> None:
    body = {"model": MODEL_NAME, "prompt": "word " * (MAX_PROMPT_BYTES // 5 + 1)}
    started = time.monotonic()
    error = _assert_error(client.post("/v1/completions", json=body), 400, "prompt")
    assert time.monotonic() - started < 5  # tokenizing 3 MB takes far longer here
    assert "--max-prompt-bytes" in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    error = _assert_error(client.post("/tokenize", json={"prompt": body["prompt"]}), 400, "prompt")


def test_long_tokenize_does_not_block_health(client: httpx.Client, server: ServerHandle) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 20_000  # 900 kB
    result: dict[str, object] = {}

    def tokenize() -> None:
        started = time.monotonic()
        result["response"] = client.post("/tokenize", json={"prompt": text})
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=tokenize)
    thread.start()
    latencies = []
    while thread.is_alive():
        started = time.monotonic()
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
        latencies.append(time.monotonic() - started)
        time.sleep(0.05)
    thread.join()
    response = result["response"]
    assert isinstance(response, httpx.Response) and response.status_code == 200
    assert response.json()["count"] > 100_000
    # Measured while tokenizing took seconds: /health never waited for it.
    assert len(latencies) >= 3 and max(latencies) < 1.0, (result["seconds"], latencies)


def test_every_route_but_public_ones_needs_the_api_key(server: ServerHandle) -> None:
    public = {"/health", "/metrics", "/dashboard"}
    for method, path in app_routes():
        url = server.base_url + path
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = httpx.request(method, url, headers=headers, timeout=30)
            if path in public:
                assert response.status_code != 401, (method, path)
            else:
                error = _assert_error(response, 401)
                assert error["type"] == "AuthenticationError", (method, path)
                assert response.headers["www-authenticate"] == "Bearer"
        # With the key every route answers (a body-taking route: 400 for the empty body).
        response = httpx.request(method, url, headers=AUTH, timeout=30)
        assert response.status_code not in (401, 500), (method, path, response.text)


def test_cors_preflight_needs_no_key_and_names_the_origin(server: ServerHandle) -> None:
    preflight = httpx.options(
        server.base_url + "/v1/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(server.base_url + "/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_chat_template_flag_renders_tokenize_and_chat(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat_ids = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    rendered = {"prompt": "<hi><yo>", "add_special_tokens": False}
    assert chat_ids == client.post("/tokenize", json=rendered).json()["tokens"]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1}
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == len(chat_ids)  # the tokenizer worker used it too


def test_load_is_shed_with_503_and_counted(client: httpx.Client, server: ServerHandle) -> None:
    # n=4 with one running sequence at a time: 3 wait for their first token, over the limit
    # of 2 (admitted all the same: nothing waited before it).
    long = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 100, "ignore_eos": True, "n": 4}
    results: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: results.append(client.post("/v1/completions", json=long))
    )
    thread.start()
    assert wait_until(lambda: client.get("/load").json()["num_sequences_waiting_first_token"] >= 2)
    shed = client.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    )
    error = _assert_error(shed, 503)
    assert shed.headers["retry-after"] == "1" and "overloaded" in error["message"]
    thread.join(timeout=120)
    assert results[0].status_code == 200 and len(results[0].json()["choices"]) == 4
    load = client.get("/load").json()
    assert load["num_requests_rejected"] >= 1
    assert load["num_sequences_waiting_first_token"] == 0
    metrics = client.get("/metrics").text
    line = next(
        ln for ln in metrics.splitlines() if ln.startswith("tokenmill:request_rejected_total")
    )
    assert float(line.rsplit(" ", 1)[1]) >= 1
    # Once the queue drained, requests are admitted again.
    ok = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200


def test_polls_of_metrics_and_health_stay_out_of_the_access_log(
    client: httpx.Client, server: ServerHandle
) -> None:
    for _ in range(3):
        client.get("/metrics")
        client.get("/health")
    client.get("/version")
    assert wait_until(lambda: "GET /version" in server.log)
    assert "GET /metrics" not in server.log and "GET /health" not in server.log
