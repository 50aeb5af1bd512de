"""Rotary position embedding (default, linear and llama3 frequency scaling), and Qwen3-VL's
multimodal rotary (mrope: temporal, height and width positions, interleaved)."""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair rotation frequencies, with the checkpoint's scaling applied (float32)."""
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1's smooth interpolation between scaled low and unscaled high frequencies."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position, half-split layout (as transformers' `rotate_half`)."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rope, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply rotation to `q` `[T, Hq, D]` and `k` `[T, Hk, D]` at `positions` `[T]`."""
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryTable(RotaryEmbedding):
    """Rotation rows given outright (`cos`, `sin` `[N, D]`), indexed by `positions` like a
    `RotaryEmbedding`'s table: one step's multimodal rotation, row t for query token t."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        nn.Module.__init__(self)
        self.cos, self.sin = cos, sin


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen3-VL's multimodal rotary: each token has a temporal, a height and a width position;
    rotation frequency j turns by the height position where `j % 3 == 1` and `j < 3 *
    section[1]`, by the width position where `j % 3 == 2` and `j < 3 * section[2]`, else by the
    temporal one (transformers' interleaved `mrope_section`). A text token's three positions
    are equal, so one position (`[T]`) rotates as the plain table does."""

    def __init__(
        self, head_dim: int, rope: RopeConfig, max_positions: int, section: tuple[int, int, int]
    ) -> None:
        super().__init__(head_dim, rope, max_positions)
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {list(section)} must add up to head_dim / 2")
        j = torch.arange(head_dim // 2)
        axis = torch.zeros(head_dim // 2, dtype=torch.int64)
        axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
        self.register_buffer("axis", torch.cat((axis, axis)), persistent=False)

    def table(self, positions: torch.Tensor) -> RotaryTable:
        """The rotation rows of tokens at `positions` `[3, T]`: row t for token t."""
        index = self.axis.expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, index)[0]
        sin = self.sin[positions].gather(0, index)[0]
        return RotaryTable(cos, sin)
