"""Batched sampling: penalties, temperature, top-k/top-p/min-p, per-request seeds, logprobs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.batch import Logprob, SamplingRows
from tokenmill.kernels import argmax_rows
from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class GrammarMask:
    """The tokens each sampled position may take under its request's grammar (structured
    outputs), filled on the host once the previous step's tokens are read.

    `bitmask` [S, ceil(G / 32)] int32: position s allows token t iff bit t % 32 of word t // 32
    is set (all bits: no grammar). G, the grammars' vocabulary (the tokenizer's), may be
    smaller than the model's: the ids past the mask are forbidden on grammar positions.
    `rows`: the positions with a grammar; their mask already bans their min_tokens stop tokens
    where anything else is left, so the sampler does not. `ended`: the positions after a draft
    model's draft that ended the grammar (a stop token): they emit no token, whatever they
    sample (`BitmaskFiller.ended`; the engine drops their tokens).
    """

    bitmask: torch.Tensor
    rows: frozenset[int]
    ended: frozenset[int] = frozenset()


@dataclass(frozen=True)
class SamplingBatch:
    """The sampling settings of every row of a logits batch, as device tensors."""

    temperature: torch.Tensor | None  # [B] float; 0 = greedy (None when all rows are greedy)
    top_k: torch.Tensor | None  # [B] int; vocab size = off
    top_p: torch.Tensor | None  # [B] float
    min_p: torch.Tensor | None  # [B] float
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    generators: list[torch.Generator | None]
    penalties: Penalties | None
    suppressed: list[tuple[int, list[int]]]  # (row, token ids) banned by min_tokens
    num_logprobs: list[int | None]
    bias: _LogitBias | None = None
    allowed: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (row, ids)
    bitmask: torch.Tensor | None = None  # [S, ceil(G / 32)] int32 on the device: GrammarMask
    # The grammar positions, on the device, when the mask covers fewer ids than the logits.
    grammar_rows: torch.Tensor | None = None

    @property
    def adjusted(self) -> bool:
        """Whether any row's logits change before its argmax other than by a grammar mask:
        penalties, min_tokens' bans, a logit bias, allowed token ids."""
        return bool(self.penalties or self.suppressed or self.bias or self.allowed)

    @staticmethod
    def from_rows(
        rows: SamplingRows,
        vocab_size: int,
        device: torch.device,
        mask: GrammarMask | None = None,
    ) -> SamplingBatch:
        """The device-side settings of a plan's sampled positions (and their grammar mask)."""
        params = rows.params
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        all_greedy = all(greedy)

        def tensor(values: list) -> torch.Tensor | None:
            # Greedy batches need no per-row settings: no host→device copies for them.
            return None if all_greedy else _to_device(values, device)

        suppressed = [(i, list(ids)) for i, ids in rows.suppressed.items()]
        bitmask = grammar_rows = None
        if mask is not None:
            bitmask = mask.bitmask.to(device, non_blocking=True)
            suppressed = [(i, ids) for i, ids in suppressed if i not in mask.rows]
            if mask.bitmask.shape[-1] * 32 < vocab_size:
                grammar_rows = _to_device(sorted(mask.rows), device)
        return SamplingBatch(
            temperature=tensor(
                [0.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
            ),
            top_k=tensor(top_k),
            top_p=tensor([p.top_p for p in params]),
            min_p=tensor([p.min_p for p in params]),
            use_top_k=any(k < vocab_size for k in top_k),
            use_top_p=any(p.top_p < 1 for p in params),
            use_min_p=any(p.min_p > 0 for p in params),
            generators=[
                None if p.seed is None else _generator(p.seed, index, device)
                for p, index in zip(params, rows.token_index, strict=True)
            ],
            penalties=Penalties.from_rows(rows, vocab_size, device),
            suppressed=suppressed,
            num_logprobs=[p.logprobs for p in params],
            bias=_LogitBias.from_params(params, device),
            allowed=[
                (i, torch.frombuffer(p.allowed_token_table, dtype=torch.int64).to(device))
                for i, p in enumerate(params)
                if p.allowed_token_ids is not None
            ],
            bitmask=bitmask,
            grammar_rows=grammar_rows,
        )


def _to_device(values: list, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, without waiting for the GPU: this runs after the
    step's forward pass is queued, and `torch.tensor(values, device=...)` synchronises the
    stream after its copy (a blocking copy), so the host would wait for the forward pass."""
    return torch.tensor(values).to(device, non_blocking=True)


@dataclass(frozen=True)
class _LogitBias:
    """Every row's `logit_bias` as one sparse addition: `logits[rows[i], ids[i]] += values[i]`."""

    rows: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor

    @staticmethod
    def from_params(params: Sequence[SamplingParams], device: torch.device) -> _LogitBias | None:
        """The biased rows' maps, from each request's tables (`logit_bias_table`): no Python
        object per entry."""
        biased = [(i, p.logit_bias_table) for i, p in enumerate(params) if p.logit_bias]
        if not biased:
            return None
        counts = np.array([len(ids) for _, (ids, _) in biased], dtype=np.int64)
        rows = np.repeat(np.array([i for i, _ in biased], dtype=np.int64), counts)
        ids = np.concatenate([np.frombuffer(ids, dtype=np.int64) for _, (ids, _) in biased])
        values = np.concatenate([np.frombuffer(v, dtype=np.float32) for _, (_, v) in biased])
        return _LogitBias(
            rows=torch.from_numpy(rows).to(device, non_blocking=True),
            ids=torch.from_numpy(ids).to(device, non_blocking=True),
            values=torch.from_numpy(values).to(device, non_blocking=True),
        )

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_put_((self.rows, self.ids), self.values, accumulate=True)


@dataclass(frozen=True)
class Penalties:
    """Each sampled position's presence, frequency and repetition penalties (vLLM's), with
    the counts of the tokens they apply to."""

    presence: torch.Tensor  # [B, 1]
    frequency: torch.Tensor  # [B, 1]
    repetition: torch.Tensor  # [B, 1]
    output_counts: torch.Tensor  # [B, V] occurrences among generated tokens
    seen: torch.Tensor  # [B, V] bool: in prompt or generated

    @staticmethod
    def from_rows(rows: SamplingRows, vocab_size: int, device: torch.device) -> Penalties | None:
        if not rows.history:
            return None
        params = rows.params
        # Rows without penalties carry no token ids: their factors leave the logits unchanged.
        history = [rows.history.get(i, ((), ())) for i in range(len(params))]
        output = _token_counts([h[1] for h in history], vocab_size, device)
        prompt = _token_counts([h[0] for h in history], vocab_size, device)

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, device=device, dtype=torch.float32)[:, None]

        return Penalties(
            presence=column([p.presence_penalty for p in params]),
            frequency=column([p.frequency_penalty for p in params]),
            repetition=column([p.repetition_penalty for p in params]),
            output_counts=output,
            seen=(output + prompt) > 0,
        )

    def add_generated(self, positions: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count `token_ids[i]` as generated before sampled position `positions[i]` (the draft
        model's drafts, on the device only, before the verify positions after them)."""
        ones = torch.ones(token_ids.shape, dtype=self.output_counts.dtype, device=token_ids.device)
        self.output_counts.index_put_((positions, token_ids), ones, accumulate=True)
        self.seen[positions, token_ids] = True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        scaled = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(self.seen, scaled, logits)
        logits = logits - self.frequency * self.output_counts
        return logits - self.presence * (self.output_counts > 0).float()


_MASK = (1 << 63) - 1


def _generator(seed: int, token_index: int, device: torch.device) -> torch.Generator:
    """A seeded position's own generator, seeded from the request's seed and the index of the
    token it draws: the draw depends on neither the batch nor the step, so a seeded request
    repeats itself alone, in any batch, with or without overlap, after preemption."""
    return seeded_generator(seed, token_index, device)


def seeded_generator(
    seed: int, token_index: int, device: torch.device, stream: int = 0
) -> torch.Generator:
    """The generator of a seeded position's draws from `stream` (0: sampling; speculative
    decoding draws its drafts and acceptance tests from streams of their own, independent of
    the sampling one)."""
    key = (seed, token_index) if stream == 0 else (seed, token_index, stream)
    # Tuples of ints hash the same in every process (no hash randomisation for ints).
    return torch.Generator(device=device).manual_seed(hash(key) & _MASK)


def _token_counts(
    rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """`[B, V]` float counts of each token id per row."""
    width = max((len(r) for r in rows), default=0)
    padded = torch.full((len(rows), width + 1), vocab_size, dtype=torch.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    counts = torch.zeros(len(rows), vocab_size + 1, device=device)
    padded = padded.to(device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row, and its logprobs where the request asked for them."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


@dataclass
class SampledTokens:
    """A step's sampling results on the device, and their copy on its way to the host.

    `start_copy` queues the device→host copy right behind the sampling kernels and records an
    event; `to_host` waits for that event only, not for steps launched after this one. Greedy
    tokens need no copy: the argmax kernel writes them to pinned host memory itself.
    `host_verify`, where set, turns the tokens read into the step's (a greedy verify step
    samples every position's argmax; the host decides which of them it emits).
    """

    token_ids: torch.Tensor  # [S]
    num_logprobs: list[int | None]
    chosen_logprobs: torch.Tensor | None = None  # [S]
    ranks: torch.Tensor | None = None  # [S]
    top_logprobs: torch.Tensor | None = None  # [S, n]
    top_ids: torch.Tensor | None = None  # [S, n]
    host_token_ids: torch.Tensor | None = None  # [S] pinned, written by the sampling kernel
    host_verify: Callable[[np.ndarray], np.ndarray] | None = None  # [S] read -> [S] emitted
    _host: list[torch.Tensor | None] | None = None
    _ready: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        parts = [self.token_ids, self.chosen_logprobs, self.ranks, self.top_logprobs, self.top_ids]
        if not self.token_ids.is_cuda:  # a snapshot: `token_ids` may be a reused buffer
            self._host = [None if t is None else t.clone() for t in parts]
            return
        tokens = self.host_token_ids
        if tokens is None:
            tokens = _pinned_copy(self.token_ids)
        self._host = [tokens, *(None if t is None else _pinned_copy(t) for t in parts[1:])]
        self._ready = torch.cuda.Event()
        self._ready.record()

    def to_host(self) -> SamplerOutput:
        """Wait for this step's tokens and build the per-row logprob maps."""
        if self._host is None:
            self.start_copy()
        assert self._host is not None
        if self._ready is not None:
            self._ready.synchronize()
        tokens, chosen_t, ranks_t, top_values_t, top_ids_t = self._host
        assert tokens is not None
        token_list = tokens.tolist()
        logprobs: list[dict[int, Logprob] | None] = [None] * len(token_list)
        if chosen_t is not None:
            assert ranks_t is not None and top_values_t is not None and top_ids_t is not None
            chosen, ranks = chosen_t.tolist(), ranks_t.tolist()
            top_values, top_ids = top_values_t.tolist(), top_ids_t.tolist()
            for row, n in enumerate(self.num_logprobs):
                if n is None:
                    continue
                entry = {token_list[row]: Logprob(chosen[row], ranks[row])}
                pairs = zip(top_ids[row][:n], top_values[row][:n], strict=True)
                for rank, (token, value) in enumerate(pairs, 1):
                    entry.setdefault(token, Logprob(value, rank))
                logprobs[row] = entry
        if self.host_verify is not None:
            token_list = self.host_verify(tokens.numpy()).tolist()
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class Sampler:
    """Turns each sequence's last-position logits into its next token, with batched tensor ops."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.device = device

    def warm_up(self, vocab_size: int, dtype: torch.dtype) -> None:
        """Compile the device argmax the sampling paths launch, at start-up rather than in the
        first request's step: rows in the logits' `dtype` with the tokens also written to the
        host (greedy) and without (speculative verification), and float32 rows (penalties,
        temperatures, logprobs). Nothing off CUDA."""
        if self.device.type != "cuda":
            return
        logits = torch.zeros(2, vocab_size, dtype=dtype, device=self.device)
        argmax_rows(logits, host_out=torch.empty(2, dtype=torch.int64, pin_memory=True))
        _greedy(logits)
        _greedy(logits.float())

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, out: torch.Tensor | None = None
    ) -> SampledTokens:
        """Sample on the device (the tokens into `out` where given); nothing here waits for
        the GPU."""
        wants_logprobs = any(n is not None for n in batch.num_logprobs)
        plain = batch.temperature is None and not batch.adjusted
        if plain and not wants_logprobs:  # greedy only: argmax is exact in the logits' dtype
            if batch.bitmask is not None:
                _apply_bitmask(logits, batch)
            if not logits.is_cuda:
                return SampledTokens(_into(logits.argmax(dim=-1), out), batch.num_logprobs)
            host = torch.empty(logits.shape[0], dtype=torch.int64, pin_memory=True)
            tokens = argmax_rows(logits, host_out=host, out=out)
            return SampledTokens(tokens, batch.num_logprobs, host_token_ids=host)
        logits = logits.float()
        raw_logits = logits if wants_logprobs else None
        logits = _penalized(logits, batch)
        tokens = _greedy(logits)
        if batch.temperature is not None:
            sampled = self._race(_weights(logits, batch, batch.temperature), batch)
            tokens = torch.where(batch.temperature == 0, tokens, sampled)
        tokens = _into(tokens, out)
        if raw_logits is None:
            return SampledTokens(tokens, batch.num_logprobs)
        return self.with_logprobs(raw_logits, tokens, batch.num_logprobs)

    def distribution(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """What each row would sample from: its normalised probabilities after penalties,
        min_tokens, temperature, top-k/top-p and min-p (None when every row is greedy), and its
        greedy token (the argmax after penalties and min_tokens)."""
        plain = not batch.adjusted and batch.bitmask is None
        if batch.temperature is None and plain:
            return None, _greedy(logits)  # exact in the logits' dtype: no float copy
        logits = _penalized(logits.float(), batch)
        greedy = _greedy(logits)
        if batch.temperature is None:
            return None, greedy
        weights = _weights(logits, batch, batch.temperature)
        return weights / weights.sum(dim=-1, keepdim=True), greedy

    def sample_with_distribution(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens `[B]` as `__call__` picks them, and the distributions the sampled rows drew
        from (None when every row is greedy): a draft model's sampler, whose verification needs
        the probabilities of its drafts."""
        probs, greedy = self.distribution(logits, batch)
        if probs is None:
            return greedy, None
        assert batch.temperature is not None
        return torch.where(batch.temperature == 0, greedy, self._race(probs, batch)), probs

    @staticmethod
    def with_logprobs(
        logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]
    ) -> SampledTokens:
        """`tokens` `[S]` with their logprobs under the raw `logits` (before any processing,
        as vLLM and OpenAI report them) and each row's top `num_logprobs`."""
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = raw_logprobs.gather(1, tokens[:, None])
        top = raw_logprobs.topk(max(n or 0 for n in num_logprobs), dim=-1)
        return SampledTokens(
            token_ids=tokens,
            num_logprobs=num_logprobs,
            chosen_logprobs=chosen[:, 0],
            ranks=(raw_logprobs > chosen).sum(dim=-1) + 1,
            top_logprobs=top.values,
            top_ids=top.indices,
        )

    def _race(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token per row drawn from `probs` (unnormalised weights will do).

        Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. Each seeded request has
        its own generator, so its draws do not depend on the rest of the batch.
        """
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in enumerate(batch.generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)


def _penalized(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Float logits after allowed token ids, min_tokens' bans, logit biases, penalties (vLLM's
    order: a bias is added before a repetition penalty scales the logit) and grammar masks
    (what greedy rows take the argmax of); `logits` itself is left as it is (logprobs are
    reported from it)."""
    edited = bool(batch.allowed or batch.suppressed) or batch.bias is not None
    if edited or (batch.bitmask is not None and batch.penalties is None):
        logits = logits.clone()  # edited in place below
    for row, ids in batch.allowed:
        kept = logits[row, ids]
        logits[row] = float("-inf")
        logits[row, ids] = kept
    for row, ids in batch.suppressed:
        logits[row, ids] = float("-inf")
    if batch.bias is not None:
        batch.bias.apply(logits)
    if batch.penalties is not None:
        logits = batch.penalties.apply(logits)  # a new tensor
    if batch.bitmask is not None:
        _apply_bitmask(logits, batch)
    return logits


def _apply_bitmask(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Set the logits of tokens a row's grammar forbids to -inf, in place: one kernel, and one
    more for the ids past the mask on grammar rows when the model's vocabulary is larger."""
    import xgrammar as xgr  # here: only constrained batches need it

    assert batch.bitmask is not None
    covered = min(logits.shape[-1], batch.bitmask.shape[-1] * 32)
    xgr.apply_token_bitmask_inplace(logits, batch.bitmask, vocab_size=covered)
    if batch.grammar_rows is not None:
        logits[:, covered:].index_fill_(0, batch.grammar_rows, float("-inf"))


def _weights(logits: torch.Tensor, batch: SamplingBatch, temperature: torch.Tensor) -> torch.Tensor:
    """Sampling weights per row after temperature, top-k/top-p and min-p (sum <= 1)."""
    temperature = torch.where(temperature == 0, 1.0, temperature)
    logits = logits / temperature[:, None]
    if batch.use_top_k or batch.use_top_p:
        logits = _top_k_top_p(logits, batch)
    probs = torch.softmax(logits, dim=-1)
    if batch.use_min_p and batch.min_p is not None:
        threshold = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, 0.0, probs)
    return probs


def _into(tokens: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return tokens if out is None else out.copy_(tokens)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: one Triton launch on CUDA (torch's takes several times longer on a
    single long row), torch elsewhere."""
    return argmax_rows(logits) if logits.is_cuda else logits.argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    assert batch.top_k is not None and batch.top_p is not None
    # Stable: tied logits (common in bfloat16) keep their vocabulary order, so which of them
    # top-p cuts does not depend on the sort's batch-dependent internals.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = rank >= batch.top_k[:, None]
    if batch.use_top_p:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop |= before >= batch.top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
