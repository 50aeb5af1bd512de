"""The OpenAI-compatible HTTP schema (pydantic), and its translation into SamplingParams.

Validation happens here, at the edge, with strict types (no `true` or `1.0` as a token id, no
`"yes"` as a bool) and the ranges `SamplingParams` and the engine accept, so that the OpenAPI
schema documents them and every violation is a 400 naming its field. Limits that depend on the
served model and the server's flags (vocabulary, context length, `--max-n`, ...) are applied by
`request_models`, which builds the request classes one server uses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    Discriminator,
    Field,
    Tag,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tokenmill.entrypoints.constraints import (
    ResponseFormat,
    StructuredOutputsBody,
    ToolChoice,
    ToolDefinition,
    naming,
    response_constraint,
    tool_constraint,
)
from tokenmill.entrypoints.schema_types import (
    MAX_INT64,
    ImagePart,
    StrictModel,
    Text,
    TextPart,
    TokenId,
    count_type,
    text_type,
    token_id_key_type,
)
from tokenmill.entrypoints.tool_parsers import DEFAULT_TOOL_PARSER, ToolParser, get_tool_parser
from tokenmill.sampling_params import (
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STRUCTURED_DEPTH,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SamplingDefaults,
    SamplingParams,
    StructuredOutputsParams,
    json_depth,
)
from tokenmill.tokenization.chat_options import ChatTemplateOptions

MAX_SEED = 2**64 - 1  # seeds are unsigned 64-bit (torch.Generator.manual_seed's range)
MAX_FEEDBACK_COMMENT_CHARS = 10_000
# Messages and content parts of one chat, where a server's RequestLimits do not say (the
# server's default is its max_model_len).
DEFAULT_MAX_CHAT_MESSAGES = 2048
M = TypeVar("M", bound=BaseModel)


class _Strict(StrictModel):
    """Base of every request model: `limits` is set on the classes `request_models` derives;
    checks that span fields use it."""

    limits: ClassVar[RequestLimits | None] = None


def limit_error(param: str, message: str) -> PydanticCustomError:
    """A validation error of a whole request that names the field to blame (`ctx.param`)."""
    return PydanticCustomError("limit", message, {"param": param})


class StreamOptions(_Strict):
    """`stream_options` of a streamed request."""

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


# A union is told apart by the shape of its input (callable discriminators), so an error names
# the member the client meant: `[1, 2, true]` is a bad token-id list, not "not a string".
_UNION_TAGS = frozenset({"str", "list[str]", "list[int]", "list[list[int]]", "list[part]"})


def _text_or_list(value: Any) -> str:
    return "list[str]" if isinstance(value, list) else "str"


def _stop_type(text: Any, max_stop: int | None = None) -> Any:
    """The `stop` field's type: one string or a list of them."""
    return Annotated[
        Annotated[text, Tag("str")]
        | Annotated[list[text], Field(max_length=max_stop), Tag("list[str]")],
        Discriminator(_text_or_list),
    ]


def _prompt_shape(value: Any) -> str:
    if not isinstance(value, list):
        return "str"
    first = value[0] if value else 0
    if isinstance(first, str):
        return "list[str]"
    if isinstance(first, list):
        return "list[list[int]]"
    return "list[int]"


def _prompt_type(text: Any = Text, ids: Any = list[TokenId], max_prompts: int | None = None) -> Any:
    """The `prompt` field's type: text, texts, token ids, or lists of token ids."""
    return Annotated[
        Annotated[text, Tag("str")]
        | Annotated[list[text], Field(min_length=1, max_length=max_prompts), Tag("list[str]")]
        | Annotated[ids, Tag("list[int]")]
        | Annotated[list[ids], Field(min_length=1, max_length=max_prompts), Tag("list[list[int]]")],
        Discriminator(_prompt_shape),
    ]


def _logit_bias_type(key: Any) -> Any:
    """OpenAI's `logit_bias`: token id keys to biases in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]."""
    value = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
    return Annotated[dict[key, value] | None, Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]


