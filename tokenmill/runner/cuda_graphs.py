"""CUDA graphs of decode steps over a ladder of padded batch sizes, speculative verify steps over
the same ladder times their query lengths, and one-sequence prefills over a ladder of padded
prompt lengths: all captured at start-up, or one at a time between steps after it (`capture_next`,
the server's background capture), a step of a size with no graph yet running eagerly."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import numpy as np
import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionInputs
from tokenmill.kernels import argmax_rows
from tokenmill.kernels.graph_inputs import (
    decode_block_size,
    fill_decode_inputs,
    fill_verify_inputs,
    pack_decode_inputs,
    pack_verify_inputs,
    verify_block_size,
)

logger = logging.getLogger(__name__)

# The prefill block's header: cu_query_lens (2), the row whose logits are returned (1), KV length.
_HEADER = 4
T = TypeVar("T")
# A graph: ("decode", batch size), ("prefill", tokens) or ("verify", (rows, tokens per row));
# ("attention" or "draft attention", row length): a build ahead (`add_pending`).
GraphKey = tuple[str, int | tuple[int, int]]


def batch_size_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to `max_bs` (and `max_bs` itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs]
    sizes += list(range(16, max_bs, 16))
    return [*sizes, max_bs]


def _fitting(ladder: list[int], n: int) -> int:
    """The smallest size of `ladder` (ascending) that holds `n`."""
    return ladder[bisect.bisect_left(ladder, n)]


def verify_ladder(sizes: list[int], max_query_len: int, max_tokens: int) -> list[tuple[int, int]]:
    """(rows, tokens per row) of the verify graphs: every size of the batch ladder `sizes` times
    every query length 2..`max_query_len`, as long as a batch needing that graph (one row more
    than the size below, one of them with q tokens) fits in `max_tokens` tokens."""
    keys = []
    for q in range(2, max_query_len + 1):
        for below, bs in zip([0, *sizes], sizes, strict=False):
            if below + q <= max_tokens:
                keys.append((bs, q))
    return keys


def prefill_size_ladder(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, then every multiple of 128 up to `max_tokens` (empty below 16)."""
    if max_tokens < 16:
        return []
    sizes = [s for s in (16, 32, 64) if s < max_tokens]
    sizes += list(range(128, max_tokens, 128))
    return [*sizes, max_tokens]


def _capture_graph(
    plan: Callable[[], None], forward: Callable[[], T], pool: object
) -> tuple[torch.cuda.CUDAGraph, T]:
    """A graph of `forward` (planned by `plan`, warmed up twice) in memory pool `pool` (None:
    a new one), and what the captured call returned."""
    plan()
    for _ in range(2):  # warm up: compile kernels, pick cuBLAS algorithms
        forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


