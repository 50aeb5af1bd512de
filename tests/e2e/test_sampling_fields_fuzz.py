"""Random combinations of the sampling fields (echo, prompt_logprobs, logit_bias,
allowed_token_ids) with n, stream, stop, logprobs, seeds and response formats, sent to a real
server: every answer is a 200 of the right shape or a 400 in OpenAI's shape, the server stays
healthy, and a greedy request answers as `LLM.generate` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.e2e.server import MODEL_NAME, ServerHandle, post_json_or_stream, server_fixture
from tokenmill import LLM, SamplingParams
from tokenmill.tokenization.tokenizer import load_tokenizer

MAX_MODEL_LEN = 128
FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "16")
VOCAB = 512  # the tiny checkpoint's


server = server_fixture(*FLAGS)


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Any:
    return load_tokenizer(str(llama_dir))


_ids = st.integers(0, VOCAB - 1)  # the low ids are the special tokens
_prompt = st.one_of(
    st.sampled_from(["hi", "The cat sat on the mat.", "a, b; c"]),
    st.lists(_ids, min_size=1, max_size=24),
)
_fields = {
    "n": st.integers(1, 3),
    "max_tokens": st.integers(0, 4),
    "min_tokens": st.integers(0, 2),
    "temperature": st.sampled_from([0, 0.7, 1.5]),
    "seed": st.integers(0, 2**32),
    "stop": st.lists(st.sampled_from(["e", "th", " ", "\n"]), min_size=1, max_size=2),
    "include_stop_str_in_output": st.booleans(),
    "stop_token_ids": st.lists(_ids, min_size=1, max_size=3),
    "logprobs": st.integers(0, 3),
    "prompt_logprobs": st.integers(0, 3),
    "echo": st.booleans(),
    "stream": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(),
    "logit_bias": st.dictionaries(_ids.map(str), st.floats(-100, 100), max_size=6),
    "allowed_token_ids": st.lists(_ids, min_size=1, max_size=6),
    "response_format": st.just({"type": "json_object"}),
    "ignore_eos": st.booleans(),
}
_overrides = st.lists(st.sampled_from(sorted(_fields)), max_size=7, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: _fields[name] for name in names})
)


def _assert_error_shape(body: Any) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400


def _assert_completion_shape(body: dict[str, Any], tokenizer: Any, n: int) -> None:
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    reply = body["reply"]
    choices = _merged_choices(reply) if body.get("stream") else reply["choices"]
    assert sorted(c["index"] for c in choices) == list(range(len(prompts) * n))
    for choice in choices:
        prompt = prompts[choice["index"] // n]
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        if body.get("echo"):
            assert choice["text"].startswith(text)
            if body.get("max_tokens") == 0:
                assert choice["text"] == text
        if body.get("prompt_logprobs") is not None:
            scores = choice["prompt_logprobs"]
            assert scores[0] is None and all(s is not None for s in scores[1:])
            if isinstance(prompt, list):
                assert len(scores) == len(prompt)
                assert all(str(t) in s for t, s in zip(prompt[1:], scores[1:], strict=True))
        allowed = body.get("allowed_token_ids")
        logprobs = choice["logprobs"]
        if allowed and logprobs and body.get("return_tokens_as_token_ids"):
            generated = logprobs["tokens"][len(prompt) if body.get("echo") else 0 :]
            if isinstance(prompt, list) or not body.get("echo"):
                assert {int(t.removeprefix("token_id:")) for t in generated} <= set(allowed)
    if not body.get("stream") and body.get("max_tokens") == 0:
        assert reply["usage"]["completion_tokens"] == 0


def _merged_choices(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stream's choices as one response's: texts and logprobs joined by index."""
    merged: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            choice = merged.setdefault(c["index"], {"index": c["index"], "text": "",
                                                    "logprobs": None})  # fmt: skip
            choice["text"] += c["text"]
            if c["logprobs"] is not None:
                old = choice["logprobs"] or {"tokens": []}
                choice["logprobs"] = {"tokens": old["tokens"] + c["logprobs"]["tokens"]}
    return list(merged.values())


