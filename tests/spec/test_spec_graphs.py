"""Speculative steps through CUDA graphs, on the CPU: graphs stood in for by re-running the
captured forward on the static buffers (as in tests/engine/test_graph_inputs.py), so that the
verify graphs' packed inputs (rows of 1 to 1 + k tokens padded to a (rows, tokens per row)
graph, drafts taken from the device), the draft model's drafting loop and its mirror passes
are exercised without a GPU. Greedy output with speculation must equal greedy output without.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # the graph-safe backend and the input fills are Triton kernels

from tokenmill import LLM, SamplingParams
from tokenmill.batch import StepPlan
from tokenmill.kernels.graph_inputs import fill_verify_inputs, pack_verify_inputs
from tokenmill.runner.cuda_graphs import CudaGraphRunner, DraftLoopGraphs, verify_ladder
from tokenmill.runner.spec_decode import device_draft_entries

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[11, 12, 13, 14] * 3, list(range(3, 10)), [7] * 9 + [9]]


def test_verify_ladder_covers_every_batch_that_fits_the_budget() -> None:
    sizes = [1, 2, 4, 8, 16]
    keys = verify_ladder(sizes, 4, 40)
    assert {q for _, q in keys} == {2, 3, 4}
    # 9 rows (one of 4 tokens) fit in 12 <= 40 tokens: the graph of 16 rows x 4 exists.
    assert (16, 4) in keys
    # 5 rows, one of 2 tokens, fit in 6: 8 x 2; 3 rows, one of 4 tokens, do too: 4 x 4.
    assert verify_ladder(sizes, 4, 6) == [
        (1, 2), (2, 2), (4, 2), (8, 2), (1, 3), (2, 3), (4, 3), (1, 4), (2, 4), (4, 4),
    ]  # fmt: skip
    assert verify_ladder(sizes, 1, 100) == []


def test_device_draft_entries_index_drafts_row_major() -> None:
    # Rows 0 and 2 draft 2 and 3 tokens (k = 3): drafting rows 0 and 1 of the drafts buffer.
    entries = device_draft_entries(np.array([2, 0, 3, 0]), 3)
    assert entries.tolist() == [0, 1, 3, 4, 5]


def test_verify_inputs_are_spread_and_padded() -> None:
    """Two rows (3 and 1 tokens) packed for a graph of 4 rows x 3 tokens: the previous step's
    sample and a device draft are read on the device, padding tokens write nothing, padding
    rows hold no tokens."""
    ids = np.array([5, 0, 0, 9])
    positions = np.array([7, 8, 9, 3])
    slots = np.array([31, 32, 33, 12])
    q_lens, kv_lens = np.array([3, 1]), np.array([10, 4])
    table = np.array([[6, 7, 8], [3, 0, 0]])
    input_src = np.array([-1, 1, -1, -1])  # token 1: entry 1 of the previous step's samples
    draft_src = np.array([-1, -1, 2, -1])  # token 2: entry 2 of the drafts buffer
    block = pack_verify_inputs(ids, positions, slots, q_lens, kv_lens, table, input_src,
                               draft_src, 4, 12)  # fmt: skip
    device = torch.device(DEVICE)
    sampled = torch.tensor([100, 101], device=device)
    drafts = torch.tensor([200, 201, 202], device=device)
    static = (torch.full((16,), 99, device=device), torch.full((16,), 99, device=device),
              torch.full((16,), 99, device=device), torch.full((5,), 99, device=device),
              torch.full((4,), 99, device=device), torch.zeros(4, 5, dtype=torch.int64,
                                                               device=device))  # fmt: skip
    fill_verify_inputs(torch.from_numpy(block).to(device), sampled, drafts, static, 4, 12)
    out_ids, out_pos, out_slots, out_cu, out_kv, out_table = (t.cpu() for t in static)
    assert out_ids[:12].tolist() == [5, 101, 202, 9] + [0] * 8
    assert out_pos[:12].tolist() == [7, 8, 9, 3] + [0] * 8
    assert out_slots[:12].tolist() == [31, 32, 33, 12] + [-1] * 8
    assert out_ids[12:].tolist() == [99] * 4  # past the graph: untouched
    assert out_cu.tolist() == [0, 3, 4, 4, 4]
    assert out_kv.tolist() == [10, 4, 0, 0]
    assert out_table[:2, :3].tolist() == table.tolist()


class _Replay:
    """Stands in for a captured graph: a replay re-plans and re-runs the forward."""

    replays = 0

    def __init__(self, plan: Callable[[], None], forward: Callable[[], torch.Tensor | None],
                 out: torch.Tensor | None) -> None:  # fmt: skip
        self.plan, self.forward, self.out = plan, forward, out

    def replay(self) -> None:
        _Replay.replays += 1
        self.plan()
        result = self.forward()
        if self.out is not None and result is not None and result is not self.out:
            self.out.copy_(result)


@pytest.fixture
def replaying(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Graph capture replaced by `_Replay`; counts replays by kind."""
    counts = {"verify": 0, "loop": 0}

    def capture(self, plan, forward):  # type: ignore[no-untyped-def]
        plan()
        out = forward()
        return _Replay(plan, forward, out), out

    def capture_loop(self, plan, forward):  # type: ignore[no-untyped-def]
        plan()
        forward()
        return _Replay(plan, forward, None)

    original_verify, original_loop = CudaGraphRunner.run_verify, DraftLoopGraphs.run

    def run_verify(self, key, num_tokens):  # type: ignore[no-untyped-def]
        counts["verify"] += 1
        return original_verify(self, key, num_tokens)

    def run_loop(self, batch):  # type: ignore[no-untyped-def]
        counts["loop"] += 1
        return original_loop(self, batch)

    monkeypatch.setattr(CudaGraphRunner, "_capture", capture)
    monkeypatch.setattr(DraftLoopGraphs, "_capture", capture_loop)
    monkeypatch.setattr(CudaGraphRunner, "run_verify", run_verify)
    monkeypatch.setattr(DraftLoopGraphs, "run", run_loop)
    return counts


