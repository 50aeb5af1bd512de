"""The host KV tier on CUDA: pinned host pages, copies on their own stream ordered by events,
the same greedy tokens as without the tier while prefixes are evicted and reloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.test_host_kv_cache import (
    GREEDY,
    PREFIXES,
    SMALL_POOL,
    assert_both_tiers_partitioned,
    host_bytes,
)
from tokenmill import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rounds() -> list[list[int]]:
    return [[*p, 1 + i] for i, p in enumerate(PREFIXES)] + [[*p, 7, 8] for p in PREFIXES]


@pytest.mark.parametrize("setting", [{}, {"enforce_eager": True}, {"overlap_scheduling": False}])
def test_host_tier_outputs_equal_outputs_without_on_gpu(llama_dir: Path, setting: dict) -> None:
    common = dict(device="cuda", dtype="float32", **SMALL_POOL, **setting)
    plain = LLM(str(llama_dir), enable_prefix_caching=False, **common)
    expected = [plain.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
                for p in _rounds()]  # fmt: skip
    llm = LLM(str(llama_dir), host_kv_cache_bytes=host_bytes(llama_dir, 64), **common)
    host = llm.engine.cache.host
    assert host is not None and host.copies is not None
    assert all(t.is_pinned() for t in host.host_kv)
    one_by_one = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in _rounds()]
    assert [o.outputs[0].token_ids for o in one_by_one] == expected
    assert [o.num_cached_tokens for o in one_by_one[3:]] == [60, 60, 60]
    together = llm.generate(_rounds(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == expected
    assert_both_tiers_partitioned(llm.engine)
    torch.cuda.synchronize()
    stats = host.poll()
    assert stats.hit_tokens > 0 and stats.load_seconds > 0
