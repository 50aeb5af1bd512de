"""Builds OpenAI-shaped response bodies and stream chunks from accumulated engine outputs."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tokenmill.entrypoints.engine_client import ChoiceOutput
from tokenmill.entrypoints.reasoning import ReasoningParser
from tokenmill.entrypoints.tool_parsers import ToolCall, ToolParser, ToolStream
from tokenmill.ipc.messages import ClientOutput, PromptTextLogprobs, TextLogprobs


@dataclass
class ChoiceState:
    """Everything one choice has produced so far."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[TextLogprobs] | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptTextLogprobs | None = None


@dataclass(frozen=True)
class Echo:
    """Completions' `echo`: each choice starts with its prompt's text (`texts`, by prompt) and,
    with `logprobs`, its prompt's tokens; `only`: nothing generated is returned (max_tokens
    0)."""

    texts: list[str]
    logprobs: bool
    only: bool


@dataclass
class ResponseState:
    """Accumulates the choices of one HTTP request (prompts x n), and its usage.

    `prompt_top_n`: the `prompt_logprobs` the request asked for (vLLM's extension; None: not
    asked), so many alternatives a token in the response's `prompt_logprobs`.
    """

    request_id: str
    model: str
    n: int
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:N"
    echo: Echo | None = None
    prompt_top_n: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    # Logprob entries held (each token's and each alternative's, generated and prompt ones).
    num_logprobs: int = 0

    def index(self, item: ChoiceOutput) -> int:
        """OpenAI's choice index: prompt-major, then sample."""
        return item.prompt_index * self.n + item.choice

    def add(self, item: ChoiceOutput, hold: bool = True) -> ChoiceState:
        """Count `item` into its choice (tokens, finish reason, usage); `hold`: also keep its
        text and logprobs for the body. A stream sends them in its chunks as they come and
        holds none: kept, a stream of 128 choices with 20 alternatives held every entry (~140
        bytes each, gigabytes at a long context) until it ended, past --max-response-logprobs."""
        out: ClientOutput = item.output
        state = self.choices.setdefault(self.index(item), ChoiceState())
        if out.prompt_logprobs is not None and hold:
            state.prompt_logprobs = out.prompt_logprobs
            self.num_logprobs += sum(map(len, out.prompt_logprobs.entries))
        if self.echo is None or not self.echo.only:
            state.num_tokens += len(out.token_ids)
            if hold:
                state.text += out.text
            if out.logprobs is not None and hold:
                # In place: a new list per output copied the choice's whole history each time
                # (quadratic; 32,000 tokens took 0.66 s of the event loop, one choice).
                if state.logprobs is None:
                    state.logprobs = []
                state.logprobs.extend(out.logprobs)
                self.num_logprobs += sum(map(len, out.logprobs))
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

    def take_choices(self) -> Iterator[tuple[int, ChoiceState]]:
        """The choices in index order, each removed from the state as it is yielded."""
        for index in sorted(self.choices):
            yield index, self.choices.pop(index)

    def echoed_text(self, index: int, text: str) -> str:
        """Choice `index`'s `text` after its prompt's, with echo (else as it is)."""
        return text if self.echo is None else self.echo.texts[index // self.n] + text

    def echoed_prompt(self, prompt: PromptTextLogprobs | None) -> PromptTextLogprobs | None:
        """A choice's prompt logprobs where its `logprobs` start with them (echo with
        logprobs), else None."""
        return prompt if self.echo is not None and self.echo.logprobs else None

    def prompt_logprobs(self, prompt: PromptTextLogprobs | None) -> list[Any] | None:
        """vLLM's `prompt_logprobs` field (None where the request did not ask for it)."""
        if self.prompt_top_n is None or prompt is None:
            return None
        return prompt_logprobs_json(prompt, self.prompt_top_n, self.tokens_as_ids)


def _named(entries: list[TextLogprobs], tokens_as_ids: bool) -> list[TextLogprobs]:
    """Entries whose token text is `"token_id:N"` when the client asked for ids (text can be
    ambiguous: several tokens may decode to the same string, or to part of a character)."""
    if not tokens_as_ids:
        return entries
    return [[(i, f"token_id:{i}", lp, rank) for i, _, lp, rank in entry] for entry in entries]


def completion_logprobs(
    entries: list[TextLogprobs] | None,
    top_n: int,
    tokens_as_ids: bool = False,
    prompt: PromptTextLogprobs | None = None,
) -> dict[str, Any] | None:
    """The legacy completions `logprobs` object; `prompt` (echo): the prompt's tokens first,
    the very first with a null logprob and no alternatives (as OpenAI and vLLM)."""
    if entries is None and prompt is None:
        return None
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    if prompt is not None:
        first_id, first_text = prompt.first_token
        tokens.append(f"token_id:{first_id}" if tokens_as_ids else first_text)
        token_logprobs.append(None)
        top.append(None)
        entries = prompt.entries + (entries or [])
    for entry in _named(entries or [], tokens_as_ids):
        _, text, logprob, _ = entry[0]
        tokens.append(text)
        token_logprobs.append(logprob)
        top.append(_top_by_text(entry, top_n) or {text: logprob})
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets if tokens else [],
    }


