"""Inside the fused decode layers (`kernels/decode_layer.py`) on a GPU: a step's layers timed
against the copy bandwidth, a launch a layer and without the L2 prefetch, one grid barrier
alone, and each stage's work and barrier wait from the programs' timer stamps.

python benchmarks/fused_decode_timeline.py --config shared/models/qwen3-0.6b [--context 640]

Random bf16 weights of the config's shapes, a paged KV cache holding `--context` positions;
every number from this process's own runs (CUDA graphs, medians of `--repeats`).
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
import triton

from tokenmill.config import ModelConfig
from tokenmill.kernels.attention import sm_count
from tokenmill.kernels.decode_layer import (
    GENERATION,
    MAX_TOKENS,
    STAMPS,
    DecodeLayerKernel,
    DecodeLayerWeights,
    DecodeStep,
    LayerDims,
    _grid_barrier,
    set_l2_prefetch,
    set_layers_per_launch,
)
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.observability.cuda_timing import median_graph_seconds

STAGE_NAMES = ("q/k/v", "attention", "o", "gate/up", "down")
MOE_STAGE_NAMES = ("q/k/v", "attention", "o", "router", "experts' gate/up", "experts' down")
PAGE = 16


@triton.jit
def _barriers_kernel(barrier_ptr, programs, rounds):
    for _ in range(rounds):
        _grid_barrier(barrier_ptr, barrier_ptr + GENERATION, programs)


def _dims(cfg: ModelConfig) -> LayerDims:
    """The kernel's layer sizes for `cfg` (a mixture of experts: its experts' sizes)."""
    moe = cfg.moe
    return LayerDims(
        cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        moe.intermediate_size if moe else cfg.intermediate_size, cfg.rms_norm_eps, PAGE,
        moe.num_experts if moe else 0, moe.top_k if moe else 0,
        moe.norm_topk_prob if moe else False,
    )  # fmt: skip


def _layer(cfg: ModelConfig, pages: int, device: torch.device) -> DecodeLayerWeights:
    """One layer of random bf16 weights of `cfg`'s shapes, with a K/V cache of `pages`."""
    d = _dims(cfg)
    h, hd, hq, hkv = d.hidden, d.head_dim, d.num_heads, d.num_kv_heads
    nqkv, ff = (hq + 2 * hkv) * hd, d.intermediate
    experts = (d.experts,) if d.experts else ()

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=torch.bfloat16)

    qk_norm = ones(hd) if cfg.qk_norm else None
    return DecodeLayerWeights(
        qkv=rand(nqkv, h), qkv_bias=rand(nqkv) if cfg.attention_bias else None, o=rand(h, hq * hd),
        gate_up=rand(*experts, 2 * ff, h), down=rand(*experts, h, ff), input_norm=ones(h),
        post_norm=ones(h), q_norm=qk_norm, k_norm=qk_norm, k_cache=rand(pages * PAGE, hkv, hd),
        v_cache=rand(pages * PAGE, hkv, hd), router=rand(d.experts, h) if d.experts else None,
    )  # fmt: skip


def _active_bytes(w: DecodeLayerWeights, d: LayerDims) -> int:
    """Weight bytes a token's step reads in a layer (a mixture of experts: its top k)."""
    mlp = w.gate_up.nbytes + w.down.nbytes
    if d.experts:
        mlp = mlp * d.top_k // d.experts + w.router.nbytes
    return w.qkv.nbytes + w.o.nbytes + mlp


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes a second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 29, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / median_graph_seconds(lambda: dst.copy_(src))


def _barrier_us(programs: int, device: torch.device, rounds: int = 1000) -> float:
    """Microseconds of one grid barrier of `programs` programs (nothing else in the kernel)."""
    words = torch.zeros(64, dtype=torch.int32, device=device)
    seconds = median_graph_seconds(
        lambda: _barriers_kernel[(programs,)](words, programs, rounds, num_warps=8)
    )
    return seconds / rounds * 1e6


