"""The OpenAI-compatible HTTP schema (pydantic), and its translation into SamplingParams."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from tokenmill.entrypoints.constraints import (
    ResponseFormat,
    StructuredOutputsBody,
    ToolChoice,
    ToolDefinition,
    response_constraint,
    tool_constraint,
)
from tokenmill.entrypoints.tool_parsers import ToolParser, get_tool_parser
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

# The tool-call markup the server parses and enforces (Hermes / Qwen `<tool_call>`).
TOOL_PARSER = "hermes"


class StreamOptions(BaseModel):
    """`stream_options` of a streamed request."""

    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields common to completions and chat completions (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-compatible extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None  # vLLM's extension

    def _constraint(self) -> StructuredOutputsParams | None:
        return response_constraint(self.response_format, self.structured_outputs)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported, got a non-empty map")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true, got stream=false")
        values: dict[str, Any] = {
            "n": self.n,
            "seed": self.seed,
            "stop": self.stop or [],
            "stop_token_ids": self.stop_token_ids or [],
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "structured_outputs": self._constraint(),
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        values.update({k: v for k, v in optional.items() if v is not None})
        return SamplingParams(**values)

    @property
    def include_usage(self) -> bool:
        """Whether the stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`."""

    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty, got []")
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        """The request as SamplingParams; raises ValueError for unsupported fields."""
        if self.echo:
            raise ValueError("echo is not supported, got true")
        if self.suffix:
            raise ValueError("suffix is not supported, got a non-empty string")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}), got {self.best_of}")
        return self._sampling_params(self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    """One chat message; content may be text or a list of text parts."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: text content only."""
        content = self.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text":
                    raise ValueError(
                        f"only text content parts are supported, got {part.get('type')!r}"
                    )
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call as chat templates expect it: arguments as an object, not JSON text."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("messages: a tool call needs function.name, got " + repr(call)[:200])
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise ValueError(
                f"messages: tool call arguments must be JSON, got {arguments[:200]!r}"
            ) from None
    return {**call, "function": {**function, "arguments": arguments}}


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def tool_parser(self) -> ToolParser | None:
        """The parser of tool calls in the output (None: the output is plain content)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return get_tool_parser(TOOL_PARSER)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's shape)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def _constraint(self) -> StructuredOutputsParams | None:
        response = super()._constraint()
        parser = self.tool_parser
        tools = None
        if parser is not None:
            tools = tool_constraint(self.tools, self.tool_choice, self.parallel_tool_calls, parser)
        elif self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice requires tools, got none")
        if response is not None and tools is not None:
            raise ValueError(
                "tool_choice required or a named function cannot be combined with "
                "response_format or structured_outputs"
            )
        return tools or response

    def sampling_params(self) -> SamplingParams:
        """The request as SamplingParams; raises ValueError for unsupported fields."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true, got logprobs=false")
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: a prompt or a chat."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]
