"""SpecDecodeStats: cumulative drafting and acceptance counts (vLLM's spec_decode metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenmill.observability.histogram import Histogram

# Bounds of the drafts-per-request histogram.
DRAFT_COUNT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16)


@dataclass
class SpecDecodeStats:
    """What proposers drafted and the target accepted, summed over every verify step.

    A "draft" is one request's proposal in one step (at least one token); position i's
    acceptance counts drafts whose first i + 1 tokens were all accepted. `chosen_drafts`
    counts, per request and step that had drafts to offer, how many it verified (adaptive
    speculation chooses; 0: speculation off for it in that step).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    chosen_drafts: Histogram = field(default_factory=lambda: Histogram.new(DRAFT_COUNT_BUCKETS))

    def observe(self, num_drafted: np.ndarray, num_accepted: np.ndarray) -> None:
        """Count one step's verified rows: tokens drafted and accepted per row."""
        drafted = num_drafted > 0
        self.num_drafts += int(drafted.sum())
        self.num_draft_tokens += int(num_drafted.sum())
        self.num_accepted_tokens += int(num_accepted.sum())
        longest = int(num_drafted.max(initial=0))
        if len(self.accepted_per_position) < longest:
            self.accepted_per_position += [0] * (longest - len(self.accepted_per_position))
        for pos in range(longest):
            self.accepted_per_position[pos] += int((num_accepted > pos).sum())

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per drafted token (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens each draft step emits on average: accepted drafts plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
