"""The runner's half of speculative decoding: the draft model's drafts and its mirror pass,
and the verification of a step's sampled positions by rejection sampling.

Nothing here reads the device from the host: index arrays are built on the host from the plan
and go to the device in one non-blocking copy (`HostStaging`), and the verified tokens stay on
the device until the engine core reads the step. With CUDA graphs, greedy drafting runs as one
graph per step (`DraftLoopGraphs`), and the mirror pass replays the draft model's graphs of the
target's step (same packed inputs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.attention.backend import AttentionInputs
from tokenmill.batch import SamplingRows, StepPlan
from tokenmill.config import EngineConfig
from tokenmill.runner.sampler import (
    Penalties,
    SampledTokens,
    Sampler,
    SamplingBatch,
    seeded_generator,
)
from tokenmill.runner.staging import HostStaging
from tokenmill.spec.draft_model import DraftModelProposer
from tokenmill.spec.proposer import Drafts
from tokenmill.spec.rejection import (
    PLACEHOLDER,
    accept_greedy,
    random_draws,
    rejection_sample,
)

if TYPE_CHECKING:
    from tokenmill.runner.cuda_graphs import CudaGraphRunner, DraftLoopGraphs

# Seeded streams besides sampling's (0): a position's acceptance test, and its draft.
ACCEPT_STREAM, DRAFT_STREAM = 1, 2


def device_draft_entries(num_device_drafts: np.ndarray, k: int) -> np.ndarray:
    """Where each device draft of a plan lives in `SpecDecoder.draft_tokens`: drafting row i
    (the i-th row with drafts) keeps its draft j at `i * k + j`; rows in order."""
    num = num_device_drafts[num_device_drafts > 0]
    within = np.arange(int(num.sum())) - np.repeat(np.cumsum(num) - num, num)
    return np.repeat(np.arange(len(num)) * k, num) + within


def penalised_draft_counts(
    offsets: np.ndarray, num_drafts: np.ndarray, k: int, history: Mapping[int, object]
) -> tuple[np.ndarray, np.ndarray]:
    """(sampled position, draft entry) pairs: drafting row i (its first sampled position
    `offsets[i]`, `num_drafts[i]` drafts at entries `i * k ..` of `SpecDecoder.draft_tokens`)
    counts its drafts [:j] as generated at its position j, where that position has a penalty
    `history`."""
    pairs = [
        (offset + j, i * k + t)
        for i, (offset, n) in enumerate(zip(offsets.tolist(), num_drafts.tolist(), strict=True))
        for j in range(1, n + 1)
        if offset + j in history
        for t in range(j)
    ]
    return (
        np.array([p for p, _ in pairs], dtype=np.int64),
        np.array([e for _, e in pairs], dtype=np.int64),
    )


def drafting_row_of(plan: StepPlan) -> Callable[[int], int]:
    """The drafting row (`device_draft_entries`' i) a sampled position of a row the draft
    model drafts for belongs to."""
    assert plan.num_device_drafts is not None
    offsets = plan.sample_offsets[np.flatnonzero(plan.num_device_drafts)]
    return lambda position: int(np.searchsorted(offsets, position, side="right")) - 1


def device_draft_positions(plan: StepPlan) -> np.ndarray:
    """Query token indices the draft model fills: each drafting row's last tokens, in order."""
    assert plan.num_device_drafts is not None
    ends = np.cumsum(plan.query_lens)
    return np.concatenate(
        [np.arange(e - n, e) for e, n in zip(ends, plan.num_device_drafts, strict=True) if n]
        or [np.zeros(0, dtype=np.int64)]
    )


class SpecDecoder:
    """Drafts with a draft model (when configured), keeps its KV cache in step with the
    target's, and turns a step's logits into its tokens by verifying each row's drafts.

    With tensor parallelism only rank 0 holds the draft model (whole, not split) and drafts;
    the other ranks (`drafts=False`) receive its drafts into `draft_tokens` (a broadcast per
    step that drafts on the device, before the forward pass that reads them)."""

    def __init__(
        self,
        config: EngineConfig,
        sampler: Sampler,
        num_pages: int,
        device: torch.device,
        staging: HostStaging,
        drafts: bool = True,
    ) -> None:
        spec = config.speculative
        assert spec is not None
        self.k = spec.num_speculative_tokens
        self.vocab_size = config.model.vocab_size
        self.sampler = sampler
        self.device = device
        self.staging = staging
        self.page_size = config.cache.page_size
        # The draft model's drafts of the current step, row-major [rows, k]: the target's
        # inputs take them from here on the device (`device_draft_entries`).
        self.draft_tokens = torch.zeros(
            config.scheduler.max_num_seqs * self.k, dtype=torch.int64, device=device
        )
        self.drafter: DraftModelProposer | None = None
        self.mirror_graphs: CudaGraphRunner | None = None
        self.loop_graphs: DraftLoopGraphs | None = None
        self._target_graphs: CudaGraphRunner | None = None
        if spec.method == "draft_model" and drafts:
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
                config.runner.deterministic,
            )

    @staticmethod
    def extra_bytes_per_page(config: EngineConfig) -> int:
        """The draft cache's share of one page (0 without a draft model)."""
        spec = config.speculative
        if spec is None or spec.method != "draft_model":
            return 0
        draft = spec.draft_model_config(config.model, config.max_model_len)
        return DraftModelProposer.bytes_per_page(draft, config.cache.page_size)

    def capture_graphs(self, target: CudaGraphRunner) -> None:
        """The draft model's CUDA graphs, for the shapes of the target's: greedy drafting
        loops, and mirror passes that read the target's packed inputs."""
        if self.drafter is None:
            return
        from tokenmill.runner.cuda_graphs import CudaGraphRunner, DraftLoopGraphs

        drafter = self.drafter
        self._target_graphs = target
        self.mirror_graphs = CudaGraphRunner(
            drafter.model, drafter.attention, target.max_bs, target.page_table.shape[1],
            self.device, target.sampled, target.max_prefill, target.max_query_len,
            target.max_verify_tokens, self.draft_tokens, logits=False,
        )  # fmt: skip
        self.mirror_graphs.capture()
        self.loop_graphs = DraftLoopGraphs(
            drafter.model, drafter.attention, target.max_bs, target.page_table.shape[1],
            self.page_size, self.k, self.device, target.sampled, self.draft_tokens,
        )  # fmt: skip
        self.loop_graphs.capture()

    def draft(self, plan: StepPlan, last_tokens: torch.Tensor) -> tuple[np.ndarray, Drafts]:
        """The draft model's drafts for the rows that ask for them (`num_device_drafts`):
        their row indices, and the drafts `[R, k]` with their distributions (also written to
        `draft_tokens`). `last_tokens`: the previous launched step's sampled tokens, where a
        row's newest token may still be (`input_src`)."""
        assert self.drafter is not None and plan.num_device_drafts is not None
        rows = np.flatnonzero(plan.num_device_drafts)
        num = plan.num_device_drafts[rows]
        starts = (plan.kv_lens - plan.query_lens)[rows]
        first = (np.cumsum(plan.query_lens) - plan.query_lens)[rows]
        offsets = plan.sample_offsets[rows]
        graphs = self.loop_graphs
        greedy = all(plan.sampling.params[o].greedy for o in offsets.tolist())
        if graphs is not None and greedy and len(rows) <= graphs.max_bs:
            block = graphs.pack(plan.input_ids[first], plan.input_src[first], starts, num,
                                plan.page_table[rows])  # fmt: skip
            self.staging.upload(block, graphs.block)
            graphs.run(len(rows))
            tokens = self.draft_tokens[: len(rows) * self.k].view(len(rows), self.k)
            return rows, Drafts(token_ids=tokens, num_drafts=num)
        src = plan.input_src[first]
        unread = np.flatnonzero(src >= 0)
        newest, where, from_ = self.staging.to_device(plan.input_ids[first], unread, src[unread])
        if len(unread):  # the newest token was sampled by the previous step
            newest[where] = last_tokens[from_]
        sample = _DraftSampler(self.sampler, plan.sampling, offsets, num, self.vocab_size,
                               self.device)  # fmt: skip
        drafts = self.drafter.propose(newest, starts, num, plan.page_table[rows], sample)
        assert isinstance(drafts.token_ids, torch.Tensor)
        self.draft_tokens[: len(rows) * self.k].copy_(drafts.token_ids.reshape(-1))
        return rows, drafts

    def mirror_eager(
        self, ids: torch.Tensor, positions: torch.Tensor, inputs: AttentionInputs
    ) -> None:
        """The draft model runs over the target's (eager) batch, so its cache covers the same
        tokens."""
        assert self.drafter is not None
        self.drafter.mirror(ids, positions, inputs)

    def mirror_graph(self, path: str, batch: int, num_tokens: int,
                     key: tuple[int, int] | None) -> None:  # fmt: skip
        """The draft model over the batch the target just ran from its CUDA graph `path`
        ("decode", "verify" or "prefill"), from the same packed inputs (copied on the
        device)."""
        graphs, target = self.mirror_graphs, self._target_graphs
        assert graphs is not None and target is not None
        if path == "decode":
            graphs.decode_block.copy_(target.decode_block)
            graphs.run(batch)
        elif path == "verify":
            assert key is not None
            graphs.verify_block.copy_(target.verify_block)
            graphs.run_verify(key, num_tokens)
        else:
            graphs.prefill_block.copy_(target.prefill_block)
            graphs.run_prefill(num_tokens)

    def sample(
        self,
        logits: torch.Tensor,
        plan: StepPlan,
        batch: SamplingBatch,
        input_ids: torch.Tensor,
        device_drafts: tuple[np.ndarray, Drafts] | None,
    ) -> SampledTokens:
        """The step's tokens, one per sampled position (`logits` `[S, V]`), verifying each
        verify row's drafts: its accepted drafts, the token after them, then `PLACEHOLDER`s.

        Every sampling row is verified, rows without drafts with none (a plain draw, from the
        same seeded stream the plain sampler uses). `input_ids` `[T]`: the step's query tokens
        on the device, drafts included; `batch`: the settings (and grammar masks) of the plan's
        sampled positions.

        When every row is greedy the step samples as a decode step does (one argmax per
        position, penalties, masks and logprobs as the plain sampler has them), and the host
        verifies the drafts once it reads the tokens (`GreedyVerdict`)."""
        if device_drafts is not None and batch.penalties is not None:
            self._count_device_drafts(batch.penalties, plan, device_drafts)
        if batch.temperature is None:
            sampled = self.sampler(logits, batch)
            sampled.host_verify = self._greedy_verdict(plan)
            return sampled
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
        # The verified [R, k + 1] tokens back to one per sampled position.
        row_of_sample = np.repeat(np.arange(len(rows)), counts)
        position = np.arange(len(row_of_sample)) - np.repeat(offsets, counts)
        params = plan.sampling.params
        greedy_rows = np.array([params[o].greedy for o in offsets.tolist()], dtype=np.int64)
        index_t, draft_pos_t, num_t, row_of_sample_t, position_t, greedy_t = (
            self.staging.to_device(index, draft_pos, num_drafts, row_of_sample, position,
                                   greedy_rows)
        )  # fmt: skip
        draft_ids = input_ids[draft_pos_t]
        probs, greedy = self.sampler.distribution(logits, batch)
        assert probs is not None  # some row samples (greedy steps returned above)
        uniform, noise = random_draws(
            len(rows), k, self.vocab_size, self.device, self.sampler.generator,
            _generators(plan.sampling, index, counts, ACCEPT_STREAM, self.device, k),
            _generators(plan.sampling, index, counts, 0, self.device, width),
        )  # fmt: skip
        verified = rejection_sample(
            probs[index_t], draft_ids, num_t, self._draft_probs(len(rows), rows, device_drafts),
            uniform, noise, greedy_t.bool(), greedy[index_t],
        )  # fmt: skip
        flat = verified.token_ids[row_of_sample_t, position_t]
        if any(n is not None for n in batch.num_logprobs):
            # Logprobs of a placeholder's stand-in (0), but its placeholder kept: it is no token.
            sampled = Sampler.with_logprobs(logits, flat.clamp(min=0), batch.num_logprobs)
            sampled.token_ids = flat
            return sampled
        return SampledTokens(flat, batch.num_logprobs)

    def _count_device_drafts(
        self, penalties: Penalties, plan: StepPlan, device_drafts: tuple[np.ndarray, Drafts]
    ) -> None:
        """Penalties count a verify position's drafts before it as generated; the host's
        histories (`SamplingRows.history`) hold no draft model drafts, made at launch, so those
        are counted here, on the device, for the positions with a history."""
        rows, drafts = device_drafts
        positions, entries = penalised_draft_counts(
            plan.sample_offsets[rows], plan.num_device_drafts[rows], self.k,
            plan.sampling.history,
        )  # fmt: skip
        if len(positions):
            positions_t, entries_t = self.staging.to_device(positions, entries)
            penalties.add_generated(positions_t, drafts.token_ids.reshape(-1)[entries_t])

    def drafts_on_host(self, num_rows: int) -> Callable[[], np.ndarray]:
        """Reads the drafts `[num_rows, k]` of the step's drafting rows (the grammar masks of
        the positions past them follow them): copied to the host behind the draft model, so
        the read waits for the drafting, not for the forward pass queued after it."""
        host, copied = _host_copy(self.draft_tokens[: num_rows * self.k])

        def read() -> np.ndarray:
            if copied is not None:
                copied.synchronize()
            return host.numpy().reshape(num_rows, self.k)

        return read

    def _greedy_verdict(self, plan: StepPlan) -> GreedyVerdict:
        """How the host verifies a greedy step from its argmax tokens: each sampled position
        compares its argmax with the query token after it (a draft), except a row's last. The
        draft model's drafts are copied to the host behind the step (read with its tokens).
        Built at launch, so that reading the step only looks the verdict up."""
        counts = plan.num_samples
        row_of_sample = np.repeat(np.arange(plan.num_rows), counts)
        offsets = plan.sample_offsets[row_of_sample]
        j = np.arange(plan.num_sampled) - offsets
        # Row r samples its last counts[r] query tokens.
        query = (np.cumsum(plan.query_lens) - counts)[row_of_sample] + j
        compare = np.where(j < counts[row_of_sample] - 1, query + 1, -1)
        drafts = np.where(compare >= 0, plan.input_ids[compare], PLACEHOLDER)
        device_drafts = None
        if plan.num_device_drafts is not None:
            entries = device_draft_entries(plan.num_device_drafts, self.k)
            host, _ = _host_copy(self.draft_tokens[: int(entries.max(initial=-1)) + 1])
            # The sampled positions compared with a device draft, and that draft's entry.
            entry_of_query = np.full(plan.num_tokens, -1, dtype=np.int64)
            entry_of_query[device_draft_positions(plan)] = entries
            entry = np.where(compare >= 0, entry_of_query[compare], -1)
            at = np.flatnonzero(entry >= 0)
            device_drafts = (host, at, entry[at])
        return GreedyVerdict(drafts, offsets, device_drafts)

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
        (where,) = self.staging.to_device(np.searchsorted(rows, drafted_rows))
        q[where] = drafts.probs
        return q


