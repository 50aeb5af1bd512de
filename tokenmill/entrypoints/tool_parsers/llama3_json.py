"""Llama 3.1 / 3.2 JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`, or
several such objects separated by `;`, after an optional `<|python_tag|>` (vLLM's
`llama3_json`). An output that does not open with `{` is content; one that opens with it but
does not parse as calls is content too, whole."""

from __future__ import annotations

import json

from tokenmill.entrypoints.tool_parsers.base import (
    FunctionTool,
    ParsedOutput,
    ToolCall,
    ToolParser,
    ToolStream,
    calls_constraint,
    register,
    tool_call_of,
)
from tokenmill.sampling_params import StructuredOutputsParams

PYTHON_TAG = "<|python_tag|>"


@register("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Calls are the output itself, not tagged spans of it: parsed whole, streamed whole."""

    start_tag = PYTHON_TAG
    end_tag = ""

    def parse_call(self, body: str) -> ToolCall | None:
        calls = self.calls(body)
        return calls[0] if calls is not None and len(calls) == 1 else None

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls a whole output makes, or None if it is not calls only."""
        body = text.strip().removeprefix(PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return None
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            try:
                value, at = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):  # as hermes's: deep, or an integer too long
                return None
            call = tool_call_of(value)
            if call is None:
                return None
            calls.append(call)
            rest = body[at:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return None
            at = len(body) - len(rest) + 1
            at += len(body[at:]) - len(body[at:].lstrip())

    def parse(self, text: str) -> ParsedOutput:
        calls = self.calls(text)
        return ParsedOutput(None, calls) if calls else ParsedOutput(text.strip(), [])

    def stream(self) -> ToolStream:
        return _WholeOutputStream(self)

    def constraint(self, tools: list[FunctionTool], parallel: bool) -> StructuredOutputsParams:
        # The JSON Llama's chat template asks for, compact: `{"name": ..., "parameters": ...}`.
        def begin(tool: FunctionTool) -> str:
            return f'{{"name": {json.dumps(tool.name)}, "parameters": '

        return calls_constraint(tools, begin, "}", "; ", parallel)


class _WholeOutputStream(ToolStream):
    """Streams content as it comes unless the output opens with `{` (or the python tag): then
    it is held to the end and goes out as its calls, or as content if it is not calls."""

    def __init__(self, parser: Llama3JsonToolParser) -> None:
        super().__init__(parser)
        self._calls_parser = parser
        self._held: bool | None = None  # None: not known yet whether the output is calls

    def feed(self, text: str) -> list[str | ToolCall]:
        if self._held:
            # Held text is kept as pieces, joined once: `+=` copied the whole output at every
            # token (32,000 tokens: 1.2 s of the event loop; 128,000: 25 s).
            self._call_parts.append(text)
            return []
        self._buffer += text
        if self._held is None:
            head = self._buffer.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return []
            self._held = head.startswith("{") or head.startswith(PYTHON_TAG)
        if self._held:
            self._call_parts.append(self._buffer)
            self._buffer = ""
            return []
        out, self._buffer = self._buffer, ""
        return [out] if out else []

    def finish(self) -> list[str | ToolCall]:
        rest, self._buffer = self._call_text(self._buffer), ""  # held: all in the pieces
        calls = self._calls_parser.calls(rest) if self._held else None
        if calls:
            self.num_calls += len(calls)
            return list(calls)
        return [rest] if rest else []
