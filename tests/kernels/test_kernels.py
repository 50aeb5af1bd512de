"""Each Triton kernel against a float64 torch reference, on fresh random inputs.

On a machine without CUDA the kernels run in Triton's interpreter (small shapes); on a GPU they
run compiled. Tolerances: float32 ~1e-5 relative, bfloat16 ~1e-2.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from tokenmill.kernels.activation import silu_and_mul  # noqa: E402
from tokenmill.kernels.attention import (  # noqa: E402
    PREFILL_TILES,
    SHORT_PREFILL_TILES,
    WIDE_MAX_ROW_BYTES,
    WIDE_PREFILL_TILES,
    PrefillTiles,
    decode_attention,
    prefill_attention,
    prefill_tiles,
    verify_attention,
)
from tokenmill.kernels.gemv import GemvConfig, InputNorm, gemv, norm_gemv  # noqa: E402
from tokenmill.kernels.invariant_matmul import (  # noqa: E402
    MIN_CHUNK,
    PDL_MAX_WEIGHT_BYTES,
    MatmulTile,
    chunk_length,
    invariant_matmul,
    k_chunks,
)
from tokenmill.kernels.norm import rms_norm  # noqa: E402
from tokenmill.kernels.rope_store import rope_and_store, rope_block_tokens  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton 3.6's CPU interpreter computes bfloat16 `tl.dot` wrongly (~1e10 off on a 16x16 product),
# so the attention kernels are checked in bfloat16 on the GPU only.
DOT_DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _skip_unlaunchable(tiles: PrefillTiles | None, d: int, dtype: torch.dtype) -> None:
    """On a GPU, skip forcing the 128 x 128 tile where its K/V stages exceed an SM's shared
    memory (Triton refuses the launch; `prefill_tiles` never picks it there)."""
    wide = tiles == WIDE_PREFILL_TILES
    if DEVICE == "cuda" and wide and d * dtype.itemsize > WIDE_MAX_ROW_BYTES:
        pytest.skip("the wide tile's K/V stages exceed an SM's shared memory")


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any()
    err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)
    assert err < TOL[dtype], f"relative error {err:.2e}"


def _randn(*shape: int, dtype: torch.dtype = torch.float32, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_cols", [64, 96, 1024])
def test_add_rms_norm(dtype: torch.dtype, n_cols: int) -> None:
    gen = torch.Generator().manual_seed(n_cols)
    x, res = (_randn(5, n_cols, dtype=dtype, gen=gen) for _ in range(2))
    w = _randn(n_cols, dtype=dtype, gen=gen)
    total = (x.double() + res.double()).to(dtype).double()
    ref = w.double() * total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)
    res_in = res.clone()
    out = rms_norm(x, w, 1e-6, res_in)
    _close(out, ref, dtype)
    _close(res_in, total, dtype)
    plain = rms_norm(x, w, 1e-6)
    ref_plain = (
        w.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    )
    _close(plain, ref_plain, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = _randn(7, 2 * 300, dtype=dtype, gen=gen)
    gate, up = x.double().chunk(2, dim=-1)
    _close(silu_and_mul(x), torch.nn.functional.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 4, 8])
@pytest.mark.parametrize(
    "config",
    [
        GemvConfig(8, 32, 1),
        GemvConfig(16, 64, 3),
        GemvConfig(4, 32, 8, num_warps=2),
        GemvConfig(8, 32, 1, prefetch=2, defer=True),
        GemvConfig(16, 32, 2, prefetch=2),
        GemvConfig(4, 64, 3, defer=True),
    ],
)
def test_gemv(dtype: torch.dtype, m: int, config: GemvConfig) -> None:
    """Ragged N and K (not multiples of the tiles); split-K partials reduced by the last program;
    a second call reuses the tickets the first left zeroed and gives the same bits."""
    gen = torch.Generator().manual_seed(m)
    x, w = _randn(m, 200, dtype=dtype, gen=gen), _randn(37, 200, dtype=dtype, gen=gen)
    out = gemv(x, w, config)
    assert out.dtype == dtype and out.shape == (m, 37)
    _close(out, x.double() @ w.double().T, dtype)
    assert torch.equal(gemv(x, w, config), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "config", [GemvConfig(8, 32, 1), GemvConfig(16, 64, 3), GemvConfig(8, 32, 2, 4, 2, True)]
)
def test_gated_gemv_applies_swiglu(dtype: torch.dtype, config: GemvConfig) -> None:
    gen = torch.Generator().manual_seed(7)
    x, w = _randn(2, 2 * 150, dtype=dtype, gen=gen), _randn(45, 150, dtype=dtype, gen=gen)
    gate, up = x.double().chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(gate) * up) @ w.double().T
    _close(gemv(x, w, config, gated=True), ref, dtype)


def _add_rmsnorm_reference(
    x: torch.Tensor, res: torch.Tensor | None, norm_w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In float64: the norm's input `x + res` (the sum rounded to x's dtype, as the kernels
    store it) and RMSNorm of it with weight `norm_w`, eps 1e-6."""
    total = (x.double() + res.double()).to(x.dtype).double() if res is not None else x.double()
    h = norm_w.double() * total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)
    return total, h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "config", [GemvConfig(8, 32, 1), GemvConfig(16, 64, 3), GemvConfig(8, 32, 3, 4, 2, True)]
)
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_gemv_is_add_rmsnorm_then_product(dtype, config, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    x, res = _randn(3, 200, dtype=dtype, gen=gen), _randn(3, 200, dtype=dtype, gen=gen)
    w, norm_w = _randn(37, 200, dtype=dtype, gen=gen), _randn(200, dtype=dtype, gen=gen)
    res_before = res.clone()
    norm = InputNorm(norm_w, 1e-6, res if with_residual else None)
    out, new_res = norm_gemv(x, w, config, norm)
    total, h = _add_rmsnorm_reference(x, res if with_residual else None, norm_w)
    _close(out, h @ w.double().T, dtype)
    _close(new_res, total, dtype)  # (the interpreter may round bf16 differently from torch)
    assert torch.equal(res, res_before)  # the old residual is left as it was
    assert torch.equal(norm_gemv(x, w, config, norm)[0], out)


# Tensor-core configs: whole tiles, K splits, one to three slabs ahead (each kind of input
# below; a 64-row tile of W, as shipped, over the 37 columns).
DOT_CONFIGS = [
    GemvConfig(16, 32, 1, dot=True),
    GemvConfig(32, 64, 3, prefetch=2, dot=True),
    GemvConfig(64, 32, 2, prefetch=3, dot=True),
]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize("config", DOT_CONFIGS)
@pytest.mark.parametrize("kind", ["plain", "gated", "normed"])
def test_dot_gemv_matches_the_reference(dtype, m: int, config: GemvConfig, kind: str) -> None:
    """The tensor-core path (W's rows by the input rows padded to 16, ragged N and K) for
    every input kind: plain, SwiGLU of (gate | up), residual add + RMSNorm."""
    gen = torch.Generator().manual_seed(m)
    width = 2 * 150 if kind == "gated" else 150
    x, w = _randn(m, width, dtype=dtype, gen=gen), _randn(37, 150, dtype=dtype, gen=gen)
    if kind == "normed":
        res, norm_w = _randn(m, 150, dtype=dtype, gen=gen), _randn(150, dtype=dtype, gen=gen)
        out, new_res = norm_gemv(x, w, config, InputNorm(norm_w, 1e-6, res))
        total, h = _add_rmsnorm_reference(x, res, norm_w)
        _close(new_res, total, dtype)
    else:
        out = gemv(x, w, config, gated=kind == "gated")
        gate, up = x.double().chunk(2, dim=-1) if kind == "gated" else (x.double(), None)
        h = gate if up is None else torch.nn.functional.silu(gate) * up
    assert out.shape == (m, 37)
    _close(out, h @ w.double().T, dtype)


def test_gemv_config_rejects_bad_prefetch() -> None:
    """Two slabs ahead at most on the CUDA cores (held in registers), three on the tensor
    cores (Triton's pipeline, in shared memory)."""
    with pytest.raises(ValueError, match="prefetch"):
        GemvConfig(8, 32, 1, prefetch=3)
    with pytest.raises(ValueError, match="prefetch"):
        GemvConfig(16, 32, 1, prefetch=4, dot=True)
    assert GemvConfig(16, 32, 1, prefetch=3, dot=True).prefetch == 3


def test_dot_gemv_does_not_norm_float16() -> None:
    """Rounded to float16 before the RMS scale, (x + residual) * g overflows where a large
    activation meets a large norm weight: such a config refuses to norm float16 inputs."""
    x, w = torch.ones(2, 32, dtype=torch.float16), torch.ones(16, 32, dtype=torch.float16)
    norm = InputNorm(torch.ones(32, dtype=torch.float16), 1e-6, None)
    with pytest.raises(ValueError, match="float16"):
        norm_gemv(x.to(DEVICE), w.to(DEVICE), GemvConfig(16, 32, 1, dot=True), norm)


@pytest.mark.parametrize("bad", [{"block_n": 8}, {"block_k": 8}, {"defer": True}])
def test_gemv_config_rejects_dot_without_whole_tiles(bad: dict) -> None:
    with pytest.raises(ValueError, match="dot"):
        GemvConfig(**{"block_n": 16, "block_k": 32, "split_k": 1, "dot": True, **bad})
    assert not GemvConfig(16, 32, 1, dot=True).serves(1)


def test_gemv_rejects_bad_shapes() -> None:
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="M <= 8"):
        gemv(torch.zeros(9, 16, device=DEVICE), w, GemvConfig(8, 16, 1))
    with pytest.raises(ValueError, match="W \\[N, K\\]"):
        gemv(torch.zeros(2, 15, device=DEVICE), w, GemvConfig(8, 16, 1))
    with pytest.raises(ValueError, match="2K"):
        gemv(torch.zeros(2, 16, device=DEVICE), w, GemvConfig(8, 16, 1), gated=True)
    x, norm_w = torch.zeros(2, 16, device=DEVICE), torch.ones(16, device=DEVICE)
    for residual in (torch.zeros(2, 8, device=DEVICE), x.double()):  # another shape or dtype
        with pytest.raises(ValueError, match="residual"):
            norm_gemv(x, w, GemvConfig(8, 16, 1), InputNorm(norm_w, 1e-6, residual))


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize(
    "tile",
    [None, MatmulTile(16, 16, 32, 4, 1), MatmulTile(32, 64, 64, 4, 2),
     MatmulTile(64, 32, 64, 4, 2)],
)  # fmt: skip
@pytest.mark.parametrize("chunks", [None, 3])
def test_invariant_matmul(
    dtype: torch.dtype, m: int, tile: MatmulTile | None, chunks: int | None
) -> None:
    """Ragged N and K (not multiples of the tiles), with a bias; K in one chunk (the default
    at this size) and in 3 (256, 256, 88 columns), each chunk in programs of its own and all
    in one program; on the GPU also the same bits for each row alone and through tensor
    descriptors (TMA, on Hopper) and pointer loads alike (on the CPU the interpreter's
    `tl.dot` is a NumPy product per tile, whose rounding follows the tile: bitwise invariance
    is checked on the GPU only, here and in tests/gpu/determinism_cases.py)."""
    gen = torch.Generator().manual_seed(m)
    x, w = _randn(m, 600, dtype=dtype, gen=gen), _randn(37, 600, dtype=dtype, gen=gen)
    bias = _randn(37, dtype=dtype, gen=gen)
    outs = [invariant_matmul(x, w, bias, tile, chunks=chunks, across=a) for a in (True, False)]
    for out in outs:
        assert out.dtype == dtype and out.shape == (m, 37)
        _close(out, x.double() @ w.double().T + bias.double(), dtype)
    if DEVICE == "cuda":
        alone = [invariant_matmul(x[i : i + 1], w, bias, chunks=chunks) for i in range(m)]
        assert torch.equal(outs[0], torch.cat(alone)) and torch.equal(outs[1], outs[0])
        for a in (True, False):
            for tma in (True, False):
                out = invariant_matmul(x, w, bias, tile, chunks=chunks, across=a, tma=tma)
                assert torch.equal(out, outs[0]), (a, tma)