class _SamplingRequest(_Strict):
    """Fields common to completions and chat completions (OpenAI's, then vLLM's extensions)."""

    model: Text | None = None
    n: count_type(ge=1) = 1  # type: ignore[valid-type]
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: count_type(ge=0, le=MAX_SEED) | None = None  # type: ignore[valid-type]
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stop: _stop_type(Text) | None = None  # type: ignore[valid-type]
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # Token ids (as JSON keys: strings of digits) to numbers added to their logits.
    logit_bias: _logit_bias_type(token_id_key_type()) = None  # type: ignore[valid-type]
    # vLLM-compatible extensions
    top_k: count_type(ge=-1, le=MAX_INT64) | None = None  # type: ignore[valid-type]
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(
        None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    min_tokens: count_type(ge=0) = 0  # type: ignore[valid-type]
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    truncate_prompt_tokens: count_type(ge=1) | None = None  # type: ignore[valid-type]
    bad_words: (
        Annotated[list[text_type(min_length=1, max_length=MAX_BAD_WORD_CHARS)],
                  Field(max_length=MAX_BAD_WORDS)]
        | None
    ) = None  # fmt: skip
    cache_salt: text_type(min_length=1, max_length=MAX_CACHE_SALT_CHARS) | None = None  # type: ignore[valid-type]
    priority: Annotated[int, Field(ge=-MAX_INT64, le=MAX_INT64)] = 0  # lower runs first
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None  # vLLM's extension
    # vLLM's older names of structured_outputs' json, regex, choice and grammar (still read
    # there): a client moving over with them got unconstrained text.
    guided_json: Text | dict[str, Any] | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N" (evals need ids)
    # vLLM's extension: each prompt token's logprob and this many alternatives (not streamed).
    prompt_logprobs: count_type(ge=0, le=MAX_LOGPROBS) | None = None  # type: ignore[valid-type]

    def _constraint(self) -> StructuredOutputsParams | None:
        guided = {
            kind: value
            for kind in ("json", "regex", "choice", "grammar")
            if (value := getattr(self, f"guided_{kind}")) is not None
        }
        if not guided:
            return response_constraint(self.response_format, self.structured_outputs)
        # A `guided_*` field is structured_outputs' field of its kind, its errors named by it.
        given = [f"guided_{kind}" for kind in guided]
        given += ["structured_outputs"] * (self.structured_outputs is not None)
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise ValueError(f"{given[0]}: give one constraint, got {', '.join(given)}")
        body = StructuredOutputsBody.model_validate(guided)
        return naming(given[0], lambda: response_constraint(self.response_format, body))

    def _check_supported(self) -> None:
        """Refuse a combination of fields that the schema cannot express."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true, got stream=false")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError(
                "prompt_logprobs is not available when stream is true (as in vLLM), "
                f"got {self.prompt_logprobs}"
            )

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: SamplingDefaults,
        fallback_max_tokens: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The request's settings; those it leaves unset (None) come from `defaults` (the
        model's), then SamplingParams' own (max_tokens: `fallback_max_tokens`).
        `prompt_logprobs`: what the engine computes, if not the request's own."""
        self._check_supported()
        given: dict[str, Any] = {
            "n": self.n,
            "seed": self.seed,
            "stop": self.stop or [],
            "stop_token_ids": self.stop_token_ids or [],
            "logit_bias": {int(t): v for t, v in (self.logit_bias or {}).items()} or None,
            "allowed_token_ids": self.allowed_token_ids,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "bad_words": self.bad_words or [],
            "cache_salt": self.cache_salt,
            "priority": self.priority,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "structured_outputs": self._constraint(),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        return defaults.sampling_params(given, {"max_tokens": fallback_max_tokens})

    @model_validator(mode="after")
    def _within_limits(self) -> Self:
        limits = type(self).limits
        if limits is None:
            return self
        sequences = self.n * self.num_prompts
        if sequences > limits.max_n:
            raise limit_error(
                "n",
                f"n x prompts is {self.n} x {self.num_prompts} = {sequences} sequences, more than "
                f"the {limits.max_n} one request may start (--max-n)",
            )
        if isinstance(self, ChatCompletionRequest):
            _check_chat_size(self.messages, limits, self.tools, self.chat_template_kwargs)
        return self

    @property
    def include_usage(self) -> bool:
        """Whether the stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    @property
    def num_prompts(self) -> int:
        """How many prompts the request holds (each gets `n` sequences)."""
        return 1


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`."""

    prompt: _prompt_type(ids=Annotated[list[TokenId], Field(min_length=1)])  # type: ignore[valid-type]
    # 0 only with echo: the prompt alone comes back (as in vLLM).
    max_tokens: count_type(ge=0) | None = 16  # type: ignore[valid-type]
    logprobs: count_type(ge=0, le=MAX_LOGPROBS) | None = None  # type: ignore[valid-type]
    echo: bool = False  # each choice's text (and logprobs) starts with the prompt's
    best_of: count_type(ge=1) | None = None  # type: ignore[valid-type]
    suffix: Text | None = Field(None, json_schema_extra={"maxLength": 0})  # refused unless empty

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def num_prompts(self) -> int:
        return len(self.prompts())

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: each choice is its prompt, nothing is generated."""
        return self.echo and self.max_tokens == 0

    @property
    def echoed_logprobs(self) -> int | None:
        """The alternatives each echoed prompt token reports (None: no prompt logprobs in the
        choices' `logprobs`)."""
        return self.logprobs if self.echo else None

    def sampling_params(self, defaults: SamplingDefaults) -> SamplingParams:
        """The request as SamplingParams, `defaults` for the settings it leaves unset; raises
        ValueError for unsupported fields. With echo and logprobs the engine scores the prompt
        too (with the more alternatives of `logprobs` and `prompt_logprobs`); echo with
        max_tokens 0 generates one token, which the response leaves out."""
        if self.suffix:
            raise ValueError("suffix is not supported, got a non-empty string")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}), got {self.best_of}")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be >= 1 unless echo is true, got 0")
        if self.echo_only and self.min_tokens > 0:
            raise ValueError(
                f"min_tokens must be 0 when max_tokens is 0 (echo generates nothing), "
                f"got {self.min_tokens}"
            )
        scored = [k for k in (self.echoed_logprobs, self.prompt_logprobs) if k is not None]
        prompt_logprobs = max(scored) if scored else None
        # Without max_tokens: the model's default, else OpenAI's 16; an explicit null: the
        # model's default, else the room left in the context (as chat completions).
        if "max_tokens" not in self.model_fields_set:
            return self._sampling_params(None, self.logprobs, defaults, 16, prompt_logprobs)
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, defaults, None, prompt_logprobs)


