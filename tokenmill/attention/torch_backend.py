"""The reference attention backend: gathers paged K/V and calls PyTorch SDPA (CPU and GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionInputs, QKNorm
from tokenmill.attention.blocked import attend_blocked, plan_blocked
from tokenmill.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class _DecodeGroup:
    """Single-token queries, attended together over K/V gathered into a padded batch."""

    token_index: torch.Tensor  # [B] position of each query in the flattened batch
    slots: torch.Tensor  # [B, L] cache slot of every context position (padding → slot 0)
    mask: torch.Tensor  # [B, 1, 1, L] True where the position is attended


@dataclass(frozen=True)
class _PrefillSeq:
    """A multi-token query (prefill chunk), attended on its own."""

    start: int
    end: int
    slots: torch.Tensor  # [L] cache slot of every context position
    mask: torch.Tensor | None  # [1, 1, q, L] causal (+ window) mask; None: plain causal, q == L


class TorchAttentionBackend(AttentionBackend):
    """Correctness oracle: plain tensor ops, no custom kernels. Deterministic mode attends
    every token through `attention.blocked` instead of SDPA."""

    def plan(self, inputs: AttentionInputs) -> None:
        # Tokens with a negative slot (padding, the start-up warm-up) write nothing.
        self._stored = torch.nonzero(inputs.slot_mapping >= 0).squeeze(1)
        self._slot_mapping = inputs.slot_mapping[self._stored]
        page_size = self.kv_cache.page_size
        if self.deterministic:
            self._blocked = plan_blocked(inputs, page_size)
            return
        device = inputs.slot_mapping.device
        cu = [0]
        for q in inputs.query_lens_cpu:
            cu.append(cu[-1] + q)
        decode = [i for i, q in enumerate(inputs.query_lens_cpu) if q == 1]
        self._decode = self._plan_decode(inputs, decode, cu, page_size) if decode else None
        self._prefills = [
            self._plan_prefill(inputs, i, cu, page_size, device)
            for i, q in enumerate(inputs.query_lens_cpu)
            if q > 1
        ]

    def _plan_decode(
        self, inputs: AttentionInputs, rows: list[int], cu: list[int], page_size: int
    ) -> _DecodeGroup:
        device = inputs.slot_mapping.device
        rows_t = torch.tensor(rows, device=device)
        kv_lens = inputs.kv_lens[rows_t]
        max_len = max(inputs.kv_lens_cpu[i] for i in rows)
        pos = torch.arange(max_len, device=device)
        valid = pos[None, :] < kv_lens[:, None]
        pages = inputs.page_table[rows_t][:, pos // page_size]
        slots = torch.where(valid, pages * page_size + pos % page_size, 0)
        if self.model.sliding_window is not None:
            valid &= pos[None, :] > kv_lens[:, None] - 1 - self.model.sliding_window
        return _DecodeGroup(
            token_index=torch.tensor([cu[i] for i in rows], device=device),
            slots=slots,
            mask=valid[:, None, None, :],
        )

    def _plan_prefill(
        self, inputs: AttentionInputs, i: int, cu: list[int], page_size: int, device: torch.device
    ) -> _PrefillSeq:
        q_len, kv_len = inputs.query_lens_cpu[i], inputs.kv_lens_cpu[i]
        pos = torch.arange(kv_len, device=device)
        slots = inputs.page_table[i][pos // page_size] * page_size + pos % page_size
        window = self.model.sliding_window
        if q_len == kv_len and (window is None or window >= kv_len):
            return _PrefillSeq(start=cu[i], end=cu[i + 1], slots=slots, mask=None)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
        mask = pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= pos[None, :] > q_pos[:, None] - window
        return _PrefillSeq(start=cu[i], end=cu[i + 1], slots=slots, mask=mask[None, None])

    def store_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        layer: int,
        rotary: RotaryEmbedding,
        qk_norm: QKNorm | None,
    ) -> torch.Tensor:
        cfg = self.model
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        q, k = rotary(positions, q, k)
        stored = self._stored
        self.kv_cache.k[layer].view(-1, *k.shape[1:])[self._slot_mapping] = k[stored]
        self.kv_cache.v[layer].view(-1, *k.shape[1:])[self._slot_mapping] = v.view_as(k)[stored]
        return q

    def attend(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        cfg = self.model
        k_cache = self.kv_cache.k[layer].view(-1, cfg.num_kv_heads, cfg.head_dim)
        v_cache = self.kv_cache.v[layer].view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.deterministic:
            return attend_blocked(q, k_cache, v_cache, self._blocked, cfg, self.scale)
        out = torch.empty_like(q)
        group = cfg.num_heads // cfg.num_kv_heads
        if self._decode is not None:
            d = self._decode
            qd = q[d.token_index].unsqueeze(2)  # [B, Hq, 1, D]
            kd = _heads_first(k_cache[d.slots], group)  # [B, Hq, L, D]
            vd = _heads_first(v_cache[d.slots], group)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=self.scale)
            out[d.token_index] = o.squeeze(2)
        for p in self._prefills:
            qp = q[p.start : p.end].transpose(0, 1)[None]  # [1, Hq, q, D]
            kp = _heads_first(k_cache[p.slots][None], group)  # [1, Hq, L, D]
            vp = _heads_first(v_cache[p.slots][None], group)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=self.scale
            )
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out


def _heads_first(kv: torch.Tensor, group: int) -> torch.Tensor:
    """`[B, L, Hkv, D]` → `[B, Hq, L, D]`, each KV head repeated for its `group` query heads.

    Repeating beats SDPA's `enable_gqa`, which falls back to the slow math kernel on the CPU.
    """
    return kv.transpose(1, 2).repeat_interleave(group, dim=1)
