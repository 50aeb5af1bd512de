"""The fused mixture-of-experts kernels against float64 references: routing + sort (one
program), the grouped gate/up and down GEMMs, the small-batch GEMVs that route each token
themselves (and apply the layer's RMSNorm), and the whole `fused_moe`.

Without CUDA they run in Triton's interpreter in float32 (its bfloat16 `tl.dot` is wrong), with
small shapes; the GPU adds bfloat16 and a batch of 8,192 tokens.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from tokenmill.kernels.fused_moe import (  # noqa: E402
    GEMV_MAX_TOKENS,
    ROUTE_ALIGN_MAX_TOKENS,
    experts_gemv,
    fused_experts,
    fused_moe,
    route_and_align,
)
from tokenmill.kernels.gemv_config import InputNorm  # noqa: E402
from tokenmill.kernels.moe_routing import (  # noqa: E402
    MoeGemvConfig,
    MoeKernelConfig,
    SortedPairs,
    align_block_size,
    max_padded_pairs,
    moe_config_for,
    select_experts,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
SMALL = MoeKernelConfig(block_m=16, block_n=32, block_k=16)


def _experts_f64(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Token by token, slot by slot, in float64."""
    x, gate_up, down, weights = (t.double().cpu() for t in (x, gate_up, down, weights))
    inter = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t].tolist()):
            gate, up = gate_up[e, :inter] @ x[t], gate_up[e, inter:] @ x[t]
            out[t] += weights[t, slot] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any()
    err = (out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-12)
    assert err < TOL[dtype], f"relative error {err:.2e}"


def _problem(tokens: int, experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, generator=gen)).to(DEVICE, dtype)

    x = randn(tokens, hidden)
    gate_up = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    down = randn(experts, hidden, inter, scale=inter**-0.5)
    logits = randn(tokens, experts, scale=2.0).float()
    return x, gate_up, down, logits