def _content_shape(value: Any) -> str:
    return "list[part]" if isinstance(value, list) else "str"


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
Content = Annotated[
    Annotated[Text, Tag("str")] | Annotated[list[ContentPart], Tag("list[part]")],
    Discriminator(_content_shape),
]
# A text-only model's: text parts only, so its schema offers no image part.
TextContent = Annotated[
    Annotated[Text, Tag("str")] | Annotated[list[TextPart], Tag("list[part]")],
    Discriminator(_content_shape),
]


class CalledFunction(_Strict):
    """`tool_calls[].function` of an earlier assistant message."""

    name: Text
    arguments: Text = "{}"  # JSON text, as the API returned it


class MessageToolCall(_Strict):
    """One of an earlier assistant message's `tool_calls`."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def template_dict(self) -> dict[str, Any]:
        """The call as chat templates expect it: arguments as an object, not JSON text."""
        try:
            arguments = json.loads(self.function.arguments or "{}")
        except ValueError:  # not JSON, or an integer of more digits than Python reads (4,300)
            raise ValueError(
                f"messages: tool call arguments must be JSON, got {self.function.arguments[:200]!r}"
            ) from None
        call = self.model_dump(exclude_none=True)
        return {**call, "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(_Strict):
    """One chat message; content may be text or a list of text and image parts."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Content | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: the call it answers

    def text(self) -> str:
        """The content's text as one string (image parts left out)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content or ""

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(
            isinstance(p, ImagePart) for p in self.content
        )

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: text content (or, with images, the list
        of text and `image_url` parts, which the tokenizer worker turns into images), tool
        calls with their arguments as objects."""
        content: Any = self.text()
        if self.has_images():
            assert isinstance(self.content, list)
            content = [p.model_dump(exclude_none=True) for p in self.content]
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class _ChatTemplateFields(_Strict):
    """vLLM's chat fields: how the model's template renders the conversation."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # More variables for the template, e.g. Qwen3's {"enable_thinking": false}.
    chat_template_kwargs: dict[Text, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _few_enough_messages(cls, data: Any) -> Any:
        """Counted before the messages are validated: that, for hundreds of thousands of
        messages or parts, took seconds of the event loop."""
        limits = cls.limits
        if limits is not None and isinstance(data, dict):
            _check_chat_items(data.get("messages"), limits)
        return data

    def chat_options(self) -> ChatTemplateOptions:
        """The fields as the tokenizer takes them; ValueError for a combination it refuses."""
        return ChatTemplateOptions(
            self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs
        )


class ChatCompletionRequest(_ChatTemplateFields, _SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: count_type(ge=1) | None = None  # type: ignore[valid-type]
    max_completion_tokens: count_type(ge=1) | None = None  # type: ignore[valid-type]
    logprobs: bool = False
    top_logprobs: count_type(ge=0, le=MAX_LOGPROBS) | None = None  # type: ignore[valid-type]
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def tool_parser(self) -> ToolParser | None:
        """The parser of tool calls in the output (None: the output is plain content)."""
        if not self.tools or self.tool_choice == "none":
            return None
        limits = type(self).limits
        return get_tool_parser(DEFAULT_TOOL_PARSER if limits is None else limits.tool_parser)

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

    def sampling_params(self, defaults: SamplingDefaults) -> SamplingParams:
        """The request as SamplingParams, `defaults` for the settings it leaves unset; raises
        ValueError for unsupported fields."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true, got logprobs=false")
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, defaults, None)