def test_invariant_matmul_chunks_follow_the_weight_alone() -> None:
    """K's chunks at the bf16 products of Qwen3-0.6B (latency-bound, 4-13 MB: one chunk) and
    Llama-3.1-8B: those with few decode tiles cut in two (q/k/v 192 tiles of 32 columns, o and
    down 128), none below MIN_CHUNK columns, the LM head and gate/up (enough tiles) not at all;
    every chunk a whole number of every tile's K steps."""
    shapes = {(4096, 1024): 1, (1024, 2048): 1, (6144, 1024): 1, (1024, 3072): 1,
              (151936, 1024): 1, (6144, 4096): 2, (4096, 4096): 2, (28672, 4096): 1,
              (4096, 14336): 2, (128256, 4096): 1}  # fmt: skip
    assert {shape: k_chunks(*shape, itemsize=2) for shape in shapes} == shapes
    assert k_chunks(1024, 16384, itemsize=2) == 4  # 64 tiles of 16 columns
    for (_, k), chunks in shapes.items():
        length = chunk_length(k, chunks)
        assert length % 256 == 0 and length >= MIN_CHUNK and -(-k // length) == chunks


def test_invariant_matmul_launches_with_pdl_only_for_small_weights(monkeypatch) -> None:
    """Small (latency-bound) products start under PDL; large ones, which ran slower so, do not
    (the launch's own options, spied on; meta tensors: nothing runs)."""
    # The module itself: `tokenmill.kernels.invariant_matmul` as an attribute is the function
    # the package re-exports under the module's name.
    module = importlib.import_module("tokenmill.kernels.invariant_matmul")
    launches: list[dict] = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    def pdl_options(device: torch.device, wanted: bool = True) -> dict[str, bool]:
        return {"USE_PDL": wanted, "launch_pdl": wanted}  # as on an sm_90 GPU

    monkeypatch.setattr(module, "pdl_options", pdl_options)
    monkeypatch.setattr(module, "_invariant_matmul_kernel", Spy())
    # Qwen3-0.6B's q/k/v, a weight of exactly the bound, Llama-3.1-8B's q/k/v.
    for n, k, pdl in ((4096, 1024, True), (PDL_MAX_WEIGHT_BYTES // 2048, 1024, True),
                      (6144, 4096, False)):  # fmt: skip
        x = torch.empty(1, k, dtype=torch.bfloat16, device="meta")
        module.invariant_matmul(x, torch.empty(n, k, dtype=torch.bfloat16, device="meta"))
        assert (launches[-1]["USE_PDL"], launches[-1]["launch_pdl"]) == (pdl, pdl), n


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("tile", [None, MatmulTile(16, 16, 32, 4, 1), MatmulTile(32, 64, 64, 4, 2)])
@pytest.mark.parametrize("chunks", [None, 2])
def test_invariant_matmul_swiglu_is_silu_and_mul_of_the_product(dtype, tile, chunks) -> None:
    """Interleaved gate/up rows with `swiglu`: `silu_and_mul` of the plain product (bitwise on
    the GPU, where a product's elements do not depend on their column; ragged N), K in one
    chunk and in two (all in one program against a program per chunk)."""
    gen = torch.Generator().manual_seed(3)
    x, w = _randn(7, 300, dtype=dtype, gen=gen), _randn(2 * 45, 300, dtype=dtype, gen=gen)
    interleaved = w.view(2, 45, 300).transpose(0, 1).reshape(90, 300)
    out = invariant_matmul(x, interleaved, tile=tile, swiglu=True, chunks=chunks, across=False)
    plain = silu_and_mul(invariant_matmul(x, w, tile=tile, chunks=chunks))
    assert out.shape == (7, 45)
    if DEVICE == "cuda":
        assert torch.equal(out, plain)
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    _close(out, torch.nn.functional.silu(gate) * up, dtype)


def test_invariant_matmul_rejects_bad_shapes() -> None:
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="W \\[N, K\\]"):
        invariant_matmul(torch.zeros(2, 15, device=DEVICE), w)
    assert invariant_matmul(torch.zeros(0, 16, device=DEVICE), w).shape == (0, 8)
    with pytest.raises(ValueError, match="even number of rows"):
        invariant_matmul(torch.zeros(2, 16, device=DEVICE), w[:7], swiglu=True)


def _rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 64), (8, 1, 128), (6, 6, 64)])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("per_program", [None, 4])
def test_rope_norm_and_kv_store(
    dtype, hq: int, hkv: int, d: int, qk_norm: bool, per_program: int | None
) -> None:
    """Each token's q and k normalised (optional) and rotated, k and v stored at its slot and
    by token; `per_program` 4: 6 tokens in programs of 4, the second program's last 2 rows
    past the step."""
    gen = torch.Generator().manual_seed(hq * d + qk_norm)
    tokens, slots_total = 6, 40
    qkv = _randn(tokens, (hq + 2 * hkv) * d, dtype=dtype, gen=gen)
    positions = torch.tensor([0, 5, 17, 3, 33, 8], device=DEVICE)
    slots = torch.tensor([3, 9, -1, 0, 39, 21], device=DEVICE)
    cos, sin = _rope_tables(d, 64)
    k_cache = torch.full((slots_total, hkv, d), 7.0, dtype=dtype, device=DEVICE)
    v_cache = torch.full((slots_total, hkv, d), 7.0, dtype=dtype, device=DEVICE)
    norm = (_randn(d, gen=gen), _randn(d, gen=gen), 1e-6) if qk_norm else None
    # the step's K and V by token too (dense rows read them), and spare rows of q's storage
    fresh = torch.full((2, tokens, hkv, d), 7.0, dtype=dtype, device=DEVICE)
    q = rope_and_store(
        qkv,
        positions,
        slots,
        cos,
        sin,
        k_cache,
        v_cache,
        hq,
        hkv,
        d,
        norm,
        (*fresh,),
        3,
        per_program,
    )
    assert q.shape == (tokens, hq, d) and q.untyped_storage().nbytes() == q.nbytes * 9 // 6

    q_rot, k_rot, v_ref = _rotated_reference(qkv, positions, cos, sin, norm, hq, hkv)
    _close(q, q_rot, dtype)
    written = slots >= 0
    _close(k_cache[slots[written]], k_rot[written], dtype)
    _close(v_cache[slots[written]], v_ref[written], dtype)
    untouched = torch.ones(slots_total, dtype=torch.bool, device=DEVICE)
    untouched[slots[written]] = False
    assert (k_cache[untouched] == 7.0).all() and (v_cache[untouched] == 7.0).all()
    _close(fresh[0][written], k_rot[written], dtype)
    _close(fresh[1][written], v_ref[written], dtype)
    assert (fresh[:, ~written] == 0).all()  # a row that stores nothing: zeros


