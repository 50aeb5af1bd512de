"""The structured output and tool choice of an OpenAI request, and the constraint it runs with.

`response_format` (json_schema / json_object), vLLM's `structured_outputs` body field, and
`tools` + `tool_choice` all end as one `StructuredOutputsParams` (or none); a tool choice of
"required" or a named function is enforced by the tool parser's grammar of its own markup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import ConfigDict, Field

from tokenmill.entrypoints.schema_types import StrictModel, Text, text_type
from tokenmill.entrypoints.tool_parsers import FunctionTool, ToolParser
from tokenmill.sampling_params import STRUCTURED_KINDS, StructuredOutputsParams

# OpenAI: a-z, A-Z, 0-9, underscores and dashes, at most 64
FunctionName = text_type(pattern=r"^[a-zA-Z0-9_-]{1,64}$")


class JsonSchemaFormat(StrictModel):
    """`response_format.json_schema`: a named schema (`strict` is implied: always enforced)."""

    model_config = ConfigDict(populate_by_name=True)

    name: text_type(min_length=1, max_length=64)  # type: ignore[valid-type]
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """`response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(StrictModel):
    """vLLM's `structured_outputs` extra body field (one of these)."""

    json_: Text | dict[str, Any] | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: Text | dict[str, Any] | None = None


class FunctionDefinition(StrictModel):
    """`tools[].function`."""

    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(StrictModel):
    """One entry of `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: FunctionName


class NamedToolChoice(StrictModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def response_constraint(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputsBody | None
) -> StructuredOutputsParams | None:
    """The constraint `response_format` or `structured_outputs` asks for (at most one of them)."""
    wants_format = response_format is not None and response_format.type != "text"
    if wants_format and structured_outputs is not None:
        raise ValueError("response_format and structured_outputs cannot both constrain the output")
    if structured_outputs is not None:
        fields = structured_outputs.model_dump(by_alias=True, exclude_none=True)
        return StructuredOutputsParams(**fields)
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise ValueError("response_format.json_schema.schema is required for type json_schema")
    schema = spec.json_schema
    field = "response_format.json_schema.schema"
    return naming(field, lambda: StructuredOutputsParams(json=schema))


def naming(
    field: str, build: Callable[[], StructuredOutputsParams | None]
) -> StructuredOutputsParams | None:
    """`build()`, its errors naming `field`, the request field the client sent, instead of the
    `structured_outputs` field it became (an error's first word is its `param`)."""
    try:
        return build()
    except ValueError as exc:
        message = str(exc)
        for kind in sorted(STRUCTURED_KINDS, key=len, reverse=True):  # json_object before json
            message = message.replace(f"structured_outputs.{kind}", field, 1)
        raise ValueError(message) from None


def function_tools(tools: list[ToolDefinition] | None) -> list[FunctionTool]:
    """The offered functions; their names must be unique."""
    result = [
        FunctionTool(t.function.name, t.function.parameters or {"type": "object"})
        for t in tools or []
    ]
    names = [t.name for t in result]
    if len(set(names)) != len(names):
        raise ValueError(f"tools must have unique function names, got {names}")
    return result


def tool_constraint(
    tools: list[ToolDefinition] | None,
    tool_choice: ToolChoice | None,
    parallel: bool,
    parser: ToolParser,
) -> StructuredOutputsParams | None:
    """The grammar that enforces `tool_choice` ("required" or a named function), or None."""
    offered = function_tools(tools)
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if not offered:
        raise ValueError(f"tool_choice {_choice_text(tool_choice)} needs tools, got none")
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        chosen = [t for t in offered if t.name == name]
        if not chosen:
            raise ValueError(
                f"tool_choice names function {name!r}, which is not among the tools "
                f"({', '.join(t.name for t in offered)})"
            )
        return naming("tools", lambda: parser.constraint(chosen, parallel=False))
    return naming("tools", lambda: parser.constraint(offered, parallel))


def _choice_text(choice: ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.function.name)
