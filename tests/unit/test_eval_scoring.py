"""The evals' arithmetic: per-position conformance measures and the task scorers."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.evals.conformance import compare_position


def test_identical_distributions_agree_with_zero_kl_and_error() -> None:
    ref = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, -1.0]), dim=0)
    top = {0: float(ref[0]), 1: float(ref[1])}
    agree, kl, error = compare_position(ref, 0, float(ref[0]), top)
    assert agree and kl == pytest.approx(0, abs=1e-12) and error == pytest.approx(0, abs=1e-7)


def test_kl_over_the_listed_tokens_and_the_rest_of_the_vocabulary() -> None:
    ref = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    # The server lists tokens 1 and 0 with other probabilities; the rest bucket holds 0.2 vs 0.1.
    server = {1: math.log(0.6), 0: math.log(0.3)}
    agree, kl, error = compare_position(ref, 1, math.log(0.6), server)
    expected = 0.5 * math.log(0.5 / 0.3) + 0.3 * math.log(0.3 / 0.6) + 0.2 * math.log(0.2 / 0.1)
    assert not agree  # the reference's top token is 0, the server sampled 1
    assert kl == pytest.approx(expected, rel=1e-6)
    assert error == pytest.approx(abs(math.log(0.3) - math.log(0.6)), rel=1e-6)
