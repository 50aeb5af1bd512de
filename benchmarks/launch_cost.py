"""Host time of a Triton launch: Triton's own path against the direct launch (`kernels/launch.py`).

For the engine's add + RMSNorm and SwiGLU kernels at a prefill step's shapes (qwen3-0.6b's
hidden size), the microseconds of host time per launch through Triton's `JITFunction.run`
(binder, specialisation, key, launch metadata) and through `DirectLaunch` (our key, the
compiled kernel's launcher), then the engine's wrappers (`rms_norm`, `silu_and_mul`: the
output's allocation and launch options included). Each row: the median over 5 rounds of the
mean of 2,000 launches, in a warmed loop, the device synchronised only between rounds.

    python benchmarks/launch_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import triton

from tokenmill.kernels.activation import _silu_and_mul_kernel, silu_and_mul
from tokenmill.kernels.norm import _add_rms_norm_kernel, rms_norm
from tokenmill.kernels.pdl import pdl_options

HIDDEN, INTERMEDIATE, ROWS = 1024, 3072, 16


def host_us(launch: Callable[[], object], calls: int = 2000, rounds: int = 5) -> float:
    """Median over `rounds` of the mean host microseconds of `calls` calls of `launch`."""
    for _ in range(50):
        launch()
    means = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            launch()
        means.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(means)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res, out, w = torch.randn_like(x), torch.empty_like(x), torch.ones(HIDDEN, device="cuda")
    w = w.to(torch.bfloat16)
    g = torch.randn(ROWS, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    g_out = torch.empty(ROWS, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    pdl = pdl_options(x.device)
    norm_args = (x, res, w, out, x.stride(0), res.stride(0), out.stride(0), HIDDEN, 1e-6)
    norm_opts = dict(HAS_RESIDUAL=True, BLOCK=HIDDEN, num_warps=4, **pdl)
    block = min(triton.next_power_of_2(INTERMEDIATE), 1024)
    silu_grid = (ROWS, triton.cdiv(INTERMEDIATE, block))
    silu_args = (g, g_out, g.stride(0), g_out.stride(0), INTERMEDIATE)
    rows = {
        "add + RMSNorm kernel, Triton's launch": lambda: _add_rms_norm_kernel.jit[(ROWS,)](
            *norm_args, **norm_opts
        ),
        "add + RMSNorm kernel, direct launch": lambda: _add_rms_norm_kernel[(ROWS,)](
            *norm_args, **norm_opts
        ),
        "SwiGLU kernel, Triton's launch": lambda: _silu_and_mul_kernel.jit[silu_grid](
            *silu_args, BLOCK=block, **pdl
        ),
        "SwiGLU kernel, direct launch": lambda: _silu_and_mul_kernel[silu_grid](
            *silu_args, BLOCK=block, **pdl
        ),
        "rms_norm(x, w, eps, residual) wrapper": lambda: rms_norm(x, w, 1e-6, res),
        "silu_and_mul(g) wrapper": lambda: silu_and_mul(g),
        "torch.empty_like (for scale)": lambda: torch.empty_like(x),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for name, launch in rows.items():
        print(f"launch {name}: {host_us(launch):.1f} us")


if __name__ == "__main__":
    main()
