"""Hermes / Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

import json

from tokenmill.entrypoints.tool_parsers.base import (
    FunctionTool,
    ToolCall,
    ToolParser,
    calls_constraint,
    register,
    tool_call_of,
)
from tokenmill.sampling_params import StructuredOutputsParams


@register("hermes")
class HermesToolParser(ToolParser):
    """The markup of Hermes, Qwen2.5 and Qwen3 chat templates (and many fine-tunes of them)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_call(self, body: str) -> ToolCall | None:
        try:
            return tool_call_of(json.loads(body))
        # The model's text, however deep (RecursionError) or long its numbers (ValueError:
        # over Python's 4,300 digits of an integer; JSONDecodeError is one too).
        except (ValueError, RecursionError):
            return None

    def constraint(self, tools: list[FunctionTool], parallel: bool) -> StructuredOutputsParams:
        # Exactly the text the chat templates write, with compact JSON arguments.
        def begin(tool: FunctionTool) -> str:
            return f'{self.start_tag}\n{{"name": {json.dumps(tool.name)}, "arguments": '

        return calls_constraint(tools, begin, f"}}\n{self.end_tag}", "\n", parallel)
