"""The pieces of the structured-output benchmark: a tokenizer of a model's vocabulary size,
built offline, and the grammar's host cost per row measured the engine's way."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from tokenmill.config import ModelConfig
from tokenmill.testing.large_tokenizer import MAX_PADDING, build_large_tokenizer

_BENCH = Path(__file__).parents[2] / "benchmarks" / "structured_outputs.py"
_spec = importlib.util.spec_from_file_location("structured_outputs_bench", _BENCH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_a_large_tokenizer_has_the_models_size_less_padding_and_its_eos(tmp_path: Path) -> None:
    path = build_large_tokenizer(tmp_path, 20_000, [19_600])
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    assert len(tok) == 19_601  # the EOS id is past 20,000 less the padding
    assert (
        len(
            PreTrainedTokenizerFast.from_pretrained(
                build_large_tokenizer(tmp_path / "b", 20_000, [2])
            )
        )
        == 20_000 - MAX_PADDING
    )
    assert tok.convert_ids_to_tokens(19_600) == "<|eos_19600|>"
    assert tok.decode([19_600], skip_special_tokens=True) == ""
    words = [tok.decode([i]) for i in range(8192, len(tok)) if i != 19_600]
    assert all("\ufffd" not in w and w for w in words)  # whole characters, as most real tokens


def test_grammar_host_costs_are_measured_over_the_tokenizers_vocabulary(
    tmp_path: Path, llama_dir: Path
) -> None:
    model = replace(ModelConfig.from_pretrained(llama_dir), vocab_size=20_000)
    path = build_large_tokenizer(tmp_path, model.vocab_size, model.eos_token_ids)
    report = bench.grammar_host_costs(str(path), model, rows=4, threads=(1, 2))
    assert report["grammar_vocab_size"] == 20_000 - MAX_PADDING  # the tokenizer's, not the model's
    for state in ("number", "string"):
        costs = report[state]
        assert costs["accept_us"] > 0 and costs["fill_2_threads_us"] > 0
    assert report["string"]["allowed_tokens"] > report["number"]["allowed_tokens"]
