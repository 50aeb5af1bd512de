"""The engine on a CUDA GPU: greedy equality in float32, closeness in bfloat16, CUDA graphs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.conftest import FAMILIES, assert_prompt_logprobs_match, hf_logprobs
from tests.gpu.bf16_tracking import track
from tests.gpu.hf_reference import hf_greedy_on
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [list(range(3, 10)), list(range(20, 77)), [100, 200, 300], [7] * 33 + [9], [42]]
PROMPTS = [*PROMPTS, [*list(range(20, 60)), 5, 6]]  # shares a prefix with the second
MAX_TOKENS = 24


SETTINGS = {
    "cuda_graphs": {},
    "eager": {"enforce_eager": True},
    "no_overlap": {"overlap_scheduling": False},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "page_size_1": {"page_size": 1},
    "torch_backend": {"attention_backend": "torch", "enforce_eager": True},
    # one sequence a step: the start-up warm-up runs no batch of more (it did: a crash)
    "one_sequence": {"max_num_seqs": 1},
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_float32_greedy_equals_transformers_on_gpu(checkpoints, family: str, setting: str):
    path = checkpoints[family]
    llm = LLM(str(path), device="cuda", dtype="float32", **SETTINGS[setting])
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_on(path, PROMPTS, MAX_TOKENS)
    # Repeat: now every prompt hits the prefix cache.
    again = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_one_sequence_prefill_graphs_equal_transformers(checkpoints, family: str) -> None:
    """Prompts sent one at a time prefill through the prefill graphs (7, 57, 3, 34 and 42
    tokens padded to 16 or 64; the last one after a prefix-cache hit)."""
    path = checkpoints[family]
    llm = LLM(str(path), device="cuda", dtype="float32", cuda_graph_max_prefill_tokens=64)
    assert llm.engine.runner.graphs is not None
    assert llm.engine.runner.graphs.prefill_sizes == [16, 32, 64]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = [llm.generate([p], greedy, use_tqdm=False)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_on(path, PROMPTS, MAX_TOKENS)
    assert outputs[-1].num_cached_tokens > 0


def test_prompt_logprobs_beside_graph_steps_equal_transformers(checkpoints) -> None:
    """Steps scoring a prompt run eagerly (the graphs keep no prompt position's hidden state)
    among decode steps through the graphs; the scores come back through pinned copies. (The
    tolerance allows the Triton kernels' TF32 products.)"""
    path = checkpoints["llama"]
    llm = LLM(str(path), device="cuda", dtype="float32", max_num_batched_tokens=16)
    scored = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=3)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, [scored if i % 2 else greedy for i in range(len(PROMPTS))],
                           use_tqdm=False)  # fmt: skip
    for i, (prompt, out) in enumerate(zip(PROMPTS, outputs, strict=True)):
        if i % 2:
            reference = hf_logprobs(path, prompt)
            assert_prompt_logprobs_match(out.prompt_logprobs, reference, prompt, 2e-2)
        else:
            assert out.prompt_logprobs is None