def _graphed_llm(path: Path, spec: dict | None, **engine_args) -> LLM:  # type: ignore[no-untyped-def]
    """An LLM whose runner replays stand-in graphs (batches up to 4 rows, prefills up to 16
    tokens, verifies up to 4 rows of 1 + k tokens) on the CPU."""
    llm = LLM(str(path), device=DEVICE, dtype="float32", attention_backend="triton", page_size=4,
              enforce_eager=True, speculative_config=spec, **engine_args)  # fmt: skip
    runner = llm.engine.runner
    config = runner.config
    max_pages = -(-config.max_model_len // runner.page_size)
    budget = config.scheduler.max_num_batched_tokens
    runner._tokens = torch.zeros(budget, dtype=torch.int64, device=runner.device)
    k = config.speculative.num_speculative_tokens if config.speculative else 0
    drafts = runner.spec.draft_tokens if runner.spec is not None else None
    graphs = CudaGraphRunner(runner.model, runner.attention, 4, max_pages, runner.device,
                             runner._tokens, 16, 1 + k, budget, drafts)  # fmt: skip
    graphs.capture()
    runner.graphs = graphs
    if runner.spec is not None:
        runner.spec.capture_graphs(graphs)
    return llm


def _spec(method: str, k: int, draft: Path) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3, "adaptive": False}  # fmt: skip
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
            "adaptive": False}  # fmt: skip


def _verifies(plan: StepPlan) -> bool:
    """A step of decode and verify rows only, one at least verifying drafts."""
    return plan.query_lens.max() > 1 and np.array_equal(plan.num_samples, plan.query_lens)


@pytest.mark.parametrize(("method", "k"), [("ngram", 2), ("draft_model", 2)])
def test_greedy_verify_through_graphs_equals_plain(
    llama_dir: Path, replaying: dict[str, int], method: str, k: int
) -> None:
    """Greedy output through verify (and draft-loop) graphs equals plain decoding; the draft
    model is the target itself, so drafts are accepted and bonus tokens taken in few steps."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(str(llama_dir), dtype="float32", page_size=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy, use_tqdm=False)]
    llm = _graphed_llm(llama_dir, _spec(method, k, llama_dir))
    runner = llm.engine.runner
    computed: list[tuple[StepPlan, int]] = []  # what adaptive speculation would measure
    launch = runner.launch

    def recording(plan, grammar_mask=None):  # type: ignore[no-untyped-def]
        step = launch(plan, grammar_mask)
        computed.append((plan, step.num_computed_tokens))
        return step

    runner.launch = recording  # type: ignore[method-assign]
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert replaying["verify"] > 0
    assert runner.padded_verify_rows == 4
    verifies = [(p, n) for p, n in computed if _verifies(p)]
    assert verifies
    for plan, num_tokens in verifies:  # every row of a verify graph at the longest row's length
        rows = runner.graphs.padded_size(plan.num_rows)
        assert num_tokens == rows * plan.query_lens.max()
    if method == "draft_model":
        assert replaying["loop"] > 0
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert llm.engine.cache.num_used_pages == 0
