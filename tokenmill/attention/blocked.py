"""Batch-invariant attention in torch ops: every query token reduces over its keys in fixed
blocks of `KEY_BLOCK` positions from position 0, with products of one fixed shape.

The torch backend's default path pads a decode group to its longest context and hands each
prefill chunk to SDPA, whose blocking follows the chunk's length, so a token's output depends on
its batch and on how its prompt was chunked. Here (deterministic mode):

- Query tokens are cut into tiles of `QUERY_TILE` consecutive tokens of one sequence (a decode
  row is a tile of one token and padding). For key block j, the tiles that reach it multiply
  their queries by its keys, `[QUERY_TILE * group, D] x [D, KEY_BLOCK]` per (tile, key/value
  head), in one batched product of identical shapes: a row's result does not depend on the
  other rows of its tile (see `layers.invariant`).
- An online softmax folds block after block into each row's running max, sum and output. A
  block past a token's position (there for another token of its tile) is masked whole and
  changes nothing: its weights are exact zeros and its rescale factor exactly 1.
- Pointwise exponentials go through `invariant_pointwise`.

So a token's output depends only on its query, its keys and values, and its position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention.backend import AttentionInputs
from tokenmill.config import ModelConfig
from tokenmill.layers.invariant import invariant_pointwise

QUERY_TILE = 8
KEY_BLOCK = 64


@dataclass(frozen=True)
class BlockedPlan:
    """A step's query tiles, those reaching more key blocks first.

    `tokens [N, QUERY_TILE]` (index of each tile row's query token in the flattened batch; 0
    for padding), `positions [N, QUERY_TILE]` (-1 for padding: it attends to nothing),
    `slots [N, blocks * KEY_BLOCK]` (cache slot of each key position; 0 where past the
    sequence, masked), `key_valid` (the position is in the sequence), and `active[j]`: how
    many tiles reach key block j.
    """

    tokens: torch.Tensor
    real: torch.Tensor  # [N, QUERY_TILE] bool: the tile row is a query token
    positions: torch.Tensor
    slots: torch.Tensor
    key_valid: torch.Tensor
    active: list[int]


def plan_blocked(inputs: AttentionInputs, page_size: int) -> BlockedPlan:
    """Tile the batch of `inputs` (host arithmetic, one copy of each array to the device)."""
    q_lens = np.asarray(inputs.query_lens_cpu, dtype=np.int64)
    kv_lens = np.asarray(inputs.kv_lens_cpu, dtype=np.int64)
    tiles_per_row = -(-q_lens // QUERY_TILE)
    row = np.repeat(np.arange(len(q_lens)), tiles_per_row)
    first_tile = np.concatenate(([0], np.cumsum(tiles_per_row)[:-1]))
    tile_in_row = np.arange(len(row)) - first_tile[row]
    offset = tile_in_row[:, None] * QUERY_TILE + np.arange(QUERY_TILE)[None, :]  # in the chunk
    real = offset < q_lens[row][:, None]
    cu = np.concatenate(([0], np.cumsum(q_lens)))
    tokens = np.where(real, cu[row][:, None] + offset, 0)
    positions = np.where(real, (kv_lens - q_lens)[row][:, None] + offset, -1)
    blocks = -(-(positions.max(axis=1) + 1) // KEY_BLOCK)
    order = np.argsort(-blocks, kind="stable")
    row, tokens, real, positions, blocks = (
        a[order] for a in (row, tokens, real, positions, blocks)
    )
    width = int(blocks[0]) * KEY_BLOCK if len(blocks) else 0
    key_pos = np.arange(width)[None, :]
    key_valid = key_pos < kv_lens[row][:, None]
    device = inputs.page_table.device
    row_d = torch.from_numpy(row).to(device)
    clipped = torch.from_numpy(np.minimum(key_pos, np.maximum(kv_lens[row][:, None] - 1, 0)))
    clipped = clipped.to(device)
    pages = torch.gather(inputs.page_table[row_d], 1, clipped // page_size)
    slots = torch.where(
        torch.from_numpy(key_valid).to(device), pages * page_size + clipped % page_size, 0
    )
    active = [int((blocks > j).sum()) for j in range(width // KEY_BLOCK)]
    return BlockedPlan(
        tokens=torch.from_numpy(tokens).to(device),
        real=torch.from_numpy(real).to(device),
        positions=torch.from_numpy(positions).to(device),
        slots=slots,
        key_valid=torch.from_numpy(key_valid).to(device),
        active=active,
    )


def attend_blocked(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: BlockedPlan,
    model: ModelConfig,
    scale: float,
) -> torch.Tensor:
    """Attention output `[T, Hq, D]` of `q` over the flattened caches `[slots, Hkv, D]`."""
    hkv, d = model.num_kv_heads, model.head_dim
    group = model.num_heads // hkv
    tiles = plan.tokens.shape[0]
    rows = QUERY_TILE * group
    # [tiles * Hkv, QUERY_TILE * group, D]: a tile's queries of one key/value head.
    qt = q[plan.tokens].float().view(tiles, QUERY_TILE, hkv, group, d)
    qt = qt.permute(0, 2, 1, 3, 4).reshape(tiles * hkv, rows, d)
    device = q.device
    m = torch.full((tiles * hkv, rows), float("-inf"), device=device)
    total = torch.zeros(tiles * hkv, rows, device=device)
    acc = torch.zeros(tiles * hkv, rows, d, device=device)
    for j, n in enumerate(plan.active):
        a = n * hkv
        keys = slice(j * KEY_BLOCK, (j + 1) * KEY_BLOCK)
        slots = plan.slots[:n, keys]
        k = k_cache[slots].float().permute(0, 2, 3, 1).reshape(a, d, KEY_BLOCK)
        valid = plan.key_valid[:n, keys]
        v = torch.where(valid[:, :, None, None], v_cache[slots].float(), 0.0)
        v = v.permute(0, 2, 1, 3).reshape(a, KEY_BLOCK, d)
        key_pos = torch.arange(j * KEY_BLOCK, (j + 1) * KEY_BLOCK, device=device)
        keep = key_pos[None, None, :] <= plan.positions[:n, :, None]  # [n, QUERY_TILE, KEY_BLOCK]
        if model.sliding_window is not None:
            window_start = plan.positions[:n, :, None] - model.sliding_window
            keep &= key_pos[None, None, :] > window_start
        s = (torch.bmm(qt[:a], k) * scale).view(n, hkv, QUERY_TILE, group, KEY_BLOCK)
        s = torch.where(keep[:, None, :, None, :], s, float("-inf")).view(a, rows, KEY_BLOCK)
        m_new = torch.maximum(m[:a], s.amax(dim=-1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        p = invariant_pointwise(torch.exp, s - m_safe[..., None])
        alpha = invariant_pointwise(torch.exp, m[:a] - m_safe)
        total[:a] = total[:a] * alpha + p.sum(dim=-1)
        acc[:a] = acc[:a] * alpha[..., None] + torch.bmm(p, v)
        m[:a] = m_new
    out = acc / torch.where(total == 0.0, 1.0, total)[..., None]
    out = out.view(tiles, hkv, QUERY_TILE, group, d).permute(0, 2, 1, 3, 4)
    out = out.reshape(tiles * QUERY_TILE, hkv * group, d).to(q.dtype)
    result = torch.empty_like(q)
    real = plan.real.reshape(-1)
    result[plan.tokens.reshape(-1)[real]] = out[real]
    return result
