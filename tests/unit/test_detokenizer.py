"""Incremental detokenization: deltas concatenate to the full text, never split a character."""

from __future__ import annotations

import random

import pytest

from tokenmill.config import DEMO_MODEL_DIR
from tokenmill.sampling_params import SamplingParams
from tokenmill.testing.checkpoints import build_metaspace_tokenizer, build_tokenizer
from tokenmill.tokenization.detokenizer import ChoiceStream, IncrementalDetokenizer
from tokenmill.tokenization.tokenizer import load_tokenizer


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


@pytest.mark.parametrize("decoder", ["stream", "windows"])
@pytest.mark.parametrize("finished", [False, True])
def test_tokens_after_a_stop_string_in_one_update_are_dropped(
    tokenizer, decoder: str, finished: bool
) -> None:
    """A speculative step adds several tokens at once: the choice keeps those up to the one
    whose text completes the stop string, as it would receiving them one a step."""
    ids = tokenizer.encode("Hello world! How are you", add_special_tokens=False)
    stops = [i for i in range(len(ids)) if "How" in tokenizer.decode(ids[: i + 1])]
    end = stops[0] + 1  # tokens up to the one that completes "How"
    assert end < len(ids)
    params = SamplingParams(stop=["How"])
    choice = ChoiceStream(tokenizer, [], params)
    if decoder == "windows":
        choice.detokenizer._stream = None
    update = choice.update(ids, "length" if finished else None)
    assert update is not None and update.token_ids == ids[:end]
    assert update.text == choice.text == "Hello world! "
    assert update.finish_reason == ("stop" if finished else None)
    assert update.stop_matched is not finished


def test_final_update_flushes_held_back_text(tokenizer) -> None:
    ids = tokenizer.encode("abc", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["xyz!"])
    text = "".join(detok.update([t], final=i == len(ids) - 1).text for i, t in enumerate(ids))
    assert text == "abc"


def _deltas(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> list[str]:
    """Feed `ids` `chunk` at a time (speculative steps add several); the deltas returned."""
    parts = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    return [detok.update(p, final=i == len(parts) - 1).text for i, p in enumerate(parts)]


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "demo"])
def test_the_decode_stream_gives_the_text_of_two_decodes_a_step(kind: str) -> None:
    corpus = [*TEXTS, "The tutorial explains how to define a function in Python."]
    tokenizer = {
        "byte_level": build_tokenizer,
        "metaspace": lambda: build_metaspace_tokenizer(corpus * 4),
        "demo": lambda: load_tokenizer(str(DEMO_MODEL_DIR)),
    }[kind]()
    rng = random.Random(kind)
    specials = list(tokenizer.all_special_ids)
    for trial in range(40):
        text = " ".join(rng.sample(corpus, 2))
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids = [rng.choice(specials) if rng.random() < 0.05 else t for t in ids]  # specials too
        if trial % 4 == 0:  # random ids: byte tokens that never form a character, ...
            ids = [rng.randrange(len(tokenizer)) for _ in range(30)]
        prompt = tokenizer.encode(rng.choice(corpus), add_special_tokens=False)
        skip, chunk = trial % 2 == 0, 1 + trial % 3
        streamed = IncrementalDetokenizer(tokenizer, prompt, [], skip_special_tokens=skip)
        windows = IncrementalDetokenizer(tokenizer, prompt, [], skip_special_tokens=skip)
        assert streamed._stream is not None
        windows._stream = None  # the other path: two decodes per update
        deltas = _deltas(streamed, ids, chunk)
        assert "".join(deltas) == "".join(_deltas(windows, ids, chunk)), (trial, ids)
        assert streamed.output_text == windows.output_text
        if "\ufffd" not in windows.output_text:  # (a special token can split a character)
            assert all("\ufffd" not in d for d in deltas)
