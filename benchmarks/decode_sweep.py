"""Split-KV decode attention at large batch: every (splits, BLOCK_N, warps, stages) of the split
kernel on random paged K/V, for Qwen3-0.6B's and Llama-3.1-8B's heads, batch 64 and 256,
contexts 512 and 2,048; prints the fastest configs and the one `decode_attention` uses, with
the K/V bytes each read per second.

    PYTHONPATH=$PWD python benchmarks/decode_sweep.py
"""

from __future__ import annotations

import itertools

import torch
import triton
from triton.testing import do_bench

from tokenmill.attention.triton_backend import decode_splits
from tokenmill.kernels.attention import _LOG2E, _decode_split_kernel, decode_block_n, one_wave
from tokenmill.kernels.pdl import pdl_options

HEAD_DIM, PAGE = 128, 16
MODELS = {"qwen3-0.6b": (16, 8), "llama-3.1-8b": (32, 8)}  # (query heads, KV heads)


def paged_case(hq: int, hkv: int, batch: int, ctx: int, device: torch.device) -> tuple:
    """Random q and paged K/V of `batch` sequences of `ctx` tokens (pages in random order)."""
    pages = batch * (ctx // PAGE)
    k = torch.randn((pages + 1) * PAGE, hkv, HEAD_DIM, device=device, dtype=torch.bfloat16)
    table = (torch.randperm(pages, device=device) + 1).view(batch, -1).int()
    kv_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    q = torch.randn(batch, hq, HEAD_DIM, device=device, dtype=torch.bfloat16)
    return q, k, torch.randn_like(k), table, kv_lens


def time_config(case: tuple, hq: int, hkv: int, config: tuple[int, int, int, int]) -> float:
    """Microseconds of one split-kernel launch with `config` (splits, BLOCK_N, warps, stages)."""
    q, k, v, table, kv_lens = case
    splits, block_n, warps, stages = config
    batch = q.shape[0]
    mid_o = torch.empty(batch, hq, splits, HEAD_DIM, device=q.device)
    mid_lse = torch.empty(batch, hq, splits, device=q.device)

    def run() -> None:
        _decode_split_kernel[(batch, hkv, splits)](
            q, k, v, mid_o, mid_lse, kv_lens, table, table.stride(0), HEAD_DIM**-0.5 * _LOG2E, 0,
            HQ=hq, HKV=hkv, D=HEAD_DIM, PAGE=PAGE, SPLITS=splits,
            BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)), BLOCK_N=block_n,
            HAS_WINDOW=False, EARLY_KV=False, num_warps=warps, num_stages=stages,
            **pdl_options(q.device),
        )  # fmt: skip

    return do_bench(run, warmup=5, rep=30) * 1e3


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    for (name, (hq, hkv)), batch, ctx in itertools.product(MODELS.items(), (64, 256), (512, 2048)):
        case = paged_case(hq, hkv, batch, ctx, device)
        gigabytes = batch * ctx * hkv * HEAD_DIM * 2 * 2 / 1e9
        splits = decode_splits(device, batch, hkv)
        used = (splits, decode_block_n(one_wave(device, batch * hkv * splits)), 4, 2)
        configs = itertools.product({1, 2, splits}, (32, 64, 128), (4, 8), (2, 3, 4))
        times = sorted((time_config(case, hq, hkv, c), c) for c in {*configs, used})
        ours = next(t for t, c in times if c == used)
        best = ", ".join(f"{c} {t:.1f} us" for t, c in times[:3])
        print(f"{name} batch {batch} context {ctx}: used {used} {ours:.1f} us "
              f"({gigabytes / ours * 1e6:.0f} GB/s); fastest {best}")  # fmt: skip


if __name__ == "__main__":
    main()
