"""Workload profiles of the serving benchmark: `--length-scale` scales every length once."""

from __future__ import annotations

import pytest

from tokenmill.bench.workloads import WorkloadSpec, build_workload


def test_length_scale_shrinks_data_documents_and_outputs_once() -> None:
    turns = [s.turns[0] for s in build_workload(
        WorkloadSpec("data", num_sessions=64, length_scale=0.1)
    )]  # fmt: skip
    prompts = [len(t.new_tokens) for t in turns]
    outputs = [t.max_tokens for t in turns]
    # 2,000-8,000 tokens and 20-100 outputs at scale 1.
    assert min(prompts) >= 200 and max(prompts) <= 800 and max(prompts) - min(prompts) > 300
    assert min(outputs) >= 2 and max(outputs) <= 10


def test_length_scale_shrinks_chat_turns_once() -> None:
    for session in build_workload(WorkloadSpec("chatbot", num_sessions=16, length_scale=0.1)):
        first, *later = session.turns
        # A 2,000-token system prompt, then 50-300 new tokens per turn and 50-300 outputs.
        assert 200 + 5 <= len(first.new_tokens) <= 200 + 30
        assert all(5 <= len(t.new_tokens) <= 30 for t in later)
        assert all(5 <= t.max_tokens <= 30 for t in session.turns)


def _prompt_tokens(spec: WorkloadSpec) -> int:
    return sum(len(t.new_tokens) for s in build_workload(spec) for t in s.turns)


def test_the_size_bound_holds_what_each_workload_draws() -> None:
    """The size check's estimate of a session's prompt tokens (the bound of
    `--num-requests`) is at least what `build_workload` draws for it."""
    for name in ("random", "shared-prefix", "chatbot", "agent", "data"):
        spec = WorkloadSpec(name, num_sessions=8, length_scale=0.05)
        assert _prompt_tokens(spec) <= 8 * _session_bound(spec)


def _session_bound(spec: WorkloadSpec) -> float:
    """The per-session tokens `_check_size` assumes, read back from its refusal."""
    try:
        WorkloadSpec(spec.name, num_sessions=10**9, length_scale=spec.length_scale)
    except ValueError as exc:
        return float(str(exc).split(" x ")[-1].split()[0])
    raise AssertionError("a billion sessions were admitted")


def test_a_bad_seed_or_an_unbounded_size_names_the_option() -> None:
    """numpy's "expected non-negative integer", or its out-of-memory traceback, before."""
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        WorkloadSpec("random", seed=-1)
    with pytest.raises(ValueError, match="x length_scale must be at most 1048576 tokens"):
        WorkloadSpec("data", length_scale=1e6)
    with pytest.raises(ValueError, match="num_sessions \\(--num-requests\\) x prompt tokens"):
        WorkloadSpec("agent", num_sessions=10_000)
