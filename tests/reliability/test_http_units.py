"""Edge pieces checked in-process: internal errors, the prompt byte limit, the access-log filter,
--chat-template, and error messages."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import time
from pathlib import Path

import pytest
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from pydantic import ValidationError

from tests.reliability.routes import offline_app, server_state
from tokenmill.config import EngineArgs
from tokenmill.entrypoints import api_server
from tokenmill.entrypoints import openai_responses as oai
from tokenmill.entrypoints.engine_client import ChoiceOutput
from tokenmill.entrypoints.protocol import MessageToolCall, error_param, request_models
from tokenmill.entrypoints.server_options import ServerOptions
from tokenmill.entrypoints.tool_parsers import get_tool_parser
from tokenmill.ipc.messages import ClientOutput, PromptTextLogprobs
from tokenmill.tokenization.tokenizer import PromptBounds, load_tokenizer


def test_unexpected_exception_is_a_500_in_openai_shape_and_the_app_keeps_serving() -> None:
    app = offline_app()

    async def boom() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/boom", boom)
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: no engine needed
    response = client.get("/boom")
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "InternalServerError"
    assert "a bug" not in response.text  # internals stay in the log
    assert client.get("/version").status_code == 200


def _output(text: str, finish: str | None = None) -> ChoiceOutput:
    out = ClientOutput("r-0:0", text, [1], None, finish, 1, 0)
    return ChoiceOutput(0, 0, out)


def test_exception_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async def outputs():
        yield _output("b")
        raise RuntimeError("a bug")

    async def run() -> list[str]:
        state = oai.ResponseState("cmpl-1", "m", 1)
        stream = api_server._stream(state, _output("a"), outputs(), False, 0, (False, False))
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert chunks[-1] == "data: [DONE]\n\n"
    error = json.loads(chunks[-2].removeprefix("data: "))["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"


def test_default_prompt_byte_limit_is_the_context_of_the_longest_tokens(llama_dir: Path) -> None:
    config = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=100)
    served = config.create_served_model()
    tokenizer = load_tokenizer(str(llama_dir))
    longest = max(len(t.encode()) for t in tokenizer.get_vocab())
    bounds = PromptBounds.read(str(llama_dir))
    assert bounds == PromptBounds.of(tokenizer)  # tokenizer.json alone says what it does
    limits = api_server.request_limits("m", ServerOptions(), served, bounds)
    assert limits.max_prompt_bytes == 2 * 100 * longest
    # No text of more bytes can fit: even all-longest tokens fill the context first.
    assert len(tokenizer.encode("x" * (limits.max_prompt_bytes + 1))) > 100
    explicit = ServerOptions(max_prompt_bytes=5)
    assert api_server.request_limits("m", explicit, served, bounds).max_prompt_bytes == 5


def test_chat_messages_and_parts_past_the_limit_are_refused_before_they_are_validated(
    llama_dir: Path,
) -> None:
    """480,000 messages (16 MB) took 26 s of the tokenizer worker and 2 s of the event loop;
    counted first, such a chat is a 400 naming `messages`, whatever its messages hold."""
    served = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=100).create_served_model()
    assert api_server.request_limits("m", ServerOptions(), served, None).max_chat_messages == 100
    explicit = ServerOptions(max_chat_messages=7)
    assert api_server.request_limits("m", explicit, served, None).max_chat_messages == 7
    client = TestClient(offline_app())  # --max-chat-messages 128
    message = {"role": "user", "content": "a"}
    bogus = {"role": "bogus", "content": 1}  # would fail validation, were it reached
    too_many = [message] * 128 + [bogus]
    one_of_many_parts = [{"role": "user", "content": [{"type": "text", "text": ""}] * 128}]
    for messages in (too_many, one_of_many_parts, [message] * 200_000):
        response = client.post("/tokenize", json={"messages": messages})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "messages" and "--max-chat-messages" in error["message"]
    # At the limit the chat goes on to the tokenizer (this app has none).
    response = client.post("/tokenize", json={"messages": [message] * 128})
    assert "--max-chat-messages" not in response.text


def test_access_log_filter_drops_polls_only() -> None:
    quiet = api_server._QuietRoutes("/llm")

    def line(path: str) -> logging.LogRecord:
        args = ("127.0.0.1:1", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, "%s %s %s", args, None)

    assert not quiet.filter(line("/llm/metrics")) and not quiet.filter(line("/llm/health?x=1"))
    assert quiet.filter(line("/llm/v1/completions")) and quiet.filter(line("/llm/load"))


def test_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert api_server.read_chat_template(str(path)) == template
    assert api_server.read_chat_template(template) == template
    assert api_server.read_chat_template(None) is None
    with pytest.raises(ValueError, match="chat_template: cannot read"):
        api_server.read_chat_template(str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize(
    "template",
    ["{% for m in messages %}{{ m.content }", "{% if x %}no end", "{{ m | }}"],
)
def test_a_chat_template_that_does_not_compile_is_refused_before_the_server_starts(
    template: str, tmp_path: Path
) -> None:
    """Else the server started and every chat request failed on the template."""
    with pytest.raises(ValueError, match=r"chat_template is not a valid Jinja template \(line 1\)"):
        api_server.read_chat_template(template)
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}\n" + template)
    with pytest.raises(ValueError, match=r"\(line 2\)"):
        api_server.read_chat_template(str(path))
    # transformers' own tags and extensions compile
    ok = "{% for m in messages %}{% generation %}{{ m }}{% endgeneration %}{% break %}{% endfor %}"
    assert api_server.read_chat_template(ok) == ok
    with pytest.raises(ValueError, match="chat_template is not a valid Jinja template: 'break'"):
        api_server.read_chat_template("{% break %}")


def test_error_messages_name_the_path_without_union_tags() -> None:
    error = {
        "type": "less_than",
        "loc": ("body", "prompt", "list[list[int]]", 1, 0),
        "msg": "Input should be less than 512",
        "input": 600,
    }
    assert error_param(error) == ("prompt.1.0: Input should be less than 512, got 600", "prompt")
    limit = {"type": "limit", "loc": ("body",), "msg": "too many", "ctx": {"param": "n"}}
    assert error_param(limit) == ("n: too many", "n")
    invalid = {"type": "json_invalid", "loc": ("body", 3), "msg": "x", "ctx": {"error": "bad"}}
    assert error_param(invalid) == ("the body is not valid JSON: bad", None)
    query = {"type": "greater_than_equal", "loc": ("query", "limit"), "msg": "too small"}
    assert error_param(query) == ("limit: too small", "limit")


@pytest.mark.parametrize("key", ["-1", "1.5", "01", "512"])
def test_a_logit_bias_key_that_is_no_token_id_is_named_once(key: str) -> None:
    """The message was `... as decimal strings, got {key!r}, got '-1'` (pydantic fills in
    `{key}` only)."""
    completion = request_models(server_state().limits).completion
    with pytest.raises(ValidationError) as raised:
        completion.model_validate({"prompt": "hi", "logit_bias": {key: 1.0}})
    message, param = error_param(raised.value.errors()[0])
    assert param == "logit_bias"
    assert message.endswith(f"integers in [0, 512) as decimal strings, got {key!r}"), message
    assert "{" not in message


@pytest.mark.parametrize(
    "body",
    [
        # a lone surrogate, escaped: parsed, it could not be encoded (HTTP 500, or a torn stream)
        '{"name": "f", "arguments": {"a": "\\ud800"}}',
        '{"name": "\\udfff", "arguments": {}}',
        '{"name": "f", "arguments": "\\ud800"}',
        # nested past json.loads' recursion limit (RecursionError: HTTP 500)
        '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}",
    ],
    ids=["surrogate-in-arguments", "surrogate-in-name", "surrogate-in-arguments-text", "deep"],
)
def test_tool_calls_a_response_can_not_carry_stay_content(body: str) -> None:
    text = f"<tool_call>\n{body}\n</tool_call>"
    parsed = get_tool_parser("hermes").parse(text)
    assert parsed.tool_calls == [] and parsed.content == text
    JSONResponse({"content": parsed.content})  # renders


def test_logprob_tokens_are_token_ids_when_asked() -> None:
    # Two tokens decoding to the same text collide as text (the text keeps the more likely
    # one's logprob: lm-eval's is_greedy compares a token with the top's best), never as ids.
    entries = [[(7, "a", -0.1, 1), (9, "a", -2.3, 2)]]
    assert oai.completion_logprobs(entries, 2)["top_logprobs"] == [{"a": -0.1}]
    named = oai.completion_logprobs(entries, 2, tokens_as_ids=True)
    assert named["tokens"] == ["token_id:7"]
    assert named["top_logprobs"] == [{"token_id:7": -0.1, "token_id:9": -2.3}]
    chat = oai.chat_logprobs(entries, 2, tokens_as_ids=True)["content"][0]
    assert [t["token"] for t in chat["top_logprobs"]] == ["token_id:7", "token_id:9"]


def test_echoed_prompt_starts_the_completion_logprobs() -> None:
    prompt = PromptTextLogprobs((1, "<s>"), [[(5, "ab", -1.5, 3), (6, "x", -0.2, 1)]])
    generated = [[(8, "c", -0.7, 1)]]
    body = oai.completion_logprobs(generated, 1, prompt=prompt)
    assert body == {
        "tokens": ["<s>", "ab", "c"],
        "token_logprobs": [None, -1.5, -0.7],
        "top_logprobs": [None, {"x": -0.2}, {"c": -0.7}],
        "text_offset": [0, 3, 5],
    }
    assert oai.completion_logprobs(None, 1, prompt=prompt)["tokens"] == ["<s>", "ab"]
    named = oai.completion_logprobs(None, 1, tokens_as_ids=True, prompt=prompt)
    assert named["tokens"] == ["token_id:1", "token_id:5"]
    # vLLM's prompt_logprobs: the token itself, and its alternatives up to the rank asked
    assert oai.prompt_logprobs_json(prompt, 0) == [
        None,
        {5: {"logprob": -1.5, "rank": 3, "decoded_token": "ab"}},
    ]
    assert set(oai.prompt_logprobs_json(prompt, 1)[1]) == {5, 6}
    JSONResponse({"prompt_logprobs": oai.prompt_logprobs_json(prompt, 1)})  # renders


def test_dashboard_requests_are_relative_so_it_works_under_a_root_path() -> None:
    """Behind a proxy prefix (`--root-path /llm`) the page is /llm/dashboard; an absolute
    `/metrics` would miss the prefix."""
    page = api_server.DASHBOARD_HTML.read_text()
    urls = re.findall(r"""(?:fetch\(|href = )["'`]([^"'`$]+)""", page)
    assert {"metrics", "v1/feedback?max_rating=-1&limit=20", "v1/traces/"} <= set(urls)
    assert not [u for u in urls if u.startswith("/")]


@pytest.mark.parametrize(
    "arguments", ["{not json", '{"n": ' + "7" * 5000 + "}"], ids=["not-json", "long-integer"]
)
def test_tool_call_arguments_python_cannot_read_name_the_messages(arguments: str) -> None:
    """An earlier call's arguments holding an integer of over 4,300 digits: the message was
    int()'s ('Exceeds the limit ...'), naming no field."""
    call = MessageToolCall.model_validate(
        {"id": "a", "function": {"name": "f", "arguments": arguments}}
    )
    with pytest.raises(ValueError, match="^messages: tool call arguments must be JSON"):
        call.template_dict()


def _streamed(outputs: list[ClientOutput], parsers: tuple) -> list[dict]:
    """The chunks `_stream` makes of one choice's `outputs` (logprobs top 0, no usage)."""
    response = oai.ResponseState(request_id="chatcmpl-x", model="m", n=1)
    items = [ChoiceOutput(0, 0, out) for out in outputs]

    async def rest():
        for item in items[1:]:
            yield item

    async def collect() -> list[str]:
        stream = api_server._stream(response, items[0], rest(), True, 0, (False, False), parsers)
        return [event async for event in stream]

    events = asyncio.run(collect())
    return [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]


@pytest.mark.parametrize("tools", [False, True], ids=["no-tools", "llama3_json"])
def test_streamed_reasoning_carries_its_tokens_logprobs(tools: bool) -> None:
    """Each step's logprobs go out in the chunk holding its reasoning (as vLLM's), not in an
    empty chunk after it; a step that crosses `</think>` is one chunk of both."""
    from tokenmill.entrypoints.reasoning import REASONING_PARSERS

    def step(text: str, token: int, finish: str | None = None) -> ClientOutput:
        return ClientOutput("r", text, [token], [[(token, text, -0.5, 1)]], finish, 3, 0)

    outputs = [step("So", 1), step(" yes</think>", 2), step("Hi", 3, "stop")]
    parsers = (get_tool_parser("llama3_json") if tools else None, REASONING_PARSERS["deepseek_r1"])
    chunks = [c["choices"][0] for c in _streamed(outputs, parsers)]
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    tokens = [[t["token"] for t in (c["logprobs"] or {}).get("content") or []] for c in chunks]
    assert [c["delta"] for c in chunks[1:]] == [
        {"reasoning_content": "So"},
        {"reasoning_content": " yes"},
        {"content": "Hi"},
    ]
    assert tokens[1:] == [["So"], [" yes</think>"], ["Hi"]]
    assert chunks[-1]["finish_reason"] == "stop"


def test_choice_logprobs_accumulate_in_time_linear_in_the_tokens() -> None:
    """Each output's logprobs are added to its choice's in place: a new list per output copied
    the choice's whole history (32,000 tokens: 0.66 s of the event loop, per choice)."""
    response = oai.ResponseState("cmpl-x", "m", 1)
    entry = [(7, "a", -0.1, 1)]
    started = time.perf_counter()
    for _ in range(64_000):
        out = ClientOutput("cmpl-x-0-0", "a", [7], [entry], None, 1, 0)
        response.add(ChoiceOutput(0, 0, out))
    assert time.perf_counter() - started < 1.5
    assert response.choices[0].logprobs == [entry] * 64_000


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_stream_holds_none_of_the_logprobs_and_text_it_sent(chat: bool) -> None:
    """A stream's chunks carry each output's text and logprobs; the response state kept them
    too, for the stream's whole life and past --max-response-logprobs (a stream of n=128 with
    20 alternatives held every entry, gigabytes at a long context). It counts tokens only."""
    entry = [(7, "a", -0.1, 1)] * 21
    prompt = PromptTextLogprobs((1, "<s>"), [entry] * 100)
    echo = None if chat else oai.Echo(["<s>"], logprobs=True, only=False)
    response = oai.ResponseState("cmpl-x", "m", 2, echo=echo)

    def item(choice: int, finish: str | None = None) -> ChoiceOutput:
        out = ClientOutput("cmpl-x-0", "a", [7], [entry], finish, 3, 0)
        out.prompt_logprobs = prompt if finish is None else None
        return ChoiceOutput(0, choice, out)

    items = [item(c) for c in (0, 1)] * 500 + [item(0, "length"), item(1, "length")]

    async def rest():
        for output in items[1:]:
            yield output

    async def collect() -> list[str]:
        stream = api_server._stream(response, items[0], rest(), chat, 20, (True, False))
        return [event async for event in stream]

    events = asyncio.run(collect())
    usage = json.loads(events[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 1002  # still counted
    assert response.num_logprobs == 0
    for state in response.choices.values():
        assert (state.text, state.logprobs, state.prompt_logprobs) == ("", None, None)
        assert state.finish_reason == "length"


def test_a_non_streamed_body_is_encoded_as_json_response_encodes_it() -> None:
    """Bodies are encoded choice by choice (off the event loop), each choice taken out of the
    state as it goes: the bytes are JSONResponse's of the whole body, choices in index order
    (they arrive in any), usage counted over all of them."""
    prompt = PromptTextLogprobs((1, "<s>"), [[(5, "é\u2028", -1.5, 3)]])
    response = oai.ResponseState("cmpl-x", "m", 2, echo=None, prompt_top_n=1)
    for choice, text in ((1, "本"), (0, "日本")):
        out = ClientOutput("cmpl-x-0", text, [7] * len(text), [[(7, "日", -0.5, 1)]] * len(text),
                           "stop", 3, 0)  # fmt: skip
        out.prompt_logprobs = prompt
        response.add(ChoiceOutput(0, choice, out))
    scored = [None, {"5": {"logprob": -1.5, "rank": 3, "decoded_token": "é\u2028"}}]
    envelope = {"id": "cmpl-x", "created": response.created, "model": "m"}
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    completion = {
        **envelope, "object": "text_completion", "usage": usage,
        "choices": [
            {"index": i, "text": text, "finish_reason": "stop", "prompt_logprobs": scored,
             "logprobs": {"tokens": ["日"] * len(text), "token_logprobs": [-0.5] * len(text),
                          "top_logprobs": [{"日": -0.5}] * len(text),
                          "text_offset": [0, 1][: len(text)]}}
            for i, text in ((0, "日本"), (1, "本"))
        ],
    }  # fmt: skip
    item = {"token": "日", "logprob": -0.5, "bytes": [230, 151, 165]}
    chat = {
        **envelope, "object": "chat.completion", "usage": usage, "prompt_logprobs": scored,
        "choices": [
            {"index": i, "finish_reason": "stop",
             "message": {"role": "assistant", "content": text},
             "logprobs": {"content": [{**item, "top_logprobs": [item]}] * len(text)}}
            for i, text in ((0, "日本"), (1, "本"))
        ],
    }  # fmt: skip
    for build, expected in ((oai.completion_body, completion), (oai.chat_body, chat)):
        state = copy.deepcopy(response)
        body = build(state, 1)
        assert list(body)[:6] == ["id", "object", "created", "model", "choices", "usage"]
        encoded = api_server._json_body(body)
        assert state.choices == {}  # each choice was taken out as it was encoded
        assert json.loads(encoded) == expected
        listed = build(copy.deepcopy(response), 1)
        listed["choices"] = list(listed["choices"])
        assert encoded == JSONResponse(listed).body
    assert api_server._json_body({"choices": []}) == JSONResponse({"choices": []}).body
