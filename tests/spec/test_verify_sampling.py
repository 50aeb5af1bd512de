"""The verify's target distributions are the plain sampler's: `Sampler.distribution` is what
`Sampler.__call__` draws from, and leaves the logits (logprobs' source) alone."""

from __future__ import annotations

import torch

from tokenmill.batch import SamplingRows
from tokenmill.runner.sampler import Sampler, SamplingBatch
from tokenmill.sampling_params import SamplingParams

VOCAB = 40


def test_distribution_is_what_the_sampler_draws_from() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05),
    ]
    rows = SamplingRows(params=params, token_index=[0, 0, 0], suppressed={2: (2,)})
    batch = SamplingBatch.from_rows(rows, VOCAB, torch.device("cpu"))
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(torch.device("cpu"), seed=0)
    probs, greedy = sampler.distribution(logits, batch)
    assert probs is not None
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert (probs[1] > 0).sum() == 5 and probs[2, 2] == 0
    draws = torch.stack([sampler(logits, batch).token_ids for _ in range(1000)])
    assert draws[:, 0].eq(greedy[0]).all()
    for row in (1, 2):
        freq = torch.bincount(draws[:, row], minlength=VOCAB) / len(draws)
        assert (freq[probs[row] == 0] == 0).all()
        assert 0.5 * (freq - probs[row]).abs().sum() < 0.1


def test_distribution_leaves_the_logits_alone() -> None:
    params = [SamplingParams(temperature=1.0, min_tokens=2)]
    rows = SamplingRows(params=params, token_index=[0], suppressed={0: (2,)})
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    batch = SamplingBatch.from_rows(rows, VOCAB, torch.device("cpu"))
    Sampler(torch.device("cpu"), 0).distribution(logits, batch)
    assert torch.equal(logits, before)
