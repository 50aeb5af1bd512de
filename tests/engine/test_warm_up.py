"""The runner's start-up warm-up (`model_runner.warm_up`): eager mixed batches on dummy inputs,
which must write no KV and leave the backend planning real steps as before."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # the Triton backend runs its kernels in the interpreter

from tests.conftest import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.runner.model_runner import warm_up, warm_up_batches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


SHORT = [[q, 1] for q in range(2, 9)]  # short prompts (the verify kernel's row blocks)
SHORT_ALONE = [[q] for q in range(2, 9)]  # the same with one sequence a step


def test_warm_up_batches_fit_the_step_budget_and_the_model_length() -> None:
    assert warm_up_batches(8192, 40960, 64) == [[8191, 1], [64, 1], [16, 1], *SHORT]
    assert warm_up_batches(8192, 4096, 64) == [[4096, 4095, 1], [64, 1], [16, 1], *SHORT]
    assert warm_up_batches(40, 1024, 64) == [[39, 1], [16, 1], *SHORT]
    assert warm_up_batches(40, 16, 64) == [[16, 16, 7, 1], [16, 1], *SHORT]
    assert warm_up_batches(40, 4, 64) == [[4] * 9 + [3, 1], [4, 1], [2, 1], [3, 1]]
    assert warm_up_batches(1, 1024, 64) == []
    # whole prompts of >= 2,048 tokens attend through another kernel: rows just shorter too
    rows = [[2047] * 4 + [3, 1]]
    assert warm_up_batches(8192, 40960, 64, 2048) == [[8191, 1], *rows, [64, 1], [16, 1], *SHORT]
    assert warm_up_batches(40, 16, 64, 2048) == warm_up_batches(40, 16, 64)
    # never more rows than max_num_seqs: the first ones (the scratch is sized for that many)
    assert warm_up_batches(40, 16, 3) == [[16, 16, 7], [16, 1], *SHORT]
    assert warm_up_batches(8192, 40960, 1) == [[8191], [64], [16], *SHORT_ALONE]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_warm_up_runs_mixed_batches_and_writes_no_kv(checkpoints, backend, monkeypatch) -> None:
    path = checkpoints["qwen3"]
    llm = LLM(str(path), device=DEVICE, dtype="float32", attention_backend=backend, page_size=4,
              max_num_batched_tokens=40, enforce_eager=True)  # fmt: skip
    runner = llm.engine.runner
    cache = [*runner.kv_cache.k, *runner.kv_cache.v]
    for t in cache:
        t.fill_(0.5)
    planned: list[list[int]] = []
    plan = type(runner.attention).plan

    def spy(self, inputs) -> None:  # type: ignore[no-untyped-def]
        planned.append(list(inputs.query_lens_cpu))
        plan(self, inputs)

    monkeypatch.setattr(type(runner.attention), "plan", spy)
    batches = warm_up_batches(40, 16, 64)  # rows of at most 16 tokens, as for a 16-token model
    warm_up(runner.model, runner.attention, runner.page_size, batches, runner.device)
    assert planned == [[16, 16, 7, 1], [16, 1], *SHORT]
    assert all(bool((t == 0.5).all()) for t in cache)
    prompt = list(range(3, 12))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([prompt], greedy, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(path, prompt, 4)


def test_warm_up_of_one_sequence_fits_the_backends_scratch(checkpoints) -> None:
    """With `max_num_seqs=1` the warm-up's batches are single rows: a 2-row batch of 8 + 1
    tokens attended through the split-KV verify path, whose scratch holds one sequence's
    partials, and overran it (on a GPU, where the warm-up runs at start-up)."""
    path = checkpoints["qwen3"]
    llm = LLM(str(path), device=DEVICE, dtype="float32", attention_backend="triton",
              max_num_seqs=1, max_num_batched_tokens=40, enforce_eager=True)  # fmt: skip
    runner = llm.engine.runner
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        warm_up(runner.model, runner.attention, runner.page_size, [[8, 1]], runner.device)
    batches = warm_up_batches(40, 1024, 1)
    assert batches == [[39], [16], *SHORT_ALONE]
    warm_up(runner.model, runner.attention, runner.page_size, batches, runner.device)
