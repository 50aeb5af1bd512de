"""Drafting with a smaller checkpoint that shares the target's tokenizer.

The draft keeps its own paged KV cache, indexed by the *target's* page ids: page p holds the
target's K/V of some tokens in the target's cache and the draft's K/V of the same tokens in this
one. The page pool, the radix prefix cache and preemption therefore handle both caches with one
page accounting (a page costs the target's bytes plus the draft's): a prefix hit reuses both,
a preempted request frees both.

For that to hold, the draft's KV must cover exactly the tokens the target's does. `mirror` runs
the draft over every batch the target runs (same token ids, positions and slots: prefill chunks,
decodes and verify windows alike); a verify's rejected positions are stale in both caches and
overwritten in both later. `propose` then extends a row from its newest token (sampled by the
target, not yet in either cache) with k draft decodes, writing the draft's KV at positions the
scheduler already reserved for the verify that follows.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from tokenmill.attention.backend import AttentionInputs, create_backend
from tokenmill.cache.kv_cache import KVCache
from tokenmill.config import ModelConfig
from tokenmill.layers.invariant import make_batch_invariant
from tokenmill.models.loader import load_model
from tokenmill.runner.staging import HostStaging
from tokenmill.spec.proposer import Drafts


class DraftSampler(Protocol):
    """Picks one draft token per row from the draft's logits `[B, V]` (rows of the whole batch;
    rows not drafting at this position hold zeros and their picks are dropped). Returns the
    tokens `[B]` and the distributions they were drawn from `[B, V]`, or None when every row is
    greedy (drafts are then the argmax, and verification compares them exactly)."""

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class DraftModelProposer:
    """A draft checkpoint with a KV cache over the target's page ids."""

    def __init__(
        self,
        draft: ModelConfig,
        num_speculative_tokens: int,
        num_pages: int,
        page_size: int,
        device: torch.device,
        attention_backend: str,
        max_num_seqs: int,
        load_format: str = "auto",
        seed: int = 0,
        deterministic: bool = False,
    ) -> None:
        """`deterministic`: batch-invariant products and attention, as the target's, so a seeded
        sampled request's drafts (and so its accepted tokens) do not depend on its batch."""
        self.config = draft
        self.k = num_speculative_tokens
        self.device = device
        self.page_size = page_size
        self.model = load_model(draft, device, load_format, seed)
        if deterministic:
            make_batch_invariant(self.model)
        self.kv_cache = KVCache.allocate(draft, num_pages, page_size, device)
        self.attention = create_backend(
            attention_backend, draft, self.kv_cache, max_num_seqs, deterministic
        )
        self.staging = HostStaging(device)

    @staticmethod
    def bytes_per_page(draft: ModelConfig, page_size: int) -> int:
        """What one shared page adds to the target's page in the draft's cache."""
        return KVCache.bytes_per_page(draft, page_size)

    @torch.inference_mode()
    def mirror(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs: AttentionInputs
    ) -> None:
        """Write the draft's K/V for the batch the target just ran, in the same slots."""
        self.attention.plan(inputs)
        self.model(input_ids, positions, self.attention)

    @torch.inference_mode()
    def propose(
        self,
        last_token_ids: torch.Tensor,
        positions: np.ndarray,
        num_drafts: np.ndarray,
        page_table: np.ndarray,
        sample: DraftSampler,
    ) -> Drafts:
        """Draft `num_drafts[b]` tokens after each row's newest token.

        `last_token_ids` `[B]` (device): each row's newest token, at position `positions[b]`,
        whose KV neither model has yet; the draft has KV for every earlier position.
        `page_table` `[B, W]`: each row's pages, covering positions up to
        `positions[b] + num_drafts[b]` (the verify's reservation). Iteration j runs only the rows
        drafting more than j tokens, so no row writes past its reserved pages.
        """
        batch = len(positions)
        drafts = torch.zeros(batch, self.k, dtype=torch.int64, device=self.device)
        probs: torch.Tensor | None = None
        tokens = last_token_ids
        ps = self.page_size
        counts, table = self.staging.to_device(num_drafts.astype(np.int64), page_table)
        for j in range(int(num_drafts.max(initial=0))):
            rows = np.flatnonzero(num_drafts > j)
            pos = (positions[rows] + j).astype(np.int64)
            slots = page_table[rows, pos // ps] * ps + pos % ps
            rows_t, pos_t, slots_t, kv_t = self.staging.to_device(rows, pos, slots, pos + 1)
            logits = self._decode(tokens[rows_t], pos_t, slots_t, kv_t, (pos + 1).tolist(),
                                  table[rows_t])  # fmt: skip
            if len(rows) < batch:  # the sampler sees the whole batch: its settings are per row
                logits = logits.new_zeros(batch, logits.shape[-1]).index_copy_(0, rows_t, logits)
            chosen, chosen_probs = sample(logits)
            drafts[:, j] = chosen
            if chosen_probs is not None:
                if probs is None:
                    shape = (batch, self.k, chosen_probs.shape[-1])
                    probs = torch.zeros(shape, device=self.device)
                probs[:, j] = chosen_probs
            tokens = drafts[:, j]
        return Drafts(token_ids=drafts, num_drafts=counts, probs=probs)

    def _decode(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_lens: torch.Tensor,
        kv_lens_cpu: list[int],
        page_table: torch.Tensor,
    ) -> torch.Tensor:
        """One token per row at `positions` (in slots `slots`, `kv_lens = positions + 1`, also
        on the host): write its K/V, return the next-token logits."""
        batch = len(token_ids)
        self.attention.plan(
            AttentionInputs(
                query_lens_cpu=[1] * batch,
                kv_lens_cpu=kv_lens_cpu,
                cu_query_lens=torch.arange(batch + 1, device=self.device),
                kv_lens=kv_lens,
                page_table=page_table,
                slot_mapping=slots,
            )
        )
        hidden = self.model(token_ids, positions, self.attention)
        return self.model.compute_logits(hidden)
