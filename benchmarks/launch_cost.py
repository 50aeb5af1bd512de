"""Host time of a Triton launch: Triton's own path against the direct launch (`kernels/launch.py`).

The engine's add + RMSNorm and SwiGLU wrappers (`rms_norm`, `silu_and_mul`: the output's
allocation, launch options and the kernel's launch) at a prefill step's shapes (qwen3-0.6b's
hidden and intermediate sizes, 16 rows), host microseconds a call with direct launches off
(`set_direct_launches(False)`: Triton's `JITFunction.run`, its binder, specialisation, key and
launch metadata) and on (our key, the compiled kernel's launcher). Each row: the median over 5
rounds of the mean of 2,000 calls, in a warmed loop, the device synchronised only between
rounds.

    python benchmarks/launch_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import triton

from tokenmill.kernels.activation import silu_and_mul
from tokenmill.kernels.launch import set_direct_launches
from tokenmill.kernels.norm import rms_norm

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
    res, w = torch.randn_like(x), torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(ROWS, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    rows = {
        "rms_norm(x, w, eps, residual)": lambda: rms_norm(x, w, 1e-6, res),
        "silu_and_mul(g)": lambda: silu_and_mul(g),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for name, launch in rows.items():
        for direct in (False, True):
            set_direct_launches(direct)
            how = "direct launch" if direct else "Triton's launch"
            print(f"launch {name}, {how}: {host_us(launch):.1f} us")
    print(f"launch torch.empty_like (for scale): {host_us(lambda: torch.empty_like(x)):.1f} us")


if __name__ == "__main__":
    main()
