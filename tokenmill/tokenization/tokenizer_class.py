"""The transformers class that `AutoTokenizer.from_pretrained` picks for a checkpoint, worked out
without importing `transformers.models.auto` (it imports torch: 4.4 s of a process's start-up
on a laptop, 7.75 s on the H200, for a tokenizer that needs neither).

transformers 5's AutoTokenizer (`models/auto/tokenization_auto.py`), given a local folder,
reads config.json into an `AutoConfig` for its `model_type`, reads `tokenizer_config.json`'s
`tokenizer_class`, chooses a class from the two, and calls that class's `from_pretrained` on
the folder (plus keywords that change no result for a local folder: `_from_auto`, which only
labels Hub downloads, and a `revision` of None). So calling the class it would choose gives the
same tokenizer. The choice matters: a class with its own `__init__` (`Qwen2Tokenizer`,
`LlamaTokenizer`) rebuilds the tokenizer from tokenizer.json's vocabulary and merges with its
own normalizer, pre-tokenizer and special-token defaults, so it is not `TokenizersBackend`
(`PreTrainedTokenizerFast`) reading tokenizer.json as it is.

`auto_tokenizer_class` follows AutoTokenizer's rules only where they are simple and written
down here: the model types tokenmill serves, the classes their checkpoints name, no remote
code. Anything else (None) loads through AutoTokenizer itself.
`tests/unit/test_tokenizer_class.py` checks these tables against transformers' own, and the
two loaders against each other.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

TOKENIZERS_BACKEND = "TokenizersBackend"

# AutoTokenizer's `TOKENIZER_MAPPING_NAMES` for the model types tokenmill serves (config.json's
# `model_type` of every architecture in `models/registry.py`).
REGISTERED_CLASSES: dict[str, str | None] = {
    "llama": None,
    "mistral": TOKENIZERS_BACKEND,
    "qwen2": "Qwen2Tokenizer",
    "qwen2_moe": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "qwen3_moe": "Qwen2Tokenizer",
    "qwen3_vl": "Qwen2Tokenizer",
    "qwen3_vl_moe": "Qwen2Tokenizer",
}
# Those of them in AutoTokenizer's `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`: their registered
# class wins over the checkpoint's `tokenizer_class`.
INCORRECT_HUB_CLASS = frozenset({"qwen2"})
# AutoTokenizer's `MODEL_IDS_TO_TOKENIZERS_BACKEND`: names (config `_name_or_path`, here the
# folder as given) always loaded as TokenizersBackend.
TOKENIZERS_BACKEND_IDS = (
    "deepseek-ai/deepseek-r1-distill-llama-*",
    "deepseek-ai/deepseek-coder-*",
    "allenai/dolma2-tokenizer",
    "google/umt5-small",
    "naver-clova-ix/donut-*",
    "salesforce/blip2-opt-*",
    "salesforce/blip2-flan-t5-*",
    "salesforce/instructblip-flan-t5-*",
    "stepfun-ai/step-3.7-*",
)
# `tokenizer_class` (without "Fast") → the class AutoTokenizer's `tokenizer_class_from_name`
# returns for it; "PreTrainedTokenizer" is `PythonBackend`, which AutoTokenizer swaps for
# TokenizersBackend.
_CLASS_OF_NAME = {
    "TokenizersBackend": TOKENIZERS_BACKEND,
    "PreTrainedTokenizer": TOKENIZERS_BACKEND,
    "Qwen2Tokenizer": "Qwen2Tokenizer",
    "LlamaTokenizer": "LlamaTokenizer",
}
# Where each class lives: none of these modules imports torch.
CLASS_MODULES = {
    TOKENIZERS_BACKEND: "transformers.tokenization_utils_tokenizers",
    "Qwen2Tokenizer": "transformers.models.qwen2.tokenization_qwen2",
    "LlamaTokenizer": "transformers.models.llama.tokenization_llama",
}


def auto_tokenizer_class(path: str) -> str | None:
    """The name of the class (a key of `CLASS_MODULES`) `AutoTokenizer.from_pretrained(path)`
    instantiates for checkpoint folder `path`, or None where its rules are not followed here
    (no tokenizer.json, remote code, another model type or tokenizer class)."""
    root = Path(path)
    config = _json_object(root / "config.json")
    tokenizer_config = _json_object(root / "tokenizer_config.json")
    if config is None or tokenizer_config is None or not (root / "tokenizer.json").is_file():
        return None
    model_type = config.get("model_type")
    hub_class = tokenizer_config.get("tokenizer_class")
    if (
        model_type not in REGISTERED_CLASSES
        or not isinstance(hub_class, str)
        or hub_class.removesuffix("Fast") not in _CLASS_OF_NAME
        # Remote code, or a `model_name` AutoTokenizer checks against a table not copied here.
        or {"auto_map", "model_name"} & (config.keys() | tokenizer_config.keys())
    ):
        return None
    if any(fnmatch.fnmatch(str(path).lower(), pattern) for pattern in TOKENIZERS_BACKEND_IDS):
        return TOKENIZERS_BACKEND
    hub_name = hub_class.removesuffix("Fast")
    hub = _CLASS_OF_NAME[hub_name]
    incorrect = model_type in INCORRECT_HUB_CLASS
    # A Llama tokenizer class over a byte-level tokenizer.json (Llama 3 style): LlamaTokenizer
    # would impose SentencePiece's Metaspace.
    if hub_name == "LlamaTokenizer" and not incorrect and _is_byte_level(root / "tokenizer.json"):
        return TOKENIZERS_BACKEND
    registered = REGISTERED_CLASSES[model_type]
    if registered is not None and registered.removesuffix("Fast") != hub_name:
        # The checkpoint names another class than its model type's: a specialised class wins
        # (the registered one where the Hub's is known wrong), else TokenizersBackend.
        if registered != TOKENIZERS_BACKEND:
            chosen = registered if incorrect else hub
            if chosen != TOKENIZERS_BACKEND:
                return chosen
        return TOKENIZERS_BACKEND
    return hub


def _json_object(path: Path) -> dict | None:
    """The JSON object in file `path`, or None (no such file, or not a JSON object)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _is_byte_level(tokenizer_json: Path) -> bool:
    """AutoTokenizer's test (`TokenizersBackend._tokenizer_json_has_byte_level`): the file
    names a ByteLevel pre-tokenizer or decoder."""
    return '"ByteLevel"' in tokenizer_json.read_text(encoding="utf-8")
