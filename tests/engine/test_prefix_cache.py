"""Prefix caching: same tokens as without it, cached work skipped, nothing leaked, policy order."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.cache.cache_manager import CacheManager
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
BASE = list(range(40, 80))  # 40 tokens: 2.5 pages of 16
PROMPTS = [
    BASE,
    BASE,  # repeated
    BASE[:20],  # a prefix of the first
    [*BASE, 7, 7, 7],  # extends the first
    [*BASE[:37], 5, 6, 7],  # diverges inside the third page
    BASE[:16] + [9] * 30,  # diverges right at a page boundary
    [3, 4],  # shorter than a page
]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_outputs_with_cache_equal_outputs_without(family: str, checkpoints: dict[str, Path]):
    path = str(checkpoints[family])
    uncached = _tokens(LLM(path, device="cpu", enable_prefix_caching=False), PROMPTS)
    llm = LLM(path, device="cpu")
    # One at a time (each sees what the earlier ones cached), then all together, then again.
    assert [_tokens(llm, [p])[0] for p in PROMPTS] == uncached
    assert _tokens(llm, PROMPTS) == uncached
    assert _tokens(llm, PROMPTS) == uncached
    assert llm.engine.cache.stats.hits > 0


def test_identical_1000_token_prefix_is_not_recomputed(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), device="cpu", max_num_batched_tokens=512)
    runner = llm.engine.runner
    prefix = [random.Random(0).randrange(5, 500) for _ in range(1000)]
    first = llm.generate([[*prefix, 1, 2, 3]], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    before = runner.num_forward_tokens
    second = llm.generate([[*prefix, 4, 5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 990
    computed = runner.num_forward_tokens - before
    # Only the uncached prompt tail, then one token per decode step (the last is never fed back).
    assert computed == 1004 - second.num_cached_tokens + GREEDY.max_tokens - 1
    stats = llm.engine.cache.stats
    assert stats.hits == second.num_cached_tokens and stats.queries == 1003 + 1004


def test_cache_salt_shares_cached_prefixes_only_within_a_salt(llama_dir: Path) -> None:
    """A salted request hits only pages its own salt cached (vLLM's `cache_salt`): unsalted and
    other salts' requests of the same prompt compute it again; the outputs do not change."""
    llm = LLM(str(llama_dir), device="cpu")
    prompt = [random.Random(1).randrange(5, 500) for _ in range(100)]

    def run(salt: str | None):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, cache_salt=salt)
        return llm.generate([prompt], params, use_tqdm=False)[0]

    plain = run(None)
    assert run("tenant-a").num_cached_tokens == 0
    again = run("tenant-a")
    assert again.num_cached_tokens >= 96
    assert run("tenant-b").num_cached_tokens == 0
    assert run(None).num_cached_tokens >= 96  # the unsalted pages are still there
    assert again.outputs[0].token_ids == plain.outputs[0].token_ids


