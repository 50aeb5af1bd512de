"""Long-prompt prefill attention (`kernels/attention.prefill_attention`) against the matmul rate.

For the heads of qwen3-0.6b and llama-3.1-8b, paged K/V (16-token pages, shuffled), bfloat16:
whole prompts of 2,048 / 8,192 / 32,768 tokens and 2,048-token chunks after a 6,144-token
prefix, about 32k query tokens a batch. Each case is timed for the kernel's default tiles and
(`--sweep`, when the tree's `prefill_attention` takes `tiles`) every tile in TILES, next to
torch's SDPA (flash, contiguous K/V: the transformers peer's kernel) and the bf16 matmul rate
measured in the same run (causal FLOPs: 4 x head_dim per query head and (query, key) pair).

`--decode`: `decode_attention` instead, over B2's decode batches (32, 143 and 256 rows of
contexts uniform in 100-2,048 tokens) against the copy bandwidth; with `--sweep` every key
block, stage count and warp count of its kernel, the three fastest printed.

`--mixed`: the data workload's mixed steps instead (an 8,192-token chunk budget spent on two
prompts, one after a 2,000-token prefix, beside 0-128 decode rows of 5,000-token contexts): the
step's launches with the decode rows as short rows, the prefill rows alone, and the decode rows
alone in the prefill kernel and in `decode_attention` (its split count for the batch), the
decode rows' K/V bytes against the copy bandwidth measured in the same run.

    python benchmarks/prefill_attention.py [--sweep] [--mixed | --decode]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import itertools

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


def copy_tbps() -> float:
    """Device-to-device copy bandwidth of 2 GiB (read + write), the decode rows' ceiling."""
    a = torch.empty(2**30, device="cuda", dtype=torch.int16)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a))
    return 2 * a.numel() * 2 / ms / 1e9


# --mixed: the chunk's prefill rows (query tokens, cached prefix) and each decode row's context
MIXED_PREFILLS = [(3000, 2000), (5192, 0)]
DECODE_CONTEXT = 5000


def paged_rows(kv_lens: list[int], hkv: int, d: int) -> tuple[torch.Tensor, ...]:
    """Random bf16 K and V caches holding rows of `kv_lens` tokens in shuffled pages, and the
    rows' page table."""
    pages = [triton.cdiv(n, PAGE) for n in kv_lens]
    order = torch.randperm(sum(pages), device="cuda", dtype=torch.int32)
    table = torch.zeros(len(pages), max(pages), device="cuda", dtype=torch.int32)
    start = 0
    for row, n in enumerate(pages):
        table[row, :n] = order[start : start + n]
        start += n
    k = torch.randn(sum(pages) * PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
    return k, torch.randn_like(k), table


def mixed_case(hq: int, hkv: int, d: int, decode_rows: int) -> dict:
    """The MIXED_PREFILLS rows and `decode_rows` rows of one query token after
    `DECODE_CONTEXT - 1` cached: one paged batch."""
    q_lens = [q for q, _ in MIXED_PREFILLS] + [1] * decode_rows
    kv_lens = [q + p for q, p in MIXED_PREFILLS] + [DECODE_CONTEXT] * decode_rows
    k, v, table = paged_rows(kv_lens, hkv, d)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device="cuda")
    return dict(
        q=torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16),
        k_cache=k, v_cache=v, cu_q=cu.to(torch.int32),
        kv_lens=torch.tensor(kv_lens, device="cuda", dtype=torch.int32), page_table=table,
        max_q_len=max(q_lens), page_size=PAGE, scale=d**-0.5, window=None,
    )  # fmt: skip


def _rows(inputs: dict, first: int, last: int) -> dict:
    """The batch `inputs` cut to its rows `first .. last - 1`."""
    cu = inputs["cu_q"]
    q = inputs["q"][int(cu[first]) : int(cu[last])]
    lens = (cu[first + 1 : last + 1] - cu[first:last]).tolist()
    return dict(
        inputs, q=q, cu_q=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                       device="cuda", dtype=torch.int32),
        kv_lens=inputs["kv_lens"][first:last], page_table=inputs["page_table"][first:last],
        max_q_len=max(lens),
    )  # fmt: skip


