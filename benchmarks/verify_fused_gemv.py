"""A/B of the start-up tuning's choice for verify steps: `spec_host_time.py` with the 8-row
bucket of every normed and gated layer (q/k/v and gate/up behind an RMSNorm, down behind SwiGLU)
forced to the fastest tensor-core GEMV with its input transform inside, whatever cuBLAS's time.

The tuning times each layer's product with its norm or SwiGLU kernel in front (cuBLAS or an
unfused GEMV) against the fused GEMV, in a CUDA graph of same-shape products; on the H200 it
kept Qwen3-0.6B's 8-row bucket unfused, so a 5-token verify step runs 85 norm and SiLU kernels
a plain step does not (docs/perf-notes.md, sessions 19-20). This shows whether the step, where
those kernels sit between others under PDL, is faster with them fused. Run it with an empty
tuning cache of its own (`XDG_CACHE_HOME`), or the cached choice is read, not the forced one:

    XDG_CACHE_HOME=/tmp/forced python benchmarks/verify_fused_gemv.py --config DIR --device cuda
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

import tokenmill.kernels.gemv_tuning as gemv_tuning
from tokenmill.kernels import GemvConfig, InputNorm, gemv, norm_gemv
from tokenmill.observability.cuda_timing import median_graph_seconds

BUCKET = 8
_tuned = gemv_tuning.fastest_gemv


def fused_dot_gemv(
    weights: list[torch.Tensor],
    buckets: Sequence[int],
    kind: gemv_tuning.InputKind,
    threads: int = 1,
) -> gemv_tuning.BucketTimings:
    """`fastest_gemv`, except that the BUCKET rows of a normed or gated layer take the fastest
    fused tensor-core candidate; prints both choices."""
    chosen = _tuned(weights, buckets, kind, threads)
    if BUCKET not in chosen or kind == "plain":
        return chosen
    choice, seconds, cublas = chosen[BUCKET]
    w0, timed = weights[0], gemv_tuning.timed_weights(weights)
    x = torch.randn(BUCKET, w0.shape[1] * (2 if kind == "gated" else 1), dtype=w0.dtype,
                    device=w0.device)  # fmt: skip
    residual = torch.randn(BUCKET, w0.shape[1], dtype=w0.dtype, device=w0.device)
    norm = InputNorm(torch.ones(w0.shape[1], dtype=w0.dtype, device=w0.device), 1e-6, residual)

    def run(w: torch.Tensor, config: GemvConfig) -> torch.Tensor:
        return norm_gemv(x, w, config, norm)[0] if kind == "normed" else gemv(x, w, config, True)

    times = {
        config: median_graph_seconds(lambda c=config: [run(w, c) for w in timed]) / len(timed)
        for config in gemv_tuning.GEMV_CANDIDATES
        if config.dot and config.serves(BUCKET)
    }
    best = min(times, key=times.__getitem__)
    tuned = f"tuned {choice or 'cuBLAS'} {seconds * 1e6:.1f} us, cuBLAS {cublas * 1e6:.1f}"
    forced = f"forced {best} {times[best] * 1e6:.1f} us"
    print(f"{tuple(w0.shape)} {kind} M<={BUCKET}: {tuned}; {forced}")
    return {**chosen, BUCKET: (gemv_tuning.GemvChoice(best, True), times[best], cublas)}


if __name__ == "__main__":
    gemv_tuning.fastest_gemv = fused_dot_gemv
    script = Path(__file__).with_name("spec_host_time.py")
    sys.argv = [str(script), *sys.argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
