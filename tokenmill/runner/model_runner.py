"""ModelRunner: lays out a scheduled batch as flat tensors, runs the model, samples."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.attention.backend import AttentionBackend, AttentionInputs, create_backend
from tokenmill.batch import Logprob, StepPlan
from tokenmill.cache.kv_cache import KVCache
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.distributed.group import TPGroup
from tokenmill.kernels.gemv_tuning import ShippedChoices
from tokenmill.layers.invariant import configure_invariant_cublas, make_batch_invariant
from tokenmill.layers.linear import choose_gemv_kernels
from tokenmill.models.loader import load_model
from tokenmill.observability.startup import StartupTimer
from tokenmill.runner.host_heap import HeapTrimmer, bound_onednn_cache
from tokenmill.runner.prompt_logprobs import read_scores, score_prompt
from tokenmill.runner.sampler import (
    GrammarMask,
    SampledTokens,
    Sampler,
    SamplerOutput,
    SamplingBatch,
)
from tokenmill.runner.spec_decode import (
    SpecDecoder,
    device_draft_entries,
    device_draft_positions,
    drafting_row_of,
)
from tokenmill.runner.staging import HostStaging
from tokenmill.runner.tp_workers import TPWorkers, rank_device, share_cpu_threads
from tokenmill.tuning_cache import open_tuning_cache

if TYPE_CHECKING:
    from tokenmill.runner.cuda_graphs import CudaGraphRunner, GraphKey
    from tokenmill.runner.encoder_cache import EncoderCache
    from tokenmill.spec.proposer import Drafts

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 2 << 30

# Called once a step's forward pass is queued: reads the previous step's tokens and starts
# filling this step's grammar masks (structured outputs), which its sampling waits for. Its
# argument reads the draft model's drafts of the step (`SpecDecoder.drafts_on_host`; None: the
# step drafts nothing on the device), which the masks of the positions past them follow.
GrammarMasks = Callable[[Callable[[], np.ndarray] | None], "Future[GrammarMask | None]"]


@dataclass(frozen=True)
class HostBatch:
    """A step's inputs as host arrays: the flattened tokens and each sequence's place."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T] rotary positions, or [3, T] multimodal ones (see `lay_out`)
    slots: np.ndarray  # [T] KV-cache slot each token writes
    query_lens: np.ndarray  # [B]
    kv_lens: np.ndarray  # [B]
    page_table: np.ndarray  # [B, W] pages of each sequence, W = most pages any one needs
    logits_index: np.ndarray  # [S] tokens whose logits are sampled
    input_src: np.ndarray  # [T] -1, or the previous step's sampled token that is the input

    @property
    def is_decode(self) -> bool:
        return len(self.input_ids) == len(self.kv_lens)

    @property
    def multimodal(self) -> bool:
        """Some token's rotary positions differ by axis (an image's): eager only."""
        return self.positions.ndim == 2


def lay_out(plan: StepPlan, page_size: int) -> HostBatch:
    """The plan's positions, KV slots and sampled token indices, derived on the host."""
    # (Few numpy calls: with speculative decoding this runs between reading a step and
    # launching the next, where each call costs the GPU microseconds of idling.)
    q_lens, kv_lens, num_samples = plan.query_lens, plan.kv_lens, plan.num_samples
    ends = np.cumsum(q_lens)  # each row's end among the query tokens
    # Row r's query tokens end at position kv_lens[r]: token t is at t + kv_lens[r] - ends[r].
    positions = np.arange(ends[-1]) + np.repeat(kv_lens - ends, q_lens)
    pages, offsets = np.divmod(positions, page_size)
    row_of_token = np.repeat(np.arange(plan.num_rows), q_lens)
    slots = plan.page_table[row_of_token, pages] * page_size + offsets
    # Each row's last `num_samples` tokens, rows in order: row r's sampled entries end at
    # sample_ends[r], its tokens at ends[r].
    sample_ends = np.cumsum(num_samples)
    logits_index = np.arange(sample_ends[-1]) + np.repeat(ends - sample_ends, num_samples)
    if plan.rope_positions is not None:
        # A multimodal model's rotary positions; where all three agree (text tokens) one row
        # of them rotates the same, and the step can run in a CUDA graph.
        rope = plan.rope_positions
        positions = rope[0] if (rope == rope[0]).all() else rope
    return HostBatch(
        plan.input_ids, positions, slots, q_lens, kv_lens, plan.page_table, logits_index,
        plan.input_src,
    )  # fmt: skip


