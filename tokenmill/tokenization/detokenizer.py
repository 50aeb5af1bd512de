"""Token ids → text deltas that never split a character; stop strings end a choice.

`IncrementalDetokenizer` turns a growing token list into final text; `ChoiceStream` is one
choice's output as a client sees it, the one place stop strings decide how a choice ends (used by
the offline `LLM` and by the server's detokenizer worker alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Tokens of the prompt decoded with the first output tokens, so that a leading space or a
# character spanning the prompt/output boundary decodes as it would in the full text.
_CONTEXT_TOKENS = 5


@dataclass(frozen=True)
class DetokenizerUpdate:
    """Text that became final with the latest tokens; `stopped` when a stop string matched.
    `num_tokens`: how many of the latest tokens the output keeps: all of them, unless a stop
    string matched in the text of one before the last (a speculative step adds several)."""

    text: str
    stopped: bool
    num_tokens: int = 0


def _decode_stream(
    tokenizer: PreTrainedTokenizerBase, context: list[int], skip_special_tokens: bool
) -> DecodeStream | None:
    """tokenizers' incremental decoder from `context`, when it decodes as `tokenizer.decode`
    does: a Rust-backed tokenizer that does not clean up spaces after decoding, and a tokenizers
    release whose stream takes a prefix. Else None (two `decode` calls a step instead)."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    except TypeError:  # tokenizers < 0.22: no prefix
        return None


class IncrementalDetokenizer:
    """Decodes a growing list of output tokens into text, a delta at a time.

    A delta is emitted only once it cannot change: text ending in an incomplete UTF-8 sequence
    (U+FFFD) waits for the next token, and when stop strings are set, the last
    `max(len(stop)) - 1` characters are held back until they cannot begin a stop string.
    Fast tokenizers decode through tokenizers' `DecodeStream` (one Rust call per token: at 256
    rows a step, two `decode` calls per row cost ~3.7 ms of the host's step on the H200's
    machine); others decode the last tokens twice per update and compare.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_text = ""  # final text so far (stop string removed)
        self._emitted = 0  # characters of output_text already returned
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.stopped = False
        self._stream = _decode_stream(tokenizer, self._ids, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], final: bool = False) -> DetokenizerUpdate:
        """Add tokens; returns the text that is now final. `final` flushes everything held back."""
        if self.stopped:
            return DetokenizerUpdate("", True)
        if self._stream is not None:
            num_tokens = self._step_stream(new_token_ids, final)
        elif self.stop and len(new_token_ids) > 1:  # one at a time: which token stops
            num_tokens = 0
            while num_tokens < len(new_token_ids) and not self.stopped:
                self._ids.append(new_token_ids[num_tokens])
                num_tokens += 1
                self._step_windows(final and num_tokens == len(new_token_ids))
        else:
            self._ids.extend(new_token_ids)
            self._step_windows(final)
            num_tokens = len(new_token_ids)
        hold = 0 if (final or self.stopped) else self._holdback
        end = max(self._emitted, len(self.output_text) - hold)
        delta = self.output_text[self._emitted : end]
        self._emitted = end
        return DetokenizerUpdate(delta, self.stopped, num_tokens)

    def _step_windows(self, final: bool) -> None:
        """Decode the tokens after the last emitted ones, with a few before them, and emit
        what they add to the text (unless it ends in an incomplete character)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            new_text = full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._append(new_text)

    def _step_stream(self, new_token_ids: list[int], final: bool) -> int:
        """Feed the tokens to the `DecodeStream`; at `final`, an incomplete character at the
        end is emitted as the full decode shows it (U+FFFD), as `_step_windows` does. Returns
        how many tokens were fed: all, or up to the one whose text completes a stop string."""
        assert self._stream is not None
        backend = self.tokenizer.backend_tokenizer
        for i, token in enumerate(new_token_ids):
            self._ids.append(token)
            text = self._stream.step(backend, token)
            if text is not None:
                self._read_offset = len(self._ids)
                self._append(text)
                if self.stopped:
                    return i + 1
        if final and self._read_offset < len(self._ids):
            self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
            self._step_windows(final=True)
        return len(new_token_ids)

    def _append(self, new_text: str) -> None:
        if not self.stop:
            self.output_text += new_text
            return
        # Search only where a stop string could end inside the new text.
        start = max(0, len(self.output_text) - self._holdback)
        text = self.output_text + new_text
        hits = [(i, s) for s in self.stop if (i := text.find(s, start)) != -1]
        if hits:
            index, stop = min(hits)
            self.output_text = text[: index + len(stop)] if self.include_stop else text[:index]
            self.stopped = True
        else:
            self.output_text = text


@dataclass(frozen=True)
class ChoiceUpdate:
    """One engine output as the client sees it.

    `stop_matched`: a stop string ended the choice before the engine did; the caller aborts the
    engine request with finish reason "stop", and the engine's final output then closes it.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_matched: bool = False


class ChoiceStream:
    """One choice of a request: its text, and how stop strings end it.

    The text up to a matched stop string goes out at once; tokens the engine produced after the
    match are dropped (`update` returns None) until its final output, whose finish reason is
    then "stop" whatever the engine said. Without a tokenizer there is no text and no stop
    string matching; token ids pass through.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.detokenizer = None
        if tokenizer is not None:
            self.detokenizer = IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            )
        self.stopped = False  # a stop string matched; waiting for the engine's final output

    @property
    def text(self) -> str:
        """The choice's text so far (without a matched stop string unless asked to keep it)."""
        return "" if self.detokenizer is None else self.detokenizer.output_text

    def update(self, new_token_ids: list[int], finish_reason: str | None) -> ChoiceUpdate | None:
        """Apply one engine output; None when the client sees nothing of it."""
        if self.stopped:
            return None if finish_reason is None else ChoiceUpdate("", [], "stop")
        if self.detokenizer is None:
            return ChoiceUpdate("", new_token_ids, finish_reason)
        update = self.detokenizer.update(new_token_ids, final=finish_reason is not None)
        if not update.stopped:
            return ChoiceUpdate(update.text, new_token_ids, finish_reason)
        # Tokens after the one that completed the stop string are dropped (several come in
        # one speculative step): the choice's tokens are those it has without speculation.
        kept = new_token_ids[: update.num_tokens]
        if finish_reason is not None:
            return ChoiceUpdate(update.text, kept, "stop")
        self.stopped = True
        return ChoiceUpdate(update.text, kept, None, stop_matched=True)
