"""SpeculativeConfig: which proposer drafts tokens and how many, validated as vLLM's is."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tokenmill.config import ModelConfig
from tokenmill.spec.proposer import PROPOSERS

# vLLM's defaults for prompt lookup when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5

_PREFIX = "speculative_config"
# Most tokens one request may draft per step: buffers of max_num_seqs x k are allocated at
# start-up, and acceptance decays geometrically, so more is only memory.
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings: `--speculative-config '{"method": "ngram", ...}'`.

    `method` "ngram" drafts by prompt lookup: the longest suffix of the request's tokens, between
    `prompt_lookup_min` and `prompt_lookup_max` tokens long, found earlier in its prompt and
    output, proposes the tokens that followed it. "draft_model" drafts with the checkpoint in
    `model`, which must share the target's tokenizer. Either proposes up to
    `num_speculative_tokens` tokens per step, which the target verifies in one pass.
    With `adaptive` (the default) each step chooses how many of those each request drafts,
    0 included, from the request's measured acceptance and the measured cost of the step's
    size, so that speculation does not slow a large batch down (`spec/adaptive.py`); `false`
    drafts `num_speculative_tokens` whenever a proposal is found (vLLM's behaviour).
    Every bad value raises `ValueError` naming the field.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in PROPOSERS:
            raise ValueError(
                f"{_PREFIX}.method must be one of {', '.join(PROPOSERS)}, got {self.method!r}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"{_PREFIX}.adaptive must be true or false, got {self.adaptive!r}")
        if self.method == "ngram":
            self._resolve_prompt_lookup()
        elif self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
            raise ValueError(
                f"{_PREFIX}.prompt_lookup_max/prompt_lookup_min apply to method 'ngram' only, "
                f"not {self.method!r}"
            )
        if self.method == "draft_model":
            self._check_draft_dir()
        elif self.model is not None:
            raise ValueError(
                f"{_PREFIX}.model applies to method 'draft_model' only, not {self.method!r}"
            )

    def _resolve_prompt_lookup(self) -> None:
        high, low = self.prompt_lookup_max, self.prompt_lookup_min
        if high is None and low is None:
            high = low = DEFAULT_PROMPT_LOOKUP
        elif high is None:
            high = low
        elif low is None:
            low = high
        _check_int("prompt_lookup_min", low, minimum=1)
        _check_int("prompt_lookup_max", high, minimum=1)
        assert high is not None and low is not None
        if low > high:
            raise ValueError(
                f"{_PREFIX}.prompt_lookup_min must be <= prompt_lookup_max ({high}), got {low}"
            )
        # Frozen: the resolved bounds are set once, here.
        object.__setattr__(self, "prompt_lookup_max", high)
        object.__setattr__(self, "prompt_lookup_min", low)

    def _check_draft_dir(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                f"{_PREFIX}.model must be the draft checkpoint directory for method "
                f"'draft_model', got {self.model!r}"
            )
        root = Path(self.model)
        if not root.is_dir():
            raise ValueError(f"{_PREFIX}.model: directory {self.model!r} does not exist")
        if not (root / "config.json").is_file():
            raise ValueError(f"{_PREFIX}.model: directory {self.model!r} has no config.json")

    @staticmethod
    def parse(
        value: str | Mapping[str, Any] | SpeculativeConfig | None,
    ) -> SpeculativeConfig | None:
        """A config from `--speculative-config`'s JSON text, a dict (`LLM(...)`), or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{_PREFIX} must be a JSON object, got {value!r}: {e}") from e
        if not isinstance(value, Mapping):
            raise ValueError(f"{_PREFIX} must be a JSON object, got {value!r}")
        known = [f.name for f in fields(SpeculativeConfig)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(
                f"{_PREFIX} has unknown field(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(known)}"
            )
        args = dict(value)
        if "method" not in args:  # as vLLM: a draft checkpoint alone means a draft model
            if args.get("model") is None:
                raise ValueError(f"{_PREFIX}.method is required (one of {', '.join(PROPOSERS)})")
            args["method"] = "draft_model"
        if "num_speculative_tokens" not in args:
            raise ValueError(f"{_PREFIX}.num_speculative_tokens is required (an integer >= 1)")
        return SpeculativeConfig(**args)

    def draft_model_config(self, target: ModelConfig, max_model_len: int) -> ModelConfig:
        """The draft checkpoint's config, checked against the target it drafts for."""
        assert self.model is not None, "only method 'draft_model' has a draft checkpoint"
        try:
            draft = ModelConfig.from_pretrained(self.model, target.dtype)
        except ValueError as e:
            raise ValueError(f"{_PREFIX}.model: {e}") from e
        check_same_vocabulary(draft, target)
        if draft.max_position_embeddings < max_model_len:
            raise ValueError(
                f"{_PREFIX}.model: the draft handles {draft.max_position_embeddings} positions "
                f"(max_position_embeddings), fewer than the target's max_model_len {max_model_len}"
            )
        return draft

    def check(self, target: ModelConfig, max_model_len: int) -> None:
        """Raise `ValueError` naming the field if this config cannot serve `target`."""
        if self.method == "draft_model":
            self.draft_model_config(target, max_model_len)


def check_same_vocabulary(draft: ModelConfig, target: ModelConfig) -> None:
    """A draft's token ids must mean what the target's mean: same vocabulary size, and the same
    tokenizer vocabulary where both checkpoints ship a `tokenizer.json`."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"{_PREFIX}.model: the draft's vocab_size is {draft.vocab_size}, the target's "
            f"{target.vocab_size}; a draft model must share the target's tokenizer"
        )
    draft_vocab = _tokenizer_vocabulary(Path(draft.path))
    target_vocab = _tokenizer_vocabulary(Path(target.path))
    if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))[:3]
        raise ValueError(
            f"{_PREFIX}.model: the draft's tokenizer differs from the target's (e.g. "
            f"{differing}); a draft model must share the target's tokenizer"
        )


def _tokenizer_vocabulary(root: Path) -> dict[str, int] | None:
    """Token → id of a checkpoint's `tokenizer.json` (model vocabulary and added tokens)."""
    path = root / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        vocab = dict((data.get("model") or {}).get("vocab") or {})
        for token in data.get("added_tokens") or []:
            vocab[token["content"]] = token["id"]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        # A malformed file: json's bare message, or a KeyError naming a key, named nothing.
        message = f"{_PREFIX}.model: cannot read the vocabulary of {path}: {exc!r}"
        raise ValueError(message) from None
    return vocab


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{_PREFIX}.{name} must be an integer {bound}, got {value!r}")
