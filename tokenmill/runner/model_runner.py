"""ModelRunner: lays out a scheduled batch as flat tensors, runs the model, samples."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.attention.backend import AttentionInputs, create_backend
from tokenmill.batch import SchedulerOutput
from tokenmill.cache.kv_cache import KVCache
from tokenmill.config import EngineConfig
from tokenmill.layers.linear import choose_gemv_kernels
from tokenmill.models.loader import load_model
from tokenmill.runner.sampler import SampledTokens, Sampler, SamplerOutput, SamplingBatch

if TYPE_CHECKING:
    from tokenmill.runner.cuda_graphs import CudaGraphRunner

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 2 << 30
GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class HostBatch:
    """A step's inputs as host arrays: the flattened tokens and each sequence's place."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T] KV-cache slot each token writes
    query_lens: np.ndarray  # [B]
    kv_lens: np.ndarray  # [B]
    page_table: np.ndarray  # [B, W] pages of each sequence, W = most pages any one needs
    logits_index: np.ndarray  # [S] rows whose last token is sampled
    pending_dst: np.ndarray  # [P] input positions whose token the previous step sampled...
    pending_src: np.ndarray  # [P] ...and its row in that step's sampled tokens

    @property
    def is_decode(self) -> bool:
        return len(self.input_ids) == len(self.kv_lens)


class LaunchedStep:
    """A queued forward pass: its sampled tokens and its GPU time, readable once it is done."""

    def __init__(self, device: torch.device) -> None:
        self.sampled: SampledTokens | None = None
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start, self._end = torch.cuda.Event(True), torch.cuda.Event(True)
            self._start.record()
        else:
            self._t0, self._elapsed = time.perf_counter(), 0.0

    def forward_done(self) -> None:
        if self._cuda:
            self._end.record()
        else:
            self._elapsed = time.perf_counter() - self._t0

    def read(self) -> SamplerOutput | None:
        """Wait for the step and return its sampled tokens (None if nothing was sampled)."""
        if self.sampled is not None:
            return self.sampled.to_host()
        if self._cuda:
            self._end.synchronize()
        return None

    def forward_seconds(self) -> float:
        """Device time of the forward pass and sampling (call after `read`)."""
        return self._start.elapsed_time(self._end) / 1e3 if self._cuda else self._elapsed