class TokenizeRequest(_ChatTemplateFields):
    """`POST /tokenize`: a prompt or a chat."""

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> Self:
        if (self.prompt is None) == (self.messages is None):
            raise limit_error("prompt", "give exactly one of prompt and messages")
        limits = type(self).limits
        if limits is not None and self.messages is not None:
            _check_chat_size(self.messages, limits, template_kwargs=self.chat_template_kwargs)
        return self


class DetokenizeRequest(_Strict):
    """`POST /detokenize`."""

    model: Text | None = None
    tokens: list[TokenId]


class FeedbackRequest(_Strict):
    """`POST /v1/feedback`: a user's rating of a finished response (its `id`)."""

    request_id: text_type(min_length=1, max_length=256)  # type: ignore[valid-type]
    rating: int = Field(ge=-1, le=1, description="-1 bad, 0 neutral, 1 good")
    comment: text_type(max_length=MAX_FEEDBACK_COMMENT_CHARS) | None = None  # type: ignore[valid-type]


@dataclass(frozen=True)
class RequestLimits:
    """What one server accepts: the model's vocabulary and context, and its flags' limits."""

    model_name: str
    vocab_size: int
    max_model_len: int
    max_prompt_bytes: int
    max_n: int
    max_stop: int
    max_stop_chars: int
    # 1 when an empty text tokenizes to no token (no BOS): the schema then refuses empty prompts.
    min_prompt_chars: int = 0
    # The model reads images: chat messages may hold image parts (else text parts only).
    images: bool = False
    tool_parser: str = DEFAULT_TOOL_PARSER  # --tool-call-parser
    # --max-chat-messages: messages and their content parts, together, in one chat.
    max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES


