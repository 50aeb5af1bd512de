"""SamplingParams rejects every bad value with a message naming the field and the value."""

from __future__ import annotations

import math

import pytest

from tokenmill import SamplingParams

BAD = [
    ("n", 0),
    ("n", 1.5),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("seed", 1.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3),
    ("repetition_penalty", 0),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("min_tokens", -1),
    ("stop", [""]),
    ("stop", [3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("logprobs", -1),
    ("logprobs", 21),
    ("temperature", True),
]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_bad_value_raises_value_error_naming_the_field(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name) as info:
        SamplingParams(**{name: value})
    assert repr(value) in str(info.value)


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_stop_string_is_promoted_to_a_list() -> None:
    assert SamplingParams(stop="END").stop == ["END"]


def test_defaults_are_valid_and_greedy_is_derived() -> None:
    assert not SamplingParams().greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
