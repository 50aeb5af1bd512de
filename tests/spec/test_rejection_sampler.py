"""Rejection sampling keeps the target's distribution exactly: chi-square tests on synthetic
target/draft distributions with many draws, plus the exact greedy and bonus-token cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tokenmill.spec.rejection import (
    PLACEHOLDER,
    accept_greedy,
    random_draws,
    rejection_sample,
)

VOCAB = 6
K = 3
ROWS = 40_000
# A test fails by chance once in 10^4 runs at most (several tests, each a few p-values).
ALPHA = 1e-4


def _random_dists(seed: int, shape: tuple[int, ...], sparse: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(*shape, VOCAB, generator=gen) ** 2
    if sparse:  # some tokens impossible, as after top-k / top-p / min-p
        weights[..., 0] = 0.0
    return weights / weights.sum(-1, keepdim=True)


def _draw(dists: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """`[rows, K]` tokens, column j drawn from `dists[j]`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(d, rows, True, generator=gen) for d in dists], dim=1)


def _assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit of the observed `tokens` to `probs` (over its support)."""
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"tokens outside the support: {counts}"
    expected = probs[support].double()
    expected = expected / expected.sum() * len(tokens)
    result = chisquare(counts[support].numpy(), expected.numpy())
    assert result.pvalue > ALPHA, (counts.tolist(), expected.tolist(), result)


def _randoms(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return random_draws(rows, K, VOCAB, torch.device("cpu"), gen)


def _verify(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, seed: int):
    rows = drafts.shape[0]
    target = p.expand(rows, *p.shape)
    draft_probs = None if q is None else q.expand(rows, *q.shape)
    num_drafts = torch.full((rows,), K)
    return rejection_sample(target, drafts, num_drafts, draft_probs, *_randoms(rows, seed))


@pytest.mark.parametrize("sparse", [False, True])
def test_emitted_tokens_follow_the_target_with_a_draft_distribution(sparse: bool) -> None:
    p = _random_dists(1, (K + 1,), sparse)  # target at positions 0..K (K: bonus)
    q = _random_dists(2, (K,))
    out = _verify(p, _draw(q, ROWS, 3), q, seed=4)
    accepted = out.num_accepted
    # Position j's token is emitted when drafts 0..j-1 were accepted; it follows p_j.
    for j in range(K + 1):
        reached = accepted >= j
        _assert_follows(out.token_ids[reached, j], p[j])
    # Draft 0 is accepted with probability sum_x min(p_0(x), q_0(x)).
    rate = torch.minimum(p[0], q[0]).sum().item()
    observed = (accepted >= 1).double().mean().item()
    assert abs(observed - rate) < 5 * (rate * (1 - rate) / ROWS) ** 0.5


@pytest.mark.parametrize("draft_token", [0, 3])
def test_one_hot_drafts_keep_the_target_distribution(draft_token: int) -> None:
    """A proposer without probabilities (prompt lookup): whatever it proposes, the emitted token
    follows p; a draft is accepted with probability p(draft)."""
    p = _random_dists(5, (K + 1,), sparse=draft_token == 0)  # draft 0 then has p = 0
    drafts = torch.full((ROWS, K), draft_token)
    out = _verify(p, drafts, None, seed=6)
    for j in range(K + 1):
        reached = out.num_accepted >= j
        if reached.sum() > 1000:
            _assert_follows(out.token_ids[reached, j], p[j])
    rate = p[0, draft_token].item()
    observed = (out.num_accepted >= 1).double().mean().item()
    assert abs(observed - rate) < 5 * (max(rate * (1 - rate), 1e-9) / ROWS) ** 0.5 + 1e-12


def test_rejected_position_draws_from_the_residual() -> None:
    """Given a rejection at position 0, the token follows norm(max(0, p - q))."""
    p = _random_dists(7, (K + 1,))
    q = _random_dists(8, (K,))
    out = _verify(p, _draw(q, ROWS, 9), q, seed=10)
    rejected = out.num_accepted == 0
    residual = (p[0] - q[0]).clamp(min=0)
    _assert_follows(out.token_ids[rejected, 0], residual / residual.sum())


def test_rows_with_fewer_drafts_take_the_bonus_at_their_last_draft() -> None:
    p = _random_dists(11, (K + 1,))
    q = _random_dists(12, (K,))
    num_drafts = torch.tensor([0, 1, 2, 3]).repeat(ROWS // 4)
    drafts = _draw(q, len(num_drafts), 13)
    out = rejection_sample(
        p.expand(len(drafts), *p.shape), drafts, num_drafts, q.expand(len(drafts), *q.shape),
        *_randoms(len(drafts), 14),
    )  # fmt: skip
    assert (out.num_accepted <= num_drafts).all()
    for n in range(K + 1):
        rows = (num_drafts == n) & (out.num_accepted == n)  # every draft accepted: bonus at n
        _assert_follows(out.token_ids[rows, n], p[n])
        assert (out.token_ids[num_drafts == n, n + 1 :] == PLACEHOLDER).all()
    # No draft at all: the row is plain sampling from p_0.
    _assert_follows(out.token_ids[num_drafts == 0, 0], p[0])


def _accept_greedy_rows(
    argmax: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
) -> torch.Tensor:
    """`accept_greedy` over rows laid out as a step samples them (row b: `num_drafts[b] + 1`
    positions, one after another), padded back to `[B, k + 1]`."""
    targets, following, row_start = [], [], []
    for row, n in enumerate(num_drafts.tolist()):
        row_start += [len(targets)] * (n + 1)
        targets += argmax[row, : n + 1].tolist()
        following += [*drafts[row, :n].tolist(), PLACEHOLDER]
    flat = accept_greedy(np.array(targets), np.array(following), np.array(row_start)).tolist()
    out = torch.full(argmax.shape, PLACEHOLDER)
    for row, n in enumerate(num_drafts.tolist()):
        out[row, : n + 1] = torch.tensor(flat[: n + 1])
        flat = flat[n + 1 :]
    return out


def test_greedy_accepts_exact_matches_then_emits_the_argmax() -> None:
    argmax = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3], [5, 1, 2, 3], [4, 4, 4, 4], [2, 0, 1, 1]])
    drafts = torch.tensor([[5, 1, 2], [5, 0, 2], [0, 1, 2], [4, 4, 4], [2, 0, 1]])
    num_drafts = torch.tensor([3, 3, 3, 2, 0])
    assert _accept_greedy_rows(argmax, drafts, num_drafts).tolist() == [
        [5, 1, 2, 3],  # all accepted: bonus = argmax after the last draft
        [5, 1, -1, -1],  # mismatch at 1: the argmax there replaces the draft
        [5, -1, -1, -1],
        [4, 4, 4, -1],  # two drafts: bonus at position 2
        [2, -1, -1, -1],  # no drafts: a plain decode row
    ]


def test_greedy_rows_in_a_sampled_batch_are_exact() -> None:
    """`rejection_sample`'s greedy rows (of a batch with sampled rows) decide as the host's
    greedy verification does."""
    p = _random_dists(15, (K + 1,)).expand(8, K + 1, VOCAB).contiguous()
    argmax = p.argmax(-1)
    drafts = argmax[:, :K].clone()
    drafts[4:, 1] = (drafts[4:, 1] + 1) % VOCAB  # rows 4..7: second draft wrong
    greedy = torch.ones(8, dtype=torch.bool)
    num_drafts = torch.full((8,), K)
    out = rejection_sample(
        p, drafts, num_drafts, None, *_randoms(8, 0), greedy=greedy, target_argmax=argmax,
    )  # fmt: skip
    assert torch.equal(out.token_ids, _accept_greedy_rows(argmax, drafts, num_drafts))
    assert out.num_accepted.tolist() == [K] * 4 + [1] * 4


def test_a_seeded_row_draws_the_same_tokens_in_any_batch() -> None:
    p = _random_dists(16, (K + 1,))
    q = _random_dists(17, (K,))
    drafts = _draw(q, 64, 18)

    def run(rows: int, at: int) -> torch.Tensor:
        batch = drafts[:rows].clone()
        batch[at] = drafts[0]
        uniform_gens = [[None] * K for _ in range(rows)]
        noise_gens = [[None] * (K + 1) for _ in range(rows)]
        uniform_gens[at] = [torch.Generator().manual_seed(100 + j) for j in range(K)]
        noise_gens[at] = [torch.Generator().manual_seed(200 + j) for j in range(K + 1)]
        uniform, noise = random_draws(rows, K, VOCAB, torch.device("cpu"),
                                      torch.Generator().manual_seed(rows), uniform_gens,
                                      noise_gens)  # fmt: skip
        out = rejection_sample(
            p.expand(rows, *p.shape), batch, torch.full((rows,), K), q.expand(rows, *q.shape),
            uniform, noise,
        )  # fmt: skip
        return out.token_ids[at]

    alone = run(1, 0)
    assert torch.equal(run(64, 37), alone)
    assert torch.equal(run(9, 8), alone)


def test_identical_draft_and_target_accept_everything() -> None:
    p = _random_dists(19, (K + 1,))
    out = _verify(p, _draw(p[:K], 2000, 20), p[:K], seed=21)
    assert (out.num_accepted == K).all()
    _assert_follows(out.token_ids[:, K], p[K])
    assert np.isin(out.token_ids.numpy(), np.arange(VOCAB)).all()