def _timeline(kernel: DecodeLayerKernel, x: torch.Tensor, step: DecodeStep) -> None:
    """Each stage's work (its start to its end, per program) and the wait before it (the
    previous stage's end to its start), in microseconds over programs and layers."""
    timing = torch.zeros(kernel.programs, kernel.num_layers, STAMPS.value, dtype=torch.int64,
                         device=x.device)  # fmt: skip
    kernel.run(x, step, timing=timing)
    torch.cuda.synchronize()
    names = MOE_STAGE_NAMES if kernel.dims.experts else STAGE_NAMES
    stamps = timing[:, :, : 2 * len(names)]
    t = (stamps - stamps.min()).double() / 1e3  # us from the first stamp
    ends = t[:, :, 1::2]
    starts = t[:, :, 0::2]
    prev_end = torch.cat((ends[:, :, -1:].roll(1, dims=1), ends[:, :, :-1]), dim=2)
    print(f"timeline ({kernel.programs} programs x {kernel.num_layers} layers, us):")
    print("  stage        work mean   work max   wait mean   wait max")
    for s, name in enumerate(names):
        work = ends[:, :, s] - starts[:, :, s]
        wait = (
            (starts[:, :, s] - prev_end[:, :, s])[:, 1:]
            if s == 0
            else (starts[:, :, s] - prev_end[:, :, s])
        )  # (the first layer's q/k/v follows the kernel's start)
        print(f"  {name:<11} {work.mean():10.2f} {work.max():10.2f} {wait.mean():11.2f} "
              f"{wait.max():10.2f}")  # fmt: skip
    layer_starts = starts[:, :, 0].min(dim=0).values
    per_layer = (layer_starts[1:] - layer_starts[:-1]).tolist()
    print(f"  a layer: {statistics.median(per_layer):.2f} us (median); the step's layers "
          f"{t.max():.1f} us from the first stamp")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a model folder (its config.json)")
    parser.add_argument("--context", type=int, default=640, help="positions of the context")
    parser.add_argument("--programs", type=int, default=None, help="default: the SM count")
    args = parser.parse_args()
    device = torch.device("cuda")
    cfg = ModelConfig.from_pretrained(args.config, "bfloat16")
    programs = args.programs or sm_count(device)
    pages = -(-(args.context + 1) // PAGE) + 1
    dims = _dims(cfg)
    layers = [_layer(cfg, pages, device) for _ in range(cfg.num_layers)]
    weight_bytes = sum(_active_bytes(w, dims) for w in layers)
    rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings).to(device)

    def step_of(tokens: int) -> DecodeStep:  # the context's last `tokens` positions
        positions = torch.arange(args.context - tokens, args.context, device=device)
        return DecodeStep(
            positions=positions, slots=positions,
            kv_lens=torch.tensor([args.context], dtype=torch.int32, device=device),
            page_table=torch.arange(pages, dtype=torch.int32, device=device)[None],
            cos=rotary.cos, sin=rotary.sin,
        )  # fmt: skip

    step = step_of(1)
    x = torch.randn(MAX_TOKENS, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    copy = _copy_bandwidth(device)
    print(f"{args.config}: {cfg.num_layers} layers, {weight_bytes / 1e6:.1f} MB of weights read, "
          f"context {args.context}; copy bandwidth {copy / 1e12:.2f} TB/s; {programs} programs; "
          f"one grid barrier {_barrier_us(programs, device):.2f} us")  # fmt: skip
    rows = [("one launch", None, None, 1), ("one launch, no L2 prefetch", None, False, 1),
            ("a launch a layer", 1, None, 1)]  # fmt: skip
    if not dims.experts:  # (a mixture of experts' layers take one token)
        rows.append(("one launch, 4 tokens (verify)", None, None, 4))
    for label, per_launch, l2, tokens in rows:
        set_layers_per_launch(per_launch)
        set_l2_prefetch(l2)
        kernel = DecodeLayerKernel(dims, layers, programs)
        run = partial(kernel.run, x[:tokens], step_of(tokens))
        seconds = median_graph_seconds(run, replays=50)
        print(f"  {label:<28} {seconds * 1e6:8.1f} us a step ({seconds * 1e6 / cfg.num_layers:.2f} "
              f"a layer), {weight_bytes / seconds / copy:.0%} of the copy bandwidth "
              f"(L2 prefetch {'on' if kernel.l2_prefetch else 'off'})")  # fmt: skip
    set_layers_per_launch(None)
    set_l2_prefetch(None)
    _timeline(DecodeLayerKernel(dims, layers, programs), x[:1], step)


if __name__ == "__main__":
    main()
