"""Direct launches on the GPU: each specialisation compiled once by Triton, then launched by
its own launcher with the right results, for misaligned views, ints equal to 1 or multiples of
16, and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tokenmill.kernels.launch import direct_launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@direct_launch
@triton.jit
def _add_kernel(x_ptr, out_ptr, n, add, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + add, mask=mask)


def _add(x: torch.Tensor, add: int | float) -> torch.Tensor:
    out = torch.empty_like(x)
    _add_kernel[(triton.cdiv(x.numel(), 128),)](x, out, x.numel(), add, BLOCK=128, num_warps=4)
    return out


def test_direct_launches_match_tritons_for_every_specialisation(monkeypatch) -> None:
    if not _add_kernel._direct:
        pytest.skip("this Triton's launches are not direct (launch.DIRECT_TRITON)")
    base = torch.arange(4096, device="cuda", dtype=torch.float16)
    cases = [(0, 4096, 3), (1, 4095, 3), (16, 1024, 1), (3, 17, 1), (8, 32, 2.5), (5, 1, 16)]
    for offset, n, add in cases:  # the first launch of each: Triton's path, filling the cache
        x = base[offset : offset + n]
        torch.testing.assert_close(_add(x, add), x + add, rtol=0, atol=0)
    compiled = len(_add_kernel._cache)
    assert compiled >= 4  # aligned / not, n = 1, add = 1 (a constexpr to Triton), a float add

    def no_triton(*args, **kwargs):
        raise AssertionError("a cached specialisation went through Triton's launch")

    monkeypatch.setattr(_add_kernel.jit, "run", no_triton)
    for offset, n, add in reversed(cases):  # again, other order: all direct
        x = base[offset : offset + n]
        torch.testing.assert_close(_add(x, add), x + add, rtol=0, atol=0)
    assert len(_add_kernel._cache) == compiled


def test_direct_launch_in_a_cuda_graph() -> None:
    x = torch.arange(1000, device="cuda", dtype=torch.float16)
    _add(x, 7)  # compiled and cached before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _add(x, 7)
    x.fill_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 8))