class LaunchedStep:
    """A queued forward pass: its sampled tokens and its GPU time, readable once it is done.

    A step sampling under grammars queues its sampling later (`defer`): when the next step is
    launched, or when it is read, whichever comes first.
    """

    def __init__(self, device: torch.device) -> None:
        self.sampled: SampledTokens | None = None
        # The plan's prompt logprobs (`StepPlan.prompt_logprobs`), on their way to the host.
        self.prompt_scores: list[SampledTokens] = []
        self._deferred: Callable[[], SampledTokens] | None = None
        # Query tokens the forward computes, CUDA graphs' padding included (adaptive
        # speculation measures step costs by it).
        self.num_computed_tokens = 0
        self._cuda = device.type == "cuda"
        self._started = False
        if self._cuda:
            self._start, self._end = torch.cuda.Event(True), torch.cuda.Event(True)
        else:
            self._t0, self._elapsed = time.perf_counter(), 0.0

    def start(self) -> None:
        """Mark where the step's device work begins: called before its first copy or kernel,
        after the host has laid out and packed its inputs. A step read before the next is
        launched runs while the device idles, and adaptive speculation prices a plain one by
        its device time (`spec.adaptive.step_seconds`): counted from the launch, it included
        the host's preparation (estimated ~0.3 ms a step for Qwen3-0.6B at batch 1 on an
        H200, against 0.78 ms of device work; not measured), which can make verifying look
        worth it where it is not. On the CPU the forward
        runs inside the launch, and the time counts from it."""
        if self._cuda and not self._started:
            self._start.record()
        self._started = True

    def forward_done(self) -> None:
        self.start()  # (a step with no device work: none measured)
        if self._cuda:
            self._end.record()
        else:
            self._elapsed = time.perf_counter() - self._t0

    def defer(self, sample: Callable[[], SampledTokens]) -> None:
        """Queue `sample` (this step's sampling) at `complete`."""
        self._deferred = sample

    def complete(self) -> None:
        """Queue the deferred sampling, if any, and mark the step's device work done."""
        if self._deferred is not None:
            sample, self._deferred = self._deferred, None
            self.sampled = sample()
            self.forward_done()

    def read(self) -> SamplerOutput | None:
        """Wait for the step and return its sampled tokens (None if nothing was sampled)."""
        self.complete()
        if self.sampled is not None:
            return self.sampled.to_host()
        if self._cuda:
            self._end.synchronize()
        return None

    def read_prompt_logprobs(self) -> list[dict[int, Logprob]]:
        """Wait for the plan's prompt logprobs: one map per scored position, in the plan's
        order (`PromptLogprobRows`); empty when it scores none."""
        return read_scores(self.prompt_scores)

    def forward_seconds(self) -> float:
        """Device time of the forward pass and sampling (call after `read`); a deferred
        sampling's includes the wait for its grammar masks."""
        return self._start.elapsed_time(self._end) / 1e3 if self._cuda else self._elapsed


def _reclaim_device_memory(device: torch.device) -> None:
    """Give back what engines dropped earlier in this process still hold on `device` (an `LLM`
    per test, a benchmark's plain run before its speculative one): one held by a reference
    cycle waits for the collector, and memory freed into torch's cache is still used as far
    as the driver (and so `_num_pages`) can tell. A fresh process has nothing to give back."""
    if torch.cuda.memory_reserved(device):
        gc.collect()
        torch.cuda.empty_cache()