def mixed(models: list[str]) -> None:
    """Time the data workload's mixed steps (`--mixed`)."""
    from tokenmill.attention.triton_backend import decode_splits

    bandwidth = copy_tbps()
    print(f"copy bandwidth (read + write, 2 GiB): {bandwidth:.2f} TB/s")
    for model in models:
        hq, hkv, d = HEADS[model]
        for n in (0, 32, 96, 128):
            inputs = mixed_case(hq, hkv, d, n)
            tiles = attention.prefill_tiles([q for q, _ in MIXED_PREFILLS], d, 2)
            prefill = functools.partial(attention.prefill_attention, tiles=tiles)
            whole = triton.testing.do_bench(functools.partial(prefill, **inputs, short_q_len=8))
            alone = triton.testing.do_bench(functools.partial(prefill, **_rows(inputs, 0, 2)))
            line = f"{model} {n} decode rows: the step {whole:.3f} ms, prefill rows {alone:.3f}"
            if n:
                short = _rows(inputs, 2, 2 + n)
                kv_bytes = 2 * n * DECODE_CONTEXT * hkv * d * 2
                in_prefill = triton.testing.do_bench(
                    functools.partial(attention.prefill_attention, **short, short_q_len=8)
                )
                splits = decode_splits(torch.device("cuda"), n, hkv)
                mid_o = torch.empty(n, hq, splits, d, device="cuda", dtype=torch.float32)
                mid_lse = torch.empty(n, hq, splits, device="cuda", dtype=torch.float32)
                args = (short["q"], short["k_cache"], short["v_cache"], short["kv_lens"],
                        short["page_table"], PAGE, d**-0.5, None, mid_o, mid_lse)  # fmt: skip
                decode = triton.testing.do_bench(
                    functools.partial(attention.decode_attention, *args)
                )
                line += (
                    f"; decode rows alone: prefill kernel {in_prefill:.3f} ms "
                    f"({kv_bytes / in_prefill / 1e9:.2f} TB/s), decode_attention ({splits} "
                    f"splits) {decode:.3f} ms ({kv_bytes / decode / 1e9:.2f} TB/s)"
                )
            print(line)
            del inputs
            torch.cuda.empty_cache()


# --decode: B2's decode batches (context lengths uniform in DECODE_LENGTHS, seeded by the batch
# size), and with --sweep the split-decode kernel's (key block, stages, warps) candidates.
DECODE_BATCHES = (32, 143, 256)
DECODE_LENGTHS = (100, 2048)
DECODE_BLOCKS = list(itertools.product((32, 64, 128), (2, 3, 4), (4, 8)))


def decode(models: list[str], sweep: bool) -> None:
    """Time `decode_attention` over B2's context lengths (`--decode`) against the copy
    bandwidth; with `sweep` every candidate in DECODE_BLOCKS, the three fastest printed."""
    from tokenmill.attention.triton_backend import decode_splits

    print(f"copy bandwidth (read + write, 2 GiB): {copy_tbps():.2f} TB/s")
    for model in models:
        hq, hkv, d = HEADS[model]
        for batch in DECODE_BATCHES:
            gen = torch.Generator().manual_seed(batch)
            lens = torch.randint(DECODE_LENGTHS[0], DECODE_LENGTHS[1] + 1, (batch,), generator=gen)
            k, v, table = paged_rows(lens.tolist(), hkv, d)
            splits = decode_splits(torch.device("cuda"), batch, hkv)
            mid_o = torch.empty(batch, hq, splits, d, device="cuda", dtype=torch.float32)
            mid_lse = torch.empty(batch, hq, splits, device="cuda", dtype=torch.float32)
            q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
            args = (q, k, v, lens.to("cuda", torch.int32), table, PAGE, d**-0.5, None, mid_o,
                    mid_lse)  # fmt: skip
            kv_bytes = 2 * int(lens.sum()) * hkv * d * 2

            def rate(ms: float, kv_bytes: int = kv_bytes) -> str:
                return f"{ms * 1e3:.0f} us ({kv_bytes / ms / 1e9:.2f} TB/s)"

            line = f"{model} batch {batch} ({splits} splits): {rate(_decode_ms(args, None))}"
            if sweep:
                ranked = sorted((_decode_ms(args, b), b) for b in DECODE_BLOCKS)
                ranked = [(ms, b) for ms, b in ranked if ms < float("inf")]
                line += "; fastest (key block, stages, warps): " + ", ".join(
                    f"{b} {rate(ms)}" for ms, b in ranked[:3]
                )
            print(line)
            del k, v
            torch.cuda.empty_cache()


def _decode_ms(args: tuple, blocks: tuple[int, int, int] | None) -> float:  # type: ignore[type-arg]
    """Milliseconds of `decode_attention(*args)` with `blocks` (None: its own choice); inf
    where the launch needs more shared memory than an SM has."""
    run = functools.partial(attention.decode_attention, *args, blocks=blocks)
    try:
        return triton.testing.do_bench(run)
    except triton.runtime.errors.OutOfResources:
        return float("inf")


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
    parser.add_argument(
        "--sweep", action="store_true",
        help="also time every candidate: the tiles in TILES (with --decode: DECODE_BLOCKS)",
    )  # fmt: skip
    parser.add_argument(
        "--models", nargs="+", default=list(HEADS), choices=list(HEADS),
        help="the models whose heads (query, key/value, head_dim) the cases take",
    )  # fmt: skip
    parser.add_argument("--mixed", action="store_true", help="time mixed steps instead")
    parser.add_argument(
        "--decode", action="store_true", help="time decode_attention over B2's lengths instead"
    )
    args = parser.parse_args()
    if args.mixed:
        mixed(args.models)
        return
    if args.decode:
        decode(args.models, args.sweep)
        return
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
