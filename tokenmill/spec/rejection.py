"""Batched rejection sampling: which drafted tokens the target accepts, on the device.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft token `d` at position `j`,
drawn from the draft distribution `q_j`, is accepted with probability `min(1, p_j(d) / q_j(d))`,
`p_j` being the target's distribution there. At the first rejection the row emits a token drawn
from `norm(max(0, p_j - q_j))` and stops; when every draft is accepted it emits a bonus token
drawn from `p` at the position after the last draft. Each emitted token is then distributed
exactly as the target's, whatever `q` is. A proposer without probabilities (prompt lookup)
proposes with a one-hot `q`: acceptance is `p_j(d)`, and the residual is `p_j` without `d`.
Greedy rows accept a draft iff it equals the target's argmax, and emit the argmax after.

Shapes are fixed (`[B, k]` drafts, `[B, k + 1]` outputs, padded with `PLACEHOLDER`), rows may
draft fewer than `k` tokens (`num_drafts`), and nothing here reads a value back to the host.

Greedy steps need none of it on the device: a greedy row's whole verdict follows from the
target's argmax at each of its positions, which the host reads anyway; `accept_greedy` decides
it there, in numpy, once the step's tokens are read (one argmax kernel per step, as a decode
step, instead of a dozen verification kernels between the forward pass and the read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Output slots after a row's last emitted token.
PLACEHOLDER = -1


@dataclass(frozen=True)
class VerifiedTokens:
    """A verify step's outcome per row, on the device.

    `token_ids[b, :num_accepted[b] + 1]` are the row's new tokens (its accepted drafts, then the
    recovered or bonus token); the rest of the row is `PLACEHOLDER`.
    """

    token_ids: torch.Tensor  # [B, k + 1] int64
    num_accepted: torch.Tensor  # [B] int64, drafts accepted

    @property
    def num_emitted(self) -> torch.Tensor:
        """`[B]` tokens each row emits: its accepted drafts plus one."""
        return self.num_accepted + 1


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor,
    noise: torch.Tensor,
    greedy: torch.Tensor | None = None,
    target_argmax: torch.Tensor | None = None,
) -> VerifiedTokens:
    """Verify each row's drafts against the target's distributions.

    `target_probs` `[B, k + 1, V]`: the target's (normalised) sampling distribution at each
    position, after the request's temperature, top-k/top-p/min-p and penalties. Position `j`
    follows draft `j - 1`; the row's bonus position is `num_drafts[b]`.
    `draft_token_ids` `[B, k]` with `num_drafts` `[B]` valid per row; `draft_probs` `[B, k, V]`
    the distributions the drafts were drawn from, or None for one-hot drafts.
    The randomness is the caller's (`random_draws`): `uniform` `[B, k]` U[0, 1) decides draft
    j's acceptance, `noise` `[B, k + 1, V]` Exp(1) draws the token emitted at position j (by an
    exponential race, as the plain sampler draws), so a seeded position can use its own
    generators. `greedy` `[B]` marks rows decided by `target_argmax` `[B, k + 1]` instead (the
    argmax of the processed logits, as the plain sampler's greedy rows use).
    """
    batch, k = draft_token_ids.shape
    if target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(
            f"target_probs must be [B, k + 1, V] = [{batch}, {k + 1}, V], "
            f"got {list(target_probs.shape)}"
        )
    probs = target_probs.float()
    drafted = _drafted(num_drafts, k)
    p_draft = probs[:, :k].gather(2, draft_token_ids[:, :, None])[:, :, 0]  # [B, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = probs[:, :k].scatter(2, draft_token_ids[:, :, None], 0.0)
    else:
        q = draft_probs.float()
        q_draft = q.gather(2, draft_token_ids[:, :, None])[:, :, 0]
        residual = (probs[:, :k] - q).clamp_(min=0.0)
    # Where no draft was made the row's token comes from p itself (the bonus position).
    residual = torch.where(drafted[:, :, None], residual, probs[:, :k])
    # p == q leaves no residual mass; rejection then has probability 0, but keep the draw valid.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, probs[:, :k], residual)
    weights = torch.cat([residual, probs[:, k:]], dim=1)  # [B, k + 1, V]
    accepted = uniform * q_draft < p_draft  # P = min(1, p / q); never when p == 0
    candidates = (weights / noise).argmax(dim=-1)  # exponential race: ~ weights
    if greedy is not None:
        if target_argmax is None:
            raise ValueError("greedy rows need target_argmax")
        accepted = torch.where(greedy[:, None], draft_token_ids == target_argmax[:, :k], accepted)
        candidates = torch.where(greedy[:, None], target_argmax, candidates)
    return _emit(accepted & drafted, draft_token_ids, candidates, num_drafts)


def random_draws(
    batch: int,
    k: int,
    vocab_size: int,
    device: torch.device,
    generator: torch.Generator,
    uniform_generators: Sequence[Sequence[torch.Generator | None]] | None = None,
    noise_generators: Sequence[Sequence[torch.Generator | None]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`uniform` `[B, k]` and `noise` `[B, k + 1, V]` for `rejection_sample`, from `generator`
    except at the positions whose `[b][j]` generator is given (seeded requests)."""
    uniform = torch.empty(batch, k, device=device).uniform_(generator=generator)
    noise = torch.empty(batch, k + 1, vocab_size, device=device).exponential_(generator=generator)
    for out, gens, fill in ((uniform, uniform_generators, _uniform),
                            (noise, noise_generators, _exponential)):  # fmt: skip
        for b, row in enumerate(gens or ()):
            for j, gen in enumerate(row):
                if gen is not None:
                    fill(out[b, j], gen)
    return uniform, noise


def accept_greedy(targets: np.ndarray, drafts: np.ndarray, row_start: np.ndarray) -> np.ndarray:
    """Greedy verification on the host, over a step's sampled positions (rows in order).

    `targets` `[S]`: the target's argmax at each position; `drafts` `[S]`: the draft that
    follows the position (the query token after it), `PLACEHOLDER` at a row's last position;
    `row_start` `[S]`: the first position of the position's row. A row keeps its drafts while
    each equals the argmax before it; so a position emits its argmax iff every draft before it
    in its row was accepted, and `PLACEHOLDER` after the row's first rejection (what
    `rejection_sample` makes of greedy rows, one token per position instead of `[B, k + 1]`).
    """
    rejected = drafts != targets
    before = np.cumsum(rejected) - rejected  # rejections at earlier positions, any row
    return np.where(before == before[row_start], targets, PLACEHOLDER)


def _drafted(num_drafts: torch.Tensor, k: int) -> torch.Tensor:
    """`[B, k]` True at positions that hold a real draft."""
    return torch.arange(k, device=num_drafts.device)[None, :] < num_drafts[:, None]


def _emit(
    accepted: torch.Tensor,
    draft_token_ids: torch.Tensor,
    candidates: torch.Tensor,
    num_drafts: torch.Tensor,
) -> VerifiedTokens:
    """Keep the leading accepted drafts, then the candidate at the first position after them."""
    batch, k = draft_token_ids.shape
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # leading run of acceptances
    index = torch.arange(k + 1, device=draft_token_ids.device)[None, :]
    drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((batch, 1), PLACEHOLDER)], 1)
    out = torch.where(index < num_accepted[:, None], drafts, PLACEHOLDER)
    last = candidates.gather(1, num_accepted[:, None])
    out.scatter_(1, num_accepted[:, None], last)
    return VerifiedTokens(token_ids=out, num_accepted=num_accepted)


def _uniform(out: torch.Tensor, gen: torch.Generator) -> None:
    out.uniform_(generator=gen)


def _exponential(out: torch.Tensor, gen: torch.Generator) -> None:
    out.exponential_(generator=gen)