def test_rope_blocks_tokens_only_in_long_steps_of_small_groups() -> None:
    """4 tokens a program from 512 tokens (Qwen3-0.6B: 2 query heads of 128 a KV head;
    Llama-3.1-8B: 4), one below, and one for groups of more than 512 values (8 x 128)."""
    assert rope_block_tokens(8192, 2, 128) == rope_block_tokens(512, 4, 128) == 4
    assert rope_block_tokens(511, 2, 128) == rope_block_tokens(1, 2, 128) == 1
    assert rope_block_tokens(8192, 8, 128) == rope_block_tokens(8192, 3, 256) == 1
    assert rope_block_tokens(8192, 3, 128) == 4  # padded to 4 heads: 512 values


def _rope_tables(d: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    freqs = torch.arange(positions).double()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float().to(DEVICE), emb.sin().float().to(DEVICE)


def _rotated_reference(qkv, positions, cos, sin, norm, hq: int, hkv: int):
    """float64 (q, k) normalised (`norm` = (q weight, k weight, eps), optional) and rotated,
    and v, of `qkv` [T, (hq + 2 hkv) d]."""
    tokens, d = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv)
    ref = qkv.double()
    q = ref[:, : hq * d].view(tokens, hq, d)
    k = ref[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
    v = ref[:, (hq + hkv) * d :].view(tokens, hkv, d)
    if norm is not None:
        q_w, k_w, eps = norm
        q = q_w.double() * q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps)
        k = k_w.double() * k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    c, s = cos.double()[positions], sin.double()[positions]
    return _rope_reference(q, c, s), _rope_reference(k, c, s), v


def _paged_setup(kv_lens: list[int], page: int, hkv: int, d: int, dtype, gen):
    """Random K/V scattered over shuffled pages, with each sequence's page table."""
    pages_per_seq = [-(-n // page) for n in kv_lens]
    total_pages = sum(pages_per_seq) + 3
    order = torch.randperm(total_pages, generator=gen).tolist()
    width = max([*pages_per_seq, 1])
    table = torch.zeros(len(kv_lens), width, dtype=torch.int64)
    for i, n in enumerate(pages_per_seq):
        table[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int64)
    k = _randn(total_pages * page, hkv, d, dtype=dtype, gen=gen)
    v = _randn(total_pages * page, hkv, d, dtype=dtype, gen=gen)
    return k, v, table.to(DEVICE)


def _gather(cache: torch.Tensor, table: torch.Tensor, seq: int, n: int, page: int) -> torch.Tensor:
    pos = torch.arange(n, device=DEVICE)
    return cache[table[seq, pos // page] * page + pos % page].double()


def _attention_reference(q, k, v, q_pos, scale, window):
    """q [M, Hq, D], k/v [L, Hkv, D]: causal (q_pos), optional window, float64."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,lhd->hml", q.double(), k) * scale
    pos = torch.arange(k.shape[0], device=DEVICE)
    keep = pos[None, :] <= q_pos[:, None]
    if window is not None:
        keep &= pos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~keep[None], float("-inf"))
    return torch.einsum("hml,lhd->mhd", torch.softmax(s, dim=-1), v)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 4, 64), (8, 2, 64), (4, 1, 128)])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("tiles", [None, PrefillTiles(128, 128, 8, 2)])
def test_prefill_attention_with_prefix(dtype, hq, hkv, d, page, window, tiles) -> None:
    _skip_unlaunchable(tiles, d, dtype)
    gen = torch.Generator().manual_seed(hq + d + page)
    # the last three: query tiles after whole key blocks (unmasked) and with the diagonal's,
    # starting one and two positions below a 64-key block's end
    q_lens, prefixes = [37, 1, 70, 5, 100, 40, 5], [0, 12, 30, 0, 150, 62, 63]
    kv_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    k, v, table = _paged_setup(kv_lens, page, hkv, d, dtype, gen)
    q = _randn(sum(q_lens), hq, d, dtype=dtype, gen=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=DEVICE)
    kv = torch.tensor(kv_lens, device=DEVICE)
    scale = d**-0.5
    out = prefill_attention(q, k, v, cu, kv, table, max(q_lens), page, scale, window, tiles)
    _check_last_tokens_attention(out, q, k, v, table, cu, kv_lens, page, scale, window, dtype)


def test_prefill_tiles_follow_the_batch() -> None:
    """Wide tiles only when every sequence fills most of one (a decode row would be padded to
    128 rows over its whole context) and the batch has enough tokens to fill the GPU with
    them, small ones when no query is longer than 32 tokens."""
    assert prefill_tiles([2048, 128, 8192], 128, 2) == WIDE_PREFILL_TILES
    assert prefill_tiles([512], 128, 2) == PREFILL_TILES  # too few programs of 128 rows
    assert prefill_tiles([2048, 1, 1], 128, 2) == PREFILL_TILES
    assert prefill_tiles([127, 33], 128, 2) == PREFILL_TILES
    assert prefill_tiles([1, 32, 5], 128, 2) == SHORT_PREFILL_TILES
    # its K/V stages would not fit in shared memory: bf16 with head_dim 256, float32 with 128
    assert prefill_tiles([8192] * 4, 256, 2) == prefill_tiles([8192] * 4, 128, 4) == PREFILL_TILES


def _compiled_report(module: str) -> dict:
    """The JSON a module that compiles kernels for sm_90 prints, run outside Triton's
    interpreter (which this session runs, and under which nothing compiles)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", module],
        env=env, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    return json.loads(run.stdout)


def test_prefill_tiles_fit_in_shared_memory() -> None:
    """Compiled for sm_90, the tile `prefill_tiles` picks for long batches (and the launch for
    short rows, with their largest block), and the split-decode kernel's block for large
    batches, need at most the 227 KiB of shared memory a Hopper SM gives one program: Triton
    would refuse the launch (the 128 x 128 tile in bf16 with head_dim 256 needed 320 KiB)."""
    shared = _compiled_report("tests.kernels.prefill_smem")
    assert len(shared) == 5 and all(0 < b <= 227 * 1024 for b in shared.values()), shared


def _check_last_tokens_attention(out, q, k, v, table, cu, kv_lens, page, scale, window, dtype):
    """Each sequence's query tokens (laid out by `cu`) are its last ones: causal attention over
    its `kv_lens` positions, against the float64 reference (sequences without tokens skipped)."""
    for i, kl in enumerate(kv_lens):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        ql = rows.stop - rows.start
        if ql == 0:
            continue
        q_pos = torch.arange(kl - ql, kl, device=DEVICE)
        ref = _attention_reference(
            q[rows], _gather(k, table, i, kl, page), _gather(v, table, i, kl, page), q_pos,
            scale, window,
        )  # fmt: skip
        _close(out[rows], ref, dtype)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 4, 64), (8, 2, 128), (16, 2, 64)])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("early_kv", [True, False])
def test_split_kv_decode(dtype, hq, hkv, d, page, window, early_kv) -> None:
    gen = torch.Generator().manual_seed(hq * 3 + d + page)
    kv_lens = [1, 77, 300, 0, 16]  # 0: a padded CUDA-graph row
    k, v, table = _paged_setup(kv_lens, page, hkv, d, dtype, gen)
    q = _randn(len(kv_lens), hq, d, dtype=dtype, gen=gen)
    splits = 4 if page == 1 else 1  # 1: what large batches use (decode_splits)
    mid_o = torch.empty(len(kv_lens), hq, splits, d, device=DEVICE)
    mid_lse = torch.empty(len(kv_lens), hq, splits, device=DEVICE)
    scale = d**-0.5
    kv = torch.tensor(kv_lens, device=DEVICE)
    out = decode_attention(q, k, v, kv, table, page, scale, window, mid_o, mid_lse, early_kv)
    for i, n in enumerate(kv_lens):
        if n == 0:
            assert (out[i] == 0).all()
            continue
        ref = _attention_reference(
            q[i : i + 1], _gather(k, table, i, n, page), _gather(v, table, i, n, page),
            torch.tensor([n - 1], device=DEVICE), scale, window,
        )  # fmt: skip
        _close(out[i : i + 1], ref, dtype)


@pytest.mark.parametrize("blocks", [(32, 3, 8), (128, 2, 4)])
def test_split_kv_decode_with_a_sweeps_blocks(blocks) -> None:
    """`decode_attention` with the (key block, stages, warps) a sweep passes: the same
    attention (contexts of several such blocks, one split and two)."""
    hq, hkv, d, page, dtype = 8, 2, 64, 16, DOT_DTYPES[0]
    gen = torch.Generator().manual_seed(blocks[0])
    kv_lens = [1, 77, 300, 33]
    k, v, table = _paged_setup(kv_lens, page, hkv, d, dtype, gen)
    q = _randn(len(kv_lens), hq, d, dtype=dtype, gen=gen)
    kv, scale = torch.tensor(kv_lens, device=DEVICE), d**-0.5
    for splits in (1, 2):
        mid_o = torch.empty(len(kv_lens), hq, splits, d, device=DEVICE)
        mid_lse = torch.empty(len(kv_lens), hq, splits, device=DEVICE)
        out = decode_attention(q, k, v, kv, table, page, scale, None, mid_o, mid_lse, False,
                               blocks)  # fmt: skip
        for i, n in enumerate(kv_lens):
            ref = _attention_reference(
                q[i : i + 1], _gather(k, table, i, n, page), _gather(v, table, i, n, page),
                torch.tensor([n - 1], device=DEVICE), scale, None,
            )  # fmt: skip
            _close(out[i : i + 1], ref, dtype)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 4, 64), (8, 2, 64), (16, 2, 128)])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("splits", [1, 3])
