"""Time the fused MoE kernels on one model's expert shapes, as they run in a CUDA graph.

For each batch size T: routing + sort (`route_and_align`, one program) against torch's ops
(`select_experts` + `align_block_size`), and the two expert GEMMs under each candidate tile
config (the table's and its neighbours), over distinct weight copies per layer (so weights
stream from HBM as in a decode step). Prints µs per layer and the GB/s of the experts actually
touched. For small batches also the GEMV kernels (`experts_gemv`), whose time includes the
routing (each program routes its token) and the RMSNorm of the input: each gate/up and down
candidate on its own (µs only), then pairs of both in a step's order (µs and GB/s), to compare
with the grouped GEMMs' time plus the route+sort kernel's. Use it to revise
`moe_routing.MOE_CONFIGS`, `MOE_GEMV_CONFIG`, `fused_moe.GEMV_MAX_TOKENS` and
`ROUTE_ALIGN_MAX_TOKENS`.

    python benchmarks/moe_sweep.py --config shared/models/qwen3-30b-a3b --out moe.json
"""

from __future__ import annotations

import argparse
import json

import torch

from tokenmill.config import ModelConfig
from tokenmill.kernels.fused_moe import (
    GEMV_MAX_TOKENS,
    experts_down_gemv,
    experts_gate_up_gemv,
    experts_gemv,
    fused_experts,
    route_and_align,
)
from tokenmill.kernels.gemv_config import InputNorm
from tokenmill.kernels.moe_routing import (
    MOE_CONFIGS,
    MOE_GEMV_CONFIG,
    MoeGemvConfig,
    MoeKernelConfig,
    SortedPairs,
    align_block_size,
    moe_config_for,
    select_experts,
)
from tokenmill.observability.cuda_timing import median_graph_seconds

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
# Gate/up candidates and down candidates (`down_*`); each kernel is timed on its own, so the
# best of each can be combined.
GATE_UP_CANDIDATES = (
    MOE_GEMV_CONFIG,
    *(MoeGemvConfig(n, k, num_warps=w)
      for n, k, w in ((1, 256, 4), (1, 512, 4), (2, 128, 4), (2, 512, 4), (2, 512, 8),
                      (4, 256, 4), (4, 256, 8), (4, 128, 4))),
)  # fmt: skip
_DOWN_TILES = ((4, 128, 4), (2, 128, 4), (2, 256, 4), (4, 64, 4), (8, 64, 4), (16, 128, 8),
               (1, 256, 4), (16, 64, 8))  # fmt: skip
DOWN_CANDIDATES = (
    MOE_GEMV_CONFIG,
    *(MoeGemvConfig(2, 256, down_block_n=n, down_block_k=k, down_num_warps=w)
      for n, k, w in _DOWN_TILES),
)  # fmt: skip
# Both kernels together (`experts_gemv`), as a step runs them one after the other.
COMBOS = (
    MOE_GEMV_CONFIG,
    MoeGemvConfig(2, 256, down_block_n=4),
    MoeGemvConfig(4, 256, down_block_n=4),
)
GEMV_SWEEP_MAX_TOKENS = 8  # the GEMV path is timed up to here (used up to GEMV_MAX_TOKENS)
EXTRA = (
    MoeKernelConfig(16, 32, 128, num_warps=4, num_stages=4),
    MoeKernelConfig(16, 64, 256, num_warps=4, num_stages=3),
    MoeKernelConfig(16, 128, 64, num_warps=4, num_stages=4),
    MoeKernelConfig(32, 128, 64, num_warps=4, num_stages=3),
    MoeKernelConfig(64, 64, 64, num_warps=4, num_stages=3),
    MoeKernelConfig(128, 128, 64, num_warps=8, num_stages=3),
)


