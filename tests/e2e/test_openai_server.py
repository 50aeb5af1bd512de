"""The OpenAI-compatible server, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server import MODEL_NAME, ServerHandle, run_server, wait_until
from tokenmill import LLM, SamplingParams
from tokenmill.config import DEMO_MODEL_DIR
from tokenmill.testing.checkpoints import build_scripted_checkpoint

SCRIPT = "Hello🎉世界!"


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    path = tmp_path_factory.mktemp("scripted") / "model"
    return path, build_scripted_checkpoint(path, SCRIPT)


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with run_server(llama_dir, log, "--max-model-len", "512", "--num-tokenizer-workers", "2") as h:
        yield h


@pytest.fixture(scope="module")
def scripted_server(scripted, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    log = tmp_path_factory.mktemp("logs") / "scripted.log"
    with run_server(scripted[0], log) as handle:
        yield handle


@pytest.fixture
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_completion_matches_offline_engine(client: openai.OpenAI, llama_dir: Path) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt="Hello world", max_tokens=12, temperature=0
    )
    offline = LLM(str(llama_dir), device="cpu").generate(
        ["Hello world"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )[0]
    assert response.choices[0].text == offline.outputs[0].text
    assert response.choices[0].finish_reason == "length"
    usage = response.usage
    assert usage.prompt_tokens == len(offline.prompt_token_ids)
    assert usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + 12


def test_logit_bias_and_allowed_token_ids_steer_the_tokens(server: ServerHandle) -> None:
    """A +100 bias makes its token the greedy choice; allowed ids bound what is sampled."""
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
    forced = {**body, "temperature": 0, "logit_bias": {"321": 100}}
    response = httpx.post(server.base_url + "/v1/completions", json=forced, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:321"] * 4
    allowed = {**body, "temperature": 1.5, "n": 3, "allowed_token_ids": [40, 41, 42]}
    response = httpx.post(server.base_url + "/v1/completions", json=allowed, timeout=60)
    assert response.status_code == 200, response.text
    tokens = {t for c in response.json()["choices"] for t in c["logprobs"]["tokens"]}
    assert tokens <= {"token_id:40", "token_id:41", "token_id:42"}


def test_truncate_prompt_tokens_keeps_the_end_of_a_long_prompt(server: ServerHandle) -> None:
    """A text prompt longer than the context is refused, or runs on its last tokens."""
    body = {"model": MODEL_NAME, "prompt": "one two three " * 300, "max_tokens": 3}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    body["truncate_prompt_tokens"] = 50
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 50


def test_bad_words_keep_a_word_out_of_the_output(server: ServerHandle) -> None:
    """A token of the greedy output whose text tokenizes back to it alone, sent as a bad word
    (text), is drawn no more."""
    url = server.base_url
    body = {"model": MODEL_NAME, "prompt": "Hello world", "max_tokens": 12, "temperature": 0,
            "logprobs": 0, "return_tokens_as_token_ids": True, "ignore_eos": True}  # fmt: skip
    response = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    ids = [int(t.split(":")[1]) for t in response["choices"][0]["logprobs"]["tokens"]]

    def alone(token: int) -> str | None:
        text = httpx.post(url + "/detokenize", json={"tokens": [token]}).json()["prompt"]
        if not text.strip() or not text.isprintable():
            return None
        again = httpx.post(
            url + "/tokenize", json={"prompt": text.strip(), "add_special_tokens": False}
        ).json()
        return text.strip() if again["tokens"] == [token] else None

    token, word = next((t, w) for t in ids if (w := alone(t)) is not None)
    response = httpx.post(url + "/v1/completions", json={**body, "bad_words": [word]}, timeout=60)
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    assert f"token_id:{token}" not in tokens


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server: ServerHandle):
    """vLLM's `stream_options.continuous_usage_stats`: each chunk's usage counts the tokens
    so far (never fewer than the chunk before), the last one all of them."""
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 6, "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all("usage" in c for c in chunks) and counts == sorted(counts)
    assert counts[-1] == 6 and chunks[-1]["choices"] == []


def test_streamed_completion_concatenates_to_the_full_text(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": "The cat", "max_tokens": 16, "temperature": 0}
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices


def test_streamed_chat_concatenates_to_the_full_message(client: openai.OpenAI) -> None:
    kwargs = {
        "model": MODEL_NAME,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_completion_tokens": 10,
        "temperature": 0,
    }
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_for_several_prompts_are_indexed_prompt_major(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt=["one", "two"], n=3, max_tokens=4, temperature=1.0, seed=5
    )
    assert sorted(c.index for c in response.choices) == list(range(6))
    again = client.completions.create(
        model=MODEL_NAME, prompt=["one", "two"], n=3, max_tokens=4, temperature=1.0, seed=5
    )
    assert [c.text for c in again.choices] == [c.text for c in response.choices]
    assert response.usage.completion_tokens == 24


def test_token_id_prompts_are_accepted(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7], [8]], max_tokens=2)
    assert len(response.choices) == 2
    assert response.usage.prompt_tokens == 4


def test_completion_logprobs(scripted_server: ServerHandle, scripted) -> None:
    # The scripted model's first tokens are ASCII: the legacy format keys alternatives by text,
    # which merges byte tokens that each decode to U+FFFD.
    _, ids = scripted
    client = openai.OpenAI(base_url=scripted_server.base_url + "/v1", api_key="x", max_retries=0)
    response = client.completions.create(
        model=MODEL_NAME, prompt=ids[:1], max_tokens=2, temperature=0, logprobs=3
    )
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 2
    assert "".join(lp.tokens) == response.choices[0].text == "llo"
    assert lp.text_offset == [0, len(lp.tokens[0])]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and top[token] == logprob == max(top.values())


def test_chat_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == item.logprob <= 0


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "Hello world! How are you today? " * 8
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= second.usage.prompt_tokens - 16 and cached > 0


def test_cache_salt_keeps_tenants_prefixes_apart(client: openai.OpenAI) -> None:
    prompt = "A salted prompt of a tenant of its own, long enough for pages. " * 8

    def cached(salt: str) -> int:
        response = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt}
        )
        return response.usage.prompt_tokens_details.cached_tokens

    assert cached("a") == 0 and cached("a") > 0 and cached("b") == 0


def test_reset_prefix_cache_empties_the_cache(server: ServerHandle, client: openai.OpenAI):
    prompt = "Reset me please, this prompt spans several pages. " * 4
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert httpx.post(server.base_url + "/reset_prefix_cache").status_code == 200
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_models_tokenize_detokenize_version(server: ServerHandle, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"].endswith("Hello world")
    chat = httpx.post(
        server.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}
    ).json()
    assert chat["count"] > 3
    assert httpx.get(server.base_url + "/version").json()["version"]


def test_chat_template_options_render_as_offline(server: ServerHandle, llama_dir: Path) -> None:
    """`add_generation_prompt`, `continue_final_message` and `chat_template_kwargs` render the
    chat as `LLM.chat` does with the same options, in /tokenize and in a chat completion."""
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello wor"}]
    options = {"add_generation_prompt": False, "continue_final_message": True,
               "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    tokens = httpx.post(server.base_url + "/tokenize", json={"messages": chat, **options}).json()
    llm = LLM(str(llama_dir), device="cpu")
    offline = llm.chat(chat, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False,
                       **options)[0]  # fmt: skip
    assert tokens["tokens"] == offline.prompt_token_ids
    body = {"model": MODEL_NAME, "messages": chat, "temperature": 0, "max_tokens": 5, **options}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == offline.outputs[0].text
    assert response.json()["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)


def test_head_requests_get_the_headers_of_get(server: ServerHandle) -> None:
    """Load balancers' HEAD health checks: 200 with GET's headers and no body, not 405."""
    for path in ("/health", "/v1/models", "/version"):
        head, get = httpx.head(server.base_url + path), httpx.get(server.base_url + path)
        assert head.status_code == get.status_code == 200, path
        assert head.content == b"" and head.headers.get("content-type") == get.headers.get(
            "content-type"
        )
    assert httpx.head(server.base_url + "/v1/completions").status_code == 405


def test_multibyte_characters_stream_intact(scripted_server: ServerHandle, scripted) -> None:
    _, ids = scripted
    client = openai.OpenAI(base_url=scripted_server.base_url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(
        model=MODEL_NAME, prompt=ids[:1], max_tokens=3 * len(ids), temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == (SCRIPT * 4)[len("He") :][: len("".join(pieces))]
    assert "🎉" in "".join(pieces) and "世界" in "".join(pieces)


def test_stop_string_ends_the_stream(scripted_server: ServerHandle, scripted) -> None:
    _, ids = scripted
    client = openai.OpenAI(base_url=scripted_server.base_url + "/v1", api_key="x", max_retries=0)
    response = client.completions.create(
        model=MODEL_NAME, prompt=ids[:1], max_tokens=50, temperature=0, stop=["世"]
    )
    assert response.choices[0].text == "llo🎉"
    assert response.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=ids[:1],
            max_tokens=50,
            temperature=0,
            stop=["界!"],
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == "llo🎉世"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_64_concurrent_streams_all_complete(server: ServerHandle) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=f"request {i}", max_tokens=8, stream=True, temperature=1.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
        return reasons[-1]

    async def main() -> list[str | None]:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert asyncio.run(main()) == ["length"] * 64


def _load(server: ServerHandle) -> dict:
    return httpx.get(server.base_url + "/load").json()


def test_disconnected_stream_is_aborted_and_frees_its_pages(server: ServerHandle) -> None:
    """The client leaves after the first chunk: the request ends as aborted, not by length.
    (Counting aborts, not polling for a running request: the tiny model can finish 400 tokens
    between two polls when the machine is busy.)"""

    def aborts() -> int:
        return _load(server)["requests_finished"].get("abort", 0)

    aborted = aborts()
    body = {
        "model": MODEL_NAME, "prompt": "never ending", "max_tokens": 400, "stream": True,
        "ignore_eos": True,
    }  # fmt: skip
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as r:
        assert next(r.iter_lines()).startswith("data: ")
    assert wait_until(lambda: aborts() == aborted + 1, timeout=5), _load(server)
    assert wait_until(lambda: _load(server)["num_requests_running"] == 0, timeout=5)
    assert wait_until(lambda: _load(server)["kv_cache_used_pages"] == 0, timeout=5)


def test_a_stream_whose_client_leaves_while_queued_is_aborted_at_once(tmp_path: Path) -> None:
    """A streamed request still waiting for its first token (no headers sent yet) is aborted
    when its client leaves, not kept in the queue (counting against --max-waiting-requests)
    until it is scheduled."""
    args = ("--max-num-seqs", "1", "--max-model-len", "2048")
    with run_server(DEMO_MODEL_DIR, tmp_path / "log", *args) as server:  # slow enough to queue
        body = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 2000, "ignore_eos": True}
        url = server.base_url + "/v1/completions"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the stream
            assert next(lines).startswith("data: ")  # it holds the one seat
            # A raw socket: sent, then closed while it waits (no response headers yet).
            payload = json.dumps({**body, "stream": True}).encode()
            head = f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {len(payload)}"
            port = int(server.base_url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(f"{head}\r\nContent-Type: application/json\r\n\r\n".encode() + payload)
                assert wait_until(lambda: _load(server)["num_requests_waiting"] == 1, 10)
            # Gone from the queue while the first request still runs (not scheduled after it).
            assert wait_until(lambda: _load(server)["num_requests_waiting"] == 0, 5)
            assert _load(server)["requests_finished"] == {"abort": 1}


def test_disconnected_non_streaming_request_is_aborted(server: ServerHandle) -> None:
    aborted = _load(server)["requests_finished"].get("abort", 0)
    body = {"model": MODEL_NAME, "prompt": "long", "max_tokens": 500, "n": 16, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=0.25)

    # The 16 choices may not have reached the engine yet when the client leaves (a busy CPU):
    # wait for their aborts, not for an idle engine, which can come before they arrive.
    def aborts() -> int:
        return _load(server)["requests_finished"].get("abort", 0)

    assert wait_until(lambda: aborts() == aborted + 16, timeout=30), aborts()
    assert wait_until(lambda: _load(server)["num_requests_running"] == 0, timeout=5)
    assert _load(server)["kv_cache_used_pages"] == 0
