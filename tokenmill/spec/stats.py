"""SpecDecodeStats: cumulative drafting and acceptance counts (vLLM's spec_decode metrics)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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

    def observe(self, num_drafted: Sequence[int], num_accepted: Sequence[int]) -> None:
        """Count one step's verified rows: tokens drafted and accepted per row (plain Python:
        a few rows a step, on the path between two synchronous steps, where numpy's per-call
        cost is most of the work)."""
        drafted, accepted = [int(n) for n in num_drafted], [int(n) for n in num_accepted]
        self.num_drafts += sum(n > 0 for n in drafted)
        self.num_draft_tokens += sum(drafted)
        self.num_accepted_tokens += sum(accepted)
        per_position = self.accepted_per_position
        longest = max(drafted, default=0)
        if len(per_position) < longest:
            per_position += [0] * (longest - len(per_position))
        for n in accepted:
            for pos in range(n):
                per_position[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per drafted token (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens each draft step emits on average: accepted drafts plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
