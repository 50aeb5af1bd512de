"""The FlashInfer attention backend (`--attention-backend flashinfer`, when the `flashinfer`
package is importable): FlashInfer's paged prefill and decode kernels over tokenmill's KV cache.

q/k norm, rotary and the K/V store stay the Triton backend's fused kernel; FlashInfer reads the
cache in its "NHD" layout, which is tokenmill's `[num_pages, page_size, Hkv, D]`. Each step's
page lists are handed to FlashInfer's `plan` as CSR arrays (`indptr`, `indices`,
`last_page_len`). The wrappers plan on the host per step, so this backend runs without CUDA
graphs (`--enforce-eager`).
"""

from __future__ import annotations

import itertools

import flashinfer
import torch

from tokenmill.attention.backend import AttentionInputs
from tokenmill.attention.triton_backend import FusedStoreBackend
from tokenmill.cache.kv_cache import KVCache
from tokenmill.config import ModelConfig

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split-KV partial results)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer's query / KV-cache types


class FlashInferAttentionBackend(FusedStoreBackend):
    """Decode batches use FlashInfer's batch decode; others its paged (append) prefill."""

    def __init__(
        self, model: ModelConfig, kv_cache: KVCache, max_num_seqs: int, deterministic: bool = False
    ) -> None:
        if deterministic:  # RunnerConfig refuses the pair; a direct caller gets told here
            raise ValueError("attention_backend 'flashinfer' has no deterministic form")
        if model.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"attention_backend 'flashinfer' needs dtype float16 or bfloat16, got {model.dtype}"
            )
        super().__init__(model, kv_cache, max_num_seqs)
        device = kv_cache.k[0].device
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self._is_decode = False

    def plan(self, inputs: AttentionInputs) -> None:
        cfg, ps = self.model, self.kv_cache.page_size
        self._inputs = inputs
        self._is_decode = inputs.is_decode
        pages = [-(-n // ps) for n in inputs.kv_lens_cpu]
        indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32)
        # Row i's first pages[i] entries of the page table, concatenated (one gather).
        rows = torch.repeat_interleave(torch.arange(len(pages)), torch.tensor(pages))
        cols = torch.arange(int(indptr[-1])) - indptr[:-1].long()[rows]
        device = inputs.page_table.device
        indices = inputs.page_table[rows.to(device), cols.to(device)].to(torch.int32)
        last_page_len = torch.tensor(
            [n - (p - 1) * ps for n, p in zip(inputs.kv_lens_cpu, pages, strict=True)],
            dtype=torch.int32,
        )
        window = cfg.sliding_window - 1 if cfg.sliding_window is not None else -1
        common = dict(
            window_left=window, sm_scale=self.scale, q_data_type=cfg.dtype, kv_data_type=cfg.dtype
        )
        head = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ps)
        if self._is_decode:
            self._decode.plan(indptr, indices, last_page_len, *head, **common)
        else:
            qo_indptr = torch.tensor(
                [0, *itertools.accumulate(inputs.query_lens_cpu)], dtype=torch.int32
            )
            self._prefill.plan(
                qo_indptr, indptr, indices, last_page_len, *head, causal=True, **common
            )

    def attend(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        cache = (self.kv_cache.k[layer], self.kv_cache.v[layer])
        wrapper = self._decode if self._is_decode else self._prefill
        return wrapper.run(q, cache)