def _time_route(logits: list[torch.Tensor], top_k: int, renorm: bool, bm: int) -> dict:
    """µs per layer of routing + sort: the one-program kernel and torch's ops."""

    def kernel() -> None:
        for lg in logits:
            route_and_align(lg, top_k, renorm, bm)

    def ops() -> None:
        for lg in logits:
            _, ids = select_experts(lg, top_k, renorm)
            align_block_size(ids, lg.shape[1], bm)

    n = len(logits)
    return {
        "route_kernel_us": 1e6 * median_graph_seconds(kernel) / n,
        "route_torch_us": 1e6 * median_graph_seconds(ops) / n,
    }


def _time_experts(
    x: torch.Tensor, gate_up: list[torch.Tensor], down: list[torch.Tensor],
    logits: torch.Tensor, top_k: int, renorm: bool, table: MoeKernelConfig,
) -> list[dict]:  # fmt: skip
    """Each candidate config's µs per layer and GB/s of the touched experts (correct ones
    only), fastest first; the GEMV configs route and norm their input too."""
    weights, ids = select_experts(logits, top_k, renorm)
    e, i, h = down[0].shape[0], down[0].shape[2], x.shape[1]
    touched_bytes = int(torch.unique(ids).numel()) * 3 * h * i * x.element_size()
    reference = fused_experts(x, gate_up[0], down[0], weights, align_block_size(ids, e, 16),
                              moe_config_for(1)).float()  # fmt: skip
    timings = []
    for c in dict.fromkeys([table, *MOE_CONFIGS.values(), *EXTRA]):
        pairs = align_block_size(ids, e, c.block_m)
        try:
            got = fused_experts(x, gate_up[0], down[0], weights, pairs, c).float()
        except Exception as exc:  # a config that does not build on this GPU
            print(f"T={x.shape[0]} {c}: failed ({type(exc).__name__})")
            continue
        if not torch.allclose(got, reference, rtol=0.05, atol=0.05 * reference.abs().max()):
            print(f"T={x.shape[0]} {c}: wrong result")
            continue

        def run(c: MoeKernelConfig = c, pairs: SortedPairs = pairs) -> None:
            for gu, dn in zip(gate_up, down, strict=True):
                fused_experts(x, gu, dn, weights, pairs, c)

        us = 1e6 * median_graph_seconds(run) / len(gate_up)
        in_use = c == table and x.shape[0] > GEMV_MAX_TOKENS
        timings.append({"config": str(c), "us": us, "in_use": in_use,
                        "GBps": touched_bytes / us / 1e3})  # fmt: skip
    if x.shape[0] <= GEMV_SWEEP_MAX_TOKENS:
        timings += _time_gemv_kernels(
            x, gate_up, down, logits, top_k, renorm, reference, touched_bytes
        )
    return sorted(timings, key=lambda r: r["us"])