def _assert_chat_shape(body: dict[str, Any], n: int) -> None:
    reply = body["reply"]
    if body.get("stream"):
        assert {c["index"] for chunk in reply for c in chunk["choices"]} == set(range(n))
        return
    assert sorted(c["index"] for c in reply["choices"]) == list(range(n))
    if body.get("prompt_logprobs") is not None:
        scores = reply["prompt_logprobs"]
        assert len(scores) == reply["usage"]["prompt_tokens"] and scores[0] is None


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(chat=st.booleans(), prompt=_prompt, overrides=_overrides)
def test_random_sampling_fields_get_a_200_of_the_right_shape_or_a_400(
    server: ServerHandle, tokenizer: Any, chat: bool, prompt: str | list[int], overrides
) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 3, **overrides}
    if chat:
        body["messages"] = [{"role": "user", "content": str(prompt)}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    status, reply = post_json_or_stream(server, path, body)
    event(f"status {status}")
    assert status in (200, 400), reply
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    if status == 400:
        _assert_error_shape(reply)
        return
    body["reply"] = reply
    if chat:
        _assert_chat_shape(body, body.get("n", 1))
    else:
        _assert_completion_shape(body, tokenizer, body.get("n", 1))


@pytest.fixture(scope="module")
def offline(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), device="cpu", max_model_len=MAX_MODEL_LEN,
               max_num_batched_tokens=16)  # fmt: skip


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompt=st.lists(_ids, min_size=1, max_size=40),
    max_tokens=st.integers(1, 6),
    min_tokens=st.integers(0, 2),
    prompt_logprobs=st.none() | st.integers(0, 3),
    logit_bias=st.dictionaries(_ids, st.floats(-100, 100), max_size=5),
    allowed=st.none() | st.lists(_ids, min_size=1, max_size=6),
    stop_token_ids=st.lists(_ids, max_size=3),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
)
def test_greedy_http_answers_as_llm_generate(
    server: ServerHandle, offline: LLM, prompt: list[int], max_tokens: int, min_tokens: int,
    prompt_logprobs: int | None, logit_bias: dict[int, float], allowed: list[int] | None,
    stop_token_ids: list[int], repetition_penalty: float,
) -> None:  # fmt: skip
    fields = dict(
        max_tokens=max_tokens,
        min_tokens=min(min_tokens, max_tokens),
        prompt_logprobs=prompt_logprobs,
        logit_bias=logit_bias or None,
        allowed_token_ids=allowed,
        stop_token_ids=stop_token_ids,
        repetition_penalty=repetition_penalty,
    )
    params = SamplingParams(temperature=0, logprobs=0, **fields)
    (expected,) = offline.generate([prompt], params, use_tqdm=False)
    body = {**fields, "logit_bias": {str(t): b for t, b in logit_bias.items()} or None}
    body |= {"model": MODEL_NAME, "prompt": prompt, "temperature": 0, "logprobs": 0}
    status, reply = post_json_or_stream(
        server, "/v1/completions", {**body, "return_tokens_as_token_ids": True}
    )
    assert status == 200, reply
    (choice,) = reply["choices"]
    tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    assert tokens == expected.outputs[0].token_ids
    assert choice["finish_reason"] == expected.outputs[0].finish_reason
    if prompt_logprobs is None:
        return
    scores = choice["prompt_logprobs"]
    assert scores[0] is None and expected.prompt_logprobs is not None
    for ours, theirs in zip(scores[1:], expected.prompt_logprobs[1:], strict=True):
        assert theirs is not None
        assert {int(t): v["logprob"] for t, v in ours.items()} == pytest.approx(
            {t: lp.logprob for t, lp in theirs.items()}, abs=1e-5
        )
