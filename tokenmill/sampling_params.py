"""SamplingParams: how to pick each next token and when to stop, validated on construction."""

from __future__ import annotations

import dataclasses
import json as json_lib
import math
import re
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

MAX_LOGPROBS = 20
# The sampler computes in float32, where a temperature or repetition penalty beyond these
# bounds overflows (logits / 1e-38 and 1e39 are infinite; -inf / inf is NaN): NaN weights then
# sample token 0 whatever the model says. Temperatures below MIN_TEMPERATURE are greedy (as in
# vLLM: the distribution is the argmax already); other values outside the bounds are refused.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e6
MIN_REPETITION_PENALTY = 1e-6
MAX_REPETITION_PENALTY = 1e6
# A top_p this small keeps only the most likely token (whose probability is at least
# 1 / vocabulary size), i.e. it is greedy; below float32's smallest number it would round to 0
# and keep no token at all.
MIN_TOP_P = 1e-8
# Integers travel between processes as msgpack (64-bit at most); seeds are unsigned, as torch's.
MAX_INT = 2**63 - 1
# Most choices one request may have: each is a sequence of its own (a request object, KV pages,
# a slot in the batch), so `n` is bounded like every other input (the server's --max-n too).
MAX_N = 4096
MAX_SEED = 2**64 - 1
# A constraint is parsed in every process it crosses (the API server's event loop and the
# engine core's scheduler thread included) and compiled on the engine's one compile thread;
# both costs grow with its length and, for JSON, with the square of its nesting (a 286 kB
# schema of 150-deep objects took 18 s to parse, one 1,000 deep minutes). OpenAI allows 10
# levels of objects in a schema, about 20-40 levels of JSON.
MAX_STRUCTURED_CHARS = 128 * 1024
MAX_STRUCTURED_DEPTH = 64
# xgrammar turns the regular expressions of a JSON schema (`pattern`, `patternProperties`; a
# structural tag's too) into rules in time quadratic in their repetition counts: a 60-byte
# schema with `"pattern": "a{20000}"` took 19 s in each process it crossed (the engine core's
# loop stalled meanwhile), `a{60000}` minutes; 2,048 repetitions in all take 0.2 s.
MAX_PATTERN_REPEATS = 2048
# Its compile time also grows with the square of an object's optional properties (not under
# `required`): the sum over objects of that count squared is bounded by one object of 256
# (~1 s on a 2-core CPU; 2,000 optional properties took a minute, holding up every
# structured-output request behind it on the compile thread).
MAX_OPTIONAL_PROPERTY_PAIRS = 256 * 256
# OpenAI's range of a logit bias; the most entries a request's map may hold (each one is an
# element the sampler adds on the device, at every step of the request).
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 4096
# The most ids `allowed_token_ids` may list (a vocabulary of 256 k tokens at most).
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# `bad_words`: how many, how long each (characters; tokens of a tokenized one); each is checked
# against the newest tokens of every step the request samples in.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_CACHE_SALT_CHARS = 256


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output, as in vLLM: exactly one of the fields is set.

    `json`: a JSON schema (dict or JSON text) the output must satisfy; `regex`: a regular
    expression the whole output matches; `choice`: the output is one of these strings;
    `grammar`: an EBNF grammar (xgrammar's dialect, rule `root`); `json_object`: any JSON object;
    `structural_tag`: an xgrammar structural tag (dict or JSON text; tool calls use it). JSON is
    generated compactly (no free whitespace), so even a model that rambles ends its document. An
    invalid schema, regex, grammar or tag raises `ValueError` naming the field, as does one longer
    than MAX_STRUCTURED_CHARS (as JSON text) or, for JSON, nested deeper than
    MAX_STRUCTURED_DEPTH.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(STRUCTURED_KINDS)}, got {kinds or 'none'}"
            )
        kind = kinds[0]
        value = getattr(self, kind)
        if kind == "choice":
            _check(
                isinstance(value, list) and value and all(isinstance(c, str) and c for c in value),
                "structured_outputs.choice must be a non-empty list of non-empty strings",
                value,
            )
        elif kind == "json_object":
            _check(value is True, "structured_outputs.json_object must be a boolean", value)
        elif kind in ("json", "structural_tag"):
            message = f"structured_outputs.{kind} must be a dict or JSON text"
            _check(isinstance(value, str | dict), message, value)
            if isinstance(value, dict):
                # Before `spec`: json.dumps recurses, and a deep dict raises RecursionError.
                _check_depth(f"structured_outputs.{kind}", value)
        else:
            message = f"structured_outputs.{kind} must be a non-empty string"
            _check(isinstance(value, str) and value, message, value)
        spec = self.spec
        if len(spec) > MAX_STRUCTURED_CHARS:
            raise ValueError(
                f"structured_outputs.{kind} is {len(spec)} characters long"
                f"{'' if isinstance(value, str) else ' as JSON text'}, more than the "
                f"{MAX_STRUCTURED_CHARS} a constraint may have"
            )
        if isinstance(value, str) and kind in ("json", "structural_tag"):
            _check_depth(f"structured_outputs.{kind}", value)  # after the length: it scans it
        if kind in ("json", "structural_tag"):
            _check_document(f"structured_outputs.{kind}", value)
        # Imported here: xgrammar is loaded only by processes that see a constrained request.
        from tokenmill.structured.grammar import check_grammar

        check_grammar(kind, spec)

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar, json_object or structural_tag."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (dicts as canonical JSON): with `kind`, the compile cache key."""
        value = getattr(self, self.kind)
        if isinstance(value, dict | list):
            return json_lib.dumps(value, sort_keys=True, ensure_ascii=False)
        return "" if value is True else value


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _check_depth(name: str, value: str | dict[str, Any]) -> None:
    """Raise `ValueError` naming `name` if the JSON document `value` (text or parsed) nests
    deeper than MAX_STRUCTURED_DEPTH."""
    depth = json_depth(value, MAX_STRUCTURED_DEPTH)
    if depth > MAX_STRUCTURED_DEPTH:
        raise ValueError(
            f"{name} nests more than {MAX_STRUCTURED_DEPTH} levels of objects and arrays deep; "
            "flatten it (e.g. with $defs and $ref)"
        )


