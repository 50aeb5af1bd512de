"""Hermes / Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

import json

from tokenmill.entrypoints.tool_parsers.base import (
    FunctionTool,
    ToolCall,
    ToolParser,
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
        except (json.JSONDecodeError, RecursionError):  # the model's text, however deep
            return None

    def constraint(self, tools: list[FunctionTool], parallel: bool) -> StructuredOutputsParams:
        # Exactly the text the chat templates write, with compact JSON arguments: whitespace is
        # bounded so that any model ends its call.
        tags = [
            {
                "type": "tag",
                "begin": f'{self.start_tag}\n{{"name": {json.dumps(t.name)}, "arguments": ',
                "content": {
                    "type": "json_schema",
                    "json_schema": t.parameters,
                    "max_whitespace_cnt": 1,
                },
                "end": f"}}\n{self.end_tag}",
            }
            for t in tools
        ]
        tag = {
            "type": "structural_tag",
            "format": {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": "\n",
                "at_least_one": True,
                "stop_after_first": not parallel,
            },
        }
        return StructuredOutputsParams(structural_tag=tag)
