"""Prompt-lookup drafting: continue the request's text from where its last n tokens appeared."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenmill.spec.proposer import Drafts, HostProposer


def longest_ngram_continuation(
    tokens: np.ndarray, min_n: int, max_n: int, max_tokens: int
) -> np.ndarray:
    """The tokens that followed the most recent earlier occurrence of the longest suffix of
    `tokens` that is between `min_n` (>= 1) and `max_n` tokens long; empty if none occurs.

    Only earlier positions holding the last token can end an occurrence, so those are the
    candidates (a few in a long context, not every position: this runs for every row every
    step); one vectorised pass per further suffix token: `run[c]` counts how many tokens
    ending at candidate `c` equal the suffix's last tokens, read backwards. At most
    `max_tokens` tokens are returned (fewer when the occurrence ends near the end of `tokens`).
    """
    length = len(tokens)
    if length < 2 or max_tokens < 1:
        return tokens[:0]
    # An occurrence must end before the suffix's own last token.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if len(ends) == 0:
        return tokens[:0]
    run = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, min(max_n, length - 1)):
        alive &= (ends >= j) & (tokens[np.maximum(ends - j, 0)] == tokens[length - 1 - j])
        run += alive
        if not alive.any():
            break
    best = int(run.max())
    if best < min_n:
        return tokens[:0]
    end = int(ends[np.flatnonzero(run == best)[-1]])  # the most recent occurrence
    return tokens[end + 1 : end + 1 + max_tokens]


class NgramProposer(HostProposer):
    """Prompt lookup (as vLLM's `ngram` method): drafts copied from the prompt or the output."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[np.ndarray], max_drafts: np.ndarray) -> Drafts:
        drafts = np.zeros((len(token_ids), self.k), dtype=np.int64)
        counts = np.zeros(len(token_ids), dtype=np.int64)
        for row, tokens in enumerate(token_ids):
            limit = min(self.k, int(max_drafts[row]))
            found = longest_ngram_continuation(np.asarray(tokens), self.min_n, self.max_n, limit)
            drafts[row, : len(found)] = found
            counts[row] = len(found)
        return Drafts(token_ids=drafts, num_drafts=counts)
