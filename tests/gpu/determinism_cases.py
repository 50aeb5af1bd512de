"""Deterministic-mode checks on a CUDA GPU, one per fresh process (`python -m
tests.gpu.determinism_cases CASE DIR`): cuBLAS reads its workspace settings once, at its first
product, so each case starts before anything has used it (the torch attention backend's products
still go through cuBLAS). Prints one JSON object: the failures found (empty: none) and what was
compared.

Cases: `linear` (rows of `invariant_linear` at 1..512 rows against each row alone, and the
512 rows through every tile `choose_tile` can pick, loaded through pointers and through tensor
descriptors, on the shapes of Qwen3-0.6B and Llama-3.1-8B, LM heads included);
`engine-<family>` (a bfloat16 checkpoint built in DIR, CUDA graphs on: the greedy and the
seeded target alone, in batches of 1..64 other requests, under prefill budgets 16/512/8192,
after a prefix hit, decode-written KV reused)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

from tokenmill.kernels.invariant_matmul import choose_tile, invariant_matmul
from tokenmill.layers.invariant import configure_invariant_cublas, invariant_linear

# (N, K) of the products of Qwen3-0.6B and Llama-3.1-8B: q/k/v, o, gate/up, down, LM head.
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),
          (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]  # fmt: skip
ROWS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 64, 100, 128, 255, 256, 257, 512]
# Every tile `choose_tile` picks for some (M, N).
TILES = sorted({choose_tile(m, n) for m in (1, 32, 100, 300, 4096) for n in (1024, 4096, 32768)})


def check_linear() -> dict:
    configure_invariant_cublas()
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        x = torch.randn(max(ROWS), k, device="cuda", generator=gen, dtype=torch.bfloat16)
        alone = torch.cat([invariant_linear(x[i : i + 1], w) for i in range(max(ROWS))])
        for m in ROWS:
            rows = (invariant_linear(x[:m], w) != alone[:m]).any(dim=1)
            if rows.any():
                failures.append({"shape": [n, k], "m": m, "rows_differing": int(rows.sum())})
        for tile in TILES:  # and through tensor descriptors (TMA), as products of > 512 rows
            for tma in (False, True):
                rows = (invariant_matmul(x, w, tile=tile, tma=tma) != alone).any(dim=1)
                if rows.any():
                    failures.append({"shape": [n, k], "tile": tile, "tma": tma,
                                     "rows_differing": int(rows.sum())})  # fmt: skip
    return {"failures": failures, "shapes": len(SHAPES), "row_counts": ROWS}


GREEDY_ARGS = {"temperature": 0, "max_tokens": 24, "ignore_eos": True, "logprobs": 3}


def check_engine(family: str, root: Path) -> dict:
    from tokenmill import LLM, SamplingParams
    from tokenmill.testing.checkpoints import build_checkpoint

    path = build_checkpoint(root / family, family, hidden_size=256, intermediate_size=512,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                            num_hidden_layers=3, max_position_embeddings=2048)  # fmt: skip
    greedy = SamplingParams(**GREEDY_ARGS)
    seeded = SamplingParams(**{**GREEDY_ARGS, "temperature": 1.0, "top_p": 0.9, "seed": 7})
    rng = random.Random(0)
    target = [rng.randrange(5, 500) for _ in range(300)]

    def run(llm: LLM, others: list[list[int]]) -> list:
        outs = llm.generate([target, target, *others], [greedy, seeded, *[greedy] * len(others)],
                            use_tqdm=False)  # fmt: skip
        return [_record(o.outputs[0]) for o in outs[:2]]

    def engine(budget: int, caching: bool = False) -> LLM:
        return LLM(str(path), device="cuda", dtype="bfloat16", deterministic=True,
                   max_num_batched_tokens=budget, enable_prefix_caching=caching,
                   kv_cache_memory_bytes=1 << 30)  # fmt: skip

    reference = run(engine(8192), [])
    failures, compared = [], []
    llm = engine(512)
    for size in sorted({1, 64, *rng.sample(range(2, 64), 6)}):
        others = [
            [rng.randrange(5, 500) for _ in range(rng.randrange(1, 600))] for _ in range(size)
        ]
        compared.append(f"batch {size}")
        if run(llm, others) != reference:
            failures.append(f"batch {size}")
    for budget in (16, 512, 8192):
        others = [[rng.randrange(5, 500) for _ in range(rng.randrange(1, 400))] for _ in range(7)]
        compared.append(f"budget {budget}")
        if run(engine(budget), others) != reference:
            failures.append(f"budget {budget}")
    cached = engine(64, caching=True)
    cached.generate([target[:200]], greedy, use_tqdm=False)
    for attempt in ("prefix hit", "whole prompt cached"):
        compared.append(attempt)
        if run(cached, []) != reference:
            failures.append(attempt)
    extended = [*target, *reference[0]["token_ids"]]
    want = _record(engine(8192).generate([extended], greedy, use_tqdm=False)[0].outputs[0])
    compared.append("decode-written KV reused")
    if _record(cached.generate([extended], greedy, use_tqdm=False)[0].outputs[0]) != want:
        failures.append("decode-written KV reused")
    return {"failures": failures, "compared": compared}


def _record(completion) -> dict:
    """Token ids and every position's logprobs (chosen and top), as exact floats."""
    logprobs = [{t: (lp.logprob, lp.rank) for t, lp in pos.items()} for pos in completion.logprobs]
    return {"token_ids": list(completion.token_ids), "logprobs": logprobs}


def main() -> None:
    case, root = sys.argv[1], Path(sys.argv[2])
    if case == "linear":
        result = check_linear()
    else:
        result = check_engine(case.removeprefix("engine-"), root)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
