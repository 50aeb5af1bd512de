"""`load_tokenizer` loads the tokenizer AutoTokenizer loads, through the class AutoTokenizer
would choose, without importing torch (`tokenization/tokenizer_class.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.models.auto import tokenization_auto

from tokenmill.config import DEMO_MODEL_DIR
from tokenmill.testing.checkpoints import build_metaspace_tokenizer, build_tokenizer
from tokenmill.tokenization.tokenizer import PromptBounds, apply_chat_template, load_tokenizer
from tokenmill.tokenization.tokenizer_class import (
    CLASS_MODULES,
    INCORRECT_HUB_CLASS,
    REGISTERED_CLASSES,
    TOKENIZERS_BACKEND_IDS,
    auto_tokenizer_class,
)

TEXTS = [
    "Hello world! How are you today?",
    "<|vision_start|><|image_pad|><|vision_end|>what is this?",
    "<s>a prompt with</s> special <|im_start|>tokens<|im_end|> inside",
    "你好，世界。今日は良い天気です。 Emoji: 🎉🚀✨ café naïve",
    "  leading spaces,\ttabs\r\nand newlines\n\n",
    "",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Héllo 🎉, what is <s>?"},
]


def test_tables_are_transformers_own() -> None:
    """The copied rules are AutoTokenizer's in the installed transformers (an upgrade that
    changes them fails here, not silently in a server)."""
    names = tokenization_auto.TOKENIZER_MAPPING_NAMES
    assert {
        model_type: names.get(model_type) for model_type in REGISTERED_CLASSES
    } == REGISTERED_CLASSES
    incorrect = tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    assert set(REGISTERED_CLASSES) & incorrect == INCORRECT_HUB_CLASS
    assert list(TOKENIZERS_BACKEND_IDS) == tokenization_auto.MODEL_IDS_TO_TOKENIZERS_BACKEND
    for name, module in CLASS_MODULES.items():
        cls = tokenization_auto.tokenizer_class_from_name(name)
        assert (cls.__name__, cls.__module__) == (name, module)


@pytest.fixture(scope="module")
def tokenizers_by_kind() -> dict[str, PreTrainedTokenizerFast]:
    return {
        "byte_level": build_tokenizer(),
        "metaspace": build_metaspace_tokenizer([t for t in TEXTS if t] * 4),
    }


def _checkpoint(
    path: Path, tokenizer: PreTrainedTokenizerFast, model_type: str, tokenizer_class: str
) -> Path:
    """A folder with `tokenizer`, its `tokenizer_class` and a config.json of `model_type`."""
    tokenizer.save_pretrained(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = tokenizer_class
    config_file.write_text(json.dumps(config))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def _behaviour(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Everything tokenmill reads of a tokenizer, on test strings and a chat."""
    encoded = {
        (text, special): tokenizer.encode(text, add_special_tokens=special)
        for text in TEXTS
        for special in (True, False)
    }
    ids = [i for text in TEXTS for i in tokenizer.encode(text)]
    return {
        "encoded": encoded,
        "call": tokenizer("")["input_ids"],
        "decoded": [tokenizer.decode(ids, skip_special_tokens=skip) for skip in (False, True)],
        "tokens": tokenizer.convert_ids_to_tokens(ids),
        "special": (
            tokenizer.bos_token_id,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            tokenizer.unk_token_id,
            tokenizer.all_special_ids,
        ),
        "vocab": tokenizer.get_vocab(),
        "length": len(tokenizer),
        "chat": tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
        "chat_ids": apply_chat_template(tokenizer, CHAT),
    }


# (tokenizer.json kind, config.json model_type, tokenizer_config.json tokenizer_class, the class
# AutoTokenizer picks): every branch of its choice for the model types tokenmill serves.
CASES = [
    ("byte_level", "llama", "TokenizersBackend", "TokenizersBackend"),
    ("byte_level", "llama", "PreTrainedTokenizerFast", "TokenizersBackend"),
    ("byte_level", "llama", "LlamaTokenizerFast", "TokenizersBackend"),  # Llama 3: ByteLevel
    ("metaspace", "llama", "LlamaTokenizer", "LlamaTokenizer"),  # Llama 2: Metaspace
    ("metaspace", "mistral", "LlamaTokenizerFast", "TokenizersBackend"),
    ("byte_level", "qwen3", "Qwen2Tokenizer", "Qwen2Tokenizer"),  # Qwen3 as shipped
    ("byte_level", "qwen3", "TokenizersBackend", "TokenizersBackend"),
    ("byte_level", "qwen3_moe", "Qwen2TokenizerFast", "Qwen2Tokenizer"),
    ("byte_level", "qwen2", "TokenizersBackend", "Qwen2Tokenizer"),  # the Hub's class is wrong
    ("byte_level", "qwen3_vl", "PreTrainedTokenizerFast", "TokenizersBackend"),
]


@pytest.mark.parametrize(("kind", "model_type", "tokenizer_class", "expected"), CASES)
def test_direct_load_matches_auto_tokenizer(
    tmp_path: Path,
    tokenizers_by_kind: dict[str, PreTrainedTokenizerFast],
    kind: str,
    model_type: str,
    tokenizer_class: str,
    expected: str,
) -> None:
    path = _checkpoint(tmp_path, tokenizers_by_kind[kind], model_type, tokenizer_class)
    auto = AutoTokenizer.from_pretrained(str(path))
    assert type(auto).__name__ == expected
    assert auto_tokenizer_class(str(path)) == expected
    direct = load_tokenizer(str(path))
    assert type(direct) is type(auto)
    assert _behaviour(direct) == _behaviour(auto)


def test_test_checkpoints_and_demo_model_load_as_auto_tokenizer_does(
    checkpoints: dict[str, Path], vl_dir: Path
) -> None:
    for path in [*checkpoints.values(), vl_dir, DEMO_MODEL_DIR]:
        auto = AutoTokenizer.from_pretrained(str(path))
        assert auto_tokenizer_class(str(path)) == type(auto).__name__, path
        assert _behaviour(load_tokenizer(str(path))) == _behaviour(auto), path


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"tokenizer_class": "GPT2Tokenizer"}, "a class whose rules are not copied"),
        ({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}, "remote code"),
        ({"tokenizer_class": None}, "no tokenizer_class"),
    ],
)
def test_other_checkpoints_go_through_auto_tokenizer(
    tmp_path: Path,
    tokenizers_by_kind: dict[str, PreTrainedTokenizerFast],
    change: dict[str, Any],
    why: str,
) -> None:
    path = _checkpoint(tmp_path, tokenizers_by_kind["byte_level"], "qwen3", "Qwen2Tokenizer")
    config_file = path / "tokenizer_config.json"
    config = {**json.loads(config_file.read_text()), **change}
    config_file.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    assert auto_tokenizer_class(str(path)) is None, why
    other_type = _checkpoint(tmp_path / "gemma", tokenizers_by_kind["byte_level"], "gemma", "X")
    assert auto_tokenizer_class(str(other_type)) is None


@pytest.mark.parametrize(("kind", "model_type", "hub_class", "expected"), CASES)
def test_prompt_bounds_from_tokenizer_json_are_the_loaded_tokenizers(
    tmp_path: Path, tokenizers_by_kind, kind: str, model_type: str, hub_class: str, expected: str
) -> None:
    # The server reads them at start-up without loading the tokenizer (api_server.serve).
    path = _checkpoint(tmp_path, tokenizers_by_kind[kind], model_type, hub_class)
    assert PromptBounds.read(str(path)) == PromptBounds.of(load_tokenizer(str(path)))
