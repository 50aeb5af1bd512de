"""Tensor parallelism on the CPU (gloo, 2 ranks): the same greedy tokens as transformers for
every architecture, through chunked prefill, prefix hits and preemption; a lost rank ends the
engine; sizes the model cannot split are refused."""

from __future__ import annotations

import gc
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch

from tests.conftest import FAMILIES, hf_greedy
from tests.e2e.server import run_server
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.config import EngineArgs
from tokenmill.testing.checkpoints import build_checkpoint

PROMPTS = [
    list(range(3, 10)),
    list(range(20, 77)),
    [100, 200, 300],
    [*range(20, 60), 5, 6],  # shares 40 tokens with the second
    [42],
]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Chunked prefill (8-token budget) and a pool small enough that requests are preempted.
TIGHT = {"page_size": 4, "num_pages": 24, "max_model_len": 96, "max_num_batched_tokens": 8}


@pytest.fixture(autouse=True, scope="module")
def _keep_torch_threads() -> Iterator[None]:
    """Rank 0 runs in this process and takes its share of the cores; give them back after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _check_tp2(path: Path, again: bool = False, **options: object) -> LLM:
    """A two-rank (or `tensor_parallel_size`) engine's greedy tokens equal transformers';
    `again`: a second run, now with the prompts' pages cached, too."""
    llm = LLM(str(path), device="cpu", **{"tensor_parallel_size": 2, **options})
    expected = [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]
    assert _tokens(llm) == expected
    if again:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert sum(o.num_cached_tokens for o in outputs) > 0
    return llm


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_match_transformers(family: str, checkpoints: dict[str, Path]) -> None:
    llm = _check_tp2(checkpoints[family])
    try:
        attention = llm.engine.runner.model.model.layers[0].self_attn
        assert attention.num_heads == 2  # 4 query heads, 2 per rank; 1 of the 2 kv heads each
        assert llm.engine.runner.kv_cache.k[0].shape[-2:] == (1, attention.head_dim)
    finally:
        llm.close()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_two_ranks_through_chunks_prefix_hits_and_preemption(
    family: str, checkpoints: dict[str, Path]
) -> None:
    llm = _check_tp2(checkpoints[family], again=True, **TIGHT)
    try:
        assert llm.engine.scheduler.stats.num_preemptions > 0
    finally:
        llm.close()


def test_four_ranks_share_each_kv_head_in_pairs(llama_dir: Path) -> None:
    """tp=4 over 4 query and 2 key/value heads: one query head a rank, each kv head on 2."""
    llm = _check_tp2(llama_dir, tensor_parallel_size=4)
    llm.close()


def test_one_kv_head_replicated_biases_and_a_vocabulary_that_does_not_split(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """One key/value head (and its bias) on both ranks; the row-parallel o_proj's bias added
    once, after the sum; 515 vocabulary rows in shares of 258."""
    path = build_checkpoint(
        tmp_path_factory.mktemp("mqa") / "llama", "llama", num_key_value_heads=1, vocab_size=515,
        attention_bias=True,
    )  # fmt: skip
    llm = _check_tp2(path)
    try:
        embedding = llm.engine.runner.model.model.embed_tokens
        assert tuple(embedding.weight.shape) == (258, 64)  # rank 0: rows 0..257 of 515
    finally:
        llm.close()


def test_sampled_and_constrained_requests_run_on_two_ranks(llama_dir: Path) -> None:
    """Rank 0 alone samples (seeded, under a grammar mask) and the others follow its tokens."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=40, logprobs=2,
                       structured_outputs=StructuredOutputsParams(json=schema))
        for seed in range(4)
    ]  # fmt: skip
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=2, max_model_len=256)
    try:
        first = llm.generate(["Hello"] * 4, params, use_tqdm=False)
        again = llm.generate(["Hello"] * 4, params, use_tqdm=False)
    finally:
        llm.close()
    for out in first:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
        assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]


def _speculative(method: str, draft: Path) -> dict[str, object]:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1, "adaptive": False}  # fmt: skip
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
            "adaptive": False}  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_on_two_ranks(
    method: str, family: str, checkpoints: dict[str, Path]
) -> None:
    """Greedy tokens equal transformers' with drafts verified on two ranks (rank 0 alone
    holds the draft model and hands its drafts to the other), through chunks, prefix hits and
    preemption; sampled seeded requests give the tokens they give on one rank."""
    path = checkpoints[family]
    llm = _check_tp2(path, again=True, speculative_config=_speculative(method, path), **TIGHT)
    try:
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_accepted_tokens > 0
        if method == "draft_model":
            assert llm.engine.runner.spec is not None
            assert llm.engine.runner.spec.drafter is not None  # rank 0's
        seeded = [SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True,
                                 repetition_penalty=1.2 * (seed % 2) or 1.0)
                  for seed in range(4)]  # fmt: skip
        two_ranks = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], seeded,
                                                                    use_tqdm=False)]  # fmt: skip
    finally:
        llm.close()
    one = LLM(str(path), device="cpu", speculative_config=_speculative(method, path), **TIGHT)
    one_rank = [o.outputs[0].token_ids for o in one.generate(PROMPTS[:4], seeded, use_tqdm=False)]
    assert two_ranks == one_rank


def test_a_lost_rank_fails_the_engine_within_seconds(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=2)
    try:
        workers = llm.engine.runner.workers
        assert workers is not None
        workers.procs[0].kill()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="worker rank 1"):
            while time.monotonic() - start < 10:
                llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.close()


def test_a_deleted_llm_stops_its_ranks(llama_dir: Path) -> None:
    """An `LLM` dropped without `close` (a notebook making another) stops its ranks when it is
    collected, not only at exit: they hold their shard of the weights and KV cache."""
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=2)
    workers = llm.engine.runner.workers
    assert workers is not None
    procs = list(workers.procs)
    del llm, workers
    gc.collect()
    assert all(p.poll() is not None for p in procs)


def test_a_served_engine_that_loses_a_rank_ends_the_server(llama_dir: Path, tmp_path: Path) -> None:
    with run_server(llama_dir, tmp_path / "log", "--tensor-parallel-size", "2") as server:
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert _title(server.child_pids()["tp_worker_1"]) == "tokenmill::tp_worker_1"
        os.kill(server.child_pids()["tp_worker_1"], signal.SIGKILL)
        killed = time.monotonic()
        assert server.proc.wait(timeout=30) == 1
        assert time.monotonic() - killed < 10
    assert "tensor-parallel worker rank 1" in server.log


def _title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tensor_parallel_size": 3}, r"tensor_parallel_size=3 .*num_attention_heads=4"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        (
            {"tensor_parallel_size": 2, "host_kv_cache_bytes": 1 << 20},
            "does not work with host_kv_cache_bytes",
        ),
        ({"tensor_parallel_size": 2, "device": "cuda:7"}, r"cuda:7\.\.cuda:8"),
    ],
)
def test_sizes_the_model_or_devices_cannot_take_are_refused(
    llama_dir: Path, options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(llama_dir), **options).create_engine_config()  # type: ignore[arg-type]
