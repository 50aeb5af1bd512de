"""The batch-invariant building blocks on the CPU, each against an independent reference: the
fixed-tile product, pointwise functions at any size, and deterministic mode's whole forward
pass (greedy tokens equal transformers')."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.conftest import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.layers.invariant import POINTWISE_PIECE, invariant_linear, invariant_pointwise
from tokenmill.testing.checkpoints import build_checkpoint

ROW_COUNTS = (1, 2, 3, 7, 16, 17, 33, 100, 257)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_rows_do_not_depend_on_the_other_rows(dtype: torch.dtype) -> None:
    """Each row of a product of M rows is bitwise the row computed alone (float32 F.linear on
    MKL is not: its M=1 path differs from M=2 and both from larger M)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(300, 80, generator=gen).to(dtype)
    alone = torch.cat([invariant_linear(x[i : i + 1], weight, bias) for i in range(300)])
    for m in ROW_COUNTS:
        assert torch.equal(invariant_linear(x[:m], weight, bias), alone[:m]), m
    assert torch.equal(invariant_linear(x[5:90], weight, bias), alone[5:90])
    torch.testing.assert_close(alone.float(), F.linear(x.float(), weight.float(), bias.float()),
                               rtol=2e-2, atol=2e-2)  # fmt: skip


def test_invariant_linear_keeps_leading_dimensions() -> None:
    x, weight = torch.randn(2, 5, 8), torch.randn(3, 8)
    out = invariant_linear(x, weight)
    assert out.shape == (2, 5, 3)
    torch.testing.assert_close(out, F.linear(x, weight))


@pytest.mark.parametrize("fn", [torch.exp, F.silu, torch.sigmoid], ids=["exp", "silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_pointwise_value_does_not_depend_on_size_or_offset(fn, dtype) -> None:
    """An element's value is the same in tensors of any size, at any offset, and equals the
    function's vectorised result (a whole piece)."""
    x = torch.randn(3 * POINTWISE_PIECE + 123, generator=torch.Generator().manual_seed(1)) * 4
    x = x.to(dtype)
    vectorised = torch.cat([fn(p) for p in x[:POINTWISE_PIECE].split(POINTWISE_PIECE)])
    for start, length in ((0, 1), (0, 1001), (3, 17), (7, POINTWISE_PIECE - 7), (0, 40001)):
        part = invariant_pointwise(fn, x[start : start + length])
        whole = invariant_pointwise(fn, x)[start : start + length]
        assert torch.equal(part, whole), (start, length)
        end = min(start + length, POINTWISE_PIECE)
        assert torch.equal(part[: end - start], vectorised[start:end])
    two_d = x[: 4 * 33].view(4, 33)
    assert torch.equal(
        invariant_pointwise(fn, two_d), invariant_pointwise(fn, x)[: 4 * 33].view(4, 33)
    )
    # Every other element (a gate of interleaved gate/up columns): flattens without a copy, to
    # a whole number of pieces, so no padding makes it contiguous either.
    strided = x[: 2 * POINTWISE_PIECE].view(-1, 2)[:, 0]
    assert torch.equal(invariant_pointwise(fn, strided), invariant_pointwise(fn, strided.clone()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_swiglu_rows_do_not_depend_on_the_other_rows(dtype) -> None:
    """With interleaved gate/up rows, `silu(gate) * up` of each row is the row alone (512 rows:
    the gate flattens to whole pointwise pieces), and close to the plain product's SwiGLU."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(256, 64, generator=gen).to(dtype)
    interleaved = weight.view(2, 128, 64).transpose(0, 1).reshape(256, 64)
    x = torch.randn(600, 64, generator=gen).to(dtype)
    rows = [invariant_linear(x[i : i + 1], interleaved, swiglu=True) for i in range(600)]
    alone = torch.cat(rows)
    for m in (*ROW_COUNTS, 512):
        assert torch.equal(invariant_linear(x[:m], interleaved, swiglu=True), alone[:m]), m
    gate, up = F.linear(x.float(), weight.float()).chunk(2, dim=-1)
    torch.testing.assert_close(alone.float(), F.silu(gate) * up, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="no bias"):
        invariant_linear(x, interleaved, torch.zeros(256, dtype=dtype), swiglu=True)


@pytest.mark.parametrize(
    "family,overrides",
    [("llama", {}), ("qwen3", {}), ("qwen3_moe", {}), ("qwen2_moe", {}),
     ("mistral", {"sliding_window": 8})],
    ids=["llama", "qwen3", "qwen3_moe", "qwen2_moe", "mistral_window_8"],
)  # fmt: skip
def test_deterministic_mode_matches_transformers(
    family: str, overrides: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Greedy tokens of the deterministic forward pass (blocked attention, tiled products, fixed
    top-k sum) equal transformers' in float32, with prompts chunked, batched and decoded."""
    path = build_checkpoint(tmp_path_factory.mktemp("det") / family, family, **overrides)
    prompts = [list(range(40, 110)), [5, 6, 7], list(range(300, 340))]
    llm = LLM(str(path), device="cpu", deterministic=True, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [hf_greedy(path, p, 12) for p in prompts]
