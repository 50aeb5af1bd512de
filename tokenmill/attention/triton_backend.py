"""The Triton attention backend (default on CUDA): paged varlen prefill and split-KV decode."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionInputs, QKNorm
from tokenmill.attention.dense_rows import (
    DENSE_MIN_Q_LEN,
    DenseRefused,
    DenseRow,
    build_dense_graph,
    dense_attend,
    dense_lengths,
    dense_supported,
    plan_dense_rows,
    spare_rows,
    whole_prompt,
)
from tokenmill.cache.kv_cache import KVCache
from tokenmill.config import ModelConfig
from tokenmill.kernels.attention import (
    MAX_SPLITS_BLOCK,
    decode_attention,
    invariant_attention,
    invariant_scratch,
    prefill_attention,
    prefill_tiles,
    sm_count,
    verify_attention,
)
from tokenmill.kernels.rope_store import rope_and_store
from tokenmill.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

# Decode splits each context into at most this many chunks, processed in parallel and merged
# (the merge kernel's block: one compile serves every count).
MAX_DECODE_SPLITS = MAX_SPLITS_BLOCK
# Enough split-decode programs for this many per SM: below, the GPU's bandwidth is not used.
PROGRAMS_PER_SM = 4
# Batches whose sequences have at most this many query tokens each (speculative verify steps
# of k <= 7, small prefill chunks) attend split-KV (`verify_attention`), not as a prefill, as
# long as a program's accumulator (query tokens x the KV head's query heads rows, head_dim
# columns, float32, in registers) holds at most VERIFY_MAX_ACC values (64 rows of 128).
VERIFY_MAX_Q_LEN = 8
VERIFY_MAX_ACC = 64 * 128


def decode_splits(device: torch.device, batch: int, num_kv_heads: int) -> int:
    """How many splits decode attention cuts each context into, for `batch` sequences.

    A small batch needs splits to give every SM work; a large one has a program per (sequence,
    KV head) to spare, and each split more only adds a partial result to write and merge (at
    batch 256 of Qwen3-0.6B, 16 splits spent 16x the bytes of the output on partials). The
    count depends on the batch only, so a CUDA graph (one per batch size) serves every context
    length. Off a GPU (Triton's interpreter runs programs one after another) one split.
    """
    if device.type != "cuda":
        return 1
    wanted = PROGRAMS_PER_SM * sm_count(device)
    return max(1, min(MAX_DECODE_SPLITS, -(-wanted // (batch * num_kv_heads))))


def verifies_split_kv(max_q_len: int, group: int, head_dim: int) -> bool:
    """Whether a batch of at most `max_q_len` query tokens per sequence attends through
    `verify_attention`, for models with `group` query heads per KV head of `head_dim`."""
    return max_q_len <= VERIFY_MAX_Q_LEN and max_q_len * group * head_dim <= VERIFY_MAX_ACC


class FusedStoreBackend(AttentionBackend):
    """Backends whose `store_qkv` is the fused Triton kernel (q/k norm, rotary, K/V store);
    `plan` must keep the step's inputs as `self._inputs`, and may set `self._fresh` (`[2,
    T + spare, Hkv, D]`: the step's K and V are written there by token too, and q gets the
    same spare rows of storage past T)."""

    _inputs: AttentionInputs
    _fresh: torch.Tensor | None = None

    def _cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.model
        return (
            self.kv_cache.k[layer].view(-1, cfg.num_kv_heads, cfg.head_dim),
            self.kv_cache.v[layer].view(-1, cfg.num_kv_heads, cfg.head_dim),
        )

    def store_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        layer: int,
        rotary: RotaryEmbedding,
        qk_norm: QKNorm | None,
    ) -> torch.Tensor:
        cfg = self.model
        k_cache, v_cache = self._cache(layer)
        norm = None
        if qk_norm is not None:
            norm = (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
        fresh, spare = None, 0
        if self._fresh is not None:
            fresh, spare = (self._fresh[0], self._fresh[1]), self._fresh.shape[1] - qkv.shape[0]
        return rope_and_store(
            qkv, positions, self._inputs.slot_mapping, rotary.cos, rotary.sin, k_cache, v_cache,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, norm, fresh, spare,
            1 if self.deterministic else None,
        )  # fmt: skip


class TritonAttentionBackend(FusedStoreBackend):
    """Decode batches use split-KV decode; batches of at most VERIFY_MAX_Q_LEN query tokens per
    sequence (within VERIFY_MAX_ACC accumulator values per program) split-KV verify attention;
    the rest the prefill kernel, but for whole long prompts, which go through cuDNN's dense
    causal attention where it serves the device (`dense_rows`; not inside CUDA graphs, not in
    deterministic mode, not with a sliding window). Deterministic mode runs every batch through
    `invariant_attention`, decode batches too small to fill the GPU with each part of the
    context in a program of its own."""

    def __init__(
        self, model: ModelConfig, kv_cache: KVCache, max_num_seqs: int, deterministic: bool = False
    ) -> None:
        super().__init__(model, kv_cache, max_num_seqs, deterministic)
        device = kv_cache.k[0].device
        # Scratch for the most partial results of any batch size (viewed per batch in `attend`):
        # a verify batch of b sequences has up to VERIFY_MAX_Q_LEN query tokens each.
        most = max(
            b * VERIFY_MAX_Q_LEN * decode_splits(device, b, model.num_kv_heads)
            for b in range(1, max_num_seqs + 1)
        )
        self._mid_o = torch.empty(most * model.num_heads * model.head_dim, dtype=torch.float32,
                                  device=device)  # fmt: skip
        self._mid_lse = torch.empty(most * model.num_heads, dtype=torch.float32, device=device)
        # A prefill batch's short rows (decodes, verifies, short chunks) attend as in a verify
        # step, a program per KV head, not as a prefill tile per query head each. The bound is
        # the model's, not the batch's: each value would be a kernel of its own, compiled by the
        # first mixed batch that needed it (seconds of a serving run).
        group = model.num_heads // model.num_kv_heads
        fits = [
            q for q in range(1, VERIFY_MAX_Q_LEN + 1) if verifies_split_kv(q, group, model.head_dim)
        ]
        self._short_q_len = max(fits, default=0)
        self._dense_ok = (
            not deterministic
            and model.sliding_window is None
            and dense_supported(device, model.dtype, model.head_dim)
        )
        self._dense: list[DenseRow] = []
        # the stream the short rows of a step with dense rows run on (`_beside`), the event it
        # waits on and the one that marks their end (on a GPU)
        self._side: tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event] | None = None
        if device.type == "cuda":
            self._side = (torch.cuda.Stream(device), torch.cuda.Event(), torch.cuda.Event())
        # Deterministic decode batches split while one program per (sequence, KV head) would
        # leave most SMs idle.
        self._split_seqs = 0
        self._invariant_scratch = None
        if deterministic and device.type == "cuda":
            self._split_seqs = min(max_num_seqs, sm_count(device) // model.num_kv_heads)
            self._invariant_scratch = invariant_scratch(
                self._split_seqs, model.num_heads, model.head_dim, device
            )

    def plan(self, inputs: AttentionInputs) -> None:
        self._inputs = inputs
        self._decode = inputs.is_decode
        lens = inputs.query_lens_cpu
        self._max_q_len = max(lens)
        cfg = self.model
        group = cfg.num_heads // cfg.num_kv_heads
        self._verify = not self._decode and verifies_split_kv(self._max_q_len, group, cfg.head_dim)
        long = [q for q in lens if q > self._short_q_len]
        # (no launch for short rows in a batch without any)
        self._short_rows = self._short_q_len if len(long) < len(lens) else 0
        self._dense, self._fresh = [], None
        self._dense_min = self._dense_bound()
        if self._dense_ok and long and not (self._decode or self._verify or inputs.graphed):
            self._plan_dense(inputs)
        # the Triton kernel's rows, the dense ones left out: its longest, and its tiles (by the
        # rows it attends: a tile the warm-up never built would compile inside a step)
        self._triton_q_len = self._max_q_len
        if self._dense:
            pairs = zip(lens, inputs.kv_lens_cpu, strict=True)
            rest = [q for q, kv in pairs if not whole_prompt(q, kv, self._dense_min)]
            self._triton_q_len = max(rest, default=0)
            long = [q for q in rest if q > self._short_q_len]
        self._tiles = prefill_tiles(long or lens, cfg.head_dim, cfg.dtype.itemsize)

    def _plan_dense(self, inputs: AttentionInputs) -> None:
        """The step's dense rows, and the buffer their K/V are read from (its rows past the
        step's tokens zeroed: a padded row's keys there meet a zero probability)."""
        self._dense = plan_dense_rows(inputs, self._dense_min)
        if not self._dense:
            return
        cfg, tokens = self.model, sum(inputs.query_lens_cpu)
        spare = spare_rows(self._dense, tokens)
        shape = (2, tokens + spare, cfg.num_kv_heads, cfg.head_dim)
        self._fresh = torch.empty(shape, dtype=cfg.dtype, device=inputs.slot_mapping.device)
        self._fresh[:, tokens:].zero_()

    def graph_safe(self) -> bool:
        return True

    def prefill_graph_safe(self) -> bool:
        return True  # the prefill kernel's programs past a sequence's query length return

    def prebuild_lengths(self, max_tokens: int) -> list[int]:
        # cuDNN's graphs of the dense rows' lengths: ~65 ms each at its first use
        if not self._dense_ok:
            return []
        return dense_lengths(self._dense_bound(), max_tokens)

    def _dense_bound(self) -> int:
        """The fewest query tokens of a dense row: DENSE_MIN_Q_LEN, above the short rows'
        bound (the short rows' launch attends every row within it)."""
        return max(DENSE_MIN_Q_LEN, self._short_q_len + 1)

    def prebuild(self, length: int) -> None:
        if not self._dense_ok:
            return  # (a build refused before)
        cfg = self.model
        try:
            build_dense_graph(
                length, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                self.kv_cache.k[0].device, self.scale,
            )  # fmt: skip
        except DenseRefused as exc:
            self._dense_failed(exc)

    def whole_prompt_min_tokens(self) -> int:
        return self._dense_bound() if self._dense_ok else 0

    def attend(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        k_cache, v_cache = self._cache(layer)
        inputs, ps, window = self._inputs, self.kv_cache.page_size, self.model.sliding_window
        if self.deterministic:
            split = self._decode and inputs.kv_lens.shape[0] <= self._split_seqs
            return invariant_attention(
                q, k_cache, v_cache, inputs.cu_query_lens, inputs.kv_lens, inputs.page_table,
                self._max_q_len, ps, self.scale, window,
                self._invariant_scratch if split else None,
            )  # fmt: skip
        if self._decode:
            mid_o, mid_lse = self._scratch(q, q.shape[0])
            return decode_attention(
                q, k_cache, v_cache, inputs.kv_lens, inputs.page_table, ps, self.scale, window,
                mid_o, mid_lse,
            )  # fmt: skip
        if self._verify:
            mid_o, mid_lse = self._scratch(q, inputs.kv_lens.shape[0])
            return verify_attention(
                q, k_cache, v_cache, inputs.cu_query_lens, inputs.kv_lens, inputs.page_table,
                self._max_q_len, ps, self.scale, window, mid_o, mid_lse,
            )  # fmt: skip
        out = torch.empty_like(q)
        prefill = functools.partial(
            prefill_attention, q, k_cache, v_cache, inputs.cu_query_lens, inputs.kv_lens,
            inputs.page_table, page_size=ps, scale=self.scale, window=window, tiles=self._tiles,
            short_q_len=self._short_rows, out=out,
        )  # fmt: skip
        if not self._dense:
            return prefill(max_q_len=self._max_q_len)
        # The short rows (a mixed step's decode rows: K/V streamed at the copy rate) on a side
        # stream, beside cuDNN's dense rows (at the matmul rate): each fills SMs the other's
        # tail leaves idle (docs/perf-notes.md, session 31).
        join = self._beside(
            functools.partial(prefill, max_q_len=self._max_q_len, launches="short")
        ) if self._short_rows else None  # fmt: skip
        dense = self._attend_dense(q, out)
        prefill(
            max_q_len=self._triton_q_len if dense else self._max_q_len,
            dense_min_len=self._dense_min if dense else 0, launches="long",
        )  # fmt: skip
        if join is not None:
            join()
        return out

    def _beside(self, launch: Callable[[], object]) -> Callable[[], None] | None:
        """Run `launch` on the side stream, after what the current stream has queued; a
        function that makes the current stream wait for it (call it before reading the
        result), or None off a GPU, where `launch` runs in line. (Streams and events are
        switched and recorded directly: torch's stream context and current-stream lookups
        took ~20 us a layer of the host's time.)"""
        if self._side is None:
            launch()
            return None
        side, forked, joined = self._side
        main = torch.cuda.current_stream(side.device)
        forked.record(main)
        side.wait_event(forked)
        torch.cuda.set_stream(side)
        try:
            launch()
        finally:
            torch.cuda.set_stream(main)
        joined.record(side)
        return functools.partial(main.wait_event, joined)

    def _attend_dense(self, q: torch.Tensor, out: torch.Tensor) -> bool:
        """Write the step's dense rows into `out`; False if cuDNN refused them (a shape or
        version it does not serve, its workspace out of memory): then, with a warning, no row
        is dense from now on and the Triton kernel attends them all."""
        assert self._fresh is not None
        try:
            dense_attend(self._dense, q, self._fresh[0], self._fresh[1], out, self.scale)
        except DenseRefused as exc:
            self._dense_failed(exc)
            return False
        return True

    def _dense_failed(self, exc: DenseRefused) -> None:
        logger.warning(
            "cuDNN's dense attention failed (%s); whole long prompts attend through the "
            "Triton prefill kernel from now on", exc,
        )  # fmt: skip
        self._dense_ok, self._dense, self._fresh = False, [], None

    def _scratch(self, q: torch.Tensor, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Split-KV partial outputs and log-sum-exps for the query tokens of `q`, with the
        split count of a batch of `num_seqs` sequences."""
        cfg = self.model
        shape = (q.shape[0], cfg.num_heads, decode_splits(q.device, num_seqs, cfg.num_kv_heads))
        mid_lse = self._mid_lse[: math.prod(shape)].view(shape)
        mid_o = self._mid_o[: math.prod(shape) * cfg.head_dim].view(*shape, cfg.head_dim)
        return mid_o, mid_lse
