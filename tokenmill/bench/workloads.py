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
# Bounds of a benchmark's sizes: every prompt is drawn up front as Python lists of ids (~36 bytes
# a token), so an unbounded count or length is minutes of drawing or an out-of-memory traceback
# before the first request. One length at most MAX_LENGTH tokens (past any context window), all
# the prompts together at most MAX_WORKLOAD_TOKENS (~1.2 GB of lists).
MAX_LENGTH = 1 << 20
MAX_WORKLOAD_TOKENS = 1 << 25
_DEFAULT_PREFIX = {"chatbot": 2000, "agent": 16000, "shared-prefix": 1024}


@dataclass(frozen=True)
class _TurnShape:
    """The ranges a drawn workload's turns take at length_scale 1: each turn's new prompt
    tokens and output tokens, and how many turns follow the first (none: no count drawn)."""

    prompt: tuple[int, int]
    output: tuple[int, int]
    more_turns: tuple[int, int] | None = None

    @property
    def longest(self) -> int:
        """The longest length it draws, prompt or output."""
        return max(self.prompt[1], self.output[1])

    @property
    def most_turns(self) -> int:
        """The most turns a session of it has."""
        return 1 + (self.more_turns[1] if self.more_turns else 0)


_SHAPES = {
    "chatbot": _TurnShape((50, 300), (50, 300), (1, 5)),
    "agent": _TurnShape((50, 200), (100, 500), (9, 19)),
    "data": _TurnShape((2000, 8000), (20, 100)),
}


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
        None,
        "Shared prefix tokens (shared-prefix, chatbot and agent workloads).",
        default_help="1024 for shared-prefix, 2000 for chatbot, 16000 for agent",
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
        if self.seed < 0:  # numpy's own message names nothing
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        self._check_size()

    def _check_size(self) -> None:
        """Refuse a workload past MAX_LENGTH tokens in one length or MAX_WORKLOAD_TOKENS of
        prompts in all, by its options' names (numpy's out-of-memory traceback, or minutes of
        drawing ids, before)."""
        if self.name not in WORKLOADS:  # build_workload names it
            return
        prefix = self.prefix_len if self.prefix_len is not None else _DEFAULT_PREFIX.get(self.name)
        shape = _SHAPES.get(self.name)
        turn = shape.longest if shape else self.input_len
        longest = max(prefix or 0, turn, self.output_len if self.name == "random" else 0)
        if longest * self.length_scale > MAX_LENGTH:
            raise ValueError(
                f"input_len, output_len, prefix_len x length_scale must be at most {MAX_LENGTH} "
                f"tokens, got {longest} x {self.length_scale:g} (workload {self.name})"
            )
        turns = shape.most_turns if shape else 1
        per_session = ((prefix or 0) + turn * turns) * self.length_scale
        if self.num_sessions * per_session > MAX_WORKLOAD_TOKENS:
            raise ValueError(
                f"num_sessions (--num-requests) x prompt tokens per session must be at most "
                f"{MAX_WORKLOAD_TOKENS}, got {self.num_sessions} x {per_session:.0f} "
                f"(workload {self.name})"
            )


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
        spec.prefix_len if spec.prefix_len is not None else _DEFAULT_PREFIX.get(spec.name, 0)
    )
    prefixes = [shared]
    prefixes += [rng.integers(10, spec.vocab_size, len(shared)).tolist()
                 for _ in range(spec.num_prefixes - 1)]  # fmt: skip
    builders["random"] = lambda: Session([Turn(ids(spec.input_len), scaled(spec.output_len))])
    next_prefix = iter(range(spec.num_sessions))
    builders["shared-prefix"] = lambda: Session([Turn(
        prefixes[next(next_prefix) % len(prefixes)] + ids(spec.input_len), scaled(spec.output_len)
    )])  # fmt: skip

    def drawn(shape: _TurnShape, prefix: list[int]) -> Session:
        """A session of `shape`'s turns, the first after `prefix`."""
        first = Turn(prefix + ids(count(*shape.prompt)), uniform(*shape.output))
        more = count(*shape.more_turns) if shape.more_turns else 0
        return Session(
            [first] + [Turn(ids(count(*shape.prompt)), uniform(*shape.output)) for _ in range(more)]
        )

    builders["chatbot"] = lambda: drawn(_SHAPES["chatbot"], shared)
    builders["agent"] = lambda: drawn(_SHAPES["agent"], shared)
    builders["data"] = lambda: drawn(_SHAPES["data"], [])
    return [builders[spec.name]() for _ in range(spec.num_sessions)]


def reply_placeholder(length: int, vocab_size: int, seed: int) -> list[int]:
    """Stand-in token ids for a reply of `length` tokens in a session's history."""
    return np.random.default_rng(seed).integers(10, vocab_size, length).tolist()
