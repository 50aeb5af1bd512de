"""Workload profiles of the serving benchmark: `--length-scale` scales every length once."""

from __future__ import annotations

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
