"""The decode path through CUDA graphs, on the CPU: graphs stood in for by re-running the
captured forward on the static buffers, so that the input fill (`fill_decode_inputs`: copies,
padding rows, tokens sampled by the previous step still on the device) and the padded batch
sizes are exercised without a GPU. Greedy output must equal transformers'."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # the graph-safe backend and the input fill are Triton kernels

from tests.conftest import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.runner.cuda_graphs import CudaGraphRunner

PROMPTS = [list(range(3, 10)), [100, 200, 300], list(range(20, 45))]
# On a GPU machine the Triton kernels run compiled, which needs CUDA tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Replay:
    def __init__(self, runner: CudaGraphRunner, bs: int) -> None:
        self.runner, self.bs = runner, bs

    def replay(self) -> None:
        """What a replay of the captured graph computes: the forward of the static buffers,
        with the attention plan made at capture time."""
        self.runner._plan(self.bs)
        self.runner.logits[self.bs].copy_(self.runner._forward(self.bs))


class _ReplayingGraphRunner(CudaGraphRunner):
    def _capture(self, bs: int) -> None:
        self._plan(bs)
        self.logits[bs] = self._forward(bs)
        self.graphs[bs] = _Replay(self, bs)  # type: ignore[assignment]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decode_through_graph_inputs_matches_transformers(checkpoints, family: str) -> None:
    path = checkpoints[family]
    llm = LLM(str(path), device=DEVICE, dtype="float32", attention_backend="triton", page_size=4,
              enforce_eager=True)  # fmt: skip
    runner = llm.engine.runner
    max_pages = -(-runner.config.max_model_len // runner.page_size)
    graphs = _ReplayingGraphRunner(runner.model, runner.attention, 4, max_pages, runner.device)
    graphs.capture()
    runner.graphs = graphs
    replays = 0
    original = _Replay.replay

    def counted(self: _Replay) -> None:
        nonlocal replays
        replays += 1
        original(self)

    _Replay.replay = counted  # type: ignore[method-assign]
    try:
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)  # 3 rows: padded to 4
        single = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)  # 1 row: no padding
    finally:
        _Replay.replay = original  # type: ignore[method-assign]
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, 8) for p in PROMPTS]
    assert single[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert replays >= 14  # 7 decode steps per generate call