def _check_document(name: str, value: str | dict[str, Any]) -> None:
    """Raise `ValueError` naming `name` where the JSON document `value` (a schema or structural
    tag, as text or parsed; parsed once here) would take xgrammar too long to compile or
    refers outside itself (text that is no JSON is left to the grammar's own check)."""
    try:
        document = json_lib.loads(value) if isinstance(value, str) else value
    except ValueError:
        return
    _check_compile_cost(name, document)
    _check_references(name, document)


def _check_compile_cost(name: str, document: Any) -> None:
    """Raise `ValueError` naming `name` where the parsed JSON document would take xgrammar
    too long to compile: its regular expressions repeat more than MAX_PATTERN_REPEATS times
    in all, or its objects' optional properties exceed MAX_OPTIONAL_PROPERTY_PAIRS."""
    repeats = pattern_repeats(document)
    if repeats > MAX_PATTERN_REPEATS:
        raise ValueError(
            f"{name} has regular expressions (pattern, patternProperties) whose repetition "
            f"counts add up to {repeats}, more than the {MAX_PATTERN_REPEATS} a constraint may "
            "have; use minLength / maxLength to bound a string's length"
        )
    pairs = optional_property_pairs(document)
    if pairs > MAX_OPTIONAL_PROPERTY_PAIRS:
        raise ValueError(
            f"{name} has objects with too many optional properties (the sum over its objects "
            f"of their number squared is {pairs}, more than {MAX_OPTIONAL_PROPERTY_PAIRS}, "
            f"e.g. one object of {math.isqrt(MAX_OPTIONAL_PROPERTY_PAIRS)}); list more of "
            "them under required, or split the object"
        )


def _check_references(name: str, document: Any) -> None:
    """Raise `ValueError` naming `name` where the parsed JSON document has a `$ref` to a
    schema outside itself: xgrammar reads none (it compiled `{"$ref": "http://..."}` to any
    JSON), so the output would not follow what the client asked for."""
    for node in _json_objects(document):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise ValueError(
                f"{name} refers to {ref[:200]!r}: only references within the schema (#/...) "
                "are read; put the schema it names under $defs"
            )


