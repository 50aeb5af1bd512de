"""`fused_decode_layer`: one-sequence decode steps run every decoder layer in one kernel
(`models/fused_decode.py`). On the CPU the kernel's stages launch one at a time in Triton's
interpreter; greedy output must still equal transformers', and models or set-ups the kernel
does not serve are refused at start-up."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from tests.conftest import hf_greedy
from tokenmill import LLM, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _fused_llm(path, **engine_args) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(path), device=DEVICE, dtype="float32", attention_backend="triton",
               fused_decode_layer=True, **engine_args)  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_decode_matches_transformers(checkpoints, family: str, fused_rows) -> None:
    """Alone (every decode step fused) and, for llama, in a batch whose rows finish one by one
    (fused once one row is left), with prefix-cache hits on pages of 4 tokens."""
    path = checkpoints[family]
    llm = _fused_llm(path, page_size=4)
    prompt = list(range(3, 14))
    alone = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(fused_rows) == GREEDY.max_tokens - 1  # every decode step
    assert alone == hf_greedy(path, prompt, GREEDY.max_tokens)
    if family != "llama":  # (the batch's steps are the same code for every family)
        return
    prompts = [prompt, [*prompt[:8], 40, 41], [50, 51, 52]]
    lengths = [4, 7, 9]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    fused_rows.clear()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = [hf_greedy(path, p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert len(fused_rows) == lengths[2] - lengths[1]  # the last row's steps alone


def test_fused_chunks_and_prefix_hits_match_transformers(checkpoints, fused_rows) -> None:
    """Prompt chunks of at most 8 tokens (a budget of 8) and the few new tokens of a prompt
    whose prefix is cached run through the fused layers too: each token attends the cached
    positions and, causally, the chunk's own; greedy output is still transformers'."""
    path = checkpoints["qwen3"]
    llm = _fused_llm(path, page_size=4, max_num_batched_tokens=8)
    first = list(range(3, 16))  # 13 tokens: chunks of 8 and 5
    second = [*first[:12], 60, 61]  # 12 cached (3 pages of 4), 2 new
    for prompt in (first, second):
        tokens = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert tokens == hf_greedy(path, prompt, GREEDY.max_tokens)
    decodes = GREEDY.max_tokens - 1
    assert fused_rows[: 2 + decodes] == [8, 5] + [1] * decodes
    assert fused_rows[2 + decodes] == 2  # the second prompt's uncached tokens


def test_fused_moe_layers_match_transformers(tmp_path, fused_rows) -> None:
    """A Qwen3-MoE whose every layer is sparse (8 experts, top 2, renormalised): its decode
    steps through the fused layers (router, the token's experts, their down rows) give
    transformers' greedy tokens."""
    from tokenmill.testing.checkpoints import build_checkpoint

    path = build_checkpoint(tmp_path / "moe", "qwen3_moe", mlp_only_layers=[])
    llm = _fused_llm(path)
    for prompt in ([3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42]):
        tokens = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert tokens == hf_greedy(path, prompt, GREEDY.max_tokens)
    assert fused_rows == [1] * 2 * (GREEDY.max_tokens - 1)  # decode steps only (prefills: modules)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_fused_verify_steps_match_transformers(checkpoints, method: str, fused_rows) -> None:
    """Speculative decoding of one sequence: its verify steps (1 + k query tokens, each
    attending causally) and prompts of at most 8 tokens run through the fused layers too;
    greedy output is still transformers'."""
    path = checkpoints["llama"]
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "ngram":
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:
        spec["model"] = str(path)  # the target as its own draft: drafts accepted
    llm = _fused_llm(path, speculative_config=json.dumps(spec))
    prompts = [[11, 12, 13, 14, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6, 7, 8]]
    for prompt in prompts:
        tokens = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert tokens == hf_greedy(path, prompt, GREEDY.max_tokens)
    assert len(prompts[0]) in fused_rows  # the first prompt's prefill
    verify_rows = [r for r in fused_rows[1:] if r > 1]  # (after the first prompt's prefill)
    # (prompt lookup drafts 2 tokens once in the second prompt's continuation; the target as
    # its own draft 3 at every step)
    assert llm.engine.scheduler.spec_stats.num_drafts > 0 and verify_rows
    assert 4 in verify_rows or method == "ngram"
    drafter = llm.engine.runner.spec.drafter
    assert drafter is None or drafter.model.model.fused_decode is not None  # its steps too


@pytest.mark.parametrize(
    ("family", "args", "reason"),
    [
        ("qwen3_moe", {}, "every layer is sparse"),  # (its layer 1 is dense)
        ("qwen2_moe", {}, "every layer is sparse"),  # (a shared expert)
        ("llama", {"attention_backend": "torch"}, "triton attention backend"),
        ("llama", {"deterministic": True}, "deterministic"),
    ],
)
def test_fused_decode_refused(checkpoints, family: str, args: dict, reason: str) -> None:
    engine_args = {"device": DEVICE, "dtype": "float32", "attention_backend": "triton", **args}
    with pytest.raises(ValueError, match=f"fused_decode_layer: .*{reason}"):
        LLM(str(checkpoints[family]), fused_decode_layer=True, **engine_args)