def test_without_prefix_caching_nothing_is_cached(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), device="cpu", enable_prefix_caching=False)
    outputs = llm.generate([BASE, BASE], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [0, 0]
    assert llm.flush_prefix_cache() == 0


def test_flush_drops_unused_prefixes(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), device="cpu")
    llm.generate([BASE], GREEDY, use_tqdm=False)
    assert llm.flush_prefix_cache() > 0
    assert llm.generate([BASE], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def _first_token_order(engine: EngineCore) -> list[str]:
    order: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in order:
                order.append(out.request_id)
    return order


@pytest.mark.parametrize(
    ("policy", "max_wait", "expected"),
    [
        ("fcfs", 2.0, ["cold", "warm"]),
        ("cache-aware", 60.0, ["warm", "cold"]),
        ("cache-aware", 0.0, ["cold", "warm"]),  # waited too long: arrival order wins
    ],
)
def test_scheduling_policy_orders_admission(
    llama_dir: Path, policy: str, max_wait: float, expected: list[str]
) -> None:
    llm = LLM(
        str(llama_dir),
        device="cpu",
        max_num_seqs=1,
        scheduling_policy=policy,
        cache_aware_max_wait=max_wait,
    )
    llm.generate([BASE], GREEDY, use_tqdm=False)  # warm the cache with BASE
    engine = llm.engine
    engine.add_request("cold", list(range(100, 140)), GREEDY)
    engine.add_request("warm", [*BASE, 1], GREEDY)
    assert _first_token_order(engine) == expected


def test_priority_policy_admits_and_preempts_by_priority(llama_dir: Path) -> None:
    """Under `priority`: the lowest priority value is admitted first whatever its arrival,
    ties in arrival order; with a priority set, another policy refuses the request."""
    llm = LLM(str(llama_dir), device="cpu", max_num_seqs=1, scheduling_policy="priority")
    engine = llm.engine
    for name, priority in (("late", 5), ("urgent", -2), ("normal", 0), ("normal2", 0)):
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, priority=priority)
        engine.add_request(name, list(range(100, 120)), params)
    assert _first_token_order(engine) == ["urgent", "normal", "normal2", "late"]
    fcfs = LLM(str(llama_dir), device="cpu")
    with pytest.raises(ValueError, match="priority is 3, but this engine does not schedule"):
        fcfs.generate([[1, 2, 3]], SamplingParams(priority=3), use_tqdm=False)


def test_priority_policy_preempts_the_lowest_priority(llama_dir: Path) -> None:
    """Out of pages, the running request of the highest priority value is preempted, not the
    newest one (an urgent request that came later); outputs stay transformers' greedy ones."""
    llm = LLM(str(llama_dir), device="cpu", page_size=4, num_pages=24, max_model_len=96,
              scheduling_policy="priority")  # fmt: skip
    engine = llm.engine
    preempted: list[str] = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda req: (preempted.append(req.request_id), preempt(req))[1]
    prompts = {"background": list(range(10, 30)), "urgent": list(range(60, 80))}
    tokens: dict[str, list[int]] = {"background": [], "urgent": []}
    for name, priority in (("background", 9), ("urgent", -1)):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, priority=priority)
        engine.add_request(name, prompts[name], params)
        for _ in range(3):  # the background request runs alone first
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert preempted and set(preempted) == {"background"}
    assert tokens["urgent"] == hf_greedy(llama_dir, prompts["urgent"], 40)


def assert_pages_partitioned(cache: CacheManager, engine: EngineCore) -> None:
    """Every page is exactly one of: free, owned by the radix tree, owned by one request."""
    pool = cache.pool
    free = {p for p in range(pool.num_pages) if pool.is_free(p)}
    tree = cache.radix.cached_pages() if cache.radix is not None else []
    owned: list[int] = []
    requests = [*engine.scheduler.running, *engine.scheduler.waiting]
    for req in requests:
        owned.extend(req.pages.page_ids[req.pages.num_tree_pages :])
        assert set(req.pages.page_ids[: req.pages.num_tree_pages]) <= set(tree)
    everything = [*free, *tree, *owned]
    assert len(everything) == len(set(everything)) == pool.num_pages
    assert len(free) == pool.num_free
    # Reference counts: one per request whose locked path passes through the node (root: +1).
    if cache.radix is not None:
        expected: dict[int, int] = {}
        for req in requests:
            node = req.pages.prefix_node
            while node is not None:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        for node in cache.radix._nodes():
            extra = 1 if node is cache.radix.root else 0
            assert node.ref_count == expected.get(id(node), 0) + extra


def traffic_ops(max_tokens: int = 12) -> st.SearchStrategy[tuple]:
    """One op of `run_traffic`: add a request (prefix index, its length, max_tokens), abort
    one, or step the engine 1-3 times."""
    return st.one_of(
        st.tuples(
            st.just("add"), st.integers(0, 3), st.integers(1, 40), st.integers(1, max_tokens)
        ),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("step"), st.integers(1, 3)),
    )


