"""ModelRunner: lays out a scheduled batch as flat tensors, runs the model, samples."""

from __future__ import annotations

import logging

import numpy as np
import torch

from tokenmill.attention.backend import AttentionInputs, create_backend
from tokenmill.cache.kv_cache import KVCache
from tokenmill.config import EngineConfig
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.models.loader import load_model
from tokenmill.runner.sampler import Sampler, SamplerOutput, SamplingBatch

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 2 << 30
GPU_MEMORY_UTILIZATION = 0.9


class ModelRunner:
    """Owns the model weights, the KV cache tensors, the attention backend and the sampler."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.model = load_model(config.model, self.device, config.load_format, config.seed)
        self.page_size = config.cache.page_size
        self.num_pages = self._num_pages()
        self.kv_cache = KVCache.allocate(config.model, self.num_pages, self.page_size, self.device)
        self.attention = create_backend(config.attention_backend, config.model, self.kv_cache)
        self.sampler = Sampler(self.device, config.seed)
        self.num_forward_tokens = 0
        logger.info(
            "model %s on %s: KV cache of %d pages x %d tokens",
            config.model.architecture,
            self.device,
            self.num_pages,
            self.page_size,
        )

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
    def execute(self, batch: SchedulerOutput) -> SamplerOutput:
        """Run one forward pass over `batch` and sample a token for each sequence that needs one."""
        input_ids, positions, attn_inputs, logits_index = self._prepare(batch)
        self.attention.plan(attn_inputs)
        hidden = self.model(input_ids, positions, self.attention)
        self.num_forward_tokens += input_ids.numel()
        sampling_reqs = [s.request for s in batch.seqs if s.samples]
        if not sampling_reqs:
            return SamplerOutput(token_ids=[], logprobs=[])
        logits = self.model.compute_logits(hidden[logits_index])
        sampling = SamplingBatch.from_requests(
            sampling_reqs, self.config.model.vocab_size, self.device
        )
        return self.sampler(logits, sampling)

    def _prepare(
        self, batch: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs, torch.Tensor]:
        seqs = batch.seqs
        ps = self.page_size
        tokens: list[int] = []
        for s in seqs:
            start = s.request.num_computed_tokens
            tokens.extend(s.request.token_slice(start, start + s.num_new_tokens))
        q_lens = np.array([s.num_new_tokens for s in seqs], dtype=np.int64)
        kv_lens = np.array(
            [s.request.num_computed_tokens + s.num_new_tokens for s in seqs], dtype=np.int64
        )
        cu = np.concatenate(([0], np.cumsum(q_lens)))
        seq_of_token = np.repeat(np.arange(len(seqs)), q_lens)
        positions = np.arange(cu[-1]) - cu[seq_of_token] + (kv_lens - q_lens)[seq_of_token]
        max_pages = int(-(-kv_lens.max() // ps))
        page_table = np.zeros((len(seqs), max_pages), dtype=np.int64)
        for i, s in enumerate(seqs):
            pages = s.request.page_ids[:max_pages]
            page_table[i, : len(pages)] = pages
        slots = page_table[seq_of_token, positions // ps] * ps + positions % ps
        logits_index = np.array([cu[i + 1] - 1 for i, s in enumerate(seqs) if s.samples])

        def to_device(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        attn = AttentionInputs(
            query_lens_cpu=q_lens.tolist(),
            kv_lens_cpu=kv_lens.tolist(),
            kv_lens=to_device(kv_lens),
            page_table=to_device(page_table),
            slot_mapping=to_device(slots),
        )
        return (
            to_device(np.array(tokens, dtype=np.int64)),
            to_device(positions),
            attn,
            to_device(logits_index.astype(np.int64)),
        )
