"""A prompt's images on the host: pixel patches, where their placeholder tokens sit, their
multimodal rotary positions, and the keys that tell the prefix cache one image from another.

Plain numpy, no torch: the tokenizer workers build these, the engine core keeps them on the
`Request`, and a step's plan carries the ones it needs to the runner.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt, preprocessed: `pixel_values` `[patches, C * Tp * P * P]` float32
    (transformers' image processor's layout) over a `grid_thw` of patches; its
    `num_tokens = t * h * w / merge^2` placeholder tokens start at prompt index `offset`.
    `key` is a 62-bit hash of the pixels and grid: equal images share encoder outputs and
    cached KV pages, different ones never do."""

    key: int
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    offset: int
    num_tokens: int

    @property
    def end(self) -> int:
        """One past its last placeholder token."""
        return self.offset + self.num_tokens


def image_key(pixels: np.ndarray, grid_thw: tuple[int, int, int]) -> int:
    """The content hash of an image (62 bits: it folds into negative cache keys): of its
    decoded RGB pixels, which with the model's one image processor determine its patches,
    and are an eighth of their bytes (the float32 patches repeat each frame
    `temporal_patch_size` times: hashing them was 87 of the 210 ms a 1024x768 image's
    preprocessing took on a 2-core development machine, the RGB pixels take 10). Their shape
    is hashed too: the same bytes as 32x34 and 34x32 pixels resize to the same grid."""
    digest = hashlib.blake2b(np.ascontiguousarray(pixels).data, digest_size=8)
    digest.update(np.asarray((*pixels.shape, *grid_thw), dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 2


def num_image_tokens(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    """Language-model tokens of an image of `grid_thw` patches."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)


@dataclass(frozen=True, eq=False)
class MultimodalPrompt:
    """A prompt's images and its rotary positions: `positions` `[3, L]` (temporal, height,
    width) for its L tokens, and `rope_delta`, what every token after the prompt adds to its
    index (Qwen3-VL's `get_rope_index`)."""

    images: tuple[ImageInput, ...]
    positions: np.ndarray
    rope_delta: int

    @staticmethod
    def build(prompt_len: int, images: tuple[ImageInput, ...], merge_size: int) -> MultimodalPrompt:
        """Positions of a prompt of `prompt_len` tokens holding `images` (in prompt order):
        text advances all three by one per token; an image's tokens sit on its (h, w) grid of
        merged patches from the position where it starts, and the text after it resumes at
        that start plus its larger side."""
        parts: list[np.ndarray] = []
        pos = cursor = 0
        for image in images:
            text = image.offset - cursor
            parts.append(np.broadcast_to(np.arange(pos, pos + text), (3, text)))
            pos += text
            t, h, w = image.grid_thw
            h, w = h // merge_size, w // merge_size
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            parts.append(np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + pos)
            pos += max(h, w)
            cursor = image.end
        tail = prompt_len - cursor
        parts.append(np.broadcast_to(np.arange(pos, pos + tail), (3, tail)))
        positions = np.concatenate(parts, axis=1).astype(np.int64)
        return MultimodalPrompt(images, positions, int(positions.max()) + 1 - prompt_len)

    def rope_positions(self, start: int, end: int) -> np.ndarray:
        """`[3, end - start]` positions of tokens `[start, end)`; past the prompt each token's
        index plus `rope_delta`, the same on all three axes."""
        prompt_len = self.positions.shape[1]
        inside = self.positions[:, start : min(end, prompt_len)]
        after = np.arange(max(start, prompt_len), end) + self.rope_delta
        return np.concatenate([inside, np.broadcast_to(after, (3, len(after)))], axis=1)

    def cache_keys(self, token_ids: list[int]) -> list[int]:
        """`token_ids` (a prefix of the prompt and output) with each image's placeholder tokens
        replaced by a negative key from its hash: the prefix cache then matches an image's
        pages only for the same image."""
        keys = list(token_ids)
        for image in self.images:
            if image.offset >= len(keys):
                break
            end = min(image.end, len(keys))
            keys[image.offset : end] = [-1 - image.key] * (end - image.offset)
        return keys


@dataclass(frozen=True, eq=False)
class StepImage:
    """Part of an image a step's query tokens cover: its features `first .. first + count`
    replace query tokens `dst .. dst + count` of the step."""

    image: ImageInput
    dst: int
    first: int
    count: int


def step_images(mm: MultimodalPrompt, start: int, end: int, base: int) -> list[StepImage]:
    """The images (or parts) of sequence tokens `[start, end)` run as query tokens `base ..`."""
    parts = []
    for image in mm.images:
        lo, hi = max(start, image.offset), min(end, image.end)
        if lo < hi:
            parts.append(StepImage(image, base + lo - start, lo - image.offset, hi - lo))
    return parts


def multimodal_prompt(
    token_ids: list[int],
    images: tuple[ImageInput, ...],
    image_token_id: int,
    merge_size: int,
    patch_values: int,
) -> MultimodalPrompt:
    """Check that `images` fill exactly the runs of `image_token_id` in `token_ids`, in order,
    each with `num_tokens` tokens and `[t * h * w, patch_values]` pixels; raises `ValueError`
    naming `images` otherwise. Returns the prompt's rotary positions."""
    ids = np.asarray(token_ids)
    expected = np.flatnonzero(ids == image_token_id)
    covered = np.concatenate(
        [np.arange(i.offset, i.end) for i in images] or [np.zeros(0, dtype=np.int64)]
    )
    if not np.array_equal(expected, covered):
        raise ValueError(
            f"images must fill the prompt's {len(expected)} image placeholder tokens in order, "
            f"got {len(images)} image(s) covering {len(covered)} tokens"
        )
    for n, image in enumerate(images):
        t, h, w = image.grid_thw
        if min(t, h, w) < 1 or h % merge_size or w % merge_size:
            raise ValueError(f"images[{n}]: bad patch grid {image.grid_thw}")
        shape = (t * h * w, patch_values)
        if image.num_tokens != num_image_tokens(image.grid_thw, merge_size):
            raise ValueError(f"images[{n}]: {image.num_tokens} tokens for grid {image.grid_thw}")
        if image.pixel_values.shape != shape or image.pixel_values.dtype != np.float32:
            raise ValueError(
                f"images[{n}]: pixel values must be float32 {shape}, got "
                f"{image.pixel_values.dtype} {image.pixel_values.shape}"
            )
    return MultimodalPrompt.build(len(token_ids), images, merge_size)
