"""Batch-invariant matrix products: a row's result does not depend on how many rows come with it.

A BLAS picks its kernel, blocking and K split by the matrix shape, so one row of `x @ W^T` can
round differently in a batch of 1, of 7 and of 300 (measured on the CPU: MKL's float32 GEMM
differs for every M tried, `tests/determinism/test_invariant_ops.py`). Deterministic mode
(`--deterministic`) sends every product of the model through `invariant_linear`:

- **CPU**: `x` is cut into tiles of `TILE_ROWS` rows (the last padded with zeros) and
  multiplied as one batched product of identical `[TILE_ROWS, K] x [K, N]` shapes, so every
  row goes through the same kernel with the same blocking, wherever it sits in its tile.
- **CUDA**: `kernels.invariant_matmul`, a Triton matmul whose every output element is one
  accumulator chain per chunk of K (chunks set by the weight's shape), the chunks added in
  order, whatever the tile and wherever the chunks run (both chosen by M for speed). cuBLAS
  is not usable here even without split-K: on an H200 it picks its kernel by the row count
  at real model shapes, and rows round differently in different batches
  (session 12). cuBLAS products left in the mode (the torch attention backend's blocked
  attention) run with split-K and reduced-precision reductions off
  (`configure_invariant_cublas`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.kernels import invariant_matmul

logger = logging.getLogger(__name__)

# Rows per tile of the CPU product, by dtype. float32 (MKL): 16, where a tile costs about what
# one row does (measured: [16, 384] x [384, 1024] 0.23 ms, one row 0.06 ms, 512 rows in tiles
# 1.6x F.linear). 16-bit types on a CPU without bf16 instructions are compute-bound (a tile of
# 16 rows costs 12x one row): 4, so a decode row pays 4x, not 16x.
TILE_ROWS = {torch.float32: 16}
HALF_TILE_ROWS = 4

# Elements per call of a CPU pointwise function in `invariant_pointwise`: a multiple of every
# vector loop's stride (2 x 32 lanes) and below torch's parallel grain (32768), so one thread
# runs each piece, all of it through the vectorised loop.
POINTWISE_PIECE = 16384

# cuBLAS without a workspace cannot split K (vLLM's batch-invariant settings for Hopper).
_CUBLAS_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` with each row's result independent of the other rows of `x`.

    `swiglu`: `weight`'s rows interleave an MLP's gate and up projections (gate j, up j, ...;
    no bias), and the result is `silu(gate) * up` (on CUDA applied as the product stores its
    result, `kernels.invariant_matmul`)."""
    if swiglu and bias is not None:
        raise ValueError("invariant_linear with swiglu takes no bias")
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if x.is_cuda:
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        out = invariant_matmul(rows, weight, bias, swiglu=swiglu)
    else:
        out = _tiled_product(rows, weight, bias)
        if swiglu:
            gate, up = out.view(out.shape[0], -1, 2).unbind(-1)
            out = invariant_swiglu(gate, up)
    return out.view(*shape[:-1], out.shape[-1])


def _tiled_product(
    flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The CPU product: `flat` in tiles of TILE_ROWS rows, one batched product of them all."""
    rows, k = flat.shape
    tile = TILE_ROWS.get(flat.dtype, HALF_TILE_ROWS)
    pad = -rows % tile
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, k)])
    tiles = flat.view(-1, tile, k)
    # One weight for every tile (a stride-0 batch dimension: no copies).
    out = torch.bmm(tiles, weight.t().unsqueeze(0).expand(tiles.shape[0], -1, -1))
    out = out.view(-1, weight.shape[0])[:rows]
    return out + bias if bias is not None else out


def invariant_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` on the CPU, each element's SiLU independent of the tensor's size."""
    return invariant_pointwise(F.silu, gate) * up


def invariant_pointwise(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """`fn(x)` for a pointwise `fn` (exp, SiLU, sigmoid) whose value at an element does not
    depend on where the element sits in `x`.

    On the CPU torch runs the vectorised form of such a function over most of a tensor and its
    scalar form over the tail of each thread's share, and the two can differ in the last bit
    (measured: float32 SiLU and sigmoid, bfloat16 rsqrt); which elements fall in a tail depends
    on the tensor's size, so on the batch. Here every element goes through the vectorised
    loop: the flattened input is padded to whole pieces of `POINTWISE_PIECE` elements, each
    passed to `fn` on its own. CUDA kernels compute every element alike: `fn(x)` as it is.
    """
    if x.is_cuda:
        return fn(x)
    # Contiguous: a strided view that flattens without a copy (every other element of a row)
    # would otherwise reach `fn` strided whenever no padding copies it, and torch's strided
    # loop rounds differently.
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    pad = -n % POINTWISE_PIECE
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    out = torch.cat([fn(piece) for piece in flat.split(POINTWISE_PIECE)])
    return out[:n].view(x.shape)


def configure_invariant_cublas() -> None:
    """Make this process's cuBLAS products batch-invariant: no split-K (no workspace), no
    reduced-precision reductions. Warns when CUDA was in use before and the variables were not
    set by the caller: cuBLAS may have read the old ones already."""
    missing = {k: v for k, v in _CUBLAS_ENV.items() if os.environ.get(k) != v}
    if missing and torch.cuda.is_initialized():
        logger.warning(
            "deterministic: CUDA was in use before the engine set %s; if this process ran a "
            "cuBLAS product already, cuBLAS keeps its split-K workspace and products may "
            "depend on the batch. Set them in the environment before starting the process.",
            " ".join(f"{k}={v}" for k, v in missing.items()),
        )
    os.environ.update(_CUBLAS_ENV)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # no TF32 for float32 models


def make_batch_invariant(model: nn.Module) -> int:
    """Switch every layer of `model` that has a batch-invariant path (`batch_invariant`
    attribute: linear layers, the LM head, mixture-of-experts blocks) onto it, and let every
    SwiGLU MLP (`fuse_swiglu`) apply its activation inside its gate/up product. Returns how
    many layers were switched."""
    switched = 0
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True
            switched += 1
        if hasattr(module, "fuse_swiglu"):
            module.fuse_swiglu()
    return switched