def _plan_decode(
    attention: AttentionBackend,
    bs: int,
    cu: torch.Tensor,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Plan the attention of `bs` one-token rows on static buffers (their contents are filled
    on the device before each replay)."""
    attention.plan(
        AttentionInputs(
            query_lens_cpu=[1] * bs,
            kv_lens_cpu=[1] * bs,
            cu_query_lens=cu[: bs + 1],
            kv_lens=kv_lens[:bs],
            page_table=page_table[:bs],
            slot_mapping=slots[:bs],
            graphed=True,
        )
    )


class CudaGraphRunner:
    """Replays captured forwards (+ logits): decode batches of up to `max_bs` sequences,
    speculative verify batches of up to `max_bs` rows of up to `max_query_len` tokens, and
    prefills of one sequence with up to `max_prefill_tokens` new tokens.

    Inputs live in static device buffers, uploaded as one packed block per step. A decode batch
    of B sequences runs the graph of the smallest captured size >= B, which begins by spreading
    its block (`pack_decode_inputs`) into the model's inputs, taking pending input tokens from
    `sampled` (the previous step's samples, kept on the device), and padding the extra rows with
    `kv_len = 0` and slot -1 (they write nothing and attend to nothing). A prefill of n tokens
    runs the graph of the smallest captured length >= n, its extra tokens with slot -1, outside
    the sequence's query length.
    A verify batch (rows of 1 to q query tokens, every token sampled: decode rows and rows
    verifying drafts) runs the graph of (smallest captured size >= B rows) x q tokens: the
    attention is the varlen prefill kernel planned for q tokens per row, which reads each row's
    real query length from `cu_query_lens` on the device, so rows with fewer drafts need no
    dummy drafts; the tokens past the batch are padding (slot -1, no row). Its input tokens may
    also come from `drafts` (the draft model's, on the device). A verify graph returns hidden
    states, copied into one static buffer: the vocabulary projection runs after the replay,
    so the graphs of every (rows, q) pair hold no logits of their own.
    Prefill graphs replace hundreds of kernel launches from Python by one, so a short prompt's
    first token no longer waits for the host. With `logits=False` (a draft model mirroring the
    target's batches) the decode and prefill graphs stop at the hidden states too.
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
        max_query_len: int = 1,
        max_verify_tokens: int = 0,
        drafts: torch.Tensor | None = None,
        logits: bool = True,
    ) -> None:
        self.model = model
        self.sampled = sampled
        self.drafts = drafts if drafts is not None else sampled
        self.attention = attention
        self.with_logits = logits
        self.max_query_len, self.max_verify_tokens = max_query_len, max_verify_tokens
        self.sizes = batch_size_ladder(max_bs)
        self.max_bs = max_bs
        self.prefill_sizes = (
            prefill_size_ladder(max_prefill_tokens) if attention.prefill_graph_safe() else []
        )
        self.verify_keys = (
            verify_ladder(self.sizes, max_query_len, max_verify_tokens)
            if attention.prefill_graph_safe()
            else []
        )
        max_tokens = max([max_bs, *(bs * q for bs, q in self.verify_keys)])

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids = zeros(max_tokens)
        self.positions = zeros(max_tokens)
        self.slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.kv_lens = zeros(max_bs)
        self.page_table = zeros(max_bs, max_pages_per_seq)
        self.cu = torch.arange(max_bs + 1, dtype=torch.int64, device=device)
        self.decode_block = zeros(decode_block_size(max_bs, max_pages_per_seq))
        self.verify_cu = zeros(max_bs + 1)
        max_verify = max((bs * q for bs, q in self.verify_keys), default=0)
        self.verify_block = zeros(verify_block_size(max_bs, max_verify, max_pages_per_seq))
        self.verify_hidden: torch.Tensor | None = None  # [tokens, H], allocated at capture
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
        self.verify_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        # Graphs to capture, in order: each ladder largest first (smaller graphs reuse the
        # memory of the larger ones), prefill lengths, verify keys, decode sizes.
        self._pending: dict[GraphKey, Callable[[], None]] = {
            **{("prefill", t): partial(self._capture_prefill, t)
               for t in reversed(self.prefill_sizes)},
            **{("verify", key): partial(self._capture_verify, key)
               for key in sorted(self.verify_keys, key=lambda k: -k[0] * k[1])},
            **{("decode", bs): partial(self._capture_decode, bs) for bs in reversed(self.sizes)},
        }  # fmt: skip
        self._capture_seconds = 0.0
        self._builds: set[GraphKey] = set()  # `add_pending`'s

    def add_pending(self, key: GraphKey, build: Callable[[], None]) -> None:
        """Run `build` where a graph would be captured (with the others at start-up, or
        between steps, idle, in the background), after the graphs: another kernel's slow
        first use, done ahead (the attention backend's `prebuild`)."""
        self._pending[key] = build
        self._builds.add(key)

    def capture(self) -> None:
        """Capture every graph not captured yet."""
        while (key := self.next_pending()) is not None:
            self.capture_next(key)

    def next_pending(self) -> GraphKey | None:
        """The next graph to capture, in order, or None."""
        return next(iter(self._pending), None)

    @property
    def pending(self) -> int:
        """How many graphs are still to capture."""
        return len(self._pending)

    def pending_key(self, rows: int, query_lens: np.ndarray) -> GraphKey | None:
        """The pending graph a step of `rows` rows with these query lengths would run (a
        decode batch's size, a one-sequence prefill's length), or None."""
        if (query_lens == 1).all() and rows <= self.max_bs:
            key: GraphKey = ("decode", self.padded_size(rows))
        elif rows == 1 and 1 < query_lens[0] <= self.max_prefill:
            key = ("prefill", _fitting(self.prefill_sizes, int(query_lens[0])))
        else:
            return None
        return key if key in self._pending else None

    @torch.inference_mode()
    def capture_next(self, key: GraphKey) -> None:
        """Capture the pending graph `key` (the device must be idle: no step in flight). Logs
        the total capture time after the last one."""
        start = time.perf_counter()
        self._reset_inputs()
        self._pending.pop(key)()
        self._capture_seconds += time.perf_counter() - start
        if not self._pending:
            logger.info(
                "captured %d CUDA graphs and %d builds ahead in %.1f s: decode batch sizes "
                "%d..%d, verify (rows, tokens per row) %s, prefill lengths %s",
                len(self.sizes) + len(self.prefill_sizes) + len(self.verify_keys),
                len(self._builds),
                self._capture_seconds,
                self.sizes[0],
                self.sizes[-1],
                f"{self.verify_keys[0]}..{self.verify_keys[-1]}" if self.verify_keys else "none",
                f"{self.prefill_sizes[0]}..{self.max_prefill}" if self.prefill_sizes else "none",
            )

    def _reset_inputs(self) -> None:
        """The packed input blocks as at start-up, so that a capture's warm-up passes write no
        K/V: the blocks of the last real steps hold their rows' slots, which a graph of
        another size would read at other offsets."""
        for block in (self.decode_block, self.verify_block, self.prefill_block):
            block.zero_()
        t = self.max_prefill
        self.prefill_block[_HEADER + 2 * t : _HEADER + 3 * t] = -1

    def _capture_prefill(self, t: int) -> None:
        plan, forward = partial(self._plan_prefill, t), partial(self._forward_prefill, t)
        self.prefill_graphs[t], self.prefill_logits[t] = self._capture(plan, forward)

    def _capture_verify(self, key: tuple[int, int]) -> None:
        if self.verify_hidden is None:
            # One static output for every verify graph, outside the graphs' pool.
            weight = self.model.lm_head.weight
            most = max(bs * q for bs, q in self.verify_keys)
            self.verify_hidden = weight.new_empty(most, weight.shape[1])
        plan, forward = partial(self._plan_verify, *key), partial(self._forward_verify, *key)
        self.verify_graphs[key], _ = self._capture(plan, forward)

    def _capture_decode(self, bs: int) -> None:
        plan, forward = partial(self._plan, bs), partial(self._forward, bs)
        self.graphs[bs], self.logits[bs] = self._capture(plan, forward)

    def _capture(
        self, plan: Callable[[], None], forward: Callable[[], torch.Tensor]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A graph of `forward` (planned by `plan`) and the logits tensor it writes."""
        graph, logits = _capture_graph(plan, forward, self._pool)
        self._pool = graph.pool()
        return graph, logits

    def _plan(self, bs: int) -> None:
        _plan_decode(self.attention, bs, self.cu, self.kv_lens, self.page_table, self.slots)

    def _forward(self, bs: int) -> torch.Tensor:
        static = (self.input_ids, self.positions, self.slots, self.kv_lens, self.page_table)
        fill_decode_inputs(self.decode_block, self.sampled, static, bs)
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.attention)
        return self.model.compute_logits(hidden) if self.with_logits else hidden

    def _plan_verify(self, bs: int, q: int) -> None:
        self.attention.plan(
            AttentionInputs(
                query_lens_cpu=[q] * bs,
                kv_lens_cpu=[q] * bs,
                cu_query_lens=self.verify_cu[: bs + 1],
                kv_lens=self.kv_lens[:bs],
                page_table=self.page_table[:bs],
                slot_mapping=self.slots[: bs * q],
                graphed=True,
            )
        )

    def _forward_verify(self, bs: int, q: int) -> torch.Tensor:
        t = bs * q
        static = (self.input_ids, self.positions, self.slots, self.verify_cu, self.kv_lens,
                  self.page_table)  # fmt: skip
        fill_verify_inputs(self.verify_block, self.sampled, self.drafts, static, bs, t)
        hidden = self.model(self.input_ids[:t], self.positions[:t], self.attention)
        assert self.verify_hidden is not None
        return self.verify_hidden[:t].copy_(hidden)

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
                graphed=True,
            )
        )

    def _forward_prefill(self, t: int) -> torch.Tensor:
        _, row, _, ids, positions, _, _ = self._prefill_views(t)
        hidden = self.model(ids, positions, self.attention)
        return self.model.compute_logits(hidden[row]) if self.with_logits else hidden

    def padded_size(self, batch: int) -> int:
        """The smallest ladder size that holds `batch` sequences (its graph may be pending)."""
        return _fitting(self.sizes, batch)

    def serves_decode(self, batch: int) -> bool:
        """Whether a decode batch of `batch` sequences has a graph: its size's (a larger
        captured one while that one is pending would compute more rows than planned)."""
        return batch <= self.max_bs and self.padded_size(batch) in self.graphs

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

    def verify_key(self, batch: int, max_query_len: int) -> tuple[int, int] | None:
        """The verify graph (rows, tokens per row) for `batch` rows of at most `max_query_len`
        query tokens, or None when none was captured."""
        if batch > self.max_bs or max_query_len < 2:
            return None
        key = (self.padded_size(batch), max_query_len)
        return key if key in self.verify_graphs else None

    def pack_verify(
        self, key: tuple[int, int], ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
        query_lens: np.ndarray, kv_lens: np.ndarray, page_table: np.ndarray,
        input_src: np.ndarray, draft_src: np.ndarray,
    ) -> np.ndarray:  # fmt: skip
        """A verify batch's inputs laid out as `verify_block` for the graph `key`, to be copied
        there in one piece before `run_verify`."""
        bs, q = key
        return pack_verify_inputs(ids, positions, slots, query_lens, kv_lens, page_table,
                                  input_src, draft_src, bs, bs * q)  # fmt: skip

    def run_verify(self, key: tuple[int, int], num_tokens: int) -> torch.Tensor:
        """Hidden states `[T, H]` of a verify batch of T tokens whose inputs, packed for the
        graph `key`, are in `verify_block`; the batch's input ids are `input_ids[:T]`."""
        self.verify_graphs[key].replay()
        assert self.verify_hidden is not None
        return self.verify_hidden[:num_tokens]

    def serves_prefill(self, num_tokens: int, num_pages: int) -> bool:
        """Whether a one-sequence prefill of `num_tokens` new tokens over `num_pages` pages of
        context has a graph."""
        return (
            1 < num_tokens <= self.max_prefill
            and num_pages <= self.page_table.shape[1]
            and _fitting(self.prefill_sizes, num_tokens) in self.prefill_graphs
        )

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


class DraftLoopGraphs:
    """Greedy drafting as one CUDA graph per padded batch size: k decode steps of a draft
    model, each step's argmax the next step's input, the drafts written to `drafts` (row-major,
    `[rows, k]`: drafting row i's draft j at `i * k + j`).

    Its packed block: each row's number of drafts (`max_bs` entries, 0 past the batch), then
    the first step's decode block (`pack_decode_inputs`: each row's newest token, or where it is
    unread its entry of `sampled`; its position, slot, KV length and pages). Each later step
    moves the rows one position on, on the device; a row whose drafts are done writes no more
    K/V and attends to nothing (its drafts past its count are never read).
    """

    def __init__(
        self,
        model: nn.Module,
        attention: AttentionBackend,
        max_bs: int,
        max_pages_per_seq: int,
        page_size: int,
        k: int,
        device: torch.device,
        sampled: torch.Tensor,
        drafts: torch.Tensor,
    ) -> None:
        if drafts.numel() < max_bs * k:
            raise ValueError(f"a drafts buffer of {drafts.numel()} < {max_bs} x {k} entries")
        self.model, self.attention, self.sampled, self.drafts = model, attention, sampled, drafts
        self.sizes = batch_size_ladder(max_bs)
        self.max_bs, self.page_size, self.k = max_bs, page_size, k

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.kv_lens = zeros(max_bs), zeros(max_bs), zeros(max_bs)
        self.slots = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.page_table = zeros(max_bs, max_pages_per_seq)
        self.cu = torch.arange(max_bs + 1, dtype=torch.int64, device=device)
        self.block = zeros(max_bs + decode_block_size(max_bs, max_pages_per_seq))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per ladder size, largest first (log the total time)."""
        start = time.perf_counter()
        for bs in reversed(self.sizes):
            self.graphs[bs] = self._capture(partial(self._plan, bs), partial(self._forward, bs))
        logger.info(
            "captured %d draft-loop CUDA graphs (%d draft steps each) in %.1f s",
            len(self.sizes), self.k, time.perf_counter() - start,
        )  # fmt: skip

    def _capture(
        self, plan: Callable[[], None], forward: Callable[[], None]
    ) -> torch.cuda.CUDAGraph:
        graph, _ = _capture_graph(plan, forward, self._pool)
        self._pool = graph.pool()
        return graph

    def _plan(self, bs: int) -> None:
        _plan_decode(self.attention, bs, self.cu, self.kv_lens, self.page_table, self.slots)

    def _forward(self, bs: int) -> None:
        static = (self.input_ids, self.positions, self.slots, self.kv_lens, self.page_table)
        fill_decode_inputs(self.block[self.max_bs :], self.sampled, static, bs)
        counts = self.block[:bs]
        ids, positions, slots, kv_lens = (t[:bs] for t in static[:4])
        table = self.page_table[:bs]
        drafts = self.drafts[: self.max_bs * self.k].view(self.max_bs, self.k)[:bs]
        ps, last_page = self.page_size, self.page_table.shape[1] - 1
        for j in range(self.k):
            hidden = self.model(ids, positions, self.attention)
            logits = self.model.compute_logits(hidden)
            token = argmax_rows(logits) if logits.is_cuda else logits.argmax(dim=-1)
            drafts[:, j] = token
            if j + 1 == self.k:
                break
            ids.copy_(token)
            positions.add_(1)
            active = counts > j + 1
            page = table.gather(1, (positions // ps).clamp(max=last_page)[:, None])[:, 0]
            slots.copy_(torch.where(active, page * ps + positions % ps, -1))
            kv_lens.copy_(torch.where(active, positions + 1, 0))

    def pack(
        self, newest: np.ndarray, newest_src: np.ndarray, positions: np.ndarray,
        num_drafts: np.ndarray, page_table: np.ndarray,
    ) -> np.ndarray:  # fmt: skip
        """The block of B drafting rows: newest token ids (or `newest_src` >= 0: entries of
        `sampled`), their positions, drafts per row and pages; copied to `block` before `run`."""
        batch = len(newest)
        padded = _fitting(self.sizes, batch)
        ps = self.page_size
        slots = page_table[np.arange(batch), positions // ps] * ps + positions % ps
        first = pack_decode_inputs(newest, positions, slots, positions + 1, page_table,
                                   newest_src, padded)  # fmt: skip
        counts = np.zeros(self.max_bs, dtype=np.int64)
        counts[:batch] = num_drafts
        return np.concatenate([counts, first])

    def run(self, batch: int) -> None:
        """Draft for the `batch` rows packed in `block`: `drafts[: batch * k]` afterwards."""
        self.graphs[_fitting(self.sizes, batch)].replay()
