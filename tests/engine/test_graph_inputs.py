"""The decode and prefill paths through CUDA graphs, on the CPU: graphs stood in for by
re-running the captured forward on the static buffers, so that the input fill
(`fill_decode_inputs`: copies, padding rows, tokens sampled by the previous step still on the
device), the padded batch sizes and the packed, padded one-sequence prefill (with a
prefix-cache hit) are exercised without a GPU. Greedy output must equal transformers'."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton")  # the graph-safe backend and the input fill are Triton kernels

from tests.conftest import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.engine.core_process import engine_stats
from tokenmill.runner.cuda_graphs import CudaGraphRunner
from tokenmill.testing.metrics import metrics_page

PROMPTS = [list(range(3, 10)), [100, 200, 300], list(range(20, 45))]
# On a GPU machine the Triton kernels run compiled, which needs CUDA tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Replay:
    """Stands in for a captured graph: a replay re-plans (as planned at capture time) and
    writes the forward's logits into the captured logits tensor."""

    replays = 0

    def __init__(self, plan: Callable[[], None], forward: Callable[[], torch.Tensor],
                 logits: torch.Tensor) -> None:  # fmt: skip
        self.plan, self.forward, self.logits = plan, forward, logits

    def replay(self) -> None:
        _Replay.replays += 1
        self.plan()
        self.logits.copy_(self.forward())


class _ReplayingGraphRunner(CudaGraphRunner):
    def _capture(self, plan, forward):  # type: ignore[no-untyped-def]
        plan()
        logits = forward()
        return _Replay(plan, forward, logits), logits


def _graphed_llm(path, capture: bool = True, **engine_args) -> LLM:  # type: ignore[no-untyped-def]
    """An LLM whose runner replays stand-in graphs (decode batches up to 4 rows, prefills up to
    16 tokens) on the CPU; `capture=False` leaves them all pending (background capture)."""
    llm = LLM(str(path), device=DEVICE, dtype="float32", attention_backend="triton", page_size=4,
              enforce_eager=True, **engine_args)  # fmt: skip
    runner = llm.engine.runner
    max_pages = -(-runner.config.max_model_len // runner.page_size)
    runner._tokens = torch.zeros(runner.config.scheduler.max_num_seqs, dtype=torch.int64,
                                 device=runner.device)  # fmt: skip
    graphs = _ReplayingGraphRunner(runner.model, runner.attention, 4, max_pages, runner.device,
                                   runner._tokens, max_prefill_tokens=16)  # fmt: skip
    if capture:
        graphs.capture()
    assert graphs.prefill_sizes == [16]
    runner.graphs = graphs
    return llm


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decode_through_graph_inputs_matches_transformers(checkpoints, family: str) -> None:
    """Decode and short prefills replayed through stand-in graphs."""
    path = checkpoints[family]
    llm = _graphed_llm(path)
    _Replay.replays = 0
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)  # 3 rows: padded to 4
    assert _Replay.replays >= 4  # decode steps; the batched prefill runs eagerly
    _Replay.replays = 0
    single = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)  # 1 row: no padding
    assert _Replay.replays == 5  # the prefill (7 tokens padded to 16) and 4 decode steps
    long = llm.generate(PROMPTS[2:], greedy, use_tqdm=False)  # 25 tokens: eager prefill
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, 5) for p in PROMPTS]
    assert single[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert long[0].outputs[0].token_ids == outputs[2].outputs[0].token_ids


def test_graph_batch_with_a_non_sampling_row(checkpoints, monkeypatch) -> None:
    """A 4-token budget puts a 1-token prefill chunk (which samples nothing) beside decode rows
    in a decode-shaped batch: it runs through a graph, its logits rows gathered."""
    from tokenmill.runner.model_runner import ModelRunner

    path = checkpoints["llama"]
    llm = _graphed_llm(path, max_num_batched_tokens=4)
    shapes = []
    original = ModelRunner._run_graph

    def spy(self, host, launched):  # type: ignore[no-untyped-def]
        shapes.append((len(host.logits_index), len(host.kv_lens)))
        return original(self, host, launched)

    monkeypatch.setattr(ModelRunner, "_run_graph", spy)
    # Step 1 prefills 3 + 1 tokens; step 2 is one token each of four sequences, the last one a
    # chunk of the long prompt.
    prompts = [[5, 6, 7], [8, 9], [10], list(range(11, 19))]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, 5) for p in prompts]
    assert any(sampling < rows for sampling, rows in shapes), shapes


def test_background_capture_before_the_step_that_needs_it(checkpoints) -> None:
    """Background capture: a step whose graph is pending captures it first (after reading the
    step in flight: a capture needs the device idle), so every decode step here replays one;
    idle, a step captures the next pending graph and launches nothing. A capture's warm-up pass
    runs on the packed input blocks, which hold the last real step's rows (their slots, at
    another graph size's offsets): it must write no K/V over the requests'."""
    path = checkpoints["llama"]
    llm = _graphed_llm(path, capture=False)
    runner = llm.engine.runner
    assert runner.graphs_pending == 4  # prefill 16; decode 4, 2, 1
    assert _pending_gauge(llm) == 4
    assert llm.engine.step() == []  # idle: the next pending graph
    assert runner.graphs_pending == 3
    assert _pending_gauge(llm) == 3
    prompts = [*PROMPTS, [7, 8, 9, 10, 11]]
    lengths = [9, 3, 6, 8]  # rows finish one by one: decode batches of 4, 3, 2 and 1
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    _Replay.replays = 0
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = [hf_greedy(path, p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert _Replay.replays >= max(lengths) - 1  # every decode step; the prefill batch eager
    assert runner.graphs_pending == 0
    assert _pending_gauge(llm) == 0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == (
        expected
    )


def _pending_gauge(llm: LLM) -> float:
    """`tokenmill:cuda_graphs_pending` of a server whose engine core were `llm`'s (its stats
    through the IPC's encoding)."""
    (line,) = [
        line
        for line in metrics_page(engine_stats(llm.engine, {}, 0.0)).splitlines()
        if line.startswith("tokenmill:cuda_graphs_pending{")
    ]
    return float(line.split()[-1])


def test_a_failed_background_capture_leaves_its_steps_eager(checkpoints, monkeypatch) -> None:
    """A graph whose capture fails while serving is dropped: its batch size runs eagerly, with
    the same tokens, and the other graphs are still captured."""
    path = checkpoints["llama"]
    llm = _graphed_llm(path, capture=False)
    runner = llm.engine.runner
    capture = _ReplayingGraphRunner._capture

    def failing(self, plan, forward):  # type: ignore[no-untyped-def]
        if plan.func.__name__ == "_plan" and plan.args == (2,):  # the decode graph of 2 rows
            raise RuntimeError("operation not permitted when stream is capturing")
        return capture(self, plan, forward)

    monkeypatch.setattr(_ReplayingGraphRunner, "_capture", failing)
    prompts = [*PROMPTS, [7, 8, 9, 10, 11]]
    lengths = [9, 3, 6, 8]  # decode batches of 4, 3, 2 and 1
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = [hf_greedy(path, p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert 2 not in runner.graphs.graphs and {1, 4} <= set(runner.graphs.graphs)
