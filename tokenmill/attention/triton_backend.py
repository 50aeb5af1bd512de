"""The Triton attention backend (default on CUDA): paged varlen prefill and split-KV decode."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionInputs, QKNorm
from tokenmill.cache.kv_cache import KVCache
from tokenmill.config import ModelConfig
from tokenmill.kernels.attention import decode_attention, invariant_attention, prefill_attention
from tokenmill.kernels.rope_store import rope_and_store
from tokenmill.layers.rotary import RotaryEmbedding

# Decode splits the context into this many chunks per sequence, processed in parallel; fixed
# so that a captured CUDA graph serves every context length. Off a GPU (Triton's interpreter
# runs the programs one after another) one split: more would only add programs and a merge.
DECODE_SPLITS = 16


def decode_splits(device: torch.device) -> int:
    """How many splits decode attention cuts each context into on `device`."""
    return DECODE_SPLITS if device.type == "cuda" else 1


class FusedStoreBackend(AttentionBackend):
    """Backends whose `store_qkv` is the fused Triton kernel (q/k norm, rotary, K/V store);
    `plan` must keep the step's inputs as `self._inputs`."""

    _inputs: AttentionInputs

    def _cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.model
        return (
            self.kv_cache.k[layer].view(-1, cfg.num_kv_heads, cfg.head_dim),
            self.kv_cache.v[layer].view(-1, cfg.num_kv_heads, cfg.head_dim),
        )

    def store_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        layer: int,
        rotary: RotaryEmbedding,
        qk_norm: QKNorm | None,
    ) -> torch.Tensor:
        cfg = self.model
        k_cache, v_cache = self._cache(layer)
        norm = None
        if qk_norm is not None:
            norm = (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
        return rope_and_store(
            qkv, positions, self._inputs.slot_mapping, rotary.cos, rotary.sin, k_cache, v_cache,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, norm,
        )  # fmt: skip


class TritonAttentionBackend(FusedStoreBackend):
    """Decode batches use split-KV decode; any batch with a multi-token query uses prefill.
    Deterministic mode runs every batch through `invariant_attention`."""

    def __init__(
        self, model: ModelConfig, kv_cache: KVCache, max_num_seqs: int, deterministic: bool = False
    ) -> None:
        super().__init__(model, kv_cache, max_num_seqs, deterministic)
        device = kv_cache.k[0].device
        shape = (max_num_seqs, model.num_heads, decode_splits(device))
        self._mid_o = torch.empty((*shape, model.head_dim), dtype=torch.float32, device=device)
        self._mid_lse = torch.empty(shape, dtype=torch.float32, device=device)

    def plan(self, inputs: AttentionInputs) -> None:
        self._inputs = inputs
        self._decode = inputs.is_decode
        self._max_q_len = max(inputs.query_lens_cpu)

    def graph_safe(self) -> bool:
        return True

    def prefill_graph_safe(self) -> bool:
        return True  # the prefill kernel's programs past a sequence's query length return

    def attend(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        k_cache, v_cache = self._cache(layer)
        inputs, ps, window = self._inputs, self.kv_cache.page_size, self.model.sliding_window
        if self.deterministic:
            return invariant_attention(
                q, k_cache, v_cache, inputs.cu_query_lens, inputs.kv_lens, inputs.page_table,
                self._max_q_len, ps, self.scale, window,
            )  # fmt: skip
        if self._decode:
            return decode_attention(
                q, k_cache, v_cache, inputs.kv_lens, inputs.page_table, ps, self.scale, window,
                self._mid_o, self._mid_lse,
            )  # fmt: skip
        return prefill_attention(
            q, k_cache, v_cache, inputs.cu_query_lens, inputs.kv_lens, inputs.page_table,
            self._max_q_len, ps, self.scale, window,
        )  # fmt: skip
