"""Priority scheduling under memory pressure (hypothesis): requests of random priorities, cache
salts and arrival steps, in a cache so small that they preempt one another during overlapped
steps, each generate the greedy tokens they generate alone, and every page is accounted for."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.engine.test_prefix_cache import assert_pages_partitioned
from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def tight(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), device="cpu", page_size=4, num_pages=16, max_model_len=64,
               scheduling_policy="priority", max_num_batched_tokens=16)  # fmt: skip


@pytest.fixture(scope="module")
def roomy(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), device="cpu", max_model_len=96)


_request = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(10, 60), min_size=1, max_size=24),
    "priority": st.integers(-3, 3),
    "cache_salt": st.sampled_from([None, "a", "b"]),
    "max_tokens": st.integers(1, 30),
    "arrival": st.integers(0, 6),
})  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=st.lists(_request, min_size=2, max_size=6))
def test_preempted_priority_requests_generate_what_they_do_alone(
    tight: LLM, roomy: LLM, requests: list[dict]
) -> None:
    engine = tight.engine
    preemptions = engine.scheduler.stats.num_preemptions
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True,
                       priority=r["priority"], cache_salt=r["cache_salt"])
        for r in requests
    ]  # fmt: skip
    step = 0
    while step <= 6 or engine.has_unfinished():
        for i, r in enumerate(requests):
            if r["arrival"] == step:
                engine.add_request(str(i), r["prompt"], params[i])
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        assert_pages_partitioned(engine.scheduler.cache, engine)
        step += 1
    event(f"preempted: {engine.scheduler.stats.num_preemptions > preemptions}")
    alone = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
             for r in requests]  # fmt: skip
    expected = roomy.generate([r["prompt"] for r in requests], alone, use_tqdm=False)
    for i, out in enumerate(expected):
        assert tokens[str(i)] == out.outputs[0].token_ids, (i, requests[i])
