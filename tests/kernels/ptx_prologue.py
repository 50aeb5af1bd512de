"""Compile every Triton kernel for sm_90 with PDL on (no GPU needed) and print, as JSON, the
memory instructions each kernel's PTX issues before its `griddepcontrol.wait`.

Run by `test_pdl_kernels_wait_before_touching_memory` in a subprocess, because the test
session runs Triton's interpreter, under which kernels cannot be compiled.
"""

from __future__ import annotations

import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenmill.kernels.activation import _silu_and_mul_kernel
from tokenmill.kernels.argmax import _argmax_kernel
from tokenmill.kernels.attention import (
    _decode_reduce_kernel,
    _decode_split_kernel,
    _invariant_kernel,
    _invariant_merge_kernel,
    _prefill_kernel,
    _verify_split_kernel,
)
from tokenmill.kernels.fused_moe import _down_gemv_kernel, _gate_up_gemv_kernel
from tokenmill.kernels.gemv import _gemv_dot_kernel, _gemv_kernel
from tokenmill.kernels.graph_inputs import _decode_inputs_kernel
from tokenmill.kernels.invariant_matmul import _invariant_matmul_kernel
from tokenmill.kernels.launch import DirectLaunch
from tokenmill.kernels.norm import _add_rms_norm_kernel
from tokenmill.kernels.rope_store import _rope_store_kernel

FP32_PTRS = {"mid_o_ptr", "mid_lse_ptr", "mid_ml_ptr", "part_ptr", "ss_ptr", "cos_ptr",
             "sin_ptr", "part_val_ptr", "logits_ptr"}  # fmt: skip
INT_PTRS = {"cu_q_ptr", "kv_lens_ptr", "page_table_ptr", "positions_ptr", "slots_ptr",
            "ticket_ptr", "part_idx_ptr"}  # fmt: skip
INT64_PTRS = {"tokens_ptr", "host_ptr"}
INT64_KERNELS = {"decode_inputs"}  # every pointer of these is int64
# Index pointers (INT_PTRS) of these are int64: the kernel takes int32 or int64 ones.
INT64_INDEX_KERNELS = {"invariant_int64_index"}
FLOAT_SCALARS = {"eps", "qk_scale"}
UNALIGNED = FLOAT_SCALARS | {
    "M",
    "window",
    "SPLITS",
    "split",
    "short_q_len",
    "dense_min_len",
    "stride_pt",
    "tokens",
}
# Constexprs of each kernel (USE_PDL is set for all), as the decode path of a
# qwen3-like layer uses them.
KERNELS = {
    "prefill": (_prefill_kernel, dict(
        HQ=16, HKV=8, D=128, PAGE=16, BLOCK_M=64, BLOCK_N=64, SHORT_R=16, HAS_WINDOW=False)),
    **{name: (_decode_split_kernel, dict(
        HQ=16, HKV=8, D=128, PAGE=16, BLOCK_G=16, BLOCK_N=64, HAS_WINDOW=False,
        EARLY_KV=early)) for name, early in (("decode_split", True), ("decode_split_late", False))},
    **{name: (_invariant_kernel, dict(
        HQ=16, HKV=8, D=128, PAGE=16, BLOCK_M=16, BLOCK_N=64, CHUNK=4, PARTS=16,
        HAS_WINDOW=False)) for name in ("invariant", "invariant_int64_index")},
    "invariant_merge": (_invariant_merge_kernel, dict(HQ=16, D=128, PARTS=16, BLOCK_H=16)),
    "decode_reduce": (_decode_reduce_kernel, dict(HQ=16, D=128, BLOCK_S=16)),
    "verify_split": (_verify_split_kernel, dict(
        HQ=16, HKV=8, D=128, PAGE=16, BLOCK_R=16, BLOCK_N=64, HAS_WINDOW=False)),
    "gemv": (_gemv_kernel, dict(
        BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, SPLIT_K=4, GATED=False, NORM=True, HAS_RES=True,
        PREFETCH=2, DEFER=True)),
    "gemv_dot": (_gemv_dot_kernel, dict(
        BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, GATED=True, NORM=False, HAS_RES=False,
        STAGES=4, IEEE=False)),
    "gemv_dot_normed": (_gemv_dot_kernel, dict(
        BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, GATED=False, NORM=True, HAS_RES=True,
        STAGES=4, IEEE=False)),
    **{name: (_invariant_matmul_kernel, dict(
        HAS_BIAS=not swiglu, IEEE=False, SWIGLU=swiglu, CHUNKS=chunks, ACROSS=across, TMA=tma,
        BLOCK_M=64 if tma else 16, BLOCK_N=32, BLOCK_K=128, GROUP_M=8))
        for name, swiglu, chunks, across, tma in (
            ("invariant_matmul", False, 1, False, False),
            ("invariant_matmul_swiglu", True, 1, False, False),
            ("invariant_matmul_across", True, 4, True, False),
            ("invariant_matmul_loop", False, 2, False, False),
            ("invariant_matmul_tma", False, 2, False, True),
            ("invariant_matmul_tma_across", True, 2, True, True))},
    "add_rms_norm": (_add_rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=1024)),
    "rope_store": (_rope_store_kernel, dict(
        HQ=16, HKV=8, D=128, BLOCK_G=2, BLOCK_T=1, QK_NORM=True, FRESH=False)),
    "rope_store_blocked": (_rope_store_kernel, dict(
        HQ=16, HKV=8, D=128, BLOCK_G=2, BLOCK_T=4, QK_NORM=True, FRESH=True)),
    "silu_and_mul": (_silu_and_mul_kernel, dict(BLOCK=1024)),
    "decode_inputs": (_decode_inputs_kernel, dict(BLOCK_W=128)),
    "argmax": (_argmax_kernel, dict(CHUNKS=75, BLOCK=2048, BLOCK_C=128, TO_HOST=True)),
    "moe_gate_up_gemv": (_gate_up_gemv_kernel, dict(
        TOP_K=8, EXPERTS=128, SLOTS=8, NORM=True, BLOCK_N=2, BLOCK_K=256)),
    "moe_down_gemv": (_down_gemv_kernel, dict(
        TOP_K=8, RENORMALIZE=True, EXPERTS=128, SLOTS=8, BLOCK_N=8, BLOCK_K=128)),
}  # fmt: skip
MEMORY_OP = re.compile(r"^\s*(?:@%\w+\s+)?((?:ld|st|atom|red)\.global\S*|cp\.async\.bulk\S*)")


