"""SpeculativeConfig: vLLM's JSON shape, and a clear error naming the field for each bad value."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tokenmill.config import DEMO_DRAFT_DIR, DEMO_MODEL_DIR, ModelConfig
from tokenmill.spec.config import SpeculativeConfig
from tokenmill.testing.checkpoints import build_checkpoint


def test_ngram_json_as_vllm() -> None:
    cfg = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,'
        ' "prompt_lookup_min": 2}'
    )
    assert cfg == SpeculativeConfig("ngram", 4, prompt_lookup_max=3, prompt_lookup_min=2)


@pytest.mark.parametrize(
    ("given", "expected"),
    [({}, (5, 5)), ({"prompt_lookup_max": 4}, (4, 4)), ({"prompt_lookup_min": 2}, (2, 2))],
)
def test_prompt_lookup_bounds_default_as_vllm(given: dict, expected: tuple[int, int]) -> None:
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert cfg is not None
    assert (cfg.prompt_lookup_max, cfg.prompt_lookup_min) == expected


def test_a_draft_checkpoint_alone_means_draft_model() -> None:
    cfg = SpeculativeConfig.parse({"model": str(DEMO_DRAFT_DIR), "num_speculative_tokens": 3})
    assert cfg is not None and cfg.method == "draft_model"
    target = ModelConfig.from_pretrained(DEMO_MODEL_DIR)
    draft = cfg.draft_model_config(target, max_model_len=2048)
    assert draft.vocab_size == target.vocab_size and draft.num_layers < target.num_layers


def test_adaptive_is_on_unless_turned_off() -> None:
    on = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    off = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                  '"adaptive": false}')  # fmt: skip
    assert on is not None and on.adaptive
    assert off is not None and not off.adaptive


def test_none_and_configs_pass_through() -> None:
    cfg = SpeculativeConfig("ngram", 1)
    assert SpeculativeConfig.parse(cfg) is cfg
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ('{"method": "medusa", "num_speculative_tokens": 2}', "speculative_config.method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
        # Not a 512 GB draft-token buffer allocated at start-up:
        (
            '{"method": "ngram", "num_speculative_tokens": 1000000000}',
            "num_speculative_tokens must be an integer in [1, 64]",
        ),
        ('{"method": ["ngram"], "num_speculative_tokens": 2}', "speculative_config.method"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"num_speculative_tokens": 2}', "method is required"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 3}', "unknown field(s) 'k'"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}',
            "speculative_config.adaptive must be true or false",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": 1}', "adaptive"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}',
            "prompt_lookup_min",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 3}',
            "prompt_lookup_min must be <= prompt_lookup_max",
        ),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "speculative_config.model"),
        (
            '{"method": "draft_model", "model": "/no/such/dir", "num_speculative_tokens": 2}',
            "does not exist",
        ),
        (
            '{"method": "ngram", "model": "x", "num_speculative_tokens": 2}',
            "speculative_config.model applies to method 'draft_model' only",
        ),
        ("ngram", "must be a JSON object"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_values_name_the_field(value: str, field: str) -> None:
    with pytest.raises(ValueError, match="speculative_config") as info:
        SpeculativeConfig.parse(value)
    assert field in str(info.value)


def test_a_draft_with_another_vocabulary_size_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    other = build_checkpoint(tmp_path / "other", "llama", vocab_size=600)
    cfg = SpeculativeConfig("draft_model", 2, model=str(other))
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft's vocab_size"):
        cfg.check(ModelConfig.from_pretrained(llama_dir), max_model_len=512)


def test_a_draft_with_another_tokenizer_is_refused(
    llama_dir: Path, draft_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "swapped"
    shutil.copytree(draft_dir, other)
    tok_file = other / "tokenizer.json"
    data = json.loads(tok_file.read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok_file.write_text(json.dumps(data))
    target = ModelConfig.from_pretrained(llama_dir)
    SpeculativeConfig("draft_model", 2, model=str(draft_dir)).check(target, max_model_len=512)
    with pytest.raises(ValueError, match="the draft's tokenizer differs"):
        SpeculativeConfig("draft_model", 2, model=str(other)).check(target, max_model_len=512)


@pytest.mark.parametrize("text", ["{not json", '{"added_tokens": [{"id": 5}]}', "[1]"])
def test_a_draft_with_a_malformed_tokenizer_json_is_refused(
    llama_dir: Path, draft_dir: Path, tmp_path: Path, text: str
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(draft_dir, broken)
    (broken / "tokenizer.json").write_text(text)  # was a KeyError / a bare JSON error
    target = ModelConfig.from_pretrained(llama_dir)
    with pytest.raises(ValueError, match=r"speculative_config\.model: cannot read the vocabulary"):
        SpeculativeConfig("draft_model", 2, model=str(broken)).check(target, max_model_len=512)


def test_a_draft_with_a_shorter_context_is_refused(llama_dir: Path, draft_dir: Path) -> None:
    cfg = SpeculativeConfig("draft_model", 2, model=str(draft_dir))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        cfg.check(ModelConfig.from_pretrained(llama_dir), max_model_len=4096)
