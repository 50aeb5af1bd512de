"""Builds OpenAI-shaped response bodies and stream chunks from accumulated engine outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.entrypoints.engine_client import ChoiceOutput
from tokenmill.entrypoints.tool_parsers import ToolCall, ToolParser, ToolStream
from tokenmill.ipc.messages import ClientOutput


@dataclass
class ChoiceState:
    """Everything one choice has produced so far."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[list[tuple[int, str, float, int]]] | None = None
    finish_reason: str | None = None


@dataclass
class ResponseState:
    """Accumulates the choices of one HTTP request (prompts x n), and its usage."""

    request_id: str
    model: str
    n: int
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:N"
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)

    def index(self, item: ChoiceOutput) -> int:
        """OpenAI's choice index: prompt-major, then sample."""
        return item.prompt_index * self.n + item.choice

    def add(self, item: ChoiceOutput) -> ChoiceState:
        out: ClientOutput = item.output
        state = self.choices.setdefault(self.index(item), ChoiceState())
        state.text += out.text
        state.num_tokens += len(out.token_ids)
        if out.logprobs is not None:
            state.logprobs = (state.logprobs or []) + out.logprobs
        if out.finish_reason is not None:
            state.finish_reason = out.finish_reason
        self.prompt_tokens[item.prompt_index] = out.num_prompt_tokens
        self.cached_tokens[item.prompt_index] = out.num_cached_tokens
        return state

    def usage(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(c.num_tokens for c in self.choices.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }

    def sorted_choices(self) -> list[tuple[int, ChoiceState]]:
        return sorted(self.choices.items())


def _named(
    entries: list[list[tuple[int, str, float, int]]], tokens_as_ids: bool
) -> list[list[tuple[int, str, float, int]]]:
    """Entries whose token text is `"token_id:N"` when the client asked for ids (text can be
    ambiguous: several tokens may decode to the same string, or to part of a character)."""
    if not tokens_as_ids:
        return entries
    return [[(i, f"token_id:{i}", lp, rank) for i, _, lp, rank in entry] for entry in entries]


def completion_logprobs(
    entries: list[list[tuple[int, str, float, int]]] | None, top_n: int, tokens_as_ids: bool = False
) -> dict[str, Any] | None:
    """The legacy completions `logprobs` object."""
    if entries is None:
        return None
    entries = _named(entries, tokens_as_ids)
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for entry in entries:
        _, text, logprob, _ = entry[0]
        tokens.append(text)
        token_logprobs.append(logprob)
        top.append({t: lp for _, t, lp, rank in entry if rank <= top_n} or {text: logprob})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(
    entries: list[list[tuple[int, str, float, int]]] | None, top_n: int, tokens_as_ids: bool = False
) -> dict[str, Any] | None:
    """The chat completions `logprobs` object."""
    if entries is None:
        return None
    entries = _named(entries, tokens_as_ids)

    def item(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for entry in entries:
        _, text, logprob, _ = entry[0]
        alternatives = sorted((rank, t, lp) for _, t, lp, rank in entry if rank <= top_n)
        content.append(
            {**item(text, logprob), "top_logprobs": [item(t, lp) for _, t, lp in alternatives]}
        )
    return {"content": content}


def _envelope(state: ResponseState, kind: str) -> dict[str, Any]:
    """The fields every response body and chunk starts with."""
    return {"id": state.request_id, "object": kind, "created": state.created, "model": state.model}


def completion_body(state: ResponseState, top_n: int) -> dict[str, Any]:
    """The non-streamed `text_completion` body."""
    return {
        **_envelope(state, "text_completion"),
        "choices": [
            {
                "index": i,
                "text": c.text,
                "logprobs": completion_logprobs(c.logprobs, top_n, state.tokens_as_ids),
                "finish_reason": c.finish_reason,
            }
            for i, c in state.sorted_choices()
        ],
        "usage": state.usage(),
    }


def chat_body(
    state: ResponseState, top_n: int, tool_parser: ToolParser | None = None
) -> dict[str, Any]:
    """The non-streamed `chat.completion` body; `tool_parser` finds tool calls in the text."""
    choices = []
    for i, c in state.sorted_choices():
        message, finish_reason = assistant_message(c.text, c.finish_reason, tool_parser)
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(c.logprobs, top_n, state.tokens_as_ids),
                "finish_reason": finish_reason,
            }
        )
    return {**_envelope(state, "chat.completion"), "choices": choices, "usage": state.usage()}


def assistant_message(
    text: str, finish_reason: str | None, tool_parser: ToolParser | None
) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice, and its finish reason ("tool_calls" when
    the model stopped after calling tools)."""
    if tool_parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    parsed = tool_parser.parse(text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
    return message, _with_tool_calls(finish_reason, bool(parsed.tool_calls))


def _with_tool_calls(finish_reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def tool_chunks(
    state: ResponseState, index: int, stream: ToolStream, out: ClientOutput, top_n: int
) -> list[dict[str, Any]]:
    """Streamed chunks of choice `index` when tools are offered: content as it comes, each
    tool call whole once its markup closes; the last one carries the finish reason."""
    events = stream.feed(out.text)
    if out.finish_reason is not None:
        events += stream.finish()
    first_call = stream.num_calls - sum(isinstance(e, ToolCall) for e in events)
    deltas: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, ToolCall):
            deltas.append({"tool_calls": [event.to_openai(index=first_call)]})
            first_call += 1
        else:
            deltas.append({"content": event})
    if not deltas and (out.finish_reason is not None or out.logprobs):
        deltas.append({})
    chunks = [chat_chunk(state, index, delta, None, top_n) for delta in deltas]
    if chunks:  # logprobs and the finish reason go with the step's last chunk
        last = chat_chunk(state, index, deltas[-1], out, top_n)
        finish = last["choices"][0]["finish_reason"]
        last["choices"][0]["finish_reason"] = _with_tool_calls(finish, stream.num_calls > 0)
        chunks[-1] = last
    return chunks


def completion_chunk(
    state: ResponseState, index: int, out: ClientOutput, top_n: int
) -> dict[str, Any]:
    """One streamed `text_completion` chunk for choice `index`."""
    return {
        **_envelope(state, "text_completion"),
        "choices": [
            {
                "index": index,
                "text": out.text,
                "logprobs": completion_logprobs(out.logprobs, top_n, state.tokens_as_ids),
                "finish_reason": out.finish_reason,
            }
        ],
    }


def chat_chunk(
    state: ResponseState, index: int, delta: dict[str, Any], out: ClientOutput | None, top_n: int
) -> dict[str, Any]:
    """One streamed `chat.completion.chunk` for choice `index` (`out` None: role only)."""
    return {
        **_envelope(state, "chat.completion.chunk"),
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": (
                    chat_logprobs(out.logprobs, top_n, state.tokens_as_ids)
                    if out is not None
                    else None
                ),
                "finish_reason": out.finish_reason if out is not None else None,
            }
        ],
    }


def usage_chunk(state: ResponseState, chat: bool) -> dict[str, Any]:
    """The final streamed chunk carrying only `usage` (stream_options.include_usage)."""
    return {
        **_envelope(state, "chat.completion.chunk" if chat else "text_completion"),
        "choices": [],
        "usage": state.usage(),
    }
