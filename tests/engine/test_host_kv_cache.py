"""The host KV tier: evicted prefixes come back from host memory with the same tokens, counted
as cached, and every page (device and host) stays accounted for under random traffic."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.engine.test_prefix_cache import run_traffic, traffic_ops
from tokenmill import LLM, SamplingParams
from tokenmill.cache.kv_cache import KVCache
from tokenmill.config import ModelConfig
from tokenmill.engine.engine_core import EngineCore
from tokenmill.ipc.messages import EngineStats, HostKVCacheCounts
from tokenmill.testing.metrics import metrics_page

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PAGE = 4
# Three 60-token prefixes: the 30-page device pool holds about one and a half of them.
PREFIXES = [list(range(10, 70)), list(range(100, 160)), list(range(300, 360))]
SMALL_POOL = dict(page_size=PAGE, num_pages=30, max_model_len=80, max_num_batched_tokens=32)


def host_bytes(path: Path, pages: int) -> int:
    """A host tier of `pages` pages of the checkpoint's KV."""
    return pages * KVCache.bytes_per_page(ModelConfig.from_pretrained(path), PAGE)


def _rounds() -> list[list[int]]:
    """Each prefix, then each again with another tail: the second round finds the first
    round's prefixes evicted from the device (to the host, when there is one)."""
    return [[*p, 1 + i] for i, p in enumerate(PREFIXES)] + [[*p, 7, 8] for p in PREFIXES]


def _generate_one_by_one(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    return [(o.outputs[0].token_ids, o.num_cached_tokens) for o in outs]


@pytest.fixture(scope="module")
def host_llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), device="cpu", host_kv_cache_bytes=host_bytes(llama_dir, 64),
               **SMALL_POOL)  # fmt: skip


