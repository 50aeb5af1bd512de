"""Random combinations of the chat template options, truncate_prompt_tokens, bad_words,
cache_salt, priority, continuous usage and HEAD, sent to a real server run with the priority
policy, a reasoning parser and the llama3_json tool parser: every answer is a 200 of the right
shape or a 400 in OpenAI's shape, and the server stays healthy."""

from __future__ import annotations

from typing import Any

import httpx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.e2e.server import MODEL_NAME, ServerHandle, post_json_or_stream, server_fixture

FLAGS = (
    "--max-model-len", "128", "--max-num-batched-tokens", "16",
    "--scheduling-policy", "priority", "--reasoning-parser", "deepseek_r1",
    "--tool-call-parser", "llama3_json",
)  # fmt: skip
VOCAB = 512  # the tiny checkpoint's

server = server_fixture(*FLAGS)

_scalar = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8)
_json = st.recursive(
    _scalar | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=12,
)  # fmt: skip
_kwarg_names = st.sampled_from(
    ["enable_thinking", "bos_token", "eos_token", "raise_exception", "x", "messages", "tools",
     "date_string", "strftime_now", "range", "namespace", "loop", "__class__"]
)  # fmt: skip
_TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
_fields = {
    "n": st.integers(1, 3),
    "max_tokens": st.integers(1, 5),
    "temperature": st.sampled_from([0, 1.0]),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.dictionaries(_kwarg_names, _json, max_size=3),
    "truncate_prompt_tokens": st.integers(-1, 40),
    "bad_words": st.lists(st.text(min_size=0, max_size=6), max_size=4),
    "cache_salt": st.text(max_size=8),
    "priority": st.integers(-(2**65), 2**65),
    "tools": st.just([_TOOL]),
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "ignore_eos": st.booleans(),
    "echo": st.booleans(),
}
_overrides = st.lists(st.sampled_from(sorted(_fields)), max_size=8, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: _fields[name] for name in names})
)
_messages = st.lists(
    st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.sampled_from(["hi", "The cat sat", "<think>a", "</th", "{\"name\": \"get\"",
                                    "é€😀"]),
    }),
    min_size=1, max_size=3,
)  # fmt: skip


def _assert_stream(body: dict[str, Any], chunks: list[dict[str, Any]], n: int) -> None:
    options = body.get("stream_options") or {}
    usage = options.get("include_usage")
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert {c["index"] for c in choices} == set(range(n))
    finishes = [c for c in choices if c.get("finish_reason") is not None]
    assert sorted(c["index"] for c in finishes) == list(range(n)), chunks
    if usage:
        last = chunks[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 1
    if usage and options.get("continuous_usage_stats"):
        assert all(chunk.get("usage") is not None for chunk in chunks)


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(chat=st.booleans(), msgs=_messages, overrides=_overrides)
def test_random_new_fields_get_a_200_of_the_right_shape_or_a_400(
    server: ServerHandle, chat: bool, msgs: list[dict[str, str]], overrides: dict[str, Any]
) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 3, **overrides}
    if chat:
        body["messages"] = msgs
        path = "/v1/chat/completions"
    else:
        body["prompt"] = " ".join(m["content"] for m in msgs)
        path = "/v1/completions"
    if chat:  # /tokenize renders the chat as the completion does, or refuses it alike
        keys = {"messages", "add_generation_prompt", "continue_final_message",
                "chat_template_kwargs"}  # fmt: skip
        tokenized = httpx.post(server.base_url + "/tokenize", json={
            "model": MODEL_NAME, **{k: v for k, v in body.items() if k in keys}
        }, timeout=60)  # fmt: skip
        event(f"/tokenize {tokenized.status_code}")
        assert tokenized.status_code in (200, 400), tokenized.text
    status, reply = post_json_or_stream(server, path, body)
    event(f"{path} {status}")
    assert status in (200, 400), reply
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    if status == 400:
        error = reply["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
        return
    n = body.get("n", 1)
    if body.get("stream"):
        _assert_stream(body, reply, n)
    else:
        assert sorted(c["index"] for c in reply["choices"]) == list(range(n))
        assert reply["usage"]["completion_tokens"] >= 1


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize", "/health",
                          "/v1/models", "/metrics", "/version", "/nonexistent"]),
)  # fmt: skip
def test_head_is_never_a_500(server: ServerHandle, path: str) -> None:
    response = httpx.head(server.base_url + path, timeout=30)
    event(f"HEAD {path} {response.status_code}")
    assert response.status_code < 500 and response.content == b""
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
