"""StructuredOutputsParams: exactly one constraint, and a bad schema, regex or grammar is a
ValueError naming it (checked by parsing, as the compile would)."""

from __future__ import annotations

import msgspec
import pytest

from tokenmill import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"json": {"type": "nonsense"}}, "structured_outputs.json is invalid"),
        ({"json": "{not json"}, "structured_outputs.json is invalid"),
        ({"regex": "(unclosed"}, "structured_outputs.regex is invalid"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar is invalid"),
        ({"grammar": ""}, "structured_outputs.grammar must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", 3]}, "structured_outputs.choice must be a non-empty list"),
        ({"structural_tag": {"type": "other"}}, "structured_outputs.structural_tag is invalid"),
        ({"json": 5}, "structured_outputs.json must be a dict or JSON text"),
    ],
)
def test_invalid_constraints_raise_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_rejects_a_non_params_constraint() -> None:
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]


def test_kind_and_spec_key_the_compile_cache() -> None:
    a = StructuredOutputsParams(json={"b": 1, "type": "object"} | {"properties": {}})
    b = StructuredOutputsParams(json='{"properties": {}, "b": 1, "type": "object"}')
    assert a.kind == "json" and a.spec == '{"b": 1, "properties": {}, "type": "object"}'
    assert b.kind == "json"  # text is kept as given: its own cache entry, the same grammar
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(choice=["x", "y"]).spec == '["x", "y"]'


def test_params_cross_processes_as_msgpack() -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
