"""The evals' calls to an OpenAI-compatible server: streamed generations with their token ids,
logprobs and timing, and the server's own tokenization (`/tokenize`, vLLM's route)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

TOKEN_ID_PREFIX = "token_id:"


class EvalRequestError(Exception):
    """The server refused or failed a request; the message is the server's."""


# What reading an answer that is not in OpenAI's shape raises: not JSON (a proxy's HTML page),
# or JSON of another shape (another API's, a field missing or of another type).
_SHAPE_ERRORS = (ValueError, KeyError, IndexError, TypeError, AttributeError)


@contextmanager
def _answer_of(route: str) -> Iterator[None]:
    """Reads an answer of `route`: a shape error becomes an `EvalRequestError` naming it."""
    try:
        yield
    except _SHAPE_ERRORS as exc:
        why = f"{type(exc).__name__}: {exc}"[:200]
        raise EvalRequestError(f"{route}: the answer is not in OpenAI's shape ({why})") from None


@dataclass
class Generation:
    """One streamed response: text, the sampled token ids and their logprobs, timing."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each sampled token
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per position
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_ID_PREFIX):
        raise EvalRequestError(
            f"the server returned logprob token {token!r}, not 'token_id:N': it does not "
            "support return_tokens_as_token_ids"
        )
    digits = token.removeprefix(TOKEN_ID_PREFIX)
    if not (digits.isascii() and digits.isdigit()):
        raise EvalRequestError(f"the server returned logprob token {token!r}, not 'token_id:N'")
    return int(digits)


def _error_text(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


class EvalClient:
    """An `httpx.AsyncClient` for one server and model."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout)
        self.model: str | None = None

    async def __aenter__(self) -> EvalClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def model_card(self, name: str | None) -> dict[str, Any]:
        """The card of model `name` in /v1/models (default: the first); sets `self.model`."""
        response = await self.http.get("/v1/models")
        if response.status_code != 200:
            raise EvalRequestError(
                f"GET /v1/models: {response.status_code} {_error_text(response)}"
            )
        with _answer_of("GET /v1/models"):
            cards = response.json()["data"]
            card = next((c for c in cards if name is None or c["id"] == name), None)
            if card is None:
                raise EvalRequestError(f"the server serves no model {name!r}")
            self.model = str(card["id"])
        return card

    async def tokenize(
        self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None
    ) -> list[int] | None:
        """The server's token ids of a prompt or a chat (None if it has no /tokenize)."""
        body: dict[str, Any] = {"model": self.model}
        body.update({"prompt": prompt} if messages is None else {"messages": messages})
        response = await self.http.post("/tokenize", json=body)
        if response.status_code == 404 and "model" not in _error_text(response):
            return None
        if response.status_code != 200:
            raise EvalRequestError(
                f"POST /tokenize: {response.status_code} {_error_text(response)}"
            )
        with _answer_of("POST /tokenize"):
            return [int(t) for t in response.json()["tokens"]]

    async def generate(
        self,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        top_logprobs: int = 0,
        **params: Any,
    ) -> Generation:
        """Stream one completion (prompt) or chat completion (messages) with token ids."""
        chat = messages is not None
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_tokens_as_token_ids": True,
            **params,
        }
        if chat:
            body.update(messages=messages, logprobs=True, top_logprobs=top_logprobs)
        else:
            body.update(prompt=prompt, logprobs=top_logprobs)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        out = Generation()
        start = time.perf_counter()
        async with self.http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise EvalRequestError(
                    f"POST {path}: {response.status_code} {_error_text(response)}"
                )
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                with _answer_of(f"POST {path}"):
                    chunk = json.loads(line.removeprefix("data: "))
                    if "error" in chunk:
                        raise EvalRequestError(f"POST {path}: {_chunk_error(chunk)}")
                    _add_chunk(out, chunk, chat, start)
        if out.finish_reason is None:  # the server stopped mid-answer: no result to score
            raise EvalRequestError(f"POST {path}: the stream ended with no finish_reason")
        out.latency_s = time.perf_counter() - start
        return out


def _chunk_error(chunk: dict[str, Any]) -> str:
    """The message of a streamed error chunk (OpenAI's `{"error": {"message": ...}}`)."""
    error = chunk["error"]
    return str(error.get("message") if isinstance(error, dict) else error)[:500]


def _add_chunk(out: Generation, chunk: dict[str, Any], chat: bool, start: float) -> None:
    out.request_id = chunk.get("id", out.request_id)
    if chunk.get("usage"):
        out.prompt_tokens = chunk["usage"]["prompt_tokens"]
        details = chunk["usage"].get("prompt_tokens_details") or {}
        out.cached_tokens = details.get("cached_tokens")
    for choice in chunk.get("choices", []):
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        out.text += text or ""
        logprobs = choice.get("logprobs")
        if logprobs:
            if chat:
                for item in logprobs["content"]:
                    out.token_ids.append(_token_id(item["token"]))
                    out.logprobs.append(item["logprob"])
                    top = {_token_id(t["token"]): t["logprob"] for t in item["top_logprobs"]}
                    out.top_logprobs.append(top)
            else:
                out.token_ids.extend(_token_id(t) for t in logprobs["tokens"])
                out.logprobs.extend(logprobs["token_logprobs"])
                out.top_logprobs.extend(
                    {_token_id(t): lp for t, lp in top.items()} for top in logprobs["top_logprobs"]
                )
        if (text or logprobs) and out.ttft_s is None:
            out.ttft_s = time.perf_counter() - start
        if choice.get("finish_reason") is not None:
            out.finish_reason = choice["finish_reason"]
