"""The proposer interface and the method name → proposer registry (lazily imported)."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# method -> (module, class). An EAGLE-style head registers here too.
PROPOSERS: dict[str, tuple[str, str]] = {
    "ngram": ("tokenmill.spec.ngram", "NgramProposer"),
    "draft_model": ("tokenmill.spec.draft_model", "DraftModelProposer"),
}


@dataclass(frozen=True)
class Drafts:
    """Up to k proposed tokens per row, padded to `[B, k]`.

    `token_ids[b, :num_drafts[b]]` are row b's drafts. `probs` `[B, k, V]` holds the
    distributions they were drawn from, or None when the proposer has none (its drafts count as
    certain: one-hot). Host proposers return numpy arrays, device proposers tensors.
    """

    token_ids: np.ndarray | torch.Tensor  # [B, k] int64
    num_drafts: np.ndarray | torch.Tensor  # [B] int64
    probs: torch.Tensor | None = None  # [B, k, V]


class HostProposer(ABC):
    """A proposer that drafts from the token ids alone, on the host (prompt lookup).

    It runs after a step's tokens reach the host, so the scheduler knows each row's drafts (and
    how many query tokens its verify needs) when it builds the next step.
    """

    @abstractmethod
    def propose(self, token_ids: Sequence[np.ndarray], max_drafts: np.ndarray) -> Drafts:
        """Drafts for each row from its tokens so far (prompt + output), at most
        `max_drafts[b]` for row b."""


def proposer_class(method: str) -> type:
    """The proposer registered for `method`, imported on first use."""
    if method not in PROPOSERS:
        raise ValueError(
            f"speculative method must be one of {', '.join(PROPOSERS)}, got {method!r}"
        )
    module, name = PROPOSERS[method]
    return getattr(importlib.import_module(module), name)
