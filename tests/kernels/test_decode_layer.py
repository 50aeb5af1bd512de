"""The one-launch decoder layer (`kernels/decode_layer.py`) against a float64 torch layer.

Off a GPU the stages launch one at a time (Triton's interpreter cannot open a grid barrier);
on a GPU the whole layer runs in one launch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels.decode_layer import (
    DecodeLayerKernel,
    DecodeLayerWeights,
    DecodeStep,
    LayerDims,
    set_layers_per_launch,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _reference(
    dims: LayerDims, w: DecodeLayerWeights, x: torch.Tensor, res: torch.Tensor | None,
    cached_k: torch.Tensor, cached_v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, new residual, the step's rotated keys, its values) in float64 for the M query
    tokens `x` `[M, H]` after the cached positions, each attending causally (`cos` / `sin`:
    the tokens' rotary rows `[M, D]`)."""
    d = dims
    f = {name: (t.double() if t is not None else None) for name, t in vars(w).items()}
    h1 = x.double() + (res.double() if res is not None else 0.0)
    qkv = _rms(h1, f["input_norm"], d.eps) @ f["qkv"].T
    if f["qkv_bias"] is not None:
        qkv = qkv + f["qkv_bias"]
    m, hq, hkv, hd = x.shape[0], d.num_heads, d.num_kv_heads, d.head_dim
    q = qkv[:, : hq * hd].view(m, hq, hd)
    k = qkv[:, hq * hd : (hq + hkv) * hd].view(m, hkv, hd)
    v = qkv[:, (hq + hkv) * hd :].view(m, hkv, hd)
    if f["q_norm"] is not None:
        q, k = _rms(q, f["q_norm"], d.eps), _rms(k, f["k_norm"], d.eps)
    rows = (cos.double()[:, None, :], sin.double()[:, None, :])
    q, k = _rope(q, *rows), _rope(k, *rows)
    keys = torch.cat((cached_k.double(), k), 0)  # [n + M, hkv, hd]
    values = torch.cat((cached_v.double(), v), 0)
    group, n = hq // hkv, cached_k.shape[0]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("thd,nhd->thn", q, keys) * hd**-0.5
    seen = torch.arange(n + m)[None, :] <= n + torch.arange(m)[:, None]  # causal
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    attn = torch.einsum("thn,nhd->thd", scores.softmax(-1), values).reshape(m, -1)
    h2 = attn @ f["o"].T + h1
    normed = _rms(h2, f["post_norm"], d.eps)
    if f["router"] is None:
        gate, up = (normed @ f["gate_up"].T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ f["down"].T, h2, k, v
    probs = (normed @ f["router"].T).softmax(-1)
    weights, ids = probs.topk(d.top_k, dim=-1)
    if d.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(h2)
    for t in range(m):
        for weight, e in zip(weights[t], ids[t].tolist(), strict=True):
            gate, up = (normed[t] @ f["gate_up"][e].T).chunk(2, dim=-1)
            out[t] += weight * ((torch.nn.functional.silu(gate) * up) @ f["down"][e].T)
    return out, h2, k, v


def _weights(
    dims: LayerDims, dtype: torch.dtype, bias: bool, qk_norm: bool, k_cache: torch.Tensor,
    v_cache: torch.Tensor, gen: torch.Generator,
) -> DecodeLayerWeights:  # fmt: skip
    d = dims
    nqkv = (d.num_heads + 2 * d.num_kv_heads) * d.head_dim

    def rand(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)

    def norm(n: int) -> torch.Tensor:
        return (1 + torch.randn(n, generator=gen) * 0.1).to(dtype).to(DEVICE)

    experts = (d.experts,) if d.experts else ()
    return DecodeLayerWeights(
        qkv=rand(nqkv, d.hidden), qkv_bias=rand(nqkv) if bias else None,
        o=rand(d.hidden, d.num_heads * d.head_dim),
        gate_up=rand(*experts, 2 * d.intermediate, d.hidden),
        down=rand(*experts, d.hidden, d.intermediate), input_norm=norm(d.hidden),
        post_norm=norm(d.hidden), q_norm=norm(d.head_dim) if qk_norm else None,
        k_norm=norm(d.head_dim) if qk_norm else None, k_cache=k_cache, v_cache=v_cache,
        router=rand(d.experts, d.hidden, scale=0.5) if d.experts else None,
    )  # fmt: skip


CASES = [
    # (hidden, heads, kv heads, head dim, intermediate, page, context, programs, bias, qk norm,
    #  split keys)
    (64, 4, 2, 16, 96, 4, 9, 5, False, True, 128),
    (64, 4, 4, 16, 80, 1, 1, 4, True, False, 128),
    (96, 6, 2, 32, 160, 16, 300, 8, False, False, 64),
    (64, 8, 2, 16, 128, 8, 500, 16, True, True, 128),  # splits of two key blocks
    (64, 8, 2, 16, 128, 8, 700, 6, False, True, 64),  # three splits of four blocks
]


# Triton's CPU interpreter computes bfloat16 `tl.dot` wrongly: bfloat16 on the GPU only.
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-1}  # (bf16: 3 layers of ~0.4% roundings)


