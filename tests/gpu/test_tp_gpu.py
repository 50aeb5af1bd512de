"""Tensor parallelism on two CUDA GPUs (NCCL, all-reduces inside the CUDA graphs): greedy
tokens equal transformers' in float32 for dense and mixture-of-experts models, with CUDA graphs,
eager, chunked prefill, prefill graphs and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.hf_reference import hf_greedy_on
from tokenmill import LLM, SamplingParams
from tokenmill.testing.checkpoints import build_checkpoint

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)

PROMPTS = [list(range(3, 10)), list(range(20, 77)), [100, 200, 300], [7] * 33 + [9], [42]]
PROMPTS = [*PROMPTS, [*range(20, 60), 5, 6]]  # shares a prefix with the second
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
FAMILIES = ("llama", "qwen3", "qwen3_moe", "qwen2_moe")
SETTINGS = {
    "cuda_graphs": {},
    "eager": {"enforce_eager": True},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "prefill_graphs": {"cuda_graph_max_prefill_tokens": 64},
    "tiny_pool_preempts": {"page_size": 4, "num_pages": 24, "max_model_len": 96},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-gpu")
    return {family: build_checkpoint(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {family: hf_greedy_on(path, PROMPTS, MAX_TOKENS) for family, path in checkpoints.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_two_gpus_match_transformers(
    family: str,
    setting: str,
    checkpoints: dict[str, Path],
    references: dict[str, list[list[int]]],
) -> None:
    llm = LLM(str(checkpoints[family]), device="cuda", tensor_parallel_size=2, **SETTINGS[setting])
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == references[family]
        if "preempts" in setting:
            assert llm.engine.scheduler.stats.num_preemptions > 0
    finally:
        llm.close()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("setting", ["cuda_graphs", "eager"])
def test_speculative_decoding_on_two_gpus_matches_transformers(
    method: str,
    setting: str,
    checkpoints: dict[str, Path],
    references: dict[str, list[list[int]]],
) -> None:
    """Verify steps on two ranks (verify graphs with all-reduces); with a draft model, rank 0
    drafts (its loop graph) and broadcasts the drafts the other rank's forward pass reads."""
    path = checkpoints["llama"]
    speculative: dict[str, object] = {"method": method, "num_speculative_tokens": 3,
                                      "adaptive": False}  # fmt: skip
    if method == "ngram":
        speculative |= {"prompt_lookup_max": 3, "prompt_lookup_min": 1}
    else:
        speculative["model"] = str(path)  # the target as its own draft: most drafts accepted
    llm = LLM(str(path), device="cuda", tensor_parallel_size=2, dtype="float32",
              speculative_config=speculative, **SETTINGS[setting])  # fmt: skip
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == references["llama"]
        assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    finally:
        llm.close()
