"""JSON schemas the structured-output tests generate against: each bounded, so that a random
model at temperature 1 reaches the end of its document within a few hundred tokens."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 8}

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested_object": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "owner": {
                "type": "object",
                "properties": {"name": NAME, "active": {"type": "boolean"}},
                "required": ["name", "active"],
            },
        },
        "required": ["id", "owner"],
    },
    "array_of_enums": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "status": {"type": "string", "enum": ["open", "closed"]},
        },
        "required": ["tags", "status"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": -20, "maximum": 20},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["count", "score"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": NAME,
            "subtitle": NAME,
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "rating": {"type": ["integer", "null"], "minimum": 1, "maximum": 5},
        },
        "required": ["title"],
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {
            "start": {"$ref": "#/$defs/point"},
            "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 3},
        },
        "required": ["start", "path"],
    },
}
