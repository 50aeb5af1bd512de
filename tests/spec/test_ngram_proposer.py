"""Prompt lookup: the longest recent n-gram match proposes what followed it."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tokenmill.batch import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.ngram import NgramProposer, longest_ngram_continuation


def _lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return longest_ngram_continuation(np.array(tokens), min_n, max_n, k).tolist()


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Plain loops: longest n first, then the most recent earlier occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_copies_the_continuation_of_a_quoted_span() -> None:
    doc = [10, 11, 12, 13, 14, 15, 16]
    tokens = [1, 2, *doc, 3, 4, 10, 11, 12]
    assert _lookup(tokens, 2, 4, 3) == [13, 14, 15]


def test_prefers_the_longest_match_over_a_more_recent_shorter_one() -> None:
    tokens = [7, 8, 9, 50, 51, 0, 8, 9, 60, 61, 7, 8, 9]
    assert _lookup(tokens, 1, 3, 2) == [50, 51]  # "7 8 9" beats the later "8 9"
    assert _lookup(tokens, 1, 2, 2) == [60, 61]  # at most 2: the most recent "8 9"


def test_no_match_or_too_short_a_match_proposes_nothing() -> None:
    assert _lookup([1, 2, 3, 4], 1, 3, 3) == []
    assert _lookup([5, 1, 2, 9, 1, 2], 3, 3, 3) == []  # "1 2" matches, 3-grams do not
    assert _lookup([5], 1, 3, 3) == []


def test_a_match_near_the_end_proposes_only_the_tokens_after_it() -> None:
    assert _lookup([4, 4, 4, 4], 1, 2, 5) == [4]  # "4 4" last seen ending one before the end


@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),
    st.integers(1, 4),
    st.integers(0, 3),
    st.integers(1, 6),
)
def test_matches_a_loop_reference(tokens: list[int], min_n: int, extra: int, k: int) -> None:
    assert _lookup(tokens, min_n, min_n + extra, k) == _reference(tokens, min_n, min_n + extra, k)


def test_proposer_pads_rows_and_respects_each_rows_limit() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=2)
    rows = [np.array([1, 2, 3, 1, 2]), np.array([9, 8]), np.array([5, 6, 7, 8, 5, 6])]
    drafts = proposer.propose(rows, np.array([3, 3, 1]))
    assert drafts.num_drafts.tolist() == [3, 0, 1]
    assert drafts.token_ids.tolist() == [[3, 1, 2], [0, 0, 0], [7, 0, 0]]
    assert drafts.probs is None


def test_a_requests_token_array_follows_its_tokens_as_they_come() -> None:
    """Prompt lookup reads `Request.token_array` every step: it must always be prompt + output
    so far, whatever number of tokens arrived since the last call (a verify appends several)."""
    req = Request("r", [3, 1, 4], SamplingParams(max_tokens=100), (), 1000)
    assert req.token_array().tolist() == [3, 1, 4]
    expected = [3, 1, 4]
    for step, new in enumerate([[1], [5, 9, 2], [], list(range(20, 60))]):
        for token in new:
            req.append_token(token, None)
        expected += new
        assert req.token_array().tolist() == expected, step