@pytest.fixture(scope="module")
def small_pool_llm(llama_dir: Path) -> LLM:
    return LLM(
        str(llama_dir),
        device="cpu",
        page_size=4,
        num_pages=40,
        max_model_len=96,
        max_num_batched_tokens=24,
    )


def _seeded(i: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=i)


def run_traffic(
    engine: EngineCore,
    ops: list[tuple],
    prefixes: list[list[int]],
    check: Callable[[EngineCore], None],
    sampling: Callable[[int, int], SamplingParams] | None = None,
) -> None:
    """Replay add/abort/step `ops` (prompts from `prefixes`) to the end, `check`ing after every
    op and step; every page is free at the end. `sampling(i, max_tokens)`: request i's
    settings (default: sampled, seeded by i)."""
    ids: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, which, length, max_tokens = op
            rid = f"r{len(ids)}-{random.random()}"
            ids.append(rid)
            prompt = [*prefixes[which][:length], len(ids) % 7 + 1]
            params = (sampling or _seeded)(len(ids), max_tokens)
            engine.add_request(rid, prompt, params)
        elif op[0] == "abort" and ids:
            engine.abort_request(ids[op[1] % len(ids)])
        else:
            for _ in range(op[1]):
                engine.step()
                check(engine)
        check(engine)
    while engine.has_unfinished():
        engine.step()
        check(engine)
    assert engine.cache.num_used_pages == 0


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=st.lists(traffic_ops(), min_size=1, max_size=25))
@example(ops=[("add", i % 4, 40, 12) for i in range(8)] + [("abort", 3), ("step", 3)] * 6)
@pytest.mark.parametrize("whole_min", [0, 8])
def test_random_traffic_never_leaks_or_double_owns_a_page(
    small_pool_llm: LLM, whole_min: int, ops
) -> None:
    """`whole_min`: the scheduler's `whole_prompt_min_tokens` (a backend whose whole prompts
    attend faster: prompts wait a step whole, and the step fills with prompts that fit)."""
    _traffic(small_pool_llm, whole_min, ops)


def _traffic(llm: LLM, whole_min: int, ops: list[tuple], first: int = 10) -> None:
    """`run_traffic` with pages checked; the prompts' prefixes start at token `first`."""
    prefixes = [[*range(first, first + 60)], [*range(first + 20, first + 80)], [5] * 60,
                [*range(first + 190, first + 250)]]  # fmt: skip
    scheduler = llm.engine.scheduler
    scheduler.whole_prompt_min_tokens = whole_min
    try:
        run_traffic(llm.engine, ops, prefixes,
                    lambda engine: assert_pages_partitioned(engine.cache, engine))  # fmt: skip
    finally:
        scheduler.whole_prompt_min_tokens = 0


def test_random_traffic_includes_preemptions_and_whole_prompts(
    small_pool_llm: LLM, monkeypatch
) -> None:
    """The explicit example above overflows the pool, so the property covers preemption; with
    `whole_min`, prompts wait whole and others fill their steps."""
    filled = []
    admit_whole = Scheduler._admit_whole

    def spy(self, out, *args):  # type: ignore[no-untyped-def]
        before = len(out.seqs)
        admit_whole(self, out, *args)
        filled.append(len(out.seqs) - before)

    monkeypatch.setattr(Scheduler, "_admit_whole", spy)
    test_random_traffic_never_leaks_or_double_owns_a_page(small_pool_llm, 0)
    assert small_pool_llm.engine.scheduler.stats.num_preemptions > 0
    # 15-token prompts: the second waits behind the first, a 7-token one fills the step
    # (prompts none of the cached ones begins: a prompt with a cached prefix never waits)
    ops = [("add", 0, 14, 6), ("add", 1, 14, 6), ("add", 2, 6, 6), ("add", 3, 14, 6)] * 3
    _traffic(small_pool_llm, 8, ops, first=261)
    assert filled and max(filled) > 0
