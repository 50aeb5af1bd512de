"""Each kind of structured-output constraint as an xgrammar grammar, and its validity check."""

from __future__ import annotations

import functools
import json
import re

import xgrammar as xgr

# xgrammar's JSON string characters let through UTF-16 surrogates (invalid UTF-8, so the text
# decodes to U+FFFD) and, in length-bounded strings, raw control characters (JSON forbids them).
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\uD800-\uDFFF]"
_LOOSE_STRING_CHARS = (r"[^\0-\x1f\"\\\r\n]", r"[^\"\\\r\n]")
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the useful part.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def build_grammar(kind: str, spec: str) -> xgr.Grammar:
    """The grammar of a constraint (`StructuredOutputsParams.kind` / `.spec`).

    JSON is compact (no free whitespace between tokens): a model that would emit whitespace
    forever cannot, so every JSON document ends.
    """
    if kind == "json":
        return _strict_strings(xgr.Grammar.from_json_schema(spec, any_whitespace=False))
    if kind == "json_object":
        return _strict_strings(
            xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        )
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        return xgr.Grammar.from_ebnf(choice_ebnf(choices))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    if kind == "structural_tag":
        return _strict_strings(xgr.Grammar.from_structural_tag(spec))
    raise ValueError(f"unknown structured output kind {kind!r}")


def _strict_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """The grammar with only valid JSON string characters inside its JSON strings."""
    text = str(grammar)
    strict = text
    for loose in _LOOSE_STRING_CHARS:
        strict = strict.replace(loose, _JSON_STRING_CHAR)
    return grammar if strict == text else xgr.Grammar.from_ebnf(strict)


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (escaped as JSON string literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@functools.lru_cache(maxsize=1024)
def check_grammar(kind: str, spec: str) -> None:
    """Raise `ValueError` naming the field if the constraint does not parse.

    Cached: a request's params are validated again in every process it crosses.
    """
    try:
        build_grammar(kind, spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        text = str(exc).strip()
        message = _LOCATION.sub("", text.splitlines()[0]) if text else type(exc).__name__
        raise ValueError(f"structured_outputs.{kind} is invalid: {message}") from None
