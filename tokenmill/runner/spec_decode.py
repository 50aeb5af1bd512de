"""The runner's half of speculative decoding: the draft model's drafts and its mirror pass,
and the verification of a step's sampled positions by rejection sampling."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tokenmill.attention.backend import AttentionInputs
from tokenmill.batch import SamplingRows, StepPlan
from tokenmill.config import EngineConfig
from tokenmill.runner.sampler import SampledTokens, Sampler, SamplingBatch, seeded_generator
from tokenmill.spec.draft_model import DraftModelProposer
from tokenmill.spec.proposer import Drafts
from tokenmill.spec.rejection import greedy_verify, random_draws, rejection_sample

# Seeded streams besides sampling's (0): a position's acceptance test, and its draft.
ACCEPT_STREAM, DRAFT_STREAM = 1, 2


class SpecDecoder:
    """Drafts with a draft model (when configured), keeps its KV cache in step with the
    target's, and turns a step's logits into its tokens by verifying each row's drafts."""

    def __init__(
        self, config: EngineConfig, sampler: Sampler, num_pages: int, device: torch.device
    ) -> None:
        spec = config.speculative
        assert spec is not None
        self.k = spec.num_speculative_tokens
        self.vocab_size = config.model.vocab_size
        self.sampler = sampler
        self.device = device
        self.drafter: DraftModelProposer | None = None
        if spec.method == "draft_model":
            self.drafter = DraftModelProposer(
                spec.draft_model_config(config.model, config.max_model_len),
                self.k,
                num_pages,
                config.cache.page_size,
                device,
                config.runner.attention_backend,
                config.scheduler.max_num_seqs,
                config.load_format,
                config.seed,
            )

    @staticmethod
    def extra_bytes_per_page(config: EngineConfig) -> int:
        """The draft cache's share of one page (0 without a draft model)."""
        spec = config.speculative
        if spec is None or spec.method != "draft_model":
            return 0
        draft = spec.draft_model_config(config.model, config.max_model_len)
        return DraftModelProposer.bytes_per_page(draft, config.cache.page_size)

    def draft(self, plan: StepPlan) -> tuple[np.ndarray, Drafts]:
        """The draft model's drafts for the rows that ask for them (`num_device_drafts`):
        their row indices, and the drafts `[R, k]` with their distributions."""
        assert self.drafter is not None and plan.num_device_drafts is not None
        rows = np.flatnonzero(plan.num_device_drafts)
        num = plan.num_device_drafts[rows]
        starts = (plan.kv_lens - plan.query_lens)[rows]
        first = (np.cumsum(plan.query_lens) - plan.query_lens)[rows]
        newest = torch.from_numpy(plan.input_ids[first]).to(self.device)
        offsets = plan.sample_offsets[rows]
        sample = _DraftSampler(self.sampler, plan.sampling, offsets, num, self.vocab_size,
                               self.device)  # fmt: skip
        drafts = self.drafter.propose(newest, starts, num, plan.page_table[rows], sample)
        return rows, drafts

    def mirror(self, ids: torch.Tensor, positions: torch.Tensor, inputs: AttentionInputs) -> None:
        """The draft model runs over the target's batch, so its cache covers the same tokens."""
        if self.drafter is not None:
            self.drafter.mirror(ids, positions, inputs)

    def sample(
        self,
        logits: torch.Tensor,
        plan: StepPlan,
        input_ids: torch.Tensor,
        device_drafts: tuple[np.ndarray, Drafts] | None,
    ) -> SampledTokens:
        """The step's tokens, one per sampled position (`logits` `[S, V]`), verifying each
        verify row's drafts: its accepted drafts, the token after them, then `PLACEHOLDER`s.

        Every sampling row is verified, rows without drafts with none (a plain draw, from the
        same seeded stream the plain sampler uses). `input_ids` `[T]`: the step's query tokens
        on the device, drafts included."""
        rows = np.flatnonzero(plan.num_samples)
        counts = plan.num_samples[rows]
        num_drafts = counts - 1
        offsets = plan.sample_offsets[rows]
        k, width = self.k, self.k + 1
        # Row r's position j: its sampled entry, repeating its last past its drafts.
        j = np.arange(width)[None, :]
        index = offsets[:, None] + np.minimum(j, num_drafts[:, None])
        row_ends = np.cumsum(plan.query_lens)[rows]
        draft_pos = (
            row_ends[:, None] - num_drafts[:, None] + np.minimum(j[:, :k], num_drafts[:, None] - 1)
        )
        index_t, draft_pos_t, num_t = (
            torch.from_numpy(a).to(self.device) for a in (index, draft_pos, num_drafts)
        )
        draft_ids = input_ids[draft_pos_t]
        batch = SamplingBatch.from_rows(plan.sampling, self.vocab_size, self.device)
        probs, greedy = self.sampler.distribution(logits, batch)
        greedy = greedy[index_t]
        if probs is None:
            verified = greedy_verify(greedy, draft_ids, num_t)
        else:
            uniform, noise = random_draws(
                len(rows), k, self.vocab_size, self.device, self.sampler.generator,
                _generators(plan.sampling, index, counts, ACCEPT_STREAM, self.device, k),
                _generators(plan.sampling, index, counts, 0, self.device, width),
            )  # fmt: skip
            params = plan.sampling.params
            greedy_rows = torch.tensor([params[o].greedy for o in offsets], device=self.device)
            verified = rejection_sample(
                probs[index_t], draft_ids, num_t, self._draft_probs(len(rows), rows,
                device_drafts), uniform, noise, greedy_rows, greedy,
            )  # fmt: skip
        row_of_sample = np.repeat(np.arange(len(rows)), counts)
        position = np.arange(len(row_of_sample)) - np.repeat(offsets, counts)
        flat = verified.token_ids[torch.from_numpy(row_of_sample).to(self.device),
                                  torch.from_numpy(position).to(self.device)]  # fmt: skip
        if any(n is not None for n in batch.num_logprobs):
            return Sampler.with_logprobs(logits, flat.clamp(min=0), batch.num_logprobs)
        return SampledTokens(flat, batch.num_logprobs)

    def _draft_probs(
        self, num_rows: int, rows: np.ndarray, device_drafts: tuple[np.ndarray, Drafts] | None
    ) -> torch.Tensor | None:
        """`[R, k, V]` the draft model's q for every sampling row (zeros where it drafted
        nothing); None for one-hot drafts (prompt lookup) or greedy drafting."""
        if device_drafts is None or device_drafts[1].probs is None:
            return None
        drafted_rows, drafts = device_drafts
        assert drafts.probs is not None
        q = torch.zeros(num_rows, self.k, self.vocab_size, device=self.device)
        where = torch.from_numpy(np.searchsorted(rows, drafted_rows)).to(self.device)
        q[where] = drafts.probs
        return q