def test_verify_attention_is_causal_attention_of_the_last_tokens(
    dtype, hq, hkv, d, page, window, splits
) -> None:
    gen = torch.Generator().manual_seed(hq * 5 + d + page + splits)
    # Verify rows of 1 + k tokens, a decode row, a row of no tokens (graph padding), a short
    # prefill chunk with no prefix; 3 padding tokens at the end, in no row.
    q_lens, kv_lens = [5, 1, 0, 3, 2, 8], [130, 77, 0, 3, 65, 200]
    k, v, table = _paged_setup(kv_lens, page, hkv, d, dtype, gen)
    q = _randn(sum(q_lens) + 3, hq, d, dtype=dtype, gen=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=DEVICE)
    mid_o = torch.empty(q.shape[0], hq, splits, d, device=DEVICE)
    mid_lse = torch.empty(q.shape[0], hq, splits, device=DEVICE)
    scale = d**-0.5
    kv = torch.tensor(kv_lens, device=DEVICE)
    out = verify_attention(q, k, v, cu, kv, table, max(q_lens), page, scale, window, mid_o, mid_lse)
    _check_last_tokens_attention(out, q, k, v, table, cu, kv_lens, page, scale, window, dtype)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "page", "short"), [(8, 2, 64, 16, 5), (16, 1, 128, 1, 4), (8, 2, 256, 16, 8)]
)
@pytest.mark.parametrize("window", [None, 30])
@pytest.mark.parametrize("tiles", [None, PrefillTiles(128, 128, 8, 2)])
def test_mixed_batch_short_rows_split_kv_long_rows_prefill(
    dtype, hq, hkv, d, page, short, window, tiles
) -> None:
    """The prefill kernel with `short_q_len`: a batch's short rows (decodes, a chunk of exactly
    `short` tokens; the largest group x head_dim `verifies_split_kv` allows) as a verify step's
    programs, its longer ones (one of `short` + 1) as prefill tiles, a row of no tokens between
    them: causal attention."""
    _skip_unlaunchable(tiles, d, dtype)
    gen = torch.Generator().manual_seed(hq + d + short)
    q_lens = [1, 37, 1, short, 70, 1, 0, short + 1]
    prefixes = [20, 0, 140, 10, 30, 64, 10, 62]
    kv_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    k, v, table = _paged_setup(kv_lens, page, hkv, d, dtype, gen)
    q = _randn(sum(q_lens), hq, d, dtype=dtype, gen=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=DEVICE)
    kv, scale = torch.tensor(kv_lens, device=DEVICE), d**-0.5
    out = prefill_attention(q, k, v, cu, kv, table, 70, page, scale, window, tiles, short)
    _check_last_tokens_attention(out, q, k, v, table, cu, kv_lens, page, scale, window, dtype)


@pytest.mark.parametrize("window", [None, 30])
def test_wide_prefill_tiles_over_several_tiles_and_blocks(window) -> None:
    """128 x 128 tiles over queries of several tiles each, whose tiles start one and two
    positions below a key block's end (the first keys whole for every query, then the
    diagonal's block): causal attention."""
    hq, hkv, d, page, dtype = 4, 2, 64, 16, DOT_DTYPES[0]
    gen = torch.Generator().manual_seed(11)
    q_lens, prefixes = [300, 130, 40], [126, 127, 254]
    kv_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    k, v, table = _paged_setup(kv_lens, page, hkv, d, dtype, gen)
    q = _randn(sum(q_lens), hq, d, dtype=dtype, gen=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=DEVICE)
    kv, scale = torch.tensor(kv_lens, device=DEVICE), d**-0.5
    out = prefill_attention(q, k, v, cu, kv, table, 300, page, scale, window, WIDE_PREFILL_TILES)
    _check_last_tokens_attention(out, q, k, v, table, cu, kv_lens, page, scale, window, dtype)


@pytest.mark.parametrize(
    ("lens", "group", "short", "verify", "tiles"),
    [
        ([1, 8, 500], 16, 4, False, PREFILL_TILES),  # 8 tokens x 16 heads: too many rows
        ([1, 4, 500], 16, 4, False, PREFILL_TILES),
        ([1, 5, 64], 16, 4, False, PREFILL_TILES),  # tiles from rows 5 and 64
        ([1, 3], 2, 8, True, SHORT_PREFILL_TILES),  # all short: a verify-like step
        ([2, 4096, 4096], 2, 8, False, WIDE_PREFILL_TILES),  # tiles from the long rows
        ([8, 4096, 4096], 2, 8, False, WIDE_PREFILL_TILES),
        ([9, 4096, 4096], 2, 8, False, PREFILL_TILES),
        ([4096, 4096], 2, 8, False, WIDE_PREFILL_TILES),
    ],
)
def test_triton_backend_plans_short_rows_and_tiles(
    llama_dir, lens, group, short, verify, tiles
) -> None:
    """`plan`: a prefill batch's short rows (at most 8 tokens, within the verify kernel's
    rows: a bound of the model's, the same for every batch, so one kernel serves every mixed
    batch) are attended as verify rows, the tiles are chosen from the other rows."""
    import dataclasses

    from tokenmill.attention.backend import AttentionInputs
    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from tokenmill.cache.kv_cache import KVCache
    from tokenmill.config import ModelConfig

    model = dataclasses.replace(
        ModelConfig.from_pretrained(llama_dir, "bfloat16"), num_layers=1, num_heads=group,
        num_kv_heads=1, head_dim=128,
    )  # fmt: skip
    backend = TritonAttentionBackend(model, KVCache.allocate(model, 2, 16, DEVICE), 4)
    none = torch.zeros(0, dtype=torch.int64)
    backend.plan(AttentionInputs(lens, lens, none, none, none, none))
    assert (backend._short_q_len, backend._verify, backend._tiles) == (short, verify, tiles)


