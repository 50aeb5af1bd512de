"""Long-prompt prefill attention (`kernels/attention.prefill_attention`) against the matmul rate.

For the heads of qwen3-0.6b and llama-3.1-8b, paged K/V (16-token pages, shuffled), bfloat16:
whole prompts of 2,048 / 8,192 / 32,768 tokens and 2,048-token chunks after a 6,144-token
prefix, about 32k query tokens a batch. Each case is timed for the kernel's default tiles and
(`--sweep`, when the tree's `prefill_attention` takes `tiles`) every tile in TILES, next to
torch's SDPA (flash, contiguous K/V: the transformers peer's kernel) and the bf16 matmul rate
measured in the same run (causal FLOPs: 4 x head_dim per query head and (query, key) pair).

    python benchmarks/prefill_attention.py [--sweep]
"""

from __future__ import annotations

import argparse
import functools
import inspect

import torch
import triton
from torch.nn import functional as F

from tokenmill.kernels import attention

HEADS = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128)}
# (name, query tokens per sequence, cached prefix, sequences)
CASES = [
    ("2k", 2048, 0, 16),
    ("8k", 8192, 0, 4),
    ("32k", 32768, 0, 1),
    ("2k after 6k", 2048, 6144, 16),
]
PAGE = 16
TILES = [
    (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2),
    (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 2), (128, 64, 4, 2),
]  # fmt: skip


def matmul_tflops() -> float:
    """The bf16 matmul rate of an 8192^3 product (the ceiling the kernel is compared with)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ a)
    return 2 * 8192**3 / ms / 1e9


def causal_flops(hq: int, d: int, q_len: int, prefix: int, seqs: int) -> float:
    """4 x d FLOPs per query head and visible (query, key) pair."""
    pairs = q_len * prefix + q_len * (q_len + 1) // 2
    return 4.0 * d * hq * pairs * seqs


def paged_case(hq: int, hkv: int, d: int, q_len: int, prefix: int, seqs: int) -> dict:
    """Random queries and a paged K/V cache (pages shuffled) for `seqs` sequences."""
    kv_len = q_len + prefix
    pages = triton.cdiv(kv_len, PAGE)
    table = torch.randperm(seqs * pages, device="cuda", dtype=torch.int32).view(seqs, pages)
    k = torch.randn(seqs * pages * PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
    return dict(
        q=torch.randn(seqs * q_len, hq, d, device="cuda", dtype=torch.bfloat16),
        k_cache=k, v_cache=torch.randn_like(k),
        cu_q=torch.arange(seqs + 1, device="cuda", dtype=torch.int32) * q_len,
        kv_lens=torch.full((seqs,), kv_len, device="cuda", dtype=torch.int32),
        page_table=table, max_q_len=q_len, page_size=PAGE, scale=d**-0.5, window=None,
    )  # fmt: skip


def sdpa_ms(hq: int, hkv: int, d: int, q_len: int, seqs: int) -> float:
    """torch's SDPA (flash) on contiguous tensors, whole prompts only (no prefix)."""
    q = torch.randn(seqs, hq, q_len, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(seqs, hkv, q_len, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return triton.testing.do_bench(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time every tile in TILES")
    parser.add_argument("--models", nargs="+", default=list(HEADS), choices=list(HEADS))
    args = parser.parse_args()
    ceiling = matmul_tflops()
    print(f"matmul bf16 8192^3: {ceiling:.0f} TFLOP/s")
    tiles_arg = "tiles" in inspect.signature(attention.prefill_attention).parameters
    for model in args.models:
        hq, hkv, d = HEADS[model]
        for name, q_len, prefix, seqs in CASES:
            inputs = paged_case(hq, hkv, d, q_len, prefix, seqs)
            flops = causal_flops(hq, d, q_len, prefix, seqs)
            candidates = [None] + (TILES if args.sweep and tiles_arg else [])
            for tile in candidates:
                extra = {"tiles": attention.PrefillTiles(*tile)} if tile else {}
                ms = triton.testing.do_bench(
                    functools.partial(attention.prefill_attention, **inputs, **extra)
                )
                rate = flops / ms / 1e9
                print(f"{model} {name}: tiles {tile or 'default'} {ms:.3f} ms, {rate:.0f} "
                      f"TFLOP/s ({100 * rate / ceiling:.1f}% of the matmul rate)")  # fmt: skip
            if prefix == 0:
                ms = sdpa_ms(hq, hkv, d, q_len, seqs)
                rate = flops / ms / 1e9
                print(f"{model} {name}: torch SDPA {ms:.3f} ms, {rate:.0f} TFLOP/s "
                      f"({100 * rate / ceiling:.1f}%)")  # fmt: skip
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
