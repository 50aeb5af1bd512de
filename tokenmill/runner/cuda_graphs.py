"""CUDA graphs for decode steps, captured at start-up for a ladder of padded batch sizes."""

from __future__ import annotations

import bisect
import logging
import time

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionInputs
from tokenmill.kernels.graph_inputs import fill_decode_inputs

logger = logging.getLogger(__name__)


def batch_size_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to `max_bs` (and `max_bs` itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs]
    sizes += list(range(16, max_bs, 16))
    return [*sizes, max_bs]


class CudaGraphRunner:
    """Replays a captured forward + logits for decode batches of up to `max_bs` sequences.

    Inputs live in static device buffers; a batch of B sequences runs the graph of the smallest
    captured size >= B, its extra rows padded with `kv_len = 0` and slot -1 (they write nothing
    and attend to nothing).
    """

    def __init__(
        self,
        model: nn.Module,
        attention: AttentionBackend,
        max_bs: int,
        max_pages_per_seq: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attention = attention
        self.sizes = batch_size_ladder(max_bs)
        self.max_bs = max_bs

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids = zeros(max_bs)
        self.positions = zeros(max_bs)
        self.slots = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.kv_lens = zeros(max_bs)
        self.page_table = zeros(max_bs, max_pages_per_seq)
        self.cu = torch.arange(max_bs + 1, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._pool = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per ladder size (log the total time)."""
        start = time.perf_counter()
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            self._capture(bs)
        logger.info(
            "captured %d CUDA graphs (batch sizes %d..%d) in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def _plan(self, bs: int) -> None:
        self.attention.plan(
            AttentionInputs(
                query_lens_cpu=[1] * bs,
                kv_lens_cpu=[1] * bs,
                cu_query_lens=self.cu[: bs + 1],
                kv_lens=self.kv_lens[:bs],
                page_table=self.page_table[:bs],
                slot_mapping=self.slots[:bs],
            )
        )

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.attention)
        return self.model.compute_logits(hidden)

    def _capture(self, bs: int) -> None:
        self._plan(bs)
        for _ in range(2):  # warm up: compile kernels, pick cuBLAS algorithms
            self._forward(bs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.logits[bs] = self._forward(bs)
        self._pool = graph.pool()
        self.graphs[bs] = graph

    def padded_size(self, batch: int) -> int:
        """The smallest captured batch size that holds `batch` sequences."""
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    def run(
        self, inputs: tuple[torch.Tensor, ...], row_src: torch.Tensor, sampled: torch.Tensor
    ) -> torch.Tensor:
        """Logits `[B, V]` of a decode batch of B rows: `inputs` are its (input_ids, positions,
        slots, kv_lens, page_table) device tensors; row i's input id is `sampled[row_src[i]]`
        where `row_src[i] >= 0` (a token the previous step sampled on the device)."""
        batch = inputs[4].shape[0]
        bs = self.padded_size(batch)
        static = (self.input_ids, self.positions, self.slots, self.kv_lens, self.page_table)
        fill_decode_inputs(inputs, row_src, sampled, static, bs)
        self.graphs[bs].replay()
        return self.logits[bs][:batch]