def test_outputs_with_host_tier_equal_outputs_without(llama_dir: Path) -> None:
    uncached = LLM(str(llama_dir), device="cpu", enable_prefix_caching=False, **SMALL_POOL)
    expected = [t for t, _ in _generate_one_by_one(uncached, _rounds())]
    llm = LLM(str(llama_dir), device="cpu", host_kv_cache_bytes=host_bytes(llama_dir, 64),
              **SMALL_POOL)  # fmt: skip
    results = _generate_one_by_one(llm, _rounds())
    assert [t for t, _ in results] == expected
    assert [c for _, c in results[3:]] == [60, 60, 60]  # each second round: every whole page
    # All at once too: admission evicts and reloads while other requests run.
    outs = llm.generate(_rounds(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.cache.host.poll()
    assert stats.hit_tokens > 0 and stats.bytes_written > 0 and stats.bytes_loaded > 0


def test_reloaded_prefix_reports_its_tokens_as_cached(host_llm: LLM) -> None:
    host_llm.flush_prefix_cache()
    engine = host_llm.engine
    results = _generate_one_by_one(host_llm, _rounds()[:3])
    assert engine.cache.radix.num_host_pages > 0  # the first prefix went to the host
    loaded_before = engine.cache.host.stats.hit_tokens
    forward_before = engine.runner.num_forward_tokens
    cached = _generate_one_by_one(host_llm, [[*PREFIXES[0], 7, 8]])[0][1]
    assert cached == 60  # every whole page of the 62-token prompt's first 61 tokens
    assert engine.cache.host.stats.hit_tokens - loaded_before >= 40
    # Only the two-token tail is computed, then one token per decode step.
    assert engine.runner.num_forward_tokens - forward_before == 2 + GREEDY.max_tokens - 1
    assert results[0][1] == 0


def test_without_host_tier_the_evicted_prefix_is_recomputed(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), device="cpu", **SMALL_POOL)
    _generate_one_by_one(llm, _rounds()[:3])
    assert llm.engine.cache.host is None
    assert _generate_one_by_one(llm, [[*PREFIXES[0], 7, 8]])[0][1] < 60


def test_host_tier_needs_prefix_caching_and_a_whole_page(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="host_kv_cache_bytes needs enable_prefix_caching"):
        LLM(str(llama_dir), device="cpu", enable_prefix_caching=False, host_kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="host_kv_cache_bytes=1 is less than one KV page"):
        LLM(str(llama_dir), device="cpu", host_kv_cache_bytes=1)
    with pytest.raises(ValueError, match="host_kv_cache_bytes must be >= 0"):
        LLM(str(llama_dir), device="cpu", host_kv_cache_bytes=-1)


def assert_both_tiers_partitioned(engine: EngineCore) -> None:
    """Every device page is free, in the tree, or owned by one request; every host page is free
    or in the tree; the tree's counters agree."""
    cache, radix, host = engine.cache, engine.cache.radix, engine.cache.host
    assert radix is not None and host is not None
    requests = [*engine.scheduler.running, *engine.scheduler.waiting]
    tree = radix.cached_pages()
    owned = [p for r in requests for p in r.pages.page_ids[r.pages.num_tree_pages :]]
    for req in requests:
        assert set(req.pages.page_ids[: req.pages.num_tree_pages]) <= set(tree)
    free = [p for p in range(cache.pool.num_pages) if cache.pool.is_free(p)]
    device = [*free, *tree, *owned]
    assert len(device) == len(set(device)) == cache.pool.num_pages
    host_tree = radix.host_pages()
    host_free = [p for p in range(host.pool.num_pages) if host.pool.is_free(p)]
    assert sorted([*host_free, *host_tree]) == list(range(host.pool.num_pages))
    assert len(tree) == radix.num_cached_pages and len(host_tree) == radix.num_host_pages
    # The device part of the tree is its top: no device node below a host node.
    for node in radix._nodes():
        if node.on_host:
            assert node.ref_count == 0
            assert all(child.on_host for child in node.children.values())


@pytest.fixture(scope="module")
def tiny_tiers_llm(llama_dir: Path) -> LLM:
    """A 24-page device pool and a 12-page host pool: both evict under this traffic."""
    host = host_bytes(llama_dir, 12)
    return LLM(str(llama_dir), device="cpu", page_size=PAGE, num_pages=24, max_model_len=64,
               max_num_batched_tokens=24, host_kv_cache_bytes=host)  # fmt: skip


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(traffic_ops(8), min_size=1, max_size=20))
@example(ops=[("add", i % 4, 40, 8) for i in range(8)] + [("abort", 3), ("step", 3)] * 6)
def test_random_traffic_keeps_both_tiers_partitioned(tiny_tiers_llm: LLM, ops) -> None:
    prefixes = [list(range(10, 50)), list(range(30, 70)), [5] * 40, list(range(200, 240))]
    run_traffic(tiny_tiers_llm.engine, ops, prefixes, assert_both_tiers_partitioned)


def test_random_traffic_moves_pages_both_ways(tiny_tiers_llm: LLM) -> None:
    """The explicit example above overflows both pools, so the property covers write-back,
    reload and host eviction."""
    test_random_traffic_keeps_both_tiers_partitioned(tiny_tiers_llm)
    stats = tiny_tiers_llm.engine.cache.host.stats
    assert stats.bytes_written > 0 and stats.bytes_loaded > 0


def test_host_tier_counters_reach_metrics() -> None:
    counts = HostKVCacheCounts(hit_tokens=64, bytes_loaded=4096, bytes_written=8192,
                               load_seconds=0.5, used_pages=3, total_pages=12)  # fmt: skip
    stats = EngineStats(
        num_running=0, num_waiting=0, kv_used_pages=0, kv_total_pages=1,
        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, finished={},
        prompt_tokens=0, generation_tokens=0, histograms={}, host_kv_cache=counts,
    )  # fmt: skip
    text = metrics_page(stats)
    for line in ('host_kv_cache_hits_total{model_name="m"} 64.0',
                 'host_kv_cache_bytes_loaded_total{model_name="m"} 4096.0',
                 'host_kv_cache_bytes_written_total{model_name="m"} 8192.0',
                 'host_kv_cache_load_seconds_total{model_name="m"} 0.5',
                 'host_kv_cache_usage_perc{model_name="m"} 0.25'):  # fmt: skip
        assert "tokenmill:" + line in text