@dataclass(frozen=True)
class RequestModels:
    """The request classes of one server, with its limits in their fields (and its schema)."""

    completion: type[CompletionRequest]
    chat: type[ChatCompletionRequest]
    tokenize: type[TokenizeRequest]
    detokenize: type[DetokenizeRequest]


def _utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _too_many_bytes(what: str, size: int, limits: RequestLimits) -> str:
    return (
        f"{what} is {size} bytes, more than the {limits.max_prompt_bytes} this server tokenizes "
        f"(this model's maximum context length is {limits.max_model_len} tokens; "
        "--max-prompt-bytes)"
    )


def _check_chat_size(
    messages: list[ChatMessage],
    limits: RequestLimits,
    tools: list[ToolDefinition] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> None:
    """The chat template only adds text to what it renders: the messages' contents, names and
    tool calls, the tools offered (as JSON) and the template's variables, so a chat of more
    bytes than the limit cannot fit. Checked before the tokenizer worker renders and tokenizes
    it (seconds for megabytes, while the worker's other requests wait)."""
    size = sum(_message_bytes(m) for m in messages)
    _within_limit(size, "messages", "the messages' text", limits)
    # The template renders JSON (tool-call arguments, tools' parameters) recursively: a deep
    # document raised RecursionError there (HTTP 500), and in json.loads before it.
    for i, message in enumerate(messages):
        for j, call in enumerate(message.tool_calls or []):
            what = f"the arguments of tool call {j} of message {i}"
            _check_template_depth("messages", what, call.function.arguments)
    for i, tool in enumerate(tools or []):
        _check_template_depth("tools", f"the parameters of tool {i}", tool.function.parameters)
    if tools:
        rendered = [t.model_dump(exclude_none=True) for t in tools]
        size += _json_bytes(rendered)
        _within_limit(size, "tools", "the messages' text and tools", limits)
    if template_kwargs:
        param = "chat_template_kwargs"
        _check_template_depth(param, "chat_template_kwargs", template_kwargs)
        size += _json_bytes(template_kwargs)
        _within_limit(size, param, "the chat with its template's variables", limits)


def _check_chat_items(messages: Any, limits: RequestLimits) -> None:
    """A limit error naming `messages` if the chat's messages and their content parts number
    more than `limits.max_chat_messages`; anything not shaped as messages is left to the
    schema."""
    if not isinstance(messages, list):
        return
    parts = sum(
        len(m["content"])
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
    )
    if len(messages) + parts > limits.max_chat_messages:
        raise limit_error(
            "messages",
            f"the chat's messages and content parts number {len(messages) + parts} "
            f"({len(messages)} + {parts}), more than the {limits.max_chat_messages} this server "
            "renders (--max-chat-messages)",
        )


def _within_limit(size: int, param: str, what: str, limits: RequestLimits) -> None:
    """A limit error naming `param` if `size` bytes (`what`) are more than the server
    tokenizes."""
    if size > limits.max_prompt_bytes:
        raise limit_error(param, _too_many_bytes(what, size, limits))


def _json_bytes(document: Any) -> int:
    return _utf8_bytes(json.dumps(document, ensure_ascii=False))


def _check_template_depth(param: str, what: str, document: Any) -> None:
    if json_depth(document, MAX_STRUCTURED_DEPTH) > MAX_STRUCTURED_DEPTH:
        raise limit_error(
            param, f"{what} nest more than {MAX_STRUCTURED_DEPTH} levels of objects and arrays"
        )


def _message_bytes(message: ChatMessage) -> int:
    """The bytes of the text a chat template may render of `message` (images aside)."""
    texts = [message.text(), message.name or "", message.tool_call_id or ""]
    for call in message.tool_calls or []:
        texts += [call.id or "", call.function.name, call.function.arguments]
    return sum(_utf8_bytes(t) for t in texts)


def request_models(limits: RequestLimits) -> RequestModels:
    """Subclasses of the request models whose fields carry `limits` (so the schema shows them)."""
    token_id = Annotated[int, Field(ge=0, lt=limits.vocab_size)]
    ids = Annotated[list[token_id], Field(min_length=1, max_length=limits.max_model_len)]
    ids_or_none = Annotated[list[token_id], Field(max_length=limits.max_model_len)]

    def fits(text: str) -> str:
        if (size := _utf8_bytes(text)) > limits.max_prompt_bytes:
            raise PydanticCustomError("too_long", _too_many_bytes("the prompt", size, limits))
        return text

    # Characters never outnumber bytes, so the byte limit is also a character limit; the schema
    # shows it, the check (`fits`) counts bytes.
    def prompt_text(min_length: int = 0) -> Any:
        return Annotated[
            text_type(min_length=min_length),
            AfterValidator(fits),
            Field(json_schema_extra={"maxLength": limits.max_prompt_bytes}),
        ]

    stop_text = text_type(min_length=1, max_length=limits.max_stop_chars)
    context = {"ge": 1, "le": limits.max_model_len}
    # Any other name gets a 404 (as OpenAI answers), so the schema names the one served.
    model = (Text | None, Field(None, json_schema_extra={"enum": [limits.model_name, None]}))
    common: dict[str, Any] = {
        "model": model,
        "n": (count_type(ge=1, le=limits.max_n), 1),
        "stop": (_stop_type(stop_text, limits.max_stop) | None, None),
        "stop_token_ids": (
            Annotated[list[token_id], Field(max_length=limits.max_stop)] | None,
            None,
        ),
        "min_tokens": (count_type(ge=0, le=limits.max_model_len), 0),
        "logit_bias": (_logit_bias_type(token_id_key_type(limits.vocab_size)), None),
        "allowed_token_ids": (
            Annotated[list[token_id], Field(min_length=1, max_length=limits.vocab_size)] | None,
            None,
        ),
    }

    def derive(base: type[M], **fields: Any) -> type[M]:
        model = create_model(base.__name__, __base__=base, __doc__=base.__doc__, **fields)
        model.limits = limits
        return model

    message: type[ChatMessage] = ChatMessage
    if not limits.images:
        message = derive(ChatMessage, content=(TextContent | None, None))

    return RequestModels(
        completion=derive(
            CompletionRequest,
            **common,
            prompt=(_prompt_type(prompt_text(limits.min_prompt_chars), ids, limits.max_n), ...),
            max_tokens=(count_type(ge=0, le=limits.max_model_len) | None, 16),
            best_of=(count_type(ge=1, le=limits.max_n) | None, None),
        ),
        chat=derive(
            ChatCompletionRequest,
            **common,
            messages=(list[message], Field(min_length=1)),
            max_tokens=(count_type(**context) | None, None),
            max_completion_tokens=(count_type(**context) | None, None),
        ),
        tokenize=derive(
            TokenizeRequest,
            model=model,
            prompt=(prompt_text() | None, None),
            messages=(Annotated[list[message], Field(min_length=1)] | None, None),
        ),
        # No sequence the model runs is longer: 3.3 M ids took the event loop's thread 1.5 s.
        detokenize=derive(DetokenizeRequest, model=model, tokens=(ids_or_none, ...)),
    )


class ErrorInfo(BaseModel):
    """What went wrong: `param` names the request field to blame, `code` is the HTTP status."""

    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorInfo


def error_param(error: Mapping[str, Any]) -> tuple[str, str | None]:
    """A pydantic error as (message, param): the path without union tags, the top-level field."""
    if error.get("type") == "json_invalid":
        return f"the body is not valid JSON: {error.get('ctx', {}).get('error', '')}", None
    loc = [str(p) for p in error.get("loc", ()) if p not in _UNION_TAGS]
    if loc and loc[0] in ("body", "query"):
        loc = loc[1:]
    param = (error.get("ctx") or {}).get("param") or (loc[0] if loc else None)
    where = ".".join(loc) or param or "body"
    value = error.get("input")
    shown = (
        f", got {value!r}" if isinstance(value, int | float | str) and len(str(value)) < 80 else ""
    )
    return f"{where}: {error.get('msg')}{shown}", param