def _hash_triton_beside() -> threading.Thread | None:
    """Start computing, on a thread of its own, the hash of Triton's own files (its 400 MB
    library included) that keys its kernel cache: 0.3-0.5 s at a process's first kernel,
    which then overlaps the weights' loading (a warm start's `warm_up` phase on the H200:
    0.89 -> 0.59 s, session 25). Returns the thread (join it before the first kernel: the
    hash is cached once computed, but a second caller meanwhile computes it again)."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # a Triton without it: its first kernel computes what it needs
        return None
    thread = threading.Thread(target=triton_key, name="hash-triton", daemon=True)
    thread.start()
    return thread


class ModelRunner:
    """Owns the model weights, the KV cache tensors, the attention backend and the sampler.

    With `tensor_parallel_size` > 1 the engine core's runner is rank 0: it starts the other
    ranks (`TPWorkers`) and sends them each plan it launches; a worker's runner is made with
    its `tp` group and only runs the plans (rank 0 samples, and broadcasts the tokens).
    """

    def __init__(self, config: EngineConfig, tp: TPGroup | None = None) -> None:
        self.config = config
        size = config.parallel.tensor_parallel_size
        self.device = rank_device(config, tp.rank if tp is not None else 0)
        # Seconds of each start-up phase, device work included (the engine core reports them).
        sync = partial(torch.cuda.synchronize, self.device) if self.device.type == "cuda" else None
        self.startup = StartupTimer(sync)
        self.workers: TPWorkers | None = None
        if tp is None and size > 1:
            with self.startup.phase("tensor_parallel_workers"):
                level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
                self.workers = TPWorkers(config, level)
                self.workers.connect()
                tp = TPGroup.join(0, size, self.workers.store, self.device)
        self.tp = tp or TPGroup.single()
        if self.device.type == "cpu" and self.tp.size > 1:
            logger.info("rank %d computes on %d threads", self.tp.rank, share_cpu_threads(size))
        # A CPU process's native caches, bounded (`host_heap`): oneDNN's before its first
        # matmul, the C heap trimmed as steps launch.
        self._trim_heap: HeapTrimmer | None = None
        if self.device.type == "cpu":
            bound_onednn_cache()
            self._trim_heap = HeapTrimmer()
        deterministic = config.runner.deterministic
        if deterministic and self.device.type == "cuda":
            configure_invariant_cublas()  # before this process's first cuBLAS product
        hashing = None
        if self.device.type == "cuda":
            hashing = _hash_triton_beside()
            _reclaim_device_memory(self.device)
        with self.startup.phase("load_weights"):
            self.model = load_model(
                config.model, self.device, config.load_format, config.seed, self.tp
            )
        if deterministic:
            switched = make_batch_invariant(self.model)
            logger.info("deterministic mode: %d layers on batch-invariant paths", switched)
        # This rank's share of the model (`ModelConfig.shard`, as loaded): its heads size the
        # KV cache and the attention.
        self.model_config: ModelConfig = self.model.config
        self.page_size = config.cache.page_size
        with self.startup.phase("kv_cache"):
            self.num_pages = self.tp.min(self._num_pages(), self.device)
            self.num_host_pages = self._num_host_pages()
            self.kv_cache = KVCache.allocate(
                self.model_config, self.num_pages, self.page_size, self.device
            )
        if hashing is not None:  # before the first kernel
            hashing.join()
        max_seqs = config.scheduler.max_num_seqs
        self.attention = create_backend(
            config.runner.attention_backend, self.model_config, self.kv_cache, max_seqs,
            deterministic,
        )  # fmt: skip
        self.sampler = Sampler(self.device, config.seed)
        # Every host→device copy of a step goes through here: one pinned, non-blocking copy.
        self.staging = HostStaging(self.device)
        self.spec: SpecDecoder | None = None
        if config.speculative is not None:
            with self.startup.phase("speculative"):
                self.spec = SpecDecoder(
                    config, self.sampler, self.num_pages, self.device, self.staging,
                    drafts=self.tp.rank == 0,
                )  # fmt: skip
        self.encoder_cache: EncoderCache | None = None
        if config.model.vision is not None:
            from tokenmill.runner.encoder_cache import EncoderCache

            self.encoder_cache = EncoderCache(
                self.model.encode_images, self.device, config.runner.encoder_cache_tokens
            )
        self.num_forward_tokens = 0
        # The last launched step's sampled tokens, on the device: a plan's `input_src` points
        # into them. With CUDA graphs the sampler writes them into one static buffer the graphs
        # read, long enough for one sample per token of a step.
        self._last_tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        # The last launched step, while its sampling waits for grammar masks (LaunchedStep.defer).
        self._deferred: LaunchedStep | None = None
        self._tokens: torch.Tensor | None = None
        logger.info(
            "model %s on %s (%s attention%s): KV cache of %d pages x %d tokens",
            config.model.architecture,
            self.device,
            config.runner.attention_backend,
            f", tensor-parallel rank {self.tp.rank} of {self.tp.size}" if self.tp.size > 1 else "",
            self.num_pages,
            self.page_size,
        )
        self.graphs: CudaGraphRunner | None = None
        if self.device.type == "cuda" and not config.runner.enforce_eager:
            if not self.attention.graph_safe():
                raise ValueError(
                    f"attention_backend {config.runner.attention_backend!r} cannot run in CUDA "
                    "graphs; use enforce_eager=True"
                )
            if not deterministic:  # a GEMV is chosen per row count: not batch-invariant
                with self.startup.phase("gemv_tuning"):
                    cache = open_tuning_cache(config.runner.tuning_cache_dir, self.device)
                    threads = config.runner.tuning_threads
                    shipped = None
                    if config.runner.shipped_tuning:
                        shipped = ShippedChoices.load(torch.cuda.get_device_name(self.device))
                    chosen = choose_gemv_kernels(self.model, cache, threads, shipped)
                logger.info(
                    "GEMV kernel chosen over cuBLAS for %d (layer, row bucket) pairs", chosen
                )
            max_pages = -(-config.max_model_len // self.page_size)
            max_bs = min(config.runner.cuda_graph_max_bs, max_seqs)
            max_prefill = min(
                config.runner.cuda_graph_max_prefill_tokens, config.scheduler.max_num_batched_tokens
            )
            # Imported here: CUDA graphs need triton, which CPU-only installs may lack.
            from tokenmill.runner.cuda_graphs import CudaGraphRunner

            max_samples = config.scheduler.max_num_batched_tokens
            self._tokens = torch.zeros(max_samples, dtype=torch.int64, device=self.device)
            # Verify steps: rows of up to 1 + k tokens, drafts possibly from the draft model.
            k = config.speculative.num_speculative_tokens if config.speculative else 0
            drafts = self.spec.draft_tokens if self.spec is not None else None
            self.graphs = CudaGraphRunner(
                self.model, self.attention, max_bs, max_pages, self.device, self._tokens,
                max_prefill, 1 + k, config.scheduler.max_num_batched_tokens, drafts,
            )  # fmt: skip
            most = min(config.scheduler.max_num_batched_tokens, config.max_model_len)
            backends = {"attention": self.attention}
            if self.spec is not None and self.spec.drafter is not None:
                backends["draft attention"] = self.spec.drafter.attention
            for name, backend in backends.items():
                for length in backend.prebuild_lengths(most):
                    self.graphs.add_pending((name, length), partial(backend.prebuild, length))
            if config.runner.cuda_graph_capture == "startup":
                with self.startup.phase("cuda_graphs"):
                    self.graphs.capture()
                    if self.spec is not None:
                        self.spec.capture_graphs(self.graphs)
        if self.device.type == "cuda":
            with self.startup.phase("warm_up"):
                batches = warm_up_batches(
                    config.scheduler.max_num_batched_tokens, config.max_model_len,
                    config.scheduler.max_num_seqs, self.attention.whole_prompt_min_tokens(),
                )  # fmt: skip
                warm_up(self.model, self.attention, self.page_size, batches, self.device)
                if self.spec is not None and (drafter := self.spec.drafter) is not None:
                    # The draft model mirrors every eager step: its heads, its kernels.
                    warm_up(drafter.model, drafter.attention, self.page_size, batches, self.device)
                self.sampler.warm_up(self.model_config.vocab_size, self.model_config.dtype)

    @property
    def graphs_pending(self) -> int:
        """CUDA graphs not captured yet (background capture)."""
        return self.graphs.pending if self.graphs is not None else 0

    def pending_graph_for(self, plan: StepPlan) -> GraphKey | None:
        """Background capture: the pending graph `plan`'s step would run, or None."""
        if self.graphs is None or not self.graphs.pending or _eager_only(plan):
            return None
        return self.graphs.pending_key(plan.num_rows, plan.query_lens)

    def next_pending_graph(self) -> GraphKey | None:
        """The next CUDA graph to capture in the background, or None."""
        return self.graphs.next_pending() if self.graphs is not None else None

    def capture_pending_graph(self, key: GraphKey) -> None:
        """Capture the pending CUDA graph `key` (or run the attention backend's build ahead
        it names), with no step in flight (its steps ran eagerly until now). A capture that
        fails while serving costs speed, never requests: its steps stay eager."""
        assert self.graphs is not None
        try:
            self.graphs.capture_next(key)
        except RuntimeError as exc:  # torch's capture errors (e.g. a forbidden CUDA call)
            logger.warning("CUDA graph %s not captured (%s): its steps run eagerly", key, exc)

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every KV tensor indexed by the page ids: the target's K and V per layer, then the
        draft model's (the host tier moves a page of each)."""
        tensors = [*self.kv_cache.k, *self.kv_cache.v]
        if self.spec is not None and self.spec.drafter is not None:
            tensors += [*self.spec.drafter.kv_cache.k, *self.spec.drafter.kv_cache.v]
        return tensors

    def _bytes_per_page(self) -> int:
        # A draft model keeps its K/V in the same pages: one page accounting for both.
        cfg = self.config
        per_page = KVCache.bytes_per_page(self.model_config, self.page_size)
        return per_page + SpecDecoder.extra_bytes_per_page(cfg)

    def _num_host_pages(self) -> int:
        """Pages of the host tier (0: none)."""
        budget = self.config.cache.host_kv_cache_bytes
        if not budget:
            return 0
        per_page = self._bytes_per_page()
        if budget < per_page:
            raise ValueError(
                f"host_kv_cache_bytes={budget} is less than one KV page ({per_page} bytes); "
                "raise it or set 0 to turn the host tier off"
            )
        _check_fits(budget, "host_kv_cache_bytes", host_memory_bytes(), "host memory")
        return budget // per_page

    def _check_pool_fits(self, wanted: int, field: str) -> None:
        """A KV pool of `wanted` bytes, sized by `field`, must fit this device's free memory
        (the host's physical memory on the CPU)."""
        if self.device.type == "cuda":
            where, room = f"free on {self.device}", torch.cuda.mem_get_info(self.device)[0]
        else:
            where, room = "host memory", host_memory_bytes()
        _check_fits(wanted, field, room, where)

    def _num_pages(self) -> int:
        cfg = self.config
        per_page = self._bytes_per_page()
        if cfg.cache.num_pages is not None:
            pages = cfg.cache.num_pages
            self._check_pool_fits(pages * per_page, "num_pages")
        elif cfg.cache.kv_cache_memory_bytes is not None:
            pages = cfg.cache.kv_cache_memory_bytes // per_page
            self._check_pool_fits(pages * per_page, "kv_cache_memory_bytes")
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            pages = int(free * cfg.runner.gpu_memory_utilization) // per_page
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
    def launch(self, plan: StepPlan, grammar_mask: GrammarMasks | None = None) -> LaunchedStep:
        """Queue one forward pass over `plan` and the sampling of the positions it samples.

        Nothing waits for the GPU: an input token the previous launched step sampled (and the
        host may not have seen yet) is read on the device. `grammar_mask` is called once the
        forward pass is queued: structured outputs read the previous step's tokens and start
        filling this step's masks, while the GPU runs this forward pass; the sampling, which
        waits for the masks, is then queued by the next launch (or by reading this step), so
        the host schedules the next step while the masks are filled.

        Rank 0 of a tensor-parallel group first hands `plan` to the other ranks; they run the
        same forward pass and take rank 0's sampled tokens instead of sampling. A lost rank
        fails the launch with a `RuntimeError` naming it.
        """
        if self._trim_heap is not None:
            self._trim_heap()
        if self.workers is None:
            return self._launch(plan, grammar_mask)
        self.workers.send(plan)
        try:
            return self._launch(plan, grammar_mask)
        except RuntimeError as exc:  # a collective failed: say which rank is gone
            raise self.workers.failure(exc) from exc

    def _launch(self, plan: StepPlan, grammar_mask: GrammarMasks | None) -> LaunchedStep:
        launched = LaunchedStep(self.device)
        host = lay_out(plan, self.page_size)
        if self._deferred is not None:  # its tokens are inputs of this step: sample them first
            self._deferred.complete()
            self._deferred = None
        self.num_forward_tokens += len(host.input_ids)
        drafts = None
        host_drafts: Callable[[], np.ndarray] | None = None
        if plan.num_device_drafts is not None:
            assert self.spec is not None
            launched.start()
            rows = int(np.count_nonzero(plan.num_device_drafts))
            if self.tp.rank == 0:
                drafts = self.spec.draft(plan, self._last_tokens)
                # Grammar masks and bad words' bans follow the drafts: copied to the host
                # before the forward pass is queued.
                if grammar_mask is not None or plan.sampling.past_device_drafts:
                    host_drafts = self.spec.drafts_on_host(rows)
            # Every rank's forward pass reads the drafts: rank 0's, made by its draft model.
            self.tp.broadcast(self.spec.draft_tokens[: rows * self.spec.k])
        # Images and multimodal positions run eagerly: the graphs take one position per token;
        # so do prompt logprobs: the graphs keep only the sampled positions' hidden states.
        graphs = None if host.multimodal or _eager_only(plan) else self.graphs
        ids: torch.Tensor | None = None
        verify = self._verify_graph(plan) if graphs is not None else None
        launched.num_computed_tokens = len(host.input_ids)
        if graphs is not None and host.is_decode and graphs.serves_decode(len(host.kv_lens)):
            path = "decode"
            logits = self._run_graph(host, launched)
            launched.num_computed_tokens = graphs.padded_size(len(host.kv_lens))
        elif verify is not None:
            path = "verify"
            ids, logits = self._run_verify_graph(host, plan, verify, launched)
            launched.num_computed_tokens = verify[0] * verify[1]
        elif graphs is not None and self._prefill_graph_serves(host, graphs):
            path = "prefill"
            block = graphs.pack_prefill(
                host.input_ids, host.positions, host.slots, int(host.kv_lens[0]),
                host.page_table[0],
            )  # fmt: skip
            launched.start()
            self.staging.upload(block, graphs.prefill_block)
            logits = graphs.run_prefill(len(host.input_ids))
        else:
            path = "eager"
            launched.start()
            ids, positions, inputs, logits_index = self._device_inputs(host, plan)
            self.attention.plan(inputs)
            if plan.images:
                assert self.encoder_cache is not None
                vision = self.encoder_cache.embeds(plan.images)
                hidden = self.model(ids, positions, self.attention, vision)
            else:
                hidden = self.model(ids, positions, self.attention)
            logits = self.model.compute_logits(hidden[logits_index])
            if plan.prompt_logprobs is not None:
                launched.prompt_scores = self._score_prompt(hidden, plan)
        if self.spec is not None and self.spec.drafter is not None:
            # The draft's cache follows the target's: the same tokens in the same slots.
            if path == "eager":
                self.spec.mirror_eager(ids, positions, inputs)
            else:
                self.spec.mirror_graph(path, len(host.kv_lens), len(host.input_ids), verify)
        if plan.sampling and self.tp.rank > 0:
            self._last_tokens = self.tp.broadcast(self._token_buffer(plan.num_sampled))
        elif plan.sampling:
            if grammar_mask is not None:
                # The masks are filled while this forward pass runs and the next step is
                # scheduled; the sampling is queued when the next step is launched (or read).
                # The deferred call holds the runner weakly: a step left pending when the
                # engine is dropped must not keep the runner (and its GPU memory) in a cycle.
                masks, sample = grammar_mask(host_drafts), weakref.WeakMethod(self._sample)
                launched.defer(
                    lambda: sample()(plan, logits, ids, drafts, masks.result(), host_drafts)
                )
                self._deferred = launched
                return launched
            launched.sampled = self._sample(plan, logits, ids, drafts, None, host_drafts)
        elif grammar_mask is not None:
            # Nothing to sample, but the previous step's tokens are read.
            grammar_mask(host_drafts).result()
        launched.forward_done()
        return launched

    @torch.inference_mode()
    def _sample(
        self,
        plan: StepPlan,
        logits: torch.Tensor,
        ids: torch.Tensor | None,
        drafts: tuple[np.ndarray, Drafts] | None,
        mask: GrammarMask | None,
        host_drafts: Callable[[], np.ndarray] | None = None,
    ) -> SampledTokens:
        """Queue the sampling of `plan`'s positions from `logits` (under the grammar `mask`;
        bad words' bans past the draft model's drafts from `host_drafts`); its tokens become
        the next step's device inputs."""
        rows = plan.sampling
        if rows.past_device_drafts and host_drafts is not None:
            rows = rows.ban_past_drafts(host_drafts(), drafting_row_of(plan))
        sampling = SamplingBatch.from_rows(rows, self.config.model.vocab_size, self.device, mask)
        if self.spec is not None and (plan.num_samples > 1).any():
            assert ids is not None
            sampled = self.spec.sample(logits, plan, sampling, ids, drafts)
        else:
            out = self._tokens[: plan.num_sampled] if self._tokens is not None else None
            sampled = self.sampler(logits, sampling, out)
        self.tp.broadcast(sampled.token_ids)
        sampled.start_copy()
        self._last_tokens = sampled.token_ids
        return sampled

    def _score_prompt(self, hidden: torch.Tensor, plan: StepPlan) -> list[SampledTokens]:
        """Queue the prompt logprobs of `plan` (every rank computes them: the logits are
        gathered by a collective) and, on rank 0, their copy to the host."""
        assert plan.prompt_logprobs is not None
        vocab_size = self.config.model.vocab_size
        parts = score_prompt(self.model.compute_logits, hidden, plan.prompt_logprobs, vocab_size)
        if self.tp.rank > 0:
            return []
        for part in parts:
            part.start_copy()
        return parts

    def _token_buffer(self, num_sampled: int) -> torch.Tensor:
        """Where a worker rank receives a step's `num_sampled` tokens (the graphs' static
        buffer, when there are graphs)."""
        if self._tokens is not None:
            return self._tokens[:num_sampled]
        return torch.empty(num_sampled, dtype=torch.int64, device=self.device)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any."""
        if self.workers is not None:
            self.workers.close()

    @property
    def padded_verify_rows(self) -> int:
        """With CUDA graphs, a verify step of up to this many rows computes every row at its
        longest row's query length (0: no verify graphs; rows compute their own length)."""
        graphs = self.graphs
        return graphs.max_bs if graphs is not None and graphs.verify_graphs else 0

    def _verify_graph(self, plan: StepPlan) -> tuple[int, int] | None:
        """The verify graph of a step whose rows all sample every query token (decode rows and
        verify rows) and one at least verifies drafts; None if it has none."""
        if self.graphs is None or not plan.sampling:
            return None
        q_max = int(plan.query_lens.max())
        if q_max < 2 or not plan.samples_every_token:
            return None
        return self.graphs.verify_key(plan.num_rows, q_max)

    def _run_verify_graph(
        self, host: HostBatch, plan: StepPlan, key: tuple[int, int], launched: LaunchedStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify batch through its CUDA graph: its input ids on the device (drafts filled
        in) and the logits of every query token (all are sampled)."""
        assert self.graphs is not None
        draft_src = np.full(len(host.input_ids), -1, dtype=np.int64)
        if plan.num_device_drafts is not None:
            assert self.spec is not None
            draft_src[device_draft_positions(plan)] = device_draft_entries(
                plan.num_device_drafts, self.spec.k
            )
        block = self.graphs.pack_verify(
            key, host.input_ids, host.positions, host.slots, host.query_lens, host.kv_lens,
            host.page_table, host.input_src, draft_src,
        )  # fmt: skip
        launched.start()
        self.staging.upload(block, self.graphs.verify_block)
        num_tokens = len(host.input_ids)
        hidden = self.graphs.run_verify(key, num_tokens)
        return self.graphs.input_ids[:num_tokens], self.model.compute_logits(hidden)

    def _run_graph(self, host: HostBatch, launched: LaunchedStep) -> torch.Tensor:
        """A decode batch through its CUDA graph; returns the sampling rows' logits."""
        assert self.graphs is not None
        batch = len(host.kv_lens)
        # Token i of a decode batch is row i.
        block = self.graphs.pack_decode(
            host.input_ids, host.positions, host.slots, host.kv_lens, host.page_table,
            host.input_src,
        )  # fmt: skip
        launched.start()
        self.staging.upload(block, self.graphs.decode_block)
        logits = self.graphs.run(batch)
        if len(host.logits_index) < batch:  # rare (a 1-token prefill chunk); pageable copy
            index = torch.from_numpy(host.logits_index).to(self.device, non_blocking=True)
            logits = logits[index]
        return logits

    @staticmethod
    def _prefill_graph_serves(host: HostBatch, graphs: CudaGraphRunner) -> bool:
        """One sequence's prefill, every input token known on the host, with a graph."""
        one = len(host.kv_lens) == 1 and not (host.input_src >= 0).any()
        one = one and len(host.logits_index) <= 1  # not a verify: it needs every row's logits
        return one and graphs.serves_prefill(len(host.input_ids), host.page_table.shape[1])

    def _device_inputs(
        self, host: HostBatch, plan: StepPlan
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs, torch.Tensor]:
        """Token ids (with the tokens only the device has filled in: the previous step's
        samples, the draft model's drafts), positions, attention inputs and sampled token
        indices of a batch, in one host→device copy."""
        # The inputs sampled by the previous step: positions `dst` take its tokens `src`.
        dst = np.flatnonzero(host.input_src >= 0)
        draft_dst, draft_src = dst[:0], dst[:0]
        if plan.num_device_drafts is not None:
            assert self.spec is not None
            draft_dst = device_draft_positions(plan)
            draft_src = device_draft_entries(plan.num_device_drafts, self.spec.k)
        ids, positions, slots, q_lens, kv_lens, table, logits_index, dst_d, src_d, *drafts_d = (
            self.staging.to_device(
                host.input_ids, host.positions, host.slots, host.query_lens, host.kv_lens,
                host.page_table, host.logits_index, dst, host.input_src[dst], draft_dst,
                draft_src,
            )
        )  # fmt: skip
        if len(dst):
            ids[dst_d] = self._last_tokens[src_d]
        if len(draft_dst):
            assert self.spec is not None
            ids[drafts_d[0]] = self.spec.draft_tokens[drafts_d[1]]
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(q_lens, 0, out=cu[1:])
        inputs = AttentionInputs(
            query_lens_cpu=host.query_lens.tolist(),
            kv_lens_cpu=host.kv_lens.tolist(),
            cu_query_lens=cu,
            kv_lens=kv_lens,
            page_table=table,
            slot_mapping=slots,
        )
        return ids, positions, inputs, logits_index


def _eager_only(plan: StepPlan) -> bool:
    """Steps no CUDA graph runs: with images (the encoder's features go in) or prompt
    logprobs (they score hidden states the graphs do not keep)."""
    return bool(plan.images) or plan.prompt_logprobs is not None


def warm_up_batches(
    max_tokens: int, max_len: int, max_seqs: int, whole_min: int = 0
) -> list[list[int]]:
    """Query lengths of the eager batches `warm_up` runs, each of at most `max_tokens` tokens
    in rows of at most `max_len` (no position past the model's) and at most `max_seqs` rows
    (the batch's first ones kept: a batch of more sequences never runs, and the backends'
    scratch is sized for `max_num_seqs`): prompts filling the step beside a decode row, a 64-
    and a 16-token prompt beside one, and each of 2 to 8 tokens beside one (a serving run's
    first mixed steps; each shape may be kernels of its own: the Triton backend's prefill
    tiles, its short rows' launch, its verify kernel's row blocks). `whole_min` > 0
    (`AttentionBackend.whole_prompt_min_tokens`: whole prompts of that many tokens take another
    kernel): also prompts just shorter filling the step beside a decode row, the tiles the
    prefill kernel takes for the rows left to it (chunks after a prefix)."""
    fill = max_tokens - 1
    batches = [[*_rows_filling(fill, max_len), 1]]
    if whole_min > 1:
        batches.append([*_rows_filling(fill, min(whole_min - 1, max_len)), 1])
    batches += [[min(64, max_len), 1], [min(16, max_len), 1]]
    batches += [[min(q, max_len), 1] for q in range(2, 9)]
    kept: list[list[int]] = []
    least = min(2, max_seqs)  # (a lone decode row is no mixed step, unless steps are one row)
    for lens in (b[:max_seqs] for b in batches):
        fits = len(lens) >= least and min(lens) > 0 and sum(lens) <= max_tokens
        if fits and lens not in kept:
            kept.append(lens)
    return kept


def _rows_filling(tokens: int, row_len: int) -> list[int]:
    """Rows of `row_len` tokens, and one of the rest, that hold `tokens` tokens."""
    rest = [tokens % row_len] if tokens % row_len else []
    return [row_len] * (tokens // row_len) + rest


@torch.inference_mode()
def warm_up(
    model: torch.nn.Module,
    attention: AttentionBackend,
    page_size: int,
    batches: list[list[int]],
    device: torch.device,
) -> None:
    """Eager forward passes of `batches` (each a list of query lengths, no cached prefix) on
    dummy inputs that write no KV, so that their kernels compile at start-up rather than
    inside the first requests' steps (a mixed batch's short rows compiled a kernel of their
    own in B2's measured run: ~1.6 s). Their attention reads page 0, whatever it holds."""
    for lens in batches:
        q_lens = torch.tensor(lens, dtype=torch.int64, device=device)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int64, device=device)
        torch.cumsum(q_lens, 0, out=cu[1:])
        total, pages = sum(lens), -(-max(lens) // page_size)
        attention.plan(
            AttentionInputs(
                query_lens_cpu=lens,
                kv_lens_cpu=lens,
                cu_query_lens=cu,
                kv_lens=q_lens,
                page_table=torch.zeros(len(lens), pages, dtype=torch.int64, device=device),
                slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=device),
            )
        )
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        model(torch.zeros(total, dtype=torch.int64, device=device), positions, attention)


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_fits(wanted: int, field: str, room: int | None, where: str) -> None:
    """A `ValueError` naming `field` when a KV pool of `wanted` bytes exceeds `room` (None:
    unknown, not checked), instead of the allocator's error halfway through start-up."""
    if room is not None and wanted > room:
        raise ValueError(
            f"{field}: a KV cache of {wanted / 2**30:.1f} GiB does not fit in the "
            f"{room / 2**30:.1f} GiB {where}"
        )
