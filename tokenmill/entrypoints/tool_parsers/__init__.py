"""Tool-call parsers: turn a model's own tool-call convention into OpenAI `tool_calls`.

A parser is registered by name (`@register("hermes")`) and made by `get_tool_parser(name)`;
each knows its model family's markup, parses a whole output or a stream, and builds the
grammar that forces tool calls when `tool_choice` is "required" or names a function.
"""

from __future__ import annotations

from tokenmill.entrypoints.tool_parsers.base import (
    DEFAULT_TOOL_PARSER,
    FunctionTool,
    ParsedOutput,
    ToolCall,
    ToolParser,
    ToolStream,
    get_tool_parser,
    register,
    tool_parser_names,
)

__all__ = [
    "DEFAULT_TOOL_PARSER",
    "FunctionTool",
    "ParsedOutput",
    "ToolCall",
    "ToolParser",
    "ToolStream",
    "get_tool_parser",
    "register",
    "tool_parser_names",
]