def test_verify_attention_serves_short_queries_within_its_rows() -> None:
    from tokenmill.attention.triton_backend import verifies_split_kv

    # Verify steps of k = 4 (5 tokens) on Qwen3-0.6B (group 2), Llama-3.1-8B (4), Qwen3-30B-A3B
    # (8), head_dim 128; 16 query heads per KV head take the prefill kernel past 4 tokens, and
    # so does a head_dim of 256 past 32 rows.
    assert all(verifies_split_kv(5, group, 128) for group in (1, 2, 4, 8))
    assert verifies_split_kv(4, 16, 128) and not verifies_split_kv(5, 16, 128)
    assert verifies_split_kv(8, 4, 256) and not verifies_split_kv(5, 8, 256)
    assert verifies_split_kv(8, 1, 128) and not verifies_split_kv(9, 1, 128)


def test_decode_splits_fill_the_gpu_and_shrink_with_the_batch(monkeypatch) -> None:
    from tokenmill.attention import triton_backend

    monkeypatch.setattr(triton_backend, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    splits = [triton_backend.decode_splits(cuda, b, 8) for b in (1, 2, 8, 16, 64, 256)]
    assert splits == [16, 16, 9, 5, 2, 1]  # programs: at least 4 per SM, at most 16 splits
    assert triton_backend.decode_splits(torch.device("cpu"), 1, 8) == 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_triton_backend_engine_matches_transformers(checkpoints, family: str, monkeypatch) -> None:
    """The whole engine on the Triton backend: chunked prefill, prefix hits, decode, mixed
    batches (their short rows split-KV), float32."""
    from tests.conftest import hf_greedy
    from tokenmill import LLM, SamplingParams
    from tokenmill.attention import triton_backend

    path = checkpoints[family]
    prompts = [list(range(3, 10)), list(range(20, 57)), [100, 200, 300], list(range(20, 45))]
    llm = LLM(
        str(path), device=DEVICE, dtype="float32", attention_backend="triton", page_size=4,
        max_num_batched_tokens=16,
    )  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # Each prefill launch's query lengths and short_q_len (rows up to it attended as verify rows)
    launches = []
    prefill = triton_backend.prefill_attention

    def recorded(*a, **kw):
        call = inspect.signature(prefill).bind(*a, **kw).arguments
        launches.append((call["cu_q"].diff().tolist(), call.get("short_q_len", 0)))
        return prefill(*a, **kw)

    monkeypatch.setattr(triton_backend, "prefill_attention", recorded)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, 10) for p in prompts]
    assert outputs[3].num_cached_tokens > 0  # shares 24 tokens with the second prompt
    assert {short for _, short in launches} <= {0, 8}  # one bound for the model: one kernel
    # decode rows beside chunks, with a launch of their own; none without short rows
    assert any(1 in lens and max(lens) > 8 for lens, short in launches if short)
    assert all(min(lens) > 8 for lens, short in launches if not short)
    # Alone in its batch, a sequence decodes the same tokens.
    single = llm.generate(prompts[2:3], greedy, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outputs[2].outputs[0].token_ids


@pytest.mark.parametrize("cores", ["cuda", "tensor"])
def test_engine_with_every_gemv_fusion_matches_transformers(checkpoints, cores: str) -> None:
    """Every linear layer forced onto the GEMV kernel for decode batches of up to 4 (most with
    add+RMSNorm fused into q/k/v and gate/up and SwiGLU into down, some behind those kernels),
    on the CUDA cores or, for batches of 2-4, the tensor cores: greedy output unchanged
    (Llama: the fusions are the same for every family; under Triton's interpreter this test
    takes most of a minute)."""
    from tests.conftest import hf_greedy
    from tokenmill import LLM, SamplingParams
    from tokenmill.kernels.gemv_tuning import GEMV_BUCKETS, GemvChoice
    from tokenmill.layers.linear import Linear

    path = checkpoints["llama"]
    prompts = [list(range(3, 10)), [100, 200, 300], list(range(20, 45))]
    llm = LLM(str(path), device=DEVICE, dtype="float32", enforce_eager=True)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert {layer.input_kind for layer in layers} == {"plain", "gated", "normed"}
    for i, layer in enumerate(layers):
        config = GemvConfig(8, 32, 1 + i % 3, prefetch=1 + i % 2, defer=i % 4 < 2)
        layer.gemv_choices = dict.fromkeys(GEMV_BUCKETS, GemvChoice(config, fused=i % 5 < 3))
        if cores == "tensor":  # the decode batches of 2-4 rows (a prompt's first token: 1)
            dot = GemvConfig(16 << i % 3, 32, 1 + i % 3, prefetch=1 + i % 3, dot=True)
            layer.gemv_choices[4] = GemvChoice(dot, fused=i % 5 < 3)
    assert {c.fused for layer in layers for c in layer.gemv_choices.values()} == {True, False}
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, 8) for p in prompts]


@pytest.mark.parametrize("kind", ["plain", "gated", "normed"])
def test_gemv_choice_takes_the_fastest_correct_candidate(monkeypatch, kind: str) -> None:
    """The start-up choice over fused and unfused GEMVs (device times faked; every candidate
    still runs and matches cuBLAS, or the times would be misaligned): cuBLAS stays when nothing
    beats it by the margin, else the fastest wins; a plain input is always 'fused'."""
    from tokenmill.kernels import gemv_tuning

    calls: list[object] = []

    def fake_seconds(fn) -> float:  # cuBLAS first, then the candidates in order
        fn()
        calls.append(fn)
        return times[len(calls) - 1]

    monkeypatch.setattr(gemv_tuning, "median_graph_seconds", fake_seconds)
    gen = torch.Generator().manual_seed(0)
    weights = [_randn(16, 64, gen=gen) for _ in range(2)]
    choices = [
        gemv_tuning.GemvChoice(c, fused)
        for c in gemv_tuning.GEMV_CANDIDATES
        if c.serves(1)
        for fused in ((True,) if kind == "plain" else (True, False))
    ]
    times = [1.0] + [0.98] * len(choices)  # within the margin of cuBLAS: not worth it
    # Seconds per weight: the fake times are of both weights.
    assert gemv_tuning.fastest_gemv(weights, [1], kind) == {1: (None, 0.5, 0.5)}
    calls.clear()
    pick = len(choices) - 1
    times = [1.0] + [0.98] * pick + [0.5]
    assert gemv_tuning.fastest_gemv(weights, [1], kind) == {1: (choices[pick], 0.25, 0.5)}
    assert choices[pick].fused == (kind == "plain")


def test_gemv_candidates_checked_on_threads_keep_their_order(monkeypatch) -> None:
    """A cold start checks (and so compiles) the candidates on several threads; the timing
    then runs the correct ones alone, in candidate order (device times faked, falling: the last
    correct candidate wins), and a wrong one is never timed."""
    import threading
    import time

    from tokenmill.kernels import gemv_tuning

    threads: set[int] = set()

    def fake_check(run, expected, choice) -> bool:
        threads.add(threading.get_ident())
        time.sleep(0.05)  # a compile's worth of waiting, so that the threads overlap
        return choice.config.block_k == 512 and choice.fused

    falling = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
    times = iter(falling)
    timed = []
    monkeypatch.setattr(gemv_tuning, "matches_cublas", fake_check)
    monkeypatch.setattr(
        gemv_tuning, "median_graph_seconds", lambda fn: timed.append(fn) or next(times)
    )
    weights = [_randn(16, 64, gen=torch.Generator().manual_seed(0)) for _ in range(2)]
    correct = [
        gemv_tuning.GemvChoice(c, True) for c in gemv_tuning.GEMV_CANDIDATES
        if c.serves(1) and c.block_k == 512
    ]  # fmt: skip
    chosen = gemv_tuning.fastest_gemv(weights, [1], "gated", threads=4)
    assert len(threads) > 1
    assert len(timed) == 1 + len(correct)  # cuBLAS, then each correct candidate once
    assert chosen == {1: (correct[-1], falling[len(correct)] / 2, 0.5)}  # per weight (2)


@pytest.mark.parametrize("kind", ["plain", "normed"])
def test_shipped_choices_hold_only_where_every_chosen_kernel_matches_cublas(
    monkeypatch, kind: str
) -> None:
    """A shipped choice (measured on another machine) is taken once each chosen kernel has
    run here and matched cuBLAS; one that gives another product (or fails to build) is not."""
    from tokenmill.kernels import gemv_tuning

    gen = torch.Generator().manual_seed(3)
    weights = [_randn(16, 64, gen=gen) for _ in range(2)]
    one, four = [c for c in gemv_tuning.GEMV_CANDIDATES if not c.dot and c.serves(4)][:2]
    timings = {
        1: gemv_tuning.GemvTiming(gemv_tuning.GemvChoice(one, True), 1.0, 2.0),
        4: gemv_tuning.GemvTiming(gemv_tuning.GemvChoice(four, kind == "plain"), 1.0, 2.0),
        8: gemv_tuning.GemvTiming(None, 2.0, 2.0),
    }
    assert gemv_tuning.shipped_choices_hold(weights, timings, kind)
    real_gemv = gemv_tuning.gemv
    monkeypatch.setattr(gemv_tuning, "gemv", lambda *a, **k: 2 * real_gemv(*a, **k))
    assert not gemv_tuning.shipped_choices_hold(weights, timings, kind)
    assert gemv_tuning.shipped_choices_hold(weights, {8: timings[8]}, kind)  # cuBLAS only
    # A choice the tuning would not try for those rows (tensor-core tiles are for 2+ rows) is
    # refused unrun, whatever its product.
    dot = next(c for c in gemv_tuning.GEMV_CANDIDATES if c.dot)
    one_dot = {1: gemv_tuning.GemvTiming(gemv_tuning.GemvChoice(dot, False), 1.0, 2.0)}
    monkeypatch.setattr(gemv_tuning, "_check_choices", lambda *_: pytest.fail("ran"))
    assert not gemv_tuning.shipped_choices_hold(weights, one_dot, kind)


