"""Adaptive speculation in the engine: drafts per request change from step to step, some rows
verify drafts while others decode plain in the same step, plain steps overlap; greedy output
is still the target's, token for token, and no page leaks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import hf_greedy
from tests.engine.test_prefix_cache import assert_pages_partitioned, run_traffic
from tokenmill import LLM, SamplingParams
from tokenmill.batch import StepPlan
from tokenmill.engine.engine_core import EngineCore
from tokenmill.spec.adaptive import StepCost

PROMPTS = [
    list(range(3, 10)),
    [11, 12, 13, 14, 11, 12, 13, 14, 11, 12],  # repeats: prompt lookup finds drafts
    list(range(20, 77)),
    [7] * 33 + [9],
    [42],
]
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


class LinearCost(StepCost):
    """A step costs `1 + slope * tokens`, whatever the CPU measures: the policy's choices then
    depend on the requests' acceptance alone, so the test is deterministic."""

    def __init__(self, slope: float) -> None:
        super().__init__()
        self.slope = slope

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass

    def predict(self, num_tokens: np.ndarray) -> np.ndarray:
        return 1 + self.slope * np.asarray(num_tokens, dtype=np.float64)


@pytest.fixture(scope="module")
def references(llama_dir: Path) -> list[list[int]]:
    return [hf_greedy(llama_dir, p, MAX_TOKENS) for p in PROMPTS]


def _spec(method: str, draft: Path | None = None, k: int = 4) -> str:
    if method == "ngram":
        return json.dumps({"method": "ngram", "num_speculative_tokens": k,
                           "prompt_lookup_min": 1, "prompt_lookup_max": 3})  # fmt: skip
    return json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": k})


def _record_plans(llm: LLM) -> list[StepPlan]:
    """Every plan the engine launches, in order (a spy on the runner's launch)."""
    plans: list[StepPlan] = []
    launch = llm.engine.runner.launch

    def recording(plan, grammar_mask=None):  # type: ignore[no-untyped-def]
        plans.append(plan)
        return launch(plan, grammar_mask)

    llm.engine.runner.launch = recording  # type: ignore[method-assign]
    return plans


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_greedy_with_adaptive_speculation_equals_greedy_without(
    proposer: str, llama_dir: Path, draft_dir: Path, references: list[list[int]]
) -> None:
    """With the real, measured cost: whatever the policy chooses, the tokens are the target's."""
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_spec(proposer, draft_dir))
    assert _tokens(llm) == references
    assert llm.engine.scheduler.spec_stats.chosen_drafts.count > 0
    assert llm.engine.cache.num_used_pages == 0


@pytest.mark.parametrize("proposer", ["ngram", "other_draft"])
def test_drafts_per_row_change_between_steps_and_mix_within_a_step(
    proposer: str, llama_dir: Path, draft_dir: Path, references: list[list[int]]
) -> None:
    method = "ngram" if proposer == "ngram" else "draft_model"
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_spec(method, draft_dir))
    llm.engine.scheduler.step_cost = LinearCost(0.04)
    plans = _record_plans(llm)
    assert _tokens(llm) == references
    decode_steps = [p for p in plans if np.array_equal(p.num_samples, p.query_lens)]
    drafts = [p.num_samples - 1 for p in decode_steps]
    assert len({int(n) for d in drafts for n in d if n}) > 1  # k varies from step to step
    # Some step verifies drafts beside rows decoding plain.
    assert any((d > 0).any() and (d == 0).any() for d in drafts)
    assert llm.engine.cache.num_used_pages == 0


def test_a_compute_bound_batch_decodes_plain_and_overlapped(
    llama_dir: Path, references: list[list[int]]
) -> None:
    """When drafting never pays, the engine decodes exactly as without speculation: no
    verify rows, and steps overlap (a step is launched before the previous one is read)."""
    llm = LLM(str(llama_dir), device="cpu", speculative_config=_spec("ngram"))
    llm.engine.scheduler.step_cost = LinearCost(10.0)  # every token costs ten steps
    plans = _record_plans(llm)
    overlapped = 0
    step = llm.engine.step

    def counting_step():  # type: ignore[no-untyped-def]
        nonlocal overlapped
        outputs = step()
        overlapped += llm.engine._in_flight is not None
        return outputs

    llm.engine.step = counting_step  # type: ignore[method-assign]
    assert _tokens(llm) == references
    assert all((p.num_samples <= 1).all() for p in plans)
    assert llm.engine.scheduler.spec_stats.num_drafts == 0
    assert overlapped > MAX_TOKENS // 2


_op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 40), st.integers(1, 12)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 3)),
)


@pytest.fixture(scope="module")
def adaptive_llm(llama_dir: Path) -> LLM:
    llm = LLM(str(llama_dir), device="cpu", page_size=4, num_pages=40, max_model_len=96,
              max_num_batched_tokens=24, speculative_config=_spec("ngram"))  # fmt: skip
    llm.engine.scheduler.step_cost = LinearCost(0.1)
    return llm


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(ops=st.lists(_op, min_size=1, max_size=20))
@example(ops=[("add", i % 4, 40, 12) for i in range(8)] + [("abort", 3), ("step", 3)] * 6)
def test_random_traffic_with_adaptive_speculation_never_leaks_a_page(
    adaptive_llm: LLM, ops: list[tuple]
) -> None:
    """Greedy and unseeded sampled requests (those the policy adapts), prefixes that repeat
    (prompt lookup drafts), a small pool (preemption), aborts."""
    prefixes = [[5, 6, 7, 8] * 15, list(range(30, 90)), [5] * 60, list(range(200, 260))]

    def sampling(i: int, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0 if i % 2 else 0.8, max_tokens=max_tokens)

    def check(engine: EngineCore) -> None:
        assert_pages_partitioned(engine.cache, engine)

    run_traffic(adaptive_llm.engine, ops, prefixes, check, sampling)


def test_random_traffic_covers_preemption_and_mixed_drafting(adaptive_llm: LLM) -> None:
    """The explicit example above overflows the pool while rows draft and others do not."""
    test_random_traffic_with_adaptive_speculation_never_leaks_a_page(adaptive_llm)
    scheduler = adaptive_llm.engine.scheduler
    assert scheduler.stats.num_preemptions > 0
    chosen = scheduler.spec_stats.chosen_drafts
    assert chosen.counts[0] > 0 and sum(chosen.counts[1:]) > 0