def _check_sorted(pairs: SortedPairs, ids: torch.Tensor, num_experts: int) -> None:
    """Every pair appears once, in a block of its own expert, in pair order within the expert;
    padding fills the rest; unused blocks lie past `num_padded`."""
    flat = ids.reshape(-1).cpu().long()
    n = flat.numel()
    pair_ids = pairs.pair_ids.cpu().long()
    block_experts = pairs.block_experts.cpu().long()
    used = int(pairs.num_padded.item())
    assert pair_ids.numel() == max_padded_pairs(n, num_experts, pairs.block_m)
    assert used % pairs.block_m == 0 and used <= pair_ids.numel()
    real = pair_ids[pair_ids < n]
    assert sorted(real.tolist()) == list(range(n))
    assert (pair_ids[used:] == n).all()
    counts = torch.bincount(flat, minlength=num_experts)
    assert used == int(((counts + pairs.block_m - 1) // pairs.block_m * pairs.block_m).sum())
    for row in range(used):
        if pair_ids[row] < n:
            assert flat[pair_ids[row]] == block_experts[row // pairs.block_m]
    for e in range(num_experts):
        rows = [p for p in pair_ids.tolist() if p < n and flat[p] == e]
        assert rows == sorted(rows)


@pytest.mark.parametrize("num_experts", [4, 8, 60])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_align_block_size_groups_pairs_by_expert(num_experts: int, top_k: int, tokens: int):
    gen = torch.Generator().manual_seed(tokens * num_experts + top_k)
    # Few distinct experts chosen: most experts get no pairs.
    ids = torch.stack(
        [torch.randperm(min(num_experts, 2 * top_k), generator=gen)[:top_k] for _ in range(tokens)]
    ).to(DEVICE, torch.int32)
    for block_m in (1, 4, 16):
        _check_sorted(align_block_size(ids, num_experts, block_m), ids, num_experts)


@pytest.mark.parametrize("num_experts", [8, 60, 128])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_and_align_kernel_equals_torch_routing(num_experts, top_k, renormalize) -> None:
    tokens = 21  # more than one step of the kernel's routing loop
    *_, logits = _problem(tokens, num_experts, 8, 8, torch.float32, seed=num_experts + top_k)
    weights, ids, pairs = route_and_align(logits, top_k, renormalize, block_m=16)
    ref_weights, ref_ids = select_experts(logits.double(), top_k, renormalize)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights.cpu(), ref_weights.float().cpu(), rtol=1e-5, atol=1e-7)
    _check_sorted(pairs, ids, num_experts)
    torch_pairs = align_block_size(ids, num_experts, 16)
    assert torch.equal(pairs.pair_ids, torch_pairs.pair_ids)
    used = int(pairs.num_padded.item()) // 16
    assert torch.equal(pairs.block_experts[:used], torch_pairs.block_experts[:used])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k"),
    [(1, 8, 1), (1, 8, 2), (1, 8, 8), (3, 4, 2), (19, 8, 2), (33, 16, 1), (40, 6, 3)],
)
def test_fused_experts_match_float64(dtype, tokens: int, num_experts: int, top_k: int) -> None:
    hidden, inter = 48, 40  # not multiples of the 16-wide tiles: masked edges
    x, gate_up, down, logits = _problem(tokens, num_experts, hidden, inter, dtype, seed=tokens)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    pairs = align_block_size(ids, num_experts, SMALL.block_m)
    out = fused_experts(x, gate_up, down, weights, pairs, SMALL)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    _close(out, _experts_f64(x, gate_up, down, weights, ids), dtype)


def _rms_norm_f64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double().cpu()
    return weight.double().cpu() * x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


# Tiles that leave a partial step of both reductions (80 = 2 x 32 + 16, 40 = 2 x 16 + 8).
SMALL_GEMV = MoeGemvConfig(8, 32, down_block_k=16, down_block_n=8)
# Rows per program not dividing the intermediate (40) or the hidden size (80).
ODD_GEMV = MoeGemvConfig(16, 32, down_block_n=32, down_block_k=16, down_num_warps=2)


@pytest.mark.parametrize("config", [SMALL_GEMV, ODD_GEMV], ids=["small", "odd"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k"),
    [(1, 8, 1), (GEMV_MAX_TOKENS, 8, 2), (3, 12, 3), (1, 16, 8), (1, 128, 8), (2, 3, 3)],
)
def test_small_batch_gemv_experts_route_and_match_float64(
    dtype, tokens, num_experts, top_k, config
) -> None:
    """Routing inside the kernels (softmax, top-k, renormalisation) and the experts, against
    torch's routing and float64 products; 128 experts as qwen3-30b-a3b, 3 of 3 (every expert
    chosen; the expert and slot vectors padded to 4)."""
    hidden, inter = 80, 40
    x, gate_up, down, logits = _problem(tokens, num_experts, hidden, inter, dtype, seed=top_k)
    renormalize = top_k > 1
    out = experts_gemv(x, gate_up, down, logits, top_k, renormalize, config)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    weights, ids = select_experts(logits.double(), top_k, renormalize)
    _close(out, _experts_f64(x, gate_up, down, weights, ids), dtype)


@pytest.mark.parametrize("config", [SMALL_GEMV, ODD_GEMV], ids=["small", "odd"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (3, 2), (1, 8)])
def test_small_batch_gemv_experts_apply_the_rms_norm(
    dtype, tokens: int, top_k: int, config: MoeGemvConfig
) -> None:
    """With `norm`, x is the RMSNorm's input: the gate/up kernel norms it as it loads it."""
    hidden, inter = 80, 40
    x, gate_up, down, logits = _problem(tokens, 16, hidden, inter, dtype, seed=tokens)
    gen = torch.Generator().manual_seed(top_k)
    norm_w = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    x = 3.0 * x + 0.5  # a scale far from 1: a missing norm shows
    norm = InputNorm(norm_w, 1e-6, None)
    out = experts_gemv(x, gate_up, down, logits, top_k, True, config, norm)
    weights, ids = select_experts(logits.double(), top_k, True)
    normed = _rms_norm_f64(x, norm_w, 1e-6)
    _close(out, _experts_f64(normed, gate_up, down, weights, ids), dtype)
    with pytest.raises(ValueError, match="residual"):
        experts_gemv(x, gate_up, down, logits, top_k, True, SMALL_GEMV, InputNorm(norm_w, 1e-6, x))


@pytest.mark.parametrize("config", [SMALL_GEMV, ODD_GEMV], ids=["small", "odd"])
@pytest.mark.parametrize("top_k", [1, 2, 3, 8])
def test_small_batch_gemv_ties_pick_the_lowest_expert_ids(
    top_k: int, config: MoeGemvConfig
) -> None:
    """Equal router logits: the lowest expert ids win (as `select_experts`' topk), with equal
    weights; every other expert's weights are NaN, so reading one would show."""
    experts, hidden, inter = 16, 48, 22  # partial column blocks and reduction steps
    x, gate_up, down, _ = _problem(2, experts, hidden, inter, torch.float32, seed=4)
    logits = torch.zeros(2, experts, device=DEVICE)
    logits[1, 8:] = 1.0  # the second token: experts 8.. tie above the rest
    for start in (top_k, 8 + top_k):
        gate_up[start : start + 8 - top_k] = float("nan")
        down[start : start + 8 - top_k] = float("nan")
    out = experts_gemv(x, gate_up, down, logits, top_k, False, config)
    first = torch.arange(top_k)
    ids = torch.stack([first, first + 8]).to(torch.int32)
    weights = torch.softmax(logits.double().cpu(), dim=-1).gather(1, ids.long())
    _close(out, _experts_f64(x, gate_up, down, weights, ids), torch.float32)


def test_small_batch_gemv_experts_of_no_tokens() -> None:
    x, gate_up, down, logits = _problem(0, 8, 16, 16, torch.float32, seed=0)
    assert experts_gemv(x, gate_up, down, logits, 2, True, SMALL_GEMV).shape == (0, 16)


def test_experts_without_tokens_are_skipped() -> None:
    """Every token picks experts 5 and 2 of 8: six experts stay empty (and their weights,
    here NaN, are never read)."""
    x, gate_up, down, _ = _problem(9, 8, 32, 32, torch.float32, seed=3)
    for e in (0, 1, 3, 4, 6, 7):
        gate_up[e] = float("nan")
        down[e] = float("nan")
    ids = torch.tensor([[5, 2]] * 9, dtype=torch.int32, device=DEVICE)
    weights = torch.full((9, 2), 0.5, device=DEVICE)
    pairs = align_block_size(ids, 8, SMALL.block_m)
    assert int(pairs.num_padded.item()) == 2 * SMALL.block_m
    out = fused_experts(x, gate_up, down, weights, pairs, SMALL)
    _close(out, _experts_f64(x, gate_up, down, weights, ids), torch.float32)


def test_fused_experts_of_no_tokens() -> None:
    x, gate_up, down, logits = _problem(0, 4, 16, 16, torch.float32, seed=0)
    weights, ids = select_experts(logits, 2, renormalize=False)
    out = fused_experts(x, gate_up, down, weights, align_block_size(ids, 4, 16), SMALL)
    assert out.shape == (0, 16)


def test_fused_experts_rejects_pairs_sorted_for_other_blocks() -> None:
    x, gate_up, down, logits = _problem(2, 4, 16, 16, torch.float32, seed=0)
    weights, ids = select_experts(logits, 2, renormalize=False)
    with pytest.raises(ValueError, match="block_m"):
        fused_experts(x, gate_up, down, weights, align_block_size(ids, 4, 32), SMALL)


@pytest.mark.parametrize(("renormalize", "with_norm"), [(False, False), (True, True)])
@pytest.mark.parametrize("tokens", [GEMV_MAX_TOKENS, 11])
def test_fused_moe_routes_and_runs_experts(renormalize: bool, with_norm: bool, tokens: int):
    """A decode-sized batch takes the GEMV kernels, a larger one the grouped GEMMs; either
    applies an RMSNorm to x first when given one."""
    x, gate_up, down, logits = _problem(tokens, 8, 32, 16, torch.float32, seed=5)
    config = None if tokens <= GEMV_MAX_TOKENS else SMALL
    norm_w = torch.linspace(0.5, 1.5, 32, device=DEVICE)
    norm = InputNorm(norm_w, 1e-5, None) if with_norm else None
    out = fused_moe(x, gate_up, down, logits, 2, renormalize, config, norm=norm)
    weights, ids = select_experts(logits.double(), 2, renormalize)
    h = _rms_norm_f64(x, norm_w, 1e-5) if with_norm else x
    _close(out, _experts_f64(h, gate_up, down, weights, ids), torch.float32)


def test_large_batch_routes_with_torch_sort() -> None:
    """Past ROUTE_ALIGN_MAX_TOKENS the pairs are sorted by torch ops; same result."""
    tokens = ROUTE_ALIGN_MAX_TOKENS + 3
    x, gate_up, down, logits = _problem(tokens, 4, 16, 16, torch.float32, seed=7)
    out = fused_moe(x, gate_up, down, logits, 2, True, SMALL)
    weights, ids = select_experts(logits.double(), 2, True)
    _close(out, _experts_f64(x, gate_up, down, weights, ids), torch.float32)


@pytest.mark.skipif(DEVICE != "cuda", reason="8,192 tokens through the interpreter take minutes")
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_of_8192_tokens_with_table_configs(dtype: torch.dtype) -> None:
    tokens, experts, hidden, inter = 8192, 128, 256, 128
    x, gate_up, down, logits = _problem(tokens, experts, hidden, inter, dtype, seed=11)
    out = fused_moe(x, gate_up, down, logits, 8, True)  # the table's config for 8,192 tokens
    weights, ids = select_experts(logits.double(), 8, True)
    _close(out[:64], _experts_f64(x[:64], gate_up, down, weights[:64], ids[:64]), dtype)
    rows = torch.arange(0, tokens, 97)  # spot-check rows across the batch
    _close(out[rows], _experts_f64(x[rows], gate_up, down, weights[rows], ids[rows]), dtype)


def test_kernel_config_rejects_bad_tiles() -> None:
    with pytest.raises(ValueError, match="block_k must be a power of 2"):
        MoeGemvConfig(8, 100)
    with pytest.raises(ValueError, match="down_num_warps must be a power of 2"):
        MoeGemvConfig(8, 32, down_num_warps=3)
    with pytest.raises(ValueError, match="block_n must be a power of 2 >= 32"):
        MoeKernelConfig(16, 16, 16)
    with pytest.raises(ValueError, match="block_m must be a power of 2 >= 16"):
        MoeKernelConfig(24, 32, 16)


def test_config_table_covers_every_batch_size() -> None:
    sizes = [1, 8, 9, 200, 512, 513, 100_000]
    configs = [moe_config_for(n) for n in sizes]
    assert all(c.block_m in (16, 32, 64, 128) for c in configs)
    assert configs[0].block_m <= configs[-1].block_m
    # Float32 tiles fit in shared memory: at most 48 KiB per pipeline stage, 2 stages.
    for n in sizes:
        c = moe_config_for(n, torch.float32)
        stage = 4 * (c.block_m * c.block_k + c.block_k * c.block_n)
        assert stage * c.num_stages <= 2 * 48 * 1024
