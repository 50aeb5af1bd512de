"""Start-up tuning of the GEMV kernel: for each weight shape, input kind and row bucket, the
launch config (if any) that matches cuBLAS and beats it, measured on this GPU.

The choice is made per shape, timed in a CUDA graph over enough weights of that shape to stream
them from memory, as in a decode step. A kernel may absorb its layer's input transform:
SwiGLU (`"gated"`) or residual-add + RMSNorm (`"normed"`); the tuning also times the GEMV behind
the transform's own kernel, and keeps whichever of the three is fastest. The layers
(`layers/linear.py`) hold the result and call the kernel. With a `TuningCache` each shape's
choices are stored on disk, and a later start in the same environment reads them instead of
measuring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import triton
from torch.nn import functional as F

from tokenmill.kernels import GemvConfig, InputNorm, fused_silu_and_mul, gemv, norm_gemv, rms_norm
from tokenmill.kernels.gemv import dot_normed_ok
from tokenmill.kernels.tickets import ticket_buffer
from tokenmill.observability.cuda_timing import median_graph_seconds
from tokenmill.tuning_cache import DECODE_ERRORS, TuningCache, file_name

logger = logging.getLogger(__name__)

InputKind = Literal["plain", "gated", "normed"]

# Inputs of M rows use the choice made for the smallest bucket >= M; larger M use cuBLAS. 8: a
# speculative verify step of one sequence (1 + k tokens) or a decode batch of 5-8, which
# otherwise run cuBLAS with the norm and SwiGLU as kernels of their own.
GEMV_BUCKETS = (1, 4, 8)
# The configs of `benchmarks/gemv_sweep.py` that came within a few percent of the best on the
# decode shapes of qwen3-0.6b and llama-3.1-8b on an H200 (docs/perf-notes.md, v9), plus split-K
# ones for M > 1, where each program's product is M times the work, and tensor-core ones
# (`dot`) for M > 1, where the CUDA cores' multiply-adds take as long as the weights' bytes:
# those that won a shape of either model at 5 or 8 rows in session 36's sweep.
GEMV_CANDIDATES = (
    GemvConfig(4, 512, 1, num_warps=2, defer=True),
    GemvConfig(4, 256, 1, num_warps=2, prefetch=2, defer=True),
    GemvConfig(4, 1024, 1, num_warps=4, prefetch=2, defer=True),
    GemvConfig(2, 1024, 1, num_warps=4, defer=True),
    GemvConfig(2, 512, 1, num_warps=2, defer=True),
    GemvConfig(2, 1024, 1, num_warps=2),
    GemvConfig(4, 1024, 1, num_warps=4),
    GemvConfig(8, 512, 1),
    GemvConfig(8, 512, 2),
    GemvConfig(8, 512, 4),
    GemvConfig(64, 256, 1, num_warps=4, prefetch=3, dot=True),
    GemvConfig(64, 128, 1, num_warps=4, prefetch=3, dot=True),
    GemvConfig(64, 128, 4, num_warps=4, prefetch=3, dot=True),
    GemvConfig(64, 256, 2, num_warps=4, prefetch=3, dot=True),
    GemvConfig(64, 256, 8, num_warps=4, prefetch=2, dot=True),
)
# Bytes of weights a candidate's timing streams per replay: many times any L2 cache, so the
# weights come from memory as in a decode step, without timing every layer's (a cold start of
# llama-3.1-8b timed 32 x 235 MB of MLP weights per replay: 11.9 s for one bucket, session 25).
TIMED_BYTES = 512 * 2**20
# A candidate must beat cuBLAS by this factor to be chosen (timing noise is a few percent).
MARGIN = 0.97
# Part of a cached choice's key: choices made among other candidates, buckets or margin are stale.
_SETTINGS = hashlib.sha256(repr((GEMV_CANDIDATES, GEMV_BUCKETS, MARGIN)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class GemvChoice:
    """The GEMV kernel a layer runs for one row bucket; `fused`: a gated or normed layer's
    input transform (SwiGLU, add + RMSNorm) runs inside it, else as its own kernel before."""

    config: GemvConfig
    fused: bool = True


def gemv_bucket(m: int) -> int | None:
    """The row bucket whose kernel choice serves an input of `m` rows (None: too many rows)."""
    return next((b for b in GEMV_BUCKETS if m <= b), None)


# The RMSNorm epsilon of the tuning inputs (any small value: only speed and agreement count).
_EPS = 1e-6


@dataclass(frozen=True)
class GemvTiming:
    """A shape's choice for one row bucket (None: cuBLAS), with its time and cuBLAS's, in
    microseconds per layer."""

    choice: GemvChoice | None
    us: float
    cublas_us: float


# `fastest_gemv`'s signature: (weights of one shape, row buckets, input kind) -> for each bucket
# (choice, seconds per weight, cuBLAS's seconds per weight).
BucketTimings = dict[int, tuple[GemvChoice | None, float, float]]
Measure = Callable[[list[torch.Tensor], Sequence[int], InputKind], BucketTimings]
# `shipped_choices_hold`'s signature: (weights of one shape, its timings, input kind) -> whether
# every chosen kernel builds here and matches cuBLAS.
Check = Callable[[list[torch.Tensor], dict[int, GemvTiming], InputKind], bool]

# The choices tokenmill ships for GPUs it was tuned on, one file per GPU name (written from a
# tuning cache by `scripts/export_gemv_defaults.py`).
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "assets" / "gemv_defaults"
SHIPPED_FORMAT = 1


@dataclass(frozen=True)
class ShippedChoices:
    """The GEMV choices shipped for one GPU (`SHIPPED_DIR/<GPU name>.json`): by shape (the
    tuning cache's file name, `gemv-<dtype>-<n>x<k>-<kind>`), each bucket's timing as measured
    there. A start whose tuning cache lacks a shape checks its shipped choices against cuBLAS
    (building only the chosen kernels) instead of building and timing every candidate, as vLLM
    ships its fused-MoE configs per GPU."""

    path: Path
    shapes: Mapping[str, Any]

    @classmethod
    def load(cls, device_name: str, directory: Path | None = None) -> ShippedChoices | None:
        """The choices shipped for GPU `device_name` (in `directory`, by default
        `SHIPPED_DIR`), or None (none shipped; a file that cannot be read or was made among
        other candidates, buckets or margin: with a warning)."""
        path = (directory or SHIPPED_DIR) / f"{file_name(device_name)}.json"
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as exc:
            logger.warning("ignoring the shipped GEMV choices %s: %r", path, exc)
            return None
        if not isinstance(record, dict) or not isinstance(record.get("shapes"), dict):
            logger.warning("ignoring the shipped GEMV choices %s: no shapes in it", path)
            return None
        if (record.get("format"), record.get("settings")) != (SHIPPED_FORMAT, _SETTINGS):
            logger.warning("ignoring the shipped GEMV choices %s: made with other tuning "
                           "settings (candidates, buckets, margin)", path)  # fmt: skip
            return None
        return cls(path, record["shapes"])

    def timings(self, name: str) -> dict[int, GemvTiming] | None:
        """Shape `name`'s shipped timings, or None (not shipped, or not decodable)."""
        if (value := self.shapes.get(name)) is None:
            return None
        try:
            return _decode_timings(value)
        except DECODE_ERRORS as exc:
            logger.warning("ignoring the shipped GEMV choice %s of %s: %r", name, self.path, exc)
            return None


def export_shipped_choices(tuning_dir: str | Path, output_dir: Path) -> list[Path]:
    """Write the GEMV choices in a tuning cache folder (`--tuning-cache-dir`, a folder per GPU)
    as shipped choices, a file per GPU merged into what `output_dir` holds for it; returns the
    files written. Only choices measured there among the current candidates, buckets and margin
    are taken (not ones the cache holds from shipped choices); a file that is not a decodable
    choice raises (`DECODE_ERRORS`). A folder that does not exist writes nothing. The record's
    `measured_with` is the environment of the last file exported (for reading, not checked)."""
    written: list[Path] = []
    if not Path(tuning_dir).is_dir():
        return written
    for gpu_dir in sorted(p for p in Path(tuning_dir).iterdir() if p.is_dir()):
        shapes, key = {}, {}
        for path in sorted(gpu_dir.glob("gemv-*.json")):
            record = json.loads(path.read_text())
            if record["key"].get("settings") != _SETTINGS:
                continue
            _decode_timings(record["value"])
            if record["value"].get("shipped"):
                continue
            shapes[path.stem], key = record["value"], record["key"]
        if not shapes:
            continue
        known = ShippedChoices.load(key["device"], output_dir)
        shapes = {**(known.shapes if known else {}), **shapes}
        measured = {f: key.get(f) for f in ("driver", "cuda", "torch", "triton", "tokenmill")}
        record = {"format": SHIPPED_FORMAT, "settings": _SETTINGS, "device": key["device"],
                  "measured_with": measured, "shapes": shapes}  # fmt: skip
        path = output_dir / f"{file_name(key['device'])}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        written.append(path)
    return written


def choose_gemv_configs(
    weights: Mapping[tuple[int, int, InputKind], Sequence[torch.Tensor]],
    cache: TuningCache | None = None,
    measure: Measure | None = None,
    threads: int = 1,
    shipped: ShippedChoices | None = None,
    check: Check | None = None,
) -> dict[tuple[int, int, InputKind], dict[int, GemvChoice]]:
    """For each group of same-shape weights (`(n, k, input kind)` -> weights), the GEMV choice
    per row bucket where one matches cuBLAS's result and beats its time (buckets left out run
    cuBLAS). A shape `cache` holds is read; else its `shipped` choices are taken if they pass
    `check` (by default `shipped_choices_hold`); else it is measured (`measure`, by default
    `fastest_gemv`); both on `threads` threads, and stored in `cache`."""
    measure = measure or functools.partial(fastest_gemv, threads=threads)
    check = check or functools.partial(shipped_choices_hold, threads=threads)
    chosen: dict[tuple[int, int, InputKind], dict[int, GemvChoice]] = {}
    for (n, k, kind), group in weights.items():
        timings, source = _shape_timings((n, k, kind), list(group), cache, measure, shipped, check)
        for bucket, t in timings.items():
            logger.info(
                "GEMM %dx%d (%s input), M<=%d: %s, %.1f us per layer (cuBLAS %.1f us)%s",
                n, k, kind, bucket, t.choice or "cuBLAS", t.us, t.cublas_us, source,
            )  # fmt: skip
            if t.choice is not None:
                chosen.setdefault((n, k, kind), {})[bucket] = t.choice
    return chosen


def _shape_timings(
    shape: tuple[int, int, InputKind],
    group: list[torch.Tensor],
    cache: TuningCache | None,
    measure: Measure,
    shipped: ShippedChoices | None,
    check: Check,
) -> tuple[dict[int, GemvTiming], str]:
    """Every bucket's timing of one shape, and where it came from (for the log line: "" when
    measured here)."""
    n, k, kind = shape
    dtype = str(group[0].dtype).removeprefix("torch.")
    name = f"gemv-{dtype}-{n}x{k}-{kind}"
    key = {"kernel": "gemv", "dtype": dtype, "n": n, "k": k, "input_kind": kind,
           "settings": _SETTINGS}  # fmt: skip
    if cache is not None and (found := cache.load(name, key, _decode_timings)) is not None:
        return found, " [tuning cache]"
    timings = _shipped_timings(name, group, kind, shipped, check)
    from_shipped = timings is not None
    if timings is None:
        timings = {
            bucket: GemvTiming(choice, 1e6 * seconds, 1e6 * cublas)
            for bucket, (choice, seconds, cublas) in measure(group, GEMV_BUCKETS, kind).items()
        }
    if cache is not None:
        cache.store(name, key, _encode_timings(timings, shipped=from_shipped))
    return timings, " [shipped]" if from_shipped else ""


def _shipped_timings(
    name: str,
    group: list[torch.Tensor],
    kind: InputKind,
    shipped: ShippedChoices | None,
    check: Check,
) -> dict[int, GemvTiming] | None:
    """Shape `name`'s shipped timings if there are any and their kernels hold here."""
    timings = shipped.timings(name) if shipped is not None else None
    if timings is None or check(group, timings, kind):
        return timings
    logger.warning("the shipped GEMV choices of %s do not hold here; measuring", name)
    return None


def _encode_timings(timings: dict[int, GemvTiming], shipped: bool = False) -> dict[str, Any]:
    """Each bucket's timing as JSON data; `shipped`: taken from the shipped choices, not
    measured here (an export leaves it out)."""
    encoded: dict[str, Any] = {
        str(bucket): {
            "choice": None if t.choice is None else dataclasses.asdict(t.choice),
            "us": t.us,
            "cublas_us": t.cublas_us,
        }
        for bucket, t in timings.items()
    }
    return {**encoded, "shipped": True} if shipped else encoded


def _decode_timings(value: Any) -> dict[int, GemvTiming]:
    """`_encode_timings`' output back; one of `DECODE_ERRORS` if it is not that (a bucket
    missing, a config that is not a candidate, a time too large for a float)."""
    timings = {}
    for bucket in GEMV_BUCKETS:
        row = value[str(bucket)]
        choice = None
        if row["choice"] is not None:
            config = GemvConfig(**row["choice"]["config"])
            if config not in GEMV_CANDIDATES:
                raise ValueError(f"{config} is not a candidate")
            choice = GemvChoice(config, bool(row["choice"]["fused"]))
        timings[bucket] = GemvTiming(choice, float(row["us"]), float(row["cublas_us"]))
    return timings


def timed_weights(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The weights of a shape whose GEMVs a candidate's timing runs: enough to stream
    `TIMED_BYTES` from memory per replay, at least 2 (all, where there are fewer), not
    necessarily every layer's."""
    size = weights[0].numel() * weights[0].element_size()
    return weights[: max(2, -(-TIMED_BYTES // size))]


class _Rows:
    """One row bucket's tuning inputs: the rows, a residual, and cuBLAS's product of the first
    weight (after the input kernel) that every candidate must match."""

    def __init__(self, rows: int, kind: InputKind, w0: torch.Tensor) -> None:
        width = w0.shape[1] * (2 if kind == "gated" else 1)
        self.kind = kind
        self.x = torch.randn(rows, width, dtype=w0.dtype, device=w0.device)
        self.residual = torch.randn(rows, w0.shape[1], dtype=w0.dtype, device=w0.device)
        self.norm_weight = torch.ones(w0.shape[1], dtype=w0.dtype, device=w0.device)
        self.scratch = self.residual.clone()
        self.expected = self.run(w0, None, self.residual.clone()).float()

    def run(self, w: torch.Tensor, choice: GemvChoice | None, res: torch.Tensor) -> torch.Tensor:
        """The layer's product with `choice` (None: cuBLAS), its input kernel included; a normed
        input's add + RMSNorm updates `res` in place."""
        x, kind = self.x, self.kind
        if choice is not None and choice.fused:
            if kind == "normed":
                return norm_gemv(x, w, choice.config, InputNorm(self.norm_weight, _EPS, res))[0]
            return gemv(x, w, choice.config, kind == "gated")
        if kind == "normed":
            h = rms_norm(x, self.norm_weight, _EPS, res)
        else:
            h = fused_silu_and_mul(x) if kind == "gated" else x
        return F.linear(h, w) if choice is None else gemv(h, w, choice.config)

    def seconds(self, weights: list[torch.Tensor], choice: GemvChoice | None) -> float:
        """Device seconds per weight of `choice` over `weights`, in a CUDA graph."""
        replay = median_graph_seconds(lambda: [self.run(w, choice, self.scratch) for w in weights])
        return replay / len(weights)


def _candidates(rows: int, kind: InputKind, dtype: torch.dtype) -> list[GemvChoice]:
    """The choices worth timing for `rows` rows of a `kind` input: every candidate serving
    them, fused and (for a gated or normed input) unfused."""
    fusions = (True,) if kind == "plain" else (True, False)
    normed_dot_ok = kind != "normed" or dot_normed_ok(dtype)
    return [
        GemvChoice(c, fused)
        for c in GEMV_CANDIDATES
        if c.serves(rows)
        for fused in fusions
        if not (c.dot and fused) or normed_dot_ok
    ]


def fastest_gemv(
    weights: list[torch.Tensor], buckets: Sequence[int], kind: InputKind, threads: int = 1
) -> BucketTimings:
    """For each row bucket, the candidate (None: cuBLAS) that runs that many rows x the weights
    fastest, with its seconds per weight and cuBLAS's: one whose first product matches cuBLAS's
    and beats it by the margin. Each layer runs its input kernel (SwiGLU, or add + RMSNorm)
    before cuBLAS or an unfused GEMV. Timed on `timed_weights(weights)`.

    Every bucket's candidates are first run once and checked, which compiles their kernels
    (most of a cold start's tuning: ~0.4 s each), on `threads` threads side by side; the
    timing runs alone."""
    w0, timed = weights[0], timed_weights(weights)
    inputs = {rows: _Rows(rows, kind, w0) for rows in buckets}
    checks = [(rows, c) for rows in buckets for c in _candidates(rows, kind, w0.dtype)]
    start = time.perf_counter()
    correct = _check_choices(w0, inputs, checks, threads)
    passed = [check for check, ok in zip(checks, correct, strict=True) if ok]
    compiled = time.perf_counter()
    chosen = {}
    for rows, bench in inputs.items():
        cublas_s = bench.seconds(timed, None)
        best, best_s = None, MARGIN * cublas_s
        for choice in (c for r, c in passed if r == rows):
            if (s := bench.seconds(timed, choice)) < best_s:
                best, best_s = choice, s
        chosen[rows] = (best, best_s if best else cublas_s, cublas_s)
    # What a cold start's tuning spends where (the compiles, or timing the weights).
    logger.info(
        "GEMM %dx%d (%s input), M<=%s: %d candidates built and checked in %.2f s, timed on %d "
        "weights in %.2f s", w0.shape[0], w0.shape[1], kind, ",".join(map(str, buckets)),
        len(checks), compiled - start, len(timed), time.perf_counter() - compiled,
    )  # fmt: skip
    return chosen


def shipped_choices_hold(
    weights: list[torch.Tensor], timings: dict[int, GemvTiming], kind: InputKind, threads: int = 1
) -> bool:
    """Whether every kernel chosen in `timings` (shipped, measured on another machine) builds
    here and matches cuBLAS's product of the first weight (checked on `threads` threads)."""
    w0 = weights[0]
    checks = [(rows, t.choice) for rows, t in timings.items() if t.choice is not None]
    if any(choice not in _candidates(rows, kind, w0.dtype) for rows, choice in checks):
        return False  # not one the tuning would try for these rows, kind and dtype
    inputs = {rows: _Rows(rows, kind, w0) for rows, _ in checks}
    return all(_check_choices(w0, inputs, checks, threads))


def _check_choices(
    w0: torch.Tensor,
    inputs: Mapping[int, _Rows],
    checks: list[tuple[int, GemvChoice]],
    threads: int,
) -> list[bool]:
    """For each (rows, choice), whether its product of `w0` on `inputs[rows]` matches
    cuBLAS's; run on `threads` threads side by side (each first run compiles its kernel)."""

    def correct(check: tuple[int, GemvChoice]) -> bool:
        rows, choice = check
        bench = inputs[rows]
        # A new thread's current device is the first GPU, whatever the weights' device.
        on_device = torch.cuda.device(w0.device) if w0.is_cuda else contextlib.nullcontext()
        with on_device:
            return matches_cublas(
                lambda: bench.run(w0, choice, bench.residual.clone()), bench.expected, choice
            )

    # Made once, here, before the threads could race to make them: the ticket buffer, and
    # Triton's driver (built on its first use, with a C helper compiled on a first start).
    ticket_buffer(w0.device, 0)
    if w0.is_cuda:
        triton.runtime.driver.active.get_current_device()
    with ThreadPoolExecutor(max(1, min(threads, len(checks)))) as pool:
        return list(pool.map(correct, checks))


def matches_cublas(
    run: Callable[[], torch.Tensor], expected: torch.Tensor, choice: GemvChoice
) -> bool:
    """Whether the candidate's product is cuBLAS's to bf16 rounding (a GPU-specific fault in a
    candidate, wrong results or a kernel that does not build here, must cost speed, never
    correctness or the start-up)."""
    try:
        got = run().float()
    except Exception as exc:  # e.g. triton's CompilationError / OutOfResources on this GPU
        logger.warning("GEMV %s failed here (%s); not used", choice, exc)
        return False
    ok = bool(torch.allclose(got, expected, rtol=0.02, atol=0.02 * expected.abs().max().item()))
    if not ok:
        logger.warning("GEMV %s disagrees with cuBLAS (max error %.3g); not used", choice,
                       (got - expected).abs().max().item())  # fmt: skip
    return ok
