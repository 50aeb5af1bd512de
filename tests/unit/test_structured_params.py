"""StructuredOutputsParams: exactly one constraint, and a bad schema, regex or grammar is a
ValueError naming it (checked by parsing, as the compile would)."""

from __future__ import annotations

import time

import msgspec
import pytest

from tokenmill import SamplingParams, StructuredOutputsParams
from tokenmill.sampling_params import (
    MAX_OPTIONAL_PROPERTY_PAIRS,
    MAX_PATTERN_REPEATS,
    MAX_STRUCTURED_CHARS,
    MAX_STRUCTURED_DEPTH,
    json_depth,
    optional_property_pairs,
    pattern_repeats,
)


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
        # A schema outside the document: xgrammar read none, and allowed any JSON.
        ({"json": {"$ref": "http://example.com/s.json"}}, "structured_outputs.json refers to"),
        ({"json": '{"items": {"$ref": "other.json#/a"}}'}, "structured_outputs.json refers to"),
    ],
)
def test_invalid_constraints_raise_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_references_within_the_schema_are_read() -> None:
    schema = {"$defs": {"a": {"type": "integer"}}, "items": {"$ref": "#/$defs/a"}}
    assert StructuredOutputsParams(json=schema).kind == "json"


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


def _nested_arrays(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _as_text(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + "{}" + "}" * depth


def test_json_depth_counts_objects_and_arrays_of_text_or_parsed_documents() -> None:
    assert json_depth({"a": [1, {"b": []}]}, 10) == 4
    assert json_depth('{"a": "[[[{", "b": [1, {"c": "\\"["}]}', 10) == 3  # strings skipped
    assert json_depth("3", 10) == json_depth(3, 10) == 0
    assert json_depth("[" * 10**6, 5) == 6  # stops once past the limit


@pytest.mark.parametrize(
    "kwargs",
    [
        # Parsing cost grows with the square of the nesting (1,000 levels took minutes in the
        # API server's event loop); a dict this deep made json.dumps raise RecursionError.
        {"json": _nested_arrays(MAX_STRUCTURED_DEPTH)},
        {"json": _nested_arrays(5000)},
        {"json": _as_text(MAX_STRUCTURED_DEPTH)},
        {"structural_tag": "[" * 100_000},
    ],
    ids=["dict", "deep-dict", "text", "tag-text"],
)
def test_constraints_nested_too_deep_are_refused_at_once(kwargs: dict) -> None:
    kind = next(iter(kwargs))
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"structured_outputs.{kind} nests more than 64 levels"):
        StructuredOutputsParams(**kwargs)
    assert time.monotonic() - started < 1


def test_constraints_nested_within_the_limit_are_accepted() -> None:
    depth = MAX_STRUCTURED_DEPTH // 2 - 1  # two JSON levels per array schema
    assert StructuredOutputsParams(json=_nested_arrays(depth)).kind == "json"
    assert StructuredOutputsParams(json=_as_text(depth)).kind == "json"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"regex": "a" * (MAX_STRUCTURED_CHARS + 1)},
        {"grammar": 'root ::= "' + "a" * MAX_STRUCTURED_CHARS + '"'},
        {"choice": ["word"] * MAX_STRUCTURED_CHARS},
        {"json": {"enum": ["v"] * MAX_STRUCTURED_CHARS}},
    ],
    ids=["regex", "grammar", "choice", "json"],
)
def test_constraints_over_the_length_limit_are_refused(kwargs: dict) -> None:
    kind = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"structured_outputs.{kind} is .* characters long"):
        StructuredOutputsParams(**kwargs)


def _pattern_tag(pattern: str) -> dict:
    """A structural tag whose JSON schema holds `pattern`."""
    schema = {"type": "string", "pattern": pattern}
    return {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}}


@pytest.mark.parametrize(
    "kwargs",
    [
        # xgrammar converts a schema's patterns in time quadratic in their repetition counts:
        # each of these took 19-25 s to parse, in every process the request crossed.
        {"json": {"type": "string", "pattern": "a{20000}"}},
        {"json": '{"type": "string", "pattern": "[a-z]{1,20000}"}'},
        {"json": {"type": "object", "patternProperties": {"^a{20000}$": {}}}},
        {"json": {"type": "object", "propertyNames": {"pattern": "a{20000,}"}}},
        {"json": {"anyOf": [{"type": "string", "pattern": "a{1500}"}] * 2}},  # in all
        {"structural_tag": _pattern_tag("a{20000}")},
    ],
    ids=["pattern", "text", "pattern-properties", "property-names", "two-patterns", "tag"],
)
def test_patterns_repeating_too_much_are_refused_at_once(kwargs: dict) -> None:
    kind = next(iter(kwargs))
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"structured_outputs.{kind} has regular expressions"):
        StructuredOutputsParams(**kwargs)
    assert time.monotonic() - started < 1


def test_pattern_repeats_add_up_the_larger_bound_of_each_count() -> None:
    date_like = {"pattern": r"\d{4}-\d{2,3}x{5,}", "properties": {"pattern": {}}}
    assert pattern_repeats(date_like) == 12
    assert pattern_repeats([{"patternProperties": {"a{7}": {"pattern": "b{1}"}}}]) == 8
    assert pattern_repeats({"pattern": "a{" + "9" * 5000 + "}"}) > MAX_PATTERN_REPEATS
    schema = {"type": "string", "pattern": f"[0-9]{{{MAX_PATTERN_REPEATS}}}"}
    assert StructuredOutputsParams(json=schema).kind == "json"  # at the limit: accepted


def _object(optional: int, required: int = 0) -> dict:
    """An object schema of `optional` optional and `required` required integer properties."""
    names = [f"p{i}" for i in range(optional + required)]
    return {"type": "object", "properties": {n: {"type": "integer"} for n in names},
            "required": names[optional:]}  # fmt: skip


@pytest.mark.parametrize(
    "kwargs",
    [
        # 2,000 optional properties passed every other check and took the engine's grammar
        # compiler a minute, holding up every structured-output request queued behind it.
        {"json": _object(2000)},
        {"json": {"type": "array", "items": [_object(200), _object(200)]}},  # in all
        {"structural_tag": {"type": "structural_tag",
                            "format": {"type": "json_schema", "json_schema": _object(300)}}},
    ],
    ids=["one-object", "two-objects", "tag"],
)  # fmt: skip
def test_objects_with_too_many_optional_properties_are_refused_at_once(kwargs: dict) -> None:
    kind = next(iter(kwargs))
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"structured_outputs.{kind} has objects with too many"):
        StructuredOutputsParams(**kwargs)
    assert time.monotonic() - started < 1


def test_optional_properties_are_counted_per_object_squared() -> None:
    """Required properties cost nothing; a `required` entry naming no property, or not a
    string, changes nothing; the bound is one object of its square root."""
    assert optional_property_pairs(_object(3, required=5)) == 9
    nested = {"properties": {"a": _object(2), "b": {}}, "required": ["a", "zz", {"x": 1}]}
    assert optional_property_pairs(nested) == 1 + 4
    assert optional_property_pairs({"properties": "not a map"}) == 0
    at_limit = _object(int(MAX_OPTIONAL_PROPERTY_PAIRS**0.5), required=1000)
    assert StructuredOutputsParams(json=at_limit).kind == "json"  # accepted
