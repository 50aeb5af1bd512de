"""Where a decode step's time goes on the GPU: graph replay vs. host work, and the top kernels.

python benchmarks/profile_decode.py --config shared/models/qwen3-0.6b [--batch 1 8 64] [--no-pdl]
    [--deterministic] [--kv-cache-bytes N]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import time
from collections import defaultdict

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine_core import EngineCore
from tokenmill.kernels.pdl import set_pdl_enabled
from tokenmill.observability.cuda_timing import median_cuda_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--no-pdl", action="store_true", help="launch kernels without PDL")
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=20_000_000_000,
        help="KV cache size; every batch's prompts and 200 tokens each must fit",
    )
    parser.add_argument(
        "--deterministic", action="store_true", help="the engine in deterministic mode"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # GEMV choices
    set_pdl_enabled(not args.no_pdl)
    llm = LLM(
        args.config, load_format="dummy", dtype="bfloat16", max_num_seqs=max(args.batch),
        kv_cache_memory_bytes=args.kv_cache_bytes, enable_prefix_caching=False, max_model_len=4096,
        deterministic=args.deterministic,
    )  # fmt: skip
    runner, engine = llm.engine.runner, llm.engine
    graphs = runner.graphs
    assert graphs is not None
    rng = np.random.default_rng(0)
    vocab = llm.config.model.vocab_size
    page = llm.config.cache.page_size
    for bs in args.batch:
        if bs * -(-(args.context + 200) // page) > runner.num_pages:
            raise SystemExit(
                f"batch {bs} of {args.context}-token prompts needs more than the KV cache's "
                f"{runner.num_pages} pages: raise --kv-cache-bytes (a preempted batch leaves "
                "the graph replayed below with stale inputs)"
            )
        prompts = [rng.integers(10, vocab, args.context).tolist() for _ in range(bs)]
        for i, p in enumerate(prompts):
            engine.add_request(f"p{bs}-{i}", p, SamplingParams(temperature=0, max_tokens=200,
                                                                 ignore_eos=True))  # fmt: skip
        while any(len(r.output_token_ids) < 2 for r in engine.scheduler.running) or (
            engine.scheduler.waiting
        ):
            engine.step()
        padded = graphs.padded_size(bs)
        replay = graphs.graphs[padded].replay
        replay_ms = 1e3 * median_cuda_seconds(replay, repeats=50)
        steps = 50
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_ms = (time.perf_counter() - start) / steps * 1e3
        label = "no PDL bs" if args.no_pdl else "bs"
        print(f"{label}={bs}: graph replay {replay_ms:.3f} ms (GPU), engine step {step_ms:.3f} "
              f"ms (wall) -> host overhead ~{step_ms - replay_ms:.3f} ms/step")  # fmt: skip
        if bs == args.batch[0]:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    graphs.graphs[padded].replay()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
            _print_step_timeline(engine, steps=20)
        for rid in engine.request_ids():
            engine.abort_request(rid)


def _print_step_timeline(engine: EngineCore, steps: int) -> None:
    """Where the GPU idles across whole engine steps (inside and between graph replays): busy
    vs. span, and the kernel pairs with the most idle time between them, per step."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    if len(kernels) < 2:
        return
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    busy = sum(e.time_range.elapsed_us() for e in kernels)  # overlapping (PDL) counted twice
    gaps: dict[tuple[str, str], float] = defaultdict(float)
    end = kernels[0].time_range.end
    for prev, e in itertools.pairwise(kernels):
        end = max(end, prev.time_range.end)
        if (idle := e.time_range.start - end) > 0:
            gaps[(prev.name[:40], e.name[:40])] += idle
    idle = sum(gaps.values())
    print(f"timeline of {steps} steps: {span / steps:.1f} us/step, kernels {busy / steps:.1f} "
          f"us/step (PDL overlap counted twice), idle {idle / steps:.1f} us/step")  # fmt: skip
    for (a, b), total in sorted(gaps.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  idle {total / steps:6.1f} us/step between {a} -> {b}")


if __name__ == "__main__":
    main()
