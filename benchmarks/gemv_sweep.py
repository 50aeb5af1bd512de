"""Time decode-sized GEMMs (M = 1..8 rows) as they run in a decode CUDA graph: cuBLAS vs. gemv.

Each shape is timed as a graph of one product per layer over distinct weight copies (so the
weights stream from HBM, not L2, as in a real decode step); the graph is replayed many times and
the median replay divided by the number of products. Prints µs and GB/s per shape, M and kernel.

    python benchmarks/gemv_sweep.py --out gemv.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from torch.nn import functional as F

from tokenmill.kernels.gemv import GemvConfig, gemv
from tokenmill.observability.cuda_timing import median_graph_seconds

# (name, N, K) of the decode GEMMs of qwen3-0.6b and llama-3.1-8b.
SHAPES = [
    ("qwen3-0.6b qkv", 4096, 1024),
    ("qwen3-0.6b o", 1024, 2048),
    ("qwen3-0.6b gate_up", 6144, 1024),
    ("qwen3-0.6b down", 1024, 3072),
    ("llama-3.1-8b qkv", 6144, 4096),
    ("llama-3.1-8b o", 4096, 4096),
    ("llama-3.1-8b gate_up", 28672, 4096),
    ("llama-3.1-8b down", 4096, 14336),
]
TILES = (
    (1, 1024, 2),
    (1, 2048, 4),
    (2, 512, 2),
    (2, 1024, 2),
    (2, 1024, 4),
    (4, 256, 2),
    (4, 512, 2),
    (4, 512, 4),
    (4, 1024, 4),
    (4, 1024, 8),
    (8, 512, 2),
    (8, 1024, 4),
)  # (block_n, block_k, num_warps)
VARIANTS = ((1, False), (2, False), (1, True), (2, True))  # (prefetch, defer)


def configs_for(m: int) -> list[GemvConfig]:
    """The configs swept for `m` rows (those that serve `m` rows)."""
    configs = [
        GemvConfig(bn, bk, sk, nw, prefetch, defer)
        for bn, bk, nw in TILES
        for sk in (1, 2)
        for prefetch, defer in VARIANTS
    ]
    return [c for c in configs if c.serves(m)]


def graph_seconds_per_call(fn: Callable[[int], object], layers: int) -> float:
    """Median replay time of a graph running `fn(i)` for each layer i, divided by `layers`."""
    return median_graph_seconds(lambda: [fn(i) for i in range(layers)], replays=30) / layers


def sweep(ms: list[int]) -> list[dict[str, object]]:
    """Every shape x M x (cuBLAS + each gemv config); returns one row per shape and M."""
    rows = []
    for name, n, k in SHAPES:
        layers = max(4, min(32, (512 << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), weights[0].float())
            base = graph_seconds_per_call(lambda i, x=x, w=weights: F.linear(x, w[i]), layers)
            results = {}
            for cfg in configs_for(m):
                out = gemv(x, weights[0], cfg).float()
                if not torch.allclose(out, ref, atol=0.05 * ref.abs().max().item(), rtol=0.02):
                    raise AssertionError(f"{name} M={m} {cfg}: wrong result")
                results[cfg] = graph_seconds_per_call(
                    lambda i, x=x, w=weights, cfg=cfg: gemv(x, w[i], cfg), layers
                )
            best = min(results, key=results.__getitem__)
            gb = n * k * 2 / 1e9
            rows.append({
                "shape": name, "n": n, "k": k, "m": m, "cublas_us": base * 1e6,
                "cublas_gbs": gb / base, "best_us": results[best] * 1e6,
                "best_gbs": gb / results[best], "best": vars(best),
                "all_us": {str(vars(c)): t * 1e6 for c, t in results.items()},
            })  # fmt: skip
            print(
                f"{name:22s} M={m}: cuBLAS {base * 1e6:7.1f} us ({gb / base:5.0f} GB/s)  "
                f"gemv {results[best] * 1e6:7.1f} us ({gb / results[best]:5.0f} GB/s) {best}",
                flush=True,
            )
            for prefetch, defer in VARIANTS:  # the best of each kernel variant
                mine = {
                    c: t for c, t in results.items() if (c.prefetch, c.defer) == (prefetch, defer)
                }
                if mine:
                    top = min(mine, key=mine.__getitem__)
                    print(f"    prefetch={prefetch} defer={defer!s:5}: {mine[top] * 1e6:7.1f} us"
                          f" ({gb / mine[top]:5.0f} GB/s) {top}")  # fmt: skip
        weights.clear()
        torch.cuda.empty_cache()
    return rows


def sweep_main(
    run: Callable[[list[int]], list[dict[str, object]]], default_m: list[int], doc: str
) -> None:
    """A sweep's command line: `--m` row counts for `run`, its rows written as JSON (`--out`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=default_m)
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    rows = run(ns.m)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(rows, f, indent=2)


def main() -> None:
    """Run the sweep and write the rows as JSON."""
    sweep_main(sweep, [1, 2, 4, 8], __doc__)


if __name__ == "__main__":
    main()