def _time_gemv_kernels(
    x: torch.Tensor, gate_up: list[torch.Tensor], down: list[torch.Tensor],
    logits: torch.Tensor, top_k: int, renorm: bool, reference: torch.Tensor,
    touched_bytes: int,
) -> list[dict]:  # fmt: skip
    """The small-batch kernels: each gate/up and each down candidate timed on its own (µs per
    layer, no GB/s: each reads its share of the experts), checked together with the other
    kernel's config in use; then each of COMBOS, both kernels in a step's order ("both": µs
    and GB/s; `MOE_GEMV_CONFIG`'s row is the one in use)."""
    # x has unit RMS (`main`): a norm of weight 1 and eps 0 leaves it as the reference has it.
    norm = InputNorm(torch.ones(x.shape[1], device=x.device, dtype=x.dtype), 0.0, None)
    h = experts_gate_up_gemv(x, gate_up[0], logits, top_k, MOE_GEMV_CONFIG, norm)

    def wrong(got: torch.Tensor, label: str) -> bool:
        bad = not torch.allclose(got, reference, rtol=0.05, atol=0.05 * reference.abs().max())
        if bad:
            print(f"T={x.shape[0]} {label}: wrong result")
        return bad

    timings = []
    for kind, candidates in (("gate_up", GATE_UP_CANDIDATES), ("down", DOWN_CANDIDATES)):
        for g in dict.fromkeys(candidates):
            up_config, down_config = (
                (g, MOE_GEMV_CONFIG) if kind == "gate_up" else (MOE_GEMV_CONFIG, g)
            )
            got = experts_down_gemv(
                experts_gate_up_gemv(x, gate_up[0], logits, top_k, up_config, norm),
                down[0], logits, top_k, renorm, down_config,
            ).float()  # fmt: skip
            if wrong(got, f"{kind} {g}"):
                continue

            def run(g: MoeGemvConfig = g, kind: str = kind) -> None:
                for gu, dn in zip(gate_up, down, strict=True):
                    if kind == "gate_up":
                        experts_gate_up_gemv(x, gu, logits, top_k, g, norm)
                    else:
                        experts_down_gemv(h, dn, logits, top_k, renorm, g)

            us = 1e6 * median_graph_seconds(run) / len(gate_up)
            timings.append({"config": str(g), "kernel": kind, "us": us, "in_use": False})
            print(f"T={x.shape[0]} {kind} {us:.2f} us {g}")
    for g in dict.fromkeys(COMBOS):

        def both(g: MoeGemvConfig = g) -> None:
            for gu, dn in zip(gate_up, down, strict=True):
                experts_gemv(x, gu, dn, logits, top_k, renorm, g, norm)

        got = experts_gemv(x, gate_up[0], down[0], logits, top_k, renorm, g, norm).float()
        if wrong(got, f"both {g}"):
            continue
        us = 1e6 * median_graph_seconds(both) / len(gate_up)
        in_use = g == MOE_GEMV_CONFIG and x.shape[0] <= GEMV_MAX_TOKENS
        timings.append({"config": str(g), "kernel": "both", "us": us, "in_use": in_use,
                        "GBps": touched_bytes / us / 1e3})  # fmt: skip
        print(f"T={x.shape[0]} both {us:.2f} us {g}")
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a mixture-of-experts config.json dir")
    parser.add_argument("--layers", type=int, default=4, help="weight copies timed in turn")
    parser.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    parser.add_argument("--out", default=None, help="write the measurements as JSON")
    args = parser.parse_args()
    cfg = ModelConfig.from_pretrained(args.config, "bfloat16")
    if cfg.moe is None:
        raise SystemExit(f"{args.config} is not a mixture-of-experts model")
    moe, dev, dt = cfg.moe, torch.device("cuda"), torch.bfloat16
    e, h, i, k = moe.num_experts, cfg.hidden_size, moe.intermediate_size, moe.top_k
    gate_up = [torch.randn(e, 2 * i, h, device=dev, dtype=dt) * h**-0.5 for _ in range(args.layers)]
    down = [torch.randn(e, h, i, device=dev, dtype=dt) * i**-0.5 for _ in range(args.layers)]
    results = []
    for t in args.batches:
        x = torch.randn(t, h, device=dev)
        x = (x / x.pow(2).mean(dim=-1, keepdim=True).sqrt()).to(dt)  # unit RMS
        logits = [torch.randn(t, e, device=dev, dtype=dt) for _ in range(args.layers)]
        table = moe_config_for(t)
        row = {"tokens": t, "table": str(table)}
        row |= _time_route(logits, k, moe.norm_topk_prob, table.block_m)
        _, ids = select_experts(logits[0], k, moe.norm_topk_prob)
        row["experts_touched"] = int(torch.unique(ids).numel())
        row["experts"] = timings = _time_experts(
            x, gate_up, down, logits[0], k, moe.norm_topk_prob, table
        )
        results.append(row)
        best = next(r for r in timings if r.get("kernel", "both") == "both")  # whole layers
        mine = next((r for r in timings if r["in_use"]), None)
        print(
            f"T={t}: route+sort kernel {row['route_kernel_us']:.1f} us, torch "
            f"{row['route_torch_us']:.1f} us | experts ({row['experts_touched']} touched) best "
            f"{best['us']:.1f} us {best['GBps']:.0f} GB/s {best['config']}; in use "
            + (f"{mine['us']:.1f} us {mine['GBps']:.0f} GB/s" if mine else "failed")
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
