"""Reasoning parsers (`--reasoning-parser`): a thinking model's chat output split into
`reasoning_content` and `content`, whole and streamed in any pieces, and in the chat responses."""

from __future__ import annotations

import asyncio
import json
import random
import time
from types import SimpleNamespace

import pytest

from tokenmill.entrypoints import api_server
from tokenmill.entrypoints import openai_responses as oai
from tokenmill.entrypoints.engine_client import ChoiceOutput
from tokenmill.entrypoints.reasoning import REASONING_PARSERS, ReasoningStream
from tokenmill.entrypoints.server_options import ServerOptions
from tokenmill.entrypoints.tool_parsers import get_tool_parser
from tokenmill.ipc.messages import ClientOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

CASES = {
    # (text, parser): (reasoning, content)
    ("<think>plan it</think>\n\nThe answer.", "qwen3"): ("plan it", "\n\nThe answer."),
    ("  <think>a</think>b", "qwen3"): ("a", "b"),
    ("No thinking at all.", "qwen3"): (None, "No thinking at all."),
    ("<think>cut short by max_tokens", "qwen3"): (None, "<think>cut short by max_tokens"),
    ("<think>x</think>", "qwen3"): ("x", None),
    ("plan it</think>The answer.", "deepseek_r1"): ("plan it", "The answer."),
    ("<think>plan it</think>The answer.", "deepseek_r1"): ("plan it", "The answer."),
    ("still thinking", "deepseek_r1"): ("still thinking", None),
    ("a < b </thin and more", "deepseek_r1"): ("a < b </thin and more", None),
}


@pytest.mark.parametrize(
    ("case", "expected"), CASES.items(), ids=[f"{p}:{t[:12]}" for t, p in CASES]
)
def test_split_whole_outputs(case: tuple[str, str], expected: tuple) -> None:
    text, parser = case
    assert REASONING_PARSERS[parser].split(text) == expected


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("parser", sorted(REASONING_PARSERS))
def test_streamed_pieces_add_up_to_the_whole_split(seed: int, parser: str) -> None:
    """Cut anywhere (inside tags too), the streamed reasoning and content add up to the whole
    output's split, where the output closes its reasoning (or never opens it)."""
    rng = random.Random(seed)
    texts = ["<think>step one, step two</think>\n\nAnswer: <b>42</b>", "plain answer < 3",
             "abc</think>def"]  # fmt: skip
    text = texts[seed % len(texts)]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = ReasoningStream(REASONING_PARSERS[parser])
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    expected = REASONING_PARSERS[parser].split(text)
    assert (reasoning or None, content or None) == expected


def _output(text: str, finish: str | None = None) -> ChoiceOutput:
    return ChoiceOutput(0, 0, ClientOutput("r-0:0", text, [1], None, finish, 1, 0))


def test_chat_body_and_stream_carry_reasoning_content_and_tool_calls() -> None:
    """Non-streamed: `message.reasoning_content`; streamed: `delta.reasoning_content` chunks,
    then content; a tool call after the reasoning is still a tool call."""
    text = '<think>call it</think><tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parser, tools = REASONING_PARSERS["qwen3"], get_tool_parser("hermes")
    state = oai.ResponseState("chatcmpl-1", "m", 1)
    state.add(_output(text, "stop"))
    message = next(oai.chat_body(state, 0, tools, parser)["choices"])["message"]
    assert message["reasoning_content"] == "call it"
    assert message["tool_calls"][0]["function"]["name"] == "f"

    async def outputs():
        for piece in ("lk it over", "</thi", "nk>The", " end."):
            yield _output(piece)
        yield _output("", "stop")

    async def run() -> list[dict]:
        stream = api_server._stream(oai.ResponseState("chatcmpl-2", "m", 1), _output("<think>ta"),
                                    outputs(), True, 0, (False, False), (None, parser))  # fmt: skip
        chunks = [c async for c in stream]
        return [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]

    deltas = [c["choices"][0]["delta"] for c in asyncio.run(run())]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "talk it over"
    assert "".join(d.get("content", "") for d in deltas) == "The end."


def test_the_server_option_picks_the_parser_except_under_a_grammar() -> None:
    state = SimpleNamespace(options=ServerOptions(reasoning_parser="qwen3"))
    assert api_server._reasoning_parser(state, SamplingParams()) is REASONING_PARSERS["qwen3"]
    json_mode = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    assert api_server._reasoning_parser(state, json_mode) is None
    assert (
        api_server._reasoning_parser(SimpleNamespace(options=ServerOptions()), SamplingParams())
        is None
    )
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        ServerOptions(reasoning_parser="nope")


@pytest.mark.parametrize("parser", sorted(REASONING_PARSERS))
def test_a_long_whitespace_output_streams_in_time_linear_in_its_length(parser: str) -> None:
    """An output of only whitespace may still open with `<think>`, so it is held; it was
    stripped again, whole, at every token (64,000 tokens: 0.7 s of the event loop, four times
    that at twice the length). It still comes out whole, as the reasoning or content it is."""
    stream = ReasoningStream(REASONING_PARSERS[parser])
    started = time.perf_counter()
    for _ in range(128_000):
        assert stream.feed(" \n") == ("", "")
    reasoning, content = stream.feed("", final=True)
    assert time.perf_counter() - started < 1.0
    whole = " \n" * 128_000
    assert (reasoning, content) == ((whole, "") if parser == "deepseek_r1" else ("", whole))
