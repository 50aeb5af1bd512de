"""Tool parsers: Hermes markup and Llama 3 JSON calls parsed whole and streamed alike, and their
required-call grammars."""

from __future__ import annotations

import json
import time

import pytest
import xgrammar as xgr

from tokenmill.entrypoints.tool_parsers import (
    FunctionTool,
    ToolCall,
    ToolStream,
    get_tool_parser,
)
from tokenmill.structured.grammar import build_grammar

TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'
)


@pytest.fixture
def hermes():
    return get_tool_parser("hermes")


def test_whole_output_splits_into_content_and_calls(hermes) -> None:
    parsed = hermes.parse(TEXT)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"zone": 1}),
    ]
    assert len({c.id for c in parsed.tool_calls}) == 2
    assert parsed.tool_calls[0].to_openai(index=0)["function"]["name"] == "get_weather"


def test_text_without_calls_is_all_content(hermes) -> None:
    parsed = hermes.parse("Just an answer < not a tag")
    assert parsed.content == "Just an answer < not a tag" and parsed.tool_calls == []


def test_malformed_call_stays_content(hermes) -> None:
    parsed = hermes.parse("<tool_call>{not json}</tool_call>")
    assert parsed.tool_calls == [] and parsed.content == "<tool_call>{not json}</tool_call>"


def test_unclosed_call_at_the_end_still_counts(hermes) -> None:
    parsed = hermes.parse('<tool_call>\n{"name": "f", "arguments": {}}\n')
    assert [c.name for c in parsed.tool_calls] == ["f"] and parsed.content is None


@pytest.mark.parametrize("piece", [1, 4, 1000])
@pytest.mark.parametrize(
    "text",
    ['<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call', '<tool_call>\n{"name": "f", "a'],
    ids=["in-the-end-tag", "in-the-call"],
)
def test_output_cut_short_inside_a_call_stays_the_models_text(hermes, text, piece) -> None:
    """An output ending (max_tokens) inside a call that does not parse is content as the model
    wrote it: the response read `...</tool_call</tool_call>`, an end tag never generated."""
    assert hermes.parse(text).content == text
    stream = ToolStream(hermes)
    events = [e for i in range(0, len(text), piece) for e in stream.feed(text[i : i + piece])]
    events += stream.finish()
    assert "".join(e for e in events if isinstance(e, str)) == text


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_in_any_pieces_gives_the_same_calls(hermes, piece: int) -> None:
    stream = ToolStream(hermes)
    events = []
    for start in range(0, len(TEXT), piece):
        events += stream.feed(TEXT[start : start + piece])
    events += stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)]
    assert content.strip() == "Let me check."
    assert calls == [(c.name, c.arguments) for c in hermes.parse(TEXT).tool_calls]
    assert not any(isinstance(e, str) and "<tool" in e for e in events)  # tags never leak


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="tool parser must be one of hermes"):
        get_tool_parser("nope")


def test_required_grammar_accepts_calls_in_the_markup_and_nothing_else(hermes) -> None:
    tools = [
        FunctionTool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                     "required": ["city"]}),
        FunctionTool("get_time", {"type": "object", "properties": {"zone": {"type": "integer"}},
                                  "required": ["zone"]}),
    ]  # fmt: skip
    constraint = hermes.constraint(tools, parallel=True)
    grammar = build_grammar(constraint.kind, constraint.spec)
    good = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>'
    )
    assert xgr.testing._is_grammar_accept_string(grammar, good)
    assert [c.name for c in hermes.parse(good).tool_calls] == ["get_weather", "get_time"]
    for bad in [
        "Sure!",
        '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "x"}}\n</tool_call>',
    ]:
        assert not xgr.testing._is_grammar_accept_string(grammar, bad)
    single = hermes.constraint(tools, parallel=False)
    assert not xgr.testing._is_grammar_accept_string(build_grammar(single.kind, single.spec), good)


LLAMA_TEXT = (
    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
    '{"name": "get_time", "parameters": {"zone": 1}}'
)


@pytest.fixture
def llama3():
    return get_tool_parser("llama3_json")


