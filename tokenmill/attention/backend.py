"""The attention backend interface and the string → class registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tokenmill.cache.kv_cache import KVCache
from tokenmill.config import ModelConfig


@dataclass(frozen=True)
class AttentionInputs:
    """Where each sequence of a flattened batch sits, for one forward pass.

    Sequence i owns the next `query_lens_cpu[i]` tokens of the batch; they sit at the end of its
    `kv_lens[i]` tokens of context, whose KV lives in pages `page_table[i]`. `slot_mapping`
    gives, for every query token, the KV-cache slot (`page * page_size + offset`) it writes.
    Host copies (`*_cpu`) let backends plan without reading the device.
    """

    query_lens_cpu: list[int]
    kv_lens_cpu: list[int]
    kv_lens: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor


class AttentionBackend(ABC):
    """Computes causal attention of a mixed prefill/decode batch over the paged KV cache."""

    def __init__(self, model: ModelConfig, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.scale = model.head_dim**-0.5

    @abstractmethod
    def plan(self, inputs: AttentionInputs) -> None:
        """Prepare for the forward passes of one batch (called once per step, before the model)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """Store `k`, `v` `[T, Hkv, D]` in layer `layer`'s cache and attend with `q` `[T, Hq, D]`.

        Returns `[T, Hq, D]`.
        """


def create_backend(name: str, model: ModelConfig, kv_cache: KVCache) -> AttentionBackend:
    """Instantiate the backend registered under `name`."""
    from tokenmill.attention.torch_backend import TorchAttentionBackend

    registry: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}
    if name not in registry:
        raise ValueError(f"attention_backend must be one of {', '.join(registry)}, got {name!r}")
    return registry[name](model, kv_cache)
