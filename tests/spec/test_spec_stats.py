"""Spec-decode counters: drafts, drafted and accepted tokens, acceptance per position."""

from __future__ import annotations

import numpy as np

from tokenmill.spec.stats import SpecDecodeStats


def test_counts_accumulate_over_steps() -> None:
    stats = SpecDecodeStats()
    stats.observe(np.array([3, 0, 2]), np.array([1, 0, 2]))
    stats.observe(np.array([4]), np.array([4]))
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 7)
    assert stats.accepted_per_position == [3, 2, 1, 1]
    assert stats.acceptance_rate == 7 / 9
    assert stats.mean_acceptance_length == 1 + 7 / 3


def test_no_drafts_yet() -> None:
    stats = SpecDecodeStats()
    stats.observe(np.array([0, 0]), np.array([0, 0]))
    assert stats.num_drafts == 0 and stats.acceptance_rate == 0.0
    assert stats.mean_acceptance_length == 1.0
