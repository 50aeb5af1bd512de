"""The attention backend interface and the string → class registry."""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tokenmill.cache.kv_cache import KVCache
from tokenmill.config import ModelConfig
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class AttentionInputs:
    """Where each sequence of a flattened batch sits, for one forward pass.

    Sequence i owns query tokens `[cu_query_lens[i], cu_query_lens[i+1])`; they are the last
    `query_lens_cpu[i]` of its `kv_lens[i]` tokens of context, whose KV lives in pages
    `page_table[i]`. `slot_mapping` gives, for every query token, the KV-cache slot
    (`page * page_size + offset`) it writes; a negative slot (CUDA-graph padding) writes nothing.
    Host copies (`*_cpu`) let backends plan without reading the device. `graphed`: the
    inputs of a CUDA graph's capture, which replays for other lengths read from the device
    (the host copies are the capture's only).
    """

    query_lens_cpu: list[int]
    kv_lens_cpu: list[int]
    cu_query_lens: torch.Tensor
    kv_lens: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    graphed: bool = False

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one query token."""
        return all(q == 1 for q in self.query_lens_cpu)


QKNorm = tuple[RMSNorm, RMSNorm]


class AttentionBackend(ABC):
    """Causal attention of a mixed prefill/decode batch over the paged KV cache.

    Per step, `plan` once; per layer, `store_qkv` (q/k norm, rotary, K/V into the cache — one
    fused kernel where the backend has one), then `attend`.

    `deterministic` (batch-invariant mode): a query token's output must not depend on the rest
    of the batch, on how its sequence's prompt was chunked, or on whether its prefix came from
    the cache: every token reduces over its keys in the same fixed-size blocks, in order, by
    the same code, decode or prefill.
    """

    def __init__(
        self, model: ModelConfig, kv_cache: KVCache, max_num_seqs: int, deterministic: bool = False
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.scale = model.head_dim**-0.5
        self.deterministic = deterministic

    @abstractmethod
    def plan(self, inputs: AttentionInputs) -> None:
        """Prepare for the forward passes of one batch (called once per step, before the model)."""

    @abstractmethod
    def store_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        layer: int,
        rotary: RotaryEmbedding,
        qk_norm: QKNorm | None,
    ) -> torch.Tensor:
        """From fused projections `qkv` `[T, (Hq + 2 Hkv) D]`: normalise (optional) and rotate q
        and k, write k and v into layer `layer`'s cache; returns q `[T, Hq, D]`."""

    @abstractmethod
    def attend(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Attention output `[T, Hq, D]` of `q` over layer `layer`'s cache."""

    def graph_safe(self) -> bool:
        """Whether a decode step's forward can be captured in a CUDA graph."""
        return False

    def prefill_graph_safe(self) -> bool:
        """Whether a one-sequence prefill can be captured too: planned for T query tokens, it
        must serve any query length <= T read from the device (`cu_query_lens`, `kv_lens`),
        the padding tokens having negative slots."""
        return False

    def prebuild_lengths(self, max_tokens: int) -> list[int]:
        """Row lengths (rows of at most `max_tokens` tokens) whose kernels the backend builds
        slowly at their first use and can build ahead (`prebuild`); none by default."""
        return []

    def prebuild(self, length: int) -> None:
        """Build the kernels of rows of `length` tokens (one of `prebuild_lengths`) now, on
        the thread that runs the steps. A backend that lists none takes none."""
        raise ValueError(f"{type(self).__name__} builds no length ahead, asked for {length}")

    def whole_prompt_min_tokens(self) -> int:
        """Prompts of at least this many tokens attend faster whole than split into chunks
        (their rows with no cached prefix take a faster kernel); 0: no such prompts. The
        scheduler lets such a prompt wait a step rather than split it (`Scheduler`)."""
        return 0


# name -> (module, class, the package it needs)
_BACKENDS = {
    "torch": ("tokenmill.attention.torch_backend", "TorchAttentionBackend", "torch"),
    "triton": ("tokenmill.attention.triton_backend", "TritonAttentionBackend", "triton"),
    "flashinfer": (
        "tokenmill.attention.flashinfer_backend",
        "FlashInferAttentionBackend",
        "flashinfer",
    ),
}


def create_backend(
    name: str, model: ModelConfig, kv_cache: KVCache, max_num_seqs: int, deterministic: bool = False
) -> AttentionBackend:
    """Instantiate the backend registered under `name` (its package must be installed);
    `deterministic`: its batch-invariant form (torch and triton have one)."""
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(_BACKENDS)}, got {name!r}")
    module, cls, package = _BACKENDS[name]
    if importlib.util.find_spec(package) is None:
        raise ValueError(
            f"attention_backend {name!r} needs the {package!r} package, which is not installed"
        )
    backend: type[AttentionBackend] = getattr(importlib.import_module(module), cls)
    return backend(model, kv_cache, max_num_seqs, deterministic)
