"""Deterministic mode's matmul (`kernels/invariant_matmul.py`): each tile's bits and time.

Checks that a row's bits do not depend on the tile or on M, and times each tile next to cuBLAS.
For each product shape of qwen3-0.6b and llama-3.1-8b (LM heads included) and each M: the rows
of every tile in TILES (and of `choose_tile`'s), the 64-row and larger ones both through
pointer loads and through tensor descriptors (TMA), are compared bitwise with each row computed
alone, then each is timed as `gemv_sweep.py` times GEMVs (a CUDA graph of one product per
layer over distinct weight copies, so the weights stream from HBM as in a real step).

    python benchmarks/invariant_matmul_sweep.py --m 1 16 64 256 2048 --out sweep.json
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gemv_sweep import SHAPES, graph_seconds_per_call, sweep_main
from torch.nn import functional as F

from tokenmill.kernels.invariant_matmul import MatmulTile, choose_tile, invariant_matmul

HEADS = [("qwen3-0.6b lm_head", 151936, 1024), ("llama-3.1-8b lm_head", 128256, 4096)]
T = MatmulTile
TILES = (
    T(16, 16, 256, 4, 4), T(16, 32, 128, 4, 4), T(16, 64, 64, 4, 3), T(16, 64, 128, 4, 4),
    T(32, 64, 128, 4, 4), T(64, 64, 64, 4, 4), T(64, 64, 64, 4, 6), T(64, 64, 128, 4, 3),
    T(64, 128, 64, 8, 4), T(64, 128, 128, 8, 3), T(128, 64, 64, 8, 4), T(128, 64, 128, 8, 3),
    T(128, 128, 64, 8, 3), T(128, 128, 64, 8, 4), T(128, 256, 64, 8, 3),
)  # fmt: skip
ALONE_ROWS = 9  # rows also computed alone, spread over the M rows


def loads(tile: MatmulTile) -> tuple[bool, ...]:
    """How a tile's product may load x and W: through pointers, and for the wgmma tiles (64
    rows and more) also through tensor descriptors (TMA, on Hopper)."""
    return (False, True) if tile.block_m >= 64 else (False,)


def label(tile: MatmulTile, tma: bool) -> str:
    return f"{tuple(tile)}{' tma' if tma else ''}"


def check_bits(x: torch.Tensor, w: torch.Tensor) -> dict[str, int]:
    """Rows differing from the row computed alone, per tile and load (all zero when
    invariant)."""
    m = x.shape[0]
    picked = sorted({round(i * (m - 1) / max(ALONE_ROWS - 1, 1)) for i in range(ALONE_ROWS)})
    alone = torch.cat([invariant_matmul(x[i : i + 1], w) for i in picked])
    tiles = (*TILES, choose_tile(m, w.shape[0]))
    return {
        label(tile, tma): int(
            (invariant_matmul(x, w, tile=tile, tma=tma)[picked] != alone).any(1).sum()
        )
        for tile in tiles
        for tma in loads(tile)
    }


def time_products(
    x: torch.Tensor, weights: list[torch.Tensor]
) -> tuple[float, float, dict[str, float]]:
    """Microseconds per product of `x` with one of `weights`: cuBLAS, the chosen tile (as the
    engine loads it), each tile of TILES through each of its loads."""

    def timed(product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        return graph_seconds_per_call(lambda i: product(x, weights[i]), len(weights)) * 1e6

    tiles = {
        label(t, tma): timed(lambda a, w, t=t, tma=tma: invariant_matmul(a, w, tile=t, tma=tma))
        for t in TILES
        for tma in loads(t)
    }
    return timed(F.linear), timed(invariant_matmul), tiles


def sweep(ms: list[int]) -> list[dict[str, object]]:
    """Every shape x M: bits per tile, then cuBLAS, `choose_tile`'s tile and each tile timed."""
    rows = []
    for name, n, k in [*SHAPES, *HEADS]:
        layers = max(2, min(32, (512 << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            differing = check_bits(x, weights[0])
            cublas, chosen, tiles = time_products(x, weights)
            best = min(tiles, key=tiles.__getitem__)
            rows.append({
                "shape": name, "n": n, "k": k, "m": m, "rows_differing": differing,
                "cublas_us": cublas, "chosen_us": chosen,
                "chosen": str(tuple(choose_tile(m, n))), "best": best, "tiles_us": tiles,
            })  # fmt: skip
            print(
                f"{name:22s} M={m:5d}: cuBLAS {cublas:8.1f} us  chosen {chosen:8.1f} us  "
                f"best {tiles[best]:8.1f} us {best}  rows differing "
                f"{sum(differing.values())}",
                flush=True,
            )
        weights.clear()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    """Run the sweep and write the rows as JSON."""
    sweep_main(sweep, [1, 16, 64, 256, 2048], __doc__)


if __name__ == "__main__":
    main()
