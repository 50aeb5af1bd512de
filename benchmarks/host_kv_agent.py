"""GPU benchmark (issue 28): the host KV tier against recomputing, on one shared-prefix workload.

Two measurements, with dummy weights of `--config`, in one run:

1. Reload vs recompute: a `--prefix-tokens` prompt prefilled cold (TTFT with max_tokens=1), its
   pages written out to the host tier, then the same prompt again: its TTFT, and the host tier's
   load time for those pages (device time of the copies).
2. The agent workload (`tokenmill/bench/workloads.py`: a 16,000-token shared prefix, sessions
   re-sending their growing history turn after turn) with a device KV pool of `--device-kv-tokens`
   (smaller than the workload's working set), without and then with a host tier of
   `--host-kv-bytes`: TTFT p50/p99 per turn, throughput, preemptions, prefix and host hits.

    python benchmarks/host_kv_agent.py --config shared/models/llama-3.1-8b --output hostkv.json

On a CPU, shrink it: `--config shared/models/tiny-llama-cpu --length-scale 0.05 --sessions 2
--max-turns 2 --device-kv-tokens 2048 --prefix-tokens 800`.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.workloads import WorkloadSpec, build_workload
from tokenmill.cache.kv_cache import KVCache
from tokenmill.config import ModelConfig


@dataclass
class _Session:
    turns: list[Any]
    arrival: float
    history: list[int] = field(default_factory=list)
    turn: int = 0
    submitted: float = 0.0
    first_token: float | None = None
    reply: list[int] = field(default_factory=list)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _ttft(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def reload_vs_recompute(llm: LLM, prefix: list[int], repeats: int) -> dict[str, float]:
    """Median TTFT of a cold prefill and of the same prompt reloaded from the host tier."""
    cache = llm.engine.cache
    assert cache.radix is not None and cache.host is not None
    cold, reload, load_s = [], [], []
    for i in range(repeats):
        prompt = [*prefix, 3 + i]
        llm.flush_prefix_cache()
        cold.append(_ttft(llm, prompt))
        cache.radix.evict(cache.radix.num_cached_pages)  # every page out to the host
        _sync()
        before = cache.host.poll().load_seconds
        reload.append(_ttft(llm, [*prompt[:-1], 100 + i]))
        _sync()
        load_s.append(cache.host.poll().load_seconds - before)
    recompute, reloaded, load = (float(np.median(x)) for x in (cold, reload, load_s))
    return {
        "prefix_tokens": len(prefix),
        "ttft_recompute_s": recompute,
        "ttft_reload_s": reloaded,
        "host_load_s": load,
        "load_speedup_vs_recompute": recompute / load if load else float("inf"),
        "ttft_speedup": recompute / reloaded,
    }


def run_agent(llm: LLM, spec: WorkloadSpec, rate: float, max_turns: int) -> dict[str, Any]:
    """Drive the sessions through the engine in this process (arrivals `rate` per second, each
    turn sent when the previous reply ends); TTFT per turn and throughput."""
    engine = llm.engine
    sessions = [_Session(s.turns[:max_turns], i / rate) for i, s in enumerate(build_workload(spec))]
    waiting = list(range(len(sessions)))
    running: dict[str, int] = {}
    ttfts: list[float] = []
    tokens = 0
    start = time.perf_counter()

    def submit(index: int) -> None:
        s = sessions[index]
        turn = s.turns[s.turn]
        s.history += turn.new_tokens
        s.submitted, s.first_token, s.reply = time.perf_counter(), None, []
        rid = f"s{index}t{s.turn}"
        params = SamplingParams(temperature=0, max_tokens=turn.max_tokens, ignore_eos=True)
        engine.add_request(rid, list(s.history), params)
        running[rid] = index

    while waiting or running:
        now = time.perf_counter() - start
        while waiting and sessions[waiting[0]].arrival <= now:
            submit(waiting.pop(0))
        if not running:
            time.sleep(0.001)
            continue
        for out in engine.step():
            s = sessions[running[out.request_id]]
            if s.first_token is None and out.new_token_ids:
                s.first_token = time.perf_counter()
                ttfts.append(s.first_token - s.submitted)
            s.reply += out.new_token_ids
            tokens += len(out.new_token_ids)
            if out.finished:
                index = running.pop(out.request_id)
                s.history += s.reply
                s.turn += 1
                if s.turn < len(s.turns):
                    submit(index)
    elapsed = time.perf_counter() - start
    cache = engine.cache
    report = {
        "turns": len(ttfts),
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "output_tokens_per_s": tokens / elapsed,
        "elapsed_s": elapsed,
        "preemptions": engine.scheduler.stats.num_preemptions,
        "prefix_cache_hit_rate": cache.stats.hits / max(cache.stats.queries, 1),
    }
    if cache.host is not None:
        stats = cache.host.poll()
        report |= {
            "host_hit_tokens": stats.hit_tokens,
            "host_gb_loaded": stats.bytes_loaded / 1e9,
            "host_gb_written": stats.bytes_written / 1e9,
            "host_load_s": stats.load_seconds,
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="directory holding config.json")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefix-tokens", type=int, default=16000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=6, help="turns per session (of 10-20)")
    parser.add_argument("--rate", type=float, default=2.0, help="sessions started per second")
    parser.add_argument("--length-scale", type=float, default=1.0)
    parser.add_argument("--device-kv-tokens", type=int, default=24576,
                        help="device KV pool, in tokens (the working set is larger)")  # fmt: skip
    parser.add_argument("--host-kv-bytes", type=int, default=32_000_000_000)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--output", default=None, help="JSON report")
    args = parser.parse_args()

    model = ModelConfig.from_pretrained(args.config, args.dtype)
    spec = WorkloadSpec("agent", num_sessions=args.sessions, vocab_size=model.vocab_size,
                        length_scale=args.length_scale)  # fmt: skip
    longest = max(
        sum(len(t.new_tokens) + t.max_tokens for t in s.turns[: args.max_turns])
        for s in build_workload(spec)
    )
    page_size = 16
    engine = dict(
        load_format="dummy", dtype=args.dtype, page_size=page_size,
        max_model_len=max(longest, args.prefix_tokens + 16) + page_size,
        num_pages=args.device_kv_tokens // page_size, max_num_seqs=args.max_num_seqs,
    )  # fmt: skip
    rng = np.random.default_rng(1)
    prefix = rng.integers(10, model.vocab_size, args.prefix_tokens).tolist()
    report: dict[str, Any] = {
        "config": args.config,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "kv_bytes_per_token": KVCache.bytes_per_page(model, page_size) // page_size,
        "args": vars(args),
    }
    for name, host_bytes in (("without_host_tier", 0), ("with_host_tier", args.host_kv_bytes)):
        llm = LLM(args.config, host_kv_cache_bytes=host_bytes, **engine)
        _ttft(llm, prefix[:64])  # warm up
        report[name] = run_agent(llm, spec, args.rate, args.max_turns)
        if host_bytes:
            report["reload_vs_recompute"] = reload_vs_recompute(llm, prefix, args.repeats)
        print(name, json.dumps(report[name]), flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print("reload_vs_recompute", json.dumps(report["reload_vs_recompute"]))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