def test_a_second_start_reads_the_tuning_cache_and_measures_nothing(
    checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 start-up GEMV tuning: the first start measures every weight shape and writes
    one file for each; the second reads them, measures nothing and chooses the same kernels;
    so does a start with an empty cache and those choices shipped (checked, not measured)."""
    import gc

    from tokenmill.kernels import gemv_tuning
    from tokenmill.layers.linear import Linear

    def start(cache: Path = tmp_path / "cache", shipped: bool = False) -> LLM:
        path = str(checkpoints["llama"])
        return LLM(path, device="cuda", dtype="bfloat16", tuning_cache_dir=str(cache),
                   shipped_tuning=shipped)  # fmt: skip

    def choices(llm: LLM) -> list[dict]:
        modules = llm.engine.runner.model.modules()
        return [dict(m.gemv_choices) for m in modules if isinstance(m, Linear)]

    first = start()
    shapes = {(m.weight.shape, m.input_kind) for m in first.engine.runner.model.modules()
              if isinstance(m, Linear) and m.bias is None}  # fmt: skip
    assert len(list((tmp_path / "cache").rglob("gemv-bfloat16-*.json"))) == len(shapes)
    expected = choices(first)
    del first
    gc.collect()

    def measure(*_: object, **__: object) -> None:  # threads=... too
        raise AssertionError("a shape in the tuning cache was measured again")

    monkeypatch.setattr(gemv_tuning, "fastest_gemv", measure)
    second = start()
    assert choices(second) == expected
    assert {"load_weights", "kv_cache", "gemv_tuning", "cuda_graphs"} <= set(
        second.engine.runner.startup.phases
    )
    del second
    gc.collect()
    assert gemv_tuning.export_shipped_choices(tmp_path / "cache", tmp_path / "shipped")
    monkeypatch.setattr(gemv_tuning, "SHIPPED_DIR", tmp_path / "shipped")
    assert choices(start(tmp_path / "empty", shipped=True)) == expected
    assert len(list((tmp_path / "empty").rglob("gemv-bfloat16-*.json"))) == len(shapes)


def test_background_capture_equals_start_up_capture(checkpoints) -> None:
    """Graphs captured in the background (each before the first step that runs it, the rest
    while idle) give the tokens of graphs captured at start-up. Rows finish one by one, so the
    graphs of smaller batches are captured after larger ones ran: a capture's warm-up passes
    must not write K/V at the slots the last real step left in the packed inputs."""
    path = str(checkpoints["llama"])
    params = [SamplingParams(temperature=0, max_tokens=4 + 5 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    start_up = LLM(path, device="cuda", dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in start_up]
    llm = LLM(path, device="cuda", dtype="float32", cuda_graph_capture="background")
    runner = llm.engine.runner
    pending = runner.graphs_pending
    assert pending > 0
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == (
        expected
    )
    assert runner.graphs_pending < pending
    while runner.graphs_pending:
        assert llm.engine.step() == []  # idle: one graph a step
    again = llm.generate(PROMPTS, params, use_tqdm=False)  # prefix hits, every graph captured
    assert [o.outputs[0].token_ids for o in again] == expected


def test_cuda_graph_batch_sizes_match_eager(checkpoints) -> None:
    path = str(checkpoints["qwen3"])
    prompts = [[5 + i, 9, 11 + i] for i in range(37)]  # 37 decodes: padded to a graph of 48
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    graphs = LLM(path, device="cuda", dtype="float32").generate(prompts, greedy, use_tqdm=False)
    eager = LLM(path, device="cuda", dtype="float32", enforce_eager=True).generate(
        prompts, greedy, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_tracks_float32_transformers(
    tmp_path_factory, family: str, dense: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dense`: whole prompts of at least 16 tokens through cuDNN's dense attention
    (`attention.dense_rows`; by default only those of 2,048 or more)."""
    from tokenmill.attention import triton_backend
    from tokenmill.testing.checkpoints import build_checkpoint

    attended, attend = [], triton_backend.dense_attend

    def recorded(rows, *args) -> None:
        attended.extend(rows)
        attend(rows, *args)

    monkeypatch.setattr(triton_backend, "dense_attend", recorded)
    if dense:
        monkeypatch.setattr(triton_backend, "DENSE_MIN_Q_LEN", 16)

    path = build_checkpoint(
        tmp_path_factory.mktemp("bf16") / family, family, hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    )  # fmt: skip
    llm = LLM(str(path), device="cuda", dtype="bfloat16")
    attended.clear()  # (the start-up warm-up's)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=0)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert {row.n for row in attended} == ({57, 34, 42} if dense else set())
    # bfloat16 rounding (~0.4% per operation) can flip near-ties of the float32 reference, so
    # positions whose reference top-2 margin exceeds 0.1 nats must agree; the rest about as often
    # as in transformers' own bf16 forward.
    # Each position's logprob is held to 0.15 of the reference, or to 1.5x what transformers'
    # own bf16 forward of the same sequence is off by there, if more (one llama position of
    # 384 read 0.17, session 24).
    t = track(path, PROMPTS, outputs)
    pairs = zip(t.errors, t.peer_errors, strict=True)
    worst = [(e, p) for e, p in pairs if e >= max(0.15, 1.5 * p)]
    assert not worst, f"|dlogprob| (engine, transformers bf16) past the bound: {worst}"
    clear = f"{t.clear_agree}/{t.clear}"
    assert t.clear_agree / t.clear >= 0.99, f"top-1 agreement where clear: {clear}"
    # Near-ties flip either way in bf16: overall, the engine agrees with the reference about
    # as often as transformers' bf16 does (llama read 364/384 beside 317/320 where clear, the
    # peer's clear agreement too, session 25; 0.05 is over 3 standard deviations of the
    # near-ties' coin flips).
    agree = f"{t.agree}/{t.total} (transformers bf16 {t.peer_agree})"
    assert t.agree >= t.peer_agree - 0.05 * t.total, f"top-1 agreement {agree}"


def test_gemv_choice_keeps_outputs() -> None:
    """A forced GEMV config gives cuBLAS's result to bf16 rounding, and the start-up choice only
    ever picks configs from the candidate list."""
    from tokenmill.kernels.gemv_tuning import GEMV_BUCKETS, GEMV_CANDIDATES, GemvChoice
    from tokenmill.layers.linear import Linear, choose_gemv_kernels

    hidden = 1024
    layer = Linear(hidden, 3 * hidden).cuda().to(torch.bfloat16)
    layer.weight.normal_()
    x = torch.randn(3, hidden, device="cuda", dtype=torch.bfloat16)
    reference = layer(x).float()
    layer.gemv_choices = dict.fromkeys(GEMV_BUCKETS, GemvChoice(GEMV_CANDIDATES[3]))
    forced = layer(x).float()
    assert (forced - reference).abs().max() <= 0.02 * reference.abs().max()
    layers = (
        torch.nn.ModuleList(
            [
                layer,
                Linear(hidden, hidden, input_kind="gated"),
                Linear(hidden, 2 * hidden, input_kind="normed"),
            ]
        )
        .cuda()
        .to(torch.bfloat16)
    )
    layer.gemv_choices = {}
    for each in layers:
        each.weight.normal_()
    assert 0 <= choose_gemv_kernels(layers) <= 3 * len(GEMV_BUCKETS)
    choices = [c for each in layers for c in each.gemv_choices.values()]
    assert all(c.config in GEMV_CANDIDATES for c in choices)
    assert all(c.fused for c in layers[0].gemv_choices.values())  # a plain input: no kernel


def _compiled(kernels: list) -> int:  # type: ignore[type-arg]
    """Compiled variants of the Triton `kernels` in this process's caches."""
    return sum(k.compiled() for k in kernels)


def _triton_kernels() -> list:  # type: ignore[type-arg]
    """Every launched Triton kernel of `tokenmill.kernels` (each a `DirectLaunch`)."""
    import importlib
    import pkgutil

    import tokenmill.kernels
    from tokenmill.kernels.launch import DirectLaunch

    found = []
    for info in pkgutil.iter_modules(tokenmill.kernels.__path__):
        module = importlib.import_module(f"tokenmill.kernels.{info.name}")
        found += [v for v in vars(module).values() if isinstance(v, DirectLaunch)]
    return found


def test_serving_after_start_up_compiles_no_kernel(checkpoints) -> None:
    """The runner's start-up warm-up compiles what a serving run's steps launch: mixed steps
    (prompt chunks beside decode rows, whose short rows are a launch of their own; short
    prompts beside decode rows, through the verify kernel) of varied lengths, page-table widths
    and input offsets compile no Triton kernel (of `tokenmill.kernels`)."""
    kernels = _triton_kernels()
    assert kernels
    for k in kernels:  # earlier tests' compiles must not stand in for the warm-up's
        k.reset()
    llm = LLM(str(checkpoints["qwen3"]), device="cuda", dtype="bfloat16",
              max_num_batched_tokens=96, max_num_seqs=16)  # fmt: skip
    before = _compiled(kernels)
    rng = random.Random(0)
    # The last 8 are short (2-8 tokens), admitted as earlier ones finish: steps whose longest
    # row is such a prompt beside decode rows (the verify kernel's path).
    lens = [rng.randrange(2, 300) for _ in range(16)] + [rng.randrange(2, 9) for _ in range(8)]
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in lens]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randrange(1, 12), ignore_eos=True)
        for _ in prompts
    ]
    llm.generate(prompts, params, use_tqdm=False)
    assert _compiled(kernels) == before