class ModelRunner:
    """Owns the model weights, the KV cache tensors, the attention backend and the sampler."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.model = load_model(config.model, self.device, config.load_format, config.seed)
        self.page_size = config.cache.page_size
        self.num_pages = self._num_pages()
        self.kv_cache = KVCache.allocate(config.model, self.num_pages, self.page_size, self.device)
        max_seqs = config.scheduler.max_num_seqs
        self.attention = create_backend(
            config.attention_backend, config.model, self.kv_cache, max_seqs
        )
        self.sampler = Sampler(self.device, config.seed)
        self.num_forward_tokens = 0
        # Two pinned staging buffers, used in turn: with overlap scheduling the host fills one
        # while the previous step's copy from the other may still be queued on the GPU.
        self._staging = [torch.empty(0, dtype=torch.int64) for _ in range(2)]
        self._step_parity = 0
        # The last launched step's sampled tokens (on the device) and each request's row there.
        # With CUDA graphs the sampler writes them into one static buffer the graphs read.
        self._last_tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        self._last_rows: dict[str, int] = {}
        self._tokens: torch.Tensor | None = None
        logger.info(
            "model %s on %s (%s attention): KV cache of %d pages x %d tokens",
            config.model.architecture,
            self.device,
            config.attention_backend,
            self.num_pages,
            self.page_size,
        )
        self.graphs: CudaGraphRunner | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            if not self.attention.graph_safe():
                raise ValueError(
                    f"attention_backend {config.attention_backend!r} cannot run in CUDA graphs; "
                    "use enforce_eager=True"
                )
            chosen = choose_gemv_kernels(self.model)
            logger.info("GEMV kernel chosen over cuBLAS for %d (layer, row bucket) pairs", chosen)
            max_pages = -(-config.max_model_len // self.page_size)
            max_bs = min(config.cuda_graph_max_bs, max_seqs)
            max_prefill = min(
                config.cuda_graph_max_prefill_tokens, config.scheduler.max_num_batched_tokens
            )
            # Imported here: CUDA graphs need triton, which CPU-only installs may lack.
            from tokenmill.runner.cuda_graphs import CudaGraphRunner

            self._tokens = torch.zeros(max_seqs, dtype=torch.int64, device=self.device)
            self.graphs = CudaGraphRunner(
                self.model, self.attention, max_bs, max_pages, self.device, self._tokens,
                max_prefill,
            )  # fmt: skip
            self.graphs.capture()

    def _num_pages(self) -> int:
        cfg = self.config
        per_page = KVCache.bytes_per_page(cfg.model, self.page_size)
        if cfg.cache.num_pages is not None:
            pages = cfg.cache.num_pages
        elif cfg.cache.kv_cache_memory_bytes is not None:
            pages = cfg.cache.kv_cache_memory_bytes // per_page
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            pages = int(free * GPU_MEMORY_UTILIZATION) // per_page
        else:
            full = cfg.scheduler.max_num_seqs * -(-cfg.max_model_len // self.page_size)
            pages = min(full, CPU_KV_CACHE_BYTES // per_page)
        if pages * self.page_size < cfg.max_model_len:
            raise ValueError(
                f"the KV cache ({pages} pages of {self.page_size} tokens) cannot hold one sequence "
                f"of max_model_len={cfg.max_model_len} tokens; raise num_pages or "
                "kv_cache_memory_bytes, or lower max_model_len"
            )
        return pages

    @torch.inference_mode()
    def launch(self, batch: SchedulerOutput) -> LaunchedStep:
        """Queue one forward pass over `batch` and the sampling of each sequence that needs a token.

        Nothing waits for the GPU: a token the previous step sampled and the host has not seen
        yet is read on the device.
        """
        launched = LaunchedStep(self.device)
        host = self._prepare(batch)
        self.num_forward_tokens += len(host.input_ids)
        graphs = self.graphs
        if graphs is not None and host.is_decode and len(host.kv_lens) <= graphs.max_bs:
            logits = self._run_graph(host)
        elif graphs is not None and self._prefill_graph_serves(host, graphs):
            block = graphs.pack_prefill(
                host.input_ids, host.positions, host.slots, int(host.kv_lens[0]),
                host.page_table[0],
            )  # fmt: skip
            self._upload(block, graphs.prefill_block)
            logits = graphs.run_prefill(len(host.input_ids))
        else:
            logits = self._run_eager(host)
        sampling_reqs = [s.request for s in batch.seqs if s.samples]
        if sampling_reqs:
            sampling = SamplingBatch.from_requests(
                sampling_reqs, self.config.model.vocab_size, self.device
            )
            out = self._tokens[: len(sampling_reqs)] if self._tokens is not None else None
            sampled = self.sampler(logits, sampling, out)
            sampled.start_copy()
            self._last_tokens = sampled.token_ids
            self._last_rows = {r.request_id: row for row, r in enumerate(sampling_reqs)}
            launched.sampled = sampled
        launched.forward_done()
        return launched

    def _run_graph(self, host: HostBatch) -> torch.Tensor:
        """A decode batch through its CUDA graph; returns the sampling rows' logits."""
        assert self.graphs is not None
        batch = len(host.kv_lens)
        # Token i of a decode batch is row i; -1: the id is known on the host.
        row_src = np.full(batch, -1, dtype=np.int64)
        row_src[host.pending_dst] = host.pending_src
        block = self.graphs.pack_decode(
            host.input_ids, host.positions, host.slots, host.kv_lens, host.page_table, row_src
        )
        self._upload(block, self.graphs.decode_block)
        logits = self.graphs.run(batch)
        if len(host.logits_index) < batch:  # rare (a 1-token prefill chunk); pageable copy
            index = torch.from_numpy(host.logits_index).to(self.device, non_blocking=True)
            logits = logits[index]
        return logits

    @staticmethod
    def _prefill_graph_serves(host: HostBatch, graphs: CudaGraphRunner) -> bool:
        """One sequence's prefill, every input token known on the host, with a graph."""
        one = len(host.kv_lens) == 1 and len(host.pending_dst) == 0
        return one and graphs.serves_prefill(len(host.input_ids), host.page_table.shape[1])

    def _run_eager(self, host: HostBatch) -> torch.Tensor:
        """Any batch, layer by layer; returns the sampling rows' logits."""
        ids, positions, slots, q_lens, kv_lens, table, logits_index, dst, src = self._to_device(
            host.input_ids, host.positions, host.slots, host.query_lens, host.kv_lens,
            host.page_table, host.logits_index, host.pending_dst, host.pending_src,
        )  # fmt: skip
        if len(dst):
            ids[dst] = self._last_tokens[src]
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(q_lens, 0, out=cu[1:])
        self.attention.plan(
            AttentionInputs(
                query_lens_cpu=host.query_lens.tolist(),
                kv_lens_cpu=host.kv_lens.tolist(),
                cu_query_lens=cu,
                kv_lens=kv_lens,
                page_table=table,
                slot_mapping=slots,
            )
        )
        hidden = self.model(ids, positions, self.attention)
        return self.model.compute_logits(hidden[logits_index])

    def _prepare(self, batch: SchedulerOutput) -> HostBatch:
        seqs = batch.seqs
        ps = self.page_size
        tokens: list[int] = []
        dst: list[int] = []
        src: list[int] = []
        for s in seqs:
            known = s.request.token_slice(s.start, s.start + s.num_new_tokens)
            if len(known) < s.num_new_tokens:  # its last input is the in-flight sampled token
                dst.append(len(tokens) + len(known))
                src.append(self._last_rows[s.request.request_id])
                known.append(0)
            tokens.extend(known)
        q_lens = np.array([s.num_new_tokens for s in seqs], dtype=np.int64)
        kv_lens = np.array([s.start + s.num_new_tokens for s in seqs], dtype=np.int64)
        cu = np.concatenate(([0], np.cumsum(q_lens)))
        seq_of_token = np.repeat(np.arange(len(seqs)), q_lens)
        positions = np.arange(cu[-1]) - cu[seq_of_token] + (kv_lens - q_lens)[seq_of_token]
        width = int(-(-kv_lens.max() // ps))
        page_table = np.zeros((len(seqs), width), dtype=np.int64)
        for i, s in enumerate(seqs):
            pages = s.request.pages.page_ids[:width]
            page_table[i, : len(pages)] = pages
        slots = page_table[seq_of_token, positions // ps] * ps + positions % ps
        logits_index = np.array(
            [cu[i + 1] - 1 for i, s in enumerate(seqs) if s.samples], dtype=np.int64
        )
        return HostBatch(
            np.array(tokens, dtype=np.int64), positions, slots, q_lens, kv_lens, page_table,
            logits_index, np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64),
        )  # fmt: skip

    def _to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Int64 host arrays in one host→device copy, split back into views of their shapes."""
        flat = self._stage(arrays).to(self.device, non_blocking=True)
        sizes = [a.size for a in arrays]
        return [part.view(a.shape) for part, a in zip(flat.split(sizes), arrays, strict=True)]

    def _upload(self, array: np.ndarray, dst: torch.Tensor) -> None:
        """An int64 host array into the start of the device tensor `dst`, in one copy."""
        dst[: array.size].copy_(self._stage([array]), non_blocking=True)

    def _stage(self, arrays: Sequence[np.ndarray]) -> torch.Tensor:
        """The arrays, flattened one after another into a (pinned, on CUDA) host buffer; two
        buffers are used in turn, so this step's copy never overwrites one still queued."""
        total = sum(a.size for a in arrays)
        self._step_parity ^= 1
        buffer = self._staging[self._step_parity]
        if buffer.numel() < total:
            buffer = torch.empty(max(total, 2 * buffer.numel()), dtype=torch.int64)
            if self.device.type == "cuda":
                buffer = buffer.pin_memory()
            self._staging[self._step_parity] = buffer
        staging = buffer.numpy()
        offset = 0
        for a in arrays:
            staging[offset : offset + a.size] = a.reshape(-1)
            offset += a.size
        return buffer[:total]
