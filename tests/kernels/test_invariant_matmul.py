"""The batch-invariant matmul (`kernels/invariant_matmul.py`) against float64, and a row's bits
against the same row alone, in any batch and under both schedules.

Without CUDA the kernel runs in Triton's interpreter, in float32 (its bfloat16 `tl.dot` is
wrong, see test_kernels.py) and with small tiles; on a GPU with the real configuration.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels.invariant_matmul import (
    GROUP,
    SLICE,
    TOTAL,
    InvariantMatmulConfig,
    invariant_config,
    invariant_matmul,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small tiles so a few dozen rows span several row tiles, column tiles and K slices. 8 rows: the
# interpreter's `tl.dot` is NumPy's BLAS, which rounds a row differently by its place in a block
# of 16 (tensor-core MMAs compute every row alike; tests/gpu checks the real tiles).
SMALL = dict(block_m=8, block_n=16, block_k=16, num_warps=1, num_stages=1)


def _config(split_k: int, groups: int = 2) -> InvariantMatmulConfig | None:
    if DEVICE == "cuda":  # the real configuration: the interpreter is too slow for it
        return None
    return InvariantMatmulConfig(split_k=split_k, groups=groups, **SMALL)


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n)
    return tuple(t.to(DEVICE, dtype) for t in (x, w, b))


@pytest.mark.parametrize(("n", "k", "split_k"), [(40, 100, 3), (16, 64, 1), (33, 48, 5)])
def test_matches_float64(n: int, k: int, split_k: int) -> None:
    """Products with bias, ragged N, K and M, several slice counts: float64's result."""
    x, w, b = _inputs(21, n, k, torch.float32)
    out = invariant_matmul(x, w, b, _config(split_k))
    ref = x.double() @ w.double().T + b.double()
    assert (out.double() - ref).abs().max() < 1e-4 * k**0.5
    no_bias = invariant_matmul(x.view(3, 7, k), w, config=_config(split_k))
    assert no_bias.shape == (3, 7, n)
    assert (no_bias.view(21, n).double() - (ref - b.double())).abs().max() < 1e-4 * k**0.5


def test_rows_do_not_depend_on_the_row_count_or_the_schedule() -> None:
    """Every row of a product of 1..17 rows is bitwise that row alone, whether its programs
    sum one K slice (partials added by the last), one group of slices, or everything; K cut
    into 4 slices (2, 2, 2 and 1 blocks) in 2 groups."""
    n, k, rows = 40, 100, 17
    x, w, b = _inputs(rows, n, k, torch.float32, seed=1)
    cfg = _config(4)
    alone = torch.cat([invariant_matmul(x[i : i + 1], w, b, cfg) for i in range(rows)])
    for m in (3, 9, rows):
        assert torch.equal(invariant_matmul(x[:m], w, b, cfg), alone[:m]), m
        for level in (SLICE, GROUP, TOTAL):
            assert torch.equal(invariant_matmul(x[:m], w, b, cfg, level), alone[:m]), (m, level)


def test_default_config_depends_on_the_weight_shape_only() -> None:
    """Decode-sized products get enough programs to cover the GPU; big N no split."""
    qwen_down = invariant_config(1024, 3072, 132)
    assert qwen_down.slices(3072) * -(-1024 // qwen_down.block_n) >= 132
    assert invariant_config(151936, 1024, 132).slices(1024) == 1
    assert invariant_config(1024, 64, 132).slices(64) == 1  # one K block: nothing to split
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        InvariantMatmulConfig(split_k=0)
