"""Fixtures of the multimodal tests: tiny Qwen3-VL checkpoints, test images, and transformers'
greedy continuation of a chat with images (the reference)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tokenmill.testing.checkpoints import VL_FAMILIES, build_vl_checkpoint


@pytest.fixture(scope="session")
def vl_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per Qwen3-VL family (dense and mixture of experts)."""
    root = tmp_path_factory.mktemp("vl")
    return {family: build_vl_checkpoint(root / family, family) for family in VL_FAMILIES}


def random_image(width: int, height: int, seed: int) -> Image.Image:
    """An RGB image of noise (distinct per seed)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def chat(text: str, *images: Image.Image) -> list[dict[str, Any]]:
    """One user message: the images, then the text."""
    parts: list[dict[str, Any]] = [{"type": "image", "image": im} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


_HF: dict[Path, torch.nn.Module] = {}


def _hf_vl(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    if path not in _HF:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        _HF[path] = model
    return _HF[path]


def _image_kwargs(
    model: torch.nn.Module, ids: torch.Tensor, images: tuple[Any, ...]
) -> dict[str, Any]:
    """transformers' image inputs of prompt `ids` for these `ImageInput`s."""
    if not images:
        return {}
    return {
        "pixel_values": torch.from_numpy(np.concatenate([i.pixel_values for i in images])),
        "image_grid_thw": torch.tensor([i.grid_thw for i in images]),
        "mm_token_type_ids": (ids == model.config.image_token_id).int(),
    }


def hf_vl_greedy(
    path: Path, token_ids: list[int], images: tuple[Any, ...], max_new_tokens: int
) -> list[int]:
    """transformers' greedy continuation (float32, EOS ignored) of expanded prompt ids with
    these images (`ImageInput`s: the same pixels the engine got)."""
    model = _hf_vl(path)
    ids = torch.tensor([token_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        min_new_tokens=0, do_sample=False, **_image_kwargs(model, ids, images),
    )  # fmt: skip
    return out[0, len(token_ids) :].tolist()


def hf_vl_logprobs(path: Path, token_ids: list[int], images: tuple[Any, ...]) -> torch.Tensor:
    """Log-softmax of transformers' logits at every position of expanded prompt ids with these
    images (float32)."""
    model = _hf_vl(path)
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(ids, **_image_kwargs(model, ids, images)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)
