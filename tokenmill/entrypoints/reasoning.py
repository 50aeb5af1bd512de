"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model's chat output split into
`reasoning_content` (between `<think>` and `</think>`) and `content` (after), whole or as it
streams.

`deepseek_r1`: the chat template opens the thinking, so the output is reasoning from its first
token (a leading `<think>` is dropped) until `</think>`; an output without one is all reasoning.
`qwen3`: the output is reasoning only if it starts with `<think>` (Qwen3 writes the tag itself,
and with `enable_thinking: false` does not think), and only once `</think>` closes it: an output
without the closing tag is all content, as vLLM's parser has it (streamed, its deltas have gone
out as reasoning by then).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.entrypoints.tool_parsers.base import partial_suffix

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """How one model family marks its reasoning: whether the output starts inside it."""

    name: str
    starts_inside: bool

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A finished output as (reasoning, content), either None when absent."""
        stripped = text.lstrip()
        opened = stripped.startswith(START)
        if not (opened or self.starts_inside):
            return None, text
        body = stripped[len(START) :] if opened else text
        end = body.find(END)
        if end < 0:
            return (body, None) if self.starts_inside else (None, text)
        return body[:end], body[end + len(END) :] or None


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
    "qwen3": ReasoningParser("qwen3", starts_inside=False),
}


class ReasoningStream:
    """Splits an output as it streams: each `feed` returns the reasoning and the content its
    text completes, holding back what may be the start of a tag."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._buffer = ""
        # None: not known yet whether the output opens with `<think>` (qwen3's first tokens).
        self._inside: bool | None = True if parser.starts_inside else None
        self._at_start = True  # a leading `<think>` is dropped
        # The output's leading whitespace while `_at_start`, in pieces: kept apart from
        # `_buffer`, so that a long run of it is not copied and stripped again at every token.
        self._space: list[str] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of `text` and what was held back; `final`: nothing follows."""
        if not self._at_start:
            self._buffer += text
        elif not self._open(text, final):
            return "", ""  # may still open with `<think>`
        reasoning = content = ""
        if self._inside:
            end = self._buffer.find(END)
            if end < 0:
                keep = 0 if final else partial_suffix(self._buffer, END)
                reasoning = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:end], self._buffer[end + len(END) :]
            self._inside = False
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def _open(self, text: str, final: bool) -> bool:
        """Take `text` at the output's start: False while it may still open with `<think>`
        (its leading whitespace and the tag's first characters held), else True, with the tag
        dropped or, when there is none, the held text put back in `_buffer`."""
        if not self._buffer:  # nothing but whitespace so far
            head = text.lstrip()
            self._space.append(text[: len(text) - len(head)])
            text = head
        stripped = self._buffer + text  # `_buffer`: at most the tag's first characters
        if stripped.startswith(START):
            self._buffer, self._inside = stripped[len(START) :], True
        elif START.startswith(stripped) and not final:
            self._buffer = stripped
            return False
        else:
            self._buffer = "".join(self._space) + stripped
            if self._inside is None:
                self._inside = False
        self._at_start, self._space = False, []
        return True
