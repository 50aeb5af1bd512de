"""`bad_words` tokenized as vLLM does, for tokenizers that write a word as no token at all."""

from __future__ import annotations

from pathlib import Path

from tokenizers import normalizers

from tokenmill import SamplingParams
from tokenmill.tokenization.tokenizer import load_tokenizer, with_bad_words


def test_a_word_the_tokenizer_normalizes_away_bans_nothing(llama_dir: Path) -> None:
    """A tokenizer that drops a word's characters (as BERT's drops control characters) encodes
    it, with and without a space, as no token: that raised IndexError (a 500 from the tokenizer
    worker); the word is skipped, the others kept."""
    tokenizer = load_tokenizer(str(llama_dir))
    tokenizer.backend_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Replace("\x00", ""), normalizers.Strip()]
    )
    assert tokenizer.encode(" \x00", add_special_tokens=False) == []
    params = with_bad_words(tokenizer, SamplingParams(bad_words=["\x00", "hello"]))
    assert params.bad_words_token_ids == [tokenizer.encode("hello", add_special_tokens=False)]
