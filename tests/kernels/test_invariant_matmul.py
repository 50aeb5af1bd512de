"""The batch-invariant matmul (`kernels/invariant_matmul.py`) against float64, and a row's bits
against the same row alone, in any batch and under both schedules.

Without CUDA the kernel runs in Triton's interpreter, in float32 (its bfloat16 `tl.dot` is
wrong, see test_kernels.py) and with small tiles; on a GPU with the real configuration.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels.invariant_matmul import (  # noqa: E402
    InvariantMatmulConfig,
    invariant_config,
    invariant_matmul,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small tiles so a few dozen rows span several row tiles, column tiles and K slices. 8 rows: the
# interpreter's `tl.dot` is NumPy's BLAS, which rounds a row differently by its place in a block
# of 16 (tensor-core MMAs compute every row alike; tests/gpu checks the real tiles).
SMALL = dict(block_m=8, block_n=16, block_k=16, num_warps=1, num_stages=1)


def _config(split_k: int, max_split_tiles: int = 4) -> InvariantMatmulConfig | None:
    if DEVICE == "cuda":  # the real configuration: the interpreter is too slow for it
        return None
    return InvariantMatmulConfig(split_k=split_k, max_split_tiles=max_split_tiles, **SMALL)


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n)
    return tuple(t.to(DEVICE, dtype) for t in (x, w, b))


@pytest.mark.parametrize(("n", "k", "split_k"), [(40, 100, 3), (16, 64, 1), (33, 48, 5)])
def test_matches_float64(n: int, k: int, split_k: int) -> None:
    """Products with bias, ragged N, K and M, every split count: float64's result."""
    x, w, b = _inputs(21, n, k, torch.float32)
    out = invariant_matmul(x, w, b, _config(split_k))
    ref = x.double() @ w.double().T + b.double()
    assert (out.double() - ref).abs().max() < 1e-4 * k**0.5
    no_bias = invariant_matmul(x.view(3, 7, k), w, config=_config(split_k))
    assert no_bias.shape == (3, 7, n)
    assert (no_bias.view(21, n).double() - (ref - b.double())).abs().max() < 1e-4 * k**0.5


def test_rows_do_not_depend_on_the_row_count() -> None:
    """Every row of a product of 1..40 rows is bitwise that row alone, across the switch from
    parallel K slices (few tiles) to slices run in turn (more tiles than `max_split_tiles`)."""
    n, k, rows = 40, 100, 40
    x, w, b = _inputs(rows, n, k, torch.float32, seed=1)
    cfg = _config(3)
    alone = torch.cat([invariant_matmul(x[i : i + 1], w, b, cfg) for i in range(rows)])
    for m in (2, 5, 16, 17, 33, rows):
        assert torch.equal(invariant_matmul(x[:m], w, b, cfg), alone[:m]), m


@pytest.mark.parametrize("split_k", [2, 4])
def test_both_schedules_give_the_same_bits(split_k: int) -> None:
    """K slices in parallel programs (partials added by the last one) and in one program, in
    turn: bitwise the same output."""
    x, w, b = _inputs(24, 48, 96, torch.float32, seed=2)
    serial = invariant_matmul(x, w, b, _config(split_k, max_split_tiles=0))
    parallel = invariant_matmul(x, w, b, _config(split_k, max_split_tiles=1 << 20))
    assert torch.equal(serial, parallel)


def test_default_config_depends_on_the_weight_shape_only() -> None:
    """Decode-sized products get enough programs to cover the GPU; big N no split."""
    qwen_down = invariant_config(1024, 3072, 132)
    assert qwen_down.splits(3072) * -(-1024 // qwen_down.block_n) >= 132
    assert invariant_config(151936, 1024, 132).splits(1024) == 1
    assert invariant_config(1024, 64, 132).splits(64) == 1  # one K block: nothing to split
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        InvariantMatmulConfig(split_k=0)
