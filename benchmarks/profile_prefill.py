"""Where B1's time to first token goes: wall time vs. GPU time of the prefill, host hot spots.

python benchmarks/profile_prefill.py --config shared/models/qwen3-0.6b [--input-len 512]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    llm = LLM(
        args.config, load_format="dummy", dtype="bfloat16", max_num_seqs=8,
        kv_cache_memory_bytes=20_000_000_000,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    vocab = llm.config.model.vocab_size
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft() -> float:
        prompt = rng.integers(10, vocab, args.input_len).tolist()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], first, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(3):
        ttft()
    stats = llm.engine.stats.forward_seconds
    count, total = stats.count, stats.total
    walls = [ttft() for _ in range(args.repeats)]
    gpu = (stats.total - total) / max(stats.count - count, 1)
    print(f"prefill {args.input_len}: TTFT {1e3 * statistics.median(walls):.2f} ms (wall, median "
          f"of {args.repeats}), forward+sampling {1e3 * gpu:.2f} ms (GPU, mean)")  # fmt: skip
    profiler = cProfile.Profile()
    profiler.runcall(ttft)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ttft()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