@pytest.mark.parametrize(
    ("text", "calls", "content"),
    [
        (LLAMA_TEXT, ["get_weather", "get_time"], None),
        ("<|python_tag|>" + LLAMA_TEXT[:76].rstrip("; "), ["get_weather"], None),
        ('  {"name": "f", "arguments": {"x": 1}}  ', ["f"], None),
        ("The weather is fine.", [], "The weather is fine."),
        ('{"not": "a call"}', [], '{"not": "a call"}'),
        ('{"name": "f", "parameters": {}} and then prose', [], None),
        ('{"name": "f", "parameters": {', [], '{"name": "f", "parameters": {'),
    ],
)
def test_llama3_json_output_is_calls_or_content(llama3, text, calls, content) -> None:
    parsed = llama3.parse(text)
    assert [c.name for c in parsed.tool_calls] == calls
    if content is not None:
        assert parsed.content == content
    elif not calls:
        assert parsed.content == text.strip()


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
@pytest.mark.parametrize("text", [LLAMA_TEXT, "Plain {text} with braces.", "  {broken"])
def test_llama3_json_streams_as_it_parses_whole(llama3, text: str, piece: int) -> None:
    """Content streams at once; an output opening with `{` is held and goes out as its calls
    (or as content when it is not calls), as the whole parse has it."""
    stream = llama3.stream()
    events = []
    for start in range(0, len(text), piece):
        got = stream.feed(text[start : start + piece])
        assert not (text.lstrip().startswith("{") and got)  # held to the end
        events += got
    events += stream.finish()
    whole = llama3.parse(text)
    assert [e.name for e in events if isinstance(e, ToolCall)] == [c.name for c in whole.tool_calls]
    assert stream.num_calls == len(whole.tool_calls)
    content = "".join(e for e in events if isinstance(e, str))
    assert content.strip() == (whole.content or "")


def test_llama3_json_required_grammar_takes_its_calls_only(llama3) -> None:
    zone = {"type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}
    constraint = llama3.constraint([FunctionTool("get_time", zone)], parallel=True)
    grammar = build_grammar(constraint.kind, constraint.spec)
    call = '{{"name": "get_time", "parameters": {{"zone": {}}}}}'
    good = f"{call.format(3)}; {call.format(4)}"
    assert xgr.testing._is_grammar_accept_string(grammar, good)
    assert [c.name for c in llama3.parse(good).tool_calls] == ["get_time", "get_time"]
    hermes_call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'
    for bad in ["Sure!", '{"name": "other", "parameters": {}}', hermes_call]:
        assert not xgr.testing._is_grammar_accept_string(grammar, bad)


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_a_call_with_an_integer_python_cannot_read_is_content(name: str) -> None:
    """An integer of more digits than Python converts (4,300) raised ValueError out of the
    parser: a 500 for the request, or a broken stream."""
    call = '{"name": "f", "arguments": {"n": ' + "7" * 5000 + "}}"
    text = f"<tool_call>{call}</tool_call>" if name == "hermes" else call
    parser = get_tool_parser(name)
    parsed = parser.parse(text)
    assert parsed.tool_calls == [] and parsed.content == text
    stream = parser.stream()
    assert "".join(stream.feed(text) + stream.finish()) == text


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_a_long_call_streams_in_time_linear_in_its_length(name: str) -> None:
    """A call of 64,000 tokens (a long string argument) is parsed as it streams without
    rescanning or copying what came before at each token: that took seconds of the event
    loop (hermes 32,000 tokens: 2.2 s, llama3_json: 1.2 s, four times that at twice the
    length)."""
    parser = get_tool_parser(name)
    head = '{"name": "f", "arguments": {"text": "'
    opening = "<tool_call>\n" + head if name == "hermes" else head
    closing = '"}}\n</tool_call>' if name == "hermes" else '"}}'
    stream = parser.stream()
    started = time.perf_counter()
    events = stream.feed(opening)
    for _ in range(64_000):
        events += stream.feed("abcdefghij")
    events += stream.feed(closing)
    events += stream.finish()
    assert time.perf_counter() - started < 1.0
    [call] = events
    assert isinstance(call, ToolCall)
    assert json.loads(call.arguments) == {"text": "abcdefghij" * 64_000}