def _json_objects(document: Any) -> list[dict[str, Any]]:
    """Every object (dict) of a parsed JSON document, at any depth, found without recursion."""
    objects: list[dict[str, Any]] = []
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            objects.append(node)
            stack.extend(node.values())
    return objects


# A repetition count in a regular expression: `{n}`, `{n,}` or `{n,m}` (escaped braces too:
# counting a literal `\{5\}` errs on the safe side).
_REPETITION = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def pattern_repeats(document: Any) -> int:
    """The repetition counts (of `{n,m}` the larger) of the regular expressions in a parsed JSON
    schema or structural tag, added up: `pattern` values and `patternProperties` keys at any
    depth."""
    patterns: list[str] = []
    for node in _json_objects(document):
        if isinstance(pattern := node.get("pattern"), str):
            patterns.append(pattern)
        if isinstance(keyed := node.get("patternProperties"), dict):
            patterns.extend(keyed)
    return sum(
        max(_count(low), _count(high))
        for pattern in patterns
        for low, high in _REPETITION.findall(pattern)
    )


def optional_property_pairs(document: Any) -> int:
    """The sum, over the objects of a parsed JSON schema (or structural tag) with `properties`,
    of the square of how many of them are not `required`: xgrammar's compile time grows with
    it (an object of 200 optional integer properties took 0.5 s on a 2-core CPU, 400 took
    2.0 s, 2,000 a minute; 3,000 required ones 0.7 s)."""
    pairs = 0
    for node in _json_objects(document):
        properties = node.get("properties")
        if not isinstance(properties, dict):
            continue
        required = node.get("required")
        names = {r for r in required if isinstance(r, str)} if isinstance(required, list) else ()
        listed = properties.keys() & names
        pairs += (len(properties) - len(listed)) ** 2
    return pairs


def _count(digits: str) -> int:
    """A repetition count's digits as a number (none: 0); past 9 digits, more than any limit
    (int() refuses more than 4,300 digits)."""
    return 10**9 if len(digits) > 9 else int(digits or 0)


def json_depth(value: Any, limit: int) -> int:
    """How deep objects and arrays nest in a JSON document, as text or parsed (a scalar is 0),
    counted without recursion; stops counting once past `limit`. Text need not be valid JSON:
    its brackets outside strings are counted."""
    if isinstance(value, str):
        return _text_depth(value, limit)
    deepest = 0
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            break
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest


def _text_depth(text: str, limit: int) -> int:
    deepest = depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif char in "]}":
            depth -= 1
    return deepest