def test_gemv_timing_streams_enough_weights_not_every_layer() -> None:
    """A candidate is timed on enough of a shape's weights to stream TIMED_BYTES a replay
    (never fewer than 2), not on every layer's: llama-3.1-8b's 32 MLP weights of 235 MB each
    cost 12 s of one cold start's tuning."""
    from tokenmill.kernels.gemv_tuning import TIMED_BYTES, timed_weights

    mlp = [torch.empty(28672, 4096, dtype=torch.bfloat16, device="meta") for _ in range(32)]
    assert timed_weights(mlp) == mlp[:3]  # 3 x 235 MB >= 512 MiB
    small = [torch.empty(1024, 2048, dtype=torch.bfloat16, device="meta") for _ in range(200)]
    count = len(timed_weights(small))
    assert count * 1024 * 2048 * 2 >= TIMED_BYTES > (count - 1) * 1024 * 2048 * 2
    assert timed_weights(small[:28]) == small[:28]  # qwen3-0.6b's 28 layers: all of them
    huge = [torch.empty(2**20, 2**12, dtype=torch.bfloat16, device="meta") for _ in range(4)]
    assert timed_weights(huge) == huge[:2]


def test_gemv_candidate_check_rejects_wrong_or_failing_kernels(caplog) -> None:
    from tokenmill.kernels.gemv_tuning import GemvChoice
    from tokenmill.kernels.gemv_tuning import matches_cublas as _matches

    expected = torch.tensor([[1.0, -2.0, 3.0]])
    config = GemvChoice(GemvConfig(8, 32, 1))
    assert _matches(lambda: expected + 0.01, expected, config)
    assert not _matches(lambda: expected * 1.5, expected, config)

    def broken() -> torch.Tensor:
        raise RuntimeError("no such kernel")

    assert not _matches(broken, expected, config)
    assert "no such kernel" in caplog.text and "disagrees" in caplog.text


def test_pdl_kernels_wait_before_touching_memory() -> None:
    """Launched with PDL, a kernel may start before the previous one has finished: compiled for
    sm_90, no kernel may write global memory before its `griddepcontrol.wait`; only the
    CUDA-core GEMV (constant weights), rotary + store (the step's positions and slots, the
    rotary tables), split decode (KV lengths, page table, K/V of earlier steps) and the MoE
    down GEMV (router logits of the kernel before the previous one, expert weights) read
    before it. The tensor-core GEMV loads nothing before it: its slabs stream in Triton's
    pipeline, which starts after the wait."""
    before_wait = _compiled_report("tests.kernels.ptx_prologue")
    assert set(before_wait) >= {"decode_split", "decode_reduce", "verify_split", "gemv",
                                "gemv_dot", "gemv_dot_normed", "rope_store", "rope_store_blocked",
                                "moe_gate_up_gemv", "moe_down_gemv",
                                "invariant_matmul", "invariant_matmul_swiglu",
                                "invariant_matmul_across", "invariant_matmul_loop",
                                "invariant_matmul_tma", "invariant_matmul_tma_across", "invariant",
                                "invariant_int64_index", "invariant_merge"}  # fmt: skip
    reads_first = {"gemv", "rope_store", "rope_store_blocked", "decode_split",
                   "decode_split_late", "moe_down_gemv"}  # fmt: skip
    for name, ops in before_wait.items():
        if name in reads_first:
            assert ops and all(op.startswith("ld.global") for op in ops), (name, ops)
        else:
            assert ops == [], (name, ops)


@pytest.mark.parametrize(("batch", "padded", "width"), [(1, 1, 3), (3, 4, 130), (5, 8, 1)])
def test_fill_decode_inputs(batch: int, padded: int, width: int) -> None:
    """From the packed block: rows < batch copied (the pending ones take the previous step's
    sample), padding rows get slot -1 and KV length 0, static columns beyond the batch's width
    and rows beyond `padded` untouched."""
    from tokenmill.kernels.graph_inputs import (
        decode_block_size,
        fill_decode_inputs,
        pack_decode_inputs,
    )

    gen = torch.Generator().manual_seed(batch)

    def ints(*shape: int) -> torch.Tensor:
        return torch.randint(0, 1000, shape, generator=gen)

    inputs = (ints(batch), ints(batch), ints(batch), ints(batch), ints(batch, width))
    row_src = torch.tensor([i % 3 - 1 for i in range(batch)])  # -1, 0, 1, -1, ...
    sampled = ints(4).to(DEVICE)
    static = tuple(t.to(DEVICE) for t in (ints(10), ints(10), ints(10), ints(10), ints(10, 140)))
    before = tuple(t.clone() for t in static)
    packed = pack_decode_inputs(*(t.numpy() for t in inputs), row_src.numpy(), padded)
    block = torch.full((decode_block_size(10, 140),), 7, dtype=torch.int64)  # stale tail
    block[: packed.size] = torch.from_numpy(packed)
    fill_decode_inputs(block.to(DEVICE), sampled, static, padded)
    ids = torch.where(row_src >= 0, sampled.cpu()[row_src.clamp(min=0)], inputs[0])
    for got, want in zip(static[:4], (ids, *inputs[1:4]), strict=True):
        assert torch.equal(got[:batch].cpu(), want)
    assert torch.equal(static[4][:batch, :width].cpu(), inputs[4])
    assert (static[2][batch:padded] == -1).all() and (static[3][batch:padded] == 0).all()
    assert torch.equal(static[4][:, width:], before[4][:, width:])
    for got, old in zip(static, before, strict=True):
        assert torch.equal(got[padded:], old[padded:])
    with pytest.raises(ValueError, match="does not fit"):
        pack_decode_inputs(*(t.numpy() for t in inputs), row_src.numpy(), batch - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 5), (3, 2048), (2, 5000)])
