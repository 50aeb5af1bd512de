"""Qwen3-VL and Qwen3-VL-MoE: a vision transformer whose merged patch features replace the
image placeholder tokens' embeddings (and, from some of its blocks, are added to the first
decoder layers' outputs: deepstack), in front of the Qwen3 (or Qwen3-MoE) decoder with
multimodal rotary positions.

Checkpoint names are the hub's (`model.visual.*`, `model.language_model.*`, `lm_head.*`); the
decoder is tokenmill's Llama-family one, so attention backends, paged KV, tensor parallelism
(the vision encoder is replicated on every rank) and the loader are shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import ModelConfig, VisionConfig
from tokenmill.distributed.group import TPGroup
from tokenmill.layers.rotary import MRotaryEmbedding
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.qwen3_moe import Qwen3MoeForCausalLM, sparse_or_dense_mlp


@dataclass(frozen=True)
class VisionEmbeds:
    """A step's image features, in the order of the query tokens they replace:
    `token_index` `[N]` (query token of each), `embeds` `[N, hidden]` and `deepstack`
    `[L, N, hidden]` (added after decoder layer l, l < L)."""

    token_index: torch.Tensor
    embeds: torch.Tensor
    deepstack: torch.Tensor


@dataclass(frozen=True)
class EncodedImage:
    """One image through the vision encoder: `embeds` `[tokens, hidden]`, `deepstack` `[L,
    tokens, hidden]`."""

    embeds: torch.Tensor
    deepstack: torch.Tensor


def _patch_grid(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """`[patches, 2]` (row, column) of every patch, in the processor's order: frames, then
    merge blocks row by row, then the patches inside a block."""
    rows = []
    for t, h, w in grid_thw:
        r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        blocks = [axis.reshape(shape).transpose(1, 2).flatten() for axis in (r, c)]
        rows.append(torch.stack(blocks, dim=-1).repeat(t, 1))
    return torch.cat(rows)


class VisionPatchEmbed(nn.Module):
    """A 3-D convolution whose kernel is its stride (one output per patch): a matrix product
    over each flattened patch."""

    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.proj = nn.Conv3d(vc.in_channels, vc.hidden_size, kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.reshape(self.proj.out_channels, -1)
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    """Bidirectional attention within each image (frame), 2-D rotary on (row, column)."""

    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = vc.num_heads, vc.hidden_size // vc.num_heads
        self.qkv = nn.Linear(vc.hidden_size, 3 * vc.hidden_size)
        self.proj = nn.Linear(vc.hidden_size, vc.hidden_size)

    def forward(
        self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).reshape(len(x), 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        start = 0
        for n, count in _runs(lengths):
            # `count` images (frames) of `n` patches in one call, each its own batch entry (no
            # mask over the whole batch). Inputs are 4-D: SDPA's flash and memory-efficient
            # kernels take no other rank; a 3-D call runs the math path, which materialises
            # every score (the encoder took ~80 ms per 1024x768 image on the H200 that way).
            end = start + n * count
            qs, ks, vs = (_images(t[start:end], count) for t in (q, k, v))
            attended = F.scaled_dot_product_attention(qs, ks, vs)
            out[start:end] = attended.transpose(1, 2).flatten(0, 1)
            start = end
        return self.proj(out.reshape(len(x), -1))


def _images(x: torch.Tensor, count: int) -> torch.Tensor:
    """`[count * n, heads, d]` patches of `count` equal images as `[count, heads, n, d]`."""
    return x.view(count, -1, *x.shape[1:]).transpose(1, 2)


def _runs(lengths: list[int]) -> list[tuple[int, int]]:
    """(length, count) of each run of equal consecutive lengths."""
    runs: list[tuple[int, int]] = []
    for n in lengths:
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    return runs


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half in float32 (as transformers' vision rotary), back to `x`'s dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        if vc.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision hidden_act {vc.hidden_act!r} is not supported")
        self.approximate = "tanh" if vc.hidden_act == "gelu_pytorch_tanh" else "none"
        self.linear_fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.linear_fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(vc.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(vc.hidden_size, eps=1e-6)
        self.attn = VisionAttention(vc)
        self.mlp = VisionMLP(vc)

    def forward(
        self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), lengths, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Merges each block of `merge^2` patches into one language-model token: LayerNorm (per
    patch, or, `postshuffle`, over the merged block), then a GELU MLP to the decoder's width."""

    def __init__(self, vc: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.merged = vc.hidden_size * vc.merge_unit
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged if postshuffle else vc.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, vc.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged) if self.postshuffle else x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VLVisionModel(nn.Module):
    """The vision encoder: patch embedding plus a learned position grid (bilinearly resampled
    to each image's grid), transformer blocks with 2-D rotary, a patch merger, and the
    deepstack mergers of blocks `deepstack_visual_indexes`."""

    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        self.config = vc
        self.patch_embed = VisionPatchEmbed(vc)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, vc.hidden_size)
        self.side = int(vc.num_position_embeddings**0.5)
        head_dim = vc.hidden_size // vc.num_heads
        spatial = head_dim // 2  # half the frequencies turn by the row, half by the column
        steps = torch.arange(0, spatial, 2, dtype=torch.float) / spatial
        inv_freq = 1.0 / vc.rope_theta**steps
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.depth))
        self.merger = PatchMerger(vc, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(vc, postshuffle=True) for _ in vc.deepstack_visual_indexes
        )

    def forward(
        self, patches: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Features `[tokens, out_hidden]` and deepstack features `[L, tokens, out_hidden]` of
        the images whose patches are concatenated in `patches` (grids `grid_thw`)."""
        vc = self.config
        grid = _patch_grid(grid_thw, vc.spatial_merge_size).to(patches.device)
        x = self.patch_embed(patches)
        x = x + self._position_embeddings(grid, grid_thw).to(x.dtype)
        freqs = (grid[..., None].float() * self.inv_freq).flatten(1)  # [N, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        lengths = [h * w for t, h, w in grid_thw for _ in range(t)]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, lengths, cos, sin)
            if i in vc.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[vc.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        return self.merger(x), torch.stack(deepstack)

    def _position_embeddings(
        self, grid: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """The learned `side x side` position grid, resampled bilinearly (corners aligned) to
        each image's patch grid, at every patch's (row, column)."""
        counts = torch.tensor([t * h * w for t, h, w in grid_thw])
        sides = torch.tensor([(h, w) for _, h, w in grid_thw])
        sizes = sides.repeat_interleave(counts, dim=0).to(grid.device)
        side = self.side
        src = grid.float() * (side - 1) / (sizes - 1).clamp(min=1)  # [N, 2]
        low = src.floor().long()
        frac = src - low
        high = (low + 1).clamp(max=side - 1)
        (r0, c0), (r1, c1), (fr, fc) = low.unbind(1), high.unbind(1), frac.unbind(1)
        taps = torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], 1)
        weights = torch.stack([(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], dim=1)
        # float32 weights, as transformers (the sum is cast to the model dtype by the caller)
        return (self.pos_embed(taps) * weights[:, :, None]).sum(1)


class Qwen3VLForConditionalGeneration(LlamaForCausalLM):
    """Qwen3-VL: `visual` (the vision encoder) and the Qwen3 decoder with multimodal rotary.

    `forward` takes positions `[T]` (text only: all three rotary positions equal) or `[3,
    T]`, and a step's image features (`VisionEmbeds`), which replace the placeholder tokens'
    embeddings and are added after the first decoder layers (deepstack).
    """

    # checkpoint prefix → ours
    checkpoint_prefixes: ClassVar[dict[str, str]] = {
        "model.language_model.": "model.",
        "model.visual.": "visual.",
    }

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        if cfg.vision is None:
            raise ValueError(f"{cfg.architecture} needs a vision_config in config.json")
        rotary = MRotaryEmbedding(
            cfg.head_dim, cfg.rope, cfg.max_position_embeddings, cfg.vision.mrope_section
        )
        super().__init__(cfg, tp, rotary)
        self.mrope = rotary
        self.visual = Qwen3VLVisionModel(cfg.vision)

    def encode_images(
        self, patches: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> list[EncodedImage]:
        """Each image's features, for images whose patches are concatenated in `patches`."""
        embeds, deepstack = self.visual(patches, grid_thw)
        merge = self.visual.config.merge_unit
        sizes = [t * h * w // merge for t, h, w in grid_thw]
        return [
            EncodedImage(e, d)
            for e, d in zip(embeds.split(sizes), deepstack.split(sizes, dim=1), strict=True)
        ]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        vision: VisionEmbeds | None = None,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` of the flattened batch `input_ids` `[T]`."""
        model = self.model
        x = model.embed_tokens(input_ids)
        if vision is not None:
            x[vision.token_index] = vision.embeds.to(x.dtype)
        rotary = None
        if positions.dim() == 2:  # per-token rows; the attention indexes them by query token
            rotary = self.mrope.table(positions)
            positions = torch.arange(positions.shape[1], device=positions.device)
        residual: torch.Tensor | None = None
        num_deepstack = len(vision.deepstack) if vision is not None else 0
        for i, layer in enumerate(model.layers):
            x, residual = layer(positions, x, residual, attn, rotary)
            if i < num_deepstack:
                assert vision is not None
                # transformers adds the features to the layer's output (x + residual), which
                # then is the next layer's residual
                x = x + residual
                x[vision.token_index] += vision.deepstack[i].to(x.dtype)
                residual = None
        if residual is None:
            return model.norm(x)
        x, _ = model.norm.add_forward(x, residual)
        return x


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL-MoE: the same with the Qwen3-MoE decoder (stacked experts, `mlp.gate` router)."""

    expert_params = Qwen3MoeForCausalLM.expert_params
    make_mlp = staticmethod(sparse_or_dense_mlp)
