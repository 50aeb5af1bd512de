"""Tiny Hugging Face checkpoints built offline: a trained BPE tokenizer plus random weights."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PreTrainedTokenizerFast,
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Small shapes per architecture; each exercises its family's distinguishing feature.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    },
    "mistral": {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "tie_word_embeddings": False,
        "sliding_window": None,
    },
    "qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "tie_word_embeddings": True,
        "head_dim": 32,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "tie_word_embeddings": False,
        "head_dim": 32,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "architectures": ["Qwen2MoeForCausalLM"],
        "tie_word_embeddings": False,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 80,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    },
}


def _corpus() -> list[str]:
    """Offline training text: standard-library docstrings plus multilingual and emoji lines."""
    import argparse
    import collections
    import json as json_mod
    import logging
    import pathlib
    import re
    import textwrap

    modules = (argparse, collections, json_mod, logging, pathlib, re, textwrap)
    docs = [m.__doc__ or "" for m in modules]
    extra = [
        "Hello world! How are you today?",
        "你好，世界。今日は良い天気です。",
        "Emoji: 🎉🚀✨ café naïve",
    ]
    return [*docs, *extra] * 3


def build_tokenizer(
    vocab_size: int = 512, corpus: Iterable[str] | None = None
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with BOS/EOS and a ChatML chat template, trained on `corpus`.

    Without a corpus it trains on a few standard-library docstrings (enough for test models).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() if corpus is None else corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_metaspace_tokenizer(
    corpus: Iterable[str], vocab_size: int = 300
) -> PreTrainedTokenizerFast:
    """A SentencePiece-style (Metaspace) BPE tokenizer, as Llama 2 and Mistral ship, trained on
    `corpus`, with BOS/EOS and a ChatML chat template."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_checkpoint(
    path: str | Path, family: str = "llama", seed: int = 0, **overrides: Any
) -> Path:
    """Write a tiny random-weight checkpoint of `family` (`TINY_CONFIGS`) to `path`.

    Weights are drawn with a wide initializer so that greedy decoding has clear winners, and
    biases (transformers starts them at zero) from the same one, so that a bias the engine
    dropped or added twice changes the output. `overrides` replace config fields (e.g.
    `num_hidden_layers=4`).
    """
    if family not in TINY_CONFIGS:
        raise ValueError(f"family must be one of {', '.join(TINY_CONFIGS)}, got {family!r}")
    path = Path(path)
    tokenizer = build_tokenizer()
    cfg: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.1,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "torch_dtype": "float32",
    }
    cfg.update(TINY_CONFIGS[family])
    cfg.update(overrides)
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, cfg["initializer_range"])
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _write_config_dtype(path)
    return path


def _write_config_dtype(path: Path) -> None:
    """Record float32 under both names transformers versions use, for older readers."""
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
    cfg_file.write_text(json.dumps(cfg, indent=2))


# The special tokens a Qwen3-VL tokenizer adds for images (and videos, which the processor
# expects to exist).
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# ChatML whose message content may also be a list of parts: `{"type": "text", "text": ...}`
# and `{"type": "image"}` (the form of Qwen3-VL's own template, which the processor and
# tokenmill both render).
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Tiny Qwen3-VL shapes: 8-pixel patches merged 2x2, so a 32x32 image is 4 language-model tokens;
# two vision blocks, both feeding deepstack features; head_dim 32 split [6, 5, 5] by mrope.
VL_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")  # their transformers model types
VL_PATCH_SIZE = 8
VL_MERGE_SIZE = 2


def build_vl_checkpoint(path: str | Path, family: str = "qwen3_vl", seed: int = 0) -> Path:
    """Write a tiny random-weight Qwen3-VL (or, `qwen3_vl_moe`, Qwen3-VL-MoE) checkpoint to
    `path`, with its tokenizer (the vision tokens added), chat template and
    `preprocessor_config.json` (the image processor: resize to multiples of 16 pixels between
    16x16 and 64x64, so test images stay a few tokens)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if family not in VL_FAMILIES:
        raise ValueError(f"family must be one of {', '.join(VL_FAMILIES)}, got {family!r}")
    path = Path(path)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.1,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
        },
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
    }
    if family == "qwen3_vl_moe":
        # hidden 64 != 2 * 48 and != 48: the hub's transposed expert layout is unambiguous
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                    decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)  # fmt: skip
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": VL_PATCH_SIZE,
        "temporal_patch_size": 2,
        "spatial_merge_size": VL_MERGE_SIZE,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0, 1],
        "initializer_range": 0.1,
    }
    config = AutoConfig.for_model(
        family, text_config=text, vision_config=vision, image_token_id=image,
        video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "experts" in name or name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.1)  # transformers starts the router (and experts) at 0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    merge = VL_PATCH_SIZE * VL_MERGE_SIZE
    Qwen2VLImageProcessorPil(
        patch_size=VL_PATCH_SIZE, temporal_patch_size=2, merge_size=VL_MERGE_SIZE,
        size={"shortest_edge": merge * merge, "longest_edge": 64 * 64},
    ).save_pretrained(path)  # fmt: skip
    _write_config_dtype(path)
    return path


def main(argv: list[str] | None = None) -> None:
    """`python -m tokenmill.testing.checkpoints DIR [FAMILY]`: write a tiny checkpoint."""
    import argparse

    families = [*TINY_CONFIGS, *VL_FAMILIES]
    parser = argparse.ArgumentParser(
        prog="python -m tokenmill.testing.checkpoints",
        description="Write a tiny random-weight checkpoint (tokenizer included) to DIR.",
    )
    parser.add_argument("dir", metavar="DIR", help="The directory to write (created).")
    parser.add_argument(
        "family", nargs="?", default="llama", choices=families,
        help="The architecture family (default: llama).",
    )  # fmt: skip
    ns = parser.parse_args(argv)
    if ns.family in VL_FAMILIES:
        build_vl_checkpoint(ns.dir, ns.family)
    else:
        build_checkpoint(ns.dir, ns.family)


if __name__ == "__main__":
    main()


def build_scripted_checkpoint(path: str | Path, script: str, family: str = "llama") -> list[int]:
    """A checkpoint whose greedy output, after any token of `script`, continues `script` cyclically.

    The decoder layers are silenced (zero output projections), so the last hidden state is the
    input token's embedding; each lm_head row for "the token after t" is t's normalised embedding,
    scaled up. Gives tests a real model with known text (multi-byte characters, stop strings).
    Returns the script's token ids, which must all be distinct.
    """
    path = build_checkpoint(path, family)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    ids = tokenizer.encode(script, add_special_tokens=False)
    if len(set(ids)) != len(ids):
        raise ValueError(f"script must tokenize to distinct tokens, got {ids}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        if model.config.tie_word_embeddings:
            raise ValueError("scripted checkpoints need untied embeddings")
        emb = model.model.embed_tokens.weight
        model.lm_head.weight.mul_(0.01)
        for current, following in zip(ids, ids[1:] + ids[:1], strict=True):
            model.lm_head.weight[following] = 30 * emb[current] / emb[current].norm()
    model.save_pretrained(path)
    return ids