def test_argmax_rows_is_torch_argmax(dtype: torch.dtype, rows: int, vocab: int) -> None:
    """Equal to `torch.argmax`, ties (within and across vocabulary chunks) to the lowest index;
    a second launch finds the tickets reset; with `host_out` the tokens also land in (pinned)
    host memory."""
    from tokenmill.kernels.argmax import argmax_rows

    gen = torch.Generator().manual_seed(rows * vocab)
    logits = _randn(rows, vocab, dtype=dtype, gen=gen)
    logits[0, vocab - 1] = logits[0, vocab // 3] = 100.0  # a tie, across chunks when long
    if rows > 1:
        logits[1] = float("-inf")
    for _ in range(2):
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    host = torch.full((rows,), -1, dtype=torch.int64)
    if DEVICE == "cuda":
        host = host.pin_memory()
    assert torch.equal(argmax_rows(logits, host_out=host), logits.argmax(dim=-1))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(host, logits.argmax(dim=-1).cpu())  # written by the kernel itself
    with pytest.raises(ValueError, match="contiguous"):
        argmax_rows(logits.t())
    with pytest.raises(ValueError, match="host_out"):
        argmax_rows(logits, host_out=host[:0])


def _dense_causal_reference(q, k, v, scale):
    """cuDNN's dense causal attention by its definition (`[1, H, n, D]` each, KV heads shared
    by their query heads), in float64."""
    n = q.shape[2]
    return _attention_reference(
        q[0].transpose(0, 1), k[0].double().transpose(0, 1), v[0].double().transpose(0, 1),
        torch.arange(n, device=q.device), scale, None,
    ).transpose(0, 1)[None].to(q.dtype)  # fmt: skip


def _dense_test_backend(llama_dir, kv_lens: list[int], page: int, dtype, gen):  # type: ignore[no-untyped-def]
    """A one-layer Triton backend (8 query heads over 2 KV heads of 64) whose paged cache holds
    random K/V for sequences of `kv_lens` tokens: (backend, k, v, page table)."""
    import dataclasses

    from tokenmill.attention import triton_backend
    from tokenmill.cache.kv_cache import KVCache
    from tokenmill.config import ModelConfig

    hq, hkv, d = 8, 2, 64
    model = dataclasses.replace(
        ModelConfig.from_pretrained(llama_dir, "float32"), num_layers=1, num_heads=hq,
        num_kv_heads=hkv, head_dim=d, dtype=dtype, sliding_window=None,
    )  # fmt: skip
    k, v, table = _paged_setup(kv_lens, page, hkv, d, dtype, gen)
    cache = KVCache.allocate(model, k.shape[0] // page, page, torch.device(DEVICE))
    cache.k[0].view(-1, hkv, d).copy_(k)
    cache.v[0].view(-1, hkv, d).copy_(v)
    return triton_backend.TritonAttentionBackend(model, cache, len(kv_lens)), k, v, table


@pytest.mark.parametrize("order", ["dense rows first", "interleaved", "dense rows last"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("refused", [False, True])
def test_dense_rows_beside_paged_rows(llama_dir, order, page, refused, monkeypatch) -> None:
    """A prefill batch's whole long prompts (no cached prefix) through cuDNN's dense causal
    attention over the step's K/V by token, padded (into the next rows, or the buffer's zeroed
    spare rows), the other rows (a prefix, short, a short prompt) through the Triton kernel
    over the cache, which leaves the dense rows alone: every row equals the float64
    reference. Off a GPU, cuDNN's kernel is replaced by its definition. `refused`: cuDNN
    raises; the Triton kernel attends every row, and no row is dense after."""
    import dataclasses

    from tokenmill.attention import dense_rows, triton_backend
    from tokenmill.attention.backend import AttentionInputs

    monkeypatch.setattr(triton_backend, "DENSE_MIN_Q_LEN", 48)
    if DEVICE != "cuda":
        monkeypatch.setattr(triton_backend, "dense_supported", lambda *_: True)
        monkeypatch.setattr(dense_rows, "_dense_causal", _dense_causal_reference)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    hq, hkv, d = 8, 2, 64
    # the dense rows attended as 72 and 104 tokens (`dense_length`)
    dense, other = [(70, 0), (100, 0)], [(40, 62), (1, 50), (5, 0), (20, 0), (60, 9)]
    rows = {
        "dense rows first": dense + other,
        "interleaved": [other[0], dense[0], other[1], other[2], dense[1], other[3], other[4]],
        "dense rows last": other + dense,
    }[order]
    q_lens = [q for q, _ in rows]
    kv_lens = [q + p for q, p in rows]
    gen = torch.Generator().manual_seed(page + len(rows))
    backend, k, v, table = _dense_test_backend(llama_dir, kv_lens, page, dtype, gen)
    tokens = sum(q_lens)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=DEVICE)
    kv = torch.tensor(kv_lens, device=DEVICE)
    slots = torch.full((tokens,), -1, device=DEVICE)
    inputs = AttentionInputs(q_lens, kv_lens, cu, kv, table, slots)
    backend.plan(dataclasses.replace(inputs, graphed=True))  # a capture: never dense
    assert backend._dense == [] and backend._fresh is None
    backend.plan(inputs)
    starts = [int(cu[i]) for i, row in enumerate(rows) if row in dense]
    planned = [(row.start, row.n, row.length) for row in backend._dense]
    lengths = {70: 72, 100: 104}
    assert planned == [(s, q, lengths[q]) for s, (q, _) in zip(starts, dense, strict=True)]
    spare = backend._fresh.shape[1] - tokens
    assert spare == {"dense rows first": 0, "interleaved": 0, "dense rows last": 4}[order]
    assert backend._fresh.shape[0] == 2 and backend._fresh.shape[2:] == (hkv, d)
    assert (backend._fresh[:, tokens:] == 0).all()
    # the step's K/V by token (as `store_qkv` writes them), queries with spare storage
    for i, kl in enumerate(kv_lens):
        ql = q_lens[i]
        for cache_kv, fresh in ((k, backend._fresh[0]), (v, backend._fresh[1])):
            fresh[int(cu[i]) : int(cu[i + 1])] = _gather(cache_kv, table, i, kl, page)[kl - ql :]
    q = _randn(tokens + spare, hq, d, dtype=dtype, gen=gen)[:tokens]
    if refused:
        monkeypatch.setattr(dense_rows, "_dense_causal", _refuse)
    out = backend.attend(q, 0)
    scale = d**-0.5
    _check_last_tokens_attention(out, q, k, v, table, cu, kv_lens, page, scale, None, dtype)
    backend.plan(inputs)
    assert len(backend._dense) == (0 if refused else 2)


def test_dense_rows_are_never_short_rows(llama_dir, monkeypatch) -> None:
    """A bound at or below the short rows' (8 tokens here): a whole 6-token prompt stays a
    short row (the short rows' launch attends every row within it), and the long row after a
    prefix is still attended by the Triton kernel's long launch, in the tiles for it alone
    (not for the dense row's length: a tile the warm-up never built compiles inside a step)."""
    from tokenmill.attention import dense_rows, triton_backend
    from tokenmill.attention.backend import AttentionInputs

    monkeypatch.setattr(triton_backend, "DENSE_MIN_Q_LEN", 4)
    tiled: list[list[int]] = []
    tiles = triton_backend.prefill_tiles
    monkeypatch.setattr(
        triton_backend, "prefill_tiles", lambda lens, *a: tiled.append(lens) or tiles(lens, *a)
    )
    monkeypatch.setattr(triton_backend, "dense_supported", lambda *_: True)
    monkeypatch.setattr(dense_rows, "_dense_causal", _dense_causal_reference)
    hq, d, page = 8, 64, 16
    q_lens, kv_lens = [6, 40, 50], [6, 50, 50]
    gen = torch.Generator().manual_seed(3)
    backend, k, v, table = _dense_test_backend(llama_dir, kv_lens, page, torch.float32, gen)
    cu = torch.tensor([0, 6, 46, 96], device=DEVICE)
    slots = torch.full((96,), -1, device=DEVICE)
    backend.plan(AttentionInputs(q_lens, kv_lens, cu, torch.tensor(kv_lens, device=DEVICE),
                                 table, slots))  # fmt: skip
    assert [(row.start, row.n) for row in backend._dense] == [(46, 50)]
    assert tiled == [[40]]
    backend._fresh[:, 46:96] = torch.stack([_gather(x, table, 2, 50, page) for x in (k, v)])
    q = _randn(backend._fresh.shape[1], hq, d, gen=gen)[:96]
    out = backend.attend(q, 0)
    _check_last_tokens_attention(out, q, k, v, table, cu, kv_lens, page, d**-0.5, None,
                                 torch.float32)  # fmt: skip


def _refuse(*_args: object) -> None:
    raise RuntimeError("cuDNN Frontend error: no valid engine configs")


def test_prefill_kernel_leaves_dense_rows_alone() -> None:
    """`dense_min_len`: the Triton prefill kernel writes no output (into `out`) for rows of at
    least that many query tokens without a cached prefix (attended elsewhere; 48 tokens, the
    bound itself, included), and the others' as before, a short row's launch included."""
    gen = torch.Generator().manual_seed(5)
    q_lens, prefixes = [64, 30, 64, 1, 48], [0, 0, 10, 40, 0]
    kv_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    k, v, table = _paged_setup(kv_lens, 16, 2, 64, torch.float32, gen)
    q = _randn(sum(q_lens), 4, 64, gen=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=DEVICE)
    out = prefill_attention(
        q, k, v, cu, torch.tensor(kv_lens, device=DEVICE), table, 64, 16, 0.125, None,
        short_q_len=8, dense_min_len=48, out=torch.full_like(q, 7.0),
    )  # fmt: skip
    assert (out[:64] == 7.0).all() and (out[-48:] == 7.0).all()  # the dense rows: untouched
    assert not (out[64:-48] == 7.0).any()
    _check_last_tokens_attention(
        out[64:-48], q[64:-48], k, v, table[1:4], cu[1:5] - 64, kv_lens[1:4], 16, 0.125, None,
        torch.float32,
    )  # fmt: skip


def test_prefill_launches_short_and_long_rows_apart() -> None:
    """`launches="short"` writes only the short rows' outputs, `"long"` only the others'
    (dense rows left out as with both): together what one call with both launches writes, so
    a caller can run them on two streams; another value is refused."""
    gen = torch.Generator().manual_seed(6)
    q_lens, prefixes = [40, 1, 3, 64], [5, 30, 20, 0]
    kv_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    k, v, table = _paged_setup(kv_lens, 16, 2, 64, torch.float32, gen)
    q = _randn(sum(q_lens), 4, 64, gen=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=DEVICE)
    kv = torch.tensor(kv_lens, device=DEVICE)

    def run(launches: str) -> torch.Tensor:
        return prefill_attention(
            q, k, v, cu, kv, table, 64, 16, 0.125, None, short_q_len=8, dense_min_len=48,
            out=torch.full_like(q, 7.0), launches=launches,
        )  # fmt: skip

    both, short, long = run("both"), run("short"), run("long")
    short_rows = slice(40, 44)  # the 1- and 3-token rows
    assert (short[:40] == 7.0).all() and (short[44:] == 7.0).all()
    assert torch.equal(short[short_rows], both[short_rows])
    assert (long[short_rows] == 7.0).all() and (long[-64:] == 7.0).all()  # short, dense
    assert torch.equal(long[:40], both[:40])
    with pytest.raises(ValueError, match="launches"):
        run("all")


def test_dense_rows_only_whole_long_prompts() -> None:
    """Dense rows: no cached prefix, at least the bound's query tokens, at most DENSE_MAX_ROWS
    of them in a step (else none: each is launches of its own); the rows they read past the
    step's tokens, padded."""
    from tokenmill.attention.backend import AttentionInputs
    from tokenmill.attention.dense_rows import (
        DENSE_MAX_ROWS,
        DenseRow,
        plan_dense_rows,
        spare_rows,
    )

    def plan(rows: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        q_lens, kv_lens = [q for q, _ in rows], [q + p for q, p in rows]
        none = torch.zeros(0)
        inputs = AttentionInputs(q_lens, kv_lens, none, none, none, none)
        return [tuple(row) for row in plan_dense_rows(inputs, 1024)]

    rows = [(1, 500), (1030, 0), (1023, 0), (2048, 1), (4096, 0), (1100, 0)]
    planned = plan(rows)
    assert planned == [(1, 1030, 1152), (4102, 4096, 4096), (8198, 1100, 1152)]
    assert spare_rows([DenseRow(*row) for row in planned], 9298) == 52
    assert spare_rows([DenseRow(*row) for row in planned[:2]], 9298) == 0
    assert len(plan([(1024, 0)] * DENSE_MAX_ROWS)) == DENSE_MAX_ROWS
    assert plan([(1024, 0)] * (DENSE_MAX_ROWS + 1)) == []


def test_prebuilt_dense_graphs_have_a_steps_shapes_and_strides(llama_dir, monkeypatch) -> None:
    """`prebuild` builds cuDNN's graph for a dense length ahead (its key: the shapes and
    strides of q, k and v): the same as a step's rows attended at that length; the lengths are
    every padded length up to the bound; a backend without dense rows builds nothing."""
    from tokenmill.attention import dense_rows, triton_backend
    from tokenmill.attention.dense_rows import DenseRow, dense_attend

    hq, hkv, d = 8, 2, 64
    gen = torch.Generator().manual_seed(1)
    backend, *_ = _dense_test_backend(llama_dir, [16], 16, torch.float32, gen)
    if DEVICE != "cuda":
        assert backend.prebuild_lengths(8192) == []
    monkeypatch.setattr(triton_backend, "dense_supported", lambda *_: True)
    backend = triton_backend.TritonAttentionBackend(backend.model, backend.kv_cache, 4)
    expected = [*range(2048, 4096, 256), *range(4096, 8193, 512)]
    assert backend.prebuild_lengths(8192) == expected
    assert backend.prebuild_lengths(3000) == list(range(2048, 3073, 256))
    keys = []

    def recorded(q, k, v, scale):  # type: ignore[no-untyped-def]
        keys.append([(x.shape, x.stride()) for x in (q, k, v)])
        return _dense_causal_reference(q, k, v, scale)

    monkeypatch.setattr(dense_rows, "_dense_causal", recorded)
    backend.prebuild(72)
    # a step: a 70-token row attended at 72 after 30 other tokens, K/V in a spare-row buffer
    fresh = torch.zeros(2, 104, hkv, d, device=DEVICE)
    q = torch.zeros(110, hq, d, device=DEVICE)[:100]
    dense_attend([DenseRow(30, 70, 72)], q, fresh[0], fresh[1], torch.empty_like(q), d**-0.5)
    assert keys[0] == keys[1]
    # cuDNN refusing a build turns the dense rows off (a warning), never fails the start
    monkeypatch.setattr(dense_rows, "_dense_causal", _refuse)
    backend.prebuild(80)
    assert backend.prebuild_lengths(8192) == []


def test_dense_lengths_are_few() -> None:
    """Rows are attended at 8 lengths per power of two (each new one is a cuDNN graph to
    build), at most 1/8 longer than the row."""
    from tokenmill.attention.dense_rows import dense_length

    lengths = {dense_length(n) for n in range(1024, 8193)}
    assert len(lengths) == 3 * 8 + 1
    assert all(n <= dense_length(n) <= n * 9 / 8 for n in range(1024, 8193))


def test_dense_rows_engine_matches_transformers(checkpoints, monkeypatch) -> None:
    """The whole engine with whole prompts of at least 16 tokens attended densely (cuDNN's
    kernel replaced by its definition, so that float32 on any device takes the path) beside
    chunked prompts and decode rows: greedy equals transformers'; and the GPU's start-up
    warm-up (rows of slot -1) runs through it."""
    from tests.conftest import hf_greedy
    from tokenmill import LLM, SamplingParams
    from tokenmill.attention import dense_rows, triton_backend
    from tokenmill.runner.model_runner import warm_up

    monkeypatch.setattr(triton_backend, "DENSE_MIN_Q_LEN", 16)
    monkeypatch.setattr(triton_backend, "dense_supported", lambda *_: True)
    monkeypatch.setattr(dense_rows, "_dense_causal", _dense_causal_reference)
    attended = []
    attend = triton_backend.dense_attend

    def recorded(rows, *args):
        attended.extend(row.n for row in rows)
        return attend(rows, *args)

    monkeypatch.setattr(triton_backend, "dense_attend", recorded)
    path = checkpoints["llama"]
    # (the second waits a step rather than split, `Scheduler.whole_prompt_min_tokens`, while
    # the next two fill the step; the last, longer than a step's budget, is split: its first
    # chunk, 24 tokens beside the second prompt, has no prefix, its later ones do)
    prompts = [
        list(range(3, 40)), list(range(20, 57)), [100, 200, 300], list(range(60, 80)),
        list(range(100, 170)),
    ]  # fmt: skip
    llm = LLM(
        str(path), device=DEVICE, dtype="float32", attention_backend="triton", page_size=4,
        max_num_batched_tokens=64,
    )  # fmt: skip
    runner = llm.engine.runner
    assert llm.engine.scheduler.whole_prompt_min_tokens == 16
    attended.clear()  # (the engine's own start-up warm-up, on a GPU)
    # the GPU's start-up warm-up (slot -1: it writes no K/V), run here on any device
    warm_up(runner.model, runner.attention, runner.page_size, [[20, 1]], runner.device)
    assert set(attended) == {20}  # each layer
    attended.clear()
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, 8) for p in prompts]
    # both 37-token prompts whole (the second waited), the 20, the 70's first chunk
    assert set(attended) == {37, 20, 24}
    assert attended.count(37) == 2 * runner.model_config.num_layers  # both whole


def test_dense_rows_refused_inside_a_step_keep_greedy(checkpoints, monkeypatch) -> None:
    """cuDNN refusing a dense row after the step's first layer attended densely: that layer's
    rows stand, the step's later layers and every step after attend through the Triton kernel,
    and greedy still equals transformers'."""
    from tests.conftest import hf_greedy
    from tokenmill import LLM, SamplingParams
    from tokenmill.attention import dense_rows, triton_backend

    monkeypatch.setattr(triton_backend, "DENSE_MIN_Q_LEN", 16)
    monkeypatch.setattr(triton_backend, "dense_supported", lambda *_: True)
    calls: list[int] | None = None  # (None during the start-up: its warm-up and builds)

    def first_only(q, k, v, scale):  # type: ignore[no-untyped-def]
        if calls is not None:
            calls.append(q.shape[2])
            if len(calls) > 1:
                raise RuntimeError("cuDNN Frontend error: no valid engine configs")
        return _dense_causal_reference(q, k, v, scale)

    monkeypatch.setattr(dense_rows, "_dense_causal", first_only)
    path = checkpoints["llama"]
    llm = LLM(str(path), device=DEVICE, dtype="float32", attention_backend="triton", page_size=4)
    calls = []
    prompts = [list(range(3, 40)), [100, 200, 300]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, 8) for p in prompts]
    assert len(calls) == 2  # layer 0 dense, layer 1 refused; none after
    assert llm.engine.runner.attention.prebuild_lengths(64) == []