def test_long_prompts_after_start_up_compile_no_kernel(checkpoints, monkeypatch) -> None:
    """With whole prompts through cuDNN (from 256 tokens here; the wide prefill tile from 512
    tokens a step), the Triton kernel's rows beside them (chunks after a prefix, prompts under
    the bound, decode rows) take tiles the warm-up built: no Triton kernel compiles."""
    from tokenmill.attention import triton_backend
    from tokenmill.kernels import attention

    monkeypatch.setattr(triton_backend, "DENSE_MIN_Q_LEN", 256)
    monkeypatch.setattr(attention, "WIDE_MIN_TOKENS", 512)
    kernels = _triton_kernels()
    for k in kernels:
        k.reset()
    llm = LLM(str(checkpoints["llama"]), device="cuda", dtype="bfloat16",
              max_num_batched_tokens=1024, max_num_seqs=16)  # fmt: skip
    before = _compiled(kernels)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(130, 900))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    assert _compiled(kernels) == before


def test_dense_lengths_are_built_with_the_graphs(checkpoints, monkeypatch) -> None:
    """cuDNN builds a graph at each dense row length's first use (~65 ms on the H200): with
    start-up capture every length up to the token budget is built before the first request,
    beside the CUDA graphs (dense rows from 256 tokens here: the checkpoint's context is
    1,024)."""
    from tokenmill.attention import dense_rows, triton_backend

    monkeypatch.setattr(triton_backend, "DENSE_MIN_Q_LEN", 256)
    built, causal = [], dense_rows._dense_causal

    def recorded(q, k, v, scale):  # type: ignore[no-untyped-def]
        built.append(q.shape[2])
        return causal(q, k, v, scale)

    monkeypatch.setattr(dense_rows, "_dense_causal", recorded)
    llm = LLM(str(checkpoints["llama"]), device="cuda", dtype="bfloat16")
    lengths = llm.engine.runner.attention.prebuild_lengths(1024)
    assert lengths == [*range(256, 512, 32), *range(512, 1025, 64)]
    assert set(lengths) <= set(built)
