"""Loading a checkpoint's tokenizer and turning prompts and chats into token ids."""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from tokenmill.sampling_params import SamplingParams, is_valid_text
from tokenmill.tokenization.chat_options import DEFAULT_CHAT_OPTIONS, ChatTemplateOptions
from tokenmill.tokenization.tokenizer_class import CLASS_MODULES, auto_tokenizer_class
from tokenmill.vision.images import split_images

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tokenmill.vision.images import ImagePreprocessor
    from tokenmill.vision.inputs import ImageInput

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it is a Jinja template; raises
    `ValueError` naming chat_template if it cannot be read or compiled (else the server would
    start and fail every chat request on it)."""
    if value is None:
        return None
    template = value
    if "{" not in value or os.path.isfile(value):
        try:
            template = Path(value).read_text()
        except OSError as exc:
            raise ValueError(f"chat_template: cannot read {value!r}: {exc.strerror}") from None
    _check_chat_template(template)
    return template


Prompt = str | list[int]


@dataclass(frozen=True)
class PromptBounds:
    """What a server checks text prompts against before tokenizing them: the UTF-8 bytes of
    the longest vocabulary entry (as the vocabulary spells it: a bound on a token's text), and
    whether the empty prompt encodes to any token (a BOS: else "" is no prompt)."""

    longest_token_bytes: int
    empty_prompt_has_tokens: bool

    @staticmethod
    def of(tokenizer: PreTrainedTokenizerBase) -> PromptBounds:
        """The bounds of a loaded tokenizer."""
        return PromptBounds._from(tokenizer.get_vocab(), tokenizer("")["input_ids"])

    @staticmethod
    def _from(vocab: Iterable[str], empty_prompt_ids: list[int]) -> PromptBounds:
        longest = max((len(t.encode("utf-8")) for t in vocab), default=1)
        return PromptBounds(max(longest, 1), bool(empty_prompt_ids))

    @staticmethod
    def read(path: str) -> PromptBounds | None:
        """The bounds from directory `path`'s tokenizer.json alone, read by the tokenizers
        library (no transformers import: a server knows them in a fraction of a second of its
        start-up), or None without that file."""
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            return None
        from tokenizers import Tokenizer

        raw = Tokenizer.from_file(str(file))
        return PromptBounds._from(raw.get_vocab(with_added_tokens=True), raw.encode("").ids)


def has_tokenizer(path: str) -> bool:
    """Whether directory `path` holds tokenizer files."""
    return any((Path(path) / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(path: str, chat_template: str | None = None) -> PreTrainedTokenizerBase | None:
    """The tokenizer in directory `path` (with `chat_template` instead of its own, if given),
    or None if it holds no tokenizer files.

    It is the tokenizer `AutoTokenizer.from_pretrained` loads, through the class AutoTokenizer
    would choose (`tokenizer_class`) where that is known without it: importing AutoTokenizer
    imports torch, seconds of every tokenizer process's start-up."""
    if not has_tokenizer(path):
        return None
    name = str(Path(path))
    class_name = auto_tokenizer_class(name)
    if class_name is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name)
    else:
        module = importlib.import_module(CLASS_MODULES[class_name])
        tokenizer = getattr(module, class_name).from_pretrained(name)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _check_chat_template(template: str) -> None:
    """Raise `ValueError` naming chat_template if transformers cannot compile `template`."""
    from jinja2 import TemplateError, TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except (TemplateError, SyntaxError) as exc:  # (SyntaxError: e.g. a break outside a loop)
        where = f" (line {exc.lineno})" if isinstance(exc, TemplateSyntaxError) else ""
        raise ValueError(f"chat_template is not a valid Jinja template{where}: {exc}") from None


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase | None, prompt: Prompt, add_special_tokens: bool = True
) -> list[int]:
    """Token ids of a text prompt (with the tokenizer's special tokens), or the ids as given."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt is text but the model has no tokenizer; pass token ids")
        if not is_valid_text(prompt):  # the tokenizer's own error is a TypeError naming nothing
            raise ValueError("prompt must be valid Unicode text, got an unpaired surrogate")
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    if not isinstance(prompt, list | tuple):
        raise ValueError("prompt must be a string or a list of integer token ids")
    return list(prompt)  # each id is checked with the request (`intake.check_prompt`)


def with_bad_words(
    tokenizer: PreTrainedTokenizerBase | None, params: SamplingParams
) -> SamplingParams:
    """`params` with its `bad_words` tokenized into `bad_words_token_ids` (added to any given),
    as vLLM does: each word as written (leading spaces stripped) and, where it tokenizes to
    as many tokens but starts with another one, after a space (the word inside a sentence)."""
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise ValueError("bad_words needs the model's tokenizer; pass bad_words_token_ids")
    sequences = list(params.bad_words_token_ids or [])
    for word in params.bad_words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:  # written as no token (its characters normalized away): none to ban
            continue
        sequences.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    return dataclasses.replace(params, bad_words_token_ids=sequences)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    options: ChatTemplateOptions = DEFAULT_CHAT_OPTIONS,
) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template (offering `tools`),
    as `options` say."""
    if tokenizer is None or not tokenizer.chat_template:
        raise ValueError("the model has no chat template; send a plain completion prompt")
    if not messages:
        raise ValueError("messages must contain at least one message")
    if options.continue_final_message and messages[-1].get("role") != "assistant":
        raise ValueError("continue_final_message requires the last message to be the assistant's")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **(options.template_kwargs or {}),
        )
    except (
        TemplateError, TypeError, LookupError, ArithmeticError, RecursionError, ValueError
    ) as exc:  # fmt: skip
        # The template runs on the client's messages and variables: what it trips over is
        # theirs to fix (a variable of 0 it divides by, a range over the sandbox's limit).
        raise ValueError(f"messages can not be rendered by the chat template: {exc}") from exc
    if not is_valid_text(text):  # a message's unpaired surrogate: the tokenizer's TypeError
        raise ValueError("messages must be valid Unicode text, got an unpaired surrogate")
    # The template writes any BOS itself.
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat(
    tokenizer: PreTrainedTokenizerBase | None,
    messages: list[dict[str, Any]],
    images: ImagePreprocessor | None,
    tools: list[dict[str, Any]] | None = None,
    options: ChatTemplateOptions = DEFAULT_CHAT_OPTIONS,
    cancelled: Callable[[], bool] = lambda: False,
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """Token ids of a conversation whose messages may hold image parts, and its images
    (`images` preprocesses them, asking `cancelled` before each, see `ImagePreprocessor.expand`;
    None: the model takes none, and an image is an error)."""
    rendered, sources = split_images(messages)
    if images is None and sources:
        raise ValueError("messages: this model takes no images (send text only)")
    ids = apply_chat_template(tokenizer, rendered, tools, options)
    return (ids, ()) if images is None else images.expand(ids, sources, cancelled)
