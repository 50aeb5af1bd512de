"""The tool-parser interface, its registry, and streaming built on a parser's start/end tags."""

from __future__ import annotations

import importlib
import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class FunctionTool:
    """One function the client offers: its name and its arguments' JSON schema."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: OpenAI's `{"id", "type": "function", "function": {...}}`."""

    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as the API returns it (with `index` in a streamed delta)."""
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output split into its text content and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


class ToolParser(ABC):
    """A model family's tool-call markup: each call sits between `start_tag` and `end_tag`."""

    start_tag: str
    end_tag: str

    @abstractmethod
    def parse_call(self, body: str) -> ToolCall | None:
        """The call written between the tags, or None if it is not a well-formed call."""

    @abstractmethod
    def constraint(self, tools: list[FunctionTool], parallel: bool) -> StructuredOutputsParams:
        """A grammar forcing one call (`parallel`: or more) of one of `tools`, in this markup."""

    def stream(self) -> ToolStream:
        """A parser of one output as it streams."""
        return ToolStream(self)

    def parse(self, text: str) -> ParsedOutput:
        """Split a finished output into content and tool calls."""
        stream = self.stream()
        events = [*stream.feed(text), *stream.finish()]
        content = "".join(e for e in events if isinstance(e, str)).strip()
        calls = [e for e in events if isinstance(e, ToolCall)]
        return ParsedOutput(content or (None if calls else ""), calls)


class ToolStream:
    """Parses an output as it is generated: text outside calls goes out at once (except what
    could begin a start tag); each call goes out whole once its end tag arrives.

    Inside a call, each piece is searched for the end tag with only the few characters before
    it, and the call's text is kept as pieces joined once: rescanning (and copying) the whole
    call at every token made a long call quadratic (32,000 tokens: 2.2 s of the event loop).
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        # Outside a call: text that may begin a start tag. Inside: the call's text not yet in
        # `_call_parts`, shorter than the end tag unless just fed.
        self._buffer = ""
        self._call_parts: list[str] = []
        self._in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        """Events (content text or a finished call) that `text` completes."""
        self._buffer += text
        events: list[str | ToolCall] = []
        start, end = self.parser.start_tag, self.parser.end_tag
        while True:
            if not self._in_call:
                index = self._buffer.find(start)
                if index < 0:
                    keep = partial_suffix(self._buffer, start)
                    events.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                events.append(self._buffer[:index])
                self._buffer, self._in_call = self._buffer[index + len(start) :], True
            else:
                index = self._buffer.find(end)
                if index < 0:
                    # Keep only what may begin the end tag; the rest is the call's for good.
                    cut = max(0, len(self._buffer) - len(end) + 1)
                    self._call_parts.append(self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    break
                events.append(self._call(self._call_text(self._buffer[:index])))
                self._buffer, self._in_call = self._buffer[index + len(end) :], False
        return [e for e in events if self._keeps(e)]

    def _call_text(self, last: str) -> str:
        """The open call's text, ending with `last`; the call's pieces are then let go."""
        text = "".join([*self._call_parts, last])
        self._call_parts.clear()
        return text

    def _keeps(self, event: str | ToolCall) -> bool:
        # Whitespace between calls is the markup's, not content.
        return not isinstance(event, str) or bool(event.strip() if self.num_calls else event)

    def finish(self) -> list[str | ToolCall]:
        """Flush at the end of the output: an unclosed call counts if it is well formed."""
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return [rest] if self._keeps(rest) and rest else []
        self._in_call = False
        event = self._call(self._call_text(rest), closed=False)
        return [event] if event else []

    def _call(self, body: str, closed: bool = True) -> str | ToolCall:
        """The call written between the tags; if it is none, the model's text as written (the
        end tag only if `closed`: an output cut short may end inside a call, or its end tag)."""
        call = self.parser.parse_call(body)
        if call is None:  # not a call after all: keep the model's text
            return self.parser.start_tag + body + (self.parser.end_tag if closed else "")
        self.num_calls += 1
        return call


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


DEFAULT_TOOL_PARSER = "hermes"
_REGISTRY: dict[str, str] = {
    "hermes": "tokenmill.entrypoints.tool_parsers.hermes",
    "llama3_json": "tokenmill.entrypoints.tool_parsers.llama3_json",
}
_CLASSES: dict[str, type[ToolParser]] = {}


def register(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: make a parser available as `name`."""

    def wrap(cls: type[ToolParser]) -> type[ToolParser]:
        _CLASSES[name] = cls
        return cls

    return wrap


def tool_parser_names() -> list[str]:
    """Names `get_tool_parser` accepts."""
    return sorted({*_REGISTRY, *_CLASSES})


def get_tool_parser(name: str) -> ToolParser:
    """A parser by registered name (its module is imported on first use)."""
    if name not in _CLASSES and name in _REGISTRY:
        importlib.import_module(_REGISTRY[name])
    if name not in _CLASSES:
        raise ValueError(
            f"tool parser must be one of {', '.join(tool_parser_names())}, got {name!r}"
        )
    return _CLASSES[name]()


def calls_constraint(
    tools: list[FunctionTool],
    begin: Callable[[FunctionTool], str],
    end: str,
    separator: str,
    parallel: bool,
) -> StructuredOutputsParams:
    """A structural-tag grammar of one call (`parallel`: one or more, `separator` between) of
    one of `tools`, each `begin(tool)`, then its arguments as JSON of the tool's schema, then
    `end`. Whitespace inside the arguments is bounded so that any model ends its call."""
    tags = [
        {
            "type": "tag",
            "begin": begin(t),
            "content": {
                "type": "json_schema",
                "json_schema": t.parameters,
                "max_whitespace_cnt": 1,
            },
            "end": end,
        }
        for t in tools
    ]
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": separator,
            "at_least_one": True,
            "stop_after_first": not parallel,
        },
    }
    return StructuredOutputsParams(structural_tag=tag)


def tool_call_of(value: Any) -> ToolCall | None:
    """A call written as a JSON object `{"name": ..., "arguments" (or "parameters"): ...}`, or
    None if `value` is not one (or holds text no response can encode)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    try:
        call = ToolCall(value["name"], arguments_text(arguments))
        # An escaped lone surrogate (`"\ud800"`) parses to text no response can encode.
        (call.name + call.arguments).encode("utf-8")
    except (RecursionError, UnicodeEncodeError):
        return None
    return call


def arguments_text(arguments: Any) -> str:
    """Arguments as JSON text (a model may write them as an object or as a JSON string)."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)
