"""Request intake: one set of rules for the offline LLM and the server (tokenmill/intake.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.intake import (
    ContextLimits,
    IntakeError,
    check_prompt,
    child_request_id,
    fan_out,
    prepare,
    split_child_request_id,
)
from tokenmill.sampling_params import MAX_SEED, SamplingParams
from tokenmill.testing.checkpoints import build_tokenizer
from tokenmill.tokenization.detokenizer import ChoiceStream

LIMITS = ContextLimits(vocab_size=100, max_model_len=32)


@pytest.mark.parametrize(
    ("prompt", "params", "param", "fragments"),
    [
        ([], SamplingParams(), "prompt", ["at least one token"]),
        ([5, 100, -1], SamplingParams(), "prompt", ["token ids must be in [0, 100)", "[100, -1]"]),
        (list(range(32)), SamplingParams(), "prompt", ["prompt has 32 tokens", "32"]),
        ([1] * 20, SamplingParams(max_tokens=13), "max_tokens", ["20", "13", "33", "32"]),
        ([1] * 20, SamplingParams(max_tokens=None, min_tokens=13), "min_tokens", ["(12"]),
        ([1], SamplingParams(stop_token_ids=[100]), "stop_token_ids", ["[0, 100)"]),
        ([1], SamplingParams(logit_bias={3: 1, 100: 1}), "logit_bias", ["[0, 100)", "[100]"]),
        ([1], SamplingParams(allowed_token_ids=[7, 250]), "allowed_token_ids", ["[250]"]),
    ],
)
def test_a_request_that_can_never_run_names_its_field(prompt, params, param, fragments) -> None:
    with pytest.raises(IntakeError) as info:
        check_prompt(prompt, params, LIMITS)
    assert info.value.param == param
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("prompt", "shown"),
    [
        ([1, True, 2.0], "[True, 2.0]"),
        (np.array([0]), "[np.int64(0)]"),  # an array is not a list of ints, even one of 0
        (np.array([3, 4]), "[np.int64(3), np.int64(4)]"),
        (torch.tensor([0]), "[tensor(0)]"),
        ((1, "2"), "['2']"),
    ],
)
def test_ids_must_be_python_ints(prompt, shown: str) -> None:
    # Direct engine users may pass anything: the type is checked before any range.
    with pytest.raises(IntakeError, match="Python integers") as info:
        check_prompt(prompt, SamplingParams(), LIMITS)
    assert info.value.param == "prompt" and shown in str(info.value)


def test_range_errors_do_not_mention_types() -> None:
    with pytest.raises(IntakeError) as info:
        check_prompt([1, 100], SamplingParams(), LIMITS)
    assert str(info.value) == "prompt token ids must be in [0, 100), got [100]"


def test_absent_max_tokens_is_the_room_left_in_the_context() -> None:
    assert check_prompt([1] * 20, SamplingParams(max_tokens=None), LIMITS).max_tokens == 12
    assert check_prompt([1] * 20, SamplingParams(max_tokens=12), LIMITS).max_tokens == 12


def test_absent_max_tokens_is_the_models_default_within_the_room_left() -> None:
    limits = ContextLimits(vocab_size=100, max_model_len=32, default_max_tokens=8)
    assert check_prompt([1] * 10, SamplingParams(max_tokens=None), limits).max_tokens == 8
    # A default never makes a long prompt fail: it shrinks to the room left.
    assert check_prompt([1] * 28, SamplingParams(max_tokens=None), limits).max_tokens == 4
    # A request's own max_tokens is not capped by the default.
    assert check_prompt([1] * 10, SamplingParams(max_tokens=20), limits).max_tokens == 20


def test_fan_out_gives_each_choice_an_id_and_a_seed_of_its_own() -> None:
    children = prepare("req", [1, 2], SamplingParams(n=3, seed=MAX_SEED - 1), LIMITS)
    assert [c.request_id for c in children] == ["req:0", "req:1", "req:2"]
    # seed + index wraps modulo 2**64: the largest seed stays valid for every choice.
    assert [c.params.seed for c in children] == [MAX_SEED - 1, MAX_SEED, 0]
    assert all(c.params.n == 1 for c in children)
    assert [p.seed for _, p in fan_out("x", SamplingParams(n=2))] == [None, None]


def test_child_ids_split_back_even_when_the_client_id_has_colons() -> None:
    assert split_child_request_id(child_request_id("a:b", 7)) == ("a:b", 7)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_a_stop_string_ends_the_choice_and_later_tokens_are_dropped(tokenizer) -> None:
    ids = tokenizer.encode(" the end of it", add_special_tokens=False)
    stream = ChoiceStream(tokenizer, [1], SamplingParams(stop=["end"]))
    updates = [stream.update([t], None) for t in ids]
    matched = [u for u in updates if u is not None and u.stop_matched]
    assert len(matched) == 1 and stream.text == " the "
    assert updates[updates.index(matched[0]) + 1 :] == [None] * (
        len(updates) - 1 - updates.index(matched[0])
    )
    final = stream.update([], "abort")  # the engine's answer to the abort
    assert final is not None and final.finish_reason == "stop" and final.token_ids == []


def test_a_stop_string_on_the_last_token_wins_over_length(tokenizer) -> None:
    ids = tokenizer.encode(" stop here", add_special_tokens=False)
    stream = ChoiceStream(tokenizer, [1], SamplingParams(stop=["here"]))
    updates = [
        stream.update([t], "length" if i == len(ids) - 1 else None) for i, t in enumerate(ids)
    ]
    assert updates[-1] is not None and updates[-1].finish_reason == "stop"
    assert not any(u.stop_matched for u in updates if u is not None)


def test_without_a_tokenizer_token_ids_pass_through() -> None:
    stream = ChoiceStream(None, [1], SamplingParams(stop=["x"]))
    update = stream.update([4, 5], "length")
    assert update is not None and update.token_ids == [4, 5] and update.text == ""


def test_truncate_prompt_tokens_keeps_the_last_tokens() -> None:
    params = SamplingParams(truncate_prompt_tokens=5, max_tokens=3)
    (child,) = prepare("r", list(range(1, 41)), params, LIMITS)
    assert child.prompt_token_ids == [36, 37, 38, 39, 40]
    (short,) = prepare("r", [7, 8], params, LIMITS)
    assert short.prompt_token_ids == [7, 8]
    # Too long for the context without truncation, fine with it.
    with pytest.raises(IntakeError):
        prepare("r", [1] * 40, SamplingParams(max_tokens=3), LIMITS)


def test_truncation_never_cuts_a_prompt_with_images() -> None:
    params = SamplingParams(truncate_prompt_tokens=5)
    with pytest.raises(IntakeError) as info:
        prepare("r", list(range(1, 11)), params, LIMITS, has_images=True)
    assert info.value.param == "truncate_prompt_tokens"
    assert prepare("r", [1, 2], params, LIMITS, has_images=True)[0].prompt_token_ids == [1, 2]
