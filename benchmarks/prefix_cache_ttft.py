"""CPU benchmark: time to first token with a cached 2,000-token system prompt vs. cold.

B5 shapes (../shared/BENCHMARKS.md): the tiny-llama-cpu config with dummy weights. Each request is
the shared system prompt plus a distinct user turn; we time prefill + first token (max_tokens=1).
The peer, measured in the same run, is one transformers forward over the same prompt.

    python benchmarks/prefix_cache_ttft.py --config ../shared/models/tiny-llama-cpu
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tokenmill import LLM, SamplingParams

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def _ttft(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], FIRST_TOKEN, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="directory holding config.json")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--user-tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    rng = random.Random(0)
    vocab = AutoConfig.from_pretrained(args.config).vocab_size

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = ids(args.system_tokens)
    llm = LLM(args.config, load_format="dummy", device="cpu", max_model_len=4096)
    _ttft(llm, ids(64))  # warm up
    cold, hit, offsets = [], [], {}
    for _ in range(args.repeats):
        llm.flush_prefix_cache()
        cold.append(_ttft(llm, system + ids(args.user_tokens)))
        hit.append(_ttft(llm, system + ids(args.user_tokens)))
    # Divergence inside a page: the diverging request recomputes the partial page. Its cost is
    # the difference between diverging 1 token after a page boundary and 15 tokens after it.
    page = llm.config.cache.page_size
    base = (args.system_tokens // page) * page
    for extra in (1, page - 1):
        times = []
        for _ in range(args.repeats):
            llm.flush_prefix_cache()
            _ttft(llm, system[:base] + ids(page))
            times.append(_ttft(llm, system[: base + extra] + ids(4)))
        offsets[extra] = statistics.median(times)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config)).eval()
    hf_times = []
    prompt = torch.tensor([system + ids(args.user_tokens)])
    with torch.no_grad():
        for _ in range(args.repeats):
            start = time.perf_counter()
            hf(prompt).logits[:, -1].argmax(-1)
            hf_times.append(time.perf_counter() - start)
    result = {
        "prompt_tokens": args.system_tokens + args.user_tokens,
        "ttft_cold_s": statistics.median(cold),
        "ttft_hit_s": statistics.median(hit),
        "speedup": statistics.median(cold) / statistics.median(hit),
        "partial_page_recompute_1_vs_15_tokens_s": [offsets[1], offsets[page - 1]],
        "transformers_forward_s": statistics.median(hf_times),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
