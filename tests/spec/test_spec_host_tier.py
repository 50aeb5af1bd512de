"""Speculative decoding with a draft model over the host KV tier: the draft's KV lives in the
target's page ids, so it must travel with the target's when a prefix goes to the host and back."""

from __future__ import annotations

import json
from pathlib import Path

from tests.engine.test_host_kv_cache import GREEDY, PAGE, PREFIXES, SMALL_POOL
from tokenmill import LLM
from tokenmill.cache.kv_cache import KVCache
from tokenmill.config import ModelConfig


def _run(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Each prefix twice, one request at a time; the tokens and the accepted drafts per
    position."""
    prompts = [[*p, 1 + i] for i, p in enumerate(PREFIXES)] + [[*p, 7, 8] for p in PREFIXES]
    tokens = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    return tokens, llm.engine.scheduler.spec_stats.accepted_per_position


def test_draft_kv_moves_with_the_target_kv(llama_dir: Path, draft_dir: Path) -> None:
    spec = json.dumps({"method": "draft_model", "model": str(draft_dir),
                       "num_speculative_tokens": 3, "adaptive": False})  # fmt: skip
    per_page = sum(KVCache.bytes_per_page(ModelConfig.from_pretrained(d), PAGE)
                   for d in (llama_dir, draft_dir))  # fmt: skip
    # Everything stays on the device: the reference for tokens and for the draft's guesses.
    roomy = LLM(str(llama_dir), device="cpu", speculative_config=spec,
                **{**SMALL_POOL, "num_pages": 200})  # fmt: skip
    tiered = LLM(str(llama_dir), device="cpu", speculative_config=spec,
                 host_kv_cache_bytes=64 * per_page, **SMALL_POOL)  # fmt: skip
    expected = _run(roomy)
    assert _run(tiered) == expected
    host = tiered.engine.cache.host
    assert host is not None and host.stats.hit_tokens >= 2 * 40  # reloads, not recomputes
    # Bit-identical draft KV after the round trip: the draft guesses exactly as it did.
    assert len(host.host_kv) == 2 * sum(
        ModelConfig.from_pretrained(d).num_layers for d in (llama_dir, draft_dir)
    )
