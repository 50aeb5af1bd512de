"""Bad input gets the documented status and an OpenAI-style error body; never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.server import MODEL_NAME, ServerHandle, run_server

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with run_server(llama_dir, log, "--max-model-len", str(MAX_MODEL_LEN)) as handle:
        yield handle


def _post(server: ServerHandle, path: str, body: object) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=30)


def _assert_error(response: httpx.Response, status: int, *fragments: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    for fragment in fragments:
        assert fragment in error["message"]
    return error


COMPLETION_ERRORS = [
    ({"temperature": -1}, "temperature", "greater than or equal to 0, got -1"),
    ({"top_p": 0}, "top_p", "top_p: Input should be greater than 0, got 0"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1 unless echo is true, got 0"),
    ({"max_tokens": -1, "echo": True}, "max_tokens", "greater than or equal to 0"),
    ({"max_tokens": 0, "echo": True, "min_tokens": 2}, "min_tokens",
     "min_tokens must be 0 when max_tokens is 0 (echo generates nothing), got 2"),
    ({"n": 0}, "n", "n: Input should be greater than or equal to 1"),
    ({"logprobs": 50}, "logprobs", "logprobs: Input should be less than or equal to 20"),
    ({"presence_penalty": 5}, "presence_penalty", "presence_penalty: Input should be less than"),
    ({"temperature": "hot"}, "temperature", "a valid number, got 'hot'"),
    ({"prompt": []}, "prompt", "at least 1 item"),
    ({"prompt": [[1, 2], "mixed"]}, "prompt", "prompt.1: Input should be a valid list"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when stream"),
    ({"prompt": [10**9]}, "prompt", "prompt.0: Input should be less than"),
    ({"stop": [""]}, "stop", "stop.0: String should have at least 1 character"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream_options"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "min_tokens must be <= max_tokens (4)"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "keys must be token ids, integers in [0, 512)"),
    ({"logit_bias": {"512": 1}}, "logit_bias", "got '512'"),
    ({"logit_bias": {"007": 1}}, "logit_bias", "got '007'"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "less than or equal to 100"),
    ({"logit_bias": {"5": "1"}}, "logit_bias", "valid number"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "at least 1 item"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "greater than or equal to 1"),
    ({"bad_words": [" "]}, "bad_words", "non-blank strings"),
    ({"priority": 1}, "priority", "does not schedule by priority"),
    ({"bad_words": ["x"] * 129}, "bad_words", "at most 128 items"),
    ({"allowed_token_ids": [512]}, "allowed_token_ids", "less than 512"),
    ({"allowed_token_ids": [3], "response_format": {"type": "json_object"}}, "allowed_token_ids",
     "cannot be combined with structured_outputs"),
]  # fmt: skip


@pytest.mark.parametrize(("patch", "param", "message"), COMPLETION_ERRORS)
def test_bad_completion_parameters_are_400(server: ServerHandle, patch, param, message) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, **patch}
    error = _assert_error(_post(server, "/v1/completions", body), 400, message)
    if param is not None:
        assert error["param"] == param


CHAT_ERRORS = [
    ({"continue_final_message": True}, "continue_final_message", "cannot be combined"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs", "may not set"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "valid dictionary"),
    ({"add_generation_prompt": False, "continue_final_message": True}, "messages",
     "the last message to be the assistant's"),
]  # fmt: skip


@pytest.mark.parametrize(("patch", "param", "message"), CHAT_ERRORS)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_bad_chat_template_options_are_400(server: ServerHandle, path, patch, param, message):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **patch}
    error = _assert_error(_post(server, path, body), 400, message)
    assert error["param"] == param


def test_bad_chat_parameters_are_400(server: ServerHandle) -> None:
    base = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    _assert_error(_post(server, "/v1/chat/completions", {**base, "messages": []}), 400)
    bad_role = {**base, "messages": [{"role": "robot", "content": "x"}]}
    _assert_error(_post(server, "/v1/chat/completions", bad_role), 400, "messages")
    _assert_error(
        _post(server, "/v1/chat/completions", {**base, "top_logprobs": 2}), 400, "top_logprobs"
    )
    _assert_error(_post(server, "/v1/chat/completions", {**base, "min_p": 2}), 400, "min_p")


def test_unknown_model_is_404(server: ServerHandle) -> None:
    body = {"model": "gpt-5", "prompt": "hi"}
    error = _assert_error(_post(server, "/v1/completions", body), 404, "gpt-5")
    assert error["type"] == "NotFoundError" and error["param"] == "model"
    chat = {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}
    _assert_error(_post(server, "/v1/chat/completions", chat), 404)
    # A long name is repeated only in part (a 100 kB name came back whole).
    long = _assert_error(_post(server, "/v1/completions", {**body, "model": "m" * 100_000}), 404)
    assert len(long["message"]) < 400


def test_prompt_longer_than_context_is_400_naming_both_lengths(server: ServerHandle) -> None:
    body = {"model": MODEL_NAME, "prompt": list(range(5, 205)), "max_tokens": 4}
    _assert_error(_post(server, "/v1/completions", body), 400, "128", "200")
    body = {"model": MODEL_NAME, "prompt": list(range(5, 105)), "max_tokens": 50}
    _assert_error(_post(server, "/v1/completions", body), 400, "128", "150", "100", "50")
    stream = {**body, "stream": True}
    _assert_error(_post(server, "/v1/completions", stream), 400, "128")
    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "word " * 300}],
        "max_tokens": 4,
    }
    _assert_error(_post(server, "/v1/chat/completions", chat), 400, "128")


def test_malformed_json_is_400(server: ServerHandle) -> None:
    response = httpx.post(
        server.base_url + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    _assert_error(response, 400)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)  # JSON has no NaN or infinity
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=6,
)
_FIELDS = [
    "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
    "seed", "logprobs", "top_logprobs", "stream", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "max_completion_tokens",
    "logit_bias", "allowed_token_ids", "echo", "prompt_logprobs", "add_generation_prompt",
    "continue_final_message", "chat_template_kwargs", "truncate_prompt_tokens", "bad_words",
    "cache_salt", "priority",
]  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    overrides=st.dictionaries(st.sampled_from(_FIELDS), _json, max_size=3),
)
def test_fuzzed_bodies_never_get_a_server_error(server: ServerHandle, path: str, overrides) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 2}
    body |= (
        {"prompt": "hi"}
        if path.rsplit("/", 1)[1] == "completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    body |= overrides
    response = _post(server, path, body)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        _assert_error(response, 400)
