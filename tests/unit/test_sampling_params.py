"""SamplingParams rejects every bad value with a message naming the field and the value."""

from __future__ import annotations

import math

import pytest

from tokenmill import SamplingParams
from tokenmill.sampling_params import SamplingDefaults, StructuredOutputsParams

BAD = [
    ("n", 0),
    ("n", 1.5),
    ("n", 4097),  # each choice is a sequence: bounded (MAX_N)
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
    # Beyond float32's range in the sampler (NaN weights)
    ("repetition_penalty", 1e-40),
    ("repetition_penalty", 1e39),
    ("temperature", 1e39),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("min_tokens", -1),
    ("stop", [""]),
    ("stop", [3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("logprobs", -1),
    ("logprobs", 21),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", 1.0),
    ("prompt_logprobs", True),
    ("temperature", True),
    ("stop", 5),  # not iterable
    ("stop", {"a": 1}),  # would have stopped at its keys
    ("stop_token_ids", 7),
    ("ignore_eos", "no"),  # truthy: ignored EOS
    ("skip_special_tokens", 0),
    ("include_stop_str_in_output", None),
    ("logit_bias", [1]),
    ("logit_bias", 5),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [-1]),
    ("allowed_token_ids", ["a"]),
    ("allowed_token_ids", 7),
    ("allowed_token_ids", {3: 1}),
    ("truncate_prompt_tokens", 0),
    ("bad_words", [""]),
    ("bad_words", ["x" * 257]),
    ("bad_words", [3]),
    ("bad_words", "word"),
    ("bad_words_token_ids", [[]]),
    ("bad_words_token_ids", [[-1]]),
    ("bad_words_token_ids", [3]),
    ("cache_salt", ""),
    ("priority", 1.5),
    ("priority", True),
    ("cache_salt", 5),
    ("cache_salt", "x" * 257),
    ("truncate_prompt_tokens", 2.5),
    ("truncate_prompt_tokens", True),
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
    # Too small for float32 arithmetic, and the argmax already: greedy.
    assert SamplingParams(temperature=1e-40).greedy
    assert SamplingParams(top_p=1e-46).greedy
    assert not SamplingParams(temperature=0.01, top_p=0.01).greedy


def test_defaults_fill_only_the_settings_a_request_leaves_unset() -> None:
    defaults = SamplingDefaults(temperature=0.0, top_k=5, repetition_penalty=1.2, max_tokens=7)
    params = defaults.sampling_params({"temperature": 0.7, "top_k": None, "top_p": None})
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.7, 5, 1.2)
    assert params.top_p == 1.0  # neither the request nor the model sets it
    # The model's max_tokens is left to intake (it caps it at the room in the context) ...
    assert params.max_tokens is None
    # ... and a request's own max_tokens wins.
    assert defaults.sampling_params({"max_tokens": 3}).max_tokens == 3


def test_the_callers_fallback_comes_after_the_models_defaults() -> None:
    fallback = {"temperature": 0.0, "max_tokens": 64}
    none = SamplingDefaults().sampling_params({}, fallback)
    assert (none.temperature, none.max_tokens) == (0.0, 64)
    model = SamplingDefaults(temperature=0.6).sampling_params({}, fallback)
    assert (model.temperature, model.max_tokens) == (0.6, 64)


def test_a_bad_default_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingDefaults(top_p=0.0)


@pytest.mark.parametrize(
    ("bias", "shown"),
    [({"3": 1.0}, "'3'"), ({True: 1.0}, "True"), ({-1: 1.0}, "-1"), ({3: 100.5}, "100.5"),
     ({3: math.inf}, "inf"), ({3: "1"}, "'1'"), ({i: 1.0 for i in range(4097)}, "4097 entries")],
)  # fmt: skip
def test_bad_logit_bias_names_the_field_and_the_entry(bias: dict, shown: str) -> None:
    with pytest.raises(ValueError, match="logit_bias") as info:
        SamplingParams(logit_bias=bias)
    assert shown in str(info.value)


def test_logit_bias_and_allowed_token_ids_are_normalised() -> None:
    params = SamplingParams(logit_bias={5: 1, 7: -2.5}, allowed_token_ids=(4, 5))
    assert params.logit_bias == {5: 1.0, 7: -2.5} and params.allowed_token_ids == [4, 5]
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(ValueError, match="allowed_token_ids cannot be combined"):
        SamplingParams(allowed_token_ids=[1], structured_outputs=StructuredOutputsParams(regex="a"))
