"""Request intake: the checks and the `n` fan-out every request goes through before it runs.

The offline `LLM` and the server's tokenizer workers both call `prepare`; the engine core calls
`check_prompt` again when a request is added, since it must never hold a request that can not run
(but for `LLM`'s, which `prepare` made a call before in the same process: `checked=True`).
The rules, written once:

- a prompt longer than `truncate_prompt_tokens` keeps its last that many tokens (not one with
  images);
- the prompt has at least one token, every id inside the vocabulary, and leaves room for one
  output token in the context window (`max_model_len`);
- `max_tokens` absent means the room left in the context (as vLLM), or the model's default
  (`generation_config.json`'s `max_new_tokens`: `ContextLimits.default_max_tokens`) if smaller;
  given, prompt + max_tokens must fit; `min_tokens <= max_tokens`; `stop_token_ids` lie inside
  the vocabulary;
- a request of `n` choices becomes `n` engine requests: choice i of request R is `"R:i"` and
  samples with `params.for_choice(i)` (one sample; seed + i when seeded).

Stop strings are the other half of intake's promise, applied to the output:
`tokenization.detokenizer.ChoiceStream` ends a choice at one, for both users alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.sampling_params import SamplingParams

# Shown with the offending values; a prompt can hold millions of ids.
_MAX_SHOWN = 5


class IntakeError(ValueError):
    """A request that can never run; `param` names the request field to blame."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ContextLimits:
    """What a request must fit: the model's vocabulary and its context window; and the
    `max_tokens` of a request that gives none, at most (None: the room left in the context)."""

    vocab_size: int
    max_model_len: int
    default_max_tokens: int | None = None
    priority_scheduling: bool = False  # requests may set `priority` (else only 0)


def prepare(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    limits: ContextLimits,
    has_images: bool = False,
) -> list[ChildRequest]:
    """The engine requests of one client request (its prompt truncated as `params` say);
    raises `IntakeError` if it can never run."""
    ids = truncate_prompt(prompt_token_ids, params, has_images)
    checked = check_prompt(ids, params, limits)
    return [
        ChildRequest(child_id, ids, child_params)
        for child_id, child_params in fan_out(request_id, checked)
    ]


def truncate_prompt(
    prompt_token_ids: list[int], params: SamplingParams, has_images: bool = False
) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` ids (all of them if it is shorter or unset,
    as vLLM's left truncation); a prompt with images is never cut (their placeholder tokens
    must stay whole)."""
    keep = params.truncate_prompt_tokens
    if keep is None or len(prompt_token_ids) <= keep:
        return prompt_token_ids
    if has_images:
        raise IntakeError(
            f"truncate_prompt_tokens ({keep}) would cut a prompt with images "
            f"({len(prompt_token_ids)} tokens); send fewer images or less text",
            "truncate_prompt_tokens",
        )
    return list(prompt_token_ids[-keep:])


@dataclass(frozen=True)
class ChildRequest:
    """One engine request of a client request's `n` choices."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def check_prompt(
    prompt_token_ids: Sequence[int], params: SamplingParams, limits: ContextLimits
) -> SamplingParams:
    """`params` with `max_tokens` resolved; raises `IntakeError` if the request can never run."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise IntakeError("prompt must contain at least one token, got none", "prompt")
    _check_ids(prompt_token_ids, limits.vocab_size, "prompt token ids", "prompt")
    if params.priority and not limits.priority_scheduling:
        raise IntakeError(
            f"priority is {params.priority}, but this engine does not schedule by priority "
            "(start it with --scheduling-policy priority)",
            "priority",
        )
    _check_ids(params.stop_token_ids, limits.vocab_size, "stop_token_ids", "stop_token_ids")
    _check_ids(list(params.logit_bias or ()), limits.vocab_size, "logit_bias keys", "logit_bias")
    _check_ids(
        params.allowed_token_ids or [], limits.vocab_size, "allowed_token_ids", "allowed_token_ids"
    )
    for sequence in params.bad_words_token_ids or []:
        _check_ids(sequence, limits.vocab_size, "bad_words_token_ids", "bad_words")
    max_len = limits.max_model_len
    if num_prompt >= max_len:
        raise IntakeError(
            f"prompt has {num_prompt} tokens, but the context window (max_model_len) is "
            f"{max_len} tokens and must leave room for one output token",
            "prompt",
        )
    room = max_len - num_prompt
    if params.max_tokens is not None and params.max_tokens > room:
        raise IntakeError(
            f"prompt has {num_prompt} tokens and max_tokens is {params.max_tokens}: "
            f"{num_prompt + params.max_tokens} tokens, more than the context window "
            f"(max_model_len) of {max_len} tokens; shorten the prompt or lower max_tokens",
            "max_tokens",
        )
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = min(room, limits.default_max_tokens or room)
    if params.min_tokens > max_tokens:
        why = "" if params.max_tokens is not None else ", the default when it is not given"
        raise IntakeError(
            f"min_tokens must be <= max_tokens ({max_tokens}{why}), got {params.min_tokens}",
            "min_tokens",
        )
    if max_tokens == params.max_tokens:
        return params
    return dataclasses.replace(params, max_tokens=max_tokens)


def _check_ids(ids: Sequence[int], vocab_size: int, what: str, param: str) -> None:
    # The type check comes first: direct users of the engine may pass anything. Its loops run
    # in C (a data prompt of 8,000 ids in ~0.2 ms, a Python loop took ~1 ms), and only a bad
    # list walks it in Python to name what is wrong.
    # (`len`, not truth: an array's truth is its value, or an error.)
    if len(ids) == 0 or (set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) < vocab_size):
        return
    bad = [t for t in ids if not (type(t) is int and 0 <= t < vocab_size)]
    kind = "" if all(type(t) is int for t in bad) else " (Python integers: not bools or floats)"
    raise IntakeError(f"{what} must be in [0, {vocab_size}){kind}, got {bad[:_MAX_SHOWN]}", param)


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The (engine request id, settings) of each of the request's `n` choices."""
    return [(child_request_id(request_id, i), params.for_choice(i)) for i in range(params.n)]


def child_request_id(request_id: str, index: int) -> str:
    """The engine request id of choice `index` of client request `request_id`."""
    return f"{request_id}:{index}"


def owner_request_id(request_id: str) -> str:
    """The client request an id belongs to: a choice id's parent, any other id itself (workers
    report errors under either)."""
    parent, sep, _ = request_id.rpartition(":")
    return parent if sep else request_id


def split_child_request_id(child_id: str) -> tuple[str, int]:
    """(client request id, choice index) of an engine request id made by `child_request_id`."""
    parent, _, index = child_id.rpartition(":")
    return parent, int(index)
