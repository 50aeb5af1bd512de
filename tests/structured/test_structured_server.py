"""Structured outputs and tool calls through the server, driven by the official openai client."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.server import MODEL_NAME, ServerHandle, run_server
from tests.structured.schemas import SCHEMAS
from tests.structured.tool_template import use_tools_template
from tokenmill.testing.checkpoints import build_checkpoint

SEEDS = range(4)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
        },
    },
}
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
JSON_OBJECT = {"type": "json_object"}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


class Point(BaseModel):
    x: int = Field(ge=-9, le=9)
    y: int = Field(ge=-9, le=9)
    label: str = Field(max_length=6)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("tools") / "model", "llama")
    use_tools_template(checkpoint)
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with run_server(checkpoint, log, "--max-model-len", "1024") as handle:
        yield handle


@pytest.fixture
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _each_seed(request: Callable[[int], Any], seeds: Sequence[int] = SEEDS) -> list[Any]:
    """`request(seed)` for every seed, sent at once (the engine batches them)."""
    with ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(request, seeds))


def _chat(client: openai.OpenAI, seed: int, **kwargs):
    args = {"model": MODEL_NAME, "messages": CHAT, "temperature": 1.0, "seed": seed}
    return client.chat.completions.create(**(args | {"max_tokens": 300} | kwargs))


def test_parse_returns_the_pydantic_model(client: openai.OpenAI) -> None:
    def parse(seed: int) -> Any:
        return client.chat.completions.parse(
            model=MODEL_NAME, messages=CHAT, response_format=Point, temperature=1.0,
            seed=seed, max_tokens=300,
        )  # fmt: skip

    # The client builds its `ParsedChatCompletion[Point]` type on first use, and pydantic's
    # generic types are not built safely from several threads at once (a thread can get the
    # type half-built: "BaseModel cannot be instantiated directly"): one request first.
    completions = [parse(SEEDS[0]), *_each_seed(parse, SEEDS[1:])]
    for completion in completions:
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Point)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_json_schema_validates(client: openai.OpenAI, stream: bool) -> None:
    schema = SCHEMAS["refs"]
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    for seed in SEEDS:
        kwargs = {"model": MODEL_NAME, "prompt": "Points:", "max_tokens": 300, "seed": seed}
        response = client.completions.create(
            **kwargs,
            temperature=1.0,
            stream=stream,
            extra_body={"response_format": response_format},
        )
        chunks = list(response) if stream else [response]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), schema)


def test_json_object_on_chat(client: openai.OpenAI) -> None:
    for response in _each_seed(
        lambda seed: _chat(client, seed, response_format=JSON_OBJECT, max_tokens=60)
    ):
        choice = response.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut by max_tokens inside the object
            assert choice.message.content.startswith("{"), choice.message.content


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_structured_outputs_field(client: openai.OpenAI, stream: bool) -> None:
    choices = ["alpha", "beta", "gamma"]
    pattern = r"[0-9]{3}-[a-z]{2}"
    for seed in SEEDS:
        for constraint, check in [
            ({"choice": choices}, lambda t: t in choices),
            ({"regex": pattern}, lambda t: re.fullmatch(pattern, t)),
        ]:
            response = _chat(
                client, seed, stream=stream, extra_body={"structured_outputs": constraint}
            )
            chunks = list(response) if stream else [response]
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                text = response.choices[0].message.content
            assert check(text), text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"response_format": BAD_SCHEMA}, "response_format.json_schema.schema is invalid"),
        ({"extra_body": {"structured_outputs": {"regex": "(("}}}, "structured_outputs.regex is"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "exactly one of"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice names function 'nope'"),
        ({"tool_choice": "required"}, "tool_choice requires tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": JSON_OBJECT},
         "cannot be combined"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400(client: openai.OpenAI, kwargs: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        _chat(client, 0, **kwargs)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("grammar", ["root ::= root", 'root ::= x\nx ::= x "a"'])
def test_grammar_no_token_can_start_is_400(
    client: openai.OpenAI, grammar: str, stream: bool
) -> None:
    """Syntax checks pass these grammars (rules that only recurse: no string ever ends them),
    so the engine finds out when it compiles them: a 400 naming the field, streamed or not,
    then the server serves the next request (they used to end as 200s with finish_reason
    error)."""
    message = "structured_outputs.grammar matches no text this model's tokenizer can produce"
    with pytest.raises(openai.BadRequestError, match=re.escape(message)) as caught:
        _chat(client, 0, stream=stream, extra_body={"structured_outputs": {"grammar": grammar}})
    assert caught.value.body["param"] == "structured_outputs"
    assert _chat(client, 0, max_tokens=2).choices[0].finish_reason == "length"


def _check_call(call, tools: list[dict]) -> dict:
    (tool,) = [t for t in tools if t["function"]["name"] == call.function.name]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    assert call.type == "function" and call.id.startswith("call_")
    return arguments


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_returns_valid_calls(client: openai.OpenAI, stream: bool) -> None:
    tools = [WEATHER, TIME]

    def request(seed: int) -> Any:
        response = _chat(client, seed, tools=tools, tool_choice="required", stream=stream)
        return list(response) if stream else response

    for response in _each_seed(request):
        if not stream:
            choice = response.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
            calls = choice.message.tool_calls
        else:
            chunks = [c for c in response if c.choices]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
            assert [d.index for d in deltas] == list(range(len(deltas))) and deltas
            calls = deltas
        for call in calls:
            _check_call(call, tools)


def test_named_tool_choice_calls_that_function_once(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    for response in _each_seed(
        lambda seed: _chat(client, seed, tools=[WEATHER, TIME], tool_choice=choice)
    ):
        message = response.choices[0].message
        assert [c.function.name for c in message.tool_calls] == ["get_time"]
        _check_call(message.tool_calls[0], [TIME])


def test_tool_call_round_trip_through_two_turns(client: openai.OpenAI) -> None:
    first = _chat(client, 1, tools=[WEATHER], tool_choice="required").choices[0].message
    call = first.tool_calls[0]
    arguments = _check_call(call, [WEATHER])
    history = [
        *CHAT,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=[WEATHER], tool_choice="none",
        temperature=0, max_tokens=8,
    )  # fmt: skip
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason in ("stop", "length")
    # The second prompt holds the first turn's call and the tool's answer, rendered by the
    # template: its length is the first prompt's plus theirs.
    rendered = httpx_tokenize(client, history)
    rendered_call = re.search(r"<tool_call>\n(.*)\n</tool_call>", rendered)
    assert rendered_call is not None, rendered
    assert json.loads(rendered_call[1]) == {"name": "get_weather", "arguments": arguments}
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in rendered
    assert (
        second.usage.prompt_tokens
        > _chat(client, 1, tools=[WEATHER], max_tokens=1).usage.prompt_tokens
    )


def httpx_tokenize(client: openai.OpenAI, messages: list[dict]) -> str:
    """The prompt text the server renders for `messages` with the weather tool."""
    import httpx

    base = str(client.base_url).removesuffix("/v1/")
    ids = httpx.post(base + "/tokenize", json={"messages": messages}).json()["tokens"]
    detok = httpx.post(base + "/detokenize", json={"tokens": ids}).json()
    return detok["prompt"]


@pytest.fixture(scope="module")
def llama3_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("llama3") / "model", "llama")
    use_tools_template(checkpoint)
    log = tmp_path_factory.mktemp("logs") / "llama3.log"
    flags = ("--max-model-len", "1024", "--tool-call-parser", "llama3_json")
    with run_server(checkpoint, log, *flags) as handle:
        yield openai.OpenAI(base_url=handle.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_llama3_json_parser_forces_and_parses_its_calls(llama3_client, stream: bool) -> None:
    """`--tool-call-parser llama3_json`: a required call is forced in Llama's JSON and comes back
    as `tool_calls`, whole or streamed."""
    tools = [WEATHER, TIME]
    response = _chat(llama3_client, 0, tools=tools, tool_choice="required", stream=stream)
    if stream:
        chunks = [c for c in response if c.choices]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    else:
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls
    assert calls
    for call in calls:
        _check_call(call, tools)
