"""Serving workloads (BENCHMARKS.md B3): what each simulated user sends, as token-id prompts.

A workload is a list of sessions; a session is a sequence of turns sent one after another
(the next turn starts when the previous response ends). Single-request workloads have one turn
per session. Prompts are token ids with exact lengths, so the same workload runs unchanged
against any OpenAI-compatible server that accepts token-id prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tokenmill.config import option

WORKLOADS = ("random", "shared-prefix", "chatbot", "agent", "data")


@dataclass(frozen=True)
class Turn:
    """One request: new prompt tokens appended to the session's history, and its output length.

    `new_tokens` extend the history (which starts empty); the request's prompt is the whole
    history. The reply's tokens join the history as `reply_placeholder` ids of the reply's
    length, since token ids of the server's reply are not returned by the API.
    """

    new_tokens: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Session:
    turns: list[Turn]


@dataclass(frozen=True)
class WorkloadSpec:
    """Sizes of a workload; defaults follow BENCHMARKS.md B3 (scale them down on a CPU)."""

    name: str
    num_sessions: int = 16
    vocab_size: int = 32000
    seed: int = option(0, "Seed of lengths, ids, arrivals.")
    input_len: int = option(512, "random: prompt tokens.")
    output_len: int = option(128, "random: output tokens.")
    prefix_len: int | None = option(
        None, "Shared prefix tokens (shared-prefix, chatbot and agent workloads)."
    )
    length_scale: float = option(1.0, "Scale every length (e.g. 0.25 for a small CPU model).")
    num_prefixes: int = option(
        1, "shared-prefix: distinct shared prefixes; session i starts with prefix i mod this."
    )

    def __post_init__(self) -> None:
        if self.num_prefixes < 1:
            raise ValueError(f"num_prefixes must be >= 1, got {self.num_prefixes}")
        if self.num_sessions < 1:
            raise ValueError(f"num_sessions (--num-requests) must be >= 1, got {self.num_sessions}")
        if self.vocab_size <= 10:  # ids are drawn from [10, vocab_size)
            raise ValueError(f"vocab_size must be > 10, got {self.vocab_size}")
        for name in ("input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_len is not None and self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")
        if not 0 < self.length_scale < float("inf"):
            raise ValueError(f"length_scale must be > 0, got {self.length_scale}")


def build_workload(spec: WorkloadSpec) -> list[Session]:
    """The sessions of `spec`, reproducible from its seed."""
    if spec.name not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {spec.name!r}")
    rng = np.random.default_rng(spec.seed)

    def scaled(n: float) -> int:
        return max(1, round(n * spec.length_scale))

    def ids(n: int) -> list[int]:  # n tokens at length_scale 1
        return rng.integers(10, spec.vocab_size, scaled(n)).tolist()

    def count(lo: int, hi: int) -> int:
        return int(rng.integers(lo, hi + 1))

    def uniform(lo: int, hi: int) -> int:  # an output length, scaled
        return scaled(count(lo, hi))

    builders: dict[str, Callable[[], Session]] = {}
    shared = ids(
        spec.prefix_len
        if spec.prefix_len is not None
        else {"chatbot": 2000, "agent": 16000, "shared-prefix": 1024}.get(spec.name, 0)
    )
    prefixes = [shared]
    prefixes += [rng.integers(10, spec.vocab_size, len(shared)).tolist()
                 for _ in range(spec.num_prefixes - 1)]  # fmt: skip
    builders["random"] = lambda: Session([Turn(ids(spec.input_len), scaled(spec.output_len))])
    next_prefix = iter(range(spec.num_sessions))
    builders["shared-prefix"] = lambda: Session([Turn(
        prefixes[next(next_prefix) % len(prefixes)] + ids(spec.input_len), scaled(spec.output_len)
    )])  # fmt: skip
    builders["chatbot"] = lambda: Session(
        [Turn(shared + ids(count(50, 300)), uniform(50, 300))]
        + [Turn(ids(count(50, 300)), uniform(50, 300)) for _ in range(count(1, 5))]
    )
    builders["agent"] = lambda: Session(
        [Turn(shared + ids(count(50, 200)), uniform(100, 500))]
        + [Turn(ids(count(50, 200)), uniform(100, 500)) for _ in range(count(9, 19))]
    )
    builders["data"] = lambda: Session([Turn(ids(count(2000, 8000)), uniform(20, 100))])
    return [builders[spec.name]() for _ in range(spec.num_sessions)]


def reply_placeholder(length: int, vocab_size: int, seed: int) -> list[int]:
    """Stand-in token ids for a reply of `length` tokens in a session's history."""
    return np.random.default_rng(seed).integers(10, vocab_size, length).tolist()
