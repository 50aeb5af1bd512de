"""The FlashInfer backend's plumbing, against a stand-in `flashinfer` module.

No machine here has FlashInfer (its wheels are too large to carry), so these tests install a
module that implements the two wrappers tokenmill uses with plain tensor ops, following
FlashInfer's documented contract: "NHD" caches `[num_pages, page_size, Hkv, D]`, CSR page lists
(`indptr`, `indices`, `last_page_len` in 1..page_size), queries that are the last tokens of their
sequence (causal masks aligned bottom-right), `window_left` keys to the left of each query, and
`sm_scale`. The engine on the stand-in must then produce transformers' greedy tokens; it runs in
float32 (which FlashInfer itself does not take) so that equality is exact.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from collections import Counter
from typing import ClassVar

import pytest
import torch

pytest.importorskip("triton")  # the backend stores K/V with the fused Triton kernel

from tokenmill import LLM, SamplingParams
from tokenmill.testing.checkpoints import build_checkpoint

# On a GPU machine the fused store kernel runs compiled, which needs CUDA tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [list(range(3, 10)), list(range(20, 57)), [100, 200, 300], list(range(20, 45))]


class _PagedWrapper:
    """`plan` stores the batch's page lists; `run` attends with plain tensor ops."""

    calls: ClassVar[Counter[str]] = Counter()

    def __init__(self, workspace: torch.Tensor, kv_layout: str) -> None:
        assert workspace.dtype == torch.uint8 and kv_layout == "NHD"

    def _plan(self, qo_indptr, indptr, indices, last_page_len, hq, hkv, d, page_size, *,
              causal, window_left, sm_scale, q_data_type, kv_data_type) -> None:  # fmt: skip
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert len(indptr) == len(last_page_len) + 1 == len(qo_indptr)
        assert ((last_page_len >= 1) & (last_page_len <= page_size)).all()
        self.dtype = q_data_type
        assert kv_data_type == self.dtype
        self.plan_args = (qo_indptr.tolist(), indptr.tolist(), indices.cpu(), last_page_len)
        self.shape = (hq, hkv, d, page_size)
        self.causal, self.window_left, self.sm_scale = causal, window_left, sm_scale

    def run(
        self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        qo_indptr, indptr, indices, last = self.plan_args
        hq, hkv, d, page_size = self.shape
        k_cache, v_cache = paged_kv_cache
        assert k_cache.shape[1:] == (page_size, hkv, d) and q.dtype == k_cache.dtype == self.dtype
        out = torch.empty_like(q)
        for b in range(len(last)):
            pages = indices[indptr[b] : indptr[b + 1]]
            kv_len = (len(pages) - 1) * page_size + int(last[b])
            k, v = (c[pages].reshape(-1, hkv, d)[:kv_len].float() for c in (k_cache, v_cache))
            qb = q[qo_indptr[b] : qo_indptr[b + 1]].float()
            self.calls["prefix" if kv_len > len(qb) and len(qb) > 1 else "plain"] += 1
            k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
            scores = torch.einsum("qhd,khd->hqk", qb, k) * self.sm_scale
            q_pos = torch.arange(kv_len - len(qb), kv_len, device=q.device)[:, None]
            k_pos = torch.arange(kv_len, device=q.device)[None, :]
            keep = k_pos <= q_pos if self.causal else torch.ones_like(k_pos <= q_pos)
            if self.window_left >= 0:
                keep &= k_pos >= q_pos - self.window_left
            probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
            out[qo_indptr[b] : qo_indptr[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(
                q.dtype
            )
        return out


class _Prefill(_PagedWrapper):
    def plan(self, qo_indptr, indptr, indices, last_page_len, hq, hkv, d, page_size, *,
             causal=False, window_left=-1, sm_scale, q_data_type, kv_data_type):  # fmt: skip
        self.calls["prefill_plan"] += 1
        self._plan(qo_indptr, indptr, indices, last_page_len, hq, hkv, d, page_size,
                   causal=causal, window_left=window_left, sm_scale=sm_scale,
                   q_data_type=q_data_type, kv_data_type=kv_data_type)  # fmt: skip


class _Decode(_PagedWrapper):
    def plan(self, indptr, indices, last_page_len, hq, hkv, d, page_size, *,
             window_left=-1, sm_scale, q_data_type, kv_data_type) -> None:  # fmt: skip
        self.calls["decode_plan"] += 1
        qo_indptr = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo_indptr, indptr, indices, last_page_len, hq, hkv, d, page_size,
                   causal=False, window_left=window_left, sm_scale=sm_scale,
                   q_data_type=q_data_type, kv_data_type=kv_data_type)  # fmt: skip


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    module.BatchPrefillWithPagedKVCacheWrapper = _Prefill
    module.BatchDecodeWithPagedKVCacheWrapper = _Decode
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.delitem(sys.modules, "tokenmill.attention.flashinfer_backend", raising=False)
    _PagedWrapper.calls = Counter()
    yield _PagedWrapper.calls
    sys.modules.pop("tokenmill.attention.flashinfer_backend", None)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral-window"])
def test_flashinfer_backend_matches_transformers(
    checkpoints, fake_flashinfer, monkeypatch, tmp_path, family: str
) -> None:
    """Chunked prefill, a prefix-cache hit and decode, eager (and a sliding window of 6 tokens,
    shorter than the prompts): transformers' greedy tokens."""
    from tests.conftest import hf_greedy

    backend_module = importlib.import_module("tokenmill.attention.flashinfer_backend")
    monkeypatch.setattr(backend_module, "SUPPORTED_DTYPES", (torch.float32,))
    if family == "mistral-window":
        path = build_checkpoint(tmp_path / family, "mistral", sliding_window=6)
    else:
        path = checkpoints[family]
    llm = LLM(
        str(path), device=DEVICE, dtype="float32", attention_backend="flashinfer", page_size=4,
        max_num_batched_tokens=16, enforce_eager=True,
    )  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, 10) for p in PROMPTS]
    assert outputs[3].num_cached_tokens > 0  # shares 24 tokens with the second prompt
    assert min(fake_flashinfer[k] for k in ("prefill_plan", "decode_plan", "prefix")) > 0


def test_flashinfer_backend_rejects_float32(checkpoints, fake_flashinfer) -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        LLM(str(checkpoints["llama"]), device=DEVICE, dtype="float32",
            attention_backend="flashinfer")  # fmt: skip


def test_flashinfer_backend_needs_the_package(checkpoints, monkeypatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flashinfer" else find_spec(name, *a),
    )
    with pytest.raises(ValueError, match="needs the 'flashinfer' package"):
        LLM(str(checkpoints["llama"]), device=DEVICE, dtype="bfloat16",
            attention_backend="flashinfer")  # fmt: skip