@dataclass(frozen=True)
class GreedyVerdict:
    """A greedy verify step's tokens from its argmax tokens, on the host (`accept_greedy`).

    `drafts` `[S]`: the query token each sampled position's argmax is compared with (the draft
    after it, as the plan has it: a dummy where the draft model drafts at launch;
    `PLACEHOLDER` at a row's last position); `row_start` `[S]`: the first position of its row;
    `device_drafts`: the draft model's drafts (a host copy of `SpecDecoder.draft_tokens`,
    complete once the step's tokens are), the positions of `drafts` they are, and their
    entries in the copy.
    """

    drafts: np.ndarray
    row_start: np.ndarray
    device_drafts: tuple[torch.Tensor, np.ndarray, np.ndarray] | None = None

    def __call__(self, targets: np.ndarray) -> np.ndarray:
        drafts = self.drafts
        if self.device_drafts is not None:
            host, at, entries = self.device_drafts
            drafts = drafts.copy()
            drafts[at] = host.numpy()[entries]
        return accept_greedy(targets, drafts, self.row_start)


def _host_copy(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`tensor` copied to the host behind the work queued so far (pinned, non-blocking on
    CUDA), and the event that marks the copy done (None on the CPU: done)."""
    if not tensor.is_cuda:
        return tensor.clone(), None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


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