def _paged_cache(
    ctx: int, page: int, hkv: int, hd: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(page table row, each position's slot, K/V cache of random values): the context in
    shuffled pages, and pages no position uses (garbage never read)."""
    n_pages = (ctx + page - 1) // page + 3
    perm = torch.randperm(n_pages, generator=gen)
    page_table = perm[None, : (ctx + page - 1) // page].to(torch.int32).to(DEVICE)
    positions = torch.arange(ctx)
    slots = perm[positions // page] * page + positions % page
    kv = torch.randn(2, n_pages * page, hkv, hd, generator=gen).to(dtype).to(DEVICE)
    return page_table, slots.to(DEVICE), kv


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}-ctx{c[6]}-p{c[7]}")
@pytest.mark.parametrize(("num_layers", "tokens"), [(1, 1), (3, 1), (2, 4)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_layers_match_float64(
    case: tuple, num_layers: int, tokens: int, dtype: torch.dtype
) -> None:
    """A chain of layers (the first without a residual) for one decoding token, or a verify
    step's 4 tokens (each attending causally). On a GPU also: the one launch (grid barriers)
    gives the bits of a launch a layer and of a launch a stage (kernel boundaries), on one
    program per SM."""
    hidden, hq, hkv, hd, inter, page, ctx, programs, bias, qk_norm, split_keys = case
    if DEVICE == "cuda":
        programs = torch.cuda.get_device_properties(0).multi_processor_count
    ctx = max(ctx, tokens)
    gen = torch.Generator().manual_seed(ctx + programs)
    dims = LayerDims(hidden, hq, hkv, hd, inter, 1e-6, page)
    page_table, slots, kv = _paged_cache(ctx, page, hkv, hd, dtype, gen)
    layers = [_weights(dims, dtype, bias, qk_norm, kv[0].clone(), kv[1].clone(), gen)
              for _ in range(num_layers)]  # fmt: skip
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    rope_pos = torch.arange(ctx + 4, dtype=torch.float32)[:, None]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.cat((rope_pos * inv, rope_pos * inv), -1)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    positions = torch.arange(ctx - tokens, ctx, device=DEVICE)
    step = DecodeStep(
        positions=positions, slots=slots[-tokens:],
        kv_lens=torch.tensor([ctx], dtype=torch.int32, device=DEVICE), page_table=page_table,
        cos=cos, sin=sin,
    )  # fmt: skip
    ref_x, ref_res, ref_kv = x, None, []
    for w in layers:
        cached = slots[:-tokens]
        ref_x, ref_res, k, v = _reference(
            dims, w, ref_x, ref_res, w.k_cache[cached], w.v_cache[cached], cos[positions],
            sin[positions],
        )  # fmt: skip
        ref_kv.append((k, v))
    kernel = DecodeLayerKernel(dims, layers, programs, split_keys=split_keys)
    out, new_res = kernel.run(x, step)
    tol = TOL[dtype]
    torch.testing.assert_close(new_res.double(), ref_res, rtol=tol, atol=tol)
    torch.testing.assert_close(out.double(), ref_x, rtol=tol, atol=tol)
    for w, (k, v) in zip(layers, ref_kv, strict=True):
        torch.testing.assert_close(w.k_cache[slots[-tokens:]].double(), k, rtol=tol, atol=tol)
        torch.testing.assert_close(w.v_cache[slots[-tokens:]].double(), v, rtol=tol, atol=tol)
    # again (the barrier words and scratch reused): the same bits
    first, first_res = out.clone(), new_res.clone()
    assert torch.equal(kernel.run(x, step)[0], first)
    if DEVICE == "cuda":
        set_layers_per_launch(1)
        try:
            by_layer = [t.clone() for t in kernel.run(x, step)]
        finally:
            set_layers_per_launch(None)
        by_stage = kernel.run(x, step, staged=True)
        for outputs in (by_layer, by_stage):
            assert torch.equal(outputs[0], first) and torch.equal(outputs[1], first_res)


def test_l2_prefetch_rule(monkeypatch) -> None:
    """The stage after next is pulled into L2 where the largest stage fits a third of it
    (Qwen3-0.6B's gate/up, 12.6 MB, on a 50 MB L2), not Llama-3.1-8B's (235 MB) unless forced,
    never for rows that are not whole 16-byte units nor before compute capability 9.0."""
    from types import SimpleNamespace

    from tokenmill.kernels import decode_layer

    capability = [(9, 0)]
    monkeypatch.setattr(decode_layer, "interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability[0])
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(L2_cache_size=50 << 20)
    )
    gpu = torch.device("cuda", 0)
    qwen = LayerDims(1024, 16, 8, 128, 3072, 1e-6, 16)
    llama = LayerDims(4096, 32, 8, 128, 14336, 1e-5, 16)
    odd = LayerDims(1028, 16, 8, 128, 3072, 1e-6, 16)
    assert decode_layer.l2_prefetch_fits(qwen, 2, gpu)
    assert not decode_layer.l2_prefetch_fits(llama, 2, gpu)
    assert decode_layer.l2_prefetch_fits(llama, 2, gpu, sized=False)  # (set_l2_prefetch(True))
    assert not decode_layer.l2_prefetch_fits(odd, 2, gpu, sized=False)
    assert not decode_layer.l2_prefetch_fits(qwen, 2, torch.device("cpu"))
    capability[0] = (8, 0)
    assert not decode_layer.l2_prefetch_fits(qwen, 2, gpu, sized=False)


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU tests compare the launch paths at full size")
@pytest.mark.parametrize(("ctx", "tokens"), [(9, 1), (300, 1), (300, 3)])
def test_one_launch_on_one_program_matches_the_stages(ctx: int, tokens: int) -> None:
    """In Triton's interpreter a grid barrier opens only for a grid of one program: on one,
    the one-launch path (the layer loop, each layer on the previous one's output and
    residual, the barrier's count and generation) gives the bits of a launch a stage."""
    from tokenmill.kernels.decode_layer import GENERATION

    gen = torch.Generator().manual_seed(ctx)
    dims = LayerDims(64, 2, 1, 16, 96, 1e-6, 4)
    page_table, slots, kv = _paged_cache(ctx, 4, 1, 16, torch.float32, gen)
    layers = [_weights(dims, torch.float32, True, True, kv[0].clone(), kv[1].clone(), gen)
              for _ in range(3)]  # fmt: skip
    x = torch.randn(tokens, 64, generator=gen)
    rope = torch.randn(ctx + 4, 16, generator=gen)
    step = DecodeStep(
        positions=torch.arange(ctx - tokens, ctx), slots=slots[-tokens:],
        kv_lens=torch.tensor([ctx], dtype=torch.int32), page_table=page_table,
        cos=rope.cos(), sin=rope.sin(),
    )  # fmt: skip
    kernel = DecodeLayerKernel(dims, layers, programs=1)
    staged = [t.clone() for t in kernel.run(x, step, staged=True)]
    one = kernel.run(x, step, staged=False)
    assert torch.equal(one[0], staged[0]) and torch.equal(one[1], staged[1])
    # five barriers a layer, none before the first layer's first stage: 14; count back at 0
    assert kernel.barrier[0] == 0 and kernel.barrier[GENERATION.value] == 14


@pytest.mark.parametrize(("experts", "top_k", "renormalize"), [(8, 2, True), (8, 2, False),
                                                               (16, 4, True)])  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe_layers_match_float64(
    experts: int, top_k: int, renormalize: bool, dtype: torch.dtype
) -> None:
    """Mixture-of-experts layers (Qwen3-MoE's: softmax router, top k, optionally renormalised)
    for one decoding token: a router stage, then each program routes the token itself and
    computes its share of the chosen experts' gate/up rows, then their down rows, summed."""
    programs = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 6
    ctx, page = 140, 8
    gen = torch.Generator().manual_seed(experts + top_k)
    dims = LayerDims(64, 4, 2, 16, 48, 1e-6, page, experts, top_k, renormalize)
    page_table, slots, kv = _paged_cache(ctx, page, 2, 16, dtype, gen)
    layers = [_weights(dims, dtype, False, True, kv[0].clone(), kv[1].clone(), gen)
              for _ in range(2)]  # fmt: skip
    x = torch.randn(1, 64, generator=gen).to(dtype).to(DEVICE)
    rope = torch.randn(ctx + 4, 16, generator=gen)
    cos, sin = rope.cos().to(DEVICE), rope.sin().to(DEVICE)
    positions = torch.tensor([ctx - 1], device=DEVICE)
    step = DecodeStep(
        positions=positions, slots=slots[-1:],
        kv_lens=torch.tensor([ctx], dtype=torch.int32, device=DEVICE), page_table=page_table,
        cos=cos, sin=sin,
    )  # fmt: skip
    ref_x, ref_res = x, None
    for w in layers:
        ref_x, ref_res, _, _ = _reference(
            dims, w, ref_x, ref_res, w.k_cache[slots[:-1]], w.v_cache[slots[:-1]],
            cos[positions], sin[positions],
        )  # fmt: skip
    kernel = DecodeLayerKernel(dims, layers, programs)
    out, new_res = kernel.run(x, step)
    tol = TOL[dtype]
    torch.testing.assert_close(new_res.double(), ref_res, rtol=tol, atol=tol)
    torch.testing.assert_close(out.double(), ref_x, rtol=tol, atol=tol)
    if DEVICE == "cuda":
        first, first_res = out.clone(), new_res.clone()
        staged = kernel.run(x, step, staged=True)
        assert torch.equal(staged[0], first) and torch.equal(staged[1], first_res)