def _top_by_text(entry: TextLogprobs, top_n: int) -> dict[str, float]:
    """The `top_n` most likely tokens of an entry by text; where several decode to the same
    text (byte tokens of one character), the most likely one's logprob."""
    top: dict[str, float] = {}
    for _, text, logprob in sorted((rank, t, lp) for _, t, lp, rank in entry if rank <= top_n):
        top.setdefault(text, logprob)
    return top


def prompt_logprobs_json(
    prompt: PromptTextLogprobs, top_n: int, tokens_as_ids: bool = False
) -> list[Any]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map from
    token id to `{"logprob", "rank", "decoded_token"}`: the token itself and its `top_n` most
    likely alternatives."""
    scored = [
        {
            tid: {"logprob": lp, "rank": rank, "decoded_token": text}
            for j, (tid, text, lp, rank) in enumerate(entry)
            if j == 0 or rank <= top_n
        }
        for entry in _named(prompt.entries, tokens_as_ids)
    ]
    return [None, *scored]


def chat_logprobs(
    entries: list[TextLogprobs] | None, top_n: int, tokens_as_ids: bool = False
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
    """The non-streamed `text_completion` body. Its `choices` are a generator that takes each
    choice out of `state` as it makes its dict (`ResponseState.take_choices`), so a body with
    many logprobs is not held as dicts whole beside the state (an encoder that consumes one
    choice at a time, `api_server._json_body`, holds one choice's dicts)."""
    choices = (
        {
            "index": i,
            "text": state.echoed_text(i, c.text),
            "logprobs": completion_logprobs(
                c.logprobs, top_n, state.tokens_as_ids, state.echoed_prompt(c.prompt_logprobs)
            ),
            "finish_reason": c.finish_reason,
            **_prompt_logprobs_field(state, c.prompt_logprobs),
        }
        for i, c in state.take_choices()
    )
    # (The usage is counted here, before the generator takes the choices.)
    return {**_envelope(state, "text_completion"), "choices": choices, "usage": state.usage()}


def _prompt_logprobs_field(
    state: ResponseState, prompt: PromptTextLogprobs | None
) -> dict[str, Any]:
    """`{"prompt_logprobs": ...}` where the request asked for them, else nothing."""
    if state.prompt_top_n is None:
        return {}
    return {"prompt_logprobs": state.prompt_logprobs(prompt)}


def chat_body(
    state: ResponseState,
    top_n: int,
    tool_parser: ToolParser | None = None,
    reasoning: ReasoningParser | None = None,
) -> dict[str, Any]:
    """The non-streamed `chat.completion` body; `reasoning` splits off the text's reasoning,
    `tool_parser` finds tool calls in the rest. Its `choices` are a generator, as
    `completion_body`'s."""

    def choice(i: int, c: ChoiceState) -> dict[str, Any]:
        thought, text = reasoning.split(c.text) if reasoning is not None else (None, c.text)
        message, finish_reason = assistant_message(text or "", c.finish_reason, tool_parser)
        if reasoning is not None:
            message["reasoning_content"] = thought
            if text is None:  # all reasoning (no closing tag yet)
                message["content"] = None
        return {
            "index": i,
            "message": message,
            "logprobs": chat_logprobs(c.logprobs, top_n, state.tokens_as_ids),
            "finish_reason": finish_reason,
        }

    # vLLM's: one for the response (every choice has the same prompt).
    prompt = next((c.prompt_logprobs for _, c in state.sorted_choices()), None)
    return {
        **_envelope(state, "chat.completion"),
        "choices": (choice(i, c) for i, c in state.take_choices()),
        "usage": state.usage(),
        **_prompt_logprobs_field(state, prompt),
    }


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
    state: ResponseState, index: int, out: ClientOutput, top_n: int, first: bool = False
) -> dict[str, Any]:
    """One streamed `text_completion` chunk for choice `index`; with echo, its `first` chunk
    starts with the prompt (as vLLM's), and with max_tokens 0 that is all any chunk holds."""
    only = state.echo is not None and state.echo.only
    text, entries = ("", None) if only else (out.text, out.logprobs)
    prompt = state.echoed_prompt(out.prompt_logprobs) if first else None
    return {
        **_envelope(state, "text_completion"),
        "choices": [
            {
                "index": index,
                "text": state.echoed_text(index, text) if first else text,
                "logprobs": completion_logprobs(entries, top_n, state.tokens_as_ids, prompt),
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
