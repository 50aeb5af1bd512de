"""The fixed prompt set of `tokenmill eval conformance`.

Groups: `text` (prompts of several lengths, tokenized by the server), `token-ids` (random ids
over the whole vocabulary, so every embedding row can be reached even where the tokenizer is
smaller than the model), `chat` (the chat template), and `prefix-hit` (a shared document and
several questions: `prefix-warm` is sent alone, the others after it, so that they are served
from the prefix cache; `prefix-0` repeats `prefix-warm` exactly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

PASSAGE = (
    "The mill stood at the bend of the river, where the water ran fast over a bed of smooth "
    "stones. Every morning the miller opened the sluice, and the great wheel began to turn, "
    "slowly at first and then with a steady rhythm that could be heard across the valley. "
    "Farmers brought their grain in carts and on the backs of mules; some waited in the shade "
    "of the willows, others walked to the village to trade eggs, wool and news. In 1846 a flood "
    "carried away half of the wall, and for two years the wheel was silent. When it was rebuilt, "
    "the new owner added a second pair of stones, a drying floor, and a ledger in which every "
    "sack was written down with its weight, its owner and the price paid. The ledger survives: "
    "it lists 3,212 sacks in the first year, most of them wheat, some rye, and a few of barley "
    "that the brewer in the next town bought by the cartload. Reading it today, one learns that "
    "prices rose every spring, that the river froze twice, and that the miller's daughter kept "
    "the accounts after 1859 in a smaller and much neater hand. "
)
QUESTIONS = (
    "Question: Why was the wheel silent for two years? Answer:",
    "Question: Who kept the accounts after 1859? Answer:",
    "Question: How many sacks are listed in the first year? Answer:",
)
CHATS: tuple[tuple[str, list[dict[str, str]]], ...] = (
    ("chat-user", [{"role": "user", "content": "Say hello in three languages."}]),
    (
        "chat-system",
        [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What is a river delta?"},
        ],
    ),
    (
        "chat-turns",
        [
            {"role": "user", "content": "Name a prime number."},
            {"role": "assistant", "content": "Seven."},
            {"role": "user", "content": "And the next one after it?"},
        ],
    ),
)


@dataclass(frozen=True)
class ConformancePrompt:
    """One prompt: text or token ids (a completion) or messages (a chat)."""

    name: str
    group: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    warm: bool = False  # sent alone, before the others, to fill the prefix cache


def text_of_length(tokenizer: PreTrainedTokenizerBase, length: int, offset: int = 0) -> str:
    """About `length` tokens of the passage (repeated), starting `offset` tokens in."""
    ids = tokenizer.encode(PASSAGE, add_special_tokens=False)
    repeats = (offset + length) // max(len(ids), 1) + 1
    ids = (ids * repeats)[offset : offset + length]
    return tokenizer.decode(ids)


def build_prompts(
    tokenizer: PreTrainedTokenizerBase | None,
    vocab_size: int,
    max_prompt_len: int,
    lengths: tuple[int, ...],
    seed: int,
) -> list[ConformancePrompt]:
    """The prompt set, every prompt at most `max_prompt_len` tokens (a few tokens of slack are
    left for special tokens and re-tokenization); without a tokenizer, token ids only."""
    fitting = sorted({min(n, max(max_prompt_len - 8, 1)) for n in lengths})
    rng = np.random.default_rng(seed)
    prompts = [
        ConformancePrompt(f"ids-{n}", "token-ids", prompt=rng.integers(0, vocab_size, n).tolist())
        for n in fitting
    ]
    if tokenizer is None:
        return prompts
    prompts += [
        ConformancePrompt(f"text-{n}", "text", prompt=text_of_length(tokenizer, n, offset=7 * i))
        for i, n in enumerate(fitting)
    ]
    if tokenizer.chat_template:
        prompts += [ConformancePrompt(name, "chat", messages=m) for name, m in CHATS]
    # A shared document of about half the room, then a question (about 16 tokens each).
    document = text_of_length(tokenizer, max(min(512, max_prompt_len // 2 - 24), 8))
    shared = [document + "\n\n" + q for q in QUESTIONS]
    prompts.append(ConformancePrompt("prefix-warm", "prefix-hit", prompt=shared[0], warm=True))
    prompts += [
        ConformancePrompt(f"prefix-{i}", "prefix-hit", prompt=p) for i, p in enumerate(shared)
    ]
    return prompts