def _type(name: str, int64: bool, int64_index: bool = False) -> str:
    if name.endswith("_ptr"):
        if int64 or name in INT64_PTRS or (int64_index and name in INT_PTRS):
            return "*i64"
        return "*fp32" if name in FP32_PTRS else "*i32" if name in INT_PTRS else "*bf16"
    return "fp32" if name in FLOAT_SCALARS else "i32"


def memory_ops_before_wait(
    launcher: DirectLaunch,
    constexprs: dict[str, object],
    int64: bool = False,
    int64_index: bool = False,
) -> list[str]:
    """The global-memory instructions of the kernel's PTX that come before its first wait."""
    kernel = launcher.jit
    constexprs = {**constexprs, "USE_PDL": True}
    signature = {
        n: "constexpr" if n in constexprs else _type(n, int64, int64_index)
        for n in kernel.arg_names
    }  # fmt: skip
    if constexprs.get("TMA"):  # x and W as tensor descriptors of their blocks
        block_k = constexprs["BLOCK_K"]
        signature["x_ptr"] = f"tensordesc<bf16[{constexprs['BLOCK_M']}, {block_k}]>"
        signature["w_ptr"] = f"tensordesc<bf16[{constexprs['BLOCK_N']}, {block_k}]>"
    # As at a real launch, pointers and sizes are specialised as multiples of 16.
    aligned = [n for n in kernel.arg_names if n not in constexprs and n not in UNALIGNED]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True})
    ops = []
    for line in compiled.asm["ptx"].splitlines():
        if "griddepcontrol.wait" in line:
            return ops
        if match := MEMORY_OP.match(line):
            ops.append(match.group(1))
    raise AssertionError(f"{kernel.fn.__name__} never waits")


if __name__ == "__main__":
    ops = {
        name: memory_ops_before_wait(k, c, name in INT64_KERNELS, name in INT64_INDEX_KERNELS)
        for name, (k, c) in KERNELS.items()
    }
    print(json.dumps(ops))