def _generators(
    rows: SamplingRows,
    index: np.ndarray,
    counts: np.ndarray,
    stream: int,
    device: torch.device,
    width: int,
) -> list[list[torch.Generator | None]] | None:
    """Per verify row and position (`index[r, j]`: its sampled entry), the seeded generator of
    `stream`, for the positions the row samples; None when no request is seeded."""
    if all(p.seed is None for p in rows.params):
        return None
    out: list[list[torch.Generator | None]] = []
    for entries, n in zip(index.tolist(), counts.tolist(), strict=True):
        gens: list[torch.Generator | None] = []
        for j in range(width):
            seed = rows.params[entries[j]].seed
            index_j = rows.token_index[entries[j]]
            use = j < n and seed is not None
            gens.append(seeded_generator(seed, index_j, device, stream) if use else None)
        out.append(gens)
    return out


def _select(rows: SamplingRows, entries: list[int]) -> SamplingRows:
    """The sampled positions `entries` of `rows`, without penalty histories."""
    suppressed = {new: rows.suppressed[old] for new, old in enumerate(entries)
                  if old in rows.suppressed}  # fmt: skip
    return SamplingRows(
        params=[rows.params[e] for e in entries],
        token_index=[rows.token_index[e] for e in entries],
        suppressed=suppressed,
    )


class _DraftSampler:
    """The draft model's sampler: at draft position j, each drafting row draws with the
    settings of its verify position j (no penalties) from its own seeded draft stream."""

    def __init__(
        self,
        sampler: Sampler,
        sampling: SamplingRows,
        offsets: np.ndarray,
        num_drafts: np.ndarray,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.sampler = sampler
        self.sampling = sampling
        self.offsets = offsets
        self.num_drafts = num_drafts
        self.vocab_size = vocab_size
        self.device = device
        self.position = 0

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        j = self.position
        self.position += 1
        entries = [int(o) + min(j, int(n)) for o, n in zip(self.offsets, self.num_drafts,
                                                           strict=True)]  # fmt: skip
        rows = _select(self.sampling, entries)
        batch = SamplingBatch.from_rows(rows, self.vocab_size, self.device)
        generators = [
            None if p.seed is None else seeded_generator(p.seed, i, self.device, DRAFT_STREAM)
            for p, i in zip(rows.params, rows.token_index, strict=True)
        ]
        batch = dataclasses.replace(batch, generators=generators)
        return self.sampler.sample_with_distribution(logits, batch)
