"""Triton kernels for the GPU path; each has a torch reference in the layer that calls it.

Without triton (CPU-only installs) the names below stand for functions that raise, and the layers
never call them because their inputs are not on a CUDA device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenmill.kernels.gemv_config import GemvConfig, InputNorm

try:
    from tokenmill.kernels.activation import silu_and_mul as fused_silu_and_mul
    from tokenmill.kernels.argmax import argmax_rows
    from tokenmill.kernels.fused_moe import fused_moe
    from tokenmill.kernels.gemv import gemv, norm_gemv
    from tokenmill.kernels.invariant_matmul import invariant_matmul
    from tokenmill.kernels.norm import rms_norm
except ImportError:  # triton is not installed

    def _missing(*_: Any, **__: Any) -> Any:
        raise RuntimeError("CUDA kernels need triton: pip install triton")

    argmax_rows: Callable[..., Any] = _missing  # type: ignore[no-redef]
    fused_silu_and_mul: Callable[..., Any] = _missing  # type: ignore[no-redef]
    fused_moe: Callable[..., Any] = _missing  # type: ignore[no-redef]
    rms_norm: Callable[..., Any] = _missing  # type: ignore[no-redef]
    gemv: Callable[..., Any] = _missing  # type: ignore[no-redef]
    norm_gemv: Callable[..., Any] = _missing  # type: ignore[no-redef]
    invariant_matmul: Callable[..., Any] = _missing  # type: ignore[no-redef]


__all__ = [
    "GemvConfig",
    "InputNorm",
    "argmax_rows",
    "fused_moe",
    "fused_silu_and_mul",
    "gemv",
    "invariant_matmul",
    "norm_gemv",
    "rms_norm",
]