@dataclass
class SamplingParams:
    """Per-request sampling settings, mirroring vLLM's `SamplingParams`.

    temperature 0 (below 1e-5) means greedy. `seed` makes a sampled request reproducible whatever
    else runs in the same batch. Penalties follow OpenAI (presence/frequency, on generated tokens)
    and transformers (repetition, on prompt and generated tokens). `logprobs` k reports each
    generated token's logprob and the top k; `prompt_logprobs` k the same for every prompt
    token after the first, given the tokens before it (a request asking for them prefills its
    whole prompt: it reads no cached prefix). `logit_bias` (OpenAI's) is added to the logits
    before the penalties, as in vLLM; `allowed_token_ids` (vLLM's) masks every other id, and
    where all of them are stop tokens `min_tokens` does not ban them. Every bad value raises
    `ValueError` naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's: words never to generate; tokenized by `LLM` and the server (`with_bad_words`)
    # into `bad_words_token_ids`, which engine users may also set directly.
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's: requests share cached prefixes only with requests of the same salt (tenants
    # cannot learn from cache hits what others sent).
    cache_salt: str | None = None
    # vLLM's: the scheduling priority under `--scheduling-policy priority` (lower runs first).
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # Before `list()`: a number is not iterable (a TypeError naming nothing), a dict or a
        # set would pass its keys on.
        for name in ("stop", "stop_token_ids", "bad_words"):
            value = getattr(self, name)
            ok = value is None or isinstance(value, list | tuple)
            _check(ok, f"{name} must be a list", value)
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        self._check_bad_words()
        self._normalize_token_maps()
        self._validate()

    def _check_bad_words(self) -> None:
        words, ids = self.bad_words, self.bad_words_token_ids
        _check(
            len(words) <= MAX_BAD_WORDS
            and all(
                isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS
                and is_valid_text(w)
                for w in words
            ),
            f"bad_words must be at most {MAX_BAD_WORDS} non-blank strings of at most "
            f"{MAX_BAD_WORD_CHARS} characters",
            words if len(words) <= MAX_BAD_WORDS else f"{len(words)} words",
        )  # fmt: skip
        _check(
            ids is None
            or (
                isinstance(ids, list | tuple)
                and len(ids) <= 2 * MAX_BAD_WORDS
                and all(
                    isinstance(seq, list | tuple) and 0 < len(seq) <= MAX_BAD_WORD_CHARS
                    and all(_is_int(t) and 0 <= t <= MAX_INT for t in seq)
                    for seq in ids
                )
            ),
            f"bad_words_token_ids must be at most {2 * MAX_BAD_WORDS} non-empty lists of token "
            "ids",
            ids if ids is None or len(ids) <= 2 * MAX_BAD_WORDS else f"{len(ids)} lists",
        )  # fmt: skip
        if ids is not None:
            self.bad_words_token_ids = [list(seq) for seq in ids]

    def _normalize_token_maps(self) -> None:
        """`logit_bias` as a dict (empty: None), `allowed_token_ids` as a list, each checked
        for shape and bounds before anything iterates it (ids against the vocabulary: the
        engine's intake)."""
        bias = self.logit_bias
        _check(bias is None or isinstance(bias, Mapping), "logit_bias must be a map", bias)
        _check(
            bias is None or len(bias) <= MAX_LOGIT_BIAS_ENTRIES,
            f"logit_bias must have at most {MAX_LOGIT_BIAS_ENTRIES} entries",
            f"{len(bias or ())} entries",
        )
        for token, value in (bias or {}).items():
            _check(
                _is_int(token) and 0 <= token <= MAX_INT,
                "logit_bias keys must be token ids (integers >= 0)",
                token,
            )
            _check(
                _is_number(value) and abs(value) <= MAX_LOGIT_BIAS,
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                value,
            )
        self.logit_bias = {t: float(v) for t, v in bias.items()} if bias else None
        allowed = self.allowed_token_ids
        _check(
            allowed is None or (isinstance(allowed, list | tuple) and len(allowed) > 0),
            "allowed_token_ids must be a non-empty list or None",
            allowed,
        )
        if allowed is None:
            return
        _check(
            len(allowed) <= MAX_ALLOWED_TOKEN_IDS,
            f"allowed_token_ids must list at most {MAX_ALLOWED_TOKEN_IDS} ids",
            f"{len(allowed)} ids",
        )
        _check(
            all(_is_int(t) and 0 <= t <= MAX_INT for t in allowed),
            "allowed_token_ids must be a list of integers >= 0",
            allowed,
        )
        self.allowed_token_ids = list(dict.fromkeys(allowed))  # each id once

    def _validate(self) -> None:
        _check(
            _is_int(self.n) and 1 <= self.n <= MAX_N,
            f"n must be an integer in [1, {MAX_N}]",
            self.n,
        )
        _check(
            _is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
            f"temperature must be in [0, {MAX_TEMPERATURE:g}]",
            self.temperature,
        )
        _check(
            _is_number(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]", self.top_p
        )
        _check(
            _is_int(self.top_k) and -1 <= self.top_k <= MAX_INT,
            "top_k must be an integer, -1 or 0 (disabled) or >= 1 (and < 2**63)",
            self.top_k,
        )
        _check(
            _is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]", self.min_p
        )
        _check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
            "seed must be an integer in [0, 2**64) or None",
            self.seed,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2]", value)
        _check(
            _is_number(self.repetition_penalty)
            and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
            f"{MAX_REPETITION_PENALTY:g}]",
            self.repetition_penalty,
        )
        _check(
            self.max_tokens is None
            or (_is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT),
            "max_tokens must be an integer >= 1 and < 2**63, or None",
            self.max_tokens,
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= MAX_INT,
            "min_tokens must be an integer >= 0 and < 2**63",
            self.min_tokens,
        )
        _check(
            self.truncate_prompt_tokens is None
            or (
                _is_int(self.truncate_prompt_tokens) and 1 <= self.truncate_prompt_tokens <= MAX_INT
            ),
            "truncate_prompt_tokens must be an integer >= 1 and < 2**63, or None",
            self.truncate_prompt_tokens,
        )
        _check(
            _is_int(self.priority) and -MAX_INT <= self.priority <= MAX_INT,
            "priority must be an integer in (-2**63, 2**63)",
            self.priority,
        )
        salt = self.cache_salt
        _check(
            salt is None
            or (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS
                and is_valid_text(salt)),
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
            "characters, or None",
            salt,
        )  # fmt: skip
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens must be <= max_tokens ({self.max_tokens})",
                self.min_tokens,
            )
        _check(
            all(isinstance(s, str) and s and is_valid_text(s) for s in self.stop),
            "stop must be a list of non-empty strings (valid Unicode)",
            self.stop,
        )
        _check(
            all(_is_int(t) and 0 <= t <= MAX_INT for t in self.stop_token_ids),
            "stop_token_ids must be a list of integers >= 0 and < 2**63",
            self.stop_token_ids,
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None",
                value,
            )
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, bool), f"{name} must be True or False", value)
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams or None",
            self.structured_outputs,
        )
        _check(
            self.allowed_token_ids is None or self.structured_outputs is None,
            "allowed_token_ids cannot be combined with structured_outputs (a grammar decides "
            "which tokens may follow)",
            self.allowed_token_ids,
        )

    @cached_property
    def logit_bias_table(self) -> tuple[array, array]:
        """`logit_bias` as int64 token ids and float32 values, built once: the sampler reads a
        request's map at each of its steps (4,096 entries of 256 rows as Python objects took
        1.2 s a step; as buffers, milliseconds)."""
        bias = self.logit_bias or {}
        return array("q", bias.keys()), array("f", bias.values())

    @cached_property
    def watches_output(self) -> bool:
        """Whether a bad word is longer than a token: whether its bans follow the newest
        tokens (its steps wait for them)."""
        return any(len(word) > 1 for word in self.bad_words_token_ids or ())

    @cached_property
    def max_bad_word_len(self) -> int:
        """The most tokens a bad word has before its last: how many newest tokens its bans
        follow."""
        return max((len(word) - 1 for word in self.bad_words_token_ids or ()), default=0)

    @cached_property
    def allowed_token_table(self) -> array:
        """`allowed_token_ids` as int64 ids, built once (as `logit_bias_table`)."""
        return array("q", self.allowed_token_ids or ())

    def for_choice(self, index: int) -> SamplingParams:
        """Settings of choice `index` of `n`: one sample, with a seed of its own if seeded.

        Choice i draws with `seed + i` (as vLLM), wrapped into [0, 2**64) so that the largest
        seed stays a valid one for every choice.
        """
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        """True when the next token is always the most likely one: temperature below
        MIN_TEMPERATURE, top_k 1 or top_p below MIN_TOP_P."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1 or self.top_p < MIN_TOP_P


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling settings for the requests that leave them unset: the model's own (its
    `generation_config.json`, `--generation-config auto`), or none (`vllm`: SamplingParams' own).

    `max_tokens` (the file's `max_new_tokens`) is not filled in here: a request without
    max_tokens keeps None, which intake resolves to this default, at most the room left in the
    context window (`intake.check_prompt`), so that a default never makes a long prompt fail.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        SamplingParams(**self.given())  # a bad value fails here, naming its field

    def given(self) -> dict[str, Any]:
        """The settings this holds (None: not set)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def sampling_params(
        self, given: Mapping[str, Any], fallback: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        """A request's settings: each value in `given` that is not None, else this default,
        else `fallback`'s (the caller's own defaults), else SamplingParams' own."""
        values = {**(fallback or {}), **self.given()}
        values.update({k: v for k, v in given.items() if v is not None})
        if given.get("max_tokens") is None and self.max_tokens is not None:
            values["max_tokens"] = None  # intake applies the default, within the context
        return SamplingParams(**values)


def is_valid_text(text: str) -> bool:
    """True unless `text` holds an unpaired surrogate (which no UTF-8 encoder accepts)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, message: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{message}, got {value!r}")
