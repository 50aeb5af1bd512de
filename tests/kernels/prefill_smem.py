"""Compile the prefill kernel for sm_90 (no GPU needed) with the tile `prefill_tiles` picks for
long batches, for each head_dim and element size, and its launch for short rows with the largest
block of them, and the split-decode kernel with the key block `decode_blocks` picks for large
batches, and print, as JSON, the shared memory each compile needs: Triton refuses a launch
needing more than the SM has.

Run by `test_prefill_tiles_fit_in_shared_memory` in a subprocess (the test session runs
Triton's interpreter, under which kernels cannot be compiled).
"""

from __future__ import annotations

import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tests.kernels.ptx_prologue import INT_PTRS, UNALIGNED
from tokenmill.attention.triton_backend import VERIFY_MAX_ACC
from tokenmill.kernels.attention import (
    SHORT_PREFILL_TILES,
    _decode_split_kernel,
    _prefill_kernel,
    decode_blocks,
    prefill_tiles,
)
from tokenmill.kernels.launch import DirectLaunch

# The largest of each kind: the wide tile in bf16 (head_dim 128) and in float32 (64), the
# narrow one and the short rows' launch in float32 with head_dim 256 (the other cases need
# less; ~20 s a compile).
CASES = [(128, 2, False), (64, 4, False), (256, 4, False), (256, 4, True)]
# The split-decode kernel's 128-key block in 3 stages: the largest row it is picked for.
DECODE_CASES = [(128, 2)]


def shared_bytes(head_dim: int, itemsize: int, short: bool) -> int:
    """Shared memory of the prefill kernel compiled with the long-batch tile for heads of
    `head_dim` elements of `itemsize` bytes, or (`short`) for short rows, the largest block of
    them."""
    tiles = SHORT_PREFILL_TILES if short else prefill_tiles([8192] * 4, head_dim, itemsize)
    element = "*bf16" if itemsize == 2 else "*fp32"
    constexprs = dict(
        HQ=32, HKV=8, D=head_dim, PAGE=16, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        SHORT_R=VERIFY_MAX_ACC // head_dim if short else 0, HAS_WINDOW=False, USE_PDL=True,
    )  # fmt: skip
    options = {"launch_pdl": True, "num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    return _shared(_prefill_kernel, constexprs, element, options)


def decode_shared_bytes(head_dim: int, itemsize: int) -> int:
    """Shared memory of the split-decode kernel compiled with a large batch's key block and
    stages (`decode_blocks` without early K/V) for heads of `head_dim` x `itemsize` bytes."""
    block_n, stages = decode_blocks(head_dim, itemsize, early_kv=False)
    constexprs = dict(
        HQ=32, HKV=8, D=head_dim, PAGE=16, BLOCK_G=16, BLOCK_N=block_n, HAS_WINDOW=False,
        EARLY_KV=False, USE_PDL=True,
    )  # fmt: skip
    element = "*bf16" if itemsize == 2 else "*fp32"
    options = {"launch_pdl": True, "num_warps": 4, "num_stages": stages}
    return _shared(_decode_split_kernel, constexprs, element, options)


def _shared(
    launcher: DirectLaunch, constexprs: dict[str, int], element: str, options: dict[str, int]
) -> int:
    """Shared memory of the kernel compiled for sm_90 with `constexprs`, its data pointers of
    type `element` (the split scratch float32) and launch `options`."""
    kernel = launcher.jit
    signature = {
        n: "constexpr" if n in constexprs
        else "*i32" if n in INT_PTRS else "*fp32" if n.startswith("mid_")
        else element if n.endswith("_ptr")
        else "fp32" if n == "qk_scale" else "i32"
        for n in kernel.arg_names
    }  # fmt: skip
    aligned = [n for n in kernel.arg_names if n not in constexprs and n not in UNALIGNED]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared


if __name__ == "__main__":
    print(
        json.dumps(
            {f"{d},{size},{short}": shared_bytes(d, size, short) for d, size, short in CASES}
            | {f"decode {d},{size}": decode_shared_bytes(d, size) for d, size in DECODE_CASES}
        )
    )
