"""Prompt logprobs: how likely each prompt token was given the tokens before it, scored from a
prefill step's hidden states (`SamplingParams.prompt_logprobs`).

A chunk of 8,192 tokens over a 152k vocabulary would be 5 GB of float32 logprobs at once, so the
scored positions go through the LM head and the log-softmax in slices of at most
`SLICE_BYTES` of float32 logprobs each (the log-softmax briefly holds about twice that).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.batch import Logprob, PromptLogprobRows
from tokenmill.runner.sampler import SampledTokens, Sampler

SLICE_BYTES = 128 << 20


def slice_rows(vocab_size: int) -> int:
    """Positions per slice: as many as `SLICE_BYTES` of float32 logprobs hold, at least one."""
    return max(1, SLICE_BYTES // (4 * vocab_size))


def score_prompt(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    rows: PromptLogprobRows,
    vocab_size: int,
) -> list[SampledTokens]:
    """Queue the scores of `rows`' positions from the step's `hidden` states `[T, hidden]`: per
    slice, each position's logprob of its target (the prompt token after it), its rank and
    the top alternatives. Nothing here waits for the device.

    With tensor parallelism every rank calls this alike: `compute_logits` gathers the
    vocabulary shards, a collective.
    """
    device = hidden.device
    index = torch.from_numpy(rows.token_index).to(device, non_blocking=True)
    targets = torch.from_numpy(rows.target_ids).to(device, non_blocking=True)
    selected = hidden[index]
    step = slice_rows(vocab_size)
    parts = []
    for start in range(0, len(rows.num_top), step):
        logits = compute_logits(selected[start : start + step])
        tokens = targets[start : start + step]
        parts.append(Sampler.with_logprobs(logits, tokens, rows.num_top[start : start + step]))
    return parts


def read_scores(parts: list[SampledTokens]) -> list[dict[int, Logprob]]:
    """Wait for the scores `score_prompt` queued; one map per position, in order: the target
    first (its logprob and rank), then the top alternatives."""
    entries: list[dict[int, Logprob]] = []
    for part in parts:
        entries += [entry for entry in part.to_host().logprobs if entry is not None]
    return entries
