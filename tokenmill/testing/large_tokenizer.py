"""A byte-level tokenizer the size of a real model's vocabulary, built offline in seconds.

Benchmarks of dummy-weight models (qwen3-0.6b shapes) need a tokenizer of the model's size:
the grammar's mask work per token grows with the vocabulary, and a small tokenizer under a
large model measures the padding, not the grammar. The demo model's 8,192 byte-level BPE
tokens are extended with word pieces made of two of its whole-character tokens (so, as in a
real vocabulary, most tokens are valid UTF-8 text and a few hold quotes, backslashes or
partial characters), and the model's end-of-sequence ids become special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

DEMO_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "demo-llama-16m"
# A real vocabulary stops a few hundred ids short of the model's (Qwen3: 151,669 of 151,936).
MAX_PADDING = 512


def build_large_tokenizer(path: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` to `path` (made if missing): the
    tokenizer's ids cover `vocab_size` less at most `MAX_PADDING`, and every EOS id."""
    data = json.loads((DEMO_TOKENIZER / "tokenizer.json").read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    special = {t["id"] for t in data["added_tokens"]}
    to_byte = _byte_decoder()
    pieces = [p for p, i in vocab.items() if i not in special and _whole_text(p, to_byte)]
    size = max(max(eos_token_ids, default=0) + 1, vocab_size - MAX_PADDING, len(vocab))
    pairs = np.random.default_rng(0).integers(len(pieces), size=(4 * size, 2)).tolist()
    eos = set(eos_token_ids)
    for a, b in pairs:
        while len(vocab) in eos:
            token_id = len(vocab)
            vocab[f"<|eos_{token_id}|>"] = token_id
            data["added_tokens"].append(
                {"id": token_id, "content": f"<|eos_{token_id}|>", "single_word": False,
                 "lstrip": False, "rstrip": False, "normalized": False, "special": True}
            )  # fmt: skip
        if len(vocab) >= size:
            break
        vocab.setdefault(pieces[a] + pieces[b], len(vocab))
    # No merges for the new pieces: prompts are token ids, and decoding needs none.
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(data))
    (out / "tokenizer_config.json").write_text(
        (DEMO_TOKENIZER / "tokenizer_config.json").read_text()
    )
    return out


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _whole_text(piece: str, to_byte: dict[str, int]) -> bool:
    """Whether a byte-level token's bytes are whole UTF-8 characters."""
    try:
        bytes(to_byte[c] for c in piece).decode("utf-8")
    except (KeyError, UnicodeDecodeError):
        return False
    return True
