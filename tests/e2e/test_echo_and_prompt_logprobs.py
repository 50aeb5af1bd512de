"""Completions' `echo` and vLLM's `prompt_logprobs` through a real server, as vLLM answers them;
and lm-evaluation-harness's loglikelihood requests (local-completions) parsed as lm-eval does,
against transformers' log-softmax of the same tokens."""

from __future__ import annotations

import json
from operator import itemgetter
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.conftest import hf_logprobs
from tests.e2e.server import MODEL_NAME, ServerHandle, server_fixture
from tokenmill.tokenization.tokenizer import load_tokenizer

PROMPT_IDS = list(range(40, 72))
PROMPT_TEXT = "The cat sat on the mat and looked at the door."


# A 16-token budget: prompts are scored chunk by chunk.
MAX_RESPONSE_LOGPROBS = 20_000
server = server_fixture("--max-model-len", "256", "--max-num-batched-tokens", "16",
                        "--max-response-logprobs", str(MAX_RESPONSE_LOGPROBS))  # fmt: skip


def _complete(server: ServerHandle, **body: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "temperature": 0, **body}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _reference(llama_dir: Path, ids: list[int]) -> list[float]:
    """transformers' logprob of each token after the first, given the tokens before it."""
    rows = hf_logprobs(llama_dir, ids)
    return [rows[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_puts_the_prompt_text_before_the_completion(server: ServerHandle) -> None:
    plain = _complete(server, prompt=PROMPT_TEXT, max_tokens=5)
    echoed = _complete(server, prompt=PROMPT_TEXT, max_tokens=5, echo=True)
    assert echoed["choices"][0]["text"] == PROMPT_TEXT + plain["choices"][0]["text"]
    counts = ("prompt_tokens", "completion_tokens")
    assert [echoed["usage"][k] for k in counts] == [plain["usage"][k] for k in counts]


def test_echo_decodes_token_id_prompts_for_every_choice(
    server: ServerHandle, llama_dir: Path
) -> None:
    tokenizer = load_tokenizer(str(llama_dir))
    prompts = [PROMPT_IDS, [5, 6, 7]]
    body = _complete(server, prompt=prompts, max_tokens=3, echo=True, n=2, seed=1)
    texts = [c["text"] for c in sorted(body["choices"], key=itemgetter("index"))]
    assert len(texts) == 4
    for i, text in enumerate(texts):
        assert text.startswith(tokenizer.decode(prompts[i // 2]))


def test_echo_with_logprobs_scores_every_prompt_token(
    server: ServerHandle, llama_dir: Path
) -> None:
    plain = _complete(server, prompt=PROMPT_IDS, max_tokens=3, logprobs=2)["choices"][0]
    choice = _complete(server, prompt=PROMPT_IDS, max_tokens=3, logprobs=2, echo=True)
    logprobs = choice["choices"][0]["logprobs"]
    num = len(PROMPT_IDS)
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == num + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = _reference(llama_dir, PROMPT_IDS)
    assert logprobs["token_logprobs"][1:num] == pytest.approx(expected, abs=1e-4)
    reference = hf_logprobs(llama_dir, PROMPT_IDS)
    for i in range(1, num):
        top = logprobs["top_logprobs"][i]
        assert max(top.values()) == pytest.approx(reference[i - 1].max().item(), abs=1e-4)
    # The generated tokens' entries are those of the request without echo.
    plain_logprobs = plain["logprobs"]
    assert logprobs["tokens"][num:] == plain_logprobs["tokens"]
    assert logprobs["token_logprobs"][num:] == pytest.approx(plain_logprobs["token_logprobs"])
    lengths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
    assert "".join(logprobs["tokens"]) == choice["choices"][0]["text"]


def test_max_tokens_0_with_echo_returns_the_prompt_alone(
    server: ServerHandle, llama_dir: Path
) -> None:
    body = _complete(server, prompt=PROMPT_TEXT, max_tokens=0, echo=True, logprobs=1)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT_TEXT
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    ids = load_tokenizer(str(llama_dir)).encode(PROMPT_TEXT)
    assert len(choice["logprobs"]["tokens"]) == body["usage"]["prompt_tokens"] == len(ids)
    expected = _reference(llama_dir, ids)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("prompt", [PROMPT_TEXT, PROMPT_IDS])
def test_echo_of_a_truncated_prompt_is_the_text_the_model_read(
    server: ServerHandle, llama_dir: Path, prompt: str | list[int]
) -> None:
    """`truncate_prompt_tokens` cuts the prompt to its last tokens; echo repeats those (it
    repeated the whole prompt, and its logprob tokens did not spell the text)."""
    tokenizer = load_tokenizer(str(llama_dir))
    ids = prompt if isinstance(prompt, list) else tokenizer.encode(prompt)
    body = _complete(server, prompt=prompt, max_tokens=2, echo=True, logprobs=0,
                     truncate_prompt_tokens=3)  # fmt: skip
    choice = body["choices"][0]
    plain = _complete(server, prompt=ids[-3:], max_tokens=2)["choices"][0]["text"]
    assert choice["text"] == tokenizer.decode(ids[-3:]) + plain
    assert body["usage"]["prompt_tokens"] == 3
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]


def _stream(server: ServerHandle, **body: Any) -> list[dict[str, Any]]:
    body = {"model": MODEL_NAME, "temperature": 0, "stream": True, **body}
    chunks = []
    url = server.base_url + "/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


@pytest.mark.parametrize("max_tokens", [0, 6])
def test_streamed_echo_starts_with_the_prompt(server: ServerHandle, max_tokens: int) -> None:
    whole = _complete(server, prompt=PROMPT_IDS, max_tokens=max_tokens, echo=True, logprobs=1)
    chunks = _stream(server, prompt=PROMPT_IDS, max_tokens=max_tokens, echo=True, logprobs=1)
    choices = [c["choices"][0] for c in chunks]
    whole_choice = whole["choices"][0]
    assert "".join(c["text"] for c in choices) == whole_choice["text"]
    first = choices[0]["logprobs"]
    assert len(first["tokens"]) >= len(PROMPT_IDS) and first["token_logprobs"][0] is None
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == whole_choice["logprobs"]["tokens"]
    assert choices[-1]["finish_reason"] == "length"


def test_prompt_logprobs_field_as_vllm_returns_it(server: ServerHandle, llama_dir: Path) -> None:
    body = _complete(server, prompt=PROMPT_IDS, max_tokens=2, prompt_logprobs=2)
    scores = body["choices"][0]["prompt_logprobs"]
    assert body["choices"][0]["logprobs"] is None
    assert len(scores) == len(PROMPT_IDS) and scores[0] is None
    reference = hf_logprobs(llama_dir, PROMPT_IDS)
    for i in range(1, len(PROMPT_IDS)):
        entry = {int(t): v for t, v in scores[i].items()}
        token = PROMPT_IDS[i]
        assert entry[token]["logprob"] == pytest.approx(reference[i - 1, token].item(), abs=1e-4)
        top = reference[i - 1].topk(2).indices.tolist()
        assert set(entry) == {token, *top}
        assert {entry[t]["rank"] for t in top} == {1, 2}
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())
    chat = {
        "model": MODEL_NAME, "temperature": 0, "max_tokens": 2, "prompt_logprobs": 0,
        "messages": [{"role": "user", "content": "Hello there"}],
    }  # fmt: skip
    response = httpx.post(server.base_url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert response["prompt_logprobs"][0] is None
    assert len(response["prompt_logprobs"]) == response["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in response["prompt_logprobs"][1:])


def _lm_eval_loglikelihood(
    server: ServerHandle, requests: list[tuple[list[int], list[int]]]
) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's local-completions loglikelihood (lm_eval/models/
    openai_completions.py and api_models.py): one batched request of context + continuation
    ids, parsed from each choice's echoed `logprobs`."""
    inputs = [context + continuation for context, continuation in requests]
    ctxlens = [len(context) for context, _ in requests]
    payload = {
        "model": MODEL_NAME, "prompt": inputs, "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True,
    }  # fmt: skip
    response = httpx.post(server.base_url + "/v1/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    results = []
    for choice, ctxlen in zip(
        sorted(response.json()["choices"], key=itemgetter("index")), ctxlens, strict=True
    ):
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = True
        for tok, top in zip(tokens_logprobs, top_logprobs, strict=True):
            if tok != max(top.values()):
                is_greedy = False
                break
        results.append((logprobs, is_greedy))
    return results


def test_lm_eval_loglikelihood_equals_transformers(server: ServerHandle, llama_dir: Path) -> None:
    context = list(range(30, 60))
    greedy = []  # the model's own greedy continuation of the context: is_greedy must hold
    for _ in range(4):
        greedy.append(int(hf_logprobs(llama_dir, context + greedy)[-1].argmax()))
    requests = [
        (context, [70, 71, 72]),
        (context, greedy),
        (context[:10], [100]),
        ([7, 8, 9] * 9, [10, 11]),  # repeats a prefix the others left cached
    ]
    results = _lm_eval_loglikelihood(server, requests)
    for (ctx, cont), (logprob, is_greedy) in zip(requests, results, strict=True):
        rows = hf_logprobs(llama_dir, ctx + cont)
        positions = range(len(ctx), len(ctx) + len(cont))
        expected = sum(rows[i - 1, (ctx + cont)[i]].item() for i in positions)
        assert logprob == pytest.approx(expected, abs=1e-3)
        chosen = torch.tensor([(ctx + cont)[i] for i in positions])
        assert is_greedy == bool((rows[[i - 1 for i in positions]].argmax(-1) == chosen).all())
    assert results[1][1] and not results[0][1]


def test_a_response_of_more_logprobs_than_allowed_is_a_400_and_a_stream_is_not_bound(
    server: ServerHandle,
) -> None:
    """Five echoed choices of a 200-token prompt with 20 alternatives: 5 x 199 x 21 entries,
    more than the server's --max-response-logprobs; the request is aborted, the server goes on.
    Streamed, the same request is answered (a stream holds no logprobs)."""
    body = {"model": MODEL_NAME, "prompt": list(range(10, 210)), "max_tokens": 2, "n": 5,
            "echo": True, "logprobs": 20, "temperature": 0}  # fmt: skip
    assert MAX_RESPONSE_LOGPROBS < 5 * 199 * 21
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logprobs" and "--max-response-logprobs" in error["message"]
    streamed = 0
    with httpx.stream("POST", server.base_url + "/v1/completions",
                      json={**body, "stream": True}, timeout=60) as reply:  # fmt: skip
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    streamed += len(choice["logprobs"]["tokens"])
    assert streamed == 5 * (200 + 2)
    assert _complete(server, prompt=PROMPT_IDS, max_tokens=3, logprobs=2)["choices"]
