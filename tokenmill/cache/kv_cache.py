"""KVCache: the K and V tensors of every layer, indexed by page."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.config import ModelConfig


@dataclass
class KVCache:
    """Per layer, K and V as `[num_pages, page_size, num_kv_heads, head_dim]`."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int

    @staticmethod
    def allocate(
        model: ModelConfig, num_pages: int, page_size: int, device: torch.device
    ) -> KVCache:
        """Zeroed K and V tensors for every layer on `device`."""
        shape = (num_pages, page_size, model.num_kv_heads, model.head_dim)
        k = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(model.num_layers)]
        v = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(model.num_layers)]
        return KVCache(k=k, v=v, page_size=page_size)

    @staticmethod
    def bytes_per_page(model: ModelConfig, page_size: int) -> int:
        """Memory one page takes across all layers, K and V."""
        elem = torch.empty((), dtype=model.dtype).element_size()
        return 2 * model.num_layers * page_size * model.num_kv_heads * model.head_dim * elem
