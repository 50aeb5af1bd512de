"""Incremental detokenization: deltas concatenate to the full text, never split a character."""

from __future__ import annotations

import pytest

from tokenmill.testing.checkpoints import build_tokenizer
from tokenmill.tokenization.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


TEXTS = ["Hello world! How are you today?", "你好，世界。🎉🚀 café naïve", "a 🎉b"]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_rebuilds_the_text_without_broken_characters(tokenizer, text) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], stop=[])
    deltas = [detok.update([t], final=i == len(ids) - 1).text for i, t in enumerate(ids)]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # Multi-byte characters span several byte-level tokens, so some steps emit nothing.
    if any(ord(c) > 127 for c in text):
        assert len([d for d in deltas if d]) < len(ids)


def test_stop_string_truncates_and_holds_back_possible_prefixes(tokenizer) -> None:
    ids = tokenizer.encode("Hello world! How are you", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["How"])
    streamed = ""
    for t in ids:
        update = detok.update([t])
        streamed += update.text
        assert "Hello world! ".startswith(streamed)  # "H" of "How" is never streamed
        if update.stopped:
            break
    assert detok.stopped
    assert detok.output_text == "Hello world! "
    assert streamed == detok.output_text


def test_stop_string_can_be_kept(tokenizer) -> None:
    ids = tokenizer.encode("Hello world! How are you", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["world"], include_stop_str_in_output=True)
    for t in ids:
        if detok.update([t]).stopped:
            break
    assert detok.output_text == "Hello world"


def test_final_update_flushes_held_back_text(tokenizer) -> None:
    ids = tokenizer.encode("abc", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["xyz!"])
    text = "".join(detok.update([t], final=i == len(ids) - 1).text for i, t in enumerate(ids))
    assert text == "abc"
