"""CUDA graphs captured at start-up: decode steps over a ladder of padded batch sizes, and
one-sequence prefills over a ladder of padded prompt lengths."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionInputs
from tokenmill.kernels.graph_inputs import (
    decode_block_size,
    fill_decode_inputs,
    pack_decode_inputs,
)

logger = logging.getLogger(__name__)

# The prefill block's header: cu_query_lens (2), the row whose logits are returned (1), KV length.
_HEADER = 4


def batch_size_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to `max_bs` (and `max_bs` itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs]
    sizes += list(range(16, max_bs, 16))
    return [*sizes, max_bs]


def _fitting(ladder: list[int], n: int) -> int:
    """The smallest size of `ladder` (ascending) that holds `n`."""
    return ladder[bisect.bisect_left(ladder, n)]


def prefill_size_ladder(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, then every multiple of 128 up to `max_tokens` (empty below 16)."""
    if max_tokens < 16:
        return []
    sizes = [s for s in (16, 32, 64) if s < max_tokens]
    sizes += list(range(128, max_tokens, 128))
    return [*sizes, max_tokens]


class CudaGraphRunner:
    """Replays captured forwards (+ logits): decode batches of up to `max_bs` sequences, and
    prefills of one sequence with up to `max_prefill_tokens` new tokens.

    Inputs live in static device buffers, uploaded as one packed block per step. A decode batch
    of B sequences runs the graph of the smallest captured size >= B, which begins by spreading
    its block (`pack_decode_inputs`) into the model's inputs, taking pending input tokens from
    `sampled` (the previous step's samples, kept on the device), and padding the extra rows with
    `kv_len = 0` and slot -1 (they write nothing and attend to nothing). A prefill of n tokens
    runs the graph of the smallest captured length >= n, its extra tokens with slot -1, outside
    the sequence's query length.
    Prefill graphs replace hundreds of kernel launches from Python by one, so a short prompt's
    first token no longer waits for the host.
    """

    def __init__(
        self,
        model: nn.Module,
        attention: AttentionBackend,
        max_bs: int,
        max_pages_per_seq: int,
        device: torch.device,
        sampled: torch.Tensor,
        max_prefill_tokens: int = 0,
    ) -> None:
        self.model = model
        self.sampled = sampled
        self.attention = attention
        self.sizes = batch_size_ladder(max_bs)
        self.max_bs = max_bs
        self.prefill_sizes = (
            prefill_size_ladder(max_prefill_tokens) if attention.prefill_graph_safe() else []
        )

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids = zeros(max_bs)
        self.positions = zeros(max_bs)
        self.slots = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.kv_lens = zeros(max_bs)
        self.page_table = zeros(max_bs, max_pages_per_seq)
        self.cu = torch.arange(max_bs + 1, dtype=torch.int64, device=device)
        self.decode_block = zeros(decode_block_size(max_bs, max_pages_per_seq))
        # A prefill's inputs, one block (one copy per step): the header, then token ids,
        # positions and slots of `max_prefill` tokens, then the sequence's page-table row.
        self.max_prefill = max(self.prefill_sizes, default=0)
        t = self.max_prefill
        self.prefill_block = zeros(_HEADER + 3 * t + max_pages_per_seq)
        self.prefill_block[_HEADER + 2 * t : _HEADER + 3 * t] = -1  # capture: write no KV
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_logits: dict[int, torch.Tensor] = {}
        self._pool = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per ladder size (log the total time)."""
        start = time.perf_counter()
        for t in reversed(self.prefill_sizes):  # largest first: smaller ones reuse its memory
            plan, forward = partial(self._plan_prefill, t), partial(self._forward_prefill, t)
            self.prefill_graphs[t], self.prefill_logits[t] = self._capture(plan, forward)
        for bs in reversed(self.sizes):
            plan, forward = partial(self._plan, bs), partial(self._forward, bs)
            self.graphs[bs], self.logits[bs] = self._capture(plan, forward)
        logger.info(
            "captured %d CUDA graphs in %.1f s: decode batch sizes %d..%d, prefill lengths %s",
            len(self.sizes) + len(self.prefill_sizes),
            time.perf_counter() - start,
            self.sizes[0],
            self.sizes[-1],
            f"{self.prefill_sizes[0]}..{self.max_prefill}" if self.prefill_sizes else "none",
        )

    def _capture(
        self, plan: Callable[[], None], forward: Callable[[], torch.Tensor]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A graph of `forward` (planned by `plan`) and the logits tensor it writes."""
        plan()
        for _ in range(2):  # warm up: compile kernels, pick cuBLAS algorithms
            forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = forward()
        self._pool = graph.pool()
        return graph, logits

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
        static = (self.input_ids, self.positions, self.slots, self.kv_lens, self.page_table)
        fill_decode_inputs(self.decode_block, self.sampled, static, bs)
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.attention)
        return self.model.compute_logits(hidden)

    def _prefill_views(self, t: int) -> tuple[torch.Tensor, ...]:
        """(cu_query_lens, logits row, kv_lens, ids, positions, slots, page-table row) of a
        prefill graph of `t` tokens, as views of the prefill block."""
        block, n = self.prefill_block, self.max_prefill
        ids, positions, slots = (block[_HEADER + i * n : _HEADER + i * n + t] for i in range(3))
        table = block[_HEADER + 3 * n :].view(1, -1)
        return block[0:2], block[2:3], block[3:4], ids, positions, slots, table

    def _plan_prefill(self, t: int) -> None:
        cu, _, kv_lens, _, _, slots, table = self._prefill_views(t)
        self.attention.plan(
            AttentionInputs(
                query_lens_cpu=[t],
                kv_lens_cpu=[t],
                cu_query_lens=cu,
                kv_lens=kv_lens,
                page_table=table,
                slot_mapping=slots,
            )
        )

    def _forward_prefill(self, t: int) -> torch.Tensor:
        _, row, _, ids, positions, _, _ = self._prefill_views(t)
        hidden = self.model(ids, positions, self.attention)
        return self.model.compute_logits(hidden[row])

    def padded_size(self, batch: int) -> int:
        """The smallest captured batch size that holds `batch` sequences."""
        return _fitting(self.sizes, batch)

    def pack_decode(
        self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, kv_lens: np.ndarray,
        page_table: np.ndarray, input_src: np.ndarray,
    ) -> np.ndarray:  # fmt: skip
        """A decode batch's inputs laid out as `decode_block` for its graph, to be copied there
        in one piece before `run`; row i's input id is the previous step's sample in row
        `input_src[i]` where that is >= 0."""
        padded = self.padded_size(len(kv_lens))
        return pack_decode_inputs(ids, positions, slots, kv_lens, page_table, input_src, padded)

    def run(self, batch: int) -> torch.Tensor:
        """Logits `[B, V]` of a decode batch of B rows whose inputs, packed for the graph of
        `padded_size(B)` rows, are in `decode_block`."""
        bs = self.padded_size(batch)
        self.graphs[bs].replay()
        return self.logits[bs][:batch]

    def serves_prefill(self, num_tokens: int, num_pages: int) -> bool:
        """Whether a one-sequence prefill of `num_tokens` new tokens over `num_pages` pages of
        context has a graph."""
        return 1 < num_tokens <= self.max_prefill and num_pages <= self.page_table.shape[1]

    def pack_prefill(
        self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, kv_len: int,
        pages: np.ndarray,
    ) -> np.ndarray:  # fmt: skip
        """A one-sequence prefill's inputs laid out as `prefill_block` (padding included), to
        be copied there in one piece before `run_prefill`."""
        n, t = len(ids), self.max_prefill
        block = np.zeros(_HEADER + 3 * t + len(pages), dtype=np.int64)
        block[:_HEADER] = (0, n, n - 1, kv_len)
        for i, values in enumerate((ids, positions, slots)):
            block[_HEADER + i * t : _HEADER + i * t + n] = values
        block[_HEADER + 2 * t + n : _HEADER + 3 * t] = -1  # padding tokens write no KV
        block[_HEADER + 3 * t :] = pages
        return block

    def run_prefill(self, num_tokens: int) -> torch.Tensor:
        """Logits `[1, V]` of the last of `num_tokens` prefilled tokens of one sequence, whose
        inputs (`pack_prefill`) are in `prefill_block`."""
        t = _fitting(self.prefill_sizes, num_tokens)
        self.prefill_graphs[t].replay()
        return self.prefill_logits[t]
