"""Spec-decode counters reach /metrics under vLLM's names (through the engine-stats message)."""

from __future__ import annotations

import json

import msgspec

from tokenmill.ipc.messages import EngineStats, SpecDecodeCounts
from tokenmill.spec.stats import SpecDecodeStats
from tokenmill.testing.metrics import metrics_page


def _stats(spec: SpecDecodeCounts | None) -> EngineStats:
    return EngineStats(
        num_running=0, num_waiting=0, kv_used_pages=0, kv_total_pages=1,
        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, finished={},
        prompt_tokens=0, generation_tokens=0, histograms={}, spec_decode=spec,
    )  # fmt: skip


def test_counters_are_exported_per_position() -> None:
    spec = SpecDecodeCounts(num_drafts=3, num_draft_tokens=9, num_accepted_tokens=7,
                            accepted_per_position=[3, 2, 1, 1])  # fmt: skip
    stats = _stats(spec)
    text = metrics_page(stats)
    assert 'tokenmill:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'tokenmill:spec_decode_num_draft_tokens_total{model_name="m"} 9.0' in text
    assert 'tokenmill:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert (
        'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0'
        in text
    )
    json.dumps(msgspec.to_builtins(stats))


def test_nothing_is_exported_without_speculation() -> None:
    assert "spec_decode" not in metrics_page(_stats(None))


def test_chosen_drafts_histogram_is_exported() -> None:
    chosen = SpecDecodeStats().chosen_drafts
    for n in (0, 4, 4, 2):
        chosen.observe(n)
    stats = _stats(SpecDecodeCounts(0, 0, 0, []))
    stats.histograms["spec_decode_chosen_drafts"] = chosen
    text = metrics_page(stats)
    assert "# HELP tokenmill:spec_decode_chosen_drafts Drafts verified per request" in text
    assert 'tokenmill:spec_decode_chosen_drafts_bucket{le="0.0",model_name="m"} 1.0' in text
    assert 'tokenmill:spec_decode_chosen_drafts_bucket{le="3.0",model_name="m"} 2.0' in text
    assert 'tokenmill:spec_decode_chosen_drafts_count{model_name="m"} 4.0' in text
    assert 'tokenmill:spec_decode_chosen_drafts_sum{model_name="m"} 10.0' in text
